//! Thin, safe wrappers over the kernel mechanisms the paging runtime uses:
//! userfaultfd (MISSING, MINOR and WP faults on a shared memfd mapping),
//! `PAGEMAP_SCAN` (which pages are mapped), memfd, `fallocate(PUNCH_HOLE)` and `madvise`. Ioctl numbers and structs are
//! defined here (Debian's 6.1 headers lack the newer ones; see FACTS.md).

use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};

mod epoll;
pub mod handoff;
mod pagemap;
pub use epoll::{Epoll, Trigger};
pub use pagemap::Pagemap;

/// The page size everything here works in.
pub const PAGE: usize = pagefleet_units::PAGE_SIZE;

// ioctl numbers: _IOWR(0xAA, nr, size) / _IOR(0xAA, nr, size).
const UFFDIO_API: u64 = 0xC018_AA3F;
const UFFDIO_REGISTER: u64 = 0xC020_AA00;
const UFFDIO_UNREGISTER: u64 = 0x8010_AA01;
const UFFDIO_WAKE: u64 = 0x8010_AA02;
const UFFDIO_COPY: u64 = 0xC028_AA03;
const UFFDIO_ZEROPAGE: u64 = 0xC020_AA04;
const UFFDIO_WRITEPROTECT: u64 = 0xC018_AA06;
const UFFDIO_CONTINUE: u64 = 0xC020_AA07;
const UFFDIO_POISON: u64 = 0xC020_AA08;

const UFFD_API: u64 = 0xAA;
/// UFFD_FEATURE_PAGEFAULT_FLAG_WP: write-protect faults are reported.
pub const FEATURE_PAGEFAULT_FLAG_WP: u64 = 1 << 0;
/// UFFD_FEATURE_MISSING_SHMEM: MISSING faults on shared memory (memfd).
pub const FEATURE_MISSING_SHMEM: u64 = 1 << 5;
/// UFFD_FEATURE_THREAD_ID: faults carry the faulting thread's id.
pub const FEATURE_THREAD_ID: u64 = 1 << 8;
/// UFFD_FEATURE_MINOR_SHMEM: MINOR faults (page in the file, not mapped here).
pub const FEATURE_MINOR_SHMEM: u64 = 1 << 10;
/// UFFD_FEATURE_WP_HUGETLBFS_SHMEM: write protection on shared memory.
pub const FEATURE_WP_HUGETLBFS_SHMEM: u64 = 1 << 12;
/// UFFD_FEATURE_POISON: UFFDIO_POISON (a lost page raises SIGBUS).
pub const FEATURE_POISON: u64 = 1 << 14;

/// Register for faults on pages never filled.
pub const MODE_MISSING: u64 = 1 << 0;
/// Register for writes to write-protected pages.
pub const MODE_WP: u64 = 1 << 1;
/// Register for faults on pages the file holds but this mapping lacks.
pub const MODE_MINOR: u64 = 1 << 2;

const COPY_MODE_DONTWAKE: u64 = 1 << 0;
const COPY_MODE_WP: u64 = 1 << 1;
const WP_MODE_WP: u64 = 1 << 0;

const EVENT_PAGEFAULT: u8 = 0x12;
const PF_FLAG_WRITE: u64 = 1 << 0;
const PF_FLAG_WP: u64 = 1 << 1;
const PF_FLAG_MINOR: u64 = 1 << 2;
const USER_MODE_ONLY: i32 = 1;

/// What went wrong with userfaultfd.
#[derive(Debug, thiserror::Error)]
pub enum UffdError {
    /// userfaultfd(2) failed.
    #[error("userfaultfd is not available: {0} (as non-root, vm.unprivileged_userfaultfd=0 needs UFFD_USER_MODE_ONLY, which this runtime uses; check that the kernel has CONFIG_USERFAULTFD)")]
    Create(io::Error),
    /// The kernel lacks features the runtime needs.
    #[error("userfaultfd lacks features {missing:#x} the runtime needs (MISSING/MINOR/WP on shmem; kernel 5.19+)")]
    Features {
        /// The feature bits missing.
        missing: u64,
    },
    /// An ioctl failed.
    #[error("{op} failed: {source}")]
    Op {
        /// Which ioctl.
        op: &'static str,
        /// Why.
        source: io::Error,
    },
}

