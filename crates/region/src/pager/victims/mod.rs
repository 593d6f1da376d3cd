//! Victim choice: which resident chunks leave when a region is over its
//! budget. The [`Hand`] walks resident chunks in address order; a
//! [`VictimPolicy`] decides at each chunk it is shown (one file each:
//! [`clock`], [`aging`], [`lru2`]). A policy reads only the location DB,
//! the access history and what a reference probe adds to it just before it
//! looks at a chunk (the pager's probe reads which pages were touched since
//! they were last unmapped, [`super::refs`]), so the tests here run every
//! policy against an in-memory region and server, without a kernel.
//!
//! Adding a policy: a file here implementing [`VictimPolicy`], its variant
//! in `pagefleet_api::Policy` (the one name list), and its arm in
//! [`Victims::new`].

mod aging;
mod clock;
mod lru2;

use super::location::{AccessHistory, LocationDb};
use crate::Policy;

/// What a victim policy decides; the [`Hand`] and the [`Victims`] around
/// it do the walking and the bookkeeping every policy shares.
pub(super) trait VictimPolicy: Send {
    /// A page's history byte after the sampling hand passed it, from the
    /// byte before and its reference bit (1: used since the last pass).
    fn aged(&self, age: u8, referenced: u8) -> u8;
    /// The sampling hand passes a chunk: each page's history byte aged by
    /// its reference bit, the bits cleared. (A provided method, so the
    /// per-page loop is compiled per policy: one virtual call per chunk.)
    fn sweep(&self, age: &mut [u8], refb: &mut [u8]) {
        for (a, r) in age.iter_mut().zip(refb.iter_mut()) {
            *a = self.aged(*a, *r);
            *r = 0;
        }
    }
    /// How hot a chunk is from its pages' history bytes and reference
    /// bits (0: no use in its history); higher stays longer.
    fn hotness(&self, age: &[u8], refb: &[u8]) -> u32;
    /// A migrated page's history byte as this policy keeps it, from the
    /// source's byte (its history with the reference bit as the newest bit,
    /// `AccessHistory::byte`).
    fn adopted(&self, byte: u8) -> u8;
    /// Whether this policy's own look at a chunk reads the page tables and
    /// re-arms what it spares (clock): then the sampling hand rests while
    /// victims are being chosen, its unmaps would only add minor faults.
    fn reads_refs_itself(&self) -> bool {
        false
    }
    /// The next chunk to evict from and which of its pages (bit i: page i
    /// of the chunk), or None when no resident chunk is left to look at.
    fn next_victim(&mut self, look: &mut Look<'_>) -> Option<(usize, u64)>;
}

/// Brings the access history of a chunk up to date just before a policy
/// looks at it (sets the reference bits of pages used since last seen).
pub(super) trait RefProbe {
    fn refresh(&mut self, chunk: usize, access: &mut AccessHistory);
}

/// A probe that adds nothing: the history as it stands (the in-memory
/// tests set reference bits on every touch themselves).
#[cfg(test)]
pub(super) struct NoProbe;

#[cfg(test)]
impl RefProbe for NoProbe {
    fn refresh(&mut self, _: usize, _: &mut AccessHistory) {}
}

/// Chunks a window search ([`Look::coldest_whole_chunk`]) compares before
/// it picks the coldest.
const WINDOW: usize = 32;
/// How far it looks while every chunk seen is busy.
const MAX_SCAN: usize = 8 * WINDOW;

/// Where the victim search stands: a position over the region's chunks,
/// and which chunks had pages brought in since the last batch.
pub(super) struct Hand {
    pos: usize,
    chunks: usize,
    cp: usize,
    /// Per chunk: the balancing round in which a page last came in. A
    /// chunk whose page came in during this round is passed over (unless
    /// every resident chunk did): a page brought in is not evicted by the
    /// balancing its own arrival started, before the guest could use it,
    /// whatever the policy makes of a page with one use.
    arrived: Vec<u32>,
    /// This round's number (starts at 1: 0 marks "never").
    round: u32,
}

/// What a policy sees while it looks for one victim: the hand, the region's
/// state, the probe, and the chunks it gave a second chance (their pages
/// must be unmapped again so that a later touch shows).
pub(super) struct Look<'a> {
    hand: &'a mut Hand,
    loc: &'a LocationDb,
    access: &'a mut AccessHistory,
    probe: &'a mut dyn RefProbe,
    spared: &'a mut Vec<usize>,
    /// Chunks the hand passed in this batch.
    steps: usize,
    /// Every resident chunk was just brought in: the walk takes them.
    take_fresh: bool,
}

