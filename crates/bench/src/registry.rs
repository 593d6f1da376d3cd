//! `pagefleet bench registry`: the etcd registry at a scale this machine
//! cannot host for real. Simulated hosts and guests are registered in a
//! real etcd (one member on loopback, started here), then placements run
//! as the daemon runs them: read the registry, choose hosts, claim the
//! main host's memory and the sub-hosts' lending by transaction, release
//! the claims; and simulated (split) migrations write what a real one writes. Measured: placement latency,
//! etcd writes per migration (revision deltas), etcd's CPU per placement,
//! the bytes one view reads, and the memory a daemon's mirror of the
//! registry (what placement reads) takes. Every placement is checked: its
//! view holds every simulated host, alive.

use crate::util::{self, Goal, PlotOutcome};
use anyhow::{anyhow, Result};
use pagefleet_api::{GuestState, GuestStatus, HostReport};
use pagefleet_lab::etcd::EtcdCluster;
use pagefleet_migrate::placement::{self, HostInfo};
use pagefleet_registry::{parse_endpoints, Etcd, Pool};
use serde::Serialize;
use std::path::PathBuf;
use std::time::{Duration, Instant};

const GIB: u64 = 1 << 30;

#[derive(Clone, Debug, Serialize)]
pub struct Opts {
    pub hosts: usize,
    pub guests: usize,
    pub placements: usize,
    pub migrations: usize,
    #[serde(skip)]
    pub out_dir: PathBuf,
}

impl Opts {
    pub fn full(out_dir: PathBuf) -> Opts {
        Opts {
            hosts: 1000,
            guests: 10_000,
            placements: 300,
            migrations: 100,
            out_dir,
        }
    }
    pub fn quick(out_dir: PathBuf) -> Opts {
        Opts {
            hosts: 100,
            guests: 1000,
            placements: 50,
            migrations: 20,
            out_dir,
        }
    }
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub opts: Opts,
    /// Seconds to register every host with its guests, and writes that took.
    pub register_secs: f64,
    pub register_writes: i64,
    /// Placement latency samples, ms (read the registry's mirror as of
    /// now + choose + claim + release), as the daemon places.
    pub placement_ms: Vec<f64>,
    pub placement_p50_ms: f64,
    pub placement_p99_ms: f64,
    /// Of that, reading the registry, ms (median).
    pub view_p50_ms: f64,
    /// Reading placement's view from etcd itself instead (every host's
    /// record, in pages), ms (median of up to 20): what a placement cost
    /// without the mirror.
    pub direct_view_p50_ms: f64,
    /// Seconds from starting the mirror to its first use (the list).
    pub mirror_sync_secs: f64,
    /// Keys the mirror holds and their bytes (keys and values).
    pub mirror_keys: u64,
    pub mirror_bytes: u64,
    /// This process's RSS growth over building the mirror: a daemon's
    /// memory for its view of the cluster.
    pub mirror_rss_bytes: u64,
    /// Bytes the full view reads (every host and guest; `pagefleet
    /// status`, gc) and placement's view (hosts only).
    pub view_bytes: u64,
    pub hosts_view_bytes: u64,
    /// The full view's read time, ms (median of 20).
    pub full_view_p50_ms: f64,
    /// etcd writes per simulated split migration (claims on the main host
    /// and a sub-host, their releases, both hosts'
    /// records).
    pub writes_per_migration: f64,
    /// etcd's CPU seconds per placement.
    pub etcd_cpu_ms_per_placement: f64,
    pub goals: Vec<Goal>,
    pub plot: PlotOutcome,
}

fn guest(name: String, host: usize, i: usize) -> GuestStatus {
    let mut g = GuestStatus::placeholder(&name, GuestState::Running, 65536, 0);
    g.region_id = format!("{:#x}", (host as u64) << 20 | i as u64);
    g.size = 2 * GIB;
    g
}

fn report(i: usize, free: u64) -> HostReport {
    HostReport {
        hostname: format!("sim{i}"),
        mem_total: 256 * GIB,
        mem_available: 128 * GIB,
        lend_capacity: 64 * GIB,
        lend_used: (i as u64 * 7919 % 64) * GIB,
        guest_memory: 192 * GIB,
        guest_free: free,
        http: Some(format!("10.{}.{}.1:7071", i / 256, i % 256)),
        memserver: Some(format!("10.{}.{}.1:7070", i / 256, i % 256)),
        ..Default::default()
    }
}

fn pct(v: &[f64], p: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return f64::NAN;
    }
    v[((v.len() - 1) as f64 * p).round() as usize]
}

