//! Waiting for descriptors (poll).

use std::io;

/// poll(2) over `fds` for up to `timeout_ms` (-1: forever): how many have
/// events (their `revents`). EINTR counts as 0 ready.
pub fn poll(fds: &mut [libc::pollfd], timeout_ms: i32) -> io::Result<usize> {
    // SAFETY: the slice is `fds.len()` valid pollfds, borrowed mutably for
    // the call; poll does not keep them.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::Interrupted {
            Ok(0)
        } else {
            Err(e)
        };
    }
    Ok(n as usize)
}

/// A pollfd asking for `events` on `fd`.
pub fn pollfd(fd: &impl std::os::fd::AsFd, events: libc::c_short) -> libc::pollfd {
    use std::os::fd::AsRawFd;
    libc::pollfd {
        fd: fd.as_fd().as_raw_fd(),
        events,
        revents: 0,
    }
}
