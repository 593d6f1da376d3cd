//! This crate's raw system calls, each behind a safe function whose
//! `SAFETY:` comment says why the call is sound (the architecture test
//! keeps `libc::` calls in `sys` modules).

use crate::PAGE;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::UnixStream;

/// A read-only shared mapping of a file, never read through: only asked
/// which of its pages are in memory (mincore reads the page tables).
pub(crate) struct ResidencyMap {
    ptr: *mut libc::c_void,
    pages: usize,
}

// SAFETY: the mapping is never dereferenced, only passed to mincore.
unsafe impl Send for ResidencyMap {}
// SAFETY: as above.
unsafe impl Sync for ResidencyMap {}

impl ResidencyMap {
    /// Map the first `pages` pages of `f` (at least one).
    pub(crate) fn new(f: &impl AsFd, pages: usize) -> io::Result<ResidencyMap> {
        let bytes = pages
            .checked_mul(PAGE)
            .filter(|b| *b > 0)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no pages to map"))?;
        // SAFETY: a new shared read-only mapping of a file the borrow keeps
        // open; the kernel picks the address, so it overlaps nothing.
        let m = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ,
                libc::MAP_SHARED,
                f.as_fd().as_raw_fd(),
                0,
            )
        };
        if m == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(ResidencyMap { ptr: m, pages })
    }

    /// Whether pages `first..first + out.len()` are in memory (`out[i]`
    /// for page `first + i`); pages past the mapping read as not.
    pub(crate) fn resident(&self, first: usize, out: &mut [bool]) {
        out.fill(false);
        if first >= self.pages {
            return;
        }
        let n = out.len().min(self.pages - first);
        let mut vec = vec![0u8; n];
        // SAFETY: first + n <= pages, so the range lies inside the mapping
        // (whose length, pages * PAGE, fits a usize); vec has one byte per
        // page of it.
        let rc = unsafe {
            libc::mincore(
                self.ptr.cast::<u8>().add(first * PAGE).cast(),
                n * PAGE,
                vec.as_mut_ptr(),
            )
        };
        if rc != 0 {
            return;
        }
        for (o, v) in out.iter_mut().zip(&vec) {
            *o = v & 1 == 1;
        }
    }
}

impl Drop for ResidencyMap {
    fn drop(&mut self) {
        // SAFETY: our mapping, of exactly this length, unmapped once.
        unsafe { libc::munmap(self.ptr, self.pages * PAGE) };
    }
}

/// The (pid, uid) of the process at the other end of a unix socket
/// (`SO_PEERCRED`: the kernel's word, fixed at connect).
pub(crate) fn peer_cred(s: &UnixStream) -> io::Result<(u32, u32)> {
    let mut c = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `c`, which has them.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut c as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((c.pid as u32, c.uid))
}

/// The first run of pages holding data at or after page `from` in a file
/// of `pages` pages (SEEK_DATA / SEEK_HOLE): `(start, end)`, both `pages`
/// when none.
pub(crate) fn data_range(f: &File, from: u64, pages: u64) -> (u64, u64) {
    let fd = f.as_raw_fd();
    // SAFETY: lseek on a descriptor the borrow of `f` keeps open.
    let d = unsafe { libc::lseek(fd, (from * PAGE as u64) as i64, libc::SEEK_DATA) };
    if d < 0 {
        return (pages, pages);
    }
    let d = d as u64 / PAGE as u64;
    // SAFETY: as above.
    let h = unsafe { libc::lseek(fd, (d * PAGE as u64) as i64, libc::SEEK_HOLE) };
    let h = if h < 0 {
        pages
    } else {
        (h as u64).div_ceil(PAGE as u64).min(pages)
    };
    (d.min(pages), h.max(d.min(pages)))
}

/// A new memfd of `len` bytes (tests stand in guests' memory with these).
#[cfg(test)]
pub(crate) fn memfd(name: &std::ffi::CStr, len: u64) -> File {
    use std::os::fd::FromRawFd;
    // SAFETY: a NUL-terminated name; the descriptor is checked, then owned.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", io::Error::last_os_error());
    // SAFETY: a fresh descriptor nobody else owns.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(len).unwrap();
    f
}

/// Punch `len` bytes at `off` out of `f` (its size stays).
#[cfg(test)]
pub(crate) fn punch_hole(f: &File, off: u64, len: u64) -> io::Result<()> {
    // SAFETY: fallocate on a descriptor the borrow keeps open.
    let r = unsafe {
        libc::fallocate(
            f.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            off as i64,
            len as i64,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
