//! Memory mappings and the files behind them: one owner per mapping,
//! unmapped when it drops.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;

/// A mapping this value owns (`munmap` on drop). It hands out only raw
/// pointers: what the bytes mean, and who may touch them when, is the
/// owner's business (a pool's slots, a guest's memory).
#[derive(Debug)]
pub struct Mapping {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory, valid from any thread until drop;
// Mapping itself never reads or writes it.
unsafe impl Send for Mapping {}
// SAFETY: as above; shared access only yields raw pointers.
unsafe impl Sync for Mapping {}

/// What to tell the kernel about a range (madvise).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Advice {
    /// Back it with transparent huge pages where possible.
    HugePages,
    /// Never with huge pages (4 KiB pages, like a region).
    NoHugePages,
    /// Drop the pages: private anonymous memory reads as zeros again.
    DontNeed,
}

impl Mapping {
    /// `len` bytes of `fd` from offset 0, shared and read/write
    /// (`MAP_NORESERVE`: the file's pages are its own to account).
    pub fn shared(fd: BorrowedFd<'_>, len: usize) -> io::Result<Mapping> {
        Self::map(len, libc::MAP_SHARED | libc::MAP_NORESERVE, fd.as_raw_fd())
    }

    /// `len` bytes of fresh private anonymous memory (zeros), populated now
    /// when `populate`.
    pub fn anonymous(len: usize, populate: bool) -> io::Result<Mapping> {
        let pop = if populate { libc::MAP_POPULATE } else { 0 };
        Self::map(len, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | pop, -1)
    }

    fn map(len: usize, flags: libc::c_int, fd: libc::c_int) -> io::Result<Mapping> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a mapping of 0 bytes",
            ));
        }
        // SAFETY: a new mapping at an address the kernel picks: it cannot
        // overlap memory Rust already owns. fd (or -1) stays open meanwhile.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            base: NonNull::new(p.cast()).expect("mmap does not return null"),
            len,
        })
    }

    /// Advise the kernel about bytes `off..off + len` (clipped to the
    /// mapping; page-aligned `off`). Advice is a hint: failure is ignored.
    pub fn advise(&self, off: usize, len: usize, a: Advice) {
        let Some(len) = self.len.checked_sub(off).map(|room| room.min(len)) else {
            return;
        };
        let advice = match a {
            Advice::HugePages => libc::MADV_HUGEPAGE,
            Advice::NoHugePages => libc::MADV_NOHUGEPAGE,
            Advice::DontNeed => libc::MADV_DONTNEED,
        };
        // SAFETY: the range lies inside this mapping (clipped above); the
        // advice changes no memory Rust holds references into except
        // DontNeed, whose caller owns the bytes' meaning (raw pointers only).
        unsafe { libc::madvise(self.base.as_ptr().add(off).cast(), len, advice) };
    }

    /// The first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// Its length, bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never: a mapping has at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping the mapping this value owns, once.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// A new memfd named `name` (close-on-exec, plus `flags` such as
/// `libc::MFD_ALLOW_SEALING`), `len` bytes long.
pub fn memfd(name: &CStr, len: u64, flags: libc::c_uint) -> io::Result<OwnedFd> {
    // SAFETY: a NUL-terminated name; the descriptor is ours from here.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just created and nobody else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    set_len(fd.as_fd(), len)?;
    Ok(fd)
}

/// Resize the file behind `fd` (ftruncate).
pub fn set_len(fd: BorrowedFd<'_>, len: u64) -> io::Result<()> {
    let len = libc::off_t::try_from(len)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "length beyond off_t"))?;
    // SAFETY: ftruncate on a descriptor the borrow keeps open.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Allocate the first `len` bytes of the file behind `fd` (fallocate
/// mode 0): later writes overwrite blocks instead of allocating them.
pub fn allocate(fd: BorrowedFd<'_>, len: u64) -> io::Result<()> {
    let len = libc::off_t::try_from(len)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "length beyond off_t"))?;
    // SAFETY: fallocate on a descriptor the borrow keeps open.
    if unsafe { libc::fallocate(fd.as_raw_fd(), 0, 0, len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The status of the file behind `fd` (fstat).
pub fn stat(fd: BorrowedFd<'_>) -> io::Result<libc::stat> {
    // SAFETY: a plain C struct; all zeros is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat fills the struct for a descriptor the borrow keeps open.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}

/// A device number's (major, minor) parts.
pub fn dev_numbers(rdev: u64) -> (u32, u32) {
    (libc::major(rdev), libc::minor(rdev))
}

/// The size of the file behind `fd`, bytes.
pub fn file_len(fd: BorrowedFd<'_>) -> io::Result<u64> {
    Ok(stat(fd)?.st_size as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memfd_mapping_reads_back_and_advice_is_clipped() {
        let fd = memfd(c"sys-test", 8192, 0).unwrap();
        assert_eq!(file_len(fd.as_fd()).unwrap(), 8192);
        let m = Mapping::shared(fd.as_fd(), 8192).unwrap();
        // SAFETY: inside the mapping, which nothing else uses.
        unsafe { m.as_ptr().add(4096).write(7) };
        m.advise(4096, 1 << 30, Advice::NoHugePages);
        m.advise(1 << 20, 4096, Advice::DontNeed);
        // SAFETY: as above.
        assert_eq!(unsafe { m.as_ptr().add(4096).read() }, 7);
        assert!(Mapping::anonymous(0, false).is_err());
    }
}
