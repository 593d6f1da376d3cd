//! The floor under a split migration's transfer: the bytes a split sent to
//! each host (its report's `bytes_main` and `bytes_subs`), moved from a
//! memfd on the source host to a memfd on each destination host over the
//! lab's links, every destination at once, and nothing else: one TCP
//! stream per destination, sendfile(2) out of the source memfd (no copy
//! through user space), splice(2) into the destination memfd (one kernel
//! copy, as pagefleet's receiver does), one byte back when a destination
//! has it all. No framing, no plan, no dirty tracking, no rounds, no
//! device state, no second pass over changed pages. A receiver takes only
//! a connection that opens with the run's random token (anyone else in the
//! lab's namespace is dropped within [`TOKEN_TIMEOUT`]); the token is the
//! only bytes before the data.
//!
//! Run beside the guest under its load (the same CPUs, the same links), it
//! says how fast any split could move the guest here: a split slower than
//! the floor by more than its own work (rounds, sharing-aware hashing) has
//! waste to find; a target the floor misses is out of reach on this
//! machine.

use anyhow::{bail, Context, Result};
use pagefleet_common::sys::splice::{send_file, Splicer};
use pagefleet_testbed::Lab;
use serde::Serialize;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bytes the source writes at a time while it fills its memfd.
const FILL_CHUNK: usize = 1 << 20;
/// A destination that has not connected or finished after this long
/// fails the floor (a bound on every wait).
const IO_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a connection may take to show the run's token: anyone else
/// in the lab's namespace who connects first is dropped after this.
const TOKEN_TIMEOUT: Duration = Duration::from_secs(2);

/// One floor run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct FloorRun {
    /// Bytes moved, in all.
    pub bytes: u64,
    /// First byte sent to the last destination's "all here".
    pub secs: f64,
    /// CPU seconds of the source's sending threads.
    pub source_cpu_secs: f64,
    /// CPU seconds of the destinations' receiving threads.
    pub dest_cpu_secs: f64,
}

fn memfd(len: u64) -> Result<OwnedFd> {
    Ok(pagefleet_common::sys::mapping::memfd(
        c"split-floor",
        len,
        0,
    )?)
}

/// Move `shares[i].1` bytes from host `from` to host `shares[i].0`, all at
/// once, on TCP port `port` of each destination.
pub fn run(lab: &Lab, from: usize, shares: &[(usize, u64)], port: u16) -> Result<FloorRun> {
    let total: u64 = shares.iter().map(|s| s.1).sum();
    if total == 0 {
        bail!("the split floor: nothing to move");
    }
    // The source's memory: every byte written (no holes), distinct data.
    let src = Arc::new(memfd(total)?);
    {
        let f = std::fs::File::from(src.try_clone()?);
        let mut buf = vec![0u8; FILL_CHUNK];
        let mut at = 0u64;
        let mut w = std::io::BufWriter::new(&f);
        while at < total {
            let n = (total - at).min(FILL_CHUNK as u64) as usize;
            for (i, b) in buf[..n].iter_mut().enumerate() {
                *b = ((at as usize + i) * 31 % 251) as u8 | 1;
            }
            w.write_all(&buf[..n])
                .context("filling the floor's source memfd")?;
            at += n as u64;
        }
        w.flush()?;
    }
    // A connection is the sender's when it opens with this run's token
    // (a fresh random nonce, never on the wire before): a stranger who
    // connects first is dropped, and the receiver waits for the next.
    let token = pagefleet_proto::auth::random_nonce();
    // Receivers listen first.
    let mut receivers = Vec::new();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    for &(h, len) in shares {
        let ip = lab.hosts[h].ip.clone();
        let ready = ready_tx.clone();
        receivers.push(lab.spawn_in(h, move || -> Result<f64> {
            let l = TcpListener::bind((ip.as_str(), port))
                .with_context(|| format!("the split floor: listening on {ip}:{port}"))?;
            let _ = ready.send(());
            l.set_nonblocking(true)?;
            let t = Instant::now();
            let mut s = loop {
                if t.elapsed() > IO_TIMEOUT {
                    bail!("the split floor: the sender never connected to {ip}:{port}");
                }
                match l.accept() {
                    Ok((c, _)) => {
                        c.set_nonblocking(false)?;
                        c.set_read_timeout(Some(TOKEN_TIMEOUT))?;
                        let mut got = [0u8; 32];
                        if (&c).read_exact(&mut got).is_ok() && got == token {
                            break c;
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Err(e) => return Err(e.into()),
                }
            };
            s.set_read_timeout(Some(IO_TIMEOUT))?;
            let c0 = pagefleet_common::clock::thread_cpu_secs();
            let dst = memfd(len)?;
            let mut sp = Splicer::new()?;
            sp.into_file(&s, &dst, 0, len as usize)
                .with_context(|| format!("the split floor: receiving on {ip}"))?;
            s.write_all(&[1])?;
            Ok(pagefleet_common::clock::thread_cpu_secs() - c0)
        }));
    }
    drop(ready_tx);
    for _ in shares {
        ready_rx
            .recv_timeout(IO_TIMEOUT)
            .context("the split floor: a destination did not listen")?;
    }
    let t0 = Instant::now();
    let mut senders = Vec::new();
    let mut off = 0u64;
    for &(h, len) in shares {
        let ip = lab.hosts[h].ip.clone();
        let src = src.clone();
        let at = off;
        off += len;
        senders.push(lab.spawn_in(from, move || -> Result<(f64, f64)> {
            let mut s = TcpStream::connect((ip.as_str(), port))
                .with_context(|| format!("the split floor: connecting to {ip}:{port}"))?;
            s.set_read_timeout(Some(IO_TIMEOUT))?;
            s.write_all(&token)?;
            let c0 = pagefleet_common::clock::thread_cpu_secs();
            send_file(&*src, at, len as usize, &s)
                .with_context(|| format!("the split floor: sending to {ip}"))?;
            let cpu = pagefleet_common::clock::thread_cpu_secs() - c0;
            let mut ack = [0u8; 1];
            s.read_exact(&mut ack)
                .with_context(|| format!("the split floor: {ip} did not confirm"))?;
            Ok((cpu, t0.elapsed().as_secs_f64()))
        }));
    }
    let mut out = FloorRun {
        bytes: total,
        ..Default::default()
    };
    let mut first_err = None;
    for s in senders {
        match joined(s) {
            Ok((cpu, done)) => {
                out.source_cpu_secs += cpu;
                out.secs = out.secs.max(done);
            }
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    for r in receivers {
        match joined(r) {
            Ok(cpu) => out.dest_cpu_secs += cpu,
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

/// What a thread in a host's namespace returned, its errors as one.
fn joined<T>(h: std::thread::JoinHandle<pagefleet_testbed::Result<Result<T>>>) -> Result<T> {
    match h.join() {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => Err(anyhow::anyhow!("the split floor: entering a lab host: {e}")),
        Err(_) => bail!("the split floor: a thread panicked"),
    }
}
