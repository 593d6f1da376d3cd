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

use crate::sys::huge_tmpfs_file;
use pagefleet_common::sys::mapping::{file_len, Advice, Mapping};
use pagefleet_proto::PAGE_SIZE;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

/// What backs the slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backing {
    /// A file on a private tmpfs mounted with huge pages.
    HugeTmpfs,
    /// A memfd: shmem in 4 KiB pages unless the host enables shmem THP.
    Memfd,
}

/// The pool's mapping and the file behind it.
///
/// Who may touch which slot is decided by the index under the store's lock
/// (reserved, pinned or published slots); the mapping hands out raw
/// pointers only.
pub(crate) struct Pool {
    map: Mapping,
    file: OwnedFd,
    backing: Backing,
}

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
        let size = file_len(file.as_fd()).map_err(err)?;
        if size < len as u64 {
            return Err(err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("the handed-over pool file holds {size} bytes, not {len}"),
            )));
        }
        Self::map(file, len, backing).map_err(err)
    }

    fn bytes(pages: u64) -> usize {
        (pages as usize).max(1) * PAGE_SIZE
    }

    fn map(file: OwnedFd, len: usize, backing: Backing) -> io::Result<Pool> {
        let map = Mapping::shared(file.as_fd(), len)?;
        // Slots are handed out low-to-high, so huge pages fill densely and
        // RSS still tracks what is stored (rounded up to 2 MiB). On a memfd
        // this asks for shmem huge pages where the host allows them.
        map.advise(0, len, Advice::HugePages);
        Ok(Pool { map, file, backing })
    }

    pub(crate) fn ptr(&self, slot: u32) -> *mut u8 {
        assert!(
            (slot as usize + 1) * PAGE_SIZE <= self.map.len(),
            "slot {slot} beyond the pool"
        );
        // SAFETY: in bounds (checked above).
        unsafe { self.map.as_ptr().add(slot as usize * PAGE_SIZE) }
    }

    /// The file behind the slots (for the next process).
    pub(crate) fn file(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    pub(crate) fn backing(&self) -> Backing {
        self.backing
    }
}

/// A `len`-byte memfd.
fn memfd(len: usize) -> io::Result<OwnedFd> {
    pagefleet_common::sys::mapping::memfd(c"pagefleet-pool", len as u64, 0)
}
