//! This crate's raw system calls, each behind a function whose `SAFETY:`
//! comments say why the call is sound (the architecture test keeps
//! `libc::` calls in `sys` modules).

use std::io::{self, IoSlice};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, BorrowedFd};

/// sendmsg(MSG_DONTWAIT | MSG_NOSIGNAL) of `bufs` (at most 1024 of them).
pub(crate) fn send_vectored_nowait(s: &TcpStream, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
    // SAFETY: a plain C struct; all zeros is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = bufs.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = bufs.len().min(1024) as _;
    // SAFETY: the socket is borrowed open; msg describes live buffers
    // (IoSlice has iovec's layout) that the call only reads.
    let n = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

pub(crate) use pagefleet_proto::sys::recv;

/// Wait until the socket takes bytes, as its send timeout allows.
pub(crate) fn wait_writable(sock: &TcpStream) -> io::Result<()> {
    let ms = match sock.write_timeout()? {
        None => -1,
        Some(t) => t.as_millis().clamp(1, i32::MAX as u128) as i32,
    };
    let mut p = libc::pollfd {
        fd: sock.as_raw_fd(),
        events: libc::POLLOUT,
        revents: 0,
    };
    loop {
        // SAFETY: one live pollfd.
        let n = unsafe { libc::poll(&mut p, 1, ms) };
        if n > 0 {
            return Ok(());
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the peer took no bytes within the send timeout",
            ));
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Write every byte the iovecs describe (retrying short writes).
///
/// # Safety
/// Each iovec must describe memory valid for reads for the whole call.
pub(crate) unsafe fn writev_all(fd: BorrowedFd<'_>, iov: &mut [libc::iovec]) -> io::Result<()> {
    let mut i = 0;
    while i < iov.len() {
        let n = (iov.len() - i).min(1024) as libc::c_int;
        // SAFETY: the iovecs are valid per the caller's contract.
        let w = unsafe { libc::writev(fd.as_raw_fd(), iov[i..].as_ptr(), n) };
        if w < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if w == 0 {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "connection accepted no more bytes",
            ));
        }
        let mut w = w as usize;
        while i < iov.len() && w >= iov[i].iov_len {
            w -= iov[i].iov_len;
            i += 1;
        }
        if w > 0 {
            // Part of this iovec went out: send the rest of it next.
            iov[i].iov_base = (iov[i].iov_base as usize + w) as *mut libc::c_void;
            iov[i].iov_len -= w;
        }
    }
    Ok(())
}