pub fn run(o: &Opts, log: &mut dyn FnMut(&str)) -> Result<Report> {
    let etcd = EtcdCluster::start(1)
        .ok_or_else(|| anyhow!("no etcd here: `make deps` installs etcd-server"))?;
    let pid = etcd.pid(0).ok_or_else(|| anyhow!("etcd is not running"))?;
    let eps = parse_endpoints(&etcd.url())?;
    // One connection (one lease) publishes every simulated host.
    let reg = Etcd::new(eps, Duration::from_secs(60))?;
    log(&format!(
        "registering {} hosts with {} guests",
        o.hosts, o.guests
    ));
    let per_host = o.guests.div_ceil(o.hosts.max(1));
    let r0 = reg.revision()?;
    let t = Instant::now();
    for i in 0..o.hosts {
        let guests: Vec<GuestStatus> = (0..per_host)
            .map(|k| guest(format!("g{i}-{k}"), i, k))
            .collect();
        let free = (i as u64 * 104_729 % 160 + 8) * GIB;
        reg.publish(
            &format!("sim{i}"),
            &format!("10.0.{i}.1:7071"),
            &report(i, free),
            &guests,
        )?;
    }
    let register_secs = t.elapsed().as_secs_f64();
    let register_writes = reg.revision()? - r0;
    let view_bytes = serde_json::to_vec(&reg.view()?)?.len() as u64;
    let hosts_view_bytes = serde_json::to_vec(&reg.hosts_view()?)?.len() as u64;
    // Each read is ~1 KB per host: fewer of them on big clusters.
    let reads = (20_000 / o.hosts.max(1)).clamp(3, 20);
    let mut full = Vec::new();
    let mut direct = Vec::new();
    for _ in 0..reads {
        let t = Instant::now();
        reg.view()?;
        full.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        let v = reg.hosts_view()?;
        direct.push(t.elapsed().as_secs_f64() * 1e3);
        if v.hosts.len() != o.hosts {
            anyhow::bail!("etcd's view has {} hosts of {}", v.hosts.len(), o.hosts);
        }
    }
    log("mirroring the registry");
    let me = std::process::id();
    let rss0 = pagefleet_lab::proc::rss_of(me)?;
    let t = Instant::now();
    reg.follow();
    reg.placement_view()?;
    let mirror_sync_secs = t.elapsed().as_secs_f64();
    let mirror_rss_bytes = pagefleet_lab::proc::rss_of(me)?.saturating_sub(rss0);
    let (mirror_keys, mirror_bytes) = reg.mirror_size();
    log(&format!("{} placements", o.placements));
    let cpu0 = pagefleet_lab::proc::cpu_secs(pid);
    let mut placement_ms = Vec::new();
    let mut view_ms = Vec::new();
    for k in 0..o.placements {
        let t = Instant::now();
        let v = reg.placement_view()?;
        view_ms.push(t.elapsed().as_secs_f64() * 1e3);
        let alive = v.hosts.iter().filter(|h| h.host.is_some()).count();
        if v.hosts.len() != o.hosts || alive != o.hosts {
            anyhow::bail!(
                "placement {k} read {} hosts ({alive} alive) of {}",
                v.hosts.len(),
                o.hosts
            );
        }
        let infos: Vec<HostInfo> = v.hosts.iter().map(HostInfo::from).collect();
        // A 32 GiB guest with 24 GiB of data, from host k.
        let src = k % infos.len();
        let c = placement::choose(&infos, src, 32 * GIB / 4096, 24 * GIB / 4096, None, None, 1)
            .map_err(|e| anyhow!("placement: {e}"))?;
        let mut want = vec![(infos[c.main].name.clone(), Pool::Guest, c.main_pages * 4096)];
        want.extend(
            c.subs
                .iter()
                .map(|(h, n)| (infos[*h].name.clone(), Pool::Lend, n * 4096)),
        );
        for (name, pool, bytes) in &want {
            if reg.claim_pool(name, *pool, *bytes)? {
                reg.release_pool(name, *pool, *bytes)?;
            }
        }
        placement_ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let etcd_cpu = pagefleet_lab::proc::cpu_secs(pid) - cpu0;
    log(&format!("{} simulated migrations", o.migrations));
    let mut writes = Vec::new();
    for k in 0..o.migrations {
        // What the daemons write for one split migration: the claims on
        // the main host and a sub-host, their releases, and both hosts'
        // records (the source without the guest, the destination with it).
        let (s, d, e) = (k % o.hosts, (k + 1) % o.hosts, (k + 2) % o.hosts);
        let r0 = reg.revision()?;
        let bytes = 4 * GIB;
        let claimed = reg.claim(&format!("sim{d}"), bytes)?;
        let lent = reg.claim_pool(&format!("sim{e}"), Pool::Lend, GIB)?;
        let moved = guest(format!("g{s}-0"), s, 0);
        let src_guests: Vec<GuestStatus> = (1..per_host)
            .map(|j| guest(format!("g{s}-{j}"), s, j))
            .collect();
        let mut dst_guests: Vec<GuestStatus> = (0..per_host)
            .map(|j| guest(format!("g{d}-{j}"), d, j))
            .collect();
        dst_guests.push(moved);
        reg.publish(
            &format!("sim{s}"),
            &format!("10.0.{s}.1:7071"),
            &report(s, 40 * GIB),
            &src_guests,
        )?;
        reg.publish(
            &format!("sim{d}"),
            &format!("10.0.{d}.1:7071"),
            &report(d, 20 * GIB),
            &dst_guests,
        )?;
        if claimed {
            reg.release(&format!("sim{d}"), bytes)?;
        }
        if lent {
            reg.release_pool(&format!("sim{e}"), Pool::Lend, GIB)?;
        }
        writes.push((reg.revision()? - r0) as f64);
    }
    let writes_per_migration = writes.iter().sum::<f64>() / writes.len().max(1) as f64;
    let mut r = Report {
        opts: o.clone(),
        register_secs,
        register_writes,
        placement_p50_ms: pct(&placement_ms, 0.5),
        placement_p99_ms: pct(&placement_ms, 0.99),
        view_p50_ms: pct(&view_ms, 0.5),
        direct_view_p50_ms: pct(&direct, 0.5),
        mirror_sync_secs,
        mirror_keys: mirror_keys as u64,
        mirror_bytes: mirror_bytes as u64,
        mirror_rss_bytes,
        placement_ms,
        view_bytes,
        hosts_view_bytes,
        full_view_p50_ms: pct(&full, 0.5),
        writes_per_migration,
        etcd_cpu_ms_per_placement: etcd_cpu * 1e3 / o.placements.max(1) as f64,
        goals: vec![],
        plot: PlotOutcome::default(),
    };
    r.goals = vec![
        Goal::at_most(
            &format!("placement p99 with {} hosts", o.hosts),
            r.placement_p99_ms,
            50.0,
            "ms",
        ),
        Goal::at_most(
            "etcd writes per migration",
            r.writes_per_migration,
            10.0,
            "writes",
        ),
    ];
    std::fs::create_dir_all(&o.out_dir)?;
    util::save_with_plot(
        &mut r,
        |r| &mut r.plot,
        &o.out_dir,
        "registry",
        include_str!("../../../bench/plot_registry.py"),
    )?;
    drop(etcd);
    Ok(r)
}

pub fn print_table(r: &Report, out: &mut dyn std::io::Write) -> std::io::Result<()> {
    writeln!(
        out,
        "etcd registry: {} simulated hosts, {} guests (one etcd member on loopback)",
        r.opts.hosts, r.opts.guests
    )?;
    writeln!(
        out,
        "  registered in {:.2} s ({} writes); the full view (status, gc) reads {:.1} MiB in {:.1} ms (p50), placement's hosts-only view {:.2} MiB",
        r.register_secs,
        r.register_writes,
        r.view_bytes as f64 / (1 << 20) as f64,
        r.full_view_p50_ms,
        r.hosts_view_bytes as f64 / (1 << 20) as f64
    )?;
    writeln!(
        out,
        "  placement (read the mirror as of now, choose, claim, release): p50 {:.1} ms, p99 {:.1} ms over {}; reading the mirror p50 {:.1} ms, etcd itself {:.1} ms",
        r.placement_p50_ms,
        r.placement_p99_ms,
        r.placement_ms.len(),
        r.view_p50_ms,
        r.direct_view_p50_ms
    )?;
    writeln!(
        out,
        "  the mirror: {} keys, {:.1} MiB of records, {:.1} MiB RSS, listed in {:.2} s",
        r.mirror_keys,
        r.mirror_bytes as f64 / (1 << 20) as f64,
        r.mirror_rss_bytes as f64 / (1 << 20) as f64,
        r.mirror_sync_secs
    )?;
    writeln!(
        out,
        "  etcd CPU per placement {:.2} ms; etcd writes per migration {:.1}",
        r.etcd_cpu_ms_per_placement, r.writes_per_migration
    )?;
    util::print_goals(&r.goals, out)?;
    r.plot.print(out)
}

/// `pagefleet bench registry`: the etcd registry with simulated hosts.
#[derive(clap::Args, Clone, Debug)]
pub struct Args {
    /// Simulated hosts (default 1000).
    #[arg(long)]
    pub hosts: Option<usize>,
    /// Simulated guests, spread evenly (default 10000).
    #[arg(long)]
    pub guests: Option<usize>,
}

impl crate::Benchmark for Args {
    type Report = Report;
    fn run(&self, c: &crate::Common, log: &mut dyn FnMut(&str)) -> Result<Report> {
        let mut o = c.opts(Opts::quick, Opts::full);
        if let Some(h) = self.hosts {
            o.hosts = h.max(2);
        }
        if let Some(g) = self.guests {
            o.guests = g;
        }
        run(&o, log)
    }
    fn print(r: &Report, out: &mut dyn std::io::Write) -> std::io::Result<()> {
        print_table(r, out)
    }
}
