//! A memory server that hangs, measured from a replicated kv guest's
//! clients (issue 50's drill, `--runs` times in a row).
//!
//! Each run: three memory servers on loopback, `pagefleet run kv --replicas
//! 2 --budget 25%` over them, a value-checking memcached load (90% gets,
//! Zipf 0.99, 2000-byte values over half the guest's memory). Then:
//!
//! 1. one server is killed (SIGKILL); the run waits until re-replication
//!    left no page with a single copy, and measures the pre-fault rate
//!    (ops/s over 3 s);
//! 2. another is stopped (SIGSTOP: its connections stay open, nothing
//!    answers) for `--stop-secs`: the **recovery** is the time from the
//!    stop until the load's rate over a 0.5 s window is back to half the
//!    pre-fault rate (the whole stop if never);
//! 3. it is resumed (SIGCONT); the run waits until the guest revived it and
//!    every page has two copies again;
//! 4. the guest is stopped (SIGINT) and both live servers are asked what
//!    they hold: the **pages left behind**.
//!
//! The guest's resident pages are read from its `stats` (`pf_resident_pages`,
//! `pf_budget_pages`) every 100 ms from the kill to the end: the **peak over
//! the budget**. Wrong values are the load's own checks. Every figure of the
//! goals is the worst run's. Every wait is bounded.

use crate::util::{self, ChildDaemon, Goal, Stopped};
use anyhow::{anyhow, bail, Context, Result};
use pagefleet_client::{Conn, ConnectOptions};
use pagefleet_lab::kvload;
use pagefleet_proto::auth::Secret;
use serde::Serialize;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
/// How often the guest's counters and the load's ops are sampled.
const SAMPLE: Duration = Duration::from_millis(100);
/// The window the recovery's rate is measured over.
const WINDOW: f64 = 0.5;

#[derive(Clone, Debug, Serialize)]
pub struct Opts {
    pub runs: usize,
    /// How long the second server stays stopped, s.
    pub stop_secs: u64,
    pub guest_mib: u64,
    #[serde(skip)]
    pub out_dir: PathBuf,
}

impl Opts {
    pub fn full(out_dir: PathBuf) -> Opts {
        Opts {
            runs: 10,
            stop_secs: 90,
            guest_mib: 256,
            out_dir,
        }
    }
    pub fn quick(out_dir: PathBuf) -> Opts {
        Opts {
            runs: 1,
            stop_secs: 8,
            guest_mib: 64,
            out_dir,
        }
    }
}

/// One run's figures.
#[derive(Clone, Debug, Serialize)]
pub struct Run {
    /// Ops/s before any fault.
    pub baseline_ops: f64,
    /// Ops/s after the kill and re-replication, before the stop.
    pub pre_fault_ops: f64,
    /// Ops/s over the whole stop.
    pub during_stop_ops: f64,
    /// From the stop until a 0.5 s window ran at half the pre-fault rate, s.
    pub recovery_secs: f64,
    /// Highest resident / budget from the kill on.
    pub peak_resident_ratio: f64,
    /// Samples taken.
    pub samples: usize,
    /// From SIGCONT until the guest used the server again, s.
    pub revived_secs: f64,
    /// Pages of the guest on the live servers after it ended.
    pub pages_left: u64,
    pub wrong_values: u64,
    pub hedged_reads: u64,
    pub server_failures: u64,
    /// Every 0.5 s from the kill on: [s since the stop, ops/s over the
    /// last 0.5 s, resident / budget].
    pub timeline: Vec<[f64; 3]>,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub opts: Opts,
    pub runs: Vec<Run>,
    /// Runs that failed outright, with why.
    pub failed: Vec<String>,
    pub goals: Vec<Goal>,
    #[serde(flatten)]
    pub plot: util::PlotOutcome,
}

/// `pagefleet run kv` over `servers`, its stderr to `log`.
struct Guest {
    child: Child,
    addr: String,
}

