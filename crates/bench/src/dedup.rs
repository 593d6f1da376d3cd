//! `pagefleet bench dedup`: sharing-aware migration (paper 002, Fig. 4) at
//! this machine's scale, on the testbed (h1 source, h2 destination, one
//! pagefleetd each, tbf-shaped links).
//!
//! The paper's micro-benchmark: the destination runs a guest holding a
//! common content; a guest on the source has a chosen fraction of its
//! pages with that content (synthetic `--fill-shared`, spread over its
//! memory; the rest is its own pseudo-random data) and is migrated with
//! every page sent (`--no-dedup`) and sharing-aware, side by side, at the
//! paper's sharing levels, on a 10 and a 1 Gbit link. Both runs verify the
//! region checksums.

use crate::migration::{pf_json, pf_ok, stop_guest, wait_filled, wait_until};
use crate::util::{self, Goal, PlotOutcome};
use crate::{kvload, LabRun};
use anyhow::{bail, Result};
use pagefleet_api::Report as MigrationReport;
use pagefleet_testbed::Link;
use serde::Serialize;
use std::path::PathBuf;

const MIB: u64 = 1 << 20;

/// The paper's sharing levels (Fig. 4).
pub const PAPER_LEVELS: [f64; 5] = [0.0, 0.259, 0.444, 0.647, 0.828];

#[derive(Clone, Debug, Serialize)]
pub struct Opts {
    /// Size of the migrated guest (and of the destination's guest).
    pub size: u64,
    pub links: Vec<Link>,
    /// Fractions of the guest's pages the destination holds.
    pub levels: Vec<f64>,
    /// Plain/dedup pairs at 0% sharing (the cost-nothing goal is tight).
    pub zero_pairs: usize,
    /// The real-workload cases (on the first link): a kv guest migrated
    /// to a host running another kv guest holding the same dataset, and a
    /// VM to a host running another VM booted from the same image.
    pub kv: bool,
    pub vm: bool,
    /// The split case (on the first link): half the guest goes to a
    /// sub-host's memory server; main host and sub-host each run a guest
    /// holding the common content. Levels 0 and 50%.
    pub split: bool,
    pub quick: bool,
    #[serde(skip)]
    pub out_dir: PathBuf,
}

impl Opts {
    pub fn full(out_dir: PathBuf) -> Opts {
        Opts {
            size: 512 * MIB,
            links: vec![Link::Gbit10, Link::Gbit1],
            levels: PAPER_LEVELS.to_vec(),
            zero_pairs: 5,
            kv: true,
            vm: true,
            split: true,
            quick: false,
            out_dir,
        }
    }
    pub fn quick(out_dir: PathBuf) -> Opts {
        Opts {
            size: 128 * MIB,
            links: vec![Link::Gbit10],
            levels: vec![0.0, 0.5],
            zero_pairs: 1,
            kv: false,
            vm: false,
            split: false,
            quick: true,
            out_dir,
        }
    }
}

/// One migration.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub link: String,
    /// "synthetic" (controlled sharing) or "vm" (two VMs from one image).
    pub case: String,
    /// Fraction of the guest's pages the destination holds (vm: what the
    /// sharing-aware run found).
    pub shared: f64,
    /// "plain" (every page as data) or "dedup".
    pub mode: String,
    pub total_secs: f64,
    pub downtime_ms: f64,
    /// Bytes on the wire to the destination (pages, hashes, control).
    pub bytes: u64,
    /// Pages whose data was sent.
    pub pages_sent: u64,
    /// Pages the destination filled itself.
    pub pages_not_sent: u64,
    /// Pages sharing-aware mode sent without asking (sending measured
    /// cheaper in that migration).
    pub pages_sent_unasked: u64,
    /// Source CPU seconds spent hashing.
    pub source_hash_secs: f64,
    /// Destination seconds spent looking up, reading and checking pages.
    pub dest_fill_secs: f64,
    /// Of that, the destination filler's CPU seconds.
    pub dest_fill_cpu_secs: f64,
    pub checksums_equal: bool,
    pub report: Option<MigrationReport>,
    pub error: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub opts: Opts,
    pub rows: Vec<Row>,
    /// The destination's content index after the runs, per link.
    pub index: Vec<(String, Option<pagefleet_api::DedupIndexReport>)>,
    /// The floor program at each sharing level of 50% and more.
    pub floors: Vec<floor::Floor>,
    /// What the floor says each time goal could reach at best.
    pub floor_bounds: Vec<crate::paging::FloorBound>,
    pub goals: Vec<Goal>,
    pub plot: PlotOutcome,
}

type Log<'a> = &'a mut dyn FnMut(&str);

