//! TLS for every pagefleet port: the cluster CA and the certificates it
//! issues ([`certs`]), an identity loaded from a directory of them
//! ([`Identity`]), and [`Stream`], the one socket type the memory server,
//! its clients, migration streams, the NBD export and the HTTP API run on:
//! plain TCP or TLS (rustls, ring), chosen per connection.
//!
//! Policy (the same on every port): a process that has an identity speaks
//! TLS to any peer that is not on loopback and refuses such a peer that
//! will not; plaintext stays possible on loopback, and a process without an
//! identity speaks plaintext only. TLS never replaces the cluster secret's
//! proof: both run, TLS first.

pub mod certs;
pub mod handshake;
mod identity;
mod stream;
mod sys;

pub use identity::Identity;
pub use stream::Stream;

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

/// Where an identity directory is named when no flag says: `$PAGEFLEET_TLS_DIR`.
pub const TLS_DIR_ENV: &str = "PAGEFLEET_TLS_DIR";

/// What went wrong with certificates or a TLS connection's setup.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A file holds something other than what it should.
    #[error("{path}: {what}")]
    BadFile {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        what: String,
    },
    /// `cert init` would overwrite a CA.
    #[error("{0} exists: a cluster CA is already there (remove it first to start a new cluster)")]
    Exists(PathBuf),
    /// A name is not usable in a certificate or as a server name.
    #[error("{0}")]
    BadName(String),
    /// Generating a key or certificate failed.
    #[error("certificate generation: {0}")]
    Generate(#[from] rcgen::Error),
    /// rustls refused the configuration or the peer (callers say "TLS").
    #[error("{0}")]
    Rustls(#[from] rustls::Error),
    /// The configuration could not be built.
    #[error("TLS configuration: {0}")]
    Config(String),
}

impl TlsError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> TlsError {
        TlsError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// Whether an address is this machine's loopback (where plaintext may stay).
pub fn is_loopback(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

/// The identity to use on a connection with `peer`: `id`, unless the peer
/// is on loopback (plaintext may stay there). Clients present it; servers
/// with one require TLS of such a peer.
pub fn for_peer<I>(id: Option<I>, peer: SocketAddr) -> Option<I> {
    id.filter(|_| !is_loopback(peer.ip()))
}

/// Whether a connection to or from `peer` must be TLS for a process whose
/// identity is `id`.
pub fn required(id: Option<&Identity>, peer: SocketAddr) -> bool {
    for_peer(id, peer).is_some()
}

static PROCESS: RwLock<Option<Arc<Identity>>> = RwLock::new(None);

/// Make `id` this process's identity: what its clients present and its
/// servers offer unless told otherwise. Binaries call this once at start.
pub fn set_process_identity(id: Option<Arc<Identity>>) {
    *PROCESS.write().unwrap_or_else(|e| e.into_inner()) = id;
}

/// This process's identity, if it has one.
pub fn process_identity() -> Option<Arc<Identity>> {
    PROCESS.read().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Load the identity in `dir` (or `$PAGEFLEET_TLS_DIR` when `dir` is None;
/// none at all when neither names one) and make it the process's.
pub fn init_process_identity(dir: Option<&Path>) -> Result<Option<Arc<Identity>>, TlsError> {
    let dir = match dir {
        Some(d) => Some(d.to_path_buf()),
        None => std::env::var_os(TLS_DIR_ENV)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from),
    };
    let id = match dir {
        Some(d) => Some(Arc::new(Identity::load(&d)?)),
        None => None,
    };
    set_process_identity(id.clone());
    Ok(id)
}