fn op_err(op: &'static str) -> UffdError {
    UffdError::Op {
        op,
        source: io::Error::last_os_error(),
    }
}

#[repr(C)]
#[derive(Default)]
struct ApiArg {
    api: u64,
    features: u64,
    ioctls: u64,
}
#[repr(C)]
struct Range {
    start: u64,
    len: u64,
}
#[repr(C)]
struct RegisterArg {
    range: Range,
    mode: u64,
    ioctls: u64,
}
#[repr(C)]
struct CopyArg {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}
#[repr(C)]
struct RangeModeResult {
    range: Range,
    mode: u64,
    result: i64,
}
#[repr(C)]
struct WpArg {
    range: Range,
    mode: u64,
}

/// What kind of fault a message reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// No page in the page cache: fill with `copy`/`zeropage`.
    Missing,
    /// Page in the page cache, PTE absent: map it with `continue_`.
    Minor,
    /// Write to a write-protected page.
    WriteProtect,
}

/// One page fault read from the uffd.
#[derive(Clone, Copy, Debug)]
pub struct Fault {
    /// MISSING, MINOR or WP.
    pub kind: FaultKind,
    /// The faulting address.
    pub addr: u64,
    /// A write (not a read).
    pub write: bool,
    /// The faulting thread.
    pub tid: u32,
}

/// Result of a fill ioctl: installed, or the page was already there (a
/// concurrent fault or prefetch won; the waiter still needs a wake).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fill {
    /// The page is installed.
    Done,
    /// It was there already.
    Exists,
}

/// A userfaultfd, user-mode faults only (works unprivileged).
pub struct Uffd {
    fd: OwnedFd,
    /// The features the kernel granted.
    pub features: u64,
}

impl AsRawFd for Uffd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl AsFd for Uffd {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

fn ioctl<T>(fd: RawFd, req: u64, arg: &mut T) -> i32 {
    // SAFETY: arg points to the struct the request expects.
    unsafe { libc::ioctl(fd, req as _, arg as *mut T) }
}

impl Uffd {
    /// Open a non-blocking, close-on-exec userfaultfd handling user-mode
    /// faults only (works unprivileged) and negotiate `required` features.
    pub fn open(required: u64) -> Result<Uffd, UffdError> {
        Uffd::open_flags(required, USER_MODE_ONLY)
    }

    /// Like [`Uffd::open`], but faults the kernel takes on the process's
    /// behalf (a `read()` into the memory) are reported too: what a
    /// process whose memory is filled by system calls (QEMU's disk and
    /// network I/O into guest RAM) needs. Needs CAP_SYS_PTRACE or
    /// `vm.unprivileged_userfaultfd=1`.
    pub fn open_all_faults(required: u64) -> Result<Uffd, UffdError> {
        Uffd::open_flags(required, 0)
    }

    /// A userfaultfd opened and negotiated elsewhere (another process
    /// registered its memory and passed the fd over a Unix socket).
    pub fn from_fd(fd: OwnedFd, features: u64) -> Uffd {
        Uffd { fd, features }
    }

    /// The fd itself (to pass it to another process).
    pub fn into_fd(self) -> OwnedFd {
        self.fd
    }

