//! `pagefleet demo` (and `make demo`): the whole S-memV story on a 4-host
//! testbed in a few minutes. A kv guest (or, with `--vm`, the Debian VM
//! running memcached on its own address) serves a zipf client load on h1;
//! it split-migrates (placement picks the main host with free memory for
//! half of it and a sub-host for the rest), runs there paging with the
//! sub-host, and is gathered back onto h1. Throughput over time is plotted
//! with the phases marked (S-memV Fig. 12 style).

use crate::kvload;
use crate::labrun::LabRun;
use crate::plot::{self, PlotOutcome};
use crate::proc;
use anyhow::{bail, Result};
use pagefleet_testbed::Link;
use serde::Serialize;
use serde_json::Value;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

#[derive(Clone, Debug)]
pub struct Opts {
    pub size: u64,
    pub out_dir: PathBuf,
    pub phase_secs: u64,
    /// A QEMU VM (kernel, initramfs running vmwork) instead of the kv guest.
    pub vm: Option<(PathBuf, PathBuf)>,
    /// The Debian VM image (memcached on the VM's own address) instead of
    /// the kv guest: the same client load and story.
    pub debian: Option<PathBuf>,
    /// Where to forward h1's dashboard on this machine (None: not at all).
    pub dashboard: Option<String>,
}

/// Forward h1's dashboard to this machine and log a login link for it.
fn watch(l: &LabRun, o: &Opts, log: &mut dyn FnMut(&str)) -> Option<crate::forward::Forward> {
    let at = o.dashboard.as_deref()?;
    match crate::forward::dashboard(&l.lab, 0, at) {
        Ok((f, link)) => {
            log(&format!(
                "watch it live in a browser on this machine (open within a minute; the link works once): {link}"
            ));
            Some(f)
        }
        Err(e) => {
            log(&format!("no dashboard: {e:#}"));
            None
        }
    }
}

#[derive(Debug, Serialize)]
pub struct Report {
    /// "kv" (client ops/s) or "vm" (vmwork's in-guest ops/s).
    pub workload: String,
    pub size_bytes: u64,
    /// ops/s per 100 ms.
    pub timeline: Vec<f64>,
    /// (label, start s, end s) of each migration.
    pub phases: Vec<(String, f64, f64)>,
    pub split: Value,
    pub gather: Value,
    pub status_after_split: String,
    pub bad_values: u64,
    pub misses: u64,
    pub reconnects: u64,
    #[serde(flatten)]
    pub plot: PlotOutcome,
}

fn run_pf(l: &LabRun, args: &[&str], log: &mut dyn FnMut(&str)) -> Result<String> {
    log(&format!("$ pagefleet {}", args.join(" ")));
    let (ok, out, err) = l.pf(0, args);
    if !ok {
        bail!("pagefleet {}: {}", args.join(" "), err.trim());
    }
    Ok(out)
}

