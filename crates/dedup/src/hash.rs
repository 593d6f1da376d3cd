//! The keyed page hash.
//!
//! BLAKE3 in keyed mode, the key derived from the cluster secret: a tenant
//! who does not know the key cannot compute a page's hash, so it cannot
//! craft a page that collides with another tenant's and be handed that
//! page by a destination that trusts hashes (the paper used plain SHA-1
//! and ignored collisions). The digest is cut to 128 bits: with a secret
//! key a collision needs ~2^64 pages by chance, and the index and the wire
//! carry half as much.

use pagefleet_proto::auth::Secret;
use serde::{Deserialize, Serialize};

/// Page size the hashes are over.
pub const PAGE: usize = pagefleet_units::PAGE_SIZE;

/// Context string of the key derivation (BLAKE3's derive_key mode): a
/// different context gives an unrelated key from the same secret.
const CONTEXT: &str = "pagefleet 2026-11 page content hash v1";

/// The cluster's key for page hashes.
#[derive(Clone)]
pub struct ContentKey([u8; 32]);

impl ContentKey {
    /// The key every host of the cluster derives from its shared secret.
    pub fn from_secret(secret: &Secret) -> ContentKey {
        ContentKey(blake3::derive_key(CONTEXT, secret.expose()))
    }

    /// The hash of one page.
    pub fn hash(&self, page: &[u8; PAGE]) -> PageHash {
        let h = blake3::keyed_hash(&self.0, page);
        let mut out = [0u8; 16];
        out.copy_from_slice(&h.as_bytes()[..16]);
        PageHash(out)
    }

    /// The hash of the zero page (every host can supply it).
    pub fn zero(&self) -> PageHash {
        self.hash(&[0u8; PAGE])
    }
}

impl std::fmt::Debug for ContentKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ContentKey(..)")
    }
}

/// A page's keyed hash (128 bits).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PageHash(pub [u8; 16]);

impl PageHash {
    /// Its bytes on the wire.
    pub fn to_bytes(self) -> [u8; 16] {
        self.0
    }
}

impl std::fmt::Debug for PageHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for b in &self.0[..6] {
            write!(f, "{b:02x}")?;
        }
        f.write_str("..")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(s: &[u8]) -> ContentKey {
        ContentKey::from_secret(&Secret::from_bytes(s, "test").unwrap())
    }

    #[test]
    fn equal_pages_hash_equal_and_the_key_matters() {
        let a = key(b"0123456789abcdef0123456789abcdef");
        let b = key(b"fedcba9876543210fedcba9876543210");
        let mut p = [7u8; PAGE];
        let h = a.hash(&p);
        assert_eq!(h, a.hash(&p.clone()));
        assert_ne!(h, b.hash(&p), "another cluster's key gives another hash");
        p[PAGE - 1] ^= 1;
        assert_ne!(h, a.hash(&p), "one bit changes the hash");
        assert_eq!(a.zero(), a.hash(&[0u8; PAGE]));
    }

    #[test]
    fn the_key_is_not_printed() {
        let a = key(b"0123456789abcdef0123456789abcdef");
        assert_eq!(format!("{a:?}"), "ContentKey(..)");
    }
}
