//! What can go wrong in testbed.

/// An error of this crate.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A lab that cannot be made as asked.
    #[error("{0}")]
    Invalid(String),
    /// Something failed while doing something.
    #[error(transparent)]
    Failed(#[from] pagefleet_common::context::Failed),
    /// A system call.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// The lab's state file is not the JSON expected.
    #[error("unexpected JSON: {0}")]
    Json(#[from] serde_json::Error),
}

pub use pagefleet_common::context::Context;

/// A result of this crate.
pub type Result<T> = std::result::Result<T, Error>;
