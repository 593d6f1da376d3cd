//! A memcached-protocol load generator for kv guests: prefill, then a
//! closed loop of zipf-distributed gets and sets over several connections,
//! with ops counted per 100 ms (throughput over time), every value checked
//! (its content is a function of its key), and — for guests that migrate —
//! reconnection when the server goes away (its service address moves).

use anyhow::{bail, Result};
use pagefleet_guests::synthetic::Zipf;
use pagefleet_guests::Rng;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub fn key(i: u64) -> String {
    format!("key:{i:010}")
}

/// Printable pseudo-random bytes the values are cut from (never \r or \n).
fn pool() -> &'static [u8] {
    static POOL: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        (0..POOL_LEN)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                b'a' + (x % 26) as u8
            })
            .collect()
    })
}
const POOL_LEN: usize = 256 * 1024;

/// Where key i's value starts in the pool.
fn pool_offset(i: u64, len: usize) -> usize {
    let span = POOL_LEN.saturating_sub(len).max(1);
    (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 24) as usize % span
}

/// The value stored under key i: its index in hex (so no two keys' values
/// are equal), then bytes cut from a pseudo-random pool at a key-dependent
/// offset. Cheap to make and check (a copy, a compare), so the load
/// generator does not take the CPU the guest under test needs; as hard to
/// compress as random letters.
pub fn value(i: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    let tag = format!("{i:016x}");
    v.extend_from_slice(&tag.as_bytes()[..len.min(16)]);
    let rest = len - v.len();
    let off = pool_offset(i, rest);
    let p = pool();
    while v.len() < len {
        let n = (len - v.len()).min(POOL_LEN - off);
        v.extend_from_slice(&p[off..off + n]);
    }
    v
}

/// Whether `got` is key i's value (see [`value`]), without building it.
pub fn is_value(i: u64, got: &[u8]) -> bool {
    let len = got.len();
    let tag = format!("{i:016x}");
    let t = len.min(16);
    if got[..t] != tag.as_bytes()[..t] {
        return false;
    }
    let rest = len - t;
    let off = pool_offset(i, rest);
    let p = pool();
    rest <= POOL_LEN - off && got[t..] == p[off..off + rest]
}

/// Client connections a kv load keeps busy by default. S-memV's memcached
/// figure comes from memaslap, which keeps 128 requests in flight (8 threads,
/// `--concurrency 128`): a throughput figure. With a handful of closed-loop
/// connections the guest's two vCPUs sit idle between requests and the
/// figure follows the hypervisor's wake-up latency (all-local runs 34 k or
/// 54 k ops/s with 4, from one second to the next), not paging. 16 keep the
/// guest busy on these 2-CPU hosts; `bench paging`, `bench migration` and the
/// demo all use it so their figures compare.
pub const CONNS: usize = 16;

#[derive(Clone, Debug)]
pub struct Spec {
    pub addr: String,
    pub keys: u64,
    pub value_len: usize,
    pub conns: usize,
    pub get_frac: f64,
    pub theta: f64,
    /// Enter this network namespace first (a lab host), if any.
    pub netns: Option<String>,
    /// Keep retrying a lost connection (a migrating guest) instead of failing.
    pub reconnect: bool,
    /// Operations per second per connection (None: a closed loop, as fast
    /// as it goes); operations over 100 ms behind schedule are dropped.
    pub pace: Option<f64>,
}

/// A connection to `addr` (retried for up to 60 s with `reconnect`); None
/// once `stop` is set (the run ended while the server was away: no error).
fn connect(addr: &str, reconnect: bool, stop: &AtomicBool) -> Result<Option<TcpStream>> {
    let t = Instant::now();
    loop {
        if stop.load(Relaxed) {
            return Ok(None);
        }
        match TcpStream::connect_timeout(&addr.parse()?, Duration::from_secs(1)) {
            Ok(s) => {
                s.set_nodelay(true)?;
                s.set_read_timeout(Some(Duration::from_secs(30)))?;
                return Ok(Some(s));
            }
            Err(_) if reconnect && t.elapsed() < Duration::from_secs(60) => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => bail!("kv at {addr}: {e}"),
        }
    }
}

/// Store every key once, 4 pipelined connections.
/// A kv guest's memcached `stats` at `addr`, as numbers (its `pf_*`
/// counters among them); a reply waits at most 5 s.
pub fn stats(addr: &str) -> Result<std::collections::HashMap<String, u64>> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(b"stats\r\n")?;
    let mut r = BufReader::new(s);
    let mut m = std::collections::HashMap::new();
    let mut line = String::new();
    loop {
        line.clear();
        if r.read_line(&mut line)? == 0 || line.starts_with("END") {
            break;
        }
        let p: Vec<&str> = line.split_whitespace().collect();
        if p.len() == 3 {
            m.insert(p[1].to_string(), p[2].parse().unwrap_or(0));
        }
    }
    Ok(m)
}

