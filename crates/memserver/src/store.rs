//! Page store: one pool of `capacity` 4 KiB slots ([`crate::pool`]), and per region
//! a page array (a B-tree of leaves of 512 page numbers each) mapping page
//! number -> slot. A leaf holding few pages is a sorted list (8 bytes a page),
//! a full one a 2 KiB array (4 bytes a page), so the index costs under 2% of
//! the stored bytes for any pattern, sparse or dense. Page data is never copied through the index: the
//! server reads PUT data from the socket straight into fresh slots and writes
//! GET replies straight out of them.
//!
//! The index lock is held only for index updates, never during socket I/O.
//! A slot being sent by a GET is *pinned*; freeing a pinned slot only marks
//! it (zombie) and it returns to the free list on the last unpin, so a slot
//! can never be reused while its old contents are still on the wire.

use crate::pool::{Backing, Pool};
use pagefleet_proto::{PageSel, StatOk, PAGE_SIZE};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

mod handover;
pub use handover::Frozen;

const LEAF_SHIFT: u32 = 9;
const LEAF_PAGES: usize = 1 << LEAF_SHIFT;
const NO_SLOT: u32 = u32::MAX;
/// Slot state bits beside the pin count: freed while pinned (returns to
/// the free list on the last unpin), and holding a stored page (a content
/// source for sharing-aware migration reads only such slots).
const ZOMBIE: u32 = 0x8000_0000;
/// The longest a PUT waits for deleted slots' readers to finish.
const FREED_WAIT: std::time::Duration = std::time::Duration::from_secs(2);
const PUBLISHED: u32 = 0x4000_0000;
const PIN_MASK: u32 = 0x3fff_ffff;

/// Why the store refused a request.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// More new pages than free slots.
    #[error("out of capacity: {need} new pages requested, {free} free of {capacity}")]
    OutOfCapacity {
        /// New pages asked for.
        need: u64,
        /// Free slots.
        free: u64,
        /// Slots in all.
        capacity: u64,
    },
    /// A page asked for is not here.
    #[error("page {page} of region {region:#x} is not stored here")]
    NotFound {
        /// Its region.
        region: u64,
        /// The page.
        page: u64,
    },
    /// A take names a page twice.
    #[error("page {page} is named twice in one take request")]
    DuplicateTake {
        /// The page.
        page: u64,
    },
    /// The pool could not be mapped.
    #[error(transparent)]
    Pool(#[from] crate::pool::PoolError),
    /// Pages are on their way to clients (a session still runs): the
    /// index cannot be handed over without losing them.
    #[error("{pinned} slots are still being read or sent by sessions")]
    InFlight {
        /// Slots pinned or taken.
        pinned: u64,
    },
    /// A handed-over index that does not describe a store.
    #[error("the handed-over page index is unusable: {0}")]
    BadIndex(String),
    /// The capacity asked for is beyond what page numbers address.
    #[error("capacity of {pages} pages exceeds the limit of {max} pages (16 TiB)")]
    TooLarge {
        /// Pages asked for.
        pages: u64,
        /// The limit.
        max: u64,
    },
}

/// The slots of up to 512 consecutive page numbers.
enum Leaf {
    /// (index in the leaf, slot), sorted by index: for sparse leaves.
    Sparse(Vec<(u16, u32)>),
    /// slot per index (NO_SLOT: absent), and how many are present.
    Dense(Box<[u32; LEAF_PAGES]>, u32),
}

/// A sparse leaf becomes dense beyond this many pages (8 bytes each vs 2 KiB)
/// and a dense one sparse again below a quarter of it (no flapping).
const SPARSE_MAX: usize = 256;

impl Leaf {
    fn count(&self) -> usize {
        match self {
            Leaf::Sparse(v) => v.len(),
            Leaf::Dense(_, n) => *n as usize,
        }
    }
    fn get(&self, i: usize) -> Option<u32> {
        match self {
            Leaf::Sparse(v) => v
                .binary_search_by_key(&(i as u16), |e| e.0)
                .ok()
                .map(|k| v[k].1),
            Leaf::Dense(a, _) => (a[i] != NO_SLOT).then_some(a[i]),
        }
    }
    /// Set index i to `slot`; the slot it replaces, if any.
    fn insert(&mut self, i: usize, slot: u32) -> Option<u32> {
        match self {
            Leaf::Sparse(v) => match v.binary_search_by_key(&(i as u16), |e| e.0) {
                Ok(k) => Some(std::mem::replace(&mut v[k].1, slot)),
                Err(k) => {
                    v.insert(k, (i as u16, slot));
                    if v.len() > SPARSE_MAX {
                        let mut a = Box::new([NO_SLOT; LEAF_PAGES]);
                        for (j, s) in v.iter() {
                            a[*j as usize] = *s;
                        }
                        *self = Leaf::Dense(a, (SPARSE_MAX + 1) as u32);
                    }
                    None
                }
            },
            Leaf::Dense(a, n) => {
                let old = std::mem::replace(&mut a[i], slot);
                if old == NO_SLOT {
                    *n += 1;
                    None
                } else {
                    Some(old)
                }
            }
        }
    }
    fn remove(&mut self, i: usize) -> Option<u32> {
        match self {
            Leaf::Sparse(v) => {
                let k = v.binary_search_by_key(&(i as u16), |e| e.0).ok()?;
                Some(v.remove(k).1)
            }
            Leaf::Dense(a, n) => {
                let old = std::mem::replace(&mut a[i], NO_SLOT);
                if old == NO_SLOT {
                    return None;
                }
                *n -= 1;
                if (*n as usize) < SPARSE_MAX / 4 {
                    let v = a
                        .iter()
                        .enumerate()
                        .filter(|(_, s)| **s != NO_SLOT)
                        .map(|(j, s)| (j as u16, *s))
                        .collect();
                    *self = Leaf::Sparse(v);
                }
                Some(old)
            }
        }
    }
    fn slots(&self) -> Box<dyn Iterator<Item = u32> + '_> {
        match self {
            Leaf::Sparse(v) => Box::new(v.iter().map(|e| e.1)),
            Leaf::Dense(a, _) => Box::new(a.iter().copied().filter(|s| *s != NO_SLOT)),
        }
    }
}

