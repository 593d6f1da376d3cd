//! Benchmarks behind `pagefleet bench <what>`. Each one runs pagefleet and
//! its baselines/peers side by side in one run, prints a table, writes a PNG
//! (through `bench/plot_*.py`), and with `--json` prints one JSON object with
//! every measurement and a `goals` list computed from this run.

pub mod blockdev;
pub mod demo;
pub mod ioqos;
pub mod ksm;
pub mod kvload;
pub mod lab;
pub mod memserver;
pub mod migration;
pub mod paging;
pub mod util;

/// Bytes with a binary unit (for benchmark logs and tables).
pub use pagefleet_common::units::fmt_size as fmt_bytes;

pub fn is_root() -> bool {
    // SAFETY: plain syscall.
    unsafe { libc::geteuid() == 0 }
}
