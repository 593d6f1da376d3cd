//! Aging: eight history bits per page, shifted right at each sampling
//! sweep with the newest reference bit entering at the top; a chunk's
//! hotness is its pages' highest age, and the victim is the coldest whole
//! chunk of a window of resident chunks. Its reference bits come from the
//! sampling hand alone, within the sampling CPU budget: far fewer minor
//! faults than clock.

use super::{Look, VictimPolicy};

/// Hotness of a chunk referenced since the last sweep.
const USED_NOW: u32 = 1 << 8;

pub(super) struct Aging;

impl VictimPolicy for Aging {
    fn aged(&self, age: u8, referenced: u8) -> u8 {
        (age >> 1) | (referenced << 7)
    }

    /// The highest age, a reference since the last sweep counting as a
    /// ninth, newest bit (used now ranks above used last period).
    fn hotness(&self, age: &[u8], refb: &[u8]) -> u32 {
        age.iter()
            .zip(refb)
            .map(|(a, b)| *a as u32 | ((*b as u32) << 8))
            .max()
            .unwrap_or(0)
    }

    fn adopted(&self, byte: u8) -> u8 {
        byte
    }

    /// The coldest whole chunk of a window; a chunk used since the last
    /// sweep counts as busy ([`Look::coldest_whole_chunk`]).
    fn next_victim(&mut self, look: &mut Look<'_>) -> Option<(usize, u64)> {
        look.coldest_whole_chunk(|age, refb| self.hotness(age, refb), USED_NOW)
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::Sim;
    use super::super::NoProbe;
    use crate::Policy;

    #[test]
    fn hotness_ranks_recency() {
        let sim = &mut Sim::new(32, 16, 32, Policy::Aging);
        sim.access.refb[1] = 1; // chunk 0 used long ago
        sim.sweep();
        sim.sweep();
        sim.access.refb[20] = 1; // chunk 1 used just now
        sim.sweep();
        assert!(sim.hand.hotness(&sim.access, 16, 32) > sim.hand.hotness(&sim.access, 0, 16));
        sim.access.clear(16, 32);
        assert_eq!(sim.hand.hotness(&sim.access, 16, 32), 0);
        assert_eq!(sim.access.byte(1), 0b0010_0000);
    }

    #[test]
    fn aging_evicts_the_chunk_used_longest_ago() {
        let mut sim = Sim::new(64, 4, 64, Policy::Aging);
        for p in 0..64 {
            sim.touch(p, None);
        }
        sim.sweep();
        sim.sweep();
        // Every chunk but 9 is used again in the current period.
        for c in (0..16).filter(|c| *c != 9) {
            sim.touch(c * 4, None);
        }
        let batch = sim
            .hand
            .batch(&sim.loc, &mut sim.access, &mut NoProbe, 63, 1);
        assert_eq!(
            batch,
            (36..40).collect::<Vec<_>>(),
            "the pages of chunk 9, the only chunk not used lately, go"
        );
    }
}
