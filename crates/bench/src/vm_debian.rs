//! `pagefleet bench vm-migration --guest debian`: the Debian VM
//! (target/vm/debian.qcow2: systemd, memcached) on its own address on the
//! lab's network, memcached filled to 5/8 of the VM's memory and driven by
//! the kv client (every value checked) from another lab host, migrated:
//!
//! - `qemu-precopy`: QEMU's pre-copy between plain QEMUs;
//! - `qemu-multifd`: the same with multifd, 2 channels (QEMU's fastest
//!   pre-copy);
//! - `qemu-postcopy-preempt`: post-copy with its preempt channel (what QEMU
//!   recommends for large VMs), started after one pre-copy pass;
//! - `pagefleet-split`: pagefleet's split to a main host with half the
//!   VM's memory plus a sub-host, then gathered back.
//!
//! At each size (1, 2 and 4 GiB by default). Every mode boots its own VM
//! from its own copy of the image (the guest writes its root file system),
//! with a tap on its host's VM bridge; QEMU moves the disk as shared
//! storage. Measured: migration time, downtime (QEMU's figure; post-copy
//! and pagefleet: pause to resume), bytes sent, the clients' ops/s before
//! (4 s) and after (the last 3 s of the after window), their slowest
//! operation, wrong values, lost keys and broken connections.
//!
//! Hosts: h1 source, h2 main host (half the VM), h3 sub-host (lends), h4
//! QEMU's destination, h5 the clients.

use crate::migration::{pf_json, pf_ok, wait_until};
use crate::split_floor::{self, FloorRun};
use crate::util::{self, Goal};
use crate::LabRun;
use anyhow::{bail, Result};
use pagefleet_api::Report as MigrationReport;
use pagefleet_lab::kvload;
use pagefleet_lab::proc::TempCopy;
use pagefleet_testbed::Link;
use pagefleet_vm::tap::Tap;
use pagefleet_vm::{Disk, Nic, PlainLaunch, PlainVm, VmSpec};
use serde::Serialize;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
/// The ways the Debian VM is migrated.
pub const MODES: [&str; 4] = [
    "qemu-precopy",
    "qemu-multifd",
    "qemu-postcopy-preempt",
    "pagefleet-split",
];
/// Bytes of each memcached value (8 KiB: a 4 GiB VM fills in well under a
/// minute under TCG).
const VALUE_LEN: usize = 8192;
/// The split floor's port on h2 and h3.
const FLOOR_PORT: u16 = 4790;

#[derive(Clone, Debug)]
pub struct Opts {
    pub sizes: Vec<u64>,
    pub modes: Vec<String>,
    pub link: Link,
    pub before_secs: u64,
    pub after_secs: u64,
}

