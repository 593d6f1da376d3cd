//! VM guests: a QEMU process (KVM where it works, else TCG: [`accel`])
//! whose RAM is a pagefleet region.
//!
//! The runner makes the region's memfd, starts QEMU with its RAM backend on
//! that memfd (`memory-backend-file,share=on` over `/proc/PID/fd/N`) and
//! `LD_PRELOAD=libpagefleet_vmshim.so`; the shim registers QEMU's RAM
//! mapping with a userfaultfd and passes it back ([`Vm::start`] returns it
//! as a [`pagefleet_region::Foreign`]). From then on the region's pager
//! serves the VM's faults as a native guest's. QMP ([`qmp`]) stops,
//! continues and migrates the VM's device state; the serial console
//! ([`console`]) is logged and parsed.
//!
//! Nothing a request names is run: QEMU is the host's binary
//! (`PAGEFLEET_QEMU`, else `qemu-system-x86_64` on PATH), with a fixed
//! command line built from typed fields.

#![warn(missing_docs)]

pub mod accel;
pub mod console;
pub mod domain;
pub mod firmware;
mod hangup;
pub mod overlay;
mod place;
mod plain;
mod process;
mod qemu;
pub mod qmp;
mod sys;
pub mod tap;

pub use plain::{postcopy_downtime_ms, PlainLaunch, PlainVm};
pub use qemu::{Disk, Forward, Nic, Vm, VmSpec, GUEST_CONFIG_FW_CFG, GUEST_IP};

/// Why a VM could not be started or driven.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// An operating-system call failed.
    // Not a `source` field: the message already names the cause, and
    // anyhow's `{:#}` would print it twice.
    #[error("{context}: {cause}")]
    Io {
        /// What was being done.
        context: String,
        /// Why it failed.
        cause: std::io::Error,
    },
    /// A spec that cannot be run.
    #[error("{0}")]
    Invalid(String),
    /// QEMU failed or exited.
    #[error("QEMU: {0}")]
    Qemu(String),
    /// QEMU's QMP answered with an error or not at all.
    #[error("QMP: {0}")]
    Qmp(String),
    /// QEMU closed its QMP socket (it is exiting, mostly).
    #[error("QMP: QEMU closed its QMP socket")]
    QmpClosed,
}

impl VmError {
    /// An I/O error with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> VmError {
        VmError::Io {
            context: context.into(),
            cause: source,
        }
    }
}