    fn open_flags(required: u64, extra: i32) -> Result<Uffd, UffdError> {
        // SAFETY: raw syscall with integer flags.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_userfaultfd,
                libc::O_CLOEXEC | libc::O_NONBLOCK | extra,
            )
        };
        if fd < 0 {
            return Err(UffdError::Create(io::Error::last_os_error()));
        }
        // SAFETY: fd was just returned by the kernel and is ours.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
        let mut a = ApiArg {
            api: UFFD_API,
            features: required,
            ioctls: 0,
        };
        if ioctl(fd.as_raw_fd(), UFFDIO_API, &mut a) != 0 {
            let probe = Uffd::probe_features().unwrap_or(0);
            return Err(UffdError::Features {
                missing: required & !probe,
            });
        }
        Ok(Uffd {
            fd,
            features: a.features,
        })
    }

    /// Features the kernel offers (probed on a throw-away fd: UFFDIO_API works once per fd).
    pub fn probe_features() -> Result<u64, UffdError> {
        // SAFETY: as in open.
        let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | USER_MODE_ONLY) };
        if fd < 0 {
            return Err(UffdError::Create(io::Error::last_os_error()));
        }
        // SAFETY: our fd.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
        let mut a = ApiArg {
            api: UFFD_API,
            features: 0,
            ioctls: 0,
        };
        if ioctl(fd.as_raw_fd(), UFFDIO_API, &mut a) != 0 {
            return Err(op_err("UFFDIO_API"));
        }
        Ok(a.features)
    }

    /// Register `[addr, addr+len)` for the `MODE_*` faults in `mode`; the
    /// ioctls the range supports.
    ///
    /// From here on this uffd's fills (`copy`, `zeropage`, `continue_`) may
    /// write any page of the range that is not populated, and its
    /// write-protection may hold back writes to it: the kernel checks only
    /// that a fill's destination is registered here.
    ///
    /// # Safety
    /// No Rust value, reference or allocation may live in the range while
    /// it is registered (a page Rust owns but never touched is "missing" to
    /// the kernel, and a fill would change memory behind Rust's back): it
    /// must be a mapping made for the memory this uffd serves (guest
    /// memory), read and written only through raw pointers or volatile
    /// accesses.
    ///
    /// Safe code cannot register (the former hole: registering memory a
    /// `Vec` owns, then filling it):
    ///
    /// ```compile_fail,E0133
    /// let u = pagefleet_uffd::Uffd::open(0).unwrap();
    /// let v = vec![0u8; 1 << 20];
    /// u.register(v.as_ptr() as u64, 1 << 20, pagefleet_uffd::MODE_MISSING).unwrap();
    /// ```
    pub unsafe fn register(&self, addr: u64, len: u64, mode: u64) -> Result<u64, UffdError> {
        let mut r = RegisterArg {
            range: Range { start: addr, len },
            mode,
            ioctls: 0,
        };
        if ioctl(self.fd.as_raw_fd(), UFFDIO_REGISTER, &mut r) != 0 {
            return Err(op_err("UFFDIO_REGISTER"));
        }
        Ok(r.ioctls)
    }

    /// Stop handling faults on `[addr, addr+len)`.
    pub fn unregister(&self, addr: u64, len: u64) -> Result<(), UffdError> {
        let mut r = Range { start: addr, len };
        if ioctl(self.fd.as_raw_fd(), UFFDIO_UNREGISTER, &mut r) != 0 {
            return Err(op_err("UFFDIO_UNREGISTER"));
        }
        Ok(())
    }

    /// Install `src` (whole pages) at `dst`, a page-aligned address in a
    /// range registered with this uffd, and wake waiters unless `dontwake`.
    /// The kernel only fills missing pages of ranges registered here (an
    /// existing page is `Fill::Exists`; an unregistered destination an
    /// error), and [`Uffd::register`]'s contract keeps Rust's memory out of
    /// those: safe.
    pub fn copy(&self, dst: u64, src: &[u8], dontwake: bool) -> Result<Fill, UffdError> {
        self.copy_mode(dst, src, dontwake, false)
    }

    /// [`Uffd::copy`], installing the pages write-protected when `wp` (the
    /// range must be registered for WP): the first write to each raises a
    /// WP fault, so the handler learns the page changed.
    pub fn copy_mode(
        &self,
        dst: u64,
        src: &[u8],
        dontwake: bool,
        wp: bool,
    ) -> Result<Fill, UffdError> {
        let mut mode = if dontwake { COPY_MODE_DONTWAKE } else { 0 };
        if wp {
            mode |= COPY_MODE_WP;
        }
        let mut c = CopyArg {
            dst,
            src: src.as_ptr() as u64,
            len: src.len() as u64,
            mode,
            copy: 0,
        };
        loop {
            if ioctl(self.fd.as_raw_fd(), UFFDIO_COPY, &mut c) == 0 {
                return Ok(Fill::Done);
            }
            match io::Error::last_os_error().raw_os_error() {
                Some(libc::EEXIST) => return Ok(Fill::Exists),
                Some(libc::EAGAIN) if c.copy > 0 => {
                    // Partial copy (mapping changed): continue with the rest.
                    let done = c.copy as u64;
                    c = CopyArg {
                        dst: c.dst + done,
                        src: c.src + done,
                        len: c.len - done,
                        mode: c.mode,
                        copy: 0,
                    };
                }
                Some(libc::EAGAIN) => continue,
                _ => return Err(op_err("UFFDIO_COPY")),
            }
        }
    }

    /// Install zero pages at `[addr, addr+len)` and wake the waiters.
    pub fn zeropage(&self, addr: u64, len: u64) -> Result<Fill, UffdError> {
        let mut z = RangeModeResult {
            range: Range { start: addr, len },
            mode: 0,
            result: 0,
        };
        loop {
            if ioctl(self.fd.as_raw_fd(), UFFDIO_ZEROPAGE, &mut z) == 0 {
                return Ok(Fill::Done);
            }
            match io::Error::last_os_error().raw_os_error() {
                Some(libc::EEXIST) => return Ok(Fill::Exists),
                Some(libc::EAGAIN) => continue,
                _ => return Err(op_err("UFFDIO_ZEROPAGE")),
            }
        }
    }

    /// Map page-cache pages already present (MINOR fault resolution).
    pub fn continue_(&self, addr: u64, len: u64) -> Result<Fill, UffdError> {
        self.continue_mode(addr, len, false)
    }

    /// As `continue_`, optionally mapping the pages write-protected (so the
    /// next write raises a WP fault: dirty tracking).
    pub fn continue_mode(&self, addr: u64, len: u64, wp: bool) -> Result<Fill, UffdError> {
        let mut z = RangeModeResult {
            range: Range { start: addr, len },
            mode: if wp { 1 << 1 } else { 0 },
            result: 0,
        };
        loop {
            if ioctl(self.fd.as_raw_fd(), UFFDIO_CONTINUE, &mut z) == 0 {
                return Ok(Fill::Done);
            }
            match io::Error::last_os_error().raw_os_error() {
                Some(libc::EEXIST) => return Ok(Fill::Exists),
                Some(libc::EAGAIN) => continue,
                _ => return Err(op_err("UFFDIO_CONTINUE")),
            }
        }
    }

    /// Set (`wp` = true) or clear write protection; clearing wakes waiters.
    pub fn writeprotect(&self, addr: u64, len: u64, wp: bool) -> Result<(), UffdError> {
        let mut w = WpArg {
            range: Range { start: addr, len },
            mode: if wp { WP_MODE_WP } else { 0 },
        };
        if ioctl(self.fd.as_raw_fd(), UFFDIO_WRITEPROTECT, &mut w) != 0 {
            return Err(op_err("UFFDIO_WRITEPROTECT"));
        }
        Ok(())
    }

    /// Wake threads waiting on faults in `[addr, addr+len)`.
    pub fn wake(&self, addr: u64, len: u64) -> Result<(), UffdError> {
        let mut r = Range { start: addr, len };
        if ioctl(self.fd.as_raw_fd(), UFFDIO_WAKE, &mut r) != 0 {
            return Err(op_err("UFFDIO_WAKE"));
        }
        Ok(())
    }

    /// Mark pages poisoned: the next access raises SIGBUS (a loud failure
    /// instead of silently reading zeros).
    pub fn poison(&self, addr: u64, len: u64) -> Result<(), UffdError> {
        let mut z = RangeModeResult {
            range: Range { start: addr, len },
            mode: 0,
            result: 0,
        };
        if ioctl(self.fd.as_raw_fd(), UFFDIO_POISON, &mut z) != 0 {
            return Err(op_err("UFFDIO_POISON"));
        }
        Ok(())
    }

    /// Wait up to `timeout_ms` (-1: forever) for the fd to become readable.
    pub fn poll(&self, timeout_ms: i32) -> io::Result<bool> {
        let mut p = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let r = unsafe { libc::poll(&mut p, 1, timeout_ms) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                return Ok(false);
            }
            return Err(e);
        }
        Ok(r > 0)
    }

    /// Read pending fault messages (non-blocking) into `out`; returns how many.
    /// Up to 64 messages per call, read into a stack buffer (this is the
    /// fault path: no allocation).
    pub fn read_faults(&self, out: &mut Vec<Fault>, max: usize) -> io::Result<usize> {
        let mut buf = [0u8; 32 * 64];
        let raw = &mut buf[..32 * max.clamp(1, 64)];
        // SAFETY: raw is a valid buffer.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), raw.as_mut_ptr().cast(), raw.len()) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(0),
                _ => Err(e),
            };
        }
        let mut k = 0;
        for m in raw[..n as usize].chunks_exact(32) {
            if m[0] != EVENT_PAGEFAULT {
                continue;
            }
            let flags = u64::from_ne_bytes(m[8..16].try_into().unwrap());
            let addr = u64::from_ne_bytes(m[16..24].try_into().unwrap());
            let tid = u32::from_ne_bytes(m[24..28].try_into().unwrap());
            let kind = if flags & PF_FLAG_MINOR != 0 {
                FaultKind::Minor
            } else if flags & PF_FLAG_WP != 0 {
                FaultKind::WriteProtect
            } else {
                FaultKind::Missing
            };
            out.push(Fault {
                kind,
                addr,
                write: flags & PF_FLAG_WRITE != 0,
                tid,
            });
            k += 1;
        }
        Ok(k)
    }
}

