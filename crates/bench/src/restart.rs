//! An in-place restart (`pagefleet host restart`), measured where an
//! operator feels it: kv guests' clients. On a 3-host testbed h1 runs two
//! kv guests paging to h2 and lends pages to a third kv guest on h2; value-
//! checking loads from h3 run against all three while h1's pagefleetd is
//! restarted in place `restarts` times. Per restart: the longest single kv
//! operation of each guest's clients around it (what a client waited at
//! worst, reconnects included), the time until the new daemon answered,
//! and the new daemon's own figure from exec to serving. Over the whole
//! run: wrong values, lost keys, guests lost.
//!
//! A gap only means something if the guests were working through it: the
//! guest on h2 must fetch pages from h1 during each restart window (its
//! page-ins), and every guest must complete operations in it, or the
//! restart's gap reads as infinite.

use crate::util::{self, Goal, PlotOutcome};
use crate::{kvload, LabRun};
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

#[derive(Clone, Debug, Serialize)]
pub struct Opts {
    /// Each kv guest's memory, MiB (a quarter resident).
    pub guest_mib: u64,
    /// Restarts in the run.
    pub restarts: usize,
    #[serde(skip)]
    pub out_dir: PathBuf,
}

impl Opts {
    pub fn full(out_dir: PathBuf) -> Opts {
        Opts {
            guest_mib: 256,
            restarts: 5,
            out_dir,
        }
    }
    pub fn quick(out_dir: PathBuf) -> Opts {
        Opts {
            guest_mib: 64,
            restarts: 1,
            out_dir,
        }
    }
}

/// One restart.
#[derive(Clone, Debug, Serialize)]
pub struct Restart {
    /// From `pagefleet host restart` to the new daemon answering, s.
    pub answered_secs: f64,
    /// The new daemon's figure: from the old one's exec to serving again, s.
    pub exec_to_serving_secs: f64,
    /// Pages h1's memory server handed over.
    pub pages_kept: u64,
    /// Per guest (ip1, ip2 on h1; ip3 on h2 paging to h1): the longest
    /// single kv operation in the window, ms.
    pub longest_op_ms: Vec<f64>,
    /// Per guest: kv operations completed in the window.
    pub ops: Vec<u64>,
    /// Pages the guest on h2 brought in (from h1) in the window.
    pub lent_guest_page_ins: u64,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub opts: Opts,
    pub restarts: Vec<Restart>,
    /// Worst over every guest and restart, ms (infinite if a guest did no
    /// work in a window).
    pub worst_op_ms: f64,
    pub wrong_values: u64,
    pub lost_keys: u64,
    pub guests_lost: u64,
    /// Which, and how (empty when none was).
    pub lost: Vec<String>,
    pub goals: Vec<Goal>,
    pub plot: PlotOutcome,
}

const GUESTS: [(&str, &str, u8); 3] = [("ip1", "h1", 1), ("ip2", "h1", 2), ("ip3", "h2", 3)];

/// The seconds `restarted in place from … (X s since it handed over)`
/// says in h1's log, the `nth` such line.
fn exec_to_serving(l: &LabRun, nth: usize) -> Option<f64> {
    let log =
        std::fs::read_to_string(l.lab.dir.join(format!("{}.log", l.lab.hosts[0].netns))).ok()?;
    let line = log
        .lines()
        .filter(|l| l.contains("restarted in place from pagefleetd"))
        .nth(nth)?;
    let (_, rest) = line.split_once(" (")?;
    rest.split_whitespace().next()?.parse().ok()
}