pub fn run(o: &Opts, log: &mut dyn FnMut(&str)) -> Result<Report> {
    if o.vm.is_some() {
        return run_vm(o, log);
    }
    if !crate::is_root() {
        bail!("the demo builds a testbed of network namespaces: run it as root (sudo make demo)");
    }
    let bins = proc::sibling_binary("pagefleetd")?
        .parent()
        .unwrap()
        .to_path_buf();
    let half = o.size / 2;
    log(&format!(
        "testbed: h1 (source, {} for guests), h2 (main host: {} free), h3 and h4 (memory servers), 10 Gbit links; the client load runs on h4",
        crate::fmt_bytes(o.size + (64 << 20)),
        crate::fmt_bytes(half)
    ));
    let l = LabRun::up(
        "demo",
        &bins,
        4,
        Link::Gbit10,
        o.size,
        &[o.size + (64 << 20), half, 0, 0],
    )?;
    let _dashboard = watch(&l, o, log);
    let size = o.size.to_string();
    // The VM's writable copy of the image, beside it (where hosts allow
    // VM files), removed when the demo ends.
    let disk = o
        .debian
        .as_ref()
        .map(|img| proc::TempCopy::of(img, &format!("demo-{}", l.lab.prefix)))
        .transpose()?;
    let (svc, keys) = if let Some(d) = &disk {
        let ip = l.lab.vm_ip(1);
        let mb = (o.size >> 20) * 5 / 8;
        let (nic, cfg) = (format!("bridge,ip={ip}"), format!("memcached_mb={mb}"));
        run_pf(
            &l,
            &[
                "guest",
                "start",
                "db",
                "--on",
                "h1",
                "--size",
                &size,
                "--",
                "vm",
                "--disk",
                d.path(),
                "--nic",
                &nic,
                "--guest-config",
                &cfg,
            ],
            log,
        )?;
        log("the Debian VM boots (QEMU, TCG; systemd, then memcached on its own address)");
        (
            format!("{}:11211", ip.split('/').next().unwrap_or(&ip)),
            // Items fill 70% of memcached's cache (5/8 of the VM).
            mb * (1 << 20) * 7 / 10 / 4200,
        )
    } else {
        let ip = l.lab.service_ip(1);
        let svc = format!("{ip}:11211");
        run_pf(
            &l,
            &[
                "guest",
                "start",
                "db",
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
            log,
        )?;
        // Items fill 60% of the guest: more than the main host will hold.
        (svc, o.size * 6 / 10 / 4200)
    };
    let spec = kvload::Spec {
        addr: svc.clone(),
        keys,
        value_len: 4000,
        conns: kvload::CONNS,
        get_frac: 0.9,
        theta: 0.99,
        netns: Some(l.lab.hosts[3].netns.clone()),
        reconnect: true,
        pace: None,
    };
    log(&format!(
        "storing {} items of 4000 bytes in the guest's kv (memcached protocol) at {svc}",
        spec.keys
    ));
    // The VM's memcached answers once the VM has booted.
    let patience = if disk.is_some() { 180 } else { 0 };
    kvload::prefill_patiently(&spec, Duration::from_secs(patience))?;
    log(&format!(
        "client load: {} connections, 90% gets, zipf 0.99; every value read is checked",
        spec.conns
    ));
    let load = kvload::Load::start(&spec);
    std::thread::sleep(Duration::from_secs(o.phase_secs));
    let t0 = load.now();
    let split_out = run_pf(&l, &["migrate", "db", "--json"], log);
    let t1 = load.now();
    let split: Value = match split_out {
        Ok(s) => serde_json::from_str(&s)?,
        Err(e) => {
            drop(load);
            return Err(e);
        }
    };
    let (_, status, _) = l.pf(0, &["status"]);
    std::thread::sleep(Duration::from_secs(o.phase_secs * 2));
    let t2 = load.now();
    let gather_out = run_pf(&l, &["gather", "db", "--to", "h1", "--json"], log);
    let t3 = load.now();
    let gather: Value = match gather_out {
        Ok(s) => serde_json::from_str(&s)?,
        Err(e) => {
            drop(load);
            return Err(e);
        }
    };
    std::thread::sleep(Duration::from_secs(o.phase_secs));
    let c = load.counters.clone();
    let err = load.error();
    let tl = load.stop()?;
    if let Some(e) = err {
        bail!("client load: {e}");
    }
    let _ = l.pf(0, &["guest", "stop", "db"]);
    let mut r = Report {
        workload: if disk.is_some() { "debian-vm" } else { "kv" }.into(),
        size_bytes: o.size,
        timeline: tl.ops_per_sec,
        phases: vec![
            ("split migration".into(), t0, t1),
            ("gather".into(), t2, t3),
        ],
        split,
        gather,
        status_after_split: status,
        bad_values: c.bad_values.load(Relaxed),
        misses: c.misses.load(Relaxed),
        reconnects: c.reconnects.load(Relaxed),
        plot: PlotOutcome::default(),
    };
    std::fs::create_dir_all(&o.out_dir)?;
    plot::save_with_plot(
        &mut r,
        |r| &mut r.plot,
        &o.out_dir,
        "demo",
        include_str!("../../../bench/plot_demo.py"),
    )?;
    Ok(r)
}

/// The demo with a QEMU VM: it boots on h1 with vmwork (which checks every
/// value it reads), split-migrates, pages with the sub-host, and is gathered
/// back; the in-guest throughput over time is plotted.
fn run_vm(o: &Opts, log: &mut dyn FnMut(&str)) -> Result<Report> {
    let (kernel, initrd) = o.vm.clone().expect("vm demo");
    if !crate::is_root() {
        bail!("the demo builds a testbed of network namespaces: run it as root (sudo make demo)");
    }
    let bins = proc::sibling_binary("pagefleetd")?
        .parent()
        .unwrap()
        .to_path_buf();
    let half = o.size / 2;
    log(&format!(
        "testbed: h1 (source, {} for guests), h2 (main host: {} free), h3 and h4 (memory servers), 10 Gbit links",
        crate::fmt_bytes(o.size + (64 << 20)),
        crate::fmt_bytes(half)
    ));
    let l = LabRun::up(
        "dvm",
        &bins,
        4,
        Link::Gbit10,
        o.size,
        &[o.size + (64 << 20), half, 0, 0],
    )?;
    let _dashboard = watch(&l, o, log);
    let size = o.size.to_string();
    let append = format!(
        "vmwork_mb={} vmwork_span=50 vmwork_secs=0 vmwork_write=10 vmwork_seed=1",
        (o.size >> 20) * 6 / 10
    );
    let (k, i) = (
        kernel.to_str().unwrap_or_default().to_string(),
        initrd.to_str().unwrap_or_default().to_string(),
    );
    run_pf(
        &l,
        &[
            "guest", "start", "vm", "--on", "h1", "--size", &size, "--", "vm", "--kernel", &k,
            "--initrd", &i, "--append", &append,
        ],
        log,
    )?;
    log("the VM boots (QEMU, TCG) and vmwork fills 60% of its memory, then reads and writes zipf-picked pages of its first half (the working set), checking every value");
    // Sampled every 100 ms: vmwork's cumulative count (it reports 4x a second).
    let stop = std::sync::atomic::AtomicBool::new(false);
    let t_start = std::time::Instant::now();
    let ops = || l.guest("vm").map(|g| g.1.ops).unwrap_or(0);
    let errors = || {
        l.guest("vm")
            .and_then(|g| g.1.vm)
            .map(|v| v.errors)
            .unwrap_or(0)
    };
    let w0 = std::time::Instant::now();
    while ops() == 0 {
        if w0.elapsed() > Duration::from_secs(180) {
            bail!("the VM's workload did not start within 180 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let base = t_start.elapsed().as_secs_f64();
    let (samples, res) = std::thread::scope(|s| {
        // vmwork's count at each console report, at that report's time
        // (not when status happened to be asked).
        let unix0 = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0)
            - (t_start.elapsed().as_secs_f64() - base);
        let (stop, l) = (&stop, &l);
        let h = s.spawn(move || {
            let mut v: Vec<(f64, u64)> = Vec::new();
            while !stop.load(Relaxed) {
                if let Some(vm) = l.guest("vm").and_then(|g| g.1.vm) {
                    let t = vm.report_unix_secs - unix0;
                    if v.last()
                        .is_none_or(|p: &(f64, u64)| t > p.0 && vm.ops >= p.1)
                    {
                        v.push((t, vm.ops));
                    }
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            v
        });
        let res = (|| -> Result<_> {
            let now = || t_start.elapsed().as_secs_f64() - base;
            std::thread::sleep(Duration::from_secs(o.phase_secs));
            let t0 = now();
            let split: Value =
                serde_json::from_str(&run_pf(l, &["migrate", "vm", "--json", "--verify"], log)?)?;
            let t1 = now();
            let (_, status, _) = l.pf(0, &["status"]);
            std::thread::sleep(Duration::from_secs(o.phase_secs * 2));
            let t2 = now();
            let gather: Value = serde_json::from_str(&run_pf(
                l,
                &["gather", "vm", "--to", "h1", "--json", "--verify"],
                log,
            )?)?;
            let t3 = now();
            std::thread::sleep(Duration::from_secs(o.phase_secs));
            Ok((t0, t1, t2, t3, split, gather, status))
        })();
        stop.store(true, Relaxed);
        (h.join().unwrap_or_default(), res)
    });
    let (t0, t1, t2, t3, split, gather, status) = res?;
    // ops/s per 100 ms from the cumulative counts.
    let end = samples.last().map(|s| s.0).unwrap_or(0.0);
    let mut timeline = vec![0.0; (end / 0.1) as usize];
    for w in samples.windows(2) {
        let (a, b) = (w[0], w[1]);
        let rate = (b.1.saturating_sub(a.1)) as f64 / (b.0 - a.0).max(1e-3);
        let (i, j) = (
            (a.0 / 0.1) as usize,
            ((b.0 / 0.1) as usize).min(timeline.len()),
        );
        for x in timeline.iter_mut().take(j).skip(i) {
            *x = rate;
        }
    }
    let bad = errors();
    let _ = l.pf(0, &["guest", "stop", "vm"]);
    for (what, v) in [("split", &split), ("gather", &gather)] {
        if v["checksum_source"] != v["checksum_dest"] {
            bail!("{what}: the VM's memory differs after the migration: {v}");
        }
    }
    let mut r = Report {
        workload: "vm".into(),
        size_bytes: o.size,
        timeline,
        phases: vec![
            ("split migration".into(), t0, t1),
            ("gather".into(), t2, t3),
        ],
        split,
        gather,
        status_after_split: status,
        bad_values: bad,
        misses: 0,
        reconnects: 0,
        plot: PlotOutcome::default(),
    };
    std::fs::create_dir_all(&o.out_dir)?;
    plot::save_with_plot(
        &mut r,
        |r| &mut r.plot,
        &o.out_dir,
        "demo-vm",
        include_str!("../../../bench/plot_demo.py"),
    )?;
    Ok(r)
}

fn avg(tl: &[f64], from: f64, to: f64) -> f64 {
    let (a, b) = (
        ((from / 0.1) as usize).min(tl.len()),
        ((to / 0.1) as usize).min(tl.len()),
    );
    if b <= a {
        return 0.0;
    }
    tl[a..b].iter().sum::<f64>() / (b - a) as f64
}

pub fn print(r: &Report, out: &mut dyn std::io::Write) -> std::io::Result<()> {
    let show = |v: &Value, out: &mut dyn std::io::Write| -> std::io::Result<()> {
        if let Ok(rep) = serde_json::from_value::<pagefleet_migrate::Report>(v.clone()) {
            let _ = out.flush();
            rep.print();
        }
        Ok(())
    };
    writeln!(out, "\n== split migration ==")?;
    show(&r.split, out)?;
    writeln!(
        out,
        "\n== where the guest's pages were after it ==\n{}",
        r.status_after_split.trim_end()
    )?;
    writeln!(out, "\n== gather back onto h1 ==")?;
    show(&r.gather, out)?;
    let (s0, s1) = (r.phases[0].1, r.phases[0].2);
    let (g0, g1) = (r.phases[1].1, r.phases[1].2);
    let end = r.timeline.len() as f64 * 0.1;
    if r.workload == "vm" {
        writeln!(out, "\n== the VM's in-guest throughput (vmwork ops/s) ==")?;
    } else {
        writeln!(out, "\n== kv client throughput (ops/s) ==")?;
    }
    let before = avg(&r.timeline, (s0 - 3.0).max(1.0), s0);
    let steady = avg(&r.timeline, (g0 - 3.0).max(s1), g0);
    writeln!(out, "  on h1 before:                  {before:>10.0}")?;
    writeln!(
        out,
        "  split, first second after:     {:>10.0}",
        avg(&r.timeline, s1, s1 + 1.0)
    )?;
    writeln!(
        out,
        "  split, steady (paging with h3):{steady:>10.0}   ({:.3}x before; S-memV lost 14%)",
        steady / before.max(1.0)
    )?;
    writeln!(
        out,
        "  back on h1 after the gather:   {:>10.0}",
        avg(&r.timeline, g1 + 1.0, end)
    )?;
    if r.workload == "vm" {
        writeln!(
            out,
            "  values checked by vmwork inside the VM: {} wrong",
            r.bad_values
        )?;
    } else {
        writeln!(
            out,
            "  values checked: {} wrong, {} missing; clients reconnected {} times",
            r.bad_values, r.misses, r.reconnects
        )?;
    }
    r.plot.print(out)
}
