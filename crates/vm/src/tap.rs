//! A VM's own NIC: a tap device on the host's VM bridge, handed to QEMU
//! as an open descriptor (`-netdev tap,fd=N`: QEMU runs no ifup script and
//! needs no privilege to open `/dev/net/tun`).
//!
//! The tap is not persistent: it lives while a descriptor of it is open,
//! so it goes away with QEMU however QEMU ends (the runner closes its own
//! copy once QEMU has started). Nothing is left on the bridge after a
//! crash, and a migrated VM's source tap vanishes when its QEMU quits.

use crate::sys;
use crate::VmError;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

/// An open tap on a bridge, up.
#[derive(Debug)]
pub struct Tap {
    file: std::fs::File,
    /// Its device name (`pft0`, `pft1`, ...: the kernel picks the number).
    pub name: String,
}

/// The tap names' pattern: short, and recognisable in `ip link`.
const TAP_PATTERN: &str = "pft%d";

impl Tap {
    /// Make a tap, add it to `bridge` and bring it up. Errors name the
    /// bridge and what failed.
    pub fn on_bridge(bridge: &str) -> Result<Tap, VmError> {
        pagefleet_common::sys::net::check_bridge(bridge)
            .map_err(|e| VmError::Invalid(format!("VM bridge {bridge}: {e}")))?;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/net/tun")
            .map_err(|e| VmError::io("opening /dev/net/tun (the tap for the VM's NIC)", e))?;
        let name = sys::tun_set_tap(&file, TAP_PATTERN)
            .map_err(|e| VmError::io("creating the VM's tap (TUNSETIFF)", e))?;
        let sock = sys::ioctl_socket().map_err(|e| VmError::io("interface socket", e))?;
        sys::bridge_add(&sock, bridge, &name)
            .map_err(|e| VmError::io(format!("adding tap {name} to bridge {bridge}"), e))?;
        sys::link_up(&sock, &name)
            .map_err(|e| VmError::io(format!("bringing tap {name} up"), e))?;
        Ok(Tap { file, name })
    }

    /// The descriptor QEMU gets (see [`Tap::pass_to`]).
    pub fn raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    /// Let `cmd` inherit the tap's descriptor at [`Tap::raw_fd`].
    pub fn pass_to(&self, cmd: &mut std::process::Command) {
        sys::inherit_fd(cmd, self.raw_fd());
    }

    /// The descriptor, for a caller that keeps the tap alive.
    pub fn into_fd(self) -> OwnedFd {
        self.file.into()
    }
}
