//! `pagefleet bench migration`: S-memV Figs. 8–12 at this machine's scale,
//! on the testbed (hosts in network namespaces, tbf-shaped links, one
//! pagefleetd each), driven with the `pagefleet` CLI inside a host.
//!
//! Destinations compared, as in the paper:
//! - `enough`: a host with memory for the whole guest;
//! - `split`: a main host with memory for half of it plus a sub-host;
//! - `swap`: the same host as `enough`, but the runner in a memory cgroup
//!   limited to half the guest, with swap on an SSD-like device (the
//!   virtual-memory baseline; see `util::SsdSwap`).
//!
//! Experiments: migration time and downtime (idle guest, guest rewriting
//! half its memory; 10 and 1 Gbit links), post-migration sort time (with
//! and without access history), kv throughput over time across the
//! migration (recovery time).

use crate::kvload;
use crate::util::{self, Goal, MemCgroup, PlotOutcome, SsdSwap};
use crate::LabRun;
use anyhow::{bail, Context, Result};
use pagefleet_api::Report as MigrationReport;
use pagefleet_testbed::Link;
use serde::Serialize;
use serde_json::json;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

#[derive(Clone, Debug)]
pub struct Opts {
    /// Guest size; the split main host has half of it.
    pub size: u64,
    pub links: Vec<Link>,
    /// Experiments to run: "time", "sort", "kv" (all when empty).
    pub only: Vec<String>,
    pub quick: bool,
    pub out_dir: PathBuf,
    /// kv: seconds of load before and after the migration.
    pub kv_before: u64,
    pub kv_after: u64,
    /// kv: rounds of the three destinations, interleaved; the goals take
    /// each destination's median (one recovery swung 0.4–5.3 s).
    pub kv_rounds: usize,
}

