//! Strangers against a pagefleetd on loopback, measured from the signed
//! clients' side.
//!
//! 1. **Slow strangers on the HTTP API**: `--strangers` (300) connections
//!    that send an unsigned head announcing a 1 MB body and then one body
//!    byte every 5 s, and as many whose head never ends (a byte every 4 s);
//!    each reconnects when dropped. Meanwhile one signed client sends
//!    `GET /host` in a loop: success rate and p99 latency. pagefleetd's RSS
//!    is sampled each second: its growth during the phase, and the seconds
//!    it takes to come back within 4 MiB of where it started once the
//!    strangers leave (at most 60 s are waited).
//! 2. **Stalled TLS handshakes on a `--tls-dir` host**: the same against
//!    a second pagefleetd with a TLS identity, whose strangers open TLS
//!    handshakes: `--strangers` send a real ClientHello one byte every 4 s,
//!    as many send it whole and then never answer the server's flight.
//! 3. **A connection flood on the memory server**: one thread opens
//!    connections as fast as it can (holding the newest 3 000), while
//!    sessions (connect, authenticate, ping) start one after another:
//!    the share of them that succeed, and the flood's rate.
//!
//! Every load loop is bounded by the phase's length.

use crate::util::{self, Goal};
use anyhow::{anyhow, bail, Context, Result};
use pagefleet_client::{Conn, ConnectOptions};
use pagefleet_proto::auth::Secret;
use serde::Serialize;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MIB: f64 = 1048576.0;

#[derive(Clone, Debug, Serialize)]
pub struct Opts {
    /// Slow-body strangers (and as many slow-head ones).
    pub strangers: usize,
    /// Length of each phase, s.
    pub secs: u64,
    #[serde(skip)]
    pub out_dir: PathBuf,
}

impl Opts {
    pub fn full(out_dir: PathBuf) -> Opts {
        Opts {
            strangers: 300,
            secs: 30,
            out_dir,
        }
    }
    pub fn quick(out_dir: PathBuf) -> Opts {
        Opts {
            strangers: 300,
            secs: 8,
            out_dir,
        }
    }
}

/// Signed clients beside slow strangers on one pagefleetd's HTTP API.
#[derive(Debug, Serialize)]
pub struct ApiPhase {
    /// Signed `GET /host` requests sent while the strangers were connected.
    pub signed_requests: u64,
    pub signed_ok: u64,
    pub signed_p50_ms: f64,
    pub signed_p99_ms: f64,
    /// Stranger connections made (reconnects included).
    pub stranger_connections: u64,
    pub rss_start_mib: f64,
    pub rss_peak_growth_mib: f64,
    /// Seconds until RSS was back within 4 MiB of the start after the
    /// strangers left (infinite if not within 60 s).
    pub rss_return_secs: f64,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub opts: Opts,
    /// Slow-body and slow-head strangers on a plain pagefleetd.
    #[serde(flatten)]
    pub api: ApiPhase,
    /// Stalled TLS handshakes on a pagefleetd with `--tls-dir`.
    pub tls: ApiPhase,
    /// Connections the flood opened, and per second.
    pub flood_connections: u64,
    pub flood_per_s: f64,
    pub sessions: u64,
    pub sessions_ok: u64,
    pub goals: Vec<Goal>,
}

/// A pagefleetd of its own on loopback, killed on drop.
struct Daemon {
    child: Child,
    memserver: String,
    http: String,
    _dir: PathBuf,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self._dir);
    }
}

