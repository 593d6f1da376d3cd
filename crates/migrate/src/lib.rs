//! Split migration (S-memV): a running guest's region goes live to one main
//! host (hot pages with their access history, over a migration stream to a
//! runner there) and to sub-hosts' memory servers (cold pages, as plain
//! page-outs) — never main→sub — and resumes on the main host, which then
//! pages with the sub-hosts. See docs/migration.md.

pub mod choice;
pub mod dedup;
pub mod dest;
mod fill;
mod landing;
mod outcome;
pub mod placement;
pub mod plan;
pub mod source;
mod sub_dedup;
mod sys;
pub mod wire;
pub use sys::pread_pages;

use pagefleet_client::{Conn, ConnectOptions, GetMode, Pages};
use pagefleet_proto::auth::Secret;
use pagefleet_region::{Location, Region, PAGE};
use std::os::fd::AsFd;

/// What a destination needs to resume a guest (the SPEC message).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Spec {
    /// The guest's name.
    pub name: String,
    /// Guest memory, bytes.
    pub size: u64,
    /// Pages per chunk on the destination.
    pub chunk_pages: usize,
    /// Paging policy on the destination.
    pub policy: pagefleet_api::Policy,
    /// The region's id on the memory servers (kept).
    pub region_id: u64,
    /// Memory servers the guest's pages may be on (LOCATED indexes this).
    pub servers: Vec<String>,
    /// Pages the destination keeps resident.
    pub budget_pages: u64,
    /// The workload and its parameters (the runner starts it).
    pub workload: pagefleet_api::GuestSpec,
    /// Compare region checksums at stop and at resume.
    pub verify: bool,
    /// Integrated migration: the destination also pulls every page that is
    /// on a memory server, so the whole guest ends up on it.
    #[serde(default)]
    pub gather: bool,
}

pub use pagefleet_api::Report;

/// Why a region's checksum could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum ChecksumError {
    /// The region's pager did not answer.
    #[error("the region's pager did not answer")]
    PagerGone,
    /// Reading its memfd failed.
    #[error("reading the region: {0}")]
    Read(#[from] std::io::Error),
    /// A memory server holding some of its pages failed.
    #[error(transparent)]
    Server(#[from] pagefleet_client::ClientError),
    /// A memory server lacks pages the region places there.
    #[error("{server}: {pages} pages missing")]
    Missing {
        /// The memory server.
        server: String,
        /// How many are missing.
        pages: u64,
    },
}

/// A checksum of the region's content wherever each page is (local pages
/// read from the memfd, remote pages fetched without taking them, never
/// touched pages as zeros), without disturbing paging. Order-independent:
/// the wrapping sum of per-page xxh3 hashes seeded with the page number.
pub fn checksum(region: &Region, secret: &Secret) -> Result<String, ChecksumError> {
    let snap = region.snapshot().ok_or(ChecksumError::PagerGone)?;
    let fd = region.memfd().as_fd();
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
            Location::Remote(s, _) => {
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
                pread_pages(fd, p as u64, &mut buf[..n * PAGE])?;
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
        let mut c = Conn::connect(&snap.servers[s], secret, &opts)?;
        for part in list.chunks(1024) {
            let mut data = vec![0u8; part.len() * PAGE];
            let missing = c.get(
                snap.region_id,
                Pages::List(part),
                &mut data,
                GetMode::Keep,
                false,
                32,
            )?;
            if missing > 0 {
                return Err(ChecksumError::Missing {
                    server: snap.servers[s].clone(),
                    pages: missing as u64,
                });
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
