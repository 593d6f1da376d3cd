//! Which pages of a mapping are mapped now: `PAGEMAP_SCAN` (Linux 6.7+) on
//! `/proc/self/pagemap`. The paging runtime uses it as an accessed bit: it
//! unmaps (zaps) resident pages with `madvise(DONTNEED)` — the page cache
//! keeps them — and the kernel maps a page back on its next touch by itself
//! (about 1 µs, no userfaultfd round trip: the region is not registered for
//! MINOR faults, and userfaultfd-WP registration turns off fault-around, so
//! one touch maps one page). A later scan sees exactly the pages touched
//! since the zap.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

use crate::PAGE;

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct PageRegion {
    start: u64,
    end: u64,
    categories: u64,
}

#[repr(C)]
#[derive(Default)]
struct PmScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

/// PAGE_IS_PRESENT: the page is mapped in this process.
const PAGE_IS_PRESENT: u64 = 1 << 3;
/// PAGE_IS_SWAPPED: the page table holds a swap entry (an anonymous page
/// in swap; shmem pages in swap leave no entry there).
const PAGE_IS_SWAPPED: u64 = 1 << 4;
/// `_IOWR('f', 16, struct pm_scan_arg)`.
const PAGEMAP_SCAN: u64 =
    (3 << 30) | ((std::mem::size_of::<PmScanArg>() as u64) << 16) | ((b'f' as u64) << 8) | 16;
/// Ranges asked for per ioctl (a full vector resumes at `walk_end`).
const RANGES: usize = 128;

/// An open `/proc/self/pagemap` for `PAGEMAP_SCAN`.
pub struct Pagemap {
    file: File,
    ranges: Vec<PageRegion>,
}

impl Pagemap {
    /// Open it and check that this kernel has `PAGEMAP_SCAN` (6.7+).
    pub fn open() -> io::Result<Pagemap> {
        Pagemap::open_path("/proc/self/pagemap")
    }

    /// The page tables of process `pid` (a VM whose memory this process
    /// pages; needs ptrace-read access to it, as root has).
    pub fn open_pid(pid: i32) -> io::Result<Pagemap> {
        Pagemap::open_path(&format!("/proc/{pid}/pagemap"))
    }

    fn open_path(path: &str) -> io::Result<Pagemap> {
        let mut pm = Pagemap {
            file: File::open(path)?,
            ranges: vec![PageRegion::default(); RANGES],
        };
        // An empty range: accepted by a kernel that knows the ioctl.
        pm.scan(0, 0, PAGE_IS_PRESENT, &mut |_, _| {})?;
        Ok(pm)
    }

    /// Call `f(first_page, end_page)` for each run of pages mapped now in
    /// `[addr, addr + len)`, page numbers relative to `addr` (page-aligned).
    /// Only reads page tables (of the process it was opened for); nothing changes.
    pub fn present(
        &mut self,
        addr: u64,
        len: u64,
        f: &mut dyn FnMut(usize, usize),
    ) -> io::Result<()> {
        self.scan(addr, len, PAGE_IS_PRESENT, f)
    }

    /// Call `f(first_page, end_page)` for each run of anonymous pages in
    /// swap in `[addr, addr + len)`, as [`Pagemap::present`] does.
    pub fn swapped(
        &mut self,
        addr: u64,
        len: u64,
        f: &mut dyn FnMut(usize, usize),
    ) -> io::Result<()> {
        self.scan(addr, len, PAGE_IS_SWAPPED, f)
    }