/// Wait until h2's scanner has just finished a pass: its pause between
/// passes (10 s) then covers the migration, which therefore does not share
/// the CPUs with it (plain and dedup alike; the scanner's cost is its own
/// figure, `scan_cpu_secs`).
fn scanner_resting(l: &LabRun) -> Result<()> {
    let passes = || {
        l.host_report(1)
            .and_then(|r| r.dedup)
            .map_or(0, |d| d.passes)
    };
    let p0 = passes();
    wait_until("h2's scanner to finish a pass", 60, || passes() > p0)
}

/// Wait until h2's scanner has made two passes more (the guest just
/// started there is indexed).
fn wait_indexed(l: &LabRun, what: &str) -> Result<()> {
    let passes = || {
        l.host_report(1)
            .and_then(|r| r.dedup)
            .map_or(0, |d| d.passes)
    };
    let p0 = passes();
    wait_until(&format!("h2 to index its {what}"), 120, || {
        passes() >= p0 + 2
    })
}

/// Migrate `name` from h1 to h2, plain or sharing-aware, checksums on.
fn migrate_once(l: &LabRun, name: &str, mode: &str, log: Log<'_>) -> Result<MigrationReport> {
    let mut args = vec!["migrate", name, "--to", "h2", "--verify", "--json"];
    if mode == "plain" {
        args.push("--no-dedup");
    }
    let r = pf_json(l, &args);
    if let Err(e) = &r {
        log(&format!("  FAILED: {e:#}"));
    }
    r
}

/// A real-workload case: `start` puts the guest `name` on h1 (h2 already
/// runs its twin); it moves plain, then sharing-aware. The shared fraction
/// is what the sharing-aware run found.
fn real_case(
    l: &LabRun,
    link: Link,
    case: &str,
    name: &str,
    log: Log<'_>,
    rows: &mut Vec<Row>,
    start: &dyn Fn() -> Result<()>,
) -> Result<()> {
    for mode in ["plain", "dedup"] {
        log(&format!("{}: {case} case, {mode}", link.name()));
        start()?;
        scanner_resting(l)?;
        let r = migrate_once(l, name, mode, log);
        stop_guest(l, name)?;
        let mut row = row(link, case, 0.0, mode, r);
        if let Some(rep) = &row.report {
            row.shared = row.pages_not_sent as f64 / rep.pages_main.max(1) as f64;
        }
        rows.push(row);
    }
    Ok(())
}

fn start(l: &LabRun, name: &str, on: &str, size: u64, seed: u64, shared: f64) -> Result<()> {
    let (size, seed, shared) = (size.to_string(), seed.to_string(), shared.to_string());
    pf_ok(
        l,
        &[
            "guest",
            "start",
            name,
            "--on",
            on,
            "--size",
            &size,
            "--",
            "synthetic",
            "--fill-seed",
            &seed,
            "--fill-shared",
            &shared,
            "--rate",
            "0",
        ],
    )
}

fn link_runs(
    o: &Opts,
    link: Link,
    log: Log<'_>,
    rows: &mut Vec<Row>,
) -> Result<Option<pagefleet_api::DedupIndexReport>> {
    let bins = util::sibling_binary("pagefleetd")?
        .parent()
        .unwrap()
        .to_path_buf();
    // h2 holds its own guest and the migrated one.
    let l = LabRun::up(
        "bdedup",
        &bins,
        2,
        link,
        64 * MIB,
        // The VM case runs two 512 MiB VMs on h2 (after the others left).
        &[
            (o.size + 64 * MIB).max(576 * MIB),
            (2 * o.size + 128 * MIB).max(1152 * MIB),
        ],
    )?;
    let pages = o.size / 4096;
    log(&format!(
        "{}: the destination's guest ({})",
        link.name(),
        crate::fmt_bytes(o.size)
    ));
    start(&l, "base", "h2", o.size, 1, 1.0)?;
    wait_filled(&l, "base", pages)?;
    wait_until("h2 to index its guest", 300, || {
        l.host_report(1)
            .and_then(|r| r.dedup)
            .is_some_and(|d| d.pages_indexed + 64 >= pages)
    })?;
    let mut seed = 100;
    for &level in &o.levels {
        let pairs = if level == 0.0 { o.zero_pairs } else { 1 };
        for pair in 0..pairs {
            // Alternate which goes first, so neither always meets a busier host.
            let modes = if pair % 2 == 0 {
                ["plain", "dedup"]
            } else {
                ["dedup", "plain"]
            };
            for mode in modes {
                seed += 1;
                log(&format!(
                    "{}: {:.1}% shared, {mode}",
                    link.name(),
                    level * 100.0
                ));
                start(&l, "m", "h1", o.size, seed, level)?;
                wait_filled(&l, "m", pages)?;
                scanner_resting(&l)?;
                let r = migrate_once(&l, "m", mode, log);
                stop_guest(&l, "m")?;
                rows.push(row(link, "synthetic", level, mode, r));
            }
        }
    }
    let ix = l.host_report(1).and_then(|r| r.dedup);
    stop_guest(&l, "base")?;
    // A real-workload case that fails is a FAILED row, not a lost run.
    if o.kv && link == o.links[0] {
        if let Err(e) = kv_runs(&l, o, link, log, rows) {
            log(&format!("  kv case FAILED: {e:#}"));
            rows.push(row(link, "kv", 0.0, "dedup", Err(e)));
            for g in ["kv", "kvbase"] {
                let _ = stop_guest(&l, g);
            }
        }
    }
    if o.vm && link == o.links[0] {
        if let Err(e) = vm_runs(&l, &bins, link, log, rows) {
            log(&format!("  VM case FAILED: {e:#}"));
            rows.push(row(link, "vm", 0.0, "dedup", Err(e)));
            for g in ["vm", "vmbase"] {
                let _ = stop_guest(&l, g);
            }
        }
    }
    Ok(ix)
}

