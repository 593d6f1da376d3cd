//! What can go wrong in testbed.

use std::fmt::Display;

/// An error of this crate.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A lab that cannot be made as asked.
    #[error("{0}")]
    Invalid(String),
    /// Something failed while doing `what`.
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
    /// The lab's state file is not the JSON expected.
    #[error("unexpected JSON: {0}")]
    Json(#[from] serde_json::Error),
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
