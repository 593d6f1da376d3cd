//! Handing a store to the next process (an in-place restart of pagefleetd):
//! the pool stays where it is (its file descriptor is inherited across
//! `exec`) and the index goes as bytes ([`Store::freeze`] →
//! [`Store::adopt`]). Only published pages cross: the caller ends every
//! session first, so no slot is pinned or taken; connections, pins and
//! the content scanner's marks start afresh (every touched slot is marked
//! changed, so the scanner hashes the pool once more).
//!
//! The index, little-endian:
//!
//! ```text
//! "PFSTORE1"  capacity u64  next_fresh u32  backing u8  age_secs u64  regions u64
//! per region: id u64  created u32  used u32  bytes_in u64  bytes_out u64
//!             owner_len u16  owner bytes  pages u64  pages x (page u64, slot u32)
//! ```
//!
//! 12 bytes a page: an index of a full 64 GiB pool is 192 MiB, written in
//! one pass under the store's lock (see the in-place restart benchmark).

use super::{Inner, Region, Store, StoreError, PUBLISHED};
use crate::pool::{Backing, Pool};
use std::collections::HashMap;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::MutexGuard;
use std::time::{Duration, Instant};

const MAGIC: &[u8; 8] = b"PFSTORE1";

/// A store frozen for handover: its index as bytes, and its lock held, so
/// nothing changes the pool until the process execs (or the handover is
/// given up and this is dropped).
pub struct Frozen<'a> {
    _lock: MutexGuard<'a, Inner>,
    /// The index, for [`Store::adopt`].
    pub index: Vec<u8>,
    /// Pages in it.
    pub pages: u64,
}

struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], StoreError> {
        if self.0.len() < n {
            return Err(StoreError::BadIndex("it ends early".into()));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, StoreError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, StoreError> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }
    fn u32(&mut self) -> Result<u32, StoreError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64, StoreError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
}

fn bad(msg: impl Into<String>) -> StoreError {
    StoreError::BadIndex(msg.into())
}

