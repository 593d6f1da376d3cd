//! This crate's raw system calls, each behind a function whose `SAFETY:`
//! comments say why the call is sound (the architecture test keeps
//! `libc::` calls in `sys` modules).

use crate::wire::MAX_PAGES;
use pagefleet_units::PAGE_SIZE as PAGE;
use std::os::fd::{AsRawFd, BorrowedFd};

/// Read whole pages of the region's memfd without faulting (holes read as zeros).
pub fn pread_pages(fd: BorrowedFd<'_>, first: u64, dst: &mut [u8]) -> std::io::Result<()> {
    let mut done = 0;
    while done < dst.len() {
        // SAFETY: writing into the caller's buffer, its length; the borrow
        // keeps fd open.
        let n = unsafe {
            libc::pread(
                fd.as_raw_fd(),
                dst[done..].as_mut_ptr().cast(),
                dst.len() - done,
                (first as usize * PAGE + done) as i64,
            )
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            dst[done..].fill(0);
            break;
        }
        done += n as usize;
    }
    Ok(())
}

/// Map the pages of `range` (a page-aligned part of the guest mapping) that
/// are in memory. Pages the kernel already swapped out (a destination in a
/// memory cgroup) stay unmapped: faulting them back in here could only
/// push the cgroup over its limit.
pub(crate) fn map_resident(range: &mut [u8]) {
    let n = range.len() / PAGE;
    let mut vec = [0u8; MAX_PAGES];
    // SAFETY: mincore/madvise on a range of our own mapping.
    unsafe {
        if libc::mincore(range.as_mut_ptr().cast(), range.len(), vec.as_mut_ptr()) != 0 {
            return;
        }
        let mut i = 0;
        while i < n {
            if vec[i] & 1 == 0 {
                i += 1;
                continue;
            }
            let j = (i..n).find(|&k| vec[k] & 1 == 0).unwrap_or(n);
            libc::madvise(
                range.as_mut_ptr().add(i * PAGE).cast(),
                (j - i) * PAGE,
                MADV_POPULATE_WRITE,
            );
            i = j;
        }
    }
}

/// Allocate and map `len` bytes at `addr` for writing
/// (`MADV_POPULATE_WRITE`), changing no data. Best effort.
///
/// # Safety
/// `addr..addr + len` must lie inside a writable shared mapping the caller
/// keeps mapped for the call.
pub(crate) unsafe fn populate_write(addr: *mut u8, len: usize) {
    // SAFETY: the caller's contract; populating changes no data.
    unsafe { libc::madvise(addr.cast(), len, MADV_POPULATE_WRITE) };
}

/// `MADV_POPULATE_WRITE` (Linux 5.14; not in every libc crate version).
const MADV_POPULATE_WRITE: libc::c_int = 23;

/// Bytes written to a TCP socket that it has not sent yet (`SIOCOUTQNSD`,
/// tcp(7)): what waits in its send queue for the link. Bytes sent and not
/// yet acknowledged are not counted (`SIOCOUTQ` would count them, and the
/// last segment's acknowledgement can wait for the peer's delayed-ACK
/// timer, tens of ms).
pub(crate) fn unsent_bytes(sock: &std::net::TcpStream) -> std::io::Result<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: SIOCOUTQNSD writes one int through the pointer, to a local
    // that outlives the call; the borrow keeps the socket open.
    let r = unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCOUTQNSD as _, &mut n) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(n.max(0) as usize)
}
