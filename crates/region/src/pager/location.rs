//! The location DB and the access history: per-page state the pager owns.

use crate::Location;

/// Location DB values: never touched, resident here, or on server `s` (REMOTE + s).
pub(super) const ZERO: u8 = 0;
pub(super) const LOCAL: u8 = 1;
pub(super) const REMOTE: u8 = 2;

/// Outbound states of a resident page (`LocationDb::out`): not in a
/// page-out, or in a page-out job and write-protected (the writer punches
/// it once every server it goes to acked; a fault on it waits for the job).
pub(super) const OUT_NONE: u8 = 0;
pub(super) const OUT_LEAVING: u8 = 1;
/// Page-ins a page is installed writable after a residency that wrote it.
pub(super) const WRITE_HINT: u8 = 3;

/// A remote page whose GET is in flight (`LocationDb::out` of a remote page).
pub(super) const OUT_ARRIVING: u8 = 3;
/// A clean resident page in a drop job: the writer thread punches its data
/// (the server's copy is the page); faults on it wait for the job.
pub(super) const OUT_DROPPING: u8 = 4;

/// Where every page of a region is, and what servers hold for it.
pub(super) struct LocationDb {
    /// Per page: ZERO, LOCAL or REMOTE + server.
    pub(super) state: Vec<u8>,
    /// Server holding a slot for a resident page (server + 1; 0: none):
    /// what a page-in kept there (a later page-out overwrites it in place).
    pub(super) copy: Vec<u8>,
    /// With two replicas, the other server holding the page (server + 1;
    /// 0: none): for a remote page its mirror (state names the server
    /// pages are read from), for a resident page its second kept copy.
    /// A page whose copies number fewer than the region's replicas is
    /// *degraded* and re-replication gives it one.
    pub(super) second: Vec<u8>,
    /// The kept copy equals the resident page (write-protected since page-in,
    /// no write seen): evicting it is a local drop, nothing is sent.
    pub(super) clean: Vec<bool>,
    /// Per page, kept across residencies: how many more page-ins install
    /// it writable rather than clean (a write was seen while it was
    /// resident before: a clean install would only cost a WP fault).
    pub(super) write_hint: Vec<u8>,
    /// Per resident page: a write was seen in this residency.
    pub(super) written: Vec<bool>,
    /// Per page: OUT_NONE, OUT_LEAVING or OUT_DROPPING (resident pages),
    /// OUT_ARRIVING (remote pages).
    pub(super) out: Vec<u8>,
    /// Pages OUT_LEAVING: resident now, gone once their job lands.
    pub(super) leaving: u64,
    /// Resident pages per chunk.
    pub(super) chunk_res: Vec<u16>,
    /// Pages with a kept copy, per server.
    pub(super) copies: Vec<u64>,
    /// Pages resident.
    pub(super) resident: u64,
    /// Pages on servers.
    pub(super) remote: u64,
    /// Pages per chunk.
    pub(super) cp: usize,
}

impl LocationDb {
    /// All pages never touched, `servers` servers known.
    pub(super) fn new(pages: usize, chunk_pages: usize, servers: usize) -> LocationDb {
        LocationDb {
            state: vec![ZERO; pages],
            copy: vec![0; pages],
            second: vec![0; pages],
            clean: vec![false; pages],
            write_hint: vec![0; pages],
            written: vec![false; pages],
            out: vec![OUT_NONE; pages],
            leaving: 0,
            chunk_res: vec![0; pages / chunk_pages],
            copies: vec![0; servers],
            resident: 0,
            remote: 0,
            cp: chunk_pages,
        }
    }

    /// Pages in the region.
    pub(super) fn pages(&self) -> usize {
        self.state.len()
    }

    /// Where page `p` is, as the region reports it.
    pub(super) fn location(&self, p: usize) -> Location {
        match self.state[p] {
            ZERO => Location::Zero,
            LOCAL => Location::Local,
            r => Location::Remote(
                (r - REMOTE) as usize,
                self.second[p].checked_sub(1).map(usize::from),
            ),
        }
    }

