//! The device's blocks on the memory servers: reads, writes, trims split by
//! the layout into runs that are contiguous on one server (at most 32 blocks,
//! 128 KiB — a memory-server frame), every copy written, reads from the
//! first copy that answers. A server that fails is marked down: a mirrored
//! device keeps working on the other copy.

use crate::layout::Translator;
use pagefleet_client::{Conn, ConnectOptions, GetMode, Pages};
use pagefleet_proto::auth::Secret;
use pagefleet_proto::MAX_BATCH_PAGES;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;

/// The block size (one memory-server page).
pub const BLOCK: usize = 4096;

/// What all connections share: the layout, the servers and which are down.
pub struct Shared {
    /// Where each block lives.
    pub t: Translator,
    /// The device's region id on the servers.
    pub region: u64,
    /// The memory servers.
    pub servers: Vec<String>,
    /// The cluster secret.
    pub secret: Secret,
    /// Servers seen down (mirrored reads skip them).
    pub down: Vec<AtomicBool>,
}

/// One worker's connections to the servers (opened lazily).
pub struct Backend {
    sh: Arc<Shared>,
    conns: Vec<Option<Conn>>,
}

/// A block request that cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum IoError {
    /// No copy of the block is reachable.
    #[error("no copy of block {0} is reachable")]
    Unreachable(u64),
    /// The servers are full.
    #[error("{0}")]
    NoSpace(String),
}

impl Backend {
    /// A worker over the shared state.
    pub fn new(sh: Arc<Shared>) -> Backend {
        let n = sh.servers.len();
        Backend {
            sh,
            conns: (0..n).map(|_| None).collect(),
        }
    }

    fn conn(&mut self, s: usize) -> Option<&mut Conn> {
        if self.sh.down[s].load(Relaxed) {
            return None;
        }
        if self.conns[s].is_none() {
            let opts = ConnectOptions {
                name: "pagefleet-blockdev".into(),
                window: 32,
                ..Default::default()
            };
            match Conn::connect(&self.sh.servers[s], &self.sh.secret, &opts) {
                Ok(c) => self.conns[s] = Some(c),
                Err(e) => {
                    self.mark_down(s, &e.to_string());
                    return None;
                }
            }
        }
        self.conns[s].as_mut()
    }

    fn mark_down(&mut self, s: usize, why: &str) {
        if !self.sh.down[s].swap(true, Relaxed) {
            tracing::warn!(
                "memory server {} is down ({why}); using the other copies",
                self.sh.servers[s]
            );
        }
        self.conns[s] = None;
    }

    /// Read `dst.len() / 4096` blocks from `first`.
    pub fn read(&mut self, first: u64, dst: &mut [u8]) -> Result<(), IoError> {
        let count = (dst.len() / BLOCK) as u64;
        let copies = self.sh.t.runs(first, count, MAX_BATCH_PAGES as u64);
        // Run by run, from the first copy that answers.
        for i in 0..copies[0].len() {
            let (vb, _, _, n) = copies[0][i];
            let lo = ((vb - first) as usize) * BLOCK;
            let part = &mut dst[lo..lo + n as usize * BLOCK];
            let mut done = false;
            for runs in &copies {
                // The same virtual range on this copy may be split differently.
                let mine: Vec<_> = runs
                    .iter()
                    .filter(|r| r.0 < vb + n && r.0 + r.3 > vb)
                    .copied()
                    .collect();
                if self.read_runs(&mine, vb, part).is_ok() {
                    done = true;
                    break;
                }
            }
            if !done {
                return Err(IoError::Unreachable(vb));
            }
        }
        Ok(())
    }

    fn read_runs(
        &mut self,
        runs: &[(u64, usize, u64, u64)],
        vb: u64,
        part: &mut [u8],
    ) -> Result<(), ()> {
        let region = self.sh.region;
        let end = vb + (part.len() / BLOCK) as u64;
        for &(rv, s, sb, n) in runs {
            let (a, b) = (rv.max(vb), (rv + n).min(end));
            let dst = &mut part[((a - vb) as usize) * BLOCK..((b - vb) as usize) * BLOCK];
            let Some(c) = self.conn(s) else {
                return Err(());
            };
            // Never-written blocks read as zeros.
            if let Err(e) = c.get(
                region,
                Pages::Run {
                    first: sb + (a - rv),
                    count: b - a,
                },
                dst,
                GetMode::Keep,
                true,
                MAX_BATCH_PAGES,
            ) {
                self.mark_down(s, &e.to_string());
                return Err(());
            }
        }
        Ok(())
    }

    /// Write whole blocks from `first`; every reachable copy.
    pub fn write(&mut self, first: u64, data: &[u8]) -> Result<(), IoError> {
        let count = (data.len() / BLOCK) as u64;
        let region = self.sh.region;
        let copies = self.sh.t.runs(first, count, MAX_BATCH_PAGES as u64);
        let mut written = vec![false; copies.len()];
        for (ci, runs) in copies.iter().enumerate() {
            let mut ok = true;
            for &(vb, s, sb, n) in runs {
                let lo = ((vb - first) as usize) * BLOCK;
                let Some(c) = self.conn(s) else {
                    ok = false;
                    break;
                };
                match c.put(
                    region,
                    Pages::Run {
                        first: sb,
                        count: n,
                    },
                    &data[lo..lo + n as usize * BLOCK],
                    MAX_BATCH_PAGES,
                ) {
                    Ok(_) => {}
                    Err(e) if e.code() == Some(pagefleet_proto::ErrorCode::OutOfCapacity) => {
                        return Err(IoError::NoSpace(format!(
                            "memory server {} is full",
                            self.sh.servers[s]
                        )));
                    }
                    Err(e) => {
                        self.mark_down(s, &e.to_string());
                        ok = false;
                        break;
                    }
                }
            }
            written[ci] = ok;
        }
        if written.iter().any(|w| *w) {
            Ok(())
        } else {
            Err(IoError::Unreachable(first))
        }
    }

    /// Drop blocks (they read as zeros again) on every reachable copy.
    pub fn trim(&mut self, first: u64, count: u64) -> Result<(), IoError> {
        let region = self.sh.region;
        let copies = self.sh.t.runs(first, count, u32::MAX as u64);
        let mut any = false;
        for runs in &copies {
            let mut ok = true;
            for &(_, s, sb, n) in runs {
                let Some(c) = self.conn(s) else {
                    ok = false;
                    continue;
                };
                if let Err(e) = c.delete(
                    region,
                    Pages::Run {
                        first: sb,
                        count: n,
                    },
                ) {
                    self.mark_down(s, &e.to_string());
                    ok = false;
                }
            }
            any |= ok;
        }
        if any {
            Ok(())
        } else {
            Err(IoError::Unreachable(first))
        }
    }
}
