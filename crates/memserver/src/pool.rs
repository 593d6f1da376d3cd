//! The slot pool: `pages` 4 KiB slots in one shared mapping of a file that
//! has no name, so the pool can outlive the process that made it: an
//! in-place restart hands the file's descriptor to the next pagefleetd,
//! which maps the same pages ([`crate::store::Store::adopt`]).
//!
//! Where the file lives decides the page size behind the slots, and with it
//! what a first write into a fresh slot costs (1 GiB written page by page,
//! measured on this project's machines):
//!
//! | backing | first touch |
//! |---|---|
//! | file on a tmpfs mounted `huge=always` (2 MiB pages) | 8–18 GB/s |
//! | anonymous private memory with `MADV_HUGEPAGE` (the pool before it could be handed over) | 8 GB/s |
//! | memfd (shmem, 4 KiB pages: Debian's `shmem_enabled` is `never`) | 1.7 GB/s |
//!
//! So the pool is a file on a tmpfs of its own, mounted only long enough to
//! create and unlink the file (then detached: nothing shows in the mount
//! table, and the memory is freed when the last descriptor or mapping of it
//! goes). That needs CAP_SYS_ADMIN; without it the pool is a memfd.
//!
//! Freed slots are never given back to the kernel (the store reuses them),
//! so the file never needs holes punched.

use pagefleet_proto::PAGE_SIZE;
use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;

/// What backs the slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backing {
    /// A file on a private tmpfs mounted with huge pages.
    HugeTmpfs,
    /// A memfd: shmem in 4 KiB pages unless the host enables shmem THP.
    Memfd,
}

/// The pool's mapping and the file behind it.
pub(crate) struct Pool {
    base: NonNull<u8>,
    len: usize,
    file: OwnedFd,
    backing: Backing,
}

// SAFETY: the pool is plain memory; who may touch which slot is decided by
// the index under the store's lock (reserved, pinned or published slots).
unsafe impl Send for Pool {}
// SAFETY: as for Send: shared access to a slot is arbitrated by the index.
unsafe impl Sync for Pool {}

/// The pool could not be made or adopted.
#[derive(Debug, thiserror::Error)]
#[error("cannot reserve {bytes} bytes of memory for the page pool: {source}")]
pub struct PoolError {
    /// Its size.
    pub bytes: u64,
    /// Why.
    pub source: io::Error,
}

impl Pool {
    /// A fresh pool of `pages` slots (at least one), all reading as zeros,
    /// backed as `want` says (a huge-page tmpfs falls back to a memfd where
    /// it cannot be mounted).
    pub(crate) fn new(pages: u64, want: Backing) -> Result<Pool, PoolError> {
        let len = Self::bytes(pages);
        let err = |source| PoolError {
            bytes: len as u64,
            source,
        };
        let tmpfs = match want {
            Backing::HugeTmpfs => huge_tmpfs_file(len),
            Backing::Memfd => Err(io::Error::other("a memfd was asked for")),
        };
        let (file, backing) = match tmpfs {
            Ok(f) => (f, Backing::HugeTmpfs),
            Err(_) if want == Backing::Memfd => (memfd(len).map_err(err)?, Backing::Memfd),
            Err(e) => {
                tracing::info!(
                    "page pool in 4 KiB pages (a memfd): no huge-page tmpfs for it ({e}); first writes into the pool cost about 4x more"
                );
                (memfd(len).map_err(err)?, Backing::Memfd)
            }
        };
        Self::map(file, len, backing).map_err(err)
    }