    /// Page `q` is resident now (from zero, a server, or a migration).
    pub(super) fn set_local(&mut self, q: usize) {
        if self.state[q] == LOCAL {
            return;
        }
        if self.out[q] == OUT_ARRIVING {
            self.out[q] = OUT_NONE;
        }
        if self.state[q] >= REMOTE {
            self.remote -= 1;
            // The mirror keeps its copy: a second kept copy now.
            if self.second[q] > 0 {
                self.copies[self.second[q] as usize - 1] += 1;
            }
        }
        self.written[q] = false;
        self.state[q] = LOCAL;
        self.chunk_res[q / self.cp] += 1;
        self.resident += 1;
    }

    /// Resident page `q` is on server `s` now (and on `mirror`, with two
    /// replicas); its kept copies are those. Returns whether it had a kept copy.
    pub(super) fn set_remote(&mut self, q: usize, s: usize, mirror: Option<usize>) -> bool {
        debug_assert_eq!(self.state[q], LOCAL);
        let had = self.copy[q] > 0;
        if had {
            self.copies[self.copy[q] as usize - 1] -= 1;
        }
        if self.second[q] > 0 {
            self.copies[self.second[q] as usize - 1] -= 1;
        }
        self.second[q] = mirror.map_or(0, |m| m as u8 + 1);
        // A write seen: install it writable for the next WRITE_HINT page-ins
        // (each without a seen write uses one up); evicted clean: never.
        self.write_hint[q] = if self.written[q] {
            WRITE_HINT
        } else if self.clean[q] {
            0
        } else {
            self.write_hint[q].saturating_sub(1)
        };
        self.written[q] = false;
        self.state[q] = REMOTE + s as u8;
        self.copy[q] = 0;
        self.clean[q] = false;
        self.chunk_res[q / self.cp] -= 1;
        self.resident -= 1;
        self.remote += 1;
        had
    }

    /// Resident pages that will still be resident once the page-outs in
    /// flight land.
    pub(super) fn staying(&self) -> u64 {
        self.resident - self.leaving
    }

    /// Whether resident page `q` can be chosen for a page-out (it is not
    /// in one already).
    pub(super) fn evictable(&self, q: usize) -> bool {
        self.state[q] == LOCAL && self.out[q] == OUT_NONE
    }

    /// Remote page `q` is asked for.
    pub(super) fn set_arriving(&mut self, q: usize) {
        debug_assert!(self.state[q] >= REMOTE && self.out[q] == OUT_NONE);
        self.out[q] = OUT_ARRIVING;
    }

    /// Resident page `q` joins a page-out job.
    pub(super) fn set_leaving(&mut self, q: usize) {
        debug_assert!(self.evictable(q));
        self.out[q] = OUT_LEAVING;
        self.leaving += 1;
    }

    /// Clean resident page `q` joins a drop job (it counts as leaving).
    pub(super) fn set_dropping(&mut self, q: usize) {
        debug_assert!(self.evictable(q) && self.clean[q] && self.copy[q] > 0);
        self.out[q] = OUT_DROPPING;
        self.leaving += 1;
    }

    /// Page `q`'s page-out or drop job was answered: it is out of the job
    /// (and still resident until the caller marks it remote).
    pub(super) fn job_done(&mut self, q: usize) {
        debug_assert!(matches!(self.out[q], OUT_LEAVING | OUT_DROPPING));
        self.out[q] = OUT_NONE;
        self.leaving -= 1;
    }

    /// Whether page `q` is in a page-out or drop job (only resident pages
    /// join one).
    pub(super) fn in_job(&self, q: usize) -> bool {
        matches!(self.out[q], OUT_LEAVING | OUT_DROPPING)
    }

    /// Server `s` keeps a copy of resident page `q`; `clean` if it equals the page.
    pub(super) fn keep_copy(&mut self, q: usize, s: usize, clean: bool) {
        debug_assert_eq!(self.state[q], LOCAL);
        if self.copy[q] > 0 {
            self.copies[self.copy[q] as usize - 1] -= 1;
        }
        self.copy[q] = s as u8 + 1;
        self.copies[s] += 1;
        self.clean[q] = clean;
    }

    /// Server `m` keeps a second copy of resident page `q` (what the first
    /// holds: equally clean or stale). (The pager's pages get theirs as
    /// they come in, in `set_local`; tests build one directly.)
    #[cfg(test)]
    pub(super) fn keep_second(&mut self, q: usize, m: usize) {
        debug_assert_eq!(self.state[q], LOCAL);
        if self.second[q] > 0 {
            self.copies[self.second[q] as usize - 1] -= 1;
        }
        self.second[q] = m as u8 + 1;
        self.copies[m] += 1;
    }

