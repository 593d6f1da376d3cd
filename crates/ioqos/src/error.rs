//! What can go wrong guaranteeing I/O.

/// An error of the I/O guarantee crate.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A setting, tenant spec or device name that cannot be used.
    #[error("{0}")]
    Invalid(String),
    /// Something failed while doing something (a cgroup file, QMP, the device).
    #[error(transparent)]
    Failed(#[from] pagefleet_common::context::Failed),
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

pub use pagefleet_common::context::Context;

/// A result of this crate.
pub type Result<T> = std::result::Result<T, Error>;