impl Guest {
    fn start(o: &Opts, secret_path: &Path, servers: &[String], log: &Path) -> Result<Guest> {
        let me = std::env::current_exe()?;
        let mut child = Command::new(me)
            .arg("--secret-file")
            .arg(secret_path)
            .args(["run", "kv", "--listen", "127.0.0.1:0", "--duration", "0"])
            .args(["--size", &format!("{}MiB", o.guest_mib), "--budget", "25%"])
            .args(["--replicas", "2", "--servers", &servers.join(",")])
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(log)?)
            .spawn()
            .context("cannot start the kv guest")?;
        let mut out = BufReader::new(child.stdout.take().expect("piped"));
        let mut line = String::new();
        out.read_line(&mut line)?;
        // Its stdout is drained (a closed pipe would end it on a write).
        std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
        let addr = line
            .trim()
            .strip_prefix("kv listening ")
            .ok_or_else(|| anyhow!("the kv guest said {line:?} (its log: {})", log.display()))?
            .to_string();
        Ok(Guest { child, addr })
    }

    /// SIGINT, then wait for it to end (10 s; then SIGKILL).
    fn stop(mut self) -> Result<()> {
        let _ = pagefleet_common::sys::process::signal(self.child.id() as i32, libc::SIGINT);
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(10) {
            if self.child.try_wait()?.is_some() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!("the kv guest did not end within 10 s of SIGINT")
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One sample: seconds since the run's start, the load's ops so far, the
/// guest's counters.
#[derive(Clone, Default)]
struct Sample {
    t: f64,
    ops: u64,
    resident: u64,
    budget: u64,
    down: u64,
    degraded: u64,
    revived: u64,
    hedged: u64,
    failures: u64,
}

/// Samples the guest and the load every [`SAMPLE`] until told to stop.
struct Sampler {
    samples: Arc<Mutex<Vec<Sample>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Sampler {
    fn start(addr: String, counters: Arc<kvload::Counters>, t0: Instant) -> Sampler {
        let samples = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (s2, stop2) = (samples.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !stop2.load(Relaxed) {
                if let Ok(m) = kvload::stats(&addr) {
                    let g = |k: &str| m.get(k).copied().unwrap_or(0);
                    s2.lock().unwrap().push(Sample {
                        t: t0.elapsed().as_secs_f64(),
                        ops: counters.ops.load(Relaxed),
                        resident: g("pf_resident_pages"),
                        budget: g("pf_budget_pages"),
                        down: g("pf_servers_down"),
                        degraded: g("pf_degraded_pages"),
                        revived: g("pf_servers_revived"),
                        hedged: g("pf_hedged_reads"),
                        failures: g("pf_server_failures"),
                    });
                }
                std::thread::sleep(SAMPLE);
            }
        });
        Sampler {
            samples,
            stop,
            thread: Some(thread),
        }
    }

    fn last(&self) -> Sample {
        self.samples
            .lock()
            .unwrap()
            .last()
            .cloned()
            .unwrap_or_default()
    }

    /// Wait until the latest sample satisfies `f` (at most `secs`).
    fn wait(&self, what: &str, secs: u64, f: impl Fn(&Sample) -> bool) -> Result<f64> {
        let t = Instant::now();
        loop {
            if f(&self.last()) {
                return Ok(t.elapsed().as_secs_f64());
            }
            if t.elapsed() > Duration::from_secs(secs) {
                bail!(
                    "{what}: not within {secs} s (last sample: down {}, degraded {}, revived {})",
                    self.last().down,
                    self.last().degraded,
                    self.last().revived
                );
            }
            std::thread::sleep(SAMPLE);
        }
    }

    fn finish(mut self) -> Vec<Sample> {
        self.stop.store(true, Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        std::mem::take(&mut *self.samples.lock().unwrap())
    }
}

/// Ops/s of the load between `from` and `to` (seconds since the start).
fn rate(samples: &[Sample], from: f64, to: f64) -> f64 {
    let at = |t: f64| samples.iter().find(|s| s.t >= t).or(samples.last());
    match (at(from), at(to)) {
        (Some(a), Some(b)) if b.t > a.t => (b.ops - a.ops) as f64 / (b.t - a.t),
        _ => 0.0,
    }
}

fn one_run(o: &Opts, k: usize, log: &mut dyn FnMut(&str)) -> Result<Run> {
    let tmp = util::temp_dir("bench-hang")?;
    let secret_path = tmp.join("secret");
    std::fs::write(&secret_path, Secret::generate_hex())?;
    let secret = Secret::load(&secret_path)?;
    let size = o.guest_mib * MIB;
    let mut servers: Vec<ChildDaemon> = (0..3)
        .map(|_| ChildDaemon::start(size + 64 * MIB, &secret_path))
        .collect::<Result<_>>()?;
    let addrs: Vec<String> = servers.iter().map(|s| s.addr.clone()).collect();
    let guest_log = o.out_dir.join(format!("hang-run{}-guest.log", k + 1));
    let guest = Guest::start(o, &secret_path, &addrs, &guest_log)?;
    let spec = kvload::Spec {
        addr: guest.addr.clone(),
        keys: size / 2 / 2000,
        value_len: 2000,
        conns: 2,
        get_frac: 0.9,
        theta: 0.99,
        netns: None,
        reconnect: false,
        pace: None,
    };
    kvload::prefill(&spec)?;
    let load = kvload::Load::start(&spec);
    let t0 = Instant::now();
    let sampler = Sampler::start(guest.addr.clone(), load.counters.clone(), t0);
    std::thread::sleep(Duration::from_secs(5));
    let now = t0.elapsed().as_secs_f64();
    let baseline_ops = rate(&sampler.samples.lock().unwrap(), now - 4.0, now);
    // 1. A server killed; two copies restored on the other two.
    let t_kill = t0.elapsed().as_secs_f64();
    servers[0].kill();
    sampler.wait("the killed server seen down", 60, |s| s.down >= 1)?;
    sampler.wait("two copies restored after the kill", 180, |s| {
        s.down == 1 && s.degraded == 0
    })?;
    std::thread::sleep(Duration::from_secs(3));
    let now = t0.elapsed().as_secs_f64();
    let pre_fault_ops = rate(&sampler.samples.lock().unwrap(), now - 3.0, now);
    // 2. Another stopped.
    let t_stop = t0.elapsed().as_secs_f64();
    let stopped = Stopped::stop(servers[1].child.id());
    log(&format!(
        "run {}: pre-fault {pre_fault_ops:.0} ops/s; server 2 stopped for {} s",
        k + 1,
        o.stop_secs
    ));
    std::thread::sleep(Duration::from_secs(o.stop_secs));
    drop(stopped);
    let t_cont = t0.elapsed().as_secs_f64();
    // 3. Revived, two copies again.
    sampler.wait("the resumed server used again", 60, |s| s.revived >= 1)?;
    let revived_secs = t0.elapsed().as_secs_f64() - t_cont;
    sampler.wait("two copies restored after the revival", 180, |s| {
        s.degraded == 0 && s.down == 1
    })?;
    let samples = sampler.finish();
    let counters = load.counters.clone();
    if let Some(e) = load.error() {
        bail!("the kv load failed: {e}");
    }
    load.stop()?;
    let wrong_values = counters.bad_values.load(Relaxed);
    // 4. The guest ends; the live servers must hold nothing of it.
    let last = samples.last().cloned().unwrap_or_default();
    guest.stop()?;
    let mut pages_left = 0;
    for a in &addrs[1..] {
        let mut c = Conn::connect(a, &secret, &ConnectOptions::default())
            .with_context(|| format!("memory server {a} after the run"))?;
        pages_left += c.stat(false)?.used_pages;
    }
    // Recovery: the first 0.5 s window from the stop on at half the
    // pre-fault rate (never: the whole stop).
    let recovery_secs = samples
        .iter()
        .filter(|s| s.t >= t_stop + WINDOW && s.t <= t_cont)
        .find(|s| rate(&samples, s.t - WINDOW, s.t) >= 0.5 * pre_fault_ops)
        .map_or(o.stop_secs as f64, |s| s.t - t_stop);
    let from_kill: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.t >= t_kill && s.budget > 0)
        .collect();
    let peak_resident_ratio = from_kill
        .iter()
        .map(|s| s.resident as f64 / s.budget as f64)
        .fold(0.0, f64::max);
    let r = Run {
        baseline_ops,
        pre_fault_ops,
        during_stop_ops: rate(&samples, t_stop, t_cont),
        recovery_secs,
        peak_resident_ratio,
        samples: from_kill.len(),
        revived_secs,
        pages_left,
        wrong_values,
        hedged_reads: last.hedged,
        server_failures: last.failures,
        timeline: from_kill
            .iter()
            .step_by((WINDOW / SAMPLE.as_secs_f64()).round() as usize)
            .map(|s| {
                [
                    s.t - t_stop,
                    rate(&samples, s.t - WINDOW, s.t),
                    s.resident as f64 / s.budget as f64,
                ]
            })
            .collect(),
    };
    log(&format!(
        "run {}: back to half the rate {:.2} s after the stop ({:.0} ops/s during it); resident peak {:.3}x the budget ({} samples); revived {:.1} s after SIGCONT; {} pages left; {} wrong values; {} hedged reads",
        k + 1,
        r.recovery_secs,
        r.during_stop_ops,
        r.peak_resident_ratio,
        r.samples,
        r.revived_secs,
        r.pages_left,
        r.wrong_values,
        r.hedged_reads
    ));
    Ok(r)
}

pub fn run(o: &Opts, log: &mut dyn FnMut(&str)) -> Result<Report> {
    std::fs::create_dir_all(&o.out_dir)?;
    let mut runs = Vec::new();
    let mut failed = Vec::new();
    for k in 0..o.runs {
        match one_run(o, k, log) {
            Ok(r) => runs.push(r),
            Err(e) => {
                log(&format!("run {} FAILED: {e:#}", k + 1));
                failed.push(format!("run {}: {e:#}", k + 1));
            }
        }
    }
    // The worst run's figures; a run that failed fails every goal it
    // could not measure (no figure from it can read met).
    let none = !failed.is_empty() || runs.is_empty();
    let worst = |f: fn(&Run) -> f64| {
        if none {
            f64::INFINITY
        } else {
            runs.iter().map(f).fold(f64::NEG_INFINITY, f64::max)
        }
    };
    let goals = vec![
        Goal::at_least("runs completed", runs.len() as f64, o.runs as f64, "runs"),
        Goal::at_most(
            "recovery after the stop (worst run)",
            worst(|r| r.recovery_secs),
            2.0,
            "s",
        ),
        Goal::at_most(
            "resident over the budget at any sample (worst run)",
            (worst(|r| r.peak_resident_ratio) - 1.0) * 100.0,
            5.0,
            "%",
        ),
        Goal::at_most(
            "pages left on servers after the guest (worst run)",
            worst(|r| r.pages_left as f64),
            0.0,
            "pages",
        ),
        Goal::at_most(
            "wrong values (all runs)",
            if none {
                f64::INFINITY
            } else {
                runs.iter().map(|r| r.wrong_values as f64).sum()
            },
            0.0,
            "values",
        ),
    ];
    let mut r = Report {
        opts: o.clone(),
        runs,
        failed,
        goals,
        plot: util::PlotOutcome::default(),
    };
    util::save_with_plot(
        &mut r,
        |r| &mut r.plot,
        &o.out_dir,
        "hang",
        include_str!("../../../bench/plot_hang.py"),
    )?;
    Ok(r)
}

pub fn print_table(r: &Report, out: &mut dyn std::io::Write) -> std::io::Result<()> {
    writeln!(
        out,
        "a memory server stopped for {} s under a replicated kv guest ({} MiB, 25% budget, 3 servers, one killed first)",
        r.opts.stop_secs, r.opts.guest_mib
    )?;
    writeln!(
        out,
        "  {:>3} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>6} {:>6} {:>7}",
        "run",
        "base/s",
        "pre/s",
        "stop/s",
        "back s",
        "peak x",
        "revive s",
        "left",
        "wrong",
        "hedged"
    )?;
    for (i, x) in r.runs.iter().enumerate() {
        writeln!(
            out,
            "  {:>3} {:>9.0} {:>9.0} {:>9.0} {:>9.2} {:>8.3} {:>8.1} {:>6} {:>6} {:>7}",
            i + 1,
            x.baseline_ops,
            x.pre_fault_ops,
            x.during_stop_ops,
            x.recovery_secs,
            x.peak_resident_ratio,
            x.revived_secs,
            x.pages_left,
            x.wrong_values,
            x.hedged_reads
        )?;
    }
    for f in &r.failed {
        writeln!(out, "  FAILED {f}")?;
    }
    util::print_goals(&r.goals, out)?;
    r.plot.print(out)
}

/// `pagefleet bench hang`: a stopped memory server under a replicated guest.
#[derive(clap::Args, Clone, Debug)]
pub struct Args {
    /// Runs in a row (default 10; --quick 1).
    #[arg(long)]
    pub runs: Option<usize>,
    /// Seconds the second server stays stopped (default 90; --quick 8).
    #[arg(long)]
    pub stop_secs: Option<u64>,
    /// The kv guest's memory, MiB (default 256; --quick 64).
    #[arg(long)]
    pub guest_mib: Option<u64>,
}

impl crate::Benchmark for Args {
    type Report = Report;
    fn run(&self, c: &crate::Common, log: &mut dyn FnMut(&str)) -> Result<Report> {
        let mut o = c.opts(Opts::quick, Opts::full);
        if let Some(n) = self.runs {
            o.runs = n.max(1);
        }
        if let Some(s) = self.stop_secs {
            o.stop_secs = s.max(1);
        }
        if let Some(m) = self.guest_mib {
            o.guest_mib = m.max(16);
        }
        run(&o, log)
    }
    fn print(r: &Report, out: &mut dyn std::io::Write) -> std::io::Result<()> {
        print_table(r, out)
    }
}
