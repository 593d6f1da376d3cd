//! LRU-2 (O'Neil, O'Neil and Weikum, SIGMOD 1993): the victim is the chunk
//! whose pages' second most recent use is oldest, so a page used once — a
//! scan passing through — goes before a page used twice, however recently
//! the scan touched it.
//!
//! The history is aging's byte (one bit per sampling period, newest
//! highest) with the reference bit as a ninth, newest bit, so the backward
//! 2-distance is known to a sampling period: the position of the second
//! highest set bit. Pages used at most once rank by that one use (LRU
//! among them, the paper's tie-break).
//!
//! The paper's *correlated reference period*: a chunk used in the current
//! sampling period goes only when every chunk the hand looks at was, and
//! then by the same order (a page of a scan, used once, before a page used
//! before). A page just brought in (one use, an infinite 2-distance: the
//! first victim by the rank alone) is not evicted by the balancing its
//! own arrival started: the hand passes over it ([`super::Hand`]) for
//! every policy.
//!
//! The history outlives a page's eviction (the pager keeps every page's
//! byte), so a page that comes back brings its earlier uses with it: the
//! paper's retained information.

use super::{Look, VictimPolicy};

/// A chunk used in the current sampling period ranks above every chunk
/// that is not.
const CORRELATED: u32 = 1 << 18;

pub(super) struct Lru2;

/// A page's rank: in its correlated period or not, then its second most
/// recent use, then its most recent (each as the value of its history bit).
fn rank(age: u8, referenced: u8) -> u32 {
    let h = age as u32 | (referenced as u32) << 8;
    if h == 0 {
        return 0;
    }
    let top = 1u32 << (31 - h.leading_zeros());
    let rest = h ^ top;
    let second = if rest == 0 {
        0
    } else {
        1u32 << (31 - rest.leading_zeros())
    };
    let r = second << 9 | top;
    if referenced != 0 {
        r | CORRELATED
    } else {
        r
    }
}

impl VictimPolicy for Lru2 {
    fn aged(&self, age: u8, referenced: u8) -> u8 {
        (age >> 1) | (referenced << 7)
    }

    fn hotness(&self, age: &[u8], refb: &[u8]) -> u32 {
        age.iter()
            .zip(refb)
            .map(|(a, b)| rank(*a, *b))
            .max()
            .unwrap_or(0)
    }

    fn adopted(&self, byte: u8) -> u8 {
        byte
    }

    /// The lowest-ranked whole chunk of a window; a chunk in its
    /// correlated period counts as busy ([`Look::coldest_whole_chunk`]).
    fn next_victim(&mut self, look: &mut Look<'_>) -> Option<(usize, u64)> {
        look.coldest_whole_chunk(|age, refb| self.hotness(age, refb), CORRELATED)
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::Sim;
    use super::super::NoProbe;
    use super::*;
    use crate::Policy;

    #[test]
    fn the_second_use_ranks_before_the_first() {
        // Used twice long ago beats used once just before now.
        assert!(rank(0b0100_0001, 0) > rank(0b1000_0000, 0));
        // Among pages used once, the later use ranks higher (LRU).
        assert!(rank(0b1000_0000, 0) > rank(0b0000_0100, 0));
        // The current period outranks any history, and within it a page
        // used before outranks one used now only.
        assert!(rank(0b0000_0001, 1) > rank(0b1111_1111, 0));
        assert!(rank(0b0000_0001, 1) > rank(0, 1));
        assert_eq!(rank(0, 0), 0);
    }

    #[test]
    fn a_page_used_once_goes_before_one_used_twice() {
        let mut sim = Sim::new(64, 4, 64, Policy::Lru2);
        // Chunks 0..8 used in two periods, chunks 8..16 in the last only.
        for p in 0..32 {
            sim.touch(p, None);
        }
        sim.sweep();
        sim.sweep();
        for p in 0..64 {
            sim.touch(p, None);
        }
        sim.sweep();
        let batch = sim
            .hand
            .batch(&sim.loc, &mut sim.access, &mut NoProbe, 60, 4);
        assert!(batch.iter().all(|&p| p >= 32), "{batch:?}");
        assert_eq!(batch.len(), 4);
    }

    /// A hot set used every round, a scan of pages used once each
    /// streaming through, sampled every round: the scan goes, the hot set
    /// stays.
    #[test]
    fn a_scan_does_not_flush_a_set_used_every_round() {
        let mut sim = Sim::new(16384, 4, 256, Policy::Lru2);
        let mut scan = 1024..16384;
        let mut worst = 0;
        for round in 0..40 {
            let before = sim.faults;
            for p in 0..128 {
                sim.touch(p, None);
            }
            if round >= 8 {
                worst = worst.max(sim.faults - before);
            }
            for _ in 0..256 {
                let p = scan.next().unwrap();
                sim.touch(p, None);
            }
            sim.sweep();
        }
        assert_eq!(worst, 0, "hot pages faulted in a round");
    }
}
