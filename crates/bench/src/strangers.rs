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
//! 2. **A connection flood on the memory server**: one thread opens
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

#[derive(Debug, Serialize)]
pub struct Report {
    pub opts: Opts,
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
    fn start(secret_file: &std::path::Path, dir: PathBuf) -> Result<Daemon> {
        let port = util::free_port()?;
        let http_port = util::free_port()?;
        let mut cmd = Command::new(util::sibling_binary("pagefleetd")?);
        pagefleet_lab::proc::die_with_parent(&mut cmd);
        let mut child = cmd
            .args(["--lend", "64MiB", "--listen", &format!("127.0.0.1:{port}")])
            .args(["--metrics", &format!("127.0.0.1:{http_port}"), "--log", "error"])
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

/// One stranger: its socket and when it sends its next byte.
struct Stranger {
    s: Option<TcpStream>,
    slow_body: bool,
    next: Instant,
}

impl Stranger {
    fn connect(&mut self, addr: &str, made: &mut u64) {
        self.s = TcpStream::connect(addr).ok().and_then(|mut s| {
            *made += 1;
            s.set_nonblocking(true).ok()?;
            let head: &[u8] = if self.slow_body {
                b"POST /guests HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n{"
            } else {
                b"POST /guests HTTP/1.1\r\nHost: x\r\n"
            };
            s.write_all(head).ok()?;
            Some(s)
        });
        self.next = Instant::now()
            + if self.slow_body {
                Duration::from_secs(5)
            } else {
                Duration::from_secs(4)
            };
    }
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
    let secret_file = dir.join("secret");
    std::fs::write(&secret_file, Secret::generate_hex())?;
    let secret = Secret::load(&secret_file)?;
    let d = Daemon::start(&secret_file, dir)?;
    let client = pagefleet_common::http::Client::new(secret.clone());
    // Warm up: the first requests grow the runtime's pools.
    for _ in 0..20 {
        let _: pagefleet_api::HostReport = client.get(&d.http, "/host")?;
    }
    std::thread::sleep(Duration::from_secs(1));
    let rss0 = d.rss();
    log(&format!(
        "phase 1: {} slow-body and {} slow-head strangers on the HTTP API for {} s; RSS {rss0:.1} MiB",
        o.strangers, o.strangers, o.secs
    ));
    let stop = Arc::new(AtomicBool::new(false));
    let strangers = {
        let (addr, stop, n) = (d.http.clone(), stop.clone(), o.strangers);
        std::thread::spawn(move || {
            let mut made = 0u64;
            let mut all: Vec<Stranger> = (0..2 * n)
                .map(|i| Stranger {
                    s: None,
                    slow_body: i % 2 == 0,
                    next: Instant::now(),
                })
                .collect();
            for x in all.iter_mut() {
                x.connect(&addr, &mut made);
            }
            while !stop.load(Relaxed) {
                let now = Instant::now();
                for x in all.iter_mut() {
                    // Dropped (or answered and closed): a read of 0 or an error.
                    let mut buf = [0u8; 512];
                    let gone = match x.s.as_mut() {
                        None => true,
                        Some(s) => match std::io::Read::read(s, &mut buf) {
                            Ok(0) => true,
                            Ok(_) => true, // answered (401): the server closes it
                            Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
                        },
                    };
                    if gone {
                        x.connect(&addr, &mut made);
                    } else if now >= x.next {
                        let _ = x.s.as_mut().map(|s| s.write_all(b" "));
                        x.next = now
                            + if x.slow_body {
                                Duration::from_secs(5)
                            } else {
                                Duration::from_secs(4)
                            };
                    }
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            made
        })
    };
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
    let made = strangers.join().map_err(|_| anyhow!("the strangers' thread panicked"))?;
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
        "  signed requests {ok}/{sent}, p50 {p50:.1} ms, p99 {p99:.1} ms; {made} stranger connections; RSS peak +{:.1} MiB, back in {back:.1} s",
        peak - rss0
    ));

    log(&format!(
        "phase 2: a connection flood on the memory server for {} s, sessions started during it",
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
    let flood = flooder.join().map_err(|_| anyhow!("the flood's thread panicked"))?;
    let flood_rate = flood as f64 / flood_start.elapsed().as_secs_f64();
    log(&format!(
        "  sessions {sessions_ok}/{sessions} during {flood} connections ({flood_rate:.0}/s)"
    ));
    if sessions == 0 || sent == 0 {
        bail!("no signed request or session was made");
    }
    let signed_share = ok as f64 / sent as f64;
    let session_share = sessions_ok as f64 / sessions as f64;
    let goals = vec![
        Goal::at_least("signed requests with strangers holding slots", signed_share, 0.99, "share"),
        Goal::at_most("signed request p99 with strangers", p99, 1000.0, "ms"),
        Goal::at_most("pagefleetd RSS growth with strangers", peak - rss0, 32.0, "MiB"),
        Goal::at_most("RSS back after the strangers left", back, 60.0, "s"),
        Goal::at_least("sessions started during a connect flood", session_share, 0.99, "share"),
    ];
    Ok(Report {
        opts: o.clone(),
        signed_requests: sent,
        signed_ok: ok,
        signed_p50_ms: p50,
        signed_p99_ms: p99,
        stranger_connections: made,
        rss_start_mib: rss0,
        rss_peak_growth_mib: peak - rss0,
        rss_return_secs: back,
        flood_connections: flood,
        flood_per_s: flood_rate,
        sessions,
        sessions_ok,
        goals,
    })
}

pub fn print_table(r: &Report, out: &mut dyn std::io::Write) -> std::io::Result<()> {
    writeln!(
        out,
        "strangers against a pagefleetd on loopback ({} s per phase)",
        r.opts.secs
    )?;
    writeln!(
        out,
        "  HTTP API, {} slow-body + {} slow-head strangers ({} connections): signed {}/{} ok, p50 {:.1} ms, p99 {:.1} ms",
        r.opts.strangers, r.opts.strangers, r.stranger_connections, r.signed_ok, r.signed_requests, r.signed_p50_ms, r.signed_p99_ms
    )?;
    writeln!(
        out,
        "  pagefleetd RSS {:.1} MiB, peak +{:.1} MiB, back within 4 MiB in {:.1} s",
        r.rss_start_mib, r.rss_peak_growth_mib, r.rss_return_secs
    )?;
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