    /// Forget the kept copy of `q` (deleted on its server); which server held it.
    pub(super) fn forget_copy(&mut self, q: usize) -> Option<usize> {
        let c = self.copy[q];
        if c == 0 {
            return None;
        }
        self.copies[c as usize - 1] -= 1;
        self.copy[q] = 0;
        self.clean[q] = false;
        Some(c as usize - 1)
    }

    /// Forget the second kept copy of resident page `q`; which server held it.
    pub(super) fn forget_second(&mut self, q: usize) -> Option<usize> {
        let c = self.second[q];
        if c == 0 {
            return None;
        }
        if self.state[q] == LOCAL {
            self.copies[c as usize - 1] -= 1;
        }
        self.second[q] = 0;
        Some(c as usize - 1)
    }

    /// Copies of page `q` on servers (remote: where it is; resident: kept).
    pub(super) fn replicas(&self, q: usize) -> usize {
        let first = match self.state[q] {
            ZERO => return 0,
            LOCAL => self.copy[q] > 0,
            _ => true,
        };
        first as usize + (self.second[q] > 0) as usize
    }

    /// Server `s` is gone with everything it held. Remote pages it served
    /// are read from their mirror from now on, kept copies on it are
    /// forgotten (a clean page whose only copy it was is dirty now).
    /// Returns the remote pages that had no other copy: lost.
    /// How many remote pages have their only copy on server `s`.
    pub(super) fn sole_copies(&self, s: usize) -> usize {
        let tag = REMOTE + s as u8;
        (0..self.state.len())
            .filter(|&q| self.state[q] == tag && self.second[q] == 0)
            .count()
    }

    pub(super) fn server_lost(&mut self, s: usize) -> Vec<usize> {
        let (tag, mark) = (REMOTE + s as u8, s as u8 + 1);
        let mut lost = Vec::new();
        for q in 0..self.state.len() {
            let st = self.state[q];
            if st == tag {
                match self.second[q] {
                    0 => lost.push(q),
                    m => {
                        self.state[q] = REMOTE + m - 1;
                        self.second[q] = 0;
                    }
                }
            } else if st >= REMOTE {
                if self.second[q] == mark {
                    self.second[q] = 0;
                }
            } else if st == LOCAL {
                if self.second[q] == mark {
                    self.forget_second(q);
                }
                if self.copy[q] == mark {
                    // The second copy, if any, takes the first's place.
                    let (clean, other) = (self.clean[q], self.forget_second(q));
                    self.forget_copy(q);
                    if let Some(o) = other {
                        self.keep_copy(q, o, clean);
                    }
                }
            }
        }
        lost
    }
}

/// What the sampler and the faults have seen of each page's use.
pub(super) struct AccessHistory {
    /// Referenced since the hand last passed (a fault or a sampling fault).
    pub(super) refb: Vec<u8>,
    /// Clock: the last sweep's bit. Aging: an 8-bit age, newest bit highest.
    pub(super) age: Vec<u8>,
    /// Installed by read-ahead and not unmapped since: mapped because the
    /// pager put it there, so being mapped says nothing of its use (the
    /// probe ignores it). Like a read-ahead page on Linux's inactive list,
    /// it earns a second chance only by a use seen after that.
    pub(super) unproven: Vec<u8>,
    /// Installed by read-ahead and no use seen since (a fault on it, a
    /// write, or a mapping after an unmap): settles as a hit at its first
    /// seen use, a miss if it is evicted first.
    prefetched: Vec<bool>,
    /// What read-ahead brought in, settled so far.
    pub(super) prefetch: PrefetchTally,
}

/// Read-ahead pages by outcome. A use the pager cannot see (a read of a
/// mapped page before the sampler's next unmap of it) counts only when the
/// page is touched again after that unmap, so a page read once and evicted
/// before any unmap counts as a miss: misses are an upper bound.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct PrefetchTally {
    /// Used after read-ahead brought them.
    pub(super) hits: u64,
    /// Evicted with no use seen.
    pub(super) misses: u64,
}

impl AccessHistory {
    /// No page used yet.
    pub(super) fn new(pages: usize) -> AccessHistory {
        AccessHistory {
            refb: vec![0; pages],
            age: vec![0; pages],
            unproven: vec![0; pages],
            prefetched: vec![false; pages],
            prefetch: PrefetchTally::default(),
        }
    }

