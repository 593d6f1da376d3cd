//! Passing a file descriptor with a small message over a Unix socket
//! (`SCM_RIGHTS`): how a userfaultfd registered in one process (QEMU,
//! through the VM shim) reaches the process that serves its faults.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// Longest message that comes with an fd.
pub const MAX_MSG: usize = 256;

/// Send `msg` (at most [`MAX_MSG`] bytes) and `fd` in one datagram/record.
pub fn send_fd(sock: RawFd, msg: &[u8], fd: RawFd) -> io::Result<()> {
    if msg.is_empty() || msg.len() > MAX_MSG {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "message of 1..=256 bytes",
        ));
    }
    let mut iov = libc::iovec {
        iov_base: msg.as_ptr() as *mut libc::c_void,
        iov_len: msg.len(),
    };
    // u64s: the control buffer must be aligned for cmsghdr.
    let mut cbuf = [0u64; 8];
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    // SAFETY: msghdr is plain data; every pointer set below outlives the call.
    let mut m: libc::msghdr = unsafe { std::mem::zeroed() };
    m.msg_iov = &mut iov;
    m.msg_iovlen = 1;
    m.msg_control = cbuf.as_mut_ptr().cast();
    m.msg_controllen = space;
    // SAFETY: the control buffer holds one cmsghdr with room for one fd
    // (space <= 64 bytes); CMSG_FIRSTHDR/CMSG_DATA point inside it.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&m);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as usize;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<RawFd>(), fd);
    }
    // SAFETY: m describes valid buffers for the duration of the call.
    let n = unsafe { libc::sendmsg(sock, &m, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Receive a message and the fd sent with it; `Ok(None)` at end of stream.
/// A message without an fd is an error (the peer is not the shim).
pub fn recv_fd(sock: RawFd, buf: &mut [u8]) -> io::Result<Option<(usize, OwnedFd)>> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut cbuf = [0u64; 8];
    // SAFETY: msghdr is plain data; every pointer set below outlives the call.
    let mut m: libc::msghdr = unsafe { std::mem::zeroed() };
    m.msg_iov = &mut iov;
    m.msg_iovlen = 1;
    m.msg_control = cbuf.as_mut_ptr().cast();
    m.msg_controllen = std::mem::size_of_val(&cbuf);
    // SAFETY: m describes valid buffers for the duration of the call.
    let n = unsafe { libc::recvmsg(sock, &mut m, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n == 0 {
        return Ok(None);
    }
    let mut got: Option<OwnedFd> = None;
    // SAFETY: walking the control messages the kernel wrote into cbuf,
    // with the libc macros, within msg_controllen.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&m);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let fd = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<RawFd>());
                // Each fd received is now ours: owned (and closed if extra).
                let owned = OwnedFd::from_raw_fd(fd);
                if got.is_none() {
                    got = Some(owned);
                }
            }
            c = libc::CMSG_NXTHDR(&m, c);
        }
    }
    if m.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "control message truncated",
        ));
    }
    match got {
        Some(fd) => Ok(Some((n as usize, fd))),
        None => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "message without a file descriptor",
        )),
    }
}

/// What the VM shim sends with the uffd: where QEMU mapped the guest RAM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The mapping's address in QEMU.
    pub base: u64,
    /// Its length.
    pub len: u64,
    /// QEMU's pid (for its pagemap).
    pub pid: u64,
    /// The uffd features the shim negotiated.
    pub features: u64,
}

const HELLO_MAGIC: &[u8; 8] = b"PFVMUF01";
/// Bytes of an encoded [`Hello`].
pub const HELLO_LEN: usize = 40;

impl Hello {
    /// Its wire form.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[..8].copy_from_slice(HELLO_MAGIC);
        for (i, v) in [self.base, self.len, self.pid, self.features]
            .iter()
            .enumerate()
        {
            b[8 + i * 8..16 + i * 8].copy_from_slice(&v.to_le_bytes());
        }
        b
    }
    /// Read one; `None` if it is not a shim's hello.
    pub fn decode(b: &[u8]) -> Option<Hello> {
        if b.len() != HELLO_LEN || &b[..8] != HELLO_MAGIC {
            return None;
        }
        let w = |i: usize| u64::from_le_bytes(b[8 + i * 8..16 + i * 8].try_into().unwrap());
        Some(Hello {
            base: w(0),
            len: w(1),
            pid: w(2),
            features: w(3),
        })
    }
}

/// A request to the shim's agent thread inside QEMU (24 bytes: op, offset,
/// length); it answers with 8 bytes: 0 or a negative errno.
pub mod agent {
    /// The first message after the hello: the fd was taken, QEMU may go on.
    pub const ACK: u64 = 1;
    /// `madvise(MADV_DONTNEED)` on `[base + off, base + off + len)`:
    /// unmapped in QEMU, kept in the memfd (the sampler's zap).
    pub const ZAP: u64 = 2;
    /// Encode a request.
    pub fn request(op: u64, off: u64, len: u64) -> [u8; 24] {
        let mut b = [0u8; 24];
        b[..8].copy_from_slice(&op.to_le_bytes());
        b[8..16].copy_from_slice(&off.to_le_bytes());
        b[16..].copy_from_slice(&len.to_le_bytes());
        b
    }
    /// Decode a request.
    pub fn parse(b: &[u8]) -> Option<(u64, u64, u64)> {
        if b.len() != 24 {
            return None;
        }
        let w = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap());
        Some((w(0), w(1), w(2)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixDatagram;

    #[test]
    fn an_fd_crosses_a_socket_pair_with_its_message() {
        let (a, b) = UnixDatagram::pair().unwrap();
        let (r, w) = std::io::pipe().unwrap();
        send_fd(a.as_raw_fd(), b"hello", w.as_raw_fd()).unwrap();
        drop(w);
        let mut buf = [0u8; 16];
        let (n, fd) = recv_fd(b.as_raw_fd(), &mut buf).unwrap().unwrap();
        assert_eq!(&buf[..n], b"hello");
        // The received fd is the pipe's write end: writing reaches the reader.
        let mut f = std::fs::File::from(fd);
        std::io::Write::write_all(&mut f, b"x").unwrap();
        drop(f);
        let mut got = Vec::new();
        std::io::Read::read_to_end(&mut std::io::BufReader::new(r), &mut got).unwrap();
        assert_eq!(got, b"x");
    }

    #[test]
    fn a_hello_round_trips_and_anything_else_is_not_one() {
        let h = Hello {
            base: 0x7f00_0000_0000,
            len: 1 << 30,
            pid: 4242,
            features: 0x1121,
        };
        assert_eq!(Hello::decode(&h.encode()), Some(h));
        let mut bad = h.encode();
        bad[0] ^= 1;
        assert_eq!(Hello::decode(&bad), None);
        assert_eq!(Hello::decode(&h.encode()[..39]), None);
    }

    #[test]
    fn a_message_without_an_fd_is_refused() {
        let (a, b) = UnixDatagram::pair().unwrap();
        a.send(b"no fd").unwrap();
        let mut buf = [0u8; 16];
        assert!(recv_fd(b.as_raw_fd(), &mut buf).is_err());
    }
}
