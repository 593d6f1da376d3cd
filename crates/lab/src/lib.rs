//! The lab: what benchmarks, the demo and system tests share to run the
//! real thing — testbed labs driven through the CLI, child pagefleetd
//! processes, the kv load generator, swap and memory cgroups, plots.

// Not a library API: a lab harness for benchmarks, the demo and tests.
#![allow(missing_docs)]

pub mod demo;
pub mod etcd;
pub mod fio;
pub mod forward;
pub mod kvload;
pub mod labrun;
pub mod nbd;
pub mod plot;
pub mod proc;
pub mod rawhttp;
pub mod stats;
pub mod system;

pub use labrun::LabRun;

/// Bytes with a binary unit (for logs and tables).
pub use pagefleet_common::units::fmt_size as fmt_bytes;

/// Whether this process runs as root (labs and swap need it).
pub fn is_root() -> bool {
    pagefleet_common::sys::process::is_root()
}
