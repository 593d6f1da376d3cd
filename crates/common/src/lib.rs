//! Helpers every pagefleet crate shares: human sizes and shares, the signed
//! HTTP client for pagefleetd's API and the verifier the daemon checks it
//! with, the runner control-socket client, the controller skeleton (state
//! file, lock, waits), stop signals and error reports.

#![warn(missing_docs)]

pub mod context;
pub mod control;
pub mod controller;
pub mod disk_image;
pub mod http;
pub mod httpauth;
pub mod listen;
pub mod metrics;
pub mod report;
pub mod sdnotify;
pub mod sys;
pub mod units;

pub use sys::{clock, fds, heap, signal};
