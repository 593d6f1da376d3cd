//! What every connection of a device shares: its layout, servers, which
//! are down, and which blocks were written (the I/O itself is the
//! engine's, `crate::engine`).
//!
//! The device remembers which blocks were written ([`Written`], one bit a
//! block, kept by the export process): a never-written block reads as zeros
//! without asking a server, and a written block that no server holds any
//! more (a server restarted empty, its pages collected) is an I/O error,
//! never zeros.

use crate::layout::Translator;
use pagefleet_proto::auth::Secret;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

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

    /// Whether block `b` is written.
    pub fn is_set(&self, b: u64) -> bool {
        self.words[(b / 64) as usize].load(Relaxed) & (1 << (b % 64)) != 0
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