    /// Read-ahead installed (mapped) pages `lo..hi`, none asked for yet.
    pub(super) fn read_ahead(&mut self, lo: usize, hi: usize) {
        self.unproven[lo..hi].fill(1);
        self.prefetched[lo..hi].fill(true);
    }

    /// A use of page `p` was seen: a read-ahead page pending settles as a hit.
    pub(super) fn seen_use(&mut self, p: usize) {
        if std::mem::take(&mut self.prefetched[p]) {
            self.prefetch.hits += 1;
        }
    }

    /// Resident page `p` left (its data is on a server now): its history
    /// starts over, a read-ahead page never used settles as a miss.
    pub(super) fn evicted(&mut self, p: usize) {
        if std::mem::take(&mut self.prefetched[p]) {
            self.prefetch.misses += 1;
        }
        self.clear(p, p + 1);
    }

    /// Second chance, or a page that left: pages `lo..hi` count as unused from now on.
    pub(super) fn clear(&mut self, lo: usize, hi: usize) {
        self.refb[lo..hi].fill(0);
        self.age[lo..hi].fill(0);
    }

    /// The guest used page `p` (it faulted on it).
    pub(super) fn used(&mut self, p: usize) {
        self.refb[p] = 1;
        self.unproven[p] = 0;
        self.seen_use(p);
    }

    /// Pages `lo..hi` were unmapped: a mapping seen from now on is a use.
    pub(super) fn unmapped(&mut self, lo: usize, hi: usize) {
        self.unproven[lo..hi].fill(0);
    }

    /// Mapped pages `lo + a..lo + b` (what a page-table probe found): set
    /// the reference bits of those the guest mapped itself; returns how many.
    pub(super) fn mapped(&mut self, lo: usize, a: usize, b: usize) -> u64 {
        let mut n = 0;
        for q in lo + a..lo + b {
            if self.unproven[q] == 0 {
                self.refb[q] = 1;
                self.seen_use(q);
                n += 1;
            }
        }
        n
    }