impl Daemon {
    fn start(
        secret_file: &std::path::Path,
        dir: PathBuf,
        tls_dir: Option<&std::path::Path>,
    ) -> Result<Daemon> {
        let port = util::free_port()?;
        let http_port = util::free_port()?;
        let mut cmd = Command::new(util::sibling_binary("pagefleetd")?);
        pagefleet_lab::proc::die_with_parent(&mut cmd);
        if let Some(t) = tls_dir {
            cmd.arg("--tls-dir").arg(t);
        }
        let mut child = cmd
            .args(["--lend", "64MiB", "--listen", &format!("127.0.0.1:{port}")])
            .args([
                "--metrics",
                &format!("127.0.0.1:{http_port}"),
                "--log",
                "error",
            ])
            .arg("--secret-file")
            .arg(secret_file)
            .env_remove("PAGEFLEET_SECRET")
            .env_remove("PAGEFLEET_TLS_DIR")
            .stdout(Stdio::piped())
            .spawn()
            .context("cannot start pagefleetd")?;
        let mut lines = BufReader::new(child.stdout.take().expect("piped")).lines();
        let line = lines
            .next()
            .ok_or_else(|| anyhow!("pagefleetd exited before listening"))??;
        // Keep reading what it prints (its HTTP address, ...): a closed
        // pipe would end it with EPIPE on its next line.
        std::thread::spawn(move || lines.for_each(drop));
        let memserver = line
            .strip_prefix("listening ")
            .ok_or_else(|| anyhow!("unexpected pagefleetd output {line:?}"))?
            .to_string();
        let http = format!("127.0.0.1:{http_port}");
        util::wait_listening(&http, Duration::from_secs(10))?;
        Ok(Daemon {
            child,
            memserver,
            http,
            _dir: dir,
        })
    }
    fn rss(&self) -> f64 {
        pagefleet_lab::proc::rss_of(self.child.id()).unwrap_or(0) as f64 / MIB
    }
}

/// A directory removed when dropped.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What a stranger holds a connection with.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    /// An unsigned head announcing a 1 MB body, then a body byte every 5 s.
    SlowBody,
    /// A head that never ends: a byte every 4 s.
    SlowHead,
    /// A TLS ClientHello, one byte every 4 s.
    SlowHello,
    /// A whole ClientHello, then silence: the server's flight is never answered.
    StalledHello,
}

impl Kind {
    fn period(self) -> Duration {
        match self {
            Kind::SlowBody => Duration::from_secs(5),
            Kind::SlowHead | Kind::SlowHello => Duration::from_secs(4),
            // Never sends again (the phase ends long before).
            Kind::StalledHello => Duration::from_secs(3600),
        }
    }
    fn is_tls(self) -> bool {
        matches!(self, Kind::SlowHello | Kind::StalledHello)
    }
}

/// One stranger: its socket, how far it got and when it sends its next byte.
struct Stranger {
    s: Option<TcpStream>,
    kind: Kind,
    /// Bytes of the ClientHello sent (TLS kinds).
    sent: usize,
    next: Instant,
}

impl Stranger {
    fn connect(&mut self, addr: &str, hello: &[u8], made: &mut u64) {
        let first: &[u8] = match self.kind {
            Kind::SlowBody => b"POST /guests HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n{",
            Kind::SlowHead => b"POST /guests HTTP/1.1\r\nHost: x\r\n",
            Kind::SlowHello => &hello[..1],
            Kind::StalledHello => hello,
        };
        self.sent = first.len();
        self.s = TcpStream::connect(addr).ok().and_then(|mut s| {
            *made += 1;
            s.set_nonblocking(true).ok()?;
            s.write_all(first).ok()?;
            Some(s)
        });
        self.next = Instant::now() + self.kind.period();
    }

    /// Whether the server let go of it: end of stream or an error; for the
    /// HTTP kinds also an answer (a 401, after which the server closes).
    /// The server's handshake flight to a TLS stranger is read and dropped.
    fn gone(&mut self) -> bool {
        let Some(s) = self.s.as_mut() else {
            return true;
        };
        let mut buf = [0u8; 4096];
        match std::io::Read::read(s, &mut buf) {
            Ok(0) => true,
            Ok(_) => !self.kind.is_tls(),
            Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
        }
    }

