//! I/O performance guarantee (paper 004): tenants sharing one block device,
//! measured and capped through cgroup v1 blkio throttling, cgroup v2 io.max
//! or QEMU's block throttling over QMP; the paper's Algorithm 1 and a
//! `guarantee` policy that keeps every tenant at its minimum.

pub mod backend;
pub mod cli;
pub mod control;
pub mod device;
pub mod error;
pub mod policy;
pub mod spec;

pub use error::{Error, Result};