/// A region's leaves by leaf number: a short sorted list while the region
/// has few (a B-tree node costs ~460 bytes even for one leaf, 11% of the
/// page a one-page region stores), a B-tree beyond.
enum Leaves {
    Few(Vec<(u64, Leaf)>),
    Many(BTreeMap<u64, Leaf>),
}

/// Leaves kept in the short list at most.
const FEW_LEAVES: usize = 16;

impl Default for Leaves {
    fn default() -> Leaves {
        Leaves::Few(Vec::new())
    }
}

impl Leaves {
    fn get(&self, k: u64) -> Option<&Leaf> {
        match self {
            Leaves::Few(v) => v.binary_search_by_key(&k, |e| e.0).ok().map(|i| &v[i].1),
            Leaves::Many(m) => m.get(&k),
        }
    }
    fn get_mut(&mut self, k: u64) -> Option<&mut Leaf> {
        match self {
            Leaves::Few(v) => match v.binary_search_by_key(&k, |e| e.0) {
                Ok(i) => Some(&mut v[i].1),
                Err(_) => None,
            },
            Leaves::Many(m) => m.get_mut(&k),
        }
    }
    /// The leaf `k`, made (empty) if absent.
    fn get_or_make(&mut self, k: u64) -> &mut Leaf {
        if let Leaves::Few(v) = self {
            if v.len() >= FEW_LEAVES && v.binary_search_by_key(&k, |e| e.0).is_err() {
                *self = Leaves::Many(std::mem::take(v).into_iter().collect());
            }
        }
        match self {
            Leaves::Few(v) => {
                let i = match v.binary_search_by_key(&k, |e| e.0) {
                    Ok(i) => i,
                    Err(i) => {
                        if v.capacity() == 0 {
                            v.reserve_exact(1);
                        }
                        v.insert(i, (k, Leaf::Sparse(Vec::with_capacity(1))));
                        i
                    }
                };
                &mut v[i].1
            }
            Leaves::Many(m) => m
                .entry(k)
                .or_insert_with(|| Leaf::Sparse(Vec::with_capacity(1))),
        }
    }
    fn remove(&mut self, k: u64) {
        match self {
            Leaves::Few(v) => {
                if let Ok(i) = v.binary_search_by_key(&k, |e| e.0) {
                    v.remove(i);
                }
            }
            Leaves::Many(m) => {
                m.remove(&k);
            }
        }
    }
    /// Leaf numbers in [lo, hi].
    fn keys_in(&self, lo: u64, hi: u64) -> Vec<u64> {
        match self {
            Leaves::Few(v) => v
                .iter()
                .map(|e| e.0)
                .filter(|k| (lo..=hi).contains(k))
                .collect(),
            Leaves::Many(m) => m.range(lo..=hi).map(|(k, _)| *k).collect(),
        }
    }
    fn values(&self) -> Box<dyn Iterator<Item = &Leaf> + '_> {
        match self {
            Leaves::Few(v) => Box::new(v.iter().map(|e| &e.1)),
            Leaves::Many(m) => Box::new(m.values()),
        }
    }
}

/// One region's page array and counters.
#[derive(Default)]
struct Region {
    leaves: Leaves,
    pages: u64,
    bytes_in: u64,
    bytes_out: u64,
    /// The client that first stored a page of it (its HELLO name), an
    /// index into `Inner::owners`; times in seconds since the store began
    /// (a page-per-region fill keeps the index small: 12 bytes a region).
    owner: u32,
    created: u32,
    /// Its last PUT or GET.
    used: u32,
}

impl Region {
    fn get(&self, page: u64) -> Option<u32> {
        self.leaves
            .get(page >> LEAF_SHIFT)?
            .get((page as usize) & (LEAF_PAGES - 1))
    }
    fn insert(&mut self, page: u64, slot: u32) -> Option<u32> {
        let leaf = self.leaves.get_or_make(page >> LEAF_SHIFT);
        let old = leaf.insert((page as usize) & (LEAF_PAGES - 1), slot);
        if old.is_none() {
            self.pages += 1;
        }
        old
    }
    fn remove(&mut self, page: u64) -> Option<u32> {
        let key = page >> LEAF_SHIFT;
        let leaf = self.leaves.get_mut(key)?;
        let old = leaf.remove((page as usize) & (LEAF_PAGES - 1))?;
        self.pages -= 1;
        if leaf.count() == 0 {
            self.leaves.remove(key);
        }
        Some(old)
    }
    /// Remove every page in [first, first+count) and return their slots.
    fn remove_range(&mut self, first: u64, count: u64, out: &mut Vec<u32>) {
        let end = first + count;
        let keys = self
            .leaves
            .keys_in(first >> LEAF_SHIFT, (end - 1) >> LEAF_SHIFT);
        for k in keys {
            let lo = (k << LEAF_SHIFT).max(first);
            let hi = ((k + 1) << LEAF_SHIFT).min(end);
            for p in lo..hi {
                if let Some(s) = self.remove(p) {
                    out.push(s);
                }
            }
        }
    }
}

struct Inner {
    regions: HashMap<u64, Region>,
    free: Vec<u32>,
    next_fresh: u32,
    /// Published pages (what clients see as stored).
    stored: u64,
    /// Per-slot pin count; the top bit marks a slot freed while pinned.
    pins: Vec<u32>,
    /// Slots freed while pinned: free once their last reader unpins them.
    zombies: u64,
    /// One bit per slot: its content or its published state changed since
    /// the content scanner last took it ([`Store::copy_changed`]), so a
    /// scan hashes what changed, not the whole pool each pass.
    changed: Vec<u64>,
    /// Connected sessions per client name (owner index): a region whose
    /// creator is connected is in use, never an orphan.
    connected: HashMap<u32, u32>,
    /// Owner names, interned; a name no region and no session refers to
    /// any more is swept (its id reused), so clients named per process
    /// (`pagefleet-client/PID`) do not grow the table for the server's life.
    owners: Vec<String>,
    owner_ids: HashMap<String, u32>,
    free_owners: Vec<u32>,
    /// Names in use after the last sweep; the next one runs at twice that.
    owners_swept: usize,
    /// When the store began: region times count seconds from here.
    epoch: Instant,
}

