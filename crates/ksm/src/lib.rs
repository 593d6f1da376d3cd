//! Same-page merging control (paper 001): the kernel's KSM knobs and
//! counters, ksmtuned's algorithm for an honest comparison, an adaptive
//! controller that scans while merging pays within a CPU budget, and
//! enrolment of processes.

pub mod adaptive;
pub mod cli;
pub mod control;
pub mod enroll;
pub mod error;

pub use error::{Error, Result};
pub mod swapin;
mod sys;
pub mod sysfs;
pub mod tuned;