    /// Page `p`'s history byte as snapshots report it (reference bit on top).
    pub(super) fn byte(&self, p: usize) -> u8 {
        self.age[p] | (self.refb[p] << 7)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_and_counters_follow_the_pages() {
        let mut db = LocationDb::new(64, 16, 2);
        assert_eq!(db.location(5), Location::Zero);
        db.set_local(5);
        db.set_local(5);
        assert_eq!((db.resident, db.chunk_res[0]), (1, 1));
        db.keep_copy(5, 1, true);
        assert_eq!((db.copies[1], db.clean[5]), (1, true));
        assert!(db.set_remote(5, 1, None), "it had a kept copy");
        assert_eq!(db.location(5), Location::Remote(1, None));
        assert_eq!((db.resident, db.remote, db.copies[1]), (0, 1, 0));
        db.set_local(5);
        assert_eq!((db.resident, db.remote), (1, 0));
        db.keep_copy(5, 0, false);
        assert_eq!(db.forget_copy(5), Some(0));
        assert_eq!((db.copies[0], db.forget_copy(5)), (0, None));
    }

    #[test]
    fn a_page_written_last_time_is_hinted_writable_for_a_while() {
        let mut db = LocationDb::new(16, 16, 1);
        db.set_local(3);
        db.written[3] = true;
        db.set_remote(3, 0, None);
        assert_eq!(db.write_hint[3], WRITE_HINT);
        for left in (0..WRITE_HINT).rev() {
            db.set_local(3);
            db.set_remote(3, 0, None);
            assert_eq!(
                db.write_hint[3], left,
                "a residency without a write uses one up"
            );
        }
        db.set_local(3);
        db.written[3] = true;
        db.set_remote(3, 0, None);
        db.set_local(3);
        db.keep_copy(3, 0, true);
        db.set_remote(3, 0, None);
        assert_eq!(db.write_hint[3], 0, "evicted clean: no hint");
    }

    #[test]
    fn leaving_pages_count_until_their_job_lands() {
        let mut db = LocationDb::new(64, 16, 1);
        for q in 0..4 {
            db.set_local(q);
        }
        db.set_leaving(1);
        db.set_leaving(2);
        assert_eq!((db.resident, db.staying()), (4, 2));
        assert!(!db.evictable(1) && db.evictable(3));
        assert!(db.in_job(2) && !db.in_job(3));
        assert!(!db.evictable(2), "not chosen again while its job is out");
        db.job_done(1);
        db.set_remote(1, 0, None);
        db.job_done(2);
        assert_eq!((db.resident, db.staying(), db.leaving), (3, 3, 0));
        assert!(
            db.evictable(2) && !db.in_job(2),
            "page 2 was not stored: it stays"
        );
    }

    #[test]
    fn a_lost_server_leaves_pages_on_their_mirrors() {
        let mut db = LocationDb::new(16, 16, 3);
        for q in 0..6 {
            db.set_local(q);
        }
        // 0, 1: remote on server 0 mirrored on 1; 2: on 1 mirrored on 0;
        // 3: on 0 alone; 4: resident, kept on 0 and 2; 5: resident, kept on 2 and 0.
        db.set_remote(0, 0, Some(1));
        db.set_remote(1, 0, Some(1));
        db.set_remote(2, 1, Some(0));
        db.set_remote(3, 0, None);
        db.keep_copy(4, 0, true);
        db.keep_second(4, 2);
        db.keep_copy(5, 2, true);
        db.keep_second(5, 0);
        assert_eq!((db.replicas(0), db.replicas(3), db.replicas(4)), (2, 1, 2));
        assert_eq!(db.copies, vec![2, 0, 2]);
        let lost = db.server_lost(0);
        assert_eq!(lost, vec![3], "page 3 had no other copy");
        assert_eq!(db.location(0), Location::Remote(1, None));
        assert_eq!((db.second[0], db.second[2]), (0, 0), "single copies now");
        assert_eq!(db.location(2), Location::Remote(1, None));
        assert_eq!((db.copy[4], db.second[4], db.clean[4]), (3, 0, true));
        assert_eq!((db.copy[5], db.second[5]), (3, 0));
        assert_eq!(db.copies, vec![0, 0, 2]);
        // A page coming in keeps its mirror's copy as its second.
        db.second[0] = 3;
        db.set_local(0);
        db.keep_copy(0, 1, true);
        assert_eq!((db.replicas(0), db.copies.clone()), (2, vec![0, 1, 3]));
        assert_eq!(db.forget_second(0), Some(2));
        assert_eq!(db.copies, vec![0, 1, 2]);
    }

    #[test]
    fn pages_mapped_by_read_ahead_count_only_once_unmapped() {
        let mut h = AccessHistory::new(32);
        // Read-ahead installed (mapped) pages 0..16; the guest mapped 20 itself.
        h.unproven[0..16].fill(1);
        assert_eq!(h.mapped(0, 0, 32), 16, "only pages 16..32 are uses");
        let used = |h: &AccessHistory, lo: usize, hi: usize| -> u8 { h.refb[lo..hi].iter().sum() };
        assert_eq!(used(&h, 0, 16), 0, "installed, not used: cold");
        assert_eq!(used(&h, 16, 32), 16);
        // Once unmapped, being mapped again is a use.
        h.unmapped(0, 8);
        assert_eq!(h.mapped(0, 0, 16), 8);
        assert_eq!(used(&h, 0, 16), 8);
    }

    #[test]
    fn read_ahead_pages_settle_as_hits_at_first_use_or_misses_at_eviction() {
        let mut h = AccessHistory::new(32);
        h.read_ahead(0, 16);
        // Mapped because read-ahead put them there: nothing settles.
        h.mapped(0, 0, 16);
        assert_eq!(h.prefetch, PrefetchTally::default());
        // A fault on page 1, a write to page 2, a mapping after an unmap of 3..5.
        h.used(1);
        h.seen_use(2);
        h.unmapped(3, 5);
        h.mapped(0, 3, 5);
        assert_eq!(h.prefetch, PrefetchTally { hits: 4, misses: 0 });
        // Uses after the first do not count again.
        h.used(1);
        h.mapped(0, 3, 5);
        // Evicted: pages 6 and 7 were never used; page 1 was; page 20 was not read ahead.
        for p in [1, 6, 7, 20] {
            h.evicted(p);
        }
        assert_eq!(h.prefetch, PrefetchTally { hits: 4, misses: 2 });
        // Brought back by a fault, not read-ahead: nothing pending.
        h.used(6);
        h.evicted(6);
        assert_eq!(h.prefetch, PrefetchTally { hits: 4, misses: 2 });
    }
}
