//! The raw system calls of the VM crate, each behind a safe function.

use std::os::fd::AsRawFd;

/// `KVM_GET_API_VERSION` (`_IO(KVMIO, 0x00)`) on an open `/dev/kvm`.
pub(crate) fn kvm_api_version(kvm: &std::fs::File) -> i32 {
    const KVM_GET_API_VERSION: libc::c_ulong = 0xAE00;
    // SAFETY: an ioctl that takes no argument, on a descriptor the caller
    // keeps open for the call.
    unsafe { libc::ioctl(kvm.as_raw_fd(), KVM_GET_API_VERSION as _) }
}

/// `struct ifreq` (linux/if.h) as the tap and bridge ioctls use it: the
/// interface name, then a 24-byte union of which they read a short
/// (flags) or an int (an interface index) at its start.
#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    data: [u8; 24],
}

impl IfReq {
    fn new(name: &str) -> std::io::Result<IfReq> {
        let mut r = IfReq {
            name: [0; libc::IFNAMSIZ],
            data: [0; 24],
        };
        if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains('\0') {
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        }
        r.name[..name.len()].copy_from_slice(name.as_bytes());
        Ok(r)
    }

    fn name(&self) -> String {
        let end = self
            .name
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(self.name.len());
        String::from_utf8_lossy(&self.name[..end]).into_owned()
    }
}

/// `ioctl(fd, req, &mut ifreq)`.
fn ifreq_ioctl(fd: &impl AsRawFd, req: libc::c_ulong, r: &mut IfReq) -> std::io::Result<()> {
    // SAFETY: `r` is a complete, writable `struct ifreq` (40 bytes, the
    // kernel's size on this ABI) that outlives the call; the descriptor is
    // borrowed for it.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), req as _, r as *mut IfReq) };
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Make `tun` (an open `/dev/net/tun`) a new tap device named after
/// `pattern` (the kernel fills in `%d`), with virtio-net headers
/// (`IFF_VNET_HDR`, which QEMU's tap backend uses) and no packet-info
/// prefix. Returns the device's name.
pub(crate) fn tun_set_tap(tun: &std::fs::File, pattern: &str) -> std::io::Result<String> {
    let mut r = IfReq::new(pattern)?;
    let flags = (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short;
    r.data[..2].copy_from_slice(&flags.to_ne_bytes());
    ifreq_ioctl(tun, libc::TUNSETIFF as libc::c_ulong, &mut r)?;
    Ok(r.name())
}

/// A socket for interface ioctls.
pub(crate) fn ioctl_socket() -> std::io::Result<std::os::fd::OwnedFd> {
    // SAFETY: creates a descriptor; no memory is passed.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by socket(2) and is owned by nobody else.
    Ok(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
}

/// Add interface `dev` to bridge `bridge` (`SIOCBRADDIF`).
pub(crate) fn bridge_add(
    sock: &std::os::fd::OwnedFd,
    bridge: &str,
    dev: &str,
) -> std::io::Result<()> {
    /// linux/sockios.h: "add interface to bridge".
    const SIOCBRADDIF: libc::c_ulong = 0x89a2;
    let mut r = IfReq::new(dev)?;
    ifreq_ioctl(sock, libc::SIOCGIFINDEX as libc::c_ulong, &mut r)?;
    let index = i32::from_ne_bytes([r.data[0], r.data[1], r.data[2], r.data[3]]);
    let mut b = IfReq::new(bridge)?;
    b.data[..4].copy_from_slice(&index.to_ne_bytes());
    ifreq_ioctl(sock, SIOCBRADDIF, &mut b)
}

/// Bring interface `dev` up (`IFF_UP`, keeping its other flags).
pub(crate) fn link_up(sock: &std::os::fd::OwnedFd, dev: &str) -> std::io::Result<()> {
    let mut r = IfReq::new(dev)?;
    ifreq_ioctl(sock, libc::SIOCGIFFLAGS as libc::c_ulong, &mut r)?;
    let flags =
        libc::c_short::from_ne_bytes([r.data[0], r.data[1]]) | libc::IFF_UP as libc::c_short;
    r.data[..2].copy_from_slice(&flags.to_ne_bytes());
    ifreq_ioctl(sock, libc::SIOCSIFFLAGS as libc::c_ulong, &mut r)
}

/// Let `fd` survive `cmd`'s exec (clear its close-on-exec flag in the
/// child only), at the same number: QEMU's `-netdev tap,fd=N`.
pub(crate) fn inherit_fd(cmd: &mut std::process::Command, fd: std::os::fd::RawFd) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the forked child before exec and calls
    // only fcntl(2), which is async-signal-safe; it touches no memory of
    // the parent's allocator.
    unsafe {
        cmd.pre_exec(move || {
            if libc::fcntl(fd, libc::F_SETFD, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}