impl Store {
    /// The file behind the pool: the next process maps it (clear its
    /// close-on-exec flag just before `exec`).
    pub fn pool_file(&self) -> BorrowedFd<'_> {
        self.pool.file()
    }

    /// What backs the pool (huge-page tmpfs or memfd).
    pub fn pool_backing(&self) -> Backing {
        self.pool.backing()
    }

    /// Write the index for the next process and hold the store's lock
    /// until the result is dropped. Refused while any slot is pinned or
    /// taken (a session still sending pages): end the sessions first.
    pub fn freeze(&self) -> Result<Frozen<'_>, StoreError> {
        let g = self.lock();
        // Slots a session holds: pinned for a send, or neither free nor
        // published (taken by a GET, reserved by a PUT, freed while pinned).
        let pinned = g.pins.iter().filter(|p| **p & !PUBLISHED != 0).count() as u64;
        let held = g.next_fresh as u64 - g.free.len() as u64 - g.stored;
        if pinned + held > 0 {
            return Err(StoreError::InFlight {
                pinned: pinned + held,
            });
        }
        let mut w = Writer(Vec::with_capacity(64 + g.stored as usize * 12));
        w.0.extend_from_slice(MAGIC);
        w.u64(self.capacity);
        w.u32(g.next_fresh);
        w.u8(match self.pool.backing() {
            Backing::HugeTmpfs => 0,
            Backing::Memfd => 1,
        });
        w.u64(g.epoch.elapsed().as_secs());
        w.u64(g.regions.len() as u64);
        let mut pages = 0;
        for (id, r) in &g.regions {
            w.u64(*id);
            w.u32(r.created);
            w.u32(r.used);
            w.u64(r.bytes_in);
            w.u64(r.bytes_out);
            let owner = g
                .owners
                .get(r.owner as usize)
                .map(String::as_str)
                .unwrap_or("");
            let owner = &owner.as_bytes()[..owner.len().min(u16::MAX as usize)];
            w.u16(owner.len() as u16);
            w.0.extend_from_slice(owner);
            w.u64(r.pages);
            for leaf_key in r.leaves.keys_in(0, u64::MAX) {
                let leaf = r.leaves.get(leaf_key).expect("listed leaf");
                for i in 0..super::LEAF_PAGES {
                    if let Some(slot) = leaf.get(i) {
                        w.u64((leaf_key << super::LEAF_SHIFT) | i as u64);
                        w.u32(slot);
                    }
                }
            }
            pages += r.pages;
        }
        Ok(Frozen {
            _lock: g,
            index: w.0,
            pages,
        })
    }

    /// The store a previous process froze: its pool's file and its index.
    /// Every slot and page is checked (a slot named twice, beyond the pool
    /// or a count that does not add up refuses the whole index).
    pub fn adopt(file: OwnedFd, index: &[u8]) -> Result<Store, StoreError> {
        let mut r = Reader(index);
        if r.take(8)? != MAGIC {
            return Err(bad("not a pagefleet page index (wrong magic)"));
        }
        let capacity = r.u64()?;
        if capacity > Self::MAX_PAGES {
            return Err(StoreError::TooLarge {
                pages: capacity,
                max: Self::MAX_PAGES,
            });
        }
        let next_fresh = r.u32()?;
        if next_fresh as u64 > capacity {
            return Err(bad(format!(
                "{next_fresh} slots used of a pool of {capacity}"
            )));
        }
        let backing = match r.u8()? {
            0 => Backing::HugeTmpfs,
            1 => Backing::Memfd,
            b => return Err(bad(format!("unknown pool backing {b}"))),
        };
        let age = Duration::from_secs(r.u64()?);
        let mut g = Inner::empty(capacity);
        g.epoch = Instant::now().checked_sub(age).unwrap_or_else(Instant::now);
        g.next_fresh = next_fresh;
        let nregions = r.u64()?;
        let mut used = vec![0u64; (next_fresh as usize).div_ceil(64)];
        let mut regions = HashMap::new();
        for _ in 0..nregions {
            let id = r.u64()?;
            let mut reg = Region {
                created: r.u32()?,
                used: r.u32()?,
                bytes_in: r.u64()?,
                bytes_out: r.u64()?,
                ..Region::default()
            };
            let n = r.u16()? as usize;
            let owner = std::str::from_utf8(r.take(n)?)
                .map_err(|_| bad("an owner name is not UTF-8"))?
                .to_string();
            reg.owner = g.owner_id(&owner);
            let pages = r.u64()?;
            if pages > next_fresh as u64 {
                return Err(bad(format!("region {id:#x} claims {pages} pages")));
            }
            for _ in 0..pages {
                let page = r.u64()?;
                let slot = r.u32()?;
                if slot >= next_fresh {
                    return Err(bad(format!(
                        "page {page} of region {id:#x} in slot {slot}, beyond the {next_fresh} used"
                    )));
                }
                let (w, bit) = (slot as usize / 64, 1u64 << (slot % 64));
                if used[w] & bit != 0 {
                    return Err(bad(format!("slot {slot} named twice")));
                }
                used[w] |= bit;
                if reg.insert(page, slot).is_some() {
                    return Err(bad(format!("page {page} of region {id:#x} named twice")));
                }
                g.pins[slot as usize] = PUBLISHED;
            }
            if pages > 0 && regions.insert(id, reg).is_some() {
                return Err(bad(format!("region {id:#x} named twice")));
            }
            g.stored += pages;
        }
        if !r.0.is_empty() {
            return Err(bad(format!("{} bytes past its end", r.0.len())));
        }
        g.regions = regions;
        // Every used slot that holds no page is free, lowest handed out first.
        g.free = (0..next_fresh)
            .rev()
            .filter(|s| used[*s as usize / 64] & (1 << (s % 64)) == 0)
            .collect();
        // The content scanner looks at every touched slot once more.
        for s in 0..next_fresh {
            super::mark(&mut g.changed, s);
        }
        Ok(Store {
            pool: Pool::adopt(file, capacity, backing)?,
            capacity,
            inner: std::sync::Mutex::new(g),
            freed: std::sync::Condvar::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pagefleet_proto::{PageSel, PAGE_SIZE};
    use std::os::fd::AsFd;

    fn page(b: u8) -> Vec<u8> {
        vec![b; PAGE_SIZE]
    }

    #[test]
    fn an_adopted_store_has_every_page_slot_and_owner_of_the_frozen_one() {
        let s = Store::new(64 * PAGE_SIZE as u64).unwrap();
        s.put_copy(
            7,
            &PageSel::List(vec![3, 9000, 1]),
            &[page(3), page(90), page(1)].concat(),
            "a",
        )
        .unwrap();
        s.put_copy(
            8,
            &PageSel::Run { first: 0, count: 4 },
            &page(8).repeat(4),
            "b",
        )
        .unwrap();
        s.delete(8, Some(&PageSel::List(vec![2])));
        let index = s.freeze().unwrap().index;
        let fd = s.pool_file().as_fd().try_clone_to_owned().unwrap();
        let t = Store::adopt(fd, &index).unwrap();
        assert_eq!(t.stored_pages(), 6);
        let info = t.regions_info();
        assert_eq!(
            info.iter()
                .map(|r| (r.region, r.pages, r.owner.as_str()))
                .collect::<Vec<_>>(),
            vec![(7, 3, "a"), (8, 3, "b")]
        );
        let sel = PageSel::List(vec![1, 3, 9000]);
        let plan = t.begin_get(7, &sel, false, false).unwrap();
        let got: Vec<u8> = plan
            .slots
            .iter()
            // SAFETY: slots of a live plan.
            .map(|s| unsafe { t.slot(s.unwrap()) }[0])
            .collect();
        assert_eq!(got, vec![1, 3, 90]);
        t.end_get(plan, &sel, true);
        assert!(t
            .begin_get(8, &PageSel::List(vec![2]), false, false)
            .is_err());
        // The freed slot is reused before a fresh one; nothing else is.
        assert_eq!(t.touched_slots(), 7);
        t.put_copy(9, &PageSel::List(vec![0]), &page(9), "c")
            .unwrap();
        assert_eq!(t.touched_slots(), 7);
        t.put_copy(9, &PageSel::List(vec![1]), &page(9), "c")
            .unwrap();
        assert_eq!(t.touched_slots(), 8);
        // The same memory: a write through one is seen through the other.
        let sel = PageSel::List(vec![0]);
        let plan = s.begin_get(8, &sel, false, false).unwrap();
        // SAFETY: a slot of a live plan.
        assert_eq!(unsafe { s.slot(plan.slots[0].unwrap()) }[0], 8);
        s.end_get(plan, &sel, true);
    }

    #[test]
    fn a_store_with_pages_in_flight_is_not_frozen() {
        let s = Store::new(8 * PAGE_SIZE as u64).unwrap();
        s.put_copy(1, &PageSel::List(vec![0]), &page(1), "a")
            .unwrap();
        let sel = PageSel::List(vec![0]);
        let plan = s.begin_get(1, &sel, true, false).unwrap();
        assert!(matches!(s.freeze(), Err(StoreError::InFlight { .. })));
        s.end_get(plan, &sel, false);
        assert_eq!(s.freeze().unwrap().pages, 1);
    }

    #[test]
    fn a_damaged_index_is_refused_whole() {
        let s = Store::new(8 * PAGE_SIZE as u64).unwrap();
        s.put_copy(1, &PageSel::List(vec![0, 1]), &page(1).repeat(2), "a")
            .unwrap();
        let index = s.freeze().unwrap().index;
        let fd = || s.pool_file().as_fd().try_clone_to_owned().unwrap();
        let n = index.len();
        // Cut short, bytes past the end, a slot named twice, wrong magic.
        assert!(Store::adopt(fd(), &index[..n - 1]).is_err());
        assert!(Store::adopt(fd(), &[&index[..], &[0]].concat()).is_err());
        let mut twice = index.clone();
        let (a, b) = (n - 12 - 4, n - 4);
        let first = twice[a..a + 4].to_vec();
        twice[b..b + 4].copy_from_slice(&first);
        assert!(
            matches!(Store::adopt(fd(), &twice), Err(StoreError::BadIndex(m)) if m.contains("twice"))
        );
        let mut magic = index.clone();
        magic[0] = b'X';
        assert!(Store::adopt(fd(), &magic).is_err());
        assert!(Store::adopt(fd(), &index).is_ok());
    }
}
