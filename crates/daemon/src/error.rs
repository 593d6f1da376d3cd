//! What can go wrong in daemon.

/// An error of this crate.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A setting that cannot be used.
    #[error("{0}")]
    Invalid(String),
    /// Something failed while doing something.
    #[error(transparent)]
    Failed(#[from] pagefleet_common::context::Failed),
    /// A system call.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// A configuration file that is not valid TOML for pagefleetd.
    #[error("{0}")]
    Toml(#[from] toml::de::Error),
    /// The KSM controller's settings.
    #[error(transparent)]
    Ksm(#[from] pagefleet_ksm::Error),
    /// The I/O controller's settings.
    #[error(transparent)]
    Ioqos(#[from] pagefleet_ioqos::Error),
    /// The cluster secret.
    #[error(transparent)]
    Secret(#[from] pagefleet_proto::auth::SecretError),
}

pub use pagefleet_common::context::Context;

/// A result of this crate.
pub type Result<T> = std::result::Result<T, Error>;