/// The split case: a guest half of whose pages go to a sub-host (h3).
/// h2 and h3 each run a guest holding the common content, so at level L
/// both destinations together hold L of the guest. Bytes and pages count
/// the main host and the sub-host.
fn split_runs(o: &Opts, link: Link, log: Log<'_>, rows: &mut Vec<Row>) -> Result<()> {
    let bins = util::sibling_binary("pagefleetd")?
        .parent()
        .unwrap()
        .to_path_buf();
    let size = (o.size / 2).max(64 * MIB);
    let pages = size / 4096;
    let l = LabRun::up(
        "bdsplit",
        &bins,
        3,
        link,
        size,
        &[size + 64 * MIB, size + size / 2, size + 64 * MIB],
    )?;
    log(&format!(
        "{}: split case: guests holding the common content on h2 and h3 ({} each)",
        link.name(),
        crate::fmt_bytes(size)
    ));
    start(&l, "base2", "h2", size, 1, 1.0)?;
    start(&l, "base3", "h3", size, 1, 1.0)?;
    wait_filled(&l, "base2", pages)?;
    wait_filled(&l, "base3", pages)?;
    for h in [1, 2] {
        wait_until(&format!("h{} to index its guest", h + 1), 300, || {
            l.host_report(h)
                .and_then(|r| r.dedup)
                .is_some_and(|d| d.pages_indexed + 64 >= pages)
        })?;
    }
    let mut seed = 500;
    for level in [0.0, 0.5] {
        for mode in ["plain", "dedup"] {
            seed += 1;
            log(&format!(
                "{}: split, {:.1}% shared, {mode}",
                link.name(),
                level * 100.0
            ));
            start(&l, "m", "h1", size, seed, level)?;
            wait_filled(&l, "m", pages)?;
            scanner_resting(&l)?;
            let mut args = vec![
                "migrate", "m", "--to", "h2", "--sub", "h3", "--verify", "--json",
            ];
            if mode == "plain" {
                args.push("--no-dedup");
            }
            let r: Result<MigrationReport> = pf_json(&l, &args);
            if let Err(e) = &r {
                log(&format!("  FAILED: {e:#}"));
            }
            stop_guest(&l, "m")?;
            let mut x = row(link, "split", level, mode, r);
            if let Some(rep) = &x.report {
                let subs_found: u64 = rep.dedup_subs.iter().map(|d| d.pages_not_sent).sum();
                x.bytes = rep.bytes_main + rep.bytes_subs.iter().sum::<u64>();
                x.pages_sent =
                    (rep.pages_main + rep.pages_subs.iter().sum::<u64>() + rep.pages_sent_twice)
                        .saturating_sub(x.pages_not_sent + subs_found);
                x.pages_not_sent += subs_found;
                x.source_hash_secs += rep
                    .dedup_subs
                    .iter()
                    .map(|d| d.source_hash_secs)
                    .sum::<f64>();
            }
            rows.push(x);
        }
    }
    Ok(())
}

/// The first real-workload case: h2 runs a kv guest holding a dataset;
/// another kv guest loaded with the same dataset (by the same client, in
/// its own order of arrival) moves from h1 to h2.
fn kv_runs(l: &LabRun, o: &Opts, link: Link, log: Log<'_>, rows: &mut Vec<Row>) -> Result<()> {
    let size = (o.size / 2).max(64 * MIB).to_string();
    let value_len = 4000;
    let keys = o.size / 2 / 2 / 4200;
    let start_kv = |name: &str, on: &str, n: u8| -> Result<()> {
        let ip = l.lab.service_ip(n);
        let listen = format!("{ip}:11211");
        pf_ok(
            l,
            &[
                "guest",
                "start",
                name,
                "--on",
                on,
                "--size",
                &size,
                "--",
                "kv",
                "--listen",
                &listen,
                "--service-ip",
                &ip,
            ],
        )?;
        kvload::prefill(&kvload::Spec {
            addr: listen,
            keys,
            value_len,
            conns: 4,
            get_frac: 0.9,
            theta: 0.99,
            netns: Some(l.lab.hosts[0].netns.clone()),
            reconnect: true,
            pace: None,
        })
    };
    log(&format!(
        "{}: kv case: the destination's kv guest ({keys} items)",
        link.name()
    ));
    start_kv("kvbase", "h2", 21)?;
    wait_indexed(l, "kv guest")?;
    real_case(l, link, "kv", "kv", log, rows, &|| start_kv("kv", "h1", 22))?;
    stop_guest(l, "kvbase")
}