impl Look<'_> {
    /// The next chunk with resident pages (not one just brought in, unless
    /// there is no other), or None if there is none.
    fn next_resident(&mut self) -> Option<usize> {
        for _ in 0..2 {
            let mut fresh = false;
            for _ in 0..self.hand.chunks {
                let c = self.hand.pos;
                self.hand.pos = (self.hand.pos + 1) % self.hand.chunks;
                self.steps += 1;
                if self.loc.chunk_res[c] == 0 {
                    continue;
                }
                if self.hand.arrived[c] != self.hand.round || self.take_fresh {
                    return Some(c);
                }
                fresh = true;
            }
            if !fresh {
                break;
            }
            // A lap met only chunks just brought in: they go too.
            self.take_fresh = true;
        }
        None
    }

    /// Continue the walk right after chunk `c`.
    fn resume_after(&mut self, c: usize) {
        self.hand.pos = (c + 1) % self.hand.chunks;
    }

    /// The hand went round twice in this batch without finding enough:
    /// take what comes.
    fn desperate(&self) -> bool {
        self.steps > self.hand.chunks * 2
    }

    /// Pages per chunk.
    fn cp(&self) -> usize {
        self.hand.cp
    }

    /// Every page of a chunk.
    fn all(&self) -> u64 {
        u64::MAX >> (64 - self.hand.cp)
    }

    /// Chunk `c`'s history brought up to date by the probe: (age, refb).
    fn history(&mut self, c: usize) -> (&[u8], &[u8]) {
        self.probe.refresh(c, self.access);
        let (lo, hi) = (c * self.hand.cp, (c + 1) * self.hand.cp);
        (&self.access.age[lo..hi], &self.access.refb[lo..hi])
    }

    /// The whole chunk ranked lowest by `hotness` among the next
    /// [`WINDOW`] resident chunks — looking further, up to [`MAX_SCAN`],
    /// while every chunk seen ranks `busy` or above (a hot span wider than a
    /// window is not eaten chunk by chunk as the hand passes it); a chunk
    /// of rank 0 ends the search. The walk resumes right after the victim,
    /// so the rest of the window is looked at again. (Aging and LRU-2.)
    fn coldest_whole_chunk(
        &mut self,
        hotness: impl Fn(&[u8], &[u8]) -> u32,
        busy: u32,
    ) -> Option<(usize, u64)> {
        let mut best: Option<(u32, usize)> = None;
        let mut seen = 0;
        while seen < WINDOW || (best.is_some_and(|(bh, _)| bh >= busy) && seen < MAX_SCAN) {
            let Some(c) = self.next_resident() else {
                break;
            };
            let (age, refb) = self.history(c);
            let h = hotness(age, refb);
            if best.is_none_or(|(bh, _)| h < bh) {
                best = Some((h, c));
            }
            seen += 1;
            if h == 0 {
                break;
            }
        }
        let (_, c) = best?;
        self.resume_after(c);
        Some((c, self.all()))
    }

    /// Second chance for chunk `c`: its history counts as unused from now
    /// on and its pages are unmapped again (by the sampler's next tick).
    fn spare(&mut self, c: usize) {
        let lo = c * self.hand.cp;
        self.access.clear(lo, lo + self.hand.cp);
        self.spared.push(c);
    }
}

/// The victim hand and the policy that runs it.
pub(super) struct Victims {
    hand: Hand,
    policy: Box<dyn VictimPolicy>,
    /// Chunks given a second chance by the last `batch`: their pages must
    /// be unmapped again so that a later touch shows.
    pub(super) spared: Vec<usize>,
}

