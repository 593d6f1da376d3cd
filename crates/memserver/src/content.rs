//! The host content a memory server may store a PUT_HASHED page from.
//!
//! The server knows nothing about hashes or where its host keeps pages:
//! the daemon installs a provider (its content index, docs/dedup.md) that
//! finds, reads and checks pages by their keyed hash.

use crate::store::Store;

/// Pages this host holds, found by keyed content hash.
pub trait LocalContent: Send + Sync {
    /// For each `hashes[i]`, write the page whose keyed hash it is into
    /// `out[i * 4096..]` and return true, if this host holds it (the page
    /// read and checked against the hash); false otherwise. `store` is
    /// the asking server's own store (itself a content source).
    fn fill(&self, store: &Store, hashes: &[[u8; 16]], out: &mut [u8]) -> Vec<bool>;
}
