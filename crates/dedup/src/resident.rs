//! Reading a guest's memory from outside its process without swapping it
//! in.
//!
//! A guest's memfd is shmem: `SEEK_DATA` counts its swapped-out pages as
//! data, and a `pread` of one swaps it back in, charged to the memory
//! cgroup the page belongs to, the guest's. A reader outside the guest (the
//! host daemon's scanner, an incoming runner checking a hint) that read
//! every page would push a guest held to a memory limit over it: the
//! kernel answers with the cgroup's OOM killer, on the guest. So every
//! read here asks the kernel first (`mincore` on a read-only mapping that
//! is never touched) and skips what is not in memory; pages in the swap
//! cache count as in memory, they cost no I/O.
//!
//! A page can still be swapped out between the question and the read (a
//! window of one syscall); it is then swapped in once, as any reader of
//! the file would.

use crate::sys::ResidencyMap;
use crate::PAGE;
use std::fs::File;
use std::os::unix::fs::FileExt;

/// A guest memfd opened for reading, with a mapping used only to ask which
/// of its pages are in memory.
pub struct GuestMemory {
    file: File,
    /// None when the file is empty.
    map: Option<ResidencyMap>,
    pages: u64,
}

impl GuestMemory {
    /// Wrap an open guest memory file.
    pub fn new(file: File) -> std::io::Result<GuestMemory> {
        let len = file.metadata()?.len();
        let pages = len / PAGE as u64;
        let n = usize::try_from(pages)
            .ok()
            .filter(|p| p.checked_mul(PAGE).is_some())
            .ok_or_else(|| {
                std::io::Error::new(std::io::ErrorKind::InvalidInput, "file too large to map")
            })?;
        let map = if n == 0 {
            None
        } else {
            Some(ResidencyMap::new(&file, n)?)
        };
        Ok(GuestMemory { file, map, pages })
    }

    /// Whole pages in the file (when it was opened).
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// The file.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Which of pages `first..first + out.len()` are in memory: `out[i]`
    /// is set for page `first + i`. Pages past the end read as not.
    pub fn resident(&self, first: u64, out: &mut [bool]) {
        match (&self.map, usize::try_from(first)) {
            (Some(m), Ok(first)) => m.resident(first, out),
            _ => out.fill(false),
        }
    }

    /// Read page `page` into `dst` if it is in memory; false if it is not
    /// (or the read failed).
    pub fn read_resident(&self, page: u64, dst: &mut [u8; PAGE]) -> bool {
        let mut here = [false];
        self.resident(page, &mut here);
        here[0] && self.file.read_exact_at(dst, page * PAGE as u64).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memfd(pages: u64) -> File {
        crate::sys::memfd(c"resident-test", pages * PAGE as u64)
    }

    #[test]
    fn written_pages_are_resident_and_holes_are_not() {
        let f = memfd(8);
        f.write_all_at(&[7u8; PAGE], 2 * PAGE as u64).unwrap();
        f.write_all_at(&[9u8; PAGE], 5 * PAGE as u64).unwrap();
        let g = GuestMemory::new(f).unwrap();
        let mut r = [false; 10];
        g.resident(0, &mut r);
        assert_eq!(
            r,
            [false, false, true, false, false, true, false, false, false, false]
        );
        let mut p = [0u8; PAGE];
        assert!(g.read_resident(5, &mut p));
        assert_eq!(p[0], 9);
        assert!(!g.read_resident(4, &mut p), "a hole is not read");
        assert!(!g.read_resident(8, &mut p), "past the end");
        // Reading did not make the hole resident.
        g.resident(4, &mut r[..1]);
        assert!(!r[0]);
    }

    #[test]
    fn an_empty_file_has_nothing_resident() {
        let g = GuestMemory::new(memfd(0)).unwrap();
        let mut r = [true; 3];
        g.resident(0, &mut r);
        assert_eq!(r, [false; 3]);
    }
}
