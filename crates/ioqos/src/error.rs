//! What can go wrong guaranteeing I/O.

use std::fmt::Display;

/// An error of the I/O guarantee crate.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A setting, tenant spec or device name that cannot be used.
    #[error("{0}")]
    Invalid(String),
    /// Something failed while doing `what` (a cgroup file, QMP, the device).
    #[error("{what}: {source}")]
    Failed {
        /// What was being done.
        what: String,
        /// Why (its text is part of this error's message).
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A system call.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// A QMP message or state file that is not the JSON expected.
    #[error("unexpected JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// The FIFO disk (`pagefleet ioqos fifodisk`).
    #[error(transparent)]
    Disk(#[from] pagefleet_fifodisk::Error),
    /// Another controller holds the state file.
    #[error(transparent)]
    State(#[from] pagefleet_common::controller::StateError),
}

/// A result of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Say what was being done when something failed, or what was missing.
pub trait Context<T> {
    /// With `what` said up front.
    fn context(self, what: impl Display) -> Result<T>;
    /// With the description made only on failure.
    fn with_context<D: Display>(self, f: impl FnOnce() -> D) -> Result<T>;
}

impl<T, E: std::error::Error + Send + Sync + 'static> Context<T> for std::result::Result<T, E> {
    fn context(self, what: impl Display) -> Result<T> {
        self.map_err(|e| Error::Failed {
            what: what.to_string(),
            source: Box::new(e),
        })
    }
    fn with_context<D: Display>(self, f: impl FnOnce() -> D) -> Result<T> {
        self.map_err(|e| Error::Failed {
            what: f().to_string(),
            source: Box::new(e),
        })
    }
}

impl<T> Context<T> for Option<T> {
    fn context(self, what: impl Display) -> Result<T> {
        self.ok_or_else(|| Error::Invalid(what.to_string()))
    }
    fn with_context<D: Display>(self, f: impl FnOnce() -> D) -> Result<T> {
        self.ok_or_else(|| Error::Invalid(f().to_string()))
    }
}
