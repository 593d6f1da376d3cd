//! What can go wrong controlling KSM.

/// An error of the KSM crate.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file under /sys or /proc could not be read or written.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Why.
        source: std::io::Error,
    },
    /// The kernel lacks KSM, or reports something unexpected.
    #[error("{0}")]
    Kernel(String),
    /// A process could not be enrolled.
    #[error("{0}")]
    Enroll(String),
    /// A setting out of range.
    #[error("{0}")]
    Invalid(String),
    /// Another controller holds the host.
    #[error(transparent)]
    State(#[from] pagefleet_common::controller::StateError),
}

/// A result of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Turn an I/O error into [`Error::Io`] saying what was being done.
pub fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let what = what.into();
    move |source| Error::Io { what, source }
}
