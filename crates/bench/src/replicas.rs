//! Replicated remote memory, measured: how long re-replication takes to
//! restore two copies after a memory server's death, against the time to
//! send the same bytes over the same link (a pipelined PUT stream to a
//! memory server) in the same run.
//!
//! The region is 1.5x the measured size over three servers with two
//! replicas, so each server holds a copy of about the measured size; one
//! is killed (SIGKILL) and re-replication (unlimited bandwidth) copies
//! every page that lost its second copy to the server left without it.
//! Every page is then read back and checked: the bytes lost are counted.

use crate::util::ChildDaemon;
use anyhow::{bail, Result};
use pagefleet_client::{Conn, ConnectOptions, Pages};
use pagefleet_proto::auth::Secret;
use serde::Serialize;
use std::path::Path;
use std::time::{Duration, Instant};

const PAGE: usize = pagefleet_region::PAGE;

#[derive(Clone, Debug, Serialize)]
pub struct Restore {
    /// The region's size, bytes.
    pub region_bytes: u64,
    /// Pages that lost a copy with the server and got it back, bytes.
    pub restored_bytes: u64,
    /// From the kill until no page had a single copy, s.
    pub restore_secs: f64,
    /// Of which: until the pager called the server down, s.
    pub detect_secs: f64,
    /// The same link: a pipelined PUT stream of `restored_bytes` to a memory server, s.
    pub link_secs: f64,
    /// restore_secs / link_secs.
    pub ratio: f64,
    /// Every run's ratio, when this is the median of several.
    pub runs_ratio: Vec<f64>,
    /// Pages whose content was wrong after the restore (must be 0).
    pub pages_wrong: u64,
    /// Re-replication's default bandwidth limit (the measurement ran without it), bytes/s.
    pub default_rate_limit: u64,
}

/// A restore measured `runs` times, each against its own link figure (one
/// measurement of a 1–2 s restore swung 1.5x–4x on these machines): the
/// run with the median ratio, every run's ratio, and the wrong pages of all
/// runs together.
pub fn restore_runs(
    bytes: u64,
    runs: usize,
    secret_path: &Path,
    secret: &Secret,
) -> Result<Restore> {
    let mut all: Vec<Restore> = (0..runs.max(1))
        .map(|_| restore(bytes, secret_path, secret))
        .collect::<Result<_>>()?;
    let ratios: Vec<f64> = all.iter().map(|r| r.ratio).collect();
    let wrong = all.iter().map(|r| r.pages_wrong).sum();
    all.sort_by(|a, b| a.ratio.total_cmp(&b.ratio));
    let mut mid = all.swap_remove(all.len() / 2);
    mid.runs_ratio = ratios;
    mid.pages_wrong = wrong;
    Ok(mid)
}

/// Measure a restore of about `bytes` of copies.
pub fn restore(bytes: u64, secret_path: &Path, secret: &Secret) -> Result<Restore> {
    let region_bytes = bytes / 2 * 3;
    let pages = region_bytes / PAGE as u64;
    // Room for a third of the copies more on each after the death.
    let lend = bytes * 3 / 2 + (64 << 20);
    let mut servers: Vec<ChildDaemon> = (0..3)
        .map(|_| ChildDaemon::start(lend, secret_path))
        .collect::<Result<_>>()?;
    let mut cfg = pagefleet_region::Config::new(region_bytes, 16384);
    cfg.servers = servers.iter().map(|s| s.addr.clone()).collect();
    cfg.secret = Some(secret.clone());
    cfg.replicas = 2;
    cfg.rereplicate_rate = 0;
    cfg.sample_cpu_budget = 0.0;
    let r = pagefleet_region::Region::new(cfg)?;
    let base = r.as_ptr();
    for p in 0..pages {
        // SAFETY: inside the region's mapping.
        unsafe { std::ptr::write_volatile(base.add(p as usize * PAGE) as *mut u64, p ^ 0x5eed) };
    }
    let t = Instant::now();
    while r.stats().resident_pages > 16384 && t.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(5));
    }
    let st = r.stats();
    if st.servers_down > 0 || st.rereplicated_pages > 0 {
        bail!("a server was down before the drill: {st:?}");
    }
    let t0 = Instant::now();
    servers[0].kill();
    let mut detect = None;
    loop {
        let st = r.stats();
        if st.servers_down > 0 && detect.is_none() {
            detect = Some(t0.elapsed());
        }
        if st.servers_down > 0 && st.degraded_pages == 0 {
            break;
        }
        if t0.elapsed() > Duration::from_secs(300) {
            bail!("two copies not restored within 300 s: {st:?}");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let restore_secs = t0.elapsed().as_secs_f64();
    let st = r.stats();
    let restored_bytes = st.rereplicated_pages * PAGE as u64;
    // Every page back, every value checked.
    let mut wrong = 0;
    for p in 0..pages {
        // SAFETY: inside the region's mapping.
        let v = unsafe { std::ptr::read_volatile(base.add(p as usize * PAGE) as *const u64) };
        wrong += (v != p ^ 0x5eed) as u64;
    }
    drop(r);
    // The same link: the restored bytes as one pipelined PUT stream.
    let link_secs = put_stream(&servers[1].addr, secret, restored_bytes)?;
    Ok(Restore {
        region_bytes,
        restored_bytes,
        restore_secs,
        detect_secs: detect.unwrap_or_default().as_secs_f64(),
        link_secs,
        ratio: restore_secs / link_secs.max(1e-9),
        runs_ratio: Vec::new(),
        pages_wrong: wrong,
        default_rate_limit: pagefleet_region::DEFAULT_REREPLICATE_RATE,
    })
}

/// Seconds to store `bytes` on the server at `addr` as a pipelined PUT
/// stream (4 MiB calls of 32-page frames, a window of 16), then drop them.
/// The data comes from a 256 MiB buffer, far larger than the caches, as
/// a restore's pages come from a server's memory (not from a 4 MiB buffer
/// that stays in cache).
fn put_stream(addr: &str, secret: &Secret, bytes: u64) -> Result<f64> {
    let opts = ConnectOptions {
        name: "bench-link".into(),
        window: 16,
        ..Default::default()
    };
    let mut c = Conn::connect(addr, secret, &opts)?;
    let region = pagefleet_proto::auth::random_u64() | 1;
    let src = vec![0x5au8; 256 << 20];
    let call = 4usize << 20;
    let per = (call / PAGE) as u64;
    let calls = (bytes / PAGE as u64).div_ceil(per);
    let t = Instant::now();
    for i in 0..calls {
        let at = (i as usize * call) % src.len();
        c.put(
            region,
            Pages::Run {
                first: i * per,
                count: per,
            },
            &src[at..at + call],
            pagefleet_proto::MAX_BATCH_PAGES,
        )?;
    }
    let secs = t.elapsed().as_secs_f64() * (bytes as f64 / (calls * per * PAGE as u64) as f64);
    let _ = c.delete_region(region);
    Ok(secs)
}
