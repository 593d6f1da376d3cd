//! Filling pages from this host's own content, in-process: the memory
//! server stores a PUT_HASHED page from what its host holds.
//!
//! Every page is read and checked against its hash before it is used, so
//! a stale index entry (a guest wrote the page since it was hashed, a slot
//! was reused) is a miss, never a wrong page.

use crate::resident::GuestMemory;
use crate::scan::{HostIndex, ProcFd, STORE};
use crate::{PageHash, PAGE};
use std::collections::HashMap;

/// Reads one slot of the memory server's store (if it holds a page).
pub type ReadSlot<'a> = dyn FnMut(u32, &mut [u8]) -> bool + 'a;

impl HostIndex {
    /// For each `hashes[i]`, write the page with that content into
    /// `out[i * PAGE..]` and return true if this host holds it: a
    /// guest's page (read from its memfd), a page of the store (`slot`),
    /// or the zero page. Checked against the hash.
    pub fn fill_local(
        &self,
        hashes: &[[u8; 16]],
        out: &mut [u8],
        slot: &mut ReadSlot<'_>,
    ) -> Vec<bool> {
        assert!(
            out.len() >= hashes.len() * PAGE,
            "one page of room per hash"
        );
        let hashes: Vec<PageHash> = hashes.iter().map(|h| PageHash(*h)).collect();
        let found: Vec<_> = {
            let mut ix = self.lock();
            hashes.iter().map(|h| ix.lookup(h)).collect()
        };
        let mut files: HashMap<ProcFd, Option<GuestMemory>> = HashMap::new();
        let mut res = Vec::with_capacity(hashes.len());
        for (i, f) in found.into_iter().enumerate() {
            let dst = &mut out[i * PAGE..(i + 1) * PAGE];
            let ok = match f {
                None => false,
                Some(None) => {
                    dst.fill(0);
                    true
                }
                Some(Some(loc)) if loc.source == STORE => slot(loc.page, dst),
                Some(Some(loc)) => match self.source(loc.source) {
                    Some(at) => files
                        .entry(at)
                        .or_insert_with(|| at.open().and_then(GuestMemory::new).ok())
                        .as_ref()
                        .is_some_and(|m| {
                            let dst: &mut [u8; PAGE] = dst.try_into().expect("page");
                            m.read_resident(loc.page as u64, dst)
                        }),
                    None => false,
                },
            };
            let dst: &[u8; PAGE] = (&*dst).try_into().expect("page");
            res.push(ok && self.key.hash(dst) == hashes[i]);
        }
        res
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ContentKey;
    use pagefleet_proto::auth::Secret;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;
    use std::sync::atomic::AtomicBool;

    #[test]
    fn guest_pages_store_slots_and_zero_are_found_and_a_changed_page_is_not() {
        let s = Secret::from_bytes(b"0123456789abcdef0123456789abcdef", "test").unwrap();
        let key = ContentKey::from_secret(&s);
        let hi = HostIndex::new(key.clone(), 1000);
        // A guest's memfd with pages 1 and 2 written.
        let f = crate::sys::memfd(c"pagefleet-local-test", 4 * PAGE as u64);
        f.write_all_at(&[7; PAGE], PAGE as u64).unwrap();
        f.write_all_at(&[8; PAGE], 2 * PAGE as u64).unwrap();
        let at = ProcFd {
            pid: std::process::id(),
            fd: f.as_raw_fd() as u32,
        };
        let stop = AtomicBool::new(false);
        hi.scan(crate::SourceId(at.pid), at, 1.0, &stop).unwrap();
        // A "store" of 2 slots, the second holding a page of 9s.
        let mut slots = [[0u8; PAGE], [9u8; PAGE]];
        let held = [false, true];
        let mut read = |first: u32, n: usize, buf: &mut [u8]| -> Vec<Option<bool>> {
            (0..n)
                .map(|i| {
                    let s = first as usize + i;
                    buf[i * PAGE..(i + 1) * PAGE].copy_from_slice(&slots[s]);
                    Some(held[s])
                })
                .collect()
        };
        assert_eq!(hi.scan_slots(STORE, 2, &mut read, 1.0, &stop), Some(1));
        // The guest rewrites page 2 after the scan: its hint is stale.
        f.write_all_at(&[1; PAGE], 2 * PAGE as u64).unwrap();
        let want = [
            key.hash(&[7; PAGE]).0,
            key.hash(&[9; PAGE]).0,
            key.zero().0,
            key.hash(&[8; PAGE]).0,
            key.hash(&[5; PAGE]).0,
        ];
        let mut out = vec![0xaau8; want.len() * PAGE];
        let mut slot = |s: u32, dst: &mut [u8]| {
            dst.copy_from_slice(&slots[s as usize]);
            held[s as usize]
        };
        let got = hi.fill_local(&want, &mut out, &mut slot);
        assert_eq!(got, [true, true, true, false, false]);
        assert!(out[..PAGE].iter().all(|b| *b == 7));
        assert!(out[PAGE..2 * PAGE].iter().all(|b| *b == 9));
        assert!(out[2 * PAGE..3 * PAGE].iter().all(|b| *b == 0));
        // A slot reused for other content since the scan: a miss.
        slots[1] = [3; PAGE];
        let mut slot = |s: u32, dst: &mut [u8]| {
            dst.copy_from_slice(&slots[s as usize]);
            true
        };
        assert_eq!(hi.fill_local(&want[1..2], &mut out, &mut slot), [false]);
    }
}
