//! The raw system calls of the VM crate, each behind a safe function.

use std::os::fd::AsRawFd;

/// `KVM_GET_API_VERSION` (`_IO(KVMIO, 0x00)`) on an open `/dev/kvm`.
pub(crate) fn kvm_api_version(kvm: &std::fs::File) -> i32 {
    const KVM_GET_API_VERSION: libc::c_ulong = 0xAE00;
    // SAFETY: an ioctl that takes no argument, on a descriptor the caller
    // keeps open for the call.
    unsafe { libc::ioctl(kvm.as_raw_fd(), KVM_GET_API_VERSION as _) }
}
