//! `pagefleet demo` (and `make demo`): the whole S-memV story on a 4-host
//! testbed in a few minutes. A kv guest serves a zipf client load on h1;
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
}

#[derive(Debug, Serialize)]
pub struct Report {
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
    let ip = l.lab.service_ip(1);
    let svc = format!("{ip}:11211");
    let size = o.size.to_string();
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
    let spec = kvload::Spec {
        addr: svc.clone(),
        // Items fill 60% of the guest: more than the main host will hold.
        keys: o.size * 6 / 10 / 4200,
        value_len: 4000,
        conns: 4,
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
    kvload::prefill(&spec)?;
    log("client load: 4 connections, 90% gets, zipf 0.99; every value read is checked");
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
    let mut r = Report {
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
    writeln!(out, "\n== kv client throughput (ops/s) ==")?;
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
        "  split, steady (paging with h3):{steady:>10.0}   ({:.2}x before; S-memV lost 14%)",
        steady / before.max(1.0)
    )?;
    writeln!(
        out,
        "  back on h1 after the gather:   {:>10.0}",
        avg(&r.timeline, g1 + 1.0, end)
    )?;
    writeln!(
        out,
        "  values checked: {} wrong, {} missing; clients reconnected {} times",
        r.bad_values, r.misses, r.reconnects
    )?;
    r.plot.print(out)
}
