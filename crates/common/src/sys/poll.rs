//! Waiting for descriptors: the protocol layer's poll, one definition.

pub use pagefleet_proto::sys::{poll, pollfd};
