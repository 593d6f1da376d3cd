//! The destination's page table: where each page of an incoming region is
//! (here, pulled here, on a memory server, zero), shared by the stream
//! receiver (`dest`), the pullers that gather pages from memory servers and
//! the filler thread that installs sharing-aware batches (`fill`).

use std::sync::atomic::AtomicU64;
use std::sync::Mutex;

/// Where each received page is: data here (from the main host), data here
/// pulled from a memory server (gather), on server i, or zero.
pub(crate) const HERE: u16 = 0xFFFE;
pub(crate) const PULLED: u16 = 0xFFFD;

/// What the stream receiver and the pullers (gather) share. Per-page
/// versions, in effect: data from the main host is always newer than a copy
/// pulled from a memory server (the main host never pages out during a
/// migration, so a page it sends is one it took back from the server), so
/// a pull never overwrites it, whichever arrives first.
pub(crate) struct Shared {
    pub(crate) loc: Mutex<Vec<u16>>,
    /// Per page on a server: the server with its second copy (NO_MIRROR:
    /// none). Written before `loc` names the server; read under `loc`.
    pub(crate) mirror: Mutex<Vec<u16>>,
    /// The guest mapping's address (pullers copy into it under `loc`'s lock).
    pub(crate) base: usize,
    pub(crate) pulled: AtomicU64,
    pub(crate) replaced: AtomicU64,
}
