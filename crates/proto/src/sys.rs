//! The socket calls every end of both protocols makes beyond what std
//! offers (flags on recv, vectored waits), each behind a safe function with
//! its `SAFETY:` comment; crates on the data path (client, tls, memserver)
//! use these. The architecture test keeps `libc::` calls in `sys` modules.

use std::io::{Error, ErrorKind, IoSliceMut, Result};
use std::os::fd::{AsFd, AsRawFd};

/// Whether this process runs as root (effective uid 0).
pub fn is_root() -> bool {
    // SAFETY: geteuid takes nothing and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// One `recvmsg(MSG_WAITALL)` into `bufs` (at most 1024 of them): returns
/// when all are full, at end of stream, on a signal or timeout.
pub fn recv_all_vectored(s: &impl AsFd, bufs: &mut [IoSliceMut<'_>]) -> Result<usize> {
    let n = bufs.len().min(1024);
    // SAFETY: a plain C struct; all zeros is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = bufs.as_mut_ptr().cast();
    msg.msg_iovlen = n as _;
    // SAFETY: msg describes `n` live buffers (IoSliceMut has iovec's
    // layout) borrowed mutably for the call; the socket is borrowed open.
    let r = unsafe { libc::recvmsg(s.as_fd().as_raw_fd(), &mut msg, libc::MSG_WAITALL) };
    if r < 0 {
        return Err(Error::last_os_error());
    }
    Ok(r as usize)
}

/// Whether the peer of socket `fd` hung up, waiting up to `timeout_ms`.
pub fn peer_hung_up(fd: &impl AsFd, timeout_ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd: fd.as_fd().as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one pollfd on the stack; the descriptor is borrowed open.
    let n = unsafe { libc::poll(&mut p, 1, timeout_ms) };
    n > 0 && p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

/// recv(2) with `flags` (`libc::MSG_PEEK`, `libc::MSG_DONTWAIT`, ...) into
/// `buf`: bytes received (0: the peer closed).
pub fn recv(s: &impl AsFd, buf: &mut [u8], flags: i32) -> Result<usize> {
    // SAFETY: buf is valid for writes of buf.len() bytes; the borrow keeps
    // the socket open.
    let n = unsafe {
        libc::recv(
            s.as_fd().as_raw_fd(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            flags,
        )
    };
    if n < 0 {
        return Err(Error::last_os_error());
    }
    Ok(n as usize)
}

/// poll(2) over `fds` for up to `timeout_ms` (-1: forever): how many have
/// events (their `revents`). EINTR counts as 0 ready.
pub fn poll(fds: &mut [libc::pollfd], timeout_ms: i32) -> Result<usize> {
    // SAFETY: the slice is `fds.len()` valid pollfds, borrowed mutably for
    // the call; poll does not keep them.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
    if n < 0 {
        let e = Error::last_os_error();
        return if e.kind() == ErrorKind::Interrupted {
            Ok(0)
        } else {
            Err(e)
        };
    }
    Ok(n as usize)
}

/// A pollfd asking for `events` on `fd`.
pub fn pollfd(fd: &impl std::os::fd::AsFd, events: libc::c_short) -> libc::pollfd {
    libc::pollfd {
        fd: fd.as_fd().as_raw_fd(),
        events,
        revents: 0,
    }
}