/// The real-workload case: h2 runs a VM booted from the image; a second VM
/// from the same image (its own vmwork data) moves from h1 to h2.
fn vm_runs(
    l: &LabRun,
    bins: &std::path::Path,
    link: Link,
    log: Log<'_>,
    rows: &mut Vec<Row>,
) -> Result<()> {
    let (kernel, initrd) = crate::vm_migration::image(bins)?;
    let (k, i) = (
        kernel.to_str().unwrap_or_default(),
        initrd.to_str().unwrap_or_default(),
    );
    let start_vm = |name: &str, on: &str, seed: u32| {
        let append = format!("vmwork_mb=192 vmwork_seed={seed} vmwork_idle=1 vmwork_secs=0");
        pf_ok(
            l,
            &[
                "guest", "start", name, "--on", on, "--size", "512MiB", "--", "vm", "--kernel", k,
                "--initrd", i, "--append", &append,
            ],
        )
    };
    let working = |name: &str| {
        wait_until(&format!("{name}'s workload to start"), 180, || {
            l.guest(name).is_some_and(|(_, g)| g.ops > 0)
        })
    };
    log(&format!("{}: VM case: the destination's VM", link.name()));
    start_vm("vmbase", "h2", 11)?;
    working("vmbase")?;
    wait_indexed(l, "VM")?;
    real_case(l, link, "vm", "vm", log, rows, &|| {
        start_vm("vm", "h1", 12)?;
        working("vm")
    })?;
    stop_guest(l, "vmbase")
}

fn row(link: Link, case: &str, shared: f64, mode: &str, r: Result<MigrationReport>) -> Row {
    let (report, error) = match r {
        Ok(r) => (Some(r), None),
        Err(e) => (None, Some(format!("{e:#}"))),
    };
    let d = report.as_ref().and_then(|r| r.dedup_main.as_deref());
    let not_sent = d.map_or(0, |d| d.pages_not_sent);
    Row {
        link: link.name().into(),
        case: case.into(),
        shared,
        mode: mode.into(),
        total_secs: report.as_ref().map_or(f64::NAN, |r| r.total_secs),
        downtime_ms: report.as_ref().map_or(f64::NAN, |r| r.downtime_ms),
        bytes: report.as_ref().map_or(0, |r| r.bytes_main),
        pages_sent: report.as_ref().map_or(0, |r| {
            (r.pages_main + r.pages_sent_twice).saturating_sub(not_sent)
        }),
        pages_not_sent: not_sent,
        pages_sent_unasked: d.map_or(0, |d| d.pages_sent_unasked),
        source_hash_secs: d.map_or(0.0, |d| d.source_hash_secs),
        dest_fill_secs: d.map_or(0.0, |d| d.dest_fill_secs),
        dest_fill_cpu_secs: d.map_or(0.0, |d| d.dest_fill_cpu_secs),
        checksums_equal: report
            .as_ref()
            .is_some_and(|r| r.checksum_source.is_some() && r.checksum_source == r.checksum_dest),
        report,
        error,
    }
}

pub fn run(o: &Opts, log: Log<'_>) -> Result<Report> {
    if !crate::is_root() {
        bail!("the dedup benchmark builds a testbed of network namespaces: run it as root");
    }
    let key = pagefleet_dedup::ContentKey::from_secret(
        &pagefleet_proto::auth::Secret::from_bytes(&pagefleet_proto::auth::random_nonce(), "bench")
            .map_err(|e| anyhow::anyhow!("{e}"))?,
    );
    let mut floors = Vec::new();
    for &level in o.levels.iter().filter(|l| **l >= 0.5) {
        let pages = ((o.size / 4096) as usize).min(32768);
        log(&format!(
            "floor program: {:.1}% shared, {pages} pages",
            level * 100.0
        ));
        floors.push(floor::run(pages, level, &key)?);
    }
    let mut rows = Vec::new();
    let mut index = Vec::new();
    for &link in &o.links {
        let ix = link_runs(o, link, log, &mut rows)?;
        index.push((link.name().to_string(), ix));
    }
    if o.split {
        if let Err(e) = split_runs(o, o.links[0], log, &mut rows) {
            log(&format!("  split case FAILED: {e:#}"));
            rows.push(row(o.links[0], "split", 0.5, "dedup", Err(e)));
        }
    }
    let floor_bounds = floor_bounds(o, &rows, &floors);
    let mut r = Report {
        opts: o.clone(),
        rows,
        index,
        floors,
        floor_bounds,
        goals: vec![],
        plot: PlotOutcome::default(),
    };
    r.goals = goals(&r);
    std::fs::create_dir_all(&o.out_dir)?;
    util::save_with_plot(
        &mut r,
        |r| &mut r.plot,
        &o.out_dir,
        "dedup",
        include_str!("../../../bench/plot_dedup.py"),
    )?;
    Ok(r)
}

