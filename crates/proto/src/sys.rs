//! This crate's raw system calls, each behind a safe function (the
//! architecture test keeps `libc::` calls in `sys` modules).

use std::io::{self, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd};

/// Whether this process runs as root (effective uid 0).
pub(crate) fn is_root() -> bool {
    // SAFETY: geteuid takes nothing and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// One `recvmsg(MSG_WAITALL)` into `bufs` (at most 1024 of them): returns
/// when all are full, at end of stream, on a signal or timeout.
pub(crate) fn recv_all_vectored(s: &impl AsFd, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
    let n = bufs.len().min(1024);
    // SAFETY: a plain C struct; all zeros is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = bufs.as_mut_ptr().cast();
    msg.msg_iovlen = n as _;
    // SAFETY: msg describes `n` live buffers (IoSliceMut has iovec's
    // layout) borrowed mutably for the call; the socket is borrowed open.
    let r = unsafe { libc::recvmsg(s.as_fd().as_raw_fd(), &mut msg, libc::MSG_WAITALL) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(r as usize)
}

/// Whether the peer of socket `fd` hung up, waiting up to `timeout_ms`.
pub(crate) fn peer_hung_up(fd: &impl AsFd, timeout_ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd: fd.as_fd().as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one pollfd on the stack; the descriptor is borrowed open.
    let n = unsafe { libc::poll(&mut p, 1, timeout_ms) };
    n > 0 && p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}
