//! Where the guest's memory is mapped: in this process (native guests), or
//! in another process that registered its mapping with userfaultfd and
//! handed the fd over (a QEMU VM through the pagefleet VM shim). The pager
//! serves both the same way; only unmapping a page (the sampler's zap) and
//! reading page tables need the other process.

use pagefleet_uffd::Mapping;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};

/// Unmaps pages in the process that maps the guest memory (`madvise` works
/// on the caller's own mappings only): the VM shim's agent inside QEMU.
pub trait Unmapper: Send + Sync {
    /// `madvise(MADV_DONTNEED)` on `[off, off + len)` of the guest mapping.
    fn unmap(&self, off: u64, len: u64) -> std::io::Result<()>;
}

/// A guest mapping in another process, registered there with a userfaultfd
/// (MISSING and WP, with the features the pager needs) and passed here.
pub struct Foreign {
    /// The mapping's address in that process.
    pub base: u64,
    /// Its length (the region's size).
    pub len: u64,
    /// That process (its pagemap gives reference bits).
    pub pid: i32,
    /// The uffd features it negotiated.
    pub features: u64,
    uffd: Mutex<Option<OwnedFd>>,
    unmapper: Box<dyn Unmapper>,
}

impl Foreign {
    /// The mapping at `base`/`len` in process `pid`, its registered `uffd`
    /// and how to unmap pages there.
    pub fn new(
        base: u64,
        len: u64,
        pid: i32,
        features: u64,
        uffd: OwnedFd,
        unmapper: Box<dyn Unmapper>,
    ) -> Foreign {
        Foreign {
            base,
            len,
            pid,
            features,
            uffd: Mutex::new(Some(uffd)),
            unmapper,
        }
    }

    /// The uffd, once (the pager takes it).
    pub(crate) fn take_uffd(&self) -> Option<OwnedFd> {
        self.uffd.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

impl std::fmt::Debug for Foreign {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Foreign(pid {}, {:#x}+{})",
            self.pid, self.base, self.len
        )
    }
}

/// The guest mapping the pager serves.
#[derive(Clone)]
pub(crate) enum GuestMem {
    Local(Arc<Mapping>),
    Foreign(Arc<Foreign>),
}

impl GuestMem {
    pub(crate) fn base(&self) -> u64 {
        match self {
            GuestMem::Local(m) => m.base(),
            GuestMem::Foreign(f) => f.base,
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            GuestMem::Local(m) => m.len(),
            GuestMem::Foreign(f) => f.len as usize,
        }
    }

    /// Drop the page-table entries of `[off, off + len)`; the memfd keeps
    /// the data, and the next touch maps it back without a uffd event.
    pub(crate) fn unmap(&self, off: usize, len: usize) -> std::io::Result<()> {
        match self {
            GuestMem::Local(m) => m.madvise(off, len, crate::sys::MADV_DONTNEED),
            GuestMem::Foreign(f) => f.unmapper.unmap(off as u64, len as u64),
        }
    }
}