impl Victims {
    /// The hand over `chunks` chunks of `chunk_pages` pages, run by `policy`.
    pub(super) fn new(policy: Policy, chunks: usize, chunk_pages: usize) -> Victims {
        let imp: Box<dyn VictimPolicy> = match policy {
            Policy::Clock => Box::new(clock::Clock::new(chunks, chunk_pages)),
            Policy::Aging => Box::new(aging::Aging),
            Policy::Lru2 => Box::new(lru2::Lru2),
        };
        Victims::with(imp, chunks, chunk_pages)
    }

    fn with(policy: Box<dyn VictimPolicy>, chunks: usize, chunk_pages: usize) -> Victims {
        Victims {
            hand: Hand {
                pos: 0,
                chunks,
                cp: chunk_pages,
                arrived: vec![0; chunks],
                round: 1,
            },
            policy,
            spared: Vec::new(),
        }
    }

    /// Whether the policy reads the page tables itself while it chooses
    /// victims ([`VictimPolicy::reads_refs_itself`]).
    pub(super) fn reads_refs_itself(&self) -> bool {
        self.policy.reads_refs_itself()
    }

    /// The sampling hand passes pages `lo..hi`: fold their reference bits
    /// into their history.
    pub(super) fn sweep(&self, access: &mut AccessHistory, lo: usize, hi: usize) {
        self.policy
            .sweep(&mut access.age[lo..hi], &mut access.refb[lo..hi]);
    }

    /// How hot pages `lo..hi` are by the policy.
    #[cfg(test)]
    pub(super) fn hotness(&self, access: &AccessHistory, lo: usize, hi: usize) -> u32 {
        self.policy
            .hotness(&access.age[lo..hi], &access.refb[lo..hi])
    }

    /// A page of chunk `c` came in (a page-in or a first touch): batches
    /// pass the chunk over until the balancing round ends.
    pub(super) fn arrived(&mut self, c: usize) {
        self.hand.arrived[c] = self.hand.round;
    }

    /// A balancing round ends (whether it evicted or not): chunks brought
    /// in before it are fair game from now on.
    pub(super) fn round_done(&mut self) {
        self.hand.round = self.hand.round.wrapping_add(1).max(1);
    }

    /// A migrated page's history byte as the policy keeps it.
    pub(super) fn adopted(&self, byte: u8) -> u8 {
        self.policy.adopted(byte)
    }

