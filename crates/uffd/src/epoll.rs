//! epoll for the fault loop: the uffd, a doorbell and server sockets
//! registered once, then one `epoll_wait` per loop. `poll(2)` over the same
//! fds queues and dequeues a wait entry on every fd on every call, which
//! perf showed as a tenth of the pager's CPU per page-in.

use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};

/// An epoll instance; events carry the token given at registration.
pub struct Epoll {
    fd: OwnedFd,
}

/// How a registered fd reports readiness.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trigger {
    /// While readable (the uffd, an eventfd: whatever is left is seen again).
    Level,
    /// When new bytes arrive (sockets whose owner reads until empty, or
    /// ignores bytes it did not ask for).
    Edge,
}

impl Epoll {
    /// An empty set.
    pub fn new() -> io::Result<Epoll> {
        // SAFETY: plain syscall.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a new fd that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Epoll { fd })
    }

    /// Watch `fd` for input, reporting `token`. An fd closed later leaves
    /// the set by itself.
    pub fn add(&self, fd: impl AsFd, token: u64, trigger: Trigger) -> io::Result<()> {
        let fd = fd.as_fd().as_raw_fd();
        let mut ev = libc::epoll_event {
            events: (libc::EPOLLIN
                | libc::EPOLLRDHUP
                | if trigger == Trigger::Edge {
                    libc::EPOLLET
                } else {
                    0
                }) as u32,
            u64: token,
        };
        // SAFETY: valid epoll fd and event struct.
        if unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Wait up to `timeout_ms` (-1: forever; 0: just look) and call `f` with
    /// the token of each fd that is ready. Returns how many were.
    pub fn wait(&self, timeout_ms: i32, f: &mut dyn FnMut(u64)) -> io::Result<usize> {
        const EMPTY: libc::epoll_event = libc::epoll_event { events: 0, u64: 0 };
        let mut evs = [EMPTY; 32];
        // SAFETY: `evs` holds 32 writable events.
        let n = unsafe {
            libc::epoll_wait(
                self.fd.as_raw_fd(),
                evs.as_mut_ptr(),
                evs.len() as i32,
                timeout_ms,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                return Ok(0);
            }
            return Err(e);
        }
        for ev in &evs[..n as usize] {
            // (Copied out: the kernel's struct is packed.)
            let token = ev.u64;
            f(token);
        }
        Ok(n as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn level_repeats_and_edge_reports_new_input_once() {
        let ep = Epoll::new().unwrap();
        let a = crate::eventfd().unwrap();
        let (mut s, r) = std::os::unix::net::UnixStream::pair().unwrap();
        ep.add(a.as_fd(), 1, Trigger::Level).unwrap();
        ep.add(r.as_fd(), 2, Trigger::Edge).unwrap();
        let ready = |ep: &Epoll| {
            let mut v = Vec::new();
            ep.wait(0, &mut |t| v.push(t)).unwrap();
            v.sort();
            v
        };
        assert_eq!(ready(&ep), Vec::<u64>::new());
        crate::ring(&a);
        use std::io::Write;
        s.write_all(b"x").unwrap();
        assert_eq!(ready(&ep), vec![1, 2]);
        // Nothing read: the level-triggered fd is reported again, the
        // edge-triggered one not until more bytes come.
        assert_eq!(ready(&ep), vec![1]);
        s.write_all(b"y").unwrap();
        assert_eq!(ready(&ep), vec![1, 2]);
        crate::drain(&a);
        assert_eq!(ready(&ep), Vec::<u64>::new());
    }
}
