//! Split migration (S-memV): a running guest's region goes live to one main
//! host (hot pages with their access history, over a migration stream to a
//! runner there) and to sub-hosts' memory servers (cold pages, as plain
//! page-outs) — never main→sub — and resumes on the main host, which then
//! pages with the sub-hosts. See docs/migration.md.

pub mod dest;
pub mod placement;
pub mod plan;
pub mod source;
pub mod wire;

use pagefleet_client::{Conn, ConnectOptions, GetMode, Pages};
use pagefleet_proto::auth::Secret;
use pagefleet_region::{Location, Region, PAGE};
use std::os::fd::AsRawFd;

/// What a destination needs to resume a guest (the SPEC message).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Spec {
    pub name: String,
    pub size: u64,
    pub chunk_pages: usize,
    pub policy: String,
    pub region_id: u64,
    /// Memory servers the guest's pages may be on (LOCATED indexes this).
    pub servers: Vec<String>,
    pub budget_pages: u64,
    /// The workload and its parameters (the runner interprets it).
    pub workload: serde_json::Value,
    pub verify: bool,
    /// Integrated migration: the destination also pulls every page that is
    /// on a memory server, so the whole guest ends up on it.
    #[serde(default)]
    pub gather: bool,
}

/// The outcome of a migration, as `pagefleet migrate` prints it.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Report {
    pub guest: String,
    pub main_host: String,
    pub sub_hosts: Vec<String>,
    /// Start to resumed at the destination (checksum time excluded).
    pub total_secs: f64,
    /// Guest paused to guest running at the destination (checksum time excluded).
    pub downtime_ms: f64,
    pub rounds: usize,
    pub last_round_pages: u64,
    pub pages_main: u64,
    pub pages_subs: Vec<u64>,
    pub bytes_main: u64,
    pub bytes_subs: Vec<u64>,
    pub pages_sent_twice: u64,
    pub round1_secs: f64,
    pub round1_bytes: u64,
    pub region_build_ms: f64,
    /// Gather: pages the destination pulled from memory servers, and pulled
    /// copies that newer data from the main host replaced.
    #[serde(default)]
    pub pages_pulled: u64,
    #[serde(default)]
    pub pulled_then_replaced: u64,
    /// Downtime parts: reaching the safepoint, the last round, COMMIT to
    /// PREPARED (the destination builds its region), GO to STARTED.
    #[serde(default)]
    pub pause_ms: f64,
    #[serde(default)]
    pub final_copy_ms: f64,
    #[serde(default)]
    pub commit_ms: f64,
    #[serde(default)]
    pub start_ms: f64,
    pub checksum_source: Option<String>,
    pub checksum_dest: Option<String>,
}

impl Report {
    pub fn print(&self) {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        println!(
            "migrated {} to {} in {:.2} s, downtime {:.1} ms, {} rounds",
            self.guest, self.main_host, self.total_secs, self.downtime_ms, self.rounds
        );
        println!(
            "  main host {:<22} {:>8} pages  {:>9.1} MiB sent",
            self.main_host,
            self.pages_main,
            mib(self.bytes_main)
        );
        for (i, s) in self.sub_hosts.iter().enumerate() {
            println!(
                "  sub-host  {:<22} {:>8} pages  {:>9.1} MiB sent",
                s,
                self.pages_subs[i],
                mib(self.bytes_subs[i])
            );
        }
        if self.pages_pulled > 0 {
            println!(
                "  pulled from memory servers by the destination: {} pages ({} replaced by newer data from the main host)",
                self.pages_pulled, self.pulled_then_replaced
            );
        }
        println!(
            "  round 1: {:.1} MiB in {:.2} s ({:.0} MiB/s); pages sent twice: {}; last round {} pages",
            mib(self.round1_bytes),
            self.round1_secs,
            mib(self.round1_bytes) / self.round1_secs.max(1e-9),
            self.pages_sent_twice,
            self.last_round_pages
        );
        println!(
            "  downtime: pause {:.1} ms, last round {:.1} ms, destination builds its region {:.1} ms (of which {:.1} ms in the runtime), start {:.1} ms",
            self.pause_ms, self.final_copy_ms, self.commit_ms, self.region_build_ms, self.start_ms
        );
        if let (Some(a), Some(b)) = (&self.checksum_source, &self.checksum_dest) {
            println!(
                "  region checksum at stop {a}, at resume {b}: {}",
                if a == b { "equal" } else { "DIFFERENT" }
            );
        }
    }
}