impl Opts {
    pub fn full() -> Opts {
        Opts {
            sizes: vec![1 << 30, 2 << 30, 4 << 30],
            modes: MODES.iter().map(|s| s.to_string()).collect(),
            link: Link::Gbit10,
            before_secs: 5,
            after_secs: 8,
        }
    }
    pub fn quick() -> Opts {
        Opts {
            sizes: vec![512 * MIB],
            modes: vec!["qemu-multifd".into(), "pagefleet-split".into()],
            before_secs: 3,
            after_secs: 4,
            ..Opts::full()
        }
    }
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct DebRow {
    pub size_bytes: u64,
    pub mode: String,
    /// 1, or 2 for a QEMU pre-copy run again because its first attempt's
    /// VM stopped serving after the move (both rows are kept).
    pub attempt: u32,
    /// Keys memcached held (VALUE_LEN bytes each).
    pub keys: u64,
    pub total_secs: f64,
    pub downtime_ms: f64,
    pub bytes_sent: u64,
    pub ops_before: f64,
    pub ops_after: f64,
    /// The clients' slowest operation over the run, ms (the gap they saw).
    pub max_op_ms: f64,
    pub wrong_values: u64,
    pub lost_keys: u64,
    pub reconnects: u64,
    /// pagefleet --verify on the gather back: the region's checksums at
    /// stop time and resume agree.
    pub checksums_equal: Option<bool>,
    /// pagefleet: the gather back to h1, seconds.
    pub gather_secs: Option<f64>,
    /// pagefleet: the split's own report (rounds, bytes per host, the
    /// downtime's parts).
    pub split_report: Option<Box<MigrationReport>>,
    /// pagefleet: the gather's report.
    pub gather_report: Option<Box<MigrationReport>>,
    /// pagefleet: the floor under the split's transfer (its bytes to the
    /// same hosts, nothing else), run beside the VM after the gather.
    pub floor: Option<FloorRun>,
    /// Why the floor did not run to its end.
    pub floor_error: Option<String>,
    /// QEMU: when the clients got nothing after the move, what the
    /// destination VM showed (QEMU's run state, its console's last lines).
    pub lost_clients: Option<String>,
    pub error: Option<String>,
}

impl DebRow {
    fn failed(size: u64, mode: &str, e: anyhow::Error) -> DebRow {
        DebRow {
            size_bytes: size,
            mode: mode.into(),
            total_secs: f64::NAN,
            downtime_ms: f64::NAN,
            ops_before: f64::NAN,
            ops_after: f64::NAN,
            max_op_ms: f64::NAN,
            error: Some(format!("{e:#}")),
            ..Default::default()
        }
    }
}

/// The image `make vm` builds.
fn image(bins: &Path) -> Result<PathBuf> {
    let p = bins
        .parent()
        .map(|p| p.join("vm/debian.qcow2"))
        .unwrap_or_default();
    if !p.is_file() {
        bail!(
            "the Debian VM image is missing ({}): run `make vm`",
            p.display()
        );
    }
    Ok(p)
}

/// What memcached holds at VM size `size`: (cache MiB, keys).
fn fill(size: u64) -> (u64, u64) {
    let mb = (size >> 20) * 5 / 8;
    // 70% of the cache in values: memcached's slabs and item headers take
    // the rest without evicting.
    (mb, mb * MIB * 7 / 10 / VALUE_LEN as u64)
}

fn load_spec(l: &LabRun, ip: &str, keys: u64) -> kvload::Spec {
    kvload::Spec {
        addr: format!("{}:11211", ip.split('/').next().unwrap_or(ip)),
        keys,
        value_len: VALUE_LEN,
        conns: 4,
        get_frac: 0.9,
        theta: 0.99,
        netns: Some(l.lab.hosts[4].netns.clone()),
        reconnect: true,
        pace: None,
    }
}

/// Mean ops/s of a load's 0.1 s timeline between seconds `a` and `b`.
fn mean_rate(tl: &[f64], a: f64, b: f64) -> f64 {
    let (i, j) = ((a / 0.1).max(0.0) as usize, (b / 0.1) as usize);
    let s = &tl[i.min(tl.len())..j.min(tl.len())];
    if s.is_empty() {
        f64::NAN
    } else {
        s.iter().sum::<f64>() / s.len() as f64
    }
}

/// Fill memcached (waiting for it to answer), start the load, keep it
/// `before` seconds.
fn loaded(spec: &kvload::Spec, before: u64) -> Result<kvload::Load> {
    kvload::prefill_patiently(spec, Duration::from_secs(300))?;
    let load = kvload::Load::start(spec);
    std::thread::sleep(Duration::from_secs(before));
    Ok(load)
}

/// Stop the load; fill the row's client figures; `t0`, `t1`: the
/// migration's start and end on the load's clock.
fn finish(load: kvload::Load, row: &mut DebRow, t0: f64, before: u64) -> Result<()> {
    let c = load.counters.clone();
    let err = load.error();
    let end = load.now();
    let tl = load.stop()?;
    row.ops_before = mean_rate(&tl.ops_per_sec, t0 - before.min(4) as f64, t0);
    row.ops_after = mean_rate(&tl.ops_per_sec, end - 3.0, end);
    row.max_op_ms = c.max_op_us.load(Relaxed) as f64 / 1e3;
    row.wrong_values = c.bad_values.load(Relaxed);
    row.lost_keys = c.misses.load(Relaxed);
    row.reconnects = c.reconnects.load(Relaxed);
    if let Some(e) = err {
        bail!("the clients: {e}");
    }
    Ok(())
}

/// A tap on host `h`'s VM bridge (made inside its namespace).
fn tap_on(l: &LabRun, h: usize) -> Result<Tap> {
    l.lab
        .spawn_in(h, || Tap::on_bridge(pagefleet_testbed::VM_BRIDGE))
        .join()
        .map_err(|_| anyhow::anyhow!("tap thread panicked"))??
        .map_err(anyhow::Error::from)
}

/// QEMU's own migration of the Debian VM between plain QEMUs (h1 to h4).
#[allow(clippy::too_many_arguments)]
fn run_qemu(
    l: &LabRun,
    o: &Opts,
    mode: &str,
    size: u64,
    img: &Path,
    dir: &Path,
    port: u16,
    ip: &str,
) -> Result<DebRow> {
    let (mb, keys) = fill(size);
    let disk = TempCopy::of(img, &format!("bench-{}-{mode}", l.lab.prefix))?;
    let spec = VmSpec {
        kernel: None,
        initrd: None,
        append: String::new(),
        disks: vec![Disk {
            path: disk.0.clone(),
            format: pagefleet_api::DiskFormat::Qcow2,
            readonly: false,
            overlay: None,
        }],
        forward: None,
        nic: Some(Nic {
            bridge: pagefleet_testbed::VM_BRIDGE.into(),
            mac: pagefleet_api::MacAddr::for_guest(mode),
        }),
        guest_config: format!("host=deb ip={ip} memcached_mb={mb}"),
        machine: Default::default(),
        smp: 1,
        size,
        name: format!("{mode}-src"),
        operator_qmp: None,
        firmware: Default::default(),
    };
    let src_tap = tap_on(l, 0)?;
    let src = PlainVm::start(PlainLaunch {
        spec: &spec,
        netns: Some(&l.lab.hosts[0].netns),
        incoming: None,
        dir,
        cgroup: None,
        tap: Some(&src_tap),
    })?;
    drop(src_tap);
    let spec_l = load_spec(l, ip, keys);
    let load = loaded(&spec_l, o.before_secs)?;
    let dest_ip = &l.lab.hosts[3].ip;
    let mut dspec = spec.clone();
    dspec.name = format!("{mode}-dst");
    let dst_tap = tap_on(l, 3)?;
    let dst = PlainVm::start(PlainLaunch {
        spec: &dspec,
        netns: Some(&l.lab.hosts[3].netns),
        incoming: Some(format!("tcp:{dest_ip}:{port}")),
        dir,
        cgroup: None,
        tap: Some(&dst_tap),
    })?;
    drop(dst_tap);
    let post = mode == "qemu-postcopy-preempt";
    let multifd = mode == "qemu-multifd";
    let bw = o.link.bytes_per_sec().unwrap_or(4e9) as u64;
    for vm in [&src, &dst] {
        vm.qmp(|q| {
            let mut caps = vec![("postcopy-ram", post), ("multifd", multifd)];
            if post {
                caps.push(("postcopy-preempt", true));
            }
            q.set_capabilities(&caps)?;
            let mut p = json!({ "max-bandwidth": bw });
            if multifd {
                p["multifd-channels"] = json!(2);
            }
            q.execute::<serde_json::Value>("migrate-set-parameters", Some(p))
        })?;
    }
    let t0 = load.now();
    src.qmp(|q| {
        q.execute::<serde_json::Value>(
            "migrate",
            Some(json!({ "uri": format!("tcp:{dest_ip}:{port}") })),
        )
    })?;
    let started = Instant::now();
    let mut postcopy_asked = false;
    let info = loop {
        let info = src.qmp(|q| q.query_migrate())?;
        match info.status.as_deref() {
            // total-time is filled a moment after COMPLETED.
            Some("completed") if info.total_time != Some(0) => break info,
            Some("completed") if started.elapsed() > Duration::from_secs(900) => break info,
            Some("completed") => {}
            Some("failed") | Some("cancelled") => bail!(
                "QEMU migration {}: {}",
                info.status.unwrap_or_default(),
                info.error_desc.unwrap_or_default()
            ),
            // Post-copy once the first pass has gone (QEMU's advice:
            // pre-copy first, post-copy for what keeps changing).
            Some("active")
                if post
                    && !postcopy_asked
                    && info
                        .ram
                        .as_ref()
                        .is_some_and(|r| r.dirty_sync_count.unwrap_or(0) >= 2) =>
            {
                src.qmp(|q| q.execute::<serde_json::Value>("migrate-start-postcopy", None))?;
                postcopy_asked = true;
            }
            _ => {}
        }
        if started.elapsed() > Duration::from_secs(900) {
            bail!("QEMU migration did not finish in 900 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let st = dst.qmp(|q| q.status())?;
    if !st.running {
        dst.qmp(|q| q.cont())?;
    }
    let downtime_ms = if post {
        pagefleet_vm::postcopy_downtime_ms(&src, &dst)
    } else {
        info.downtime.map(|d| d as f64).unwrap_or(f64::NAN)
    };
    src.shutdown(Duration::from_secs(2));
    std::thread::sleep(Duration::from_secs(o.after_secs));
    let mut row = DebRow {
        size_bytes: size,
        mode: mode.into(),
        keys,
        total_secs: info
            .total_time
            .map(|ms| ms as f64 / 1e3)
            .unwrap_or(started.elapsed().as_secs_f64()),
        downtime_ms,
        bytes_sent: info.ram.map(|r| r.transferred).unwrap_or(0),
        ..Default::default()
    };
    finish(load, &mut row, t0, o.before_secs)?;
    if row.ops_after == 0.0 {
        let state = dst
            .qmp(|q| q.status())
            .map(|s| format!("running={} ({})", s.running, s.status))
            .unwrap_or_else(|e| format!("no QMP answer: {e}"));
        row.lost_clients = Some(format!(
            "destination QEMU {state}; console: {}",
            dst.console.tail(6).join(" | ")
        ));
    }
    dst.shutdown(Duration::from_secs(2));
    Ok(row)
}

/// pagefleet: the Debian VM as a hosted guest on h1, split to h2 + h3,
/// then gathered back to h1.
fn run_pagefleet(l: &LabRun, o: &Opts, size: u64, img: &Path, ip: &str) -> Result<DebRow> {
    let (mb, keys) = fill(size);
    let disk = TempCopy::of(img, &format!("bench-{}-pf", l.lab.prefix))?;
    let name = "deb";
    let nic = format!("bridge,ip={ip}");
    let cfg = format!("memcached_mb={mb}");
    pf_ok(
        l,
        &[
            "guest",
            "start",
            name,
            "--on",
            "h1",
            "--size",
            &format!("{}MiB", size >> 20),
            "--",
            "vm",
            "--disk",
            disk.path(),
            "--nic",
            &nic,
            "--guest-config",
            &cfg,
        ],
    )?;
    let result = (|| -> Result<DebRow> {
        let spec_l = load_spec(l, ip, keys);
        let load = loaded(&spec_l, o.before_secs)?;
        let t0 = load.now();
        // No --verify on the split: its stop-time checksum would lengthen
        // the downtime QEMU's runs are compared with; the clients check
        // every value, and the gather back verifies the region.
        let rep = pf_json(l, &["migrate", name, "--json", "--to", "h2", "--sub", "h3"])?;
        std::thread::sleep(Duration::from_secs(o.after_secs));
        let mut row = DebRow {
            size_bytes: size,
            mode: "pagefleet-split".into(),
            keys,
            total_secs: rep.total_secs,
            downtime_ms: rep.downtime_ms,
            bytes_sent: rep.bytes_main + rep.bytes_subs.iter().sum::<u64>(),
            split_report: Some(Box::new(rep)),
            ..Default::default()
        };
        // Measured after the split's after window: ops_after is the split's.
        let end = load.now();
        let g = pf_json(l, &["gather", name, "--json", "--verify", "--to", "h1"])?;
        let equal = g.checksum_source.is_some() && g.checksum_source == g.checksum_dest;
        row.gather_secs = Some(g.total_secs);
        row.checksums_equal = Some(equal);
        row.gather_report = Some(Box::new(g));
        std::thread::sleep(Duration::from_secs(2));
        // The floor beside the VM (back on h1) and its clients: the split's
        // bytes from h1 to h2 and h3 as they went, nothing else.
        if let Some(rep) = &row.split_report {
            let mut shares = vec![(1, rep.bytes_main)];
            shares.extend(rep.bytes_subs.iter().take(1).map(|b| (2, *b)));
            match split_floor::run(&l.lab, 0, &shares, FLOOR_PORT) {
                Ok(f) => row.floor = Some(f),
                Err(e) => row.floor_error = Some(format!("{e:#}")),
            }
        }
        // The split's after window ends where the gather began.
        let c = load.counters.clone();
        let err = load.error();
        let tl = load.stop()?;
        row.ops_before = mean_rate(&tl.ops_per_sec, t0 - o.before_secs.min(4) as f64, t0);
        row.ops_after = mean_rate(&tl.ops_per_sec, end - 3.0, end);
        row.max_op_ms = c.max_op_us.load(Relaxed) as f64 / 1e3;
        row.wrong_values = c.bad_values.load(Relaxed);
        row.lost_keys = c.misses.load(Relaxed);
        row.reconnects = c.reconnects.load(Relaxed);
        if let Some(e) = err {
            bail!("the clients: {e}");
        }
        Ok(row)
    })();
    let stopped = pf_ok(l, &["guest", "stop", name])
        .and_then(|_| wait_until("the VM guest to stop", 30, || l.guest(name).is_none()));
    match (result, stopped) {
        (Ok(_), Err(e)) => Err(e.context("stopping the VM after its run")),
        (r, _) => r,
    }
}

/// Every mode at every size.
pub fn run(o: &Opts, bins: &Path, log: &mut dyn FnMut(&str)) -> Result<Vec<DebRow>> {
    let img = image(bins)?;
    let dir = util::temp_dir("bench-vmdeb")?;
    let mut rows = Vec::new();
    let mut port = 4800u16;
    for &size in &o.sizes {
        let g = size + 256 * MIB;
        let l = LabRun::up("bvd", bins, 5, o.link, size, &[g, size / 2, 0, g, 0])?;
        let ip = l.lab.vm_ip(1);
        for mode in MODES.iter().filter(|m| o.modes.iter().any(|x| x == *m)) {
            log(&format!(
                "{mode}: Debian VM of {} MiB, memcached {} keys of {} KiB",
                size >> 20,
                fill(size).1,
                VALUE_LEN >> 10
            ));
            port += 1;
            let r = if *mode == "pagefleet-split" {
                run_pagefleet(&l, o, size, &img, &ip)
            } else {
                run_qemu(&l, o, mode, size, &img, &dir, port, &ip)
            };
            let mut row = r.unwrap_or_else(|e| DebRow::failed(size, mode, e));
            row.attempt = 1;
            // QEMU at its best: a pre-copy whose VM died after the move
            // (TCG pre-copy here has left the guest kernel panicking) gets
            // a second run; both rows stay, the goals take a working one.
            let lost = row.error.is_none() && row.ops_after == 0.0;
            let precopy = *mode == "qemu-precopy" || *mode == "qemu-multifd";
            rows.push(row);
            if lost && precopy {
                log(&format!(
                    "{mode}: the VM stopped serving after the move; once more"
                ));
                port += 1;
                let r = run_qemu(&l, o, mode, size, &img, &dir, port, &ip);
                let mut again = r.unwrap_or_else(|e| DebRow::failed(size, mode, e));
                again.attempt = 2;
                rows.push(again);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(rows)
}

/// The goals, per size, from rows of one run.
pub fn goals(rows: &[DebRow]) -> Vec<Goal> {
    let mut g = Vec::new();
    let mut sizes: Vec<u64> = rows.iter().map(|r| r.size_bytes).collect();
    sizes.sort();
    sizes.dedup();
    let ok = |r: &&DebRow| r.error.is_none();
    let mut per_gib = Vec::new();
    for s in &sizes {
        let gib = *s as f64 / (1u64 << 30) as f64;
        let label = format!("Debian VM {} MiB", s >> 20);
        let Some(pf) = rows
            .iter()
            .find(|r| r.size_bytes == *s && r.mode == "pagefleet-split")
        else {
            continue;
        };
        // A baseline run whose VM stopped answering its clients after the
        // move (they saw nothing in the last seconds) is not a pre-copy to
        // compare with; it is in the table.
        let pre: Vec<&DebRow> = rows
            .iter()
            .filter(ok)
            .filter(|r| {
                r.size_bytes == *s && (r.mode == "qemu-precopy" || r.mode == "qemu-multifd")
            })
            .filter(|r| r.ops_after > 0.0)
            .collect();
        let best = pre
            .iter()
            .min_by(|a, b| a.total_secs.total_cmp(&b.total_secs));
        // No working pre-copy at this size: the comparisons are reported
        // unmet (NaN), not left out.
        let (name, t, d) = match best {
            Some(b) => (b.mode.clone(), b.total_secs, b.downtime_ms),
            None => (
                "no QEMU pre-copy run kept its clients".to_string(),
                f64::NAN,
                f64::NAN,
            ),
        };
        g.push(Goal::at_most(
            &format!("{label}: split migration time / best QEMU pre-copy ({name})"),
            pf.total_secs / t,
            0.5,
            "ratio",
        ));
        g.push(Goal::at_most(
            &format!("{label}: split downtime - QEMU pre-copy downtime ({name})"),
            pf.downtime_ms - d,
            10.0,
            "ms",
        ));
        g.push(Goal::at_most(
            &format!("{label}: split downtime"),
            pf.downtime_ms,
            300.0,
            "ms",
        ));
        g.push(Goal::at_least(
            &format!("{label}: memcached ops/s after the split / before"),
            pf.ops_after / pf.ops_before,
            0.8,
            "ratio",
        ));
        if let Some(f) = &pf.floor {
            // Met: a split could reach the target here; not met: the
            // target is out of reach on this machine, whatever the split does.
            g.push(Goal::at_most(
                &format!(
                    "{label}: floor (the split's bytes alone, sendfile to splice) / best QEMU pre-copy ({name})"
                ),
                f.secs / t,
                0.5,
                "ratio",
            ));
        }
        per_gib.push((gib, pf.total_secs / gib));
    }
    if per_gib.len() > 1 {
        let mean = per_gib.iter().map(|x| x.1).sum::<f64>() / per_gib.len() as f64;
        let worst = per_gib
            .iter()
            .map(|x| (x.1 / mean - 1.0).abs())
            .fold(f64::NAN, f64::max);
        g.push(Goal::at_most(
            &format!(
                "split seconds per GiB, largest deviation from their mean over {} sizes",
                per_gib.len()
            ),
            worst * 100.0,
            15.0,
            "%",
        ));
    }
    let bad: u64 = rows
        .iter()
        .filter(|r| r.mode == "pagefleet-split")
        .map(|r| {
            r.wrong_values
                + r.lost_keys
                + (r.checksums_equal != Some(true)) as u64
                + r.error.is_some() as u64
        })
        .sum();
    g.push(Goal::at_most(
        "Debian VM, split and gather: wrong values + lost keys + checksum mismatches + failed runs",
        bad as f64,
        0.0,
        "count",
    ));
    g
}

pub fn print(rows: &[DebRow], out: &mut dyn std::io::Write) -> std::io::Result<()> {
    if rows.is_empty() {
        return Ok(());
    }
    writeln!(
        out,
        "Debian VM (systemd, memcached filled to 5/8 of its memory, kv clients on another lab host):\n"
    )?;
    writeln!(
        out,
        "  {:<22} {:>7} {:>8} {:>10} {:>9} {:>10} {:>10} {:>9} {:>6} {:>5} {:>6} {:>8}",
        "mode",
        "MiB",
        "time s",
        "downtime",
        "MiB sent",
        "ops/s bef",
        "ops/s aft",
        "max op",
        "wrong",
        "lost",
        "recon",
        "gather s"
    )?;
    for r in rows {
        let mode = if r.attempt > 1 {
            format!("{} #{}", r.mode, r.attempt)
        } else {
            r.mode.clone()
        };
        if let Some(e) = &r.error {
            writeln!(out, "  {:<22} {:>7} FAILED: {e}", mode, r.size_bytes >> 20)?;
            continue;
        }
        writeln!(
            out,
            "  {:<22} {:>7} {:>8.2} {:>7.1} ms {:>9.0} {:>10.0} {:>10.0} {:>6.0} ms {:>6} {:>5} {:>6} {:>8}",
            mode,
            r.size_bytes >> 20,
            r.total_secs,
            r.downtime_ms,
            r.bytes_sent as f64 / MIB as f64,
            r.ops_before,
            r.ops_after,
            r.max_op_ms,
            r.wrong_values,
            r.lost_keys,
            r.reconnects,
            r.gather_secs.map(|s| format!("{s:.2}")).unwrap_or_else(|| "-".into())
        )?;
    }
    for r in rows {
        if let Some(why) = &r.lost_clients {
            writeln!(
                out,
                "  {} {:>5} MiB lost its clients: {why}",
                r.mode,
                r.size_bytes >> 20
            )?;
        }
    }
    // Where the split's time went, and the floor beside it.
    for r in rows.iter().filter(|r| r.error.is_none()) {
        if let Some(s) = &r.split_report {
            writeln!(
                out,
                "  split {:>5} MiB: {} rounds, round 1 {:.2} s for {:.0} MiB ({:.0} MiB/s), main {:.0} MiB, sub-hosts {:.0} MiB, downtime: pause {:.1} + last copy {:.1} + commit {:.1} + start {:.1} ms",
                r.size_bytes >> 20,
                s.rounds,
                s.round1_secs,
                s.round1_bytes as f64 / MIB as f64,
                s.round1_bytes as f64 / MIB as f64 / s.round1_secs.max(1e-9),
                s.bytes_main as f64 / MIB as f64,
                s.bytes_subs.iter().sum::<u64>() as f64 / MIB as f64,
                s.pause_ms,
                s.final_copy_ms,
                s.commit_ms,
                s.start_ms
            )?;
        }
        match (&r.floor, &r.floor_error) {
            (Some(f), _) => writeln!(
                out,
                "  floor {:>5} MiB: the same bytes alone in {:.2} s ({:.0} MiB/s; CPU source {:.2} s, destinations {:.2} s): split / floor {:.2}",
                r.size_bytes >> 20,
                f.secs,
                f.bytes as f64 / MIB as f64 / f.secs.max(1e-9),
                f.source_cpu_secs,
                f.dest_cpu_secs,
                r.total_secs / f.secs.max(1e-9)
            )?,
            (None, Some(e)) => writeln!(out, "  floor {:>5} MiB: FAILED: {e}", r.size_bytes >> 20)?,
            (None, None) => {}
        }
    }
    writeln!(out)
}