pub fn run(o: &Opts, log: &mut dyn FnMut(&str)) -> Result<Report> {
    if !crate::is_root() {
        bail!("the restart benchmark runs a testbed: run it as root");
    }
    std::fs::create_dir_all(&o.out_dir)?;
    let bins = util::sibling_binary("pagefleetd")?
        .parent()
        .unwrap()
        .to_path_buf();
    let size = o.guest_mib * MIB;
    log("testbed: 3 hosts; h1 and h2 lend memory and run guests, h3 runs the clients");
    let l = LabRun::up(
        "brst",
        &bins,
        3,
        pagefleet_testbed::Link::Unshaped,
        2 * size + 64 * MIB,
        &[3 * size, 2 * size, 0],
    )?;
    let (h1, h2) = (l.lab.hosts[0].addr.clone(), l.lab.hosts[1].addr.clone());
    let mut loads = Vec::new();
    for (name, on, ip) in GUESTS {
        let server = if on == "h1" { &h2 } else { &h1 };
        let ip = l.lab.service_ip(ip);
        let svc = format!("{ip}:11211");
        let size_s = format!("{}MiB", o.guest_mib);
        let (ok, _, err) = l.pf(
            0,
            &[
                "guest",
                "start",
                name,
                "--on",
                on,
                "--size",
                &size_s,
                "--budget",
                "25%",
                "--",
                "kv",
                "--listen",
                &svc,
                "--service-ip",
                &ip,
                "--servers",
                server,
            ],
        );
        if !ok {
            bail!("guest start {name}: {err}");
        }
        // Values of 2000 bytes over half the guest's memory: most of it
        // remote, a skewed load touching remote pages now and then.
        let spec = kvload::Spec {
            addr: svc,
            keys: size / 2 / 2000,
            value_len: 2000,
            conns: 2,
            get_frac: 0.9,
            theta: 0.99,
            netns: Some(l.lab.hosts[2].netns.clone()),
            reconnect: true,
            pace: None,
        };
        log(&format!("{name} on {on}, paging to {server}: filling"));
        kvload::prefill(&spec)?;
        loads.push(kvload::Load::start(&spec));
    }
    let pids: Vec<u32> = GUESTS
        .iter()
        .map(|(n, _, _)| {
            l.guest(n)
                .map(|(_, g)| g.pid)
                .context("a guest is not running")
        })
        .collect::<Result<_>>()?;
    let page_ins = |l: &LabRun| l.guest("ip3").map(|(_, g)| g.page_ins).unwrap_or(0);
    std::thread::sleep(Duration::from_secs(3));
    let mut restarts = Vec::new();
    for k in 0..o.restarts {
        for ld in &loads {
            ld.counters.max_op_us.store(0, Relaxed);
        }
        let ops0: Vec<u64> = loads
            .iter()
            .map(|ld| ld.counters.ops.load(Relaxed))
            .collect();
        let in0 = page_ins(&l);
        let kept = l.host_report(0).map(|r| r.lend_used / 4096).unwrap_or(0);
        let t = Instant::now();
        let (ok, out, err) = l.pf(0, &["host", "restart", "h1"]);
        let answered_secs = t.elapsed().as_secs_f64();
        if !ok {
            bail!("pagefleet host restart h1: {out}{err}");
        }
        // The window: the restart and 2 s after it.
        std::thread::sleep(Duration::from_secs(2));
        let r = Restart {
            answered_secs,
            exec_to_serving_secs: exec_to_serving(&l, k).unwrap_or(f64::NAN),
            pages_kept: kept,
            longest_op_ms: loads
                .iter()
                .map(|ld| ld.counters.max_op_us.load(Relaxed) as f64 / 1e3)
                .collect(),
            ops: loads
                .iter()
                .zip(&ops0)
                .map(|(ld, o)| ld.counters.ops.load(Relaxed) - o)
                .collect(),
            lent_guest_page_ins: page_ins(&l).saturating_sub(in0),
        };
        log(&format!(
            "restart {}: answered in {:.2} s (exec to serving {:.3} s, {} pages kept); longest kv operation {:?} ms; ip3 brought {} pages in from h1",
            k + 1,
            r.answered_secs,
            r.exec_to_serving_secs,
            r.pages_kept,
            r.longest_op_ms,
            r.lent_guest_page_ins
        ));
        restarts.push(r);
        std::thread::sleep(Duration::from_secs(2));
    }
    // A guest is lost if it is not listed running with the runner it had
    // (asked a few times: one status call may fail on its own).
    let mut lost = Vec::new();
    for ((n, _, _), pid) in GUESTS.iter().zip(&pids) {
        let mut seen = None;
        for _ in 0..5 {
            seen = l.guest(n).map(|(_, g)| g);
            if seen.as_ref().is_some_and(|g| g.pid == *pid) {
                break;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        match seen {
            Some(g) if g.pid == *pid => {}
            Some(g) => lost.push(format!("{n}: now runner {} ({:?})", g.pid, g.state)),
            None => lost.push(format!(
                "{n}: not listed (runner {pid} {})",
                if std::path::Path::new(&format!("/proc/{pid}")).exists() {
                    "still running"
                } else {
                    "gone"
                }
            )),
        }
    }
    if !lost.is_empty() {
        log(&format!("guests lost: {}", lost.join("; ")));
    }
    let guests_lost = lost.len() as u64;
    let (mut wrong_values, mut lost_keys) = (0, 0);
    for ld in loads {
        let c = ld.counters.clone();
        if let Some(e) = ld.error() {
            bail!("a kv load failed: {e}");
        }
        ld.stop()?;
        wrong_values += c.bad_values.load(Relaxed);
        lost_keys += c.misses.load(Relaxed);
    }
    // A window where a guest did no work, or the guest on h2 never reached
    // h1, measured nothing: it counts as an infinite gap.
    let worst_op_ms = restarts
        .iter()
        .map(|r| {
            if r.ops.contains(&0) || r.lent_guest_page_ins == 0 {
                f64::INFINITY
            } else {
                r.longest_op_ms.iter().copied().fold(0.0, f64::max)
            }
        })
        .fold(0.0, f64::max);
    let mut r = Report {
        opts: o.clone(),
        restarts,
        worst_op_ms,
        wrong_values,
        lost_keys,
        guests_lost,
        lost,
        goals: vec![],
        plot: PlotOutcome::default(),
    };
    r.goals = vec![
        Goal::at_most(
            "longest kv operation through an in-place restart (worst guest, worst restart)",
            r.worst_op_ms,
            1000.0,
            "ms",
        ),
        Goal::at_most(
            "wrong values and lost keys",
            (r.wrong_values + r.lost_keys) as f64,
            0.0,
            "",
        ),
        Goal::at_most("guests lost", r.guests_lost as f64, 0.0, "guests"),
    ];
    util::save_with_plot(
        &mut r,
        |r| &mut r.plot,
        &o.out_dir,
        "restart",
        include_str!("../../../bench/plot_restart.py"),
    )?;
    Ok(r)
}

pub fn print_table(r: &Report, out: &mut dyn std::io::Write) -> std::io::Result<()> {
    writeln!(
        out,
        "in-place restart of h1's pagefleetd: kv guests of {} MiB (ip1, ip2 on h1 paging to h2; ip3 on h2 paging to h1), loads from h3",
        r.opts.guest_mib
    )?;
    writeln!(
        out,
        "  {:>3} {:>12} {:>14} {:>11} {:>30} {:>12}",
        "#",
        "answered s",
        "exec→serve s",
        "pages kept",
        "longest op ms ip1/ip2/ip3",
        "ip3 page-ins"
    )?;
    for (i, x) in r.restarts.iter().enumerate() {
        let ops: Vec<String> = x.longest_op_ms.iter().map(|v| format!("{v:.1}")).collect();
        writeln!(
            out,
            "  {:>3} {:>12.2} {:>14.3} {:>11} {:>30} {:>12}",
            i + 1,
            x.answered_secs,
            x.exec_to_serving_secs,
            x.pages_kept,
            ops.join(" / "),
            x.lent_guest_page_ins
        )?;
    }
    writeln!(
        out,
        "  wrong values {}, lost keys {}, guests lost {}",
        r.wrong_values, r.lost_keys, r.guests_lost
    )?;
    util::print_goals(&r.goals, out)?;
    r.plot.print(out)
}

/// `pagefleet bench restart`: kv guests' service through in-place restarts.
#[derive(clap::Args, Clone, Debug)]
pub struct Args {
    /// Restarts (default 5; --quick 1).
    #[arg(long)]
    pub restarts: Option<usize>,
    /// Each kv guest's memory, MiB (default 256; --quick 64).
    #[arg(long)]
    pub guest_mib: Option<u64>,
}

impl crate::Benchmark for Args {
    type Report = Report;
    fn run(&self, c: &crate::Common, log: &mut dyn FnMut(&str)) -> Result<Report> {
        let mut o = c.opts(Opts::quick, Opts::full);
        if let Some(n) = self.restarts {
            o.restarts = n.max(1);
        }
        if let Some(m) = self.guest_mib {
            o.guest_mib = m.max(32);
        }
        run(&o, log)
    }
    fn print(r: &Report, out: &mut dyn std::io::Write) -> std::io::Result<()> {
        print_table(r, out)
    }
}
