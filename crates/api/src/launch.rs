//! How pagefleetd starts a runner: the runner binary is fixed by the
//! daemon's configuration and takes no caller-chosen arguments; this one
//! message, written to the runner's stdin, says what to run. The secret
//! travels here too, so it is on no command line and in no environment.

use crate::guest::GuestSpec;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// What a runner is started for.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "mode", rename_all = "lowercase", deny_unknown_fields)]
pub enum Job {
    /// Run a new guest here.
    Guest {
        /// Its name.
        name: String,
        /// Guest memory, bytes.
        size: u64,
        /// Pages resident here.
        budget_pages: u64,
        /// What it runs (boxed: far larger than the other variant).
        spec: Box<GuestSpec>,
    },
    /// Wait for one incoming migration, then run the guest it brings.
    Incoming {
        /// Name the guest is expected under.
        name: String,
        /// Where to take the migration stream (IP:0 picks a port).
        listen: String,
        /// Most pages this host gives the guest.
        budget_pages: u64,
        /// Give up if no migration arrives within this many seconds.
        timeout_secs: u64,
    },
}

/// The one line a runner reads from stdin at start.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Launch {
    /// The cluster secret, hex-encoded.
    pub secret_hex: String,
    /// The control socket to serve.
    pub control: PathBuf,
    /// Network device the guest's service address goes on.
    pub service_dev: String,
    /// What to run.
    pub job: Job,
    /// The host's content lookup socket (sharing-aware migration; an
    /// incoming runner fills pages this host already holds through it).
    #[serde(default)]
    pub dedup_socket: Option<PathBuf>,
    /// The host's TLS identity directory: the runner's connections to peers
    /// not on loopback (memory servers, migration streams) use it.
    #[serde(default)]
    pub tls_dir: Option<PathBuf>,
    /// The bridge VM guests' own NICs join (`pagefleetd --vm-bridge`;
    /// None: a VM asking for one is refused here).
    #[serde(default)]
    pub vm_bridge: Option<String>,
}

/// Hex-encode bytes (the secret in a [`Launch`]).
pub fn to_hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Decode [`to_hex`]'s output.
pub fn from_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || !s.is_ascii() {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok())
        .collect()
}