/// An anonymous shared-memory file.
pub fn memfd(name: &str, size: u64) -> io::Result<OwnedFd> {
    let c = std::ffi::CString::new(name).unwrap_or_default();
    // SAFETY: valid C string.
    let fd = unsafe { libc::memfd_create(c.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: our fd.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: valid fd.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), size as i64) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// A `MAP_SHARED` mapping of a file, unmapped on drop. Its address is only
/// readable: a `Mapping` can only be made by mapping, so dropping one never
/// unmaps memory it does not own.
pub struct Mapping {
    addr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory owned by this value; who
// touches which bytes is the user's business, as with any shared memory.
unsafe impl Send for Mapping {}
// SAFETY: as for Send; the struct itself is never mutated after creation.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Map `len` bytes of file `fd` shared, read-write.
    pub fn shared(fd: impl AsFd, len: usize) -> io::Result<Mapping> {
        let fd = fd.as_fd().as_raw_fd();
        // SAFETY: new mapping, no hint.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            addr: p.cast(),
            len,
        })
    }
    /// The mapping's address as a number (for uffd ranges).
    pub fn base(&self) -> u64 {
        self.addr as u64
    }
    /// The mapping's first byte.
    pub fn addr(&self) -> *mut u8 {
        self.addr
    }
    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// `madvise` on `[off, off+len)` of the mapping (refused outside it).
    pub fn madvise(&self, off: usize, len: usize, advice: i32) -> io::Result<()> {
        if off.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        // SAFETY: the range is inside our mapping (checked above).
        if unsafe { libc::madvise(self.addr.add(off).cast(), len, advice) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: our mapping.
        unsafe { libc::munmap(self.addr.cast(), self.len) };
    }
}