impl Inner {
    /// The index of an empty store of `pages` slots.
    fn empty(pages: u64) -> Inner {
        Inner {
            regions: HashMap::new(),
            connected: HashMap::new(),
            owners: Vec::new(),
            owner_ids: HashMap::new(),
            free_owners: Vec::new(),
            owners_swept: 0,
            epoch: Instant::now(),
            free: Vec::new(),
            next_fresh: 0,
            stored: 0,
            pins: vec![0u32; pages as usize],
            zombies: 0,
            changed: vec![0u64; (pages as usize).div_ceil(64)],
        }
    }
    fn owner_id(&mut self, who: &str) -> u32 {
        if let Some(&i) = self.owner_ids.get(who) {
            return i;
        }
        if self.owner_ids.len() >= 2 * self.owners_swept.max(32) {
            self.sweep_owners();
        }
        let i = match self.free_owners.pop() {
            Some(i) => {
                self.owners[i as usize] = who.to_string();
                i
            }
            None => {
                self.owners.push(who.to_string());
                self.owners.len() as u32 - 1
            }
        };
        self.owner_ids.insert(who.to_string(), i);
        i
    }
    /// Forget the names no region and no connected session refers to.
    fn sweep_owners(&mut self) {
        let mut used = vec![false; self.owners.len()];
        for r in self.regions.values() {
            used[r.owner as usize] = true;
        }
        for id in self.connected.keys().chain(&self.free_owners) {
            used[*id as usize] = true;
        }
        for (i, u) in used.into_iter().enumerate() {
            if !u && self.owner_ids.remove(&self.owners[i]).is_some() {
                self.owners[i] = String::new();
                self.free_owners.push(i as u32);
            }
        }
        self.owners_swept = self.owner_ids.len();
    }
    fn now(&self) -> u32 {
        self.epoch.elapsed().as_secs().min(u32::MAX as u64) as u32
    }
}

/// Set slot `s`'s bit in a per-slot bitmap.
fn mark(bits: &mut [u64], s: u32) {
    bits[s as usize / 64] |= 1 << (s % 64);
}

impl Inner {
    fn available(&self, capacity: u64) -> u64 {
        self.free.len() as u64 + (capacity - self.next_fresh as u64)
    }
    fn alloc(&mut self) -> u32 {
        // Reuse freed slots first (already faulted in), else the next fresh one.
        if let Some(s) = self.free.pop() {
            s
        } else {
            self.next_fresh += 1;
            self.next_fresh - 1
        }
    }
    /// Slot `s` holds a stored page from now on.
    fn publish(&mut self, s: u32) {
        self.pins[s as usize] |= PUBLISHED;
        self.mark_changed(s);
    }
    /// Slot `s`'s page left the store (taken or deleted).
    fn unpublish(&mut self, s: u32) {
        self.pins[s as usize] &= !PUBLISHED;
        self.mark_changed(s);
    }
    fn mark_changed(&mut self, s: u32) {
        mark(&mut self.changed, s);
    }
    /// Whether slot `s` changed since the last call; clears the mark.
    fn take_changed(&mut self, s: u32) -> bool {
        let (w, bit) = (s as usize / 64, 1u64 << (s % 64));
        let was = self.changed[w] & bit != 0;
        self.changed[w] &= !bit;
        was
    }
    fn free_slot(&mut self, s: u32) {
        self.unpublish(s);
        let p = &mut self.pins[s as usize];
        if *p & PIN_MASK != 0 {
            *p |= ZOMBIE;
            self.zombies += 1;
        } else {
            self.free.push(s);
        }
    }
    /// Unpin `s`; true if that freed it (it was deleted meanwhile).
    fn unpin(&mut self, s: u32) -> bool {
        let p = &mut self.pins[s as usize];
        *p -= 1;
        if *p == ZOMBIE {
            *p = 0;
            self.free.push(s);
            self.zombies -= 1;
            return true;
        }
        false
    }
}

/// Where each page of a PUT goes while its data arrives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PutTarget {
    /// A reserved, unpublished slot: data is read straight into it.
    Fresh(u32),
    /// The page exists: data goes to a staging buffer and is copied over the
    /// old contents at commit, so a connection dying mid-frame leaves the old
    /// page intact.
    Overwrite,
}

/// Where a PUT's pages go, reserved until `commit_put`.
pub struct PutPlan {
    /// The region.
    pub region: u64,
    /// Per page: a fresh slot, or overwrite in place.
    pub targets: Vec<PutTarget>,
}

/// The slots a GET reads, pinned (or taken) until `end_get`.
pub struct GetPlan {
    /// The region.
    pub region: u64,
    /// Slot of each requested page, None if absent (ALLOW_MISSING).
    pub slots: Vec<Option<u32>>,
    /// The pages leave the store when sent.
    pub take: bool,
}

impl GetPlan {
    /// Pages found.
    pub fn present(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }
}

/// Numbers for STAT and metrics.
#[derive(Clone, Debug, Default)]
pub struct StoreStats {
    /// Slots in all.
    pub capacity_pages: u64,
    /// Pages stored.
    pub stored_pages: u64,
    /// Slots not free: stored + reserved for arriving PUTs + being sent.
    pub used_slots: u64,
    /// Slots ever touched (upper bound of the pool's resident memory).
    pub touched_slots: u64,
    /// Regions with pages here.
    pub region_count: u64,
    /// (region, pages, bytes_in, bytes_out), ascending region id.
    pub regions: Vec<(u64, u64, u64, u64)>,
    /// More regions exist than listed.
    pub truncated: bool,
}

/// One region as `Store::regions_info` lists it.
#[derive(Clone, Debug, PartialEq)]
pub struct RegionInfo {
    /// Its id.
    pub region: u64,
    /// Pages stored.
    pub pages: u64,
    /// Page bytes received.
    pub bytes_in: u64,
    /// Page bytes sent.
    pub bytes_out: u64,
    /// The client that created it (its HELLO name).
    pub owner: String,
    /// Seconds since its first page was stored.
    pub age_secs: f64,
    /// Seconds since its last PUT or GET.
    pub idle_secs: f64,
    /// Connected sessions of the client that created it.
    pub sessions: u32,
}