    /// Pages whose eviction brings `staying` (pages resident once the
    /// page-outs in flight land) down toward `low`, at most about `cap`
    /// pages, sorted. Empty if nothing can be evicted.
    pub(super) fn batch(
        &mut self,
        loc: &LocationDb,
        access: &mut AccessHistory,
        probe: &mut dyn RefProbe,
        low: u64,
        cap: u64,
    ) -> Vec<usize> {
        self.spared.clear();
        let staying = loc.staying();
        let cp = self.hand.cp;
        let chunks_total = self.hand.chunks;
        let mut look = Look {
            hand: &mut self.hand,
            loc,
            access,
            probe,
            spared: &mut self.spared,
            steps: 0,
            take_fresh: false,
        };
        let mut chunks = Vec::new();
        let mut batch = Vec::new();
        while staying - (batch.len() as u64) > low
            && (batch.len() as u64) < cap
            && look.steps < chunks_total * 3
        {
            let Some((c, mask)) = self.policy.next_victim(&mut look) else {
                break;
            };
            if chunks.contains(&c) {
                break;
            }
            let lo = c * cp;
            let n = batch.len();
            batch
                .extend((lo..lo + cp).filter(|q| mask & (1 << (q - lo)) != 0 && loc.evictable(*q)));
            if batch.len() > n {
                chunks.push(c);
            }
        }
        batch.sort_unstable();
        batch
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::super::location::{LOCAL, REMOTE, ZERO};
    use super::*;
    use std::collections::HashMap;

    /// A region paged against an in-memory server by the pager's own
    /// policy code: the location DB, the access history and the victim hand.
    pub(super) struct Sim {
        pub(super) loc: LocationDb,
        pub(super) access: AccessHistory,
        pub(super) hand: Victims,
        /// Resident pages' contents.
        mem: HashMap<usize, u64>,
        /// The server's pages.
        server: HashMap<usize, u64>,
        budget: u64,
        pub(super) faults: u64,
        /// Touches of resident pages whose reference bit was clear: each a
        /// minor fault when the bit comes from an unmapped page.
        pub(super) minor: u64,
        cp: usize,
        /// Every touch sets the page's reference bit (what the page-table
        /// probe sees); false: only page-ins do (no probe).
        refs_on_touch: bool,
    }

    impl Sim {
        pub(super) fn new(pages: usize, cp: usize, budget: u64, policy: Policy) -> Sim {
            Sim {
                loc: LocationDb::new(pages, cp, 1),
                access: AccessHistory::new(pages),
                hand: Victims::new(policy, pages / cp, cp),
                mem: HashMap::new(),
                server: HashMap::new(),
                budget,
                faults: 0,
                minor: 0,
                cp,
                refs_on_touch: true,
            }
        }

        /// The guest touches page `p` (writing `value` if given); returns what it reads.
        pub(super) fn touch(&mut self, p: usize, value: Option<u64>) -> u64 {
            // (A page evicted by the balance its own page-in started faults again.)
            while self.loc.state[p] != LOCAL {
                self.faults += 1;
                let v = match self.loc.state[p] {
                    ZERO => 0,
                    s => {
                        assert_eq!(s, REMOTE, "one server");
                        self.server
                            .remove(&p)
                            .expect("the server holds every remote page")
                    }
                };
                self.mem.insert(p, v);
                self.loc.set_local(p);
                self.hand.arrived(p / self.cp);
                self.access.refb[p] = 1;
                self.balance();
            }
            if self.refs_on_touch {
                self.minor += (self.access.refb[p] == 0) as u64;
                self.access.refb[p] = 1;
            }
            if let Some(v) = value {
                self.mem.insert(p, v);
            }
            self.mem[&p]
        }

        fn balance(&mut self) {
            let slack = crate::paging_slack(self.budget, self.cp);
            while self.loc.resident > self.budget {
                let low = self.budget - slack;
                let batch = self
                    .hand
                    .batch(&self.loc, &mut self.access, &mut NoProbe, low, 64);
                assert!(!batch.is_empty(), "over budget with nothing to evict");
                for q in batch {
                    self.server.insert(q, self.mem.remove(&q).unwrap());
                    self.loc.set_remote(q, 0, None);
                    self.access.clear(q, q + 1);
                }
            }
            self.hand.round_done();
        }

        /// The sampling hand passes every chunk once.
        pub(super) fn sweep(&mut self) {
            self.hand.sweep(&mut self.access, 0, self.loc.pages());
        }
    }

    /// A hot set of 512 pages touched every round, with 128 cold pages
    /// touched once in between (never again); returns the most faults on
    /// hot pages in any of the last 8 rounds.
    fn hot_faults_under_scan(policy: Policy) -> u64 {
        let (pages, cp, budget) = (16384, 4, 1024);
        let mut sim = Sim::new(pages, cp, budget, policy);
        // Cold pages in a scattered order, so the hand meets them and the
        // hot chunks alike (an address-ordered scan would let even FIFO win).
        let mut scan = (0..12288).map(|k| 4096 + (k * 7919) % 12288);
        let mut worst = 0;
        for round in 0..32 {
            let before = sim.faults;
            for p in 0..512 {
                sim.touch(p, None);
            }
            if round >= 24 {
                worst = worst.max(sim.faults - before);
            }
            for _ in 0..128 {
                let p = scan.next().unwrap();
                sim.touch(p, None);
            }
            if round % 4 == 3 {
                sim.sweep();
            }
        }
        worst
    }

    #[test]
    fn a_hot_set_stays_resident_while_cold_pages_stream_through() {
        for &policy in Policy::ALL {
            let f = hot_faults_under_scan(policy);
            assert!(
                f < 512 / 10,
                "{policy:?}: {f} of 512 hot pages faulted in the last round"
            );
        }
    }

    /// Faults and minor faults per access of a zipf(0.99) stream over 8192
    /// pages through a quarter of it, by `policy` (or `clock`, a clock
    /// with other settings); `hottest_first` lays the pages out by rank
    /// (as the kv guest's items lie: inserted in key order), else
    /// scattered.
    pub(super) fn zipf_run(
        policy: Policy,
        clock: Option<clock::Clock>,
        refs_on_touch: bool,
        hottest_first: bool,
    ) -> (f64, f64) {
        let pages = 8192usize;
        let mut sim = Sim::new(pages, 16, 2048, policy);
        sim.refs_on_touch = refs_on_touch;
        if let Some(c) = clock {
            sim.hand = Victims::with(Box::new(c), pages / 16, 16);
        }
        let w: Vec<f64> = (1..=pages).map(|r| 1.0 / (r as f64).powf(0.99)).collect();
        let total: f64 = w.iter().sum();
        let mut cdf = Vec::with_capacity(pages);
        let mut acc = 0.0;
        for x in &w {
            acc += x / total;
            cdf.push(acc);
        }
        let place = |r: usize| if hottest_first { r } else { (r * 4099) % pages };
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let u = (x >> 11) as f64 / (1u64 << 53) as f64;
            place(cdf.partition_point(|c| *c < u).min(pages - 1))
        };
        for p in 0..pages {
            sim.touch(p, None);
        }
        for i in 0..100_000 {
            sim.touch(next(), None);
            if policy != Policy::Clock && i % 8192 == 8191 {
                sim.sweep();
            }
        }
        let (f0, m0) = (sim.faults, sim.minor);
        for i in 0..100_000 {
            sim.touch(next(), None);
            if policy != Policy::Clock && i % 8192 == 8191 {
                sim.sweep();
            }
        }
        (
            (sim.faults - f0) as f64 / 100_000.0,
            (sim.minor - m0) as f64 / 100_000.0,
        )
    }