/// Free the file's pages in [off, off+len) (the next touch faults MISSING).
pub fn punch_hole(fd: impl AsFd, off: u64, len: u64) -> io::Result<()> {
    let fd = fd.as_fd().as_raw_fd();
    // SAFETY: plain syscall.
    let r = unsafe {
        libc::fallocate(
            fd,
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

/// The byte ranges of `fd` (up to `len`) that hold data, by SEEK_DATA /
/// SEEK_HOLE (shmem reports exactly the pages present in the page cache).
pub fn data_ranges(fd: impl AsFd, len: u64) -> io::Result<Vec<(u64, u64)>> {
    let fd = fd.as_fd().as_raw_fd();
    let mut out = Vec::new();
    let mut off = 0i64;
    while (off as u64) < len {
        // SAFETY: plain syscalls on a descriptor we were given.
        let d = unsafe { libc::lseek(fd, off, libc::SEEK_DATA) };
        if d < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break;
            }
            return Err(e);
        }
        // SAFETY: lseek on the caller's descriptor; no memory involved.
        let h = unsafe { libc::lseek(fd, d, libc::SEEK_HOLE) };
        if h < 0 {
            return Err(io::Error::last_os_error());
        }
        out.push((d as u64, (h as u64).min(len)));
        off = h;
    }
    Ok(out)
}

/// A non-blocking eventfd (a doorbell for a thread that polls).
pub fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: plain syscall.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Ring an eventfd.
pub fn ring(fd: impl AsFd) {
    let fd = fd.as_fd().as_raw_fd();
    let one = 1u64;
    // SAFETY: 8-byte write from a valid buffer.
    unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
}

/// Reset an eventfd after it rang.
pub fn drain(fd: impl AsFd) {
    let fd = fd.as_fd().as_raw_fd();
    let mut v = 0u64;
    // SAFETY: 8-byte read into a valid buffer.
    unsafe { libc::read(fd, (&mut v as *mut u64).cast(), 8) };
}