    /// Its next byte, if it is time.
    fn tick(&mut self, now: Instant, hello: &[u8]) {
        if now < self.next {
            return;
        }
        let byte: &[u8] = match self.kind {
            Kind::SlowBody | Kind::SlowHead => b" ",
            Kind::SlowHello => hello.get(self.sent..self.sent + 1).unwrap_or_default(),
            Kind::StalledHello => &[],
        };
        if !byte.is_empty() {
            let _ = self.s.as_mut().map(|s| s.write_all(byte));
            self.sent += 1;
        }
        self.next = now + self.kind.period();
    }
}

/// Hold `n` strangers of each of `kinds` on `addr` until `stop`, each
/// reconnecting when dropped; the connections made.
fn hold_strangers(
    addr: String,
    kinds: &[Kind],
    n: usize,
    hello: Arc<Vec<u8>>,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<u64> {
    let kinds = kinds.to_vec();
    std::thread::spawn(move || {
        let mut made = 0u64;
        let mut all: Vec<Stranger> = (0..kinds.len() * n)
            .map(|i| Stranger {
                s: None,
                kind: kinds[i % kinds.len()],
                sent: 0,
                next: Instant::now(),
            })
            .collect();
        for x in all.iter_mut() {
            x.connect(&addr, &hello, &mut made);
        }
        while !stop.load(Relaxed) {
            let now = Instant::now();
            for x in all.iter_mut() {
                if x.gone() {
                    x.connect(&addr, &hello, &mut made);
                } else {
                    x.tick(now, &hello);
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        made
    })
}

/// A real ClientHello (rustls, as pagefleet's own clients send it), captured
/// on a loopback socket pair.
fn client_hello(id: &pagefleet_tls::Identity) -> Result<Vec<u8>> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    let c = TcpStream::connect(l.local_addr()?)?;
    let (mut server, _) = l.accept()?;
    c.set_nonblocking(true)?;
    let client = pagefleet_tls::Stream::tls_client(c, id, "127.0.0.1")?;
    // Sends the ClientHello; nothing answers, so it stops there.
    let _ = client.handshake_step();
    server.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut hello = Vec::new();
    let mut buf = [0u8; 4096];
    // A TLS record: type, version, length (2 bytes), then the body.
    while hello.len() < 5 || hello.len() < 5 + u16::from_be_bytes([hello[3], hello[4]]) as usize {
        let n = std::io::Read::read(&mut server, &mut buf).context("reading a ClientHello")?;
        if n == 0 {
            bail!("the TLS client closed before its ClientHello");
        }
        hello.extend_from_slice(&buf[..n]);
    }
    if hello[0] != 0x16 {
        bail!("not a TLS handshake record: {:?}", &hello[..5]);
    }
    Ok(hello)
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::INFINITY;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

pub fn run(o: &Opts, log: &mut dyn FnMut(&str)) -> Result<Report> {
    std::fs::create_dir_all(&o.out_dir)?;
    let dir = std::env::temp_dir().join(format!("pf-strangers-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    // Removed however the run ends (the secret and the TLS keys are in it).
    let _cleanup = RemoveOnDrop(dir.clone());
    let secret_file = dir.join("secret");
    std::fs::write(&secret_file, Secret::generate_hex())?;
    let secret = Secret::load(&secret_file)?;
    let tls_dirs = pagefleet_tls::certs::cluster(&dir.join("tls"), &["h1", "stranger"])?;
    let hello = Arc::new(client_hello(&pagefleet_tls::Identity::load(&tls_dirs[1])?)?);
    let d = Daemon::start(&secret_file, dir.join("plain"), None)?;
    let client = pagefleet_common::http::Client::new(secret.clone());
    log(&format!(
        "phase 1: {} slow-body and {} slow-head strangers on the HTTP API for {} s",
        o.strangers, o.strangers, o.secs
    ));
    let api = api_phase(
        &d,
        &client,
        &[Kind::SlowBody, Kind::SlowHead],
        o,
        &hello,
        log,
    )?;
    drop(d);
    let t = Daemon::start(&secret_file, dir.join("tls-host"), Some(&tls_dirs[0]))?;
    log(&format!(
        "phase 2: {} slow and {} stalled TLS handshakes on a --tls-dir host's HTTP API for {} s",
        o.strangers, o.strangers, o.secs
    ));
    let tls = api_phase(
        &t,
        &client,
        &[Kind::SlowHello, Kind::StalledHello],
        o,
        &hello,
        log,
    )?;
    drop(t);
    let d = Daemon::start(&secret_file, dir.join("flood"), None)?;
    log(&format!(
        "phase 3: a connection flood on the memory server for {} s, sessions started during it",
        o.secs
    ));
    let stop = Arc::new(AtomicBool::new(false));
    let flood_start = Instant::now();
    // Bounded by the phase: it is stopped after o.secs, and gives up by itself later.
    let flooder = util::connect_flood(
        d.memserver.clone(),
        stop.clone(),
        3000,
        Duration::from_secs(o.secs + 60),
        u64::MAX,
    );
    std::thread::sleep(Duration::from_millis(200));
    let (mut sessions, mut sessions_ok) = (0u64, 0u64);
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(o.secs) {
        sessions += 1;
        if Conn::connect(&d.memserver, &secret, &ConnectOptions::default())
            .and_then(|mut c| c.ping())
            .is_ok()
        {
            sessions_ok += 1;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    stop.store(true, Relaxed);
    let flood = flooder
        .join()
        .map_err(|_| anyhow!("the flood's thread panicked"))?;
    let flood_rate = flood as f64 / flood_start.elapsed().as_secs_f64();
    log(&format!(
        "  sessions {sessions_ok}/{sessions} during {flood} connections ({flood_rate:.0}/s)"
    ));
    if sessions == 0 || api.signed_requests == 0 || tls.signed_requests == 0 {
        bail!("no signed request or session was made");
    }
    let session_share = sessions_ok as f64 / sessions as f64;
    let mut goals = Vec::new();
    for (p, with) in [(&api, "slow strangers"), (&tls, "stalled TLS handshakes")] {
        goals.extend([
            Goal::at_least(
                &format!("signed requests with {with} holding slots"),
                p.signed_ok as f64 / p.signed_requests as f64,
                0.99,
                "share",
            ),
            Goal::at_most(
                &format!("signed request p99 with {with}"),
                p.signed_p99_ms,
                1000.0,
                "ms",
            ),
            Goal::at_most(
                &format!("pagefleetd RSS growth with {with}"),
                p.rss_peak_growth_mib,
                32.0,
                "MiB",
            ),
            Goal::at_most(
                &format!("RSS back after the {with} left"),
                p.rss_return_secs,
                60.0,
                "s",
            ),
        ]);
    }
    goals.push(Goal::at_least(
        "sessions started during a connect flood",
        session_share,
        0.99,
        "share",
    ));
    Ok(Report {
        opts: o.clone(),
        api,
        tls,
        flood_connections: flood,
        flood_per_s: flood_rate,
        sessions,
        sessions_ok,
        goals,
    })
}

/// Slow strangers of `kinds` on `d`'s HTTP API while `client` works: its
/// success and latency, and `d`'s memory during and after.
fn api_phase(
    d: &Daemon,
    client: &pagefleet_common::http::Client,
    kinds: &[Kind],
    o: &Opts,
    hello: &Arc<Vec<u8>>,
    log: &mut dyn FnMut(&str),
) -> Result<ApiPhase> {
    // Warm up: the first requests grow the runtime's pools.
    for _ in 0..20 {
        let _: pagefleet_api::HostReport = client.get(&d.http, "/host")?;
    }
    std::thread::sleep(Duration::from_secs(1));
    let rss0 = d.rss();
    let stop = Arc::new(AtomicBool::new(false));
    let strangers = hold_strangers(
        d.http.clone(),
        kinds,
        o.strangers,
        hello.clone(),
        stop.clone(),
    );
    let mut lat = Vec::new();
    let (mut sent, mut ok) = (0u64, 0u64);
    let mut peak = rss0;
    let t0 = Instant::now();
    let mut last_sample = Instant::now();
    while t0.elapsed() < Duration::from_secs(o.secs) {
        let t = Instant::now();
        sent += 1;
        let r: Result<pagefleet_api::HostReport, _> = client.get(&d.http, "/host");
        if r.is_ok() {
            ok += 1;
            lat.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        if last_sample.elapsed() >= Duration::from_secs(1) {
            peak = peak.max(d.rss());
            last_sample = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    peak = peak.max(d.rss());
    stop.store(true, Relaxed);
    let made = strangers
        .join()
        .map_err(|_| anyhow!("the strangers' thread panicked"))?;
    let t_left = Instant::now();
    let mut back = f64::INFINITY;
    while t_left.elapsed() < Duration::from_secs(60) {
        if d.rss() <= rss0 + 4.0 {
            back = t_left.elapsed().as_secs_f64();
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let p50 = percentile(&mut lat, 0.5);
    let p99 = percentile(&mut lat, 0.99);
    log(&format!(
        "  signed requests {ok}/{sent}, p50 {p50:.1} ms, p99 {p99:.1} ms; {made} stranger connections; RSS {rss0:.1} MiB, peak +{:.1} MiB, back in {back:.1} s",
        peak - rss0
    ));
    Ok(ApiPhase {
        signed_requests: sent,
        signed_ok: ok,
        signed_p50_ms: p50,
        signed_p99_ms: p99,
        stranger_connections: made,
        rss_start_mib: rss0,
        rss_peak_growth_mib: peak - rss0,
        rss_return_secs: back,
    })
}

pub fn print_table(r: &Report, out: &mut dyn std::io::Write) -> std::io::Result<()> {
    writeln!(
        out,
        "strangers against a pagefleetd on loopback ({} s per phase)",
        r.opts.secs
    )?;
    for (p, what) in [
        (
            &r.api,
            format!(
                "{} slow-body + {} slow-head strangers",
                r.opts.strangers, r.opts.strangers
            ),
        ),
        (
            &r.tls,
            format!(
                "{} slow + {} stalled TLS handshakes (--tls-dir)",
                r.opts.strangers, r.opts.strangers
            ),
        ),
    ] {
        writeln!(
            out,
            "  HTTP API, {what} ({} connections): signed {}/{} ok, p50 {:.1} ms, p99 {:.1} ms",
            p.stranger_connections,
            p.signed_ok,
            p.signed_requests,
            p.signed_p50_ms,
            p.signed_p99_ms
        )?;
        writeln!(
            out,
            "    pagefleetd RSS {:.1} MiB, peak +{:.1} MiB, back within 4 MiB in {:.1} s",
            p.rss_start_mib, p.rss_peak_growth_mib, p.rss_return_secs
        )?;
    }
    writeln!(
        out,
        "  memory server, connect flood of {} connections ({:.0}/s): sessions {}/{} ok",
        r.flood_connections, r.flood_per_s, r.sessions_ok, r.sessions
    )?;
    util::print_goals(&r.goals, out)
}

/// `pagefleet bench strangers`: signed clients beside strangers.
#[derive(clap::Args, Clone, Debug)]
pub struct Args {
    /// Slow-body strangers (as many slow-head ones join them).
    #[arg(long)]
    pub strangers: Option<usize>,
    /// Seconds per phase (default 30; --quick 8).
    #[arg(long)]
    pub secs: Option<u64>,
}

impl crate::Benchmark for Args {
    type Report = Report;
    fn run(&self, c: &crate::Common, log: &mut dyn FnMut(&str)) -> Result<Report> {
        let mut o = c.opts(Opts::quick, Opts::full);
        if let Some(n) = self.strangers {
            o.strangers = n.max(1);
        }
        if let Some(s) = self.secs {
            o.secs = s.max(1);
        }
        run(&o, log)
    }
    fn print(r: &Report, out: &mut dyn std::io::Write) -> std::io::Result<()> {
        print_table(r, out)
    }
}
