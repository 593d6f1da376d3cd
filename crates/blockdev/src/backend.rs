//! The device's blocks on the memory servers: reads, writes, trims split by
//! the layout into runs that are contiguous on one server (at most 32 blocks,
//! 128 KiB — a memory-server frame), every copy written, reads from the
//! first copy that answers. A server that fails is marked down: a mirrored
//! device keeps working on the other copy.
//!
//! The device remembers which blocks were written ([`Written`], one bit a
//! block, kept by the export process): a never-written block reads as zeros
//! without asking a server, and a written block that no server holds any
//! more (a server restarted empty, its pages collected) is an I/O error,
//! never zeros.

use crate::layout::Translator;
use pagefleet_client::{Conn, ConnectOptions, GetMode, Pages};
use pagefleet_proto::auth::Secret;
use pagefleet_proto::MAX_BATCH_PAGES;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// The block size (one memory-server page).
pub const BLOCK: usize = pagefleet_proto::PAGE_SIZE;

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
    /// Which blocks hold data.
    pub written: Written,
    /// The name this device's sessions give the servers: the owner of its
    /// region, so a server counts the region in use while any is connected.
    pub client_name: String,
}

/// One bit per block: set once a write of the block was stored, cleared by
/// a trim. 32 MiB of bits for a 1 TiB device.
pub struct Written {
    words: Vec<AtomicU64>,
}

impl Written {
    /// A device of `blocks` blocks, none written.
    pub fn new(blocks: u64) -> Written {
        Written {
            words: (0..blocks.div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect(),
        }
    }

    fn each(&self, first: u64, count: u64, mut f: impl FnMut(&AtomicU64, u64)) {
        let (mut at, end) = (first, first + count);
        while at < end {
            let (w, bit) = ((at / 64) as usize, at % 64);
            let n = (64 - bit).min(end - at);
            let mask = if n == 64 {
                u64::MAX
            } else {
                ((1u64 << n) - 1) << bit
            };
            f(&self.words[w], mask);
            at += n;
        }
    }

    /// Mark `count` blocks from `first` written.
    pub fn set(&self, first: u64, count: u64) {
        self.each(first, count, |w, m| {
            w.fetch_or(m, Relaxed);
        });
    }

    /// Mark `count` blocks from `first` never written (trimmed).
    pub fn clear(&self, first: u64, count: u64) {
        self.each(first, count, |w, m| {
            w.fetch_and(!m, Relaxed);
        });
    }

    /// How many of `count` blocks from `first` are written.
    pub fn count(&self, first: u64, count: u64) -> u64 {
        let mut n = 0;
        self.each(first, count, |w, m| {
            n += (w.load(Relaxed) & m).count_ones() as u64
        });
        n
    }
}

/// Why one copy could not be read.
enum Fail {
    /// Its server is down.
    Down,
    /// Its server answered without a block that was written.
    Lost,
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
    /// The block was written, but no reachable server holds it any more.
    #[error("block {0} was written but no memory server holds it any more (a server restarted or its pages were freed)")]
    Lost(u64),
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
                name: self.sh.client_name.clone(),
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
            if self.sh.written.count(vb, n) == 0 {
                // Never written (or trimmed): zeros, no server asked.
                part.fill(0);
                continue;
            }
            let (mut done, mut lost) = (false, false);
            for runs in &copies {
                // The same virtual range on this copy may be split differently.
                let mine: Vec<_> = runs
                    .iter()
                    .filter(|r| r.0 < vb + n && r.0 + r.3 > vb)
                    .copied()
                    .collect();
                match self.read_runs(&mine, vb, part) {
                    Ok(()) => {
                        done = true;
                        break;
                    }
                    Err(Fail::Lost) => lost = true,
                    Err(Fail::Down) => {}
                }
            }
            if !done {
                return Err(if lost {
                    IoError::Lost(vb)
                } else {
                    IoError::Unreachable(vb)
                });
            }
        }
        Ok(())
    }

    fn read_runs(
        &mut self,
        runs: &[(u64, usize, u64, u64)],
        vb: u64,
        part: &mut [u8],
    ) -> Result<(), Fail> {
        let region = self.sh.region;
        let end = vb + (part.len() / BLOCK) as u64;
        for &(rv, s, sb, n) in runs {
            let (a, b) = (rv.max(vb), (rv + n).min(end));
            let dst = &mut part[((a - vb) as usize) * BLOCK..((b - vb) as usize) * BLOCK];
            let unwritten = (b - a) - self.sh.written.count(a, b - a);
            let Some(c) = self.conn(s) else {
                return Err(Fail::Down);
            };
            // Never-written blocks read as zeros; a written one the server
            // does not hold is lost on this copy.
            match c.get(
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
                Ok(missing) if missing > unwritten => {
                    self.mark_down(
                        s,
                        &format!(
                            "it no longer holds {} written block(s) of this device",
                            missing - unwritten
                        ),
                    );
                    return Err(Fail::Lost);
                }
                Ok(_) => {}
                Err(e) => {
                    self.mark_down(s, &e.to_string());
                    return Err(Fail::Down);
                }
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
            self.sh.written.set(first, count);
            Ok(())
        } else {
            Err(IoError::Unreachable(first))
        }
    }

    /// Drop blocks (they read as zeros again) on every reachable copy.
    pub fn trim(&mut self, first: u64, count: u64) -> Result<(), IoError> {
        let region = self.sh.region;
        // Cleared first: a read racing the delete sees zeros, not a loss.
        self.sh.written.clear(first, count);
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

#[cfg(test)]
mod tests {
    use super::Written;

    #[test]
    fn written_bits_count_set_and_clear_across_words() {
        let w = Written::new(300);
        assert_eq!(w.count(0, 300), 0);
        w.set(60, 70);
        assert_eq!(w.count(0, 300), 70);
        assert_eq!(w.count(59, 2), 1);
        assert_eq!(w.count(129, 2), 1);
        assert_eq!(w.count(64, 64), 64);
        w.clear(100, 10);
        assert_eq!(w.count(0, 300), 60);
        assert_eq!(w.count(100, 10), 0);
        w.set(0, 300);
        assert_eq!(w.count(0, 300), 300);
        w.clear(0, 300);
        assert_eq!(w.count(0, 300), 0);
    }
}