/// The page store: one pool of exactly its capacity, indexed by (region, page).
pub struct Store {
    pool: Pool,
    capacity: u64,
    inner: Mutex<Inner>,
    /// Signalled when an unpin frees a slot deleted while it was read.
    freed: std::sync::Condvar,
}

impl Store {
    /// Largest capacity: slot numbers are u32.
    pub const MAX_PAGES: u64 = (u32::MAX - 1) as u64;

    /// A store of `capacity_bytes` (whole pages), its pool on a huge-page
    /// tmpfs where it can be (see `pool`).
    pub fn new(capacity_bytes: u64) -> Result<Store, StoreError> {
        Self::with_backing(capacity_bytes, Backing::HugeTmpfs)
    }

    /// A store whose pool is backed as `backing` says: a memfd costs no
    /// mount (the fuzzer makes a store per input), a huge-page tmpfs makes
    /// first writes ~4x cheaper.
    pub fn with_backing(capacity_bytes: u64, backing: Backing) -> Result<Store, StoreError> {
        let pages = capacity_bytes / PAGE_SIZE as u64;
        if pages > Self::MAX_PAGES {
            return Err(StoreError::TooLarge {
                pages,
                max: Self::MAX_PAGES,
            });
        }
        Ok(Store {
            pool: Pool::new(pages, backing)?,
            capacity: pages,
            inner: Mutex::new(Inner::empty(pages)),
            freed: std::sync::Condvar::new(),
        })
    }

    /// Slots in all.
    pub fn capacity_pages(&self) -> u64 {
        self.capacity
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave the index half-updated
        // in a way later operations depend on, so keep serving.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Pages stored now.
    pub fn stored_pages(&self) -> u64 {
        self.lock().stored
    }

    /// Mutable view of a slot the caller owns (reserved fresh slot).
    ///
    /// # Safety
    /// `slot` must come from a `PutTarget::Fresh` of a live plan.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn fresh_slot_mut(&self, slot: u32) -> &mut [u8] {
        // SAFETY: a fresh slot is reserved for this caller alone (the
        // caller's contract) and lies inside the pool mapping.
        unsafe { std::slice::from_raw_parts_mut(self.pool.ptr(slot), PAGE_SIZE) }
    }

    /// Read-only view of a slot pinned or taken by a live `GetPlan`.
    ///
    /// # Safety
    /// `slot` must come from a live `GetPlan` (pinned or taken).
    pub unsafe fn slot(&self, slot: u32) -> &[u8] {
        // SAFETY: a pinned or taken slot is not reused while the plan lives
        // (the caller's contract) and lies inside the pool mapping.
        unsafe { std::slice::from_raw_parts(self.pool.ptr(slot), PAGE_SIZE) }
    }

