//! What an outgoing migration reports while it runs and how it ends: the
//! live counters a progress bar polls and the typed failure. Shared by the
//! source side and its sharing-aware senders (`dedup`, `sub_dedup`).

use crate::plan;
use crate::wire::WireError;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Duration;

/// Why a migration failed (everything before GO is rolled back).
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    /// The migration stream.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// The guest does not fit.
    #[error(transparent)]
    Plan(#[from] plan::PlanError),
    /// A sub-host's memory server.
    #[error("sub-host {addr}: {source}")]
    Sub {
        /// Its address.
        addr: String,
        /// What went wrong.
        source: pagefleet_client::ClientError,
    },
    /// The destination cannot be reached.
    #[error("cannot reach the destination {0}: {1}")]
    Connect(String, std::io::Error),
    /// The guest did not reach a safepoint.
    #[error("the guest did not reach a safepoint within {0:?}")]
    PauseTimeout(Duration),
    /// Cancelled by the caller.
    #[error("cancelled")]
    Cancelled,
    /// Anything else.
    #[error("{0}")]
    Other(String),
    /// GO was sent but the destination never confirmed the start: the guest
    /// stays paused here, since it may be running there.
    #[error("the destination did not confirm the resume ({0}); the guest stays paused on the source: check the destination before resuming it")]
    InDoubt(String),
}

/// Live counters for a progress bar (`pagefleet migrate` polls them).
#[derive(Default, Debug)]
pub struct Progress {
    /// What it is doing.
    pub phase: Mutex<String>,
    /// Pre-copy round.
    pub round: AtomicU64,
    /// Pages this round sends.
    pub round_pages: AtomicU64,
    /// Of which sent.
    pub round_sent: AtomicU64,
    /// Bytes sent to the main host.
    pub bytes_main: AtomicU64,
    /// Bytes sent to sub-hosts.
    pub bytes_subs: AtomicU64,
    /// Bytes per second the last round moved.
    pub transfer_rate: AtomicU64,
    /// Bytes per second the guest dirtied during the last round.
    pub dirty_rate: AtomicU64,
    /// What an abort undid, in order (for the person who asked).
    pub rolled_back: Mutex<Vec<String>>,
}

impl Progress {
    pub(crate) fn set_phase(&self, p: &str) {
        *self.phase.lock().unwrap() = p.to_string();
    }
    pub(crate) fn undid(&self, what: String) {
        self.rolled_back
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(what);
    }

    /// What the last abort undid.
    pub fn rollback(&self) -> Vec<String> {
        self.rolled_back
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Back to zero, for a new attempt.
    pub fn reset(&self) {
        self.set_phase("");
        self.rolled_back
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        for c in [
            &self.round,
            &self.round_pages,
            &self.round_sent,
            &self.bytes_main,
            &self.bytes_subs,
            &self.transfer_rate,
            &self.dirty_rate,
        ] {
            c.store(0, Relaxed);
        }
    }
}