    /// The pool another process made, from its file: `pages` slots, which
    /// the file must hold.
    pub(crate) fn adopt(file: OwnedFd, pages: u64, backing: Backing) -> Result<Pool, PoolError> {
        let len = Self::bytes(pages);
        let err = |source| PoolError {
            bytes: len as u64,
            source,
        };
        // SAFETY: a plain C struct, all zeros is a valid value.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstat fills the struct for a descriptor we own.
        if unsafe { libc::fstat(file.as_raw_fd(), &mut st) } != 0 {
            return Err(err(io::Error::last_os_error()));
        }
        if (st.st_size as u64) < len as u64 {
            return Err(err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "the handed-over pool file holds {} bytes, not {len}",
                    st.st_size
                ),
            )));
        }
        Self::map(file, len, backing).map_err(err)
    }

    fn bytes(pages: u64) -> usize {
        (pages as usize).max(1) * PAGE_SIZE
    }

    fn map(file: OwnedFd, len: usize, backing: Backing) -> io::Result<Pool> {
        // SAFETY: a shared mapping of a file we hold, at no fixed address.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_NORESERVE,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        // Slots are handed out low-to-high, so huge pages fill densely and
        // RSS still tracks what is stored (rounded up to 2 MiB). On a memfd
        // this asks for shmem huge pages where the host allows them.
        // SAFETY: p/len is the mapping just created.
        unsafe { libc::madvise(p, len, libc::MADV_HUGEPAGE) };
        Ok(Pool {
            base: NonNull::new(p as *mut u8).expect("mmap does not return null"),
            len,
            file,
            backing,
        })
    }

    pub(crate) fn ptr(&self, slot: u32) -> *mut u8 {
        assert!(
            (slot as usize + 1) * PAGE_SIZE <= self.len,
            "slot {slot} beyond the pool"
        );
        // SAFETY: in bounds (checked above).
        unsafe { self.base.as_ptr().add(slot as usize * PAGE_SIZE) }
    }

    /// The file behind the slots (for the next process).
    pub(crate) fn file(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    pub(crate) fn backing(&self) -> Backing {
        self.backing
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping.
        unsafe { libc::munmap(self.base.as_ptr() as *mut libc::c_void, self.len) };
    }
}

fn cstr(p: &std::path::Path) -> io::Result<CString> {
    use std::os::unix::ffi::OsStrExt;
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in a path"))
}

fn check(r: libc::c_int) -> io::Result<()> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// A `len`-byte file on a tmpfs of its own mounted `huge=always`, already
/// unlinked and the tmpfs detached: only the descriptor reaches it.
fn huge_tmpfs_file(len: usize) -> io::Result<OwnedFd> {
    let dir = std::env::temp_dir().join(format!(
        ".pagefleet-pool-{}-{:x}",
        std::process::id(),
        pagefleet_proto::auth::random_u64()
    ));
    std::fs::create_dir(&dir)?;
    let cdir = cstr(&dir)?;
    // Room for the file rounded up to whole huge pages, and no more.
    let size = len.div_ceil(2 << 20) * (2 << 20) + (2 << 20);
    let opts =
        CString::new(format!("huge=always,mode=0700,nr_inodes=4,size={size}")).expect("no NUL");
    let (src, fstype) = (c"pagefleet-pool", c"tmpfs");
    // SAFETY: NUL-terminated strings that outlive the call.
    let mounted = check(unsafe {
        libc::mount(
            src.as_ptr(),
            cdir.as_ptr(),
            fstype.as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            opts.as_ptr().cast(),
        )
    });
    let file = mounted.and_then(|()| {
        let path = dir.join("pool");
        let cpath = cstr(&path)?;
        // SAFETY: a NUL-terminated path; the descriptor is ours from here.
        let fd = unsafe {
            libc::open(
                cpath.as_ptr(),
                libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC,
                0o600,
            )
        };
        check(fd)?;
        // SAFETY: fd was just opened and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let _ = std::fs::remove_file(&path);
        // SAFETY: sizing our own file.
        check(unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) })?;
        Ok(fd)
    });
    // SAFETY: detaching the mount made above (if it was made) and removing
    // its empty mount point; the open file keeps the tmpfs alive.
    unsafe { libc::umount2(cdir.as_ptr(), libc::MNT_DETACH) };
    let _ = std::fs::remove_dir(&dir);
    file
}

/// A `len`-byte memfd.
fn memfd(len: usize) -> io::Result<OwnedFd> {
    // SAFETY: a NUL-terminated name; the descriptor is ours from here.
    let fd = unsafe { libc::memfd_create(c"pagefleet-pool".as_ptr(), libc::MFD_CLOEXEC) };
    check(fd)?;
    // SAFETY: fd was just created and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sizing our own file.
    check(unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) })?;
    Ok(fd)
}