    /// Reserve fresh slots for the pages that are new; all-or-nothing.
    pub fn begin_put(&self, region: u64, sel: &PageSel) -> Result<PutPlan, StoreError> {
        let mut g = self.lock();
        let reg = g.regions.get(&region);
        let targets: Vec<bool> = sel
            .iter()
            .map(|p| reg.and_then(|r| r.get(p)).is_some())
            .collect();
        let need = targets.iter().filter(|e| !**e).count() as u64;
        // Deleted slots still being read (a GET's send, the dedup scanner's
        // copy) are free as soon as the reader is done: a client that
        // deleted pages to make room gets it, waiting a bounded time for
        // those readers rather than a refusal.
        let until = Instant::now() + FREED_WAIT;
        while need > g.available(self.capacity) && need <= g.available(self.capacity) + g.zombies {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            g = self
                .freed
                .wait_timeout(g, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        let free = g.available(self.capacity);
        if need > free {
            return Err(StoreError::OutOfCapacity {
                need,
                free,
                capacity: self.capacity,
            });
        }
        // Where the whole frame fits in free slots, pages the region holds
        // get fresh slots too: their data is received straight into place
        // and the old slots are freed at commit (one a GET is sending stays
        // until it is unpinned). Else they are overwritten through staging
        // (a copy more, no slot more).
        let all_fresh = targets.len() as u64 <= free;
        let k = if all_fresh {
            targets.len() as u64
        } else {
            need
        };
        // Fresh slots in ascending address order: the kernel's copy into them
        // then streams through memory instead of hopping around the pool.
        let mut fresh: Vec<u32> = (0..k).map(|_| g.alloc()).collect();
        fresh.sort_unstable();
        let mut fresh = fresh.into_iter();
        let targets = targets
            .into_iter()
            .map(|exists| {
                if exists && !all_fresh {
                    PutTarget::Overwrite
                } else {
                    PutTarget::Fresh(fresh.next().unwrap())
                }
            })
            .collect();
        Ok(PutPlan { region, targets })
    }

    /// Publish a PUT whose data has arrived. `staging` holds page i at
    /// `i * PAGE_SIZE` for every `Overwrite` target. Returns (stored, new).
    /// `who` (the client's name) becomes the owner of a region it creates.
    pub fn commit_put(
        &self,
        plan: PutPlan,
        sel: &PageSel,
        staging: &[u8],
        who: &str,
    ) -> Result<(u32, u32), StoreError> {
        let mut g = self.lock();
        let g = &mut *g;
        let mut new_pages = 0u32;
        let mut failed = None;
        let now = g.now();
        let new_region = !g.regions.contains_key(&plan.region);
        let mut reg = g.regions.remove(&plan.region).unwrap_or_default();
        if new_region {
            reg.created = now;
            reg.owner = g.owner_id(who);
        }
        reg.used = now;
        for (i, t) in plan.targets.iter().enumerate() {
            let page = sel.page(i);
            match *t {
                PutTarget::Fresh(s) => {
                    g.publish(s);
                    match reg.insert(page, s) {
                        Some(old) => g.free_slot(old),
                        None => new_pages += 1,
                    }
                }
                PutTarget::Overwrite => {
                    let src = &staging[i * PAGE_SIZE..(i + 1) * PAGE_SIZE];
                    let slot = match reg.get(page) {
                        Some(s) => s,
                        // Taken by another connection since begin_put: needs a new slot.
                        None if g.available(self.capacity) > 0 => {
                            let s = g.alloc();
                            g.publish(s);
                            reg.insert(page, s);
                            new_pages += 1;
                            s
                        }
                        None => {
                            failed.get_or_insert(page);
                            continue;
                        }
                    };
                    // SAFETY: the slot is published in this region and we hold
                    // the lock, so it cannot be freed or reused meanwhile.
                    unsafe {
                        std::ptr::copy_nonoverlapping(src.as_ptr(), self.pool.ptr(slot), PAGE_SIZE)
                    };
                    g.mark_changed(slot);
                }
            }
        }
        reg.bytes_in += (plan.targets.len() * PAGE_SIZE) as u64;
        g.stored += new_pages as u64;
        if reg.pages > 0 {
            g.regions.insert(plan.region, reg);
        }
        if failed.is_some() {
            let free = g.available(self.capacity);
            return Err(StoreError::OutOfCapacity {
                need: 1,
                free,
                capacity: self.capacity,
            });
        }
        Ok((plan.targets.len() as u32, new_pages))
    }

    /// Drop a PUT whose data never fully arrived: nothing is published.
    pub fn abort_put(&self, plan: PutPlan) {
        let mut g = self.lock();
        for t in plan.targets {
            if let PutTarget::Fresh(s) = t {
                g.free_slot(s);
            }
        }
    }

    /// Pin (keep) or unpublish (take) the requested pages. Without
    /// `allow_missing`, any absent page fails the whole request unchanged.
    pub fn begin_get(
        &self,
        region: u64,
        sel: &PageSel,
        take: bool,
        allow_missing: bool,
    ) -> Result<GetPlan, StoreError> {
        let mut g = self.lock();
        let g = &mut *g;
        if take {
            if let PageSel::List(v) = sel {
                let mut s = v.clone();
                s.sort_unstable();
                if let Some(w) = s.windows(2).find(|w| w[0] == w[1]) {
                    return Err(StoreError::DuplicateTake { page: w[0] });
                }
            }
        }
        let now = g.now();
        let Some(reg) = g.regions.get_mut(&region) else {
            if allow_missing {
                return Ok(GetPlan {
                    region,
                    slots: vec![None; sel.len()],
                    take,
                });
            }
            return Err(StoreError::NotFound {
                region,
                page: sel.page(0),
            });
        };
        if !allow_missing {
            if let Some(page) = sel.iter().find(|p| reg.get(*p).is_none()) {
                return Err(StoreError::NotFound { region, page });
            }
        }
        let mut slots = Vec::with_capacity(sel.len());
        let mut sent = 0u64;
        for p in sel.iter() {
            let s = if take { reg.remove(p) } else { reg.get(p) };
            if let Some(s) = s {
                sent += 1;
                if take {
                    // (Fields, not `unpublish`: `reg` borrows the regions.)
                    g.pins[s as usize] &= !PUBLISHED;
                    mark(&mut g.changed, s);
                } else {
                    g.pins[s as usize] += 1;
                }
            }
            slots.push(s);
        }
        reg.bytes_out += sent * PAGE_SIZE as u64;
        reg.used = now;
        if take {
            g.stored -= sent;
            if reg.pages == 0 {
                g.regions.remove(&region);
            }
        }
        Ok(GetPlan {
            region,
            slots,
            take,
        })
    }

    /// Finish a GET. A take whose reply could not be delivered puts its
    /// pages back (unless rewritten meanwhile), so a dying client loses nothing.
    pub fn end_get(&self, plan: GetPlan, sel: &PageSel, delivered: bool) {
        let mut g = self.lock();
        let g = &mut *g;
        if plan.take && !delivered {
            let mut reg = g.regions.remove(&plan.region).unwrap_or_default();
            for (i, s) in plan.slots.iter().enumerate() {
                if let Some(s) = *s {
                    let page = sel.page(i);
                    if reg.get(page).is_none() {
                        g.publish(s);
                        reg.insert(page, s);
                        g.stored += 1;
                    } else {
                        g.free_slot(s);
                    }
                }
            }
            if reg.pages > 0 {
                g.regions.insert(plan.region, reg);
            }
            return;
        }
        let mut freed = false;
        for s in plan.slots.into_iter().flatten() {
            if plan.take {
                g.free_slot(s);
            } else {
                freed |= g.unpin(s);
            }
        }
        if freed {
            self.freed.notify_all();
        }
    }

    /// Delete pages (or, with `sel == None`, the whole region). Returns how many were stored.
    pub fn delete(&self, region: u64, sel: Option<&PageSel>) -> u64 {
        let mut g = self.lock();
        let g = &mut *g;
        let mut slots = Vec::new();
        match sel {
            None => {
                if let Some(reg) = g.regions.remove(&region) {
                    for leaf in reg.leaves.values() {
                        slots.extend(leaf.slots());
                    }
                }
            }
            Some(sel) => {
                if let Some(reg) = g.regions.get_mut(&region) {
                    match sel {
                        PageSel::Run { first, count } => {
                            reg.remove_range(*first, *count as u64, &mut slots)
                        }
                        PageSel::List(v) => slots.extend(v.iter().filter_map(|p| reg.remove(*p))),
                    }
                    if reg.pages == 0 {
                        g.regions.remove(&region);
                    }
                }
            }
        }
        let n = slots.len() as u64;
        for s in slots {
            g.free_slot(s);
        }
        g.stored -= n;
        n
    }

    /// Store `data` (page i at `i * PAGE_SIZE`) as the pages of `sel`: a
    /// PUT whose data is already in memory (PUT_HASHED's pages the host
    /// held). Returns (stored, new).
    pub fn put_copy(
        &self,
        region: u64,
        sel: &PageSel,
        data: &[u8],
        who: &str,
    ) -> Result<(u32, u32), StoreError> {
        assert_eq!(
            data.len(),
            sel.len() * PAGE_SIZE,
            "one page of data per page"
        );
        let plan = self.begin_put(region, sel)?;
        for (i, t) in plan.targets.iter().enumerate() {
            if let PutTarget::Fresh(slot) = *t {
                // SAFETY: a fresh slot of this live plan.
                unsafe { self.fresh_slot_mut(slot) }
                    .copy_from_slice(&data[i * PAGE_SIZE..(i + 1) * PAGE_SIZE]);
            }
        }
        self.commit_put(plan, sel, data, who)
    }

    /// A session of client `who` is connected; its token for
    /// [`Store::disconnect`].
    pub fn connect(&self, who: &str) -> u32 {
        let mut g = self.lock();
        let id = g.owner_id(who);
        *g.connected.entry(id).or_default() += 1;
        id
    }

    /// The session `connect` returned `id` for ended.
    pub fn disconnect(&self, id: u32) {
        let mut g = self.lock();
        if let Some(n) = g.connected.get_mut(&id) {
            *n -= 1;
            if *n == 0 {
                g.connected.remove(&id);
            }
        }
    }

    /// Delete `region` if no connected session uses it and it has been
    /// idle at least `min_idle`; the pages freed, None if it was kept.
    pub fn delete_orphan(&self, region: u64, min_idle: std::time::Duration) -> Option<u64> {
        let mut g = self.lock();
        let g = &mut *g;
        let reg = g.regions.get(&region)?;
        if g.connected.contains_key(&reg.owner) {
            return None;
        }
        if ((g.now() - reg.used) as u64) < min_idle.as_secs() {
            return None;
        }
        let reg = g.regions.remove(&region)?;
        let slots: Vec<u32> = reg.leaves.values().flat_map(|l| l.slots()).collect();
        let n = slots.len() as u64;
        for s in slots {
            g.free_slot(s);
        }
        g.stored -= n;
        Some(n)
    }

    /// Every region stored here: pages, owner, age, use.
    pub fn regions_info(&self) -> Vec<RegionInfo> {
        let g = self.lock();
        let now = g.now();
        let secs = |t: u32| now.saturating_sub(t) as f64;
        let mut v: Vec<RegionInfo> = g
            .regions
            .iter()
            .map(|(id, r)| RegionInfo {
                region: *id,
                pages: r.pages,
                bytes_in: r.bytes_in,
                bytes_out: r.bytes_out,
                owner: g.owners.get(r.owner as usize).cloned().unwrap_or_default(),
                age_secs: secs(r.created),
                idle_secs: secs(r.used),
                sessions: g.connected.get(&r.owner).copied().unwrap_or(0),
            })
            .collect();
        v.sort_by_key(|r| r.region);
        v
    }

    /// Slots ever handed out: every stored page's slot is below this.
    pub fn touched_slots(&self) -> u32 {
        self.lock().next_fresh
    }

    /// Copy the slots `first..first + n` that hold stored pages into `dst`
    /// (slot `first + i` at `i * PAGE_SIZE`); the others are not touched
    /// and come back false. The slots are pinned while they are copied, so
    /// none is reused meanwhile; a page rewritten in place meanwhile may
    /// come out torn, which a caller checking content hashes sees as a
    /// changed page.
    pub fn copy_published(&self, first: u32, n: usize, dst: &mut [u8]) -> Vec<bool> {
        self.copy_slots(first, n, dst, false)
            .into_iter()
            .map(|h| h == Some(true))
            .collect()
    }

    /// The content scanner's read: like [`Store::copy_published`], for
    /// the slots of `first..first + n` whose page was stored, rewritten or
    /// removed since the last call (which clears their marks): `Some(true)`
    /// copied, `Some(false)` holds no page now; `None` unchanged, not
    /// copied. A slot rewritten while it is copied is marked again, so the
    /// next call hands it out again.
    pub fn copy_changed(&self, first: u32, n: usize, dst: &mut [u8]) -> Vec<Option<bool>> {
        self.copy_slots(first, n, dst, true)
    }

    fn copy_slots(
        &self,
        first: u32,
        n: usize,
        dst: &mut [u8],
        only_changed: bool,
    ) -> Vec<Option<bool>> {
        assert!(dst.len() >= n * PAGE_SIZE, "room for n pages");
        let end = (first as u64 + n as u64).min(self.capacity) as u32;
        let held: Vec<Option<bool>> = {
            let mut g = self.lock();
            (first..end)
                .map(|s| {
                    if only_changed && !g.take_changed(s) {
                        return None;
                    }
                    let p = &mut g.pins[s as usize];
                    let held = *p & PUBLISHED != 0;
                    if held {
                        *p += 1;
                    }
                    Some(held)
                })
                .collect()
        };
        for (i, h) in held.iter().enumerate() {
            if *h == Some(true) {
                let s = first + i as u32;
                // SAFETY: pinned above: not freed or reused until unpinned.
                let src = unsafe { std::slice::from_raw_parts(self.pool.ptr(s), PAGE_SIZE) };
                dst[i * PAGE_SIZE..(i + 1) * PAGE_SIZE].copy_from_slice(src);
            }
        }
        let mut g = self.lock();
        let mut freed = false;
        for (i, h) in held.iter().enumerate() {
            if *h == Some(true) {
                freed |= g.unpin(first + i as u32);
            }
        }
        drop(g);
        if freed {
            self.freed.notify_all();
        }
        let mut out = held;
        out.resize(n, if only_changed { None } else { Some(false) });
        out
    }

    /// Numbers for STAT and metrics, listing at most `max_regions` regions.
    pub fn stats(&self, max_regions: usize) -> StoreStats {
        let g = self.lock();
        let mut ids: Vec<u64> = g.regions.keys().copied().collect();
        ids.sort_unstable();
        let truncated = ids.len() > max_regions;
        ids.truncate(max_regions);
        StoreStats {
            capacity_pages: self.capacity,
            stored_pages: g.stored,
            used_slots: self.capacity - g.available(self.capacity),
            touched_slots: g.next_fresh as u64,
            region_count: g.regions.len() as u64,
            regions: ids
                .into_iter()
                .map(|id| {
                    let r = &g.regions[&id];
                    (id, r.pages, r.bytes_in, r.bytes_out)
                })
                .collect(),
            truncated,
        }
    }

    /// The STAT reply.
    pub fn stat_reply(
        &self,
        list: bool,
        max_regions: u32,
        server_id: u64,
        connections: u32,
    ) -> StatOk {
        let max = if list {
            max_regions.min(pagefleet_proto::StatReq::MAX_LISTED) as usize
        } else {
            0
        };
        let s = self.stats(max);
        StatOk {
            capacity_pages: s.capacity_pages,
            used_pages: s.stored_pages,
            server_id,
            connections,
            region_count: s.region_count as u32,
            truncated: list && s.truncated,
            regions: s.regions.iter().map(|r| (r.0, r.1)).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(st: &Store, region: u64, sel: &PageSel, fill: u8) -> Result<(u32, u32), StoreError> {
        let plan = st.begin_put(region, sel)?;
        let mut staging = vec![0u8; sel.len() * PAGE_SIZE];
        for (i, t) in plan.targets.iter().enumerate() {
            let v = fill.wrapping_add(i as u8);
            match t {
                // SAFETY: `s` is a fresh slot of the live plan.
                PutTarget::Fresh(s) => unsafe { st.fresh_slot_mut(*s).fill(v) },
                PutTarget::Overwrite => staging[i * PAGE_SIZE..(i + 1) * PAGE_SIZE].fill(v),
            }
        }
        st.commit_put(plan, sel, &staging, "test")
    }

    fn get(st: &Store, region: u64, sel: &PageSel, take: bool) -> Result<Vec<u8>, StoreError> {
        let plan = st.begin_get(region, sel, take, false)?;
        let v = plan
            .slots
            .iter()
            // SAFETY: the slots of the live plan.
            .map(|s| unsafe { st.slot(s.unwrap())[0] })
            .collect();
        st.end_get(plan, sel, true);
        Ok(v)
    }

    #[test]
    fn owner_names_of_gone_clients_are_swept() {
        let st = Store::new(4096 * PAGE_SIZE as u64).unwrap();
        let page = [7u8; PAGE_SIZE];
        // One region that stays, its owner connected.
        let keep = st.connect("keeper");
        st.put_copy(1, &PageSel::List(vec![0]), &page, "keeper")
            .unwrap();
        // A thousand short-lived clients, each storing a region then deleting it.
        for i in 0..1000u64 {
            let who = format!("pagefleet-client/{i}");
            let t = st.connect(&who);
            st.put_copy(100 + i, &PageSel::List(vec![0]), &page, &who)
                .unwrap();
            assert_eq!(st.delete(100 + i, None), 1);
            st.disconnect(t);
        }
        // A region whose owner is gone but which is kept: its name stays.
        let t = st.connect("left-behind");
        st.put_copy(2, &PageSel::List(vec![0]), &page, "left-behind")
            .unwrap();
        st.disconnect(t);
        for i in 0..100u64 {
            let t = st.connect(&format!("later/{i}"));
            st.disconnect(t);
        }
        let g = st.lock();
        assert!(
            g.owners.len() < 200,
            "owner table grew to {}",
            g.owners.len()
        );
        assert!(g.owner_ids.len() < 200);
        drop(g);
        let owners: Vec<String> = st.regions_info().into_iter().map(|r| r.owner).collect();
        assert!(owners.contains(&"keeper".to_string()), "{owners:?}");
        assert!(owners.contains(&"left-behind".to_string()), "{owners:?}");
        st.disconnect(keep);
    }

    #[test]
    fn only_slots_holding_stored_pages_are_copied_out() {
        let st = Store::new(16 * PAGE_SIZE as u64).unwrap();
        let data: Vec<u8> = (0..4).flat_map(|i| [i as u8 + 1; PAGE_SIZE]).collect();
        let sel = PageSel::List(vec![5, 6, 7, 8]);
        assert_eq!(st.put_copy(3, &sel, &data, "test").unwrap(), (4, 4));
        assert_eq!(st.touched_slots(), 4);
        let mut buf = vec![0u8; 6 * PAGE_SIZE];
        let held = st.copy_published(0, 6, &mut buf);
        assert_eq!(held, [true, true, true, true, false, false]);
        let mut firsts: Vec<u8> = (0..4).map(|i| buf[i * PAGE_SIZE]).collect();
        firsts.sort_unstable();
        assert_eq!(firsts, [1, 2, 3, 4], "each stored page's content once");
        // Taken, deleted: no longer a source; a take not delivered is again.
        let take = PageSel::List(vec![5]);
        let plan = st.begin_get(3, &take, true, false).unwrap();
        let slot = plan.slots[0].unwrap();
        assert_eq!(st.copy_published(slot, 1, &mut buf), [false]);
        st.end_get(plan, &take, false);
        assert_eq!(st.copy_published(slot, 1, &mut buf), [true]);
        assert_eq!(st.delete(3, None), 4);
        assert_eq!(st.copy_published(0, 6, &mut buf), [false; 6]);
        assert_eq!(st.stats(10).used_slots, 0, "copying pinned and unpinned");
    }

    #[test]
    fn the_scanner_reads_only_slots_changed_since_its_last_read() {
        let st = Store::new(16 * PAGE_SIZE as u64).unwrap();
        let mut buf = vec![0u8; 6 * PAGE_SIZE];
        assert_eq!(
            st.copy_changed(0, 6, &mut buf),
            [None; 6],
            "nothing stored yet"
        );
        let sel = PageSel::List(vec![0, 1, 2, 3]);
        put(&st, 9, &sel, 10).unwrap();
        let first = st.copy_changed(0, 6, &mut buf);
        assert_eq!(
            first,
            [Some(true), Some(true), Some(true), Some(true), None, None]
        );
        assert_eq!(
            st.copy_changed(0, 6, &mut buf),
            [None; 6],
            "unchanged since"
        );
        // Page 1 rewritten (into a fresh slot while there are free ones):
        // its old slot reads as empty, its new one holds the new content,
        // nothing else changed.
        put(&st, 9, &PageSel::List(vec![1]), 42).unwrap();
        let again = st.copy_changed(0, 6, &mut buf);
        let slot = again.iter().position(|h| *h == Some(true)).unwrap();
        assert_eq!(again.iter().filter(|h| h.is_some()).count(), 2, "{again:?}");
        assert_eq!(
            again.iter().filter(|h| **h == Some(false)).count(),
            1,
            "{again:?}"
        );
        assert_eq!(buf[slot * PAGE_SIZE], 42);
        // Taken: no page there now; a take not delivered puts it back.
        let take = PageSel::List(vec![2]);
        let plan = st.begin_get(9, &take, true, false).unwrap();
        let taken = plan.slots[0].unwrap();
        assert_eq!(st.copy_changed(taken, 1, &mut buf), [Some(false)]);
        st.end_get(plan, &take, false);
        assert_eq!(st.copy_changed(taken, 1, &mut buf), [Some(true)]);
        // Deleted: every slot that held a page reads as empty once (page
        // 1's old slot did already), then unchanged.
        assert_eq!(st.delete(9, None), 4);
        let gone = st.copy_changed(0, 6, &mut buf);
        let mut want = [Some(false); 6];
        want[1] = None;
        want[5] = None;
        assert_eq!(gone, want);
        assert_eq!(st.copy_changed(0, 6, &mut buf), [None; 6]);
        assert_eq!(st.stats(10).used_slots, 0, "copying pinned and unpinned");
    }

    #[test]
    fn put_get_take_delete() {
        let st = Store::new(64 * PAGE_SIZE as u64).unwrap();
        let run = PageSel::Run {
            first: 1000,
            count: 8,
        };
        assert_eq!(put(&st, 7, &run, 10).unwrap(), (8, 8));
        assert_eq!(
            get(&st, 7, &run, false).unwrap(),
            (10..18).collect::<Vec<u8>>()
        );
        // An overwrite keeps the count (into fresh slots while they are
        // free, the old ones freed).
        assert_eq!(put(&st, 7, &run, 50).unwrap(), (8, 0));
        assert_eq!(st.stats(10).used_slots, 8);
        assert_eq!(st.stored_pages(), 8);
        assert_eq!(
            get(&st, 7, &PageSel::List(vec![1003]), true).unwrap(),
            vec![53]
        );
        assert_eq!(st.stored_pages(), 7);
        assert!(matches!(
            get(&st, 7, &PageSel::List(vec![1003]), true),
            Err(StoreError::NotFound { page: 1003, .. })
        ));
        assert_eq!(
            st.delete(
                7,
                Some(&PageSel::Run {
                    first: 0,
                    count: 1002
                })
            ),
            2
        );
        assert_eq!(st.delete(7, None), 5);
        assert_eq!(st.stats(10).used_slots, 0);
    }

    #[test]
    fn capacity_is_all_or_nothing() {
        let st = Store::new(4 * PAGE_SIZE as u64).unwrap();
        put(&st, 1, &PageSel::Run { first: 0, count: 3 }, 0).unwrap();
        let e = put(&st, 1, &PageSel::Run { first: 2, count: 3 }, 0).unwrap_err();
        assert!(matches!(
            e,
            StoreError::OutOfCapacity {
                need: 2,
                free: 1,
                capacity: 4
            }
        ));
        assert_eq!(st.stored_pages(), 3);
        // Overwrites need no new slots even when full.
        put(&st, 1, &PageSel::Run { first: 3, count: 1 }, 0).unwrap();
        put(&st, 1, &PageSel::Run { first: 0, count: 4 }, 9).unwrap();
        assert_eq!(st.stats(1).used_slots, 4);
    }

    #[test]
    fn pinned_slot_not_reused_until_unpinned() {
        let st = Store::new(2 * PAGE_SIZE as u64).unwrap();
        let a = PageSel::List(vec![5]);
        put(&st, 1, &a, 42).unwrap();
        let plan = st.begin_get(1, &a, false, false).unwrap();
        let pinned = plan.slots[0].unwrap();
        assert_eq!(st.delete(1, None), 1);
        // The pinned slot is a zombie: the next put uses the other slot.
        put(&st, 2, &PageSel::List(vec![0]), 1).unwrap();
        // Two more new pages than free + zombie slots: refused at once.
        assert!(put(&st, 2, &PageSel::List(vec![1, 2]), 1).is_err());
        // One more: it waits for the reader, then gets the zombie's slot,
        // never while the reader still reads it.
        let released = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|sc| {
            sc.spawn(|| {
                std::thread::sleep(std::time::Duration::from_millis(100));
                // SAFETY: `pinned` belongs to the live plan.
                assert_eq!(unsafe { st.slot(pinned)[0] }, 42);
                released.store(true, std::sync::atomic::Ordering::SeqCst);
                st.end_get(plan, &a, true);
            });
            put(&st, 2, &PageSel::List(vec![1]), 1).unwrap();
            assert!(released.load(std::sync::atomic::Ordering::SeqCst));
        });
        assert_eq!(st.stored_pages(), 2);
    }

    #[test]
    fn undelivered_take_is_put_back() {
        let st = Store::new(8 * PAGE_SIZE as u64).unwrap();
        let r = PageSel::Run { first: 0, count: 4 };
        put(&st, 3, &r, 0).unwrap();
        let plan = st.begin_get(3, &r, true, false).unwrap();
        assert_eq!(st.stored_pages(), 0);
        st.end_get(plan, &r, false);
        assert_eq!(st.stored_pages(), 4);
        assert_eq!(get(&st, 3, &r, true).unwrap(), vec![0, 1, 2, 3]);
    }

    #[test]
    fn duplicate_take_refused() {
        let st = Store::new(8 * PAGE_SIZE as u64).unwrap();
        put(&st, 3, &PageSel::List(vec![1]), 0).unwrap();
        assert!(matches!(
            st.begin_get(3, &PageSel::List(vec![1, 1]), true, false),
            Err(StoreError::DuplicateTake { page: 1 })
        ));
        assert_eq!(st.stored_pages(), 1);
    }
}