    fn scan(
        &mut self,
        addr: u64,
        len: u64,
        category: u64,
        f: &mut dyn FnMut(usize, usize),
    ) -> io::Result<()> {
        let end = addr + len;
        let mut start = addr;
        loop {
            let mut arg = PmScanArg {
                size: std::mem::size_of::<PmScanArg>() as u64,
                start,
                end,
                vec: self.ranges.as_mut_ptr() as u64,
                vec_len: RANGES as u64,
                category_mask: category,
                return_mask: category,
                ..Default::default()
            };
            // SAFETY: `arg` is a valid pm_scan_arg whose `vec` points at
            // `RANGES` page_region structs we own; the kernel writes at most
            // `vec_len` of them and only reads our page tables.
            let n = unsafe {
                libc::ioctl(
                    self.file.as_raw_fd(),
                    PAGEMAP_SCAN as libc::c_ulong,
                    &mut arg,
                )
            };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            for r in &self.ranges[..n as usize] {
                f(
                    ((r.start - addr) as usize) / PAGE,
                    ((r.end - addr) as usize) / PAGE,
                );
            }
            // The vector filled before the walk ended: go on from there.
            if (n as usize) < RANGES || arg.walk_end >= end {
                return Ok(());
            }
            start = arg.walk_end;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{memfd, Mapping};

    #[test]
    fn reports_the_pages_touched_since_a_zap() {
        let Ok(mut pm) = Pagemap::open() else {
            eprintln!("PAGEMAP_SCAN not available on this kernel: skipped");
            return;
        };
        let n = 600;
        let fd = memfd("pagemap-test", (n * PAGE) as u64).unwrap();
        let m = Mapping::shared(&fd, n * PAGE).unwrap();
        let runs = |pm: &mut Pagemap| {
            let mut v = Vec::new();
            pm.present(m.base(), (n * PAGE) as u64, &mut |a, b| v.push((a, b)))
                .unwrap();
            v
        };
        // SAFETY: inside our mapping.
        let touch = |p: usize| unsafe { std::ptr::write_volatile(m.addr().add(p * PAGE), 1u8) };
        for p in 0..n {
            touch(p);
        }
        assert_eq!(runs(&mut pm), vec![(0, n)]);
        m.madvise(0, n * PAGE, libc::MADV_DONTNEED).unwrap();
        assert_eq!(runs(&mut pm), vec![]);
        // More separate runs than one ioctl returns: the scan resumes.
        let touched: Vec<usize> = (0..n).step_by(3).collect();
        for &p in &touched {
            touch(p);
        }
        let want: Vec<(usize, usize)> = touched.iter().map(|p| (*p, p + 1)).collect();
        assert_eq!(runs(&mut pm), want);
    }

    /// The contract the pager's reference bits rest on: with MISSING + WP
    /// registration (no MINOR), a zapped page is mapped back by the kernel
    /// on a read without any event, and a zapped write-protected page still
    /// raises a WP fault on its first write (the kernel keeps a marker).
    #[test]
    fn a_zapped_write_protected_page_still_faults_on_write() {
        use crate::{FaultKind, Uffd, FEATURE_MISSING_SHMEM, FEATURE_PAGEFAULT_FLAG_WP};
        use crate::{FEATURE_WP_HUGETLBFS_SHMEM, MODE_MISSING, MODE_WP};
        let Ok(mut pm) = Pagemap::open() else {
            eprintln!("PAGEMAP_SCAN not available on this kernel: skipped");
            return;
        };
        let n = 8;
        let fd = memfd("zap-wp-test", (n * PAGE) as u64).unwrap();
        let m = Mapping::shared(&fd, n * PAGE).unwrap();
        let u = Uffd::open(
            FEATURE_MISSING_SHMEM | FEATURE_WP_HUGETLBFS_SHMEM | FEATURE_PAGEFAULT_FLAG_WP,
        )
        .unwrap();
        // SAFETY: a mapping made for this test, reached only by raw pointers.
        unsafe { u.register(m.base(), (n * PAGE) as u64, MODE_MISSING | MODE_WP) }.unwrap();
        let page = vec![7u8; PAGE];
        for p in 0..n {
            // Even pages write-protected (clean), odd ones writable.
            u.copy_mode(m.base() + (p * PAGE) as u64, &page, false, p % 2 == 0)
                .unwrap();
        }
        m.madvise(0, n * PAGE, libc::MADV_DONTNEED).unwrap();
        // SAFETY: inside our mapping; every page is in the memfd, so these
        // touches are resolved by the kernel (no handler needed).
        unsafe {
            assert_eq!(std::ptr::read_volatile(m.addr().add(2 * PAGE)), 7);
            std::ptr::write_volatile(m.addr().add(3 * PAGE), 9u8);
        }
        let mut mapped = Vec::new();
        pm.present(m.base(), (n * PAGE) as u64, &mut |a, b| mapped.push((a, b)))
            .unwrap();
        assert_eq!(
            mapped,
            vec![(2, 4)],
            "exactly the touched pages are mapped again"
        );
        for p in [2usize, 4] {
            let addr = m.addr() as usize + p * PAGE;
            // SAFETY: inside the mapping, which outlives the thread (joined below).
            let t = std::thread::spawn(move || unsafe {
                std::ptr::write_volatile(addr as *mut u8, 1u8)
            });
            assert!(u.poll(5000).unwrap(), "page {p}: the write must fault");
            let mut faults = Vec::new();
            u.read_faults(&mut faults, 4).unwrap();
            assert_eq!(faults.len(), 1);
            assert_eq!(faults[0].kind, FaultKind::WriteProtect, "page {p}");
            u.writeprotect(m.base() + (p * PAGE) as u64, PAGE as u64, false)
                .unwrap();
            t.join().unwrap();
        }
    }
}