/// Read whole pages of the region's memfd without faulting (holes read as zeros).
pub fn pread_pages(fd: i32, first: u64, dst: &mut [u8]) -> std::io::Result<()> {
    let mut done = 0;
    while done < dst.len() {
        // SAFETY: writing into our own buffer.
        let n = unsafe {
            libc::pread(
                fd,
                dst[done..].as_mut_ptr().cast(),
                dst.len() - done,
                (first as usize * PAGE + done) as i64,
            )
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            dst[done..].fill(0);
            break;
        }
        done += n as usize;
    }
    Ok(())
}

/// A checksum of the region's content wherever each page is (local pages
/// read from the memfd, remote pages fetched without taking them, never
/// touched pages as zeros), without disturbing paging. Order-independent:
/// the wrapping sum of per-page xxh3 hashes seeded with the page number.
pub fn checksum(region: &Region, secret: &Secret) -> Result<String, String> {
    let snap = region
        .snapshot()
        .ok_or("the region's pager did not answer")?;
    let fd = region.memfd().as_raw_fd();
    let zero = vec![0u8; PAGE];
    let mut sum = 0u64;
    let mut buf = vec![0u8; 64 * PAGE];
    let mut remote: Vec<Vec<u64>> = vec![Vec::new(); snap.servers.len()];
    let mut p = 0usize;
    while p < snap.location.len() {
        match snap.location[p] {
            Location::Zero => {
                sum = sum.wrapping_add(xxhash_rust::xxh3::xxh3_64_with_seed(&zero, p as u64));
                p += 1;
            }
            Location::Remote(s) => {
                remote[s].push(p as u64);
                p += 1;
            }
            Location::Local => {
                let mut n = 1;
                while n < 64
                    && p + n < snap.location.len()
                    && snap.location[p + n] == Location::Local
                {
                    n += 1;
                }
                pread_pages(fd, p as u64, &mut buf[..n * PAGE])
                    .map_err(|e| format!("reading the region: {e}"))?;
                for k in 0..n {
                    sum = sum.wrapping_add(xxhash_rust::xxh3::xxh3_64_with_seed(
                        &buf[k * PAGE..(k + 1) * PAGE],
                        (p + k) as u64,
                    ));
                }
                p += n;
            }
        }
    }
    for (s, list) in remote.iter().enumerate() {
        if list.is_empty() {
            continue;
        }
        let opts = ConnectOptions {
            name: "pagefleet-checksum".into(),
            ..Default::default()
        };
        let mut c = Conn::connect(&snap.servers[s], secret, &opts).map_err(|e| e.to_string())?;
        for part in list.chunks(1024) {
            let mut data = vec![0u8; part.len() * PAGE];
            let missing = c
                .get(
                    snap.region_id,
                    Pages::List(part),
                    &mut data,
                    GetMode::Keep,
                    false,
                    32,
                )
                .map_err(|e| format!("{}: {e}", snap.servers[s]))?;
            if missing > 0 {
                return Err(format!("{}: {missing} pages missing", snap.servers[s]));
            }
            for (k, &q) in part.iter().enumerate() {
                sum = sum.wrapping_add(xxhash_rust::xxh3::xxh3_64_with_seed(
                    &data[k * PAGE..(k + 1) * PAGE],
                    q,
                ));
            }
        }
    }
    Ok(format!("{sum:016x}"))
}
