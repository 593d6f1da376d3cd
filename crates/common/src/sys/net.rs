//! Network interfaces.

/// The index of network interface `name` in this thread's network
/// namespace, if there is one.
pub fn interface_index(name: &str) -> Option<u32> {
    let c = std::ffi::CString::new(name).ok()?;
    // SAFETY: a NUL-terminated name that outlives the call; only read.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    (i != 0).then_some(i)
}

/// Send what of `bufs` the socket takes now, without waiting
/// (sendmsg(2) with MSG_DONTWAIT, MSG_NOSIGNAL): bytes sent, 0 if it
/// would block. For a writer that must not be held up by a peer that reads
/// nothing (the rest waits in the writer's own backlog).
pub fn send_now(
    sock: &impl std::os::fd::AsFd,
    bufs: &[std::io::IoSlice<'_>],
) -> std::io::Result<usize> {
    use std::os::fd::AsRawFd;
    // SAFETY: msghdr is plain data; zeroed is a valid empty header.
    let mut m: libc::msghdr = unsafe { std::mem::zeroed() };
    // IoSlice is ABI-compatible with iovec (std guarantees it on Unix).
    m.msg_iov = bufs.as_ptr() as *mut libc::iovec;
    m.msg_iovlen = bufs.len().min(libc::UIO_MAXIOV as usize) as _;
    loop {
        // SAFETY: the descriptor is borrowed for the call; the iovecs point
        // into `bufs`, which outlive it and are only read.
        let n = unsafe {
            libc::sendmsg(
                sock.as_fd().as_raw_fd(),
                &m,
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::Interrupted => continue,
            std::io::ErrorKind::WouldBlock => return Ok(0),
            _ => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{IoSlice, Read};

    #[test]
    fn send_now_takes_what_fits_and_never_waits() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let s = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let mut peer = l.accept().unwrap().0;
        let (a, b) = (vec![1u8; 1000], vec![2u8; 24]);
        assert_eq!(
            super::send_now(&s, &[IoSlice::new(&a), IoSlice::new(&b)]).unwrap(),
            1024
        );
        let mut got = vec![0u8; 1024];
        peer.read_exact(&mut got).unwrap();
        assert!(got[..1000].iter().all(|x| *x == 1) && got[1000..].iter().all(|x| *x == 2));
        // A peer that reads nothing: the socket fills, then takes nothing,
        // and the call returns at once each time.
        let big = vec![0u8; 1 << 20];
        let mut total = 0;
        loop {
            let n = super::send_now(&s, &[IoSlice::new(&big)]).unwrap();
            if n == 0 {
                break;
            }
            total += n;
            assert!(total < 1 << 30, "the socket never filled");
        }
        assert_eq!(super::send_now(&s, &[IoSlice::new(&big)]).unwrap(), 0);
    }
}