/// For each time-saved goal: the best the floor allows. The floor's time
/// for the guest's size is its measured time per page (unshaped, so CPU
/// bound) or the link time of the pages it had to send, whichever is
/// longer; against the plain migration measured on that link.
fn floor_bounds(o: &Opts, rows: &[Row], floors: &[floor::Floor]) -> Vec<crate::paging::FloorBound> {
    let mut out = Vec::new();
    for &link in &o.links {
        let Some(rate) = link.bytes_per_sec() else {
            continue;
        };
        for f in floors {
            let plain: Vec<f64> = rows
                .iter()
                .filter(|x| {
                    x.case == "synthetic"
                        && x.link == link.name()
                        && x.shared == f.shared
                        && x.mode == "plain"
                })
                .map(|x| x.total_secs)
                .collect();
            let t_plain = median(plain);
            let pages = (o.size / 4096) as f64;
            let cpu = f.secs / f.pages as f64 * pages;
            let wire = f.pages_sent as f64 / f.pages as f64 * o.size as f64 / rate;
            let best = cpu.max(wire);
            let bound = (1.0 - best / t_plain) / f.shared;
            out.push(crate::paging::FloorBound {
                goal: format!("{} {:.1}% shared: time saved / shared fraction", link.name(), f.shared * 100.0),
                bound,
                target: 0.9,
                how: format!(
                    "floor {:.3} s for the guest (CPU {cpu:.3} s: hash {:.3} s here, copy+check {:.3} s there, per {} pages scaled; link {wire:.3} s) vs plain migration {t_plain:.3} s",
                    best,
                    f.hash_secs / f.pages as f64 * pages,
                    f.fill_secs / f.pages as f64 * pages,
                    f.pages
                ),
                reachable: bound >= 0.9,
            });
        }
    }
    out
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn goals(r: &Report) -> Vec<Goal> {
    let mut g = Vec::new();
    for link in r.opts.links.iter().map(|l| l.name()) {
        for &level in &r.opts.levels {
            let of = |mode: &str| -> Vec<&Row> {
                r.rows
                    .iter()
                    .filter(|x| {
                        x.case == "synthetic"
                            && x.link == link
                            && x.shared == level
                            && x.mode == mode
                    })
                    .collect()
            };
            let (plain, dedup) = (of("plain"), of("dedup"));
            if plain.is_empty() || dedup.is_empty() {
                continue;
            }
            let pct = level * 100.0;
            // Where the link is the bottleneck (1 Gbit) the bytes follow
            // the sharing; on a fast link sending may be the cheaper way
            // and bytes are not a goal there (time is).
            let bytes = median(
                plain
                    .iter()
                    .zip(&dedup)
                    .map(|(p, d)| d.bytes as f64 / p.bytes.max(1) as f64)
                    .collect(),
            );
            if link == Link::Gbit1.name() {
                g.push(Goal::at_most(
                    &format!("{link} {pct:.1}% shared: bytes dedup / plain"),
                    bytes,
                    1.0 - level + 0.03,
                    "x",
                ));
            }
            // Sharing-aware never costs time, at every level on every
            // link. Several pairs (0%): their median, the worst named
            // beside it (one pair of 0.5 s migrations here swings by
            // ±50% with the machine, plain against plain); a failed run
            // fails the goal.
            let ratios: Vec<f64> = plain
                .iter()
                .zip(&dedup)
                .map(|(p, d)| d.total_secs / p.total_secs)
                .collect();
            let finite = ratios.iter().all(|t| t.is_finite());
            let worst = ratios.iter().copied().fold(0.0, f64::max);
            let time = if finite {
                median(ratios.clone())
            } else {
                f64::INFINITY
            };
            let name = if ratios.len() > 1 {
                format!(
                    "{link} {pct:.1}% shared: time dedup / plain (median of {} pairs; worst {worst:.2})",
                    ratios.len()
                )
            } else {
                format!("{link} {pct:.1}% shared: time dedup / plain")
            };
            g.push(Goal::at_most(&name, time, 1.03, "x"));
            if link == Link::Gbit1.name() && level > 0.0 {
                g.push(Goal::at_least(
                    &format!("{link} {pct:.1}% shared: time saved / shared fraction"),
                    (1.0 - time) / level,
                    0.9,
                    "x",
                ));
            }
        }
    }
    {
        let of = |mode: &str| {
            r.rows.iter().find(|x| {
                x.case == "split" && x.shared == 0.5 && x.mode == mode && x.error.is_none()
            })
        };
        if let (Some(p), Some(d)) = (of("plain"), of("dedup")) {
            // Bytes where the link is the bottleneck, time where it is not
            // (the main host's part may be sent unasked there).
            if p.link == Link::Gbit1.name() {
                g.push(Goal::at_most(
                    "split to main host + sub-host, 50.0% shared: bytes dedup / plain (both destinations)",
                    d.bytes as f64 / p.bytes.max(1) as f64,
                    0.5 + 0.03,
                    "x",
                ));
            }
            g.push(Goal::at_most(
                &format!(
                    "{} split to main host + sub-host, 50.0% shared: time dedup / plain",
                    p.link
                ),
                d.total_secs / p.total_secs,
                1.03,
                "x",
            ));
        }
    }
    for (case, what) in [
        ("kv", "kv guests, one dataset"),
        ("vm", "VMs from one image"),
    ] {
        let of = |mode: &str| r.rows.iter().find(|x| x.case == case && x.mode == mode);
        if let (Some(p), Some(d)) = (of("plain"), of("dedup")) {
            g.push(Goal::at_most(
                &format!(
                    "{what} ({:.1}% found shared): bytes dedup / plain",
                    d.shared * 100.0
                ),
                d.bytes as f64 / p.bytes.max(1) as f64,
                1.0 - d.shared + 0.03,
                "x",
            ));
        }
    }
    let wrong = r.rows.iter().filter(|x| !x.checksums_equal).count();
    g.push(Goal::at_most(
        "runs whose region checksums differ (or failed)",
        wrong as f64,
        0.0,
        "runs",
    ));
    g
}

pub fn print_table(r: &Report, out: &mut dyn std::io::Write) -> std::io::Result<()> {
    writeln!(
        out,
        "sharing-aware migration of a {} guest (paper 002, Fig. 4)",
        crate::fmt_bytes(r.opts.size)
    )?;
    writeln!(
        out,
        "{:<7} {:<9} {:>7} {:<6} {:>8} {:>11} {:>9} {:>10} {:>10} {:>9} {:>8} {:>8} {:>6}",
        "link",
        "case",
        "shared",
        "mode",
        "time s",
        "downtime ms",
        "MiB sent",
        "pages sent",
        "not sent",
        "unasked",
        "hash CPU",
        "fill CPU",
        "verify"
    )?;
    for x in &r.rows {
        if let Some(e) = &x.error {
            writeln!(
                out,
                "{:<7} {:<9} {:>6.1}% {:<6} FAILED: {e}",
                x.link,
                x.case,
                x.shared * 100.0,
                x.mode
            )?;
            continue;
        }
        writeln!(
            out,
            "{:<7} {:<9} {:>6.1}% {:<6} {:>8.2} {:>11.1} {:>9.1} {:>10} {:>10} {:>9} {:>8.3} {:>8.3} {:>6}",
            x.link,
            x.case,
            x.shared * 100.0,
            x.mode,
            x.total_secs,
            x.downtime_ms,
            x.bytes as f64 / MIB as f64,
            x.pages_sent,
            x.pages_not_sent,
            x.pages_sent_unasked,
            x.source_hash_secs,
            x.dest_fill_cpu_secs,
            if x.checksums_equal { "equal" } else { "DIFFER" }
        )?;
    }
    writeln!(
        out,
        "  unasked: pages sharing-aware mode sent as data without asking (sending measured cheaper); hash CPU: the source's CPU seconds hashing; fill CPU: the destination filler's (lookups, allocating, reading, checking)"
    )?;
    for (link, ix) in &r.index {
        if let Some(ix) = ix {
            writeln!(
                out,
                "{link}: destination index {} pages, {:.1} B per page, hit rate {:.2}, scanner {:.2} CPU s for {} pages ({:.2} GB/s of CPU)",
                ix.pages_indexed,
                ix.bytes_per_page,
                ix.hit_rate,
                ix.scan_cpu_secs,
                ix.pages_scanned,
                ix.pages_scanned as f64 * 4096.0 / ix.scan_cpu_secs.max(1e-9) / 1e9
            )?;
        }
    }
    for f in &r.floors {
        writeln!(
            out,
            "floor program, {:.1}% shared: {} pages in {:.3} s (hash {:.3} s, copy+check {:.3} s, {} pages sent)",
            f.shared * 100.0,
            f.pages,
            f.secs,
            f.hash_secs,
            f.fill_secs,
            f.pages_sent
        )?;
    }
    for b in &r.floor_bounds {
        writeln!(
            out,
            "  {}: at best {:.3} (target {:.3}, {}): {}",
            b.goal,
            b.bound,
            b.target,
            if b.reachable {
                "within reach"
            } else {
                "OUT OF REACH for the floor"
            },
            b.how
        )?;
    }
    util::print_goals(&r.goals, out)?;
    r.plot.print(out)
}

/// `pagefleet bench dedup` (root): sharing-aware migration against plain
/// migration at the paper's sharing levels.
#[derive(clap::Args, Clone, Debug)]
pub struct Args {
    /// The migrated guest's size (default 512MiB; at least 64MiB).
    #[arg(long, value_parser = pagefleet_common::units::parse_size)]
    pub size: Option<u64>,
    /// Link rates, comma-separated (10gbit,1gbit).
    #[arg(long, value_delimiter = ',')]
    pub links: Vec<Link>,
    /// Sharing levels, comma-separated fractions (default the paper's:
    /// 0,0.259,0.444,0.647,0.828).
    #[arg(long, value_delimiter = ',')]
    pub levels: Vec<f64>,
    /// Skip the kv case (two kv guests holding one dataset).
    #[arg(long)]
    pub no_kv: bool,
    /// Skip the VM case (two VMs booted from one image; needs `make vm`).
    #[arg(long)]
    pub no_vm: bool,
    /// Skip the split case (half the guest to a sub-host's memory server).
    #[arg(long)]
    pub no_split: bool,
}

impl crate::Benchmark for Args {
    type Report = Report;
    fn run(&self, c: &crate::Common, log: &mut dyn FnMut(&str)) -> Result<Report> {
        let mut o = c.opts(Opts::quick, Opts::full);
        if let Some(s) = self.size {
            let s = crate::at_least("--size", "the guest size", s, 64 << 20)?;
            o.size = s / (64 << 10) * (64 << 10);
        }
        if !self.links.is_empty() {
            o.links = self.links.clone();
        }
        if self.no_vm {
            o.vm = false;
        }
        if self.no_kv {
            o.kv = false;
        }
        if self.no_split {
            o.split = false;
        }
        if !self.levels.is_empty() {
            if let Some(bad) = self.levels.iter().find(|l| !(0.0..=1.0).contains(*l)) {
                bail!("--levels {bad}: a sharing level is a fraction between 0 and 1");
            }
            o.levels = self.levels.clone();
        }
        run(&o, log)
    }
    fn print(r: &Report, out: &mut dyn std::io::Write) -> std::io::Result<()> {
        print_table(r, out)
    }
}

/// The floor: the smallest program doing only the work sharing-aware
/// migration cannot avoid, in this process over loopback TCP (unshaped).
/// The source hashes every page (keyed BLAKE3) and sends the hashes in
/// batches of 256, 4 in flight; the destination, with a prebuilt index of
/// its own pages, copies and re-hashes each page it holds and answers a
/// bitmap; the source sends the others' data. No daemon, no runner, no
/// guest memory mapping, no page table.
pub mod floor {
    use pagefleet_dedup::{ContentKey, PageHash};
    use std::collections::{HashMap, VecDeque};
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::time::Instant;

    const PAGE: usize = pagefleet_region::PAGE;
    const BATCH: usize = 256;
    const DEPTH: usize = 4;

    /// What one floor run measured.
    #[derive(Clone, Debug, serde::Serialize)]
    pub struct Floor {
        pub pages: usize,
        pub shared: f64,
        /// Wall time of the sharing-aware transfer.
        pub secs: f64,
        /// Source CPU hashing, seconds.
        pub hash_secs: f64,
        /// Destination copy + re-hash of the pages it held, seconds.
        pub fill_secs: f64,
        /// Pages whose data went over the socket.
        pub pages_sent: usize,
    }

    fn page_of(seed: u64, p: usize, out: &mut [u8]) {
        let mut x = seed ^ (p as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        for w in out.chunks_exact_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            w.copy_from_slice(&x.to_le_bytes());
        }
    }

    /// Move `pages` pages of which a `shared` fraction (every k-th) the
    /// destination holds.
    pub fn run(pages: usize, shared: f64, key: &ContentKey) -> std::io::Result<Floor> {
        let is_shared = |p: usize| ((p * 7919) % 1000) < (shared * 1000.0).round() as usize;
        let mut src = vec![0u8; pages * PAGE];
        let mut local = vec![0u8; pages * PAGE];
        for p in 0..pages {
            page_of(
                if is_shared(p) { 1 } else { 2 },
                p,
                &mut src[p * PAGE..(p + 1) * PAGE],
            );
            page_of(1, p, &mut local[p * PAGE..(p + 1) * PAGE]);
        }
        // The destination's index of what it holds (not timed: the scanner's job).
        let index: HashMap<PageHash, usize> = (0..pages)
            .map(|p| {
                (
                    key.hash(local[p * PAGE..(p + 1) * PAGE].try_into().unwrap()),
                    p,
                )
            })
            .collect();
        let l = TcpListener::bind("127.0.0.1:0")?;
        let addr = l.local_addr()?;
        let k2 = key.clone();
        let dest = std::thread::spawn(move || -> std::io::Result<(f64, Vec<u8>)> {
            let (mut s, _) = l.accept()?;
            s.set_nodelay(true)?;
            let mut target = vec![0u8; pages * PAGE];
            let mut fill = 0.0;
            let mut hashes = vec![0u8; BATCH * 24];
            loop {
                let mut h = [0u8; 8];
                s.read_exact(&mut h)?;
                let (kind, n) = (
                    h[0],
                    u32::from_le_bytes(h[4..8].try_into().unwrap()) as usize,
                );
                match kind {
                    b'H' => {
                        s.read_exact(&mut hashes[..n * 24])?;
                        let t = Instant::now();
                        let mut bits = vec![0u8; n.div_ceil(8)];
                        for (i, e) in hashes[..n * 24].chunks_exact(24).enumerate() {
                            let p = u64::from_le_bytes(e[..8].try_into().unwrap()) as usize;
                            let hash = PageHash(e[8..24].try_into().unwrap());
                            if let Some(&q) = index.get(&hash) {
                                let dst = &mut target[p * PAGE..(p + 1) * PAGE];
                                dst.copy_from_slice(&local[q * PAGE..(q + 1) * PAGE]);
                                if k2.hash((&*dst).try_into().unwrap()) == hash {
                                    bits[i / 8] |= 1 << (i % 8);
                                }
                            }
                        }
                        fill += t.elapsed().as_secs_f64();
                        s.write_all(&bits)?;
                    }
                    b'P' => {
                        let p = n;
                        s.read_exact(&mut target[p * PAGE..(p + 1) * PAGE])?;
                    }
                    _ => return Ok((fill, target)),
                }
            }
        });
        let mut s = TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        let t0 = Instant::now();
        let mut hash_secs = 0.0;
        let mut sent = 0;
        let mut inflight: VecDeque<(usize, usize)> = VecDeque::new();
        let settle = |s: &mut TcpStream, (first, n): (usize, usize)| -> std::io::Result<usize> {
            let mut bits = vec![0u8; n.div_ceil(8)];
            s.read_exact(&mut bits)?;
            let mut k = 0;
            for i in 0..n {
                if bits[i / 8] & (1 << (i % 8)) == 0 {
                    let p = first + i;
                    let mut h = [0u8; 8];
                    h[0] = b'P';
                    h[4..8].copy_from_slice(&(p as u32).to_le_bytes());
                    s.write_all(&h)?;
                    s.write_all(&src[p * PAGE..(p + 1) * PAGE])?;
                    k += 1;
                }
            }
            Ok(k)
        };
        let mut msg = Vec::with_capacity(8 + BATCH * 24);
        for first in (0..pages).step_by(BATCH) {
            let n = BATCH.min(pages - first);
            let t = Instant::now();
            msg.clear();
            msg.extend_from_slice(&[b'H', 0, 0, 0]);
            msg.extend_from_slice(&(n as u32).to_le_bytes());
            for p in first..first + n {
                msg.extend_from_slice(&(p as u64).to_le_bytes());
                msg.extend_from_slice(
                    &key.hash(src[p * PAGE..(p + 1) * PAGE].try_into().unwrap())
                        .0,
                );
            }
            hash_secs += t.elapsed().as_secs_f64();
            s.write_all(&msg)?;
            inflight.push_back((first, n));
            if inflight.len() > DEPTH {
                let b = inflight.pop_front().unwrap();
                sent += settle(&mut s, b)?;
            }
        }
        while let Some(b) = inflight.pop_front() {
            sent += settle(&mut s, b)?;
        }
        s.write_all(&[b'E', 0, 0, 0, 0, 0, 0, 0])?;
        let (fill_secs, target) = dest
            .join()
            .map_err(|_| std::io::Error::other("floor destination panicked"))??;
        let secs = t0.elapsed().as_secs_f64();
        if target != src {
            return Err(std::io::Error::other(
                "the floor program moved a wrong page",
            ));
        }
        Ok(Floor {
            pages,
            shared,
            secs,
            hash_secs,
            fill_secs,
            pages_sent: sent,
        })
    }
}