    /// On a skewed load every policy does far better than chance (a
    /// quarter resident: ~0.75 faults per access for a random choice).
    #[test]
    fn every_policy_keeps_a_skewed_loads_hot_pages() {
        for &policy in Policy::ALL {
            let (f, m) = zipf_run(policy, None, true, false);
            eprintln!("{policy}: page-ins/access {f:.4}, minor faults/access {m:.4}");
            assert!(f < 0.35, "{policy}: {f:.4} page-ins per access");
        }
    }

    /// The hot set fills the budget and was used this period; a page
    /// brought in then is not evicted by its own arrival's balancing (a
    /// region smaller than the policy's window: the walk meets every chunk,
    /// the new one too).
    #[test]
    fn a_page_in_never_evicts_itself() {
        for &policy in Policy::ALL {
            let mut sim = Sim::new(256, 4, 64, policy);
            for _ in 0..3 {
                for p in 0..64 {
                    sim.touch(p, None);
                }
                sim.sweep();
            }
            for p in 0..64 {
                sim.touch(p, None);
            }
            for p in 64..128 {
                let before = sim.faults;
                sim.touch(p, None);
                assert_eq!(
                    sim.faults - before,
                    1,
                    "{policy}: page {p} evicted by its own page-in"
                );
            }
        }
    }

    #[test]
    fn every_value_survives_eviction_and_page_in() {
        for &policy in Policy::ALL {
            let mut sim = Sim::new(2048, 16, 256, policy);
            let mut expect = vec![0u64; 2048];
            let mut x = 0x9e37_79b9_7f4a_7c15u64;
            for i in 0..40_000u64 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let p = (x % 2048) as usize;
                if i % 3 == 0 {
                    expect[p] = i + 1;
                    sim.touch(p, Some(i + 1));
                } else {
                    assert_eq!(sim.touch(p, None), expect[p], "page {p} after {i} touches");
                }
                if i % 1000 == 0 {
                    sim.sweep();
                }
                assert!(sim.loc.resident <= 256);
            }
            assert!(sim.faults > 10_000, "the budget made it page");
            assert_eq!(
                sim.loc.resident + sim.loc.remote,
                sim.mem.len() as u64 + sim.server.len() as u64
            );
        }
    }
}
