//! Helpers every pagefleet crate shares: human sizes, the signed HTTP
//! client for pagefleetd's API and the verifier the daemon checks it with.

#![warn(missing_docs)]

pub mod control;
pub mod http;
pub mod httpauth;
pub mod report;
pub mod units;
