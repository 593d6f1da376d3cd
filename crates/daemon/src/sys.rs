//! This crate's raw system calls, each behind a function whose `SAFETY:`
//! comments say why the call is sound (the architecture test keeps
//! `libc::` calls in `sys` modules).

use std::ffi::{CStr, CString};
use std::os::fd::RawFd;

/// Set or clear descriptor `fd`'s close-on-exec flag.
///
/// # Safety
/// `fd` must be a descriptor this process may change: one it owns, or one
/// handed to it alone (the in-place restart's inherited descriptors).
pub(crate) unsafe fn set_cloexec(fd: RawFd, on: bool) -> std::io::Result<()> {
    // SAFETY: F_GETFD/F_SETFD on a descriptor the caller may change; a
    // closed one is EBADF.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let want = if on {
        flags | libc::FD_CLOEXEC
    } else {
        flags & !libc::FD_CLOEXEC
    };
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, want) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Replace this process's image with `exe` (execve), arguments `argv`,
/// environment `envp`. Returns only on failure: why.
pub(crate) fn exec(exe: &CStr, argv: &[CString], envp: &[CString]) -> std::io::Error {
    let ptrs = |v: &[CString]| {
        v.iter()
            .map(|c| c.as_ptr())
            .chain(std::iter::once(std::ptr::null()))
            .collect::<Vec<_>>()
    };
    let (argv_p, envp_p) = (ptrs(argv), ptrs(envp));
    // SAFETY: NUL-terminated strings and NULL-terminated arrays of them
    // that live until the call returns (it does only on failure).
    unsafe { libc::execve(exe.as_ptr(), argv_p.as_ptr(), envp_p.as_ptr()) };
    std::io::Error::last_os_error()
}