/// [`prefill`], tried again every 500 ms while the server does not take
/// it (a VM still booting), for up to `patience`; the last error names
/// the address and how long it was tried.
pub fn prefill_patiently(s: &Spec, patience: Duration) -> Result<()> {
    let t = Instant::now();
    loop {
        match prefill(s) {
            Ok(()) => return Ok(()),
            Err(e) if t.elapsed() >= patience => {
                return Err(e.context(format!(
                    "memcached at {} did not take the items within {} s",
                    s.addr,
                    patience.as_secs()
                )))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(500)),
        }
    }
}

pub fn prefill(s: &Spec) -> Result<()> {
    let stop = AtomicBool::new(false);
    std::thread::scope(|sc| -> Result<()> {
        let hs: Vec<_> = (0..4u64)
            .map(|t| {
                let stop = &stop;
                sc.spawn(move || -> Result<()> {
                    if let Some(ns) = &s.netns {
                        pagefleet_testbed::enter_netns(ns)?;
                    }
                    let Some(mut st) = connect(&s.addr, s.reconnect, stop)? else {
                        return Ok(());
                    };
                    let mut r = BufReader::new(st.try_clone()?);
                    let mut line = String::new();
                    let mut i = t;
                    while i < s.keys {
                        let mut batch = Vec::with_capacity(32 * (s.value_len + 64));
                        let mut n = 0;
                        while n < 32 && i < s.keys {
                            batch.extend_from_slice(
                                format!("set {} 0 0 {}\r\n", key(i), s.value_len).as_bytes(),
                            );
                            batch.extend_from_slice(&value(i, s.value_len));
                            batch.extend_from_slice(b"\r\n");
                            n += 1;
                            i += 4;
                        }
                        st.write_all(&batch)?;
                        for _ in 0..n {
                            line.clear();
                            r.read_line(&mut line)?;
                            if line != "STORED\r\n" {
                                bail!("prefill: {line:?}");
                            }
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        hs.into_iter().try_for_each(|h| h.join().unwrap())
    })
}

/// Counters of a running load.
#[derive(Default)]
pub struct Counters {
    pub ops: AtomicU64,
    pub reconnects: AtomicU64,
    /// Gets whose value was not the key's value, or that found nothing.
    pub bad_values: AtomicU64,
    pub misses: AtomicU64,
    /// Paced operations dropped because the client was over 100 ms behind
    /// its schedule (a request that would have timed out).
    pub dropped: AtomicU64,
    /// The longest operation since this was last reset (`swap(0)`), µs,
    /// including reconnecting: what a client waited at worst.
    pub max_op_us: AtomicU64,
}

/// A load running in the background.
pub struct Load {
    stop: Arc<AtomicBool>,
    pub counters: Arc<Counters>,
    threads: Vec<std::thread::JoinHandle<Result<()>>>,
    sampler: Option<std::thread::JoinHandle<Vec<f64>>>,
    pub start: Instant,
    first_error: Arc<Mutex<Option<String>>>,
}

/// Throughput over time: ops/s per 100 ms interval since the load started.
pub struct Timeline {
    pub interval: f64,
    pub ops_per_sec: Vec<f64>,
}

impl Load {
    pub fn start(s: &Spec) -> Load {
        Load::start_seeded(s, 0)
    }

    /// [`Load::start`] with the clients' key sequences drawn from `seed`
    /// (0: the same as `start`): loads started one after another on one
    /// guest do not replay the same keys.
    pub fn start_seeded(s: &Spec, seed: u64) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(Counters::default());
        let first_error = Arc::new(Mutex::new(None));
        let zipf = Arc::new(Zipf::new(s.keys, s.theta));
        let threads = (0..s.conns)
            .map(|t| {
                let (s, stop, c, zipf, fe) = (
                    s.clone(),
                    stop.clone(),
                    counters.clone(),
                    zipf.clone(),
                    first_error.clone(),
                );
                std::thread::spawn(move || {
                    let r = client(&s, t, seed, &stop, &c, &zipf);
                    if let Err(e) = &r {
                        fe.lock().unwrap().get_or_insert(format!("{e:#}"));
                    }
                    r
                })
            })
            .collect();
        let (stop2, c2) = (stop.clone(), counters.clone());
        let start = Instant::now();
        let sampler = std::thread::spawn(move || {
            let mut v = Vec::new();
            let mut last = 0;
            let mut k = 1;
            loop {
                let until = start + Duration::from_millis(100 * k);
                std::thread::sleep(until.saturating_duration_since(Instant::now()));
                // Only whole intervals: the one cut short by stop() is dropped.
                if stop2.load(Relaxed) {
                    break;
                }
                let n = c2.ops.load(Relaxed);
                v.push((n - last) as f64 * 10.0);
                last = n;
                k += 1;
            }
            v
        });
        Load {
            stop,
            counters,
            threads,
            sampler: Some(sampler),
            start,
            first_error,
        }
    }

    /// Seconds since the load started.
    pub fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    pub fn error(&self) -> Option<String> {
        self.first_error.lock().unwrap().clone()
    }

    pub fn stop(mut self) -> Result<Timeline> {
        self.stop.store(true, Relaxed);
        let tl = self.sampler.take().unwrap().join().unwrap_or_default();
        for t in std::mem::take(&mut self.threads) {
            t.join().unwrap_or_else(|_| bail!("load thread panicked"))?;
        }
        Ok(Timeline {
            interval: 0.1,
            ops_per_sec: tl,
        })
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
    }
}

/// read_line that treats end-of-stream as an error (the server went away).
fn read_line(r: &mut impl BufRead, line: &mut String) -> std::io::Result<()> {
    line.clear();
    if r.read_line(line)? == 0 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}

fn client(
    s: &Spec,
    t: usize,
    seed: u64,
    stop: &AtomicBool,
    c: &Counters,
    zipf: &Zipf,
) -> Result<()> {
    if let Some(ns) = &s.netns {
        pagefleet_testbed::enter_netns(ns)?;
    }
    let mut rng = Rng::new((77 + t as u64).wrapping_add(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)));
    let mut buf = vec![0u8; s.value_len + 2];
    let mut line = String::new();
    let start = Instant::now();
    let mut sent = 0u64;
    let mut op_start: Option<Instant> = None;
    'conn: while !stop.load(Relaxed) {
        let Some(mut st) = connect(&s.addr, s.reconnect, stop)? else {
            break;
        };
        let mut r = BufReader::with_capacity(16384, st.try_clone()?);
        while !stop.load(Relaxed) {
            if let Some(p) = s.pace {
                // Open loop on a schedule: operation n is due at n / pace.
                // Operations over 100 ms late are dropped, not caught up
                // later: a stalled server loses that work, as with a
                // client's timeout (so throughput shows the stall).
                let due_s = sent as f64 / p;
                let late = start.elapsed().as_secs_f64() - due_s;
                if late > 0.1 {
                    let skip = (late * p) as u64;
                    c.dropped.fetch_add(skip, Relaxed);
                    sent += skip;
                }
                let due = start + Duration::from_secs_f64(sent as f64 / p);
                std::thread::sleep(due.saturating_duration_since(Instant::now()));
                sent += 1;
            }
            let i = zipf.sample(rng.unit());
            let k = key(i);
            let t0 = op_start.unwrap_or_else(Instant::now);
            op_start = None;
            let res = (|| -> std::io::Result<()> {
                if rng.unit() < s.get_frac {
                    st.write_all(format!("get {k}\r\n").as_bytes())?;
                    read_line(&mut r, &mut line)?;
                    if line.starts_with("VALUE") {
                        r.read_exact(&mut buf)?;
                        if !is_value(i, &buf[..s.value_len]) {
                            c.bad_values.fetch_add(1, Relaxed);
                        }
                        read_line(&mut r, &mut line)?;
                    } else if line == "END\r\n" {
                        c.misses.fetch_add(1, Relaxed);
                    } else {
                        return Err(std::io::Error::other(format!("get: {line:?}")));
                    }
                } else {
                    let mut m = format!("set {k} 0 0 {}\r\n", s.value_len).into_bytes();
                    m.extend_from_slice(&value(i, s.value_len));
                    m.extend_from_slice(b"\r\n");
                    st.write_all(&m)?;
                    read_line(&mut r, &mut line)?;
                    if line != "STORED\r\n" {
                        return Err(std::io::Error::other(format!("set: {line:?}")));
                    }
                }
                Ok(())
            })();
            match res {
                Ok(()) => {
                    c.ops.fetch_add(1, Relaxed);
                    c.max_op_us
                        .fetch_max(t0.elapsed().as_micros() as u64, Relaxed);
                }
                Err(e) if s.reconnect && e.kind() != std::io::ErrorKind::Other => {
                    c.reconnects.fetch_add(1, Relaxed);
                    // The next operation's time counts from this one's start.
                    op_start = Some(t0);
                    continue 'conn;
                }
                Err(e) => bail!("kv client: {e}"),
            }
        }
    }
    Ok(())
}

/// A closed loop for `secs` seconds: (median ops/s over whole seconds, per-second ops/s).
pub fn run_for(s: &Spec, secs: u64) -> Result<(f64, Vec<f64>)> {
    let l = Load::start(s);
    let deadline = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < deadline && l.error().is_none() {
        std::thread::sleep(Duration::from_millis(50));
    }
    let c = l.counters.clone();
    let secs = l.now();
    let tl = l.stop()?;
    if c.bad_values.load(Relaxed) > 0 {
        bail!("{} gets returned a wrong value", c.bad_values.load(Relaxed));
    }
    let mut per: Vec<f64> = tl
        .ops_per_sec
        .chunks(10)
        .filter(|c| c.len() == 10)
        .map(|c| c.iter().sum::<f64>() / 10.0)
        .collect();
    if per.is_empty() {
        // Shorter than one whole second of samples: the overall rate.
        per.push(c.ops.load(Relaxed) as f64 / secs.max(1e-3));
    }
    Ok((crate::stats::median(&per), per))
}