impl Opts {
    pub fn full(out_dir: PathBuf) -> Opts {
        Opts {
            size: 2 << 30,
            links: vec![Link::Gbit10, Link::Gbit1],
            only: vec![],
            quick: false,
            out_dir,
            kv_before: 6,
            kv_after: 15,
            kv_rounds: 3,
        }
    }
    pub fn quick(out_dir: PathBuf) -> Opts {
        Opts {
            size: 256 * MIB,
            links: vec![Link::Gbit10],
            quick: true,
            kv_before: 3,
            kv_after: 6,
            kv_rounds: 1,
            ..Opts::full(out_dir)
        }
    }
    fn runs(&self, what: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|o| o == what)
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct TimeRow {
    pub link: String,
    pub workload: String,
    pub dest: String,
    pub total_secs: f64,
    pub downtime_ms: f64,
    pub rounds: u64,
    pub pages_sent_twice: u64,
    pub round1_mb_per_s: f64,
    pub report: Option<MigrationReport>,
    /// Why this configuration has no figures (it failed; the others still ran).
    pub error: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct SortRow {
    pub dest: String,
    pub history: bool,
    pub sort_secs: f64,
    pub page_ins: u64,
    pub sorted: bool,
    pub migration_secs: f64,
    pub error: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct KvRow {
    pub dest: String,
    /// Which round (0-based) of the interleaved destinations.
    pub round: usize,
    /// ops/s per 100 ms since the load started.
    pub timeline: Vec<f64>,
    pub migrate_start: f64,
    pub migrate_end: f64,
    pub before_ops: f64,
    pub after_ops: f64,
    /// From the resume until throughput is back at 90% of before, held
    /// for 0.5 s on average ([`recovery`]; None: never).
    pub recovery_secs: Option<f64>,
    pub bad_values: u64,
    pub misses: u64,
    pub downtime_ms: f64,
    pub error: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub size_bytes: u64,
    pub quick: bool,
    pub time: Vec<TimeRow>,
    /// Round-1 link utilisation of the idle split migration, per link.
    pub link_utilisation: Vec<(String, f64)>,
    pub sort: Vec<SortRow>,
    pub kv: Vec<KvRow>,
    pub goals: Vec<Goal>,
    #[serde(flatten)]
    pub plot: PlotOutcome,
}

/// The destinations a guest is migrated to (time and kv experiments), in
/// this order.
const DESTS: [&str; 3] = ["enough", "split", "swap"];

type Log<'a> = &'a mut dyn FnMut(&str);

/// Hosts: h1 source, h2 `enough` (and `swap`), h3 split main, h4 sub-host, h5 client.
fn lab(o: &Opts, link: Link) -> Result<LabRun> {
    let bins = util::sibling_binary("pagefleetd")?
        .parent()
        .unwrap()
        .to_path_buf();
    let g = o.size + 64 * MIB;
    LabRun::up(
        "bmig",
        &bins,
        5,
        link,
        o.size + 64 * MIB,
        &[g, g, o.size / 2, 0, 0],
    )
}

pub(crate) fn pf_json(l: &LabRun, args: &[&str]) -> Result<MigrationReport> {
    let (ok, out, err) = l.pf(0, args);
    if !ok {
        bail!("pagefleet {}: {}", args.join(" "), err.trim());
    }
    serde_json::from_str(&out)
        .with_context(|| format!("pagefleet {}: not JSON: {out}", args.join(" ")))
}

pub(crate) fn pf_ok(l: &LabRun, args: &[&str]) -> Result<()> {
    let (ok, _, err) = l.pf(0, args);
    if !ok {
        bail!("pagefleet {}: {}", args.join(" "), err.trim());
    }
    Ok(())
}

pub(crate) fn wait_until(what: &str, secs: u64, mut f: impl FnMut() -> bool) -> Result<()> {
    let t = Instant::now();
    while !f() {
        if t.elapsed() > Duration::from_secs(secs) {
            bail!("timed out waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// Start guest `name` on h1: a prefilled `synthetic` of `size` bytes,
/// idle (`workload` "idle") or rewriting (any other): dirtying a quarter
/// of the link's rate, sequentially over half its memory (the paper
/// rewrote 6 of 12 GB).
pub(crate) fn start_synthetic(
    l: &LabRun,
    name: &str,
    size: u64,
    workload: &str,
    link: Link,
) -> Result<()> {
    let size = size.to_string();
    let rate = (link.bytes_per_sec().unwrap_or(1.25e9) * 0.25 / 4096.0).round();
    let rate_s = rate.to_string();
    let mut args = vec![
        "guest",
        "start",
        name,
        "--on",
        "h1",
        "--size",
        &size,
        "--",
        "synthetic",
        "--prefill",
        "--threads",
        "1",
    ];
    if workload == "idle" {
        args.extend_from_slice(&["--rate", "0"]);
    } else {
        args.extend_from_slice(&[
            "--dist",
            "seq",
            "--write-frac",
            "1",
            "--span",
            "0.5",
            "--rate",
            &rate_s,
        ]);
    }
    pf_ok(l, &args)
}

/// Wait until the guest is ready: all `pages` written (or a sort job ready).
pub(crate) fn wait_filled(l: &LabRun, name: &str, pages: u64) -> Result<()> {
    wait_until(&format!("{name} to fill its memory"), 600, || {
        l.guest(name)
            .is_some_and(|(_, g)| g.ready && g.pages.as_ref().map_or(0, |p| p.local) + 32 >= pages)
    })
}

pub(crate) fn stop_guest(l: &LabRun, name: &str) -> Result<()> {
    pf_ok(l, &["guest", "stop", name])?;
    wait_until(&format!("{name} to stop"), 30, || l.guest(name).is_none())
}

/// The swap baseline's destination limits: a memory cgroup of half the
/// guest (what the split main host keeps resident, plus a little for the
/// runner's own heap and tables) and swap of the guest's size on an
/// SSD-like device (78 µs + 2 GB/s per request; a swap file on this VM's
/// virtual disk would be served from the hypervisor's cache at near RAM
/// speed, flattering swap).
struct SwapDest {
    _swap: SsdSwap,
    cg: MemCgroup,
}

fn swap_dest(o: &Opts) -> Result<SwapDest> {
    let swap = SsdSwap::new(o.size + 128 * MIB)?;
    let cg = MemCgroup::new(o.size / 2 + 8 * MIB)?;
    Ok(SwapDest { _swap: swap, cg })
}

/// Migrate `name` to the destination kind; the report.
fn migrate_to(
    l: &LabRun,
    o: &Opts,
    name: &str,
    dest: &str,
    extra: &[&str],
) -> Result<(MigrationReport, Option<SwapDest>)> {
    let mut args = vec!["migrate", name, "--json"];
    args.extend_from_slice(extra);
    let sd;
    let cg_path;
    match dest {
        "enough" => args.extend_from_slice(&["--to", "h2"]),
        "split" | "split-nohist" => args.extend_from_slice(&["--to", "h3", "--sub", "h4"]),
        "swap" => {
            sd = Some(swap_dest(o)?);
            cg_path = sd.as_ref().unwrap().cg.path.display().to_string();
            args.extend_from_slice(&["--to", "h2", "--dest-cgroup", &cg_path]);
            let r = pf_json(l, &args)?;
            return Ok((r, sd));
        }
        d => bail!("unknown destination {d}"),
    }
    Ok((pf_json(l, &args)?, None))
}

fn time_experiment(
    o: &Opts,
    link: Link,
    log: Log<'_>,
    rows: &mut Vec<TimeRow>,
    util_rows: &mut Vec<(String, f64)>,
) -> Result<()> {
    let l = lab(o, link)?;
    let pages = o.size / 4096;
    for workload in ["idle", "rewrite"] {
        for dest in DESTS {
            log(&format!(
                "{}: {workload} guest of {} -> {dest}",
                link.name(),
                crate::fmt_bytes(o.size)
            ));
            start_synthetic(&l, "m1", o.size, workload, link)?;
            wait_filled(&l, "m1", pages)?;
            // Let the access history settle (a few sampling sweeps).
            std::thread::sleep(Duration::from_secs(if o.quick { 1 } else { 3 }));
            let (r, err, sd) = match migrate_to(&l, o, "m1", dest, &[]) {
                Ok((r, sd)) => (Some(r), None, sd),
                Err(e) => {
                    log(&format!("  FAILED: {e:#}"));
                    (None, Some(format!("{e:#}")), None)
                }
            };
            stop_guest(&l, "m1")?;
            drop(sd);
            let r1 = r
                .as_ref()
                .map_or(0.0, |r| r.round1_bytes as f64 / r.round1_secs.max(1e-9));
            if workload == "idle" && dest == "split" {
                if let Some(bps) = link.bytes_per_sec() {
                    util_rows.push((link.name().to_string(), r1 / bps));
                }
            }
            rows.push(TimeRow {
                link: link.name().into(),
                workload: workload.into(),
                dest: dest.into(),
                total_secs: r.as_ref().map_or(f64::NAN, |r| r.total_secs),
                downtime_ms: r.as_ref().map_or(f64::NAN, |r| r.downtime_ms),
                rounds: r.as_ref().map_or(0, |r| r.rounds as u64),
                pages_sent_twice: r.as_ref().map_or(0, |r| r.pages_sent_twice),
                round1_mb_per_s: r1 / 1e6,
                report: r,
                error: err,
            });
        }
    }
    Ok(())
}

fn sort_experiment(o: &Opts, log: Log<'_>, rows: &mut Vec<SortRow>) -> Result<()> {
    let l = lab(o, Link::Gbit10)?;
    let pages = o.size / 4096;
    let size = o.size.to_string();
    for (dest, history) in [
        ("enough", true),
        ("split", true),
        ("split-nohist", false),
        ("swap", true),
    ] {
        log(&format!(
            "sort: {} guest, 40% of it records -> {dest}{}",
            crate::fmt_bytes(o.size),
            if history {
                ""
            } else {
                " (no history of the sort)"
            }
        ));
        let mut args = vec![
            "guest",
            "start",
            "s1",
            "--on",
            "h1",
            "--size",
            &size,
            "--",
            "sortjob",
            "--sort-frac",
            "0.4",
        ];
        if !history {
            args.push("--no-warm");
        }
        pf_ok(&l, &args)?;
        wait_filled(&l, "s1", pages)?;
        // The running sort's accesses become the access history.
        std::thread::sleep(Duration::from_secs(if o.quick { 2 } else { 5 }));
        // The swap destination (`sd`) outlives the guest whatever fails:
        // its swap goes off only once the guest's pages are gone.
        let (res, sd) = match migrate_to(&l, o, "s1", dest, &[]) {
            Ok((r, sd)) => {
                let sorted = (|| {
                    let (h, _) = l.guest("s1").context("s1 vanished after migrating")?;
                    let s: pagefleet_api::SortResult = l
                        .post(h, "/guests/s1/sort", &json!({}), Duration::from_secs(3600))
                        .context("sort")?;
                    anyhow::Ok(s)
                })();
                (sorted.map(|s| (r, s)), sd)
            }
            Err(e) => (Err(e), None),
        };
        let (r, s, err) = match res {
            Ok((r, s)) => (Some(r), Some(s), None),
            Err(e) => {
                log(&format!("  FAILED: {e:#}"));
                (None, None, Some(format!("{e:#}")))
            }
        };
        stop_guest(&l, "s1")?;
        drop(sd);
        rows.push(SortRow {
            dest: dest.into(),
            history,
            sort_secs: s.as_ref().map_or(f64::NAN, |s| s.sort_secs),
            page_ins: s.as_ref().map_or(0, |s| s.page_ins),
            sorted: s.as_ref().is_some_and(|s| s.sorted),
            migration_secs: r.as_ref().map_or(f64::NAN, |r| r.total_secs),
            error: err,
        });
    }
    Ok(())
}

/// Seconds from `from` until throughput is back at 90% of `before`: the
/// start of the first 0.5 s whose average is (the window only keeps one
/// good sample from counting). It used to be the window's end, so an
/// instant recovery read 0.4–0.7 s and the goal compared sample jitter.
pub fn recovery(timeline: &[f64], interval: f64, from: f64, before: f64) -> Option<f64> {
    let w = (RECOVERY_WINDOW / interval).round() as usize;
    let start = (from / interval).floor() as usize;
    (start..timeline.len().saturating_sub(w - 1))
        .find(|&i| timeline[i..i + w].iter().sum::<f64>() / w as f64 >= 0.9 * before)
        .map(|i| (i as f64 * interval - from).max(0.0))
}

/// The window [`recovery`] averages over, s: recoveries shorter than it
/// are not told apart.
const RECOVERY_WINDOW: f64 = 0.5;

fn kv_experiment(o: &Opts, log: Log<'_>, rows: &mut Vec<KvRow>) -> Result<()> {
    let l = lab(o, Link::Gbit10)?;
    let ip = l.lab.service_ip(7);
    let svc = format!("{ip}:11211");
    let size = o.size.to_string();
    // Items fill half the guest, like the paper's 6 GB memcached in a 12 GB
    // VM whose main host had 6 GB free: with the kv's own tables, a little
    // more than the main host holds.
    let value_len = 4000;
    let keys = o.size / 2 / 4200;
    for (round, dest) in (0..o.kv_rounds.max(1)).flat_map(|r| DESTS.map(|d| (r, d))) {
        log(&format!(
            "kv: {} guest, {keys} items, zipf 0.99 load -> {dest} (round {} of {})",
            crate::fmt_bytes(o.size),
            round + 1,
            o.kv_rounds.max(1)
        ));
        pf_ok(
            &l,
            &[
                "guest",
                "start",
                "k1",
                "--on",
                "h1",
                "--size",
                &size,
                "--",
                "kv",
                "--listen",
                &svc,
                "--service-ip",
                &ip,
            ],
        )?;
        let spec = kvload::Spec {
            addr: svc.clone(),
            keys,
            value_len,
            conns: kvload::CONNS,
            get_frac: 0.9,
            theta: 0.99,
            netns: Some(l.lab.hosts[4].netns.clone()),
            reconnect: true,
            pace: None,
        };
        kvload::prefill(&spec)?;
        let load = kvload::Load::start(&spec);
        std::thread::sleep(Duration::from_secs(o.kv_before));
        let t0 = load.now();
        let (r, merr, sd) = match migrate_to(&l, o, "k1", dest, &[]) {
            Ok((r, sd)) => (Some(r), None, sd),
            Err(e) => {
                log(&format!("  FAILED: {e:#}"));
                (None, Some(format!("{e:#}")), None)
            }
        };
        let t1 = load.now();
        std::thread::sleep(Duration::from_secs(o.kv_after));
        let c = load.counters.clone();
        let err = load.error();
        let tl = load.stop()?;
        if let Some(e) = err {
            bail!("kv load: {e}");
        }
        stop_guest(&l, "k1")?;
        drop(sd);
        let iv = tl.interval;
        // Before: the last seconds before the migration started (skip warm-up).
        let b0 = ((t0 - (o.kv_before as f64 - 1.0).max(1.0)) / iv).max(0.0) as usize;
        let before = util::median(&tl.ops_per_sec[b0..(t0 / iv) as usize]);
        let tail =
            (tl.ops_per_sec.len().saturating_sub((3.0 / iv) as usize)).max((t1 / iv) as usize);
        // Steady state after: the mean of the run's last 3 s (a median or
        // a short average can catch one good moment before paging sets in).
        let last = &tl.ops_per_sec[tail..];
        let after = last.iter().sum::<f64>() / last.len().max(1) as f64;
        rows.push(KvRow {
            dest: dest.into(),
            round,
            recovery_secs: recovery(&tl.ops_per_sec, iv, t1, before),
            timeline: tl.ops_per_sec,
            migrate_start: t0,
            migrate_end: t1,
            before_ops: before,
            after_ops: after,
            bad_values: c.bad_values.load(Relaxed),
            misses: c.misses.load(Relaxed),
            downtime_ms: r.as_ref().map_or(f64::NAN, |r| r.downtime_ms),
            error: merr,
        });
    }
    Ok(())
}

pub fn run(o: &Opts, log: Log<'_>) -> Result<Report> {
    if !crate::is_root() {
        bail!("the migration benchmark builds a testbed of network namespaces: run it as root");
    }
    let mut time = Vec::new();
    let mut link_utilisation = Vec::new();
    let mut sort = Vec::new();
    let mut kv = Vec::new();
    if o.runs("time") {
        for &link in &o.links {
            time_experiment(o, link, log, &mut time, &mut link_utilisation)?;
        }
    }
    if o.runs("sort") {
        sort_experiment(o, log, &mut sort)?;
    }
    if o.runs("kv") {
        kv_experiment(o, log, &mut kv)?;
    }
    let mut r = Report {
        size_bytes: o.size,
        quick: o.quick,
        time,
        link_utilisation,
        sort,
        kv,
        goals: vec![],
        plot: PlotOutcome::default(),
    };
    r.goals = goals(&r);
    std::fs::create_dir_all(&o.out_dir)?;
    util::save_with_plot(
        &mut r,
        |r| &mut r.plot,
        &o.out_dir,
        "migration",
        include_str!("../../../bench/plot_migration.py"),
    )?;
    Ok(r)
}

fn goals(r: &Report) -> Vec<Goal> {
    let mut g = Vec::new();
    // A failed configuration yields NaN figures: its goals show as not met.
    let find = |link: &str, w: &str, d: &str| {
        r.time
            .iter()
            .find(|x| x.link == link && x.workload == w && x.dest == d)
    };
    let mut links: Vec<&str> = r.time.iter().map(|x| x.link.as_str()).collect();
    links.dedup();
    for link in links {
        for w in ["idle", "rewrite"] {
            if let (Some(e), Some(s), Some(v)) = (
                find(link, w, "enough"),
                find(link, w, "split"),
                find(link, w, "swap"),
            ) {
                g.push(Goal::at_most(
                    &format!("{link} {w}: split migration time / enough memory"),
                    s.total_secs / e.total_secs,
                    1.05,
                    "x",
                ));
                g.push(Goal::at_most(
                    &format!("{link} {w}: split downtime - enough memory"),
                    s.downtime_ms - e.downtime_ms,
                    10.0,
                    "ms",
                ));
                g.push(Goal::at_most(
                    &format!("{link} {w}: split migration time / swap baseline"),
                    s.total_secs / v.total_secs,
                    1.0,
                    "x",
                ));
                g.push(Goal::at_most(
                    &format!("{link} {w}: split downtime / swap baseline"),
                    s.downtime_ms / v.downtime_ms,
                    1.0,
                    "x",
                ));
            }
        }
    }
    for (link, u) in &r.link_utilisation {
        g.push(Goal::at_least(
            &format!("{link}: round-1 link utilisation (idle split)"),
            *u,
            0.9,
            "of shaped rate",
        ));
    }
    let sort = |d: &str| r.sort.iter().find(|x| x.dest == d);
    if let (Some(e), Some(s), Some(v)) = (sort("enough"), sort("split"), sort("swap")) {
        g.push(Goal::at_most(
            "post-migration sort time: split (with history) / enough memory",
            s.sort_secs / e.sort_secs,
            1.15,
            "x",
        ));
        g.push(Goal::at_most(
            "post-migration sort time: split / swap baseline",
            s.sort_secs / v.sort_secs,
            1.0,
            "x",
        ));
    }
    // Each destination's median over its rounds (a failed round counts as
    // no throughput and no recovery).
    let med = |d: &str, f: &dyn Fn(&KvRow) -> f64| {
        let v: Vec<f64> = r.kv.iter().filter(|x| x.dest == d).map(f).collect();
        (!v.is_empty()).then(|| util::median(&v))
    };
    let steady = |x: &KvRow| x.after_ops / x.before_ops.max(1e-9);
    let recovered = |x: &KvRow| x.recovery_secs.unwrap_or(f64::INFINITY);
    if let Some(s) = med("split", &steady) {
        g.push(Goal::at_least(
            "kv steady state after split migration (mean of last 3 s) / before, median of rounds",
            s,
            0.75,
            "ratio",
        ));
        if let (Some(s), Some(v)) = (med("split", &recovered), med("swap", &recovered)) {
            // Both at least the window: below it the measure cannot order them.
            g.push(Goal::at_most(
                "kv recovery time: split / swap baseline, medians of rounds (under 0.5 s counts as 0.5 s)",
                s.max(RECOVERY_WINDOW) / v.max(RECOVERY_WINDOW),
                1.0,
                "x",
            ));
        }
    }
    for d in DESTS {
        let rows: Vec<&KvRow> = r.kv.iter().filter(|x| x.dest == d).collect();
        if !rows.is_empty() {
            let bad: u64 = rows.iter().map(|k| k.bad_values + k.misses).sum();
            g.push(Goal::at_most(
                &format!("kv {d}: wrong or lost values"),
                bad as f64,
                0.0,
                "gets",
            ));
        }
    }
    g
}

pub fn print_table(r: &Report, out: &mut dyn std::io::Write) -> std::io::Result<()> {
    if !r.time.is_empty() {
        writeln!(
            out,
            "migration of a {} guest (S-memV Figs. 8-10)",
            crate::fmt_bytes(r.size_bytes)
        )?;
        writeln!(
            out,
            "{:<7} {:<8} {:<7} {:>9} {:>11} {:>7} {:>10} {:>12}",
            "link", "guest", "dest", "time s", "downtime ms", "rounds", "resent pg", "round1 MB/s"
        )?;
        for x in &r.time {
            if let Some(e) = &x.error {
                writeln!(
                    out,
                    "{:<7} {:<8} {:<7} FAILED: {e}",
                    x.link, x.workload, x.dest
                )?;
                continue;
            }
            writeln!(
                out,
                "{:<7} {:<8} {:<7} {:>9.2} {:>11.1} {:>7} {:>10} {:>12.0}",
                x.link,
                x.workload,
                x.dest,
                x.total_secs,
                x.downtime_ms,
                x.rounds,
                x.pages_sent_twice,
                x.round1_mb_per_s
            )?;
        }
    }
    if !r.sort.is_empty() {
        writeln!(
            out,
            "\npost-migration sort of 40% of the guest (S-memV Fig. 11)"
        )?;
        writeln!(
            out,
            "{:<13} {:>8} {:>9} {:>10} {:>7}",
            "dest", "history", "sort s", "page-ins", "sorted"
        )?;
        for x in &r.sort {
            if let Some(e) = &x.error {
                writeln!(out, "{:<13} FAILED: {e}", x.dest)?;
                continue;
            }
            writeln!(
                out,
                "{:<13} {:>8} {:>9.2} {:>10} {:>7}",
                x.dest, x.history, x.sort_secs, x.page_ins, x.sorted
            )?;
        }
    }
    if !r.kv.is_empty() {
        writeln!(out, "\nkv throughput across the migration (S-memV Fig. 12)")?;
        writeln!(
            out,
            "{:<7} {:>5} {:>12} {:>12} {:>7} {:>12} {:>11} {:>7}",
            "dest",
            "round",
            "before op/s",
            "after op/s",
            "after%",
            "recovery s",
            "downtime ms",
            "errors"
        )?;
        let mut kv: Vec<&KvRow> = r.kv.iter().collect();
        kv.sort_by_key(|x| (DESTS.iter().position(|d| *d == x.dest), x.round));
        for x in kv {
            if let Some(e) = &x.error {
                writeln!(out, "{:<7} FAILED: {e}", x.dest)?;
            }
            writeln!(
                out,
                "{:<7} {:>5} {:>12.0} {:>12.0} {:>6.0}% {:>12} {:>11.1} {:>7}",
                x.dest,
                x.round + 1,
                x.before_ops,
                x.after_ops,
                100.0 * x.after_ops / x.before_ops.max(1.0),
                x.recovery_secs
                    .map(|s| format!("{s:.1}"))
                    .unwrap_or("never".into()),
                x.downtime_ms,
                x.bad_values + x.misses
            )?;
        }
    }
    writeln!(out)?;
    util::print_goals(&r.goals, out)?;
    r.plot.print(out)
}

#[cfg(test)]
mod tests {
    use super::recovery;

    #[test]
    fn recovery_is_where_the_first_half_second_back_at_90_percent_starts() {
        // 100 ms samples: 10 before at 100, a dip, then back at 95 from t=2.0 s.
        let mut tl = vec![100.0; 10];
        tl.extend(vec![10.0; 10]);
        tl.extend(vec![95.0; 20]);
        let r = recovery(&tl, 0.1, 1.0, 100.0).unwrap();
        assert!((r - 1.0).abs() < 1e-9, "{r}");
        // Never down: recovered at once.
        assert_eq!(recovery(&[100.0; 30], 0.1, 1.0, 100.0), Some(0.0));
        assert_eq!(recovery(&[10.0; 30], 0.1, 1.0, 100.0), None);
    }
}

/// `pagefleet bench migration` (root): S-memV Figs. 8-12 on a testbed.
#[derive(clap::Args, Clone, Debug)]
pub struct Args {
    /// The guest's size (default 2GiB; at least 64MiB).
    #[arg(long, value_parser = pagefleet_common::units::parse_size)]
    pub dataset: Option<u64>,
    /// Link rates to measure migration time on, comma-separated (10gbit,1gbit).
    #[arg(long, value_delimiter = ',')]
    pub links: Vec<Link>,
    /// The experiments to run, comma-separated: time, sort, kv.
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// kv: rounds of the three destinations (enough, split, swap),
    /// interleaved; goals take each one's median (default 3, --quick 1).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=10))]
    pub kv_rounds: Option<u16>,
}

impl crate::Benchmark for Args {
    type Report = Report;
    fn run(&self, c: &crate::Common, log: &mut dyn FnMut(&str)) -> Result<Report> {
        let mut o = c.opts(Opts::quick, Opts::full);
        if let Some(d) = self.dataset {
            let d = crate::at_least("--dataset", "the guest size", d, 64 << 20)?;
            o.size = d / (64 << 10) * (64 << 10);
        }
        if !self.links.is_empty() {
            o.links = self.links.clone();
        }
        if let Some(n) = self.kv_rounds {
            o.kv_rounds = n as usize;
        }
        if !self.only.is_empty() {
            if let Some(bad) = self
                .only
                .iter()
                .find(|s| !["time", "sort", "kv"].contains(&s.as_str()))
            {
                bail!("--only {bad:?}: use time, sort, kv");
            }
            o.only = self.only.clone();
        }
        run(&o, log)
    }
    fn print(r: &Report, out: &mut dyn std::io::Write) -> std::io::Result<()> {
        print_table(r, out)
    }
}
