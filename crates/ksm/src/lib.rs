//! Same-page merging control (paper 001): the kernel's KSM knobs and
//! counters, ksmtuned's algorithm for an honest comparison, an adaptive
//! controller that scans while merging pays within a CPU budget, and
//! enrolment of processes.

// Not every public item is documented yet (issue 16): remove this once
// `cargo clippy -p pagefleet-ksm` passes without it.
#![allow(missing_docs)]

pub mod adaptive;
pub mod cli;
pub mod control;
pub mod enroll;
pub mod sysfs;
pub mod tuned;
