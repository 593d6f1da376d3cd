//! Passing a file descriptor with a small message over a Unix socket
//! (`SCM_RIGHTS`): how a userfaultfd registered in one process (QEMU,
//! through the VM shim) reaches the process that serves its faults.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// Longest message that comes with an fd.
pub const MAX_MSG: usize = 256;

/// Send `msg` (at most [`MAX_MSG`] bytes) and `fd` in one datagram/record.
pub fn send_fd(sock: impl AsFd, msg: &[u8], fd: impl AsFd) -> io::Result<()> {
    send_fds(sock, msg, &[fd.as_fd()])
}

/// Most fds [`send_fds`] sends with one message.
pub const MAX_SEND_FDS: usize = 8;

/// Send `msg` (1..=256 bytes) with `fds` (0..=[`MAX_SEND_FDS`]) in one
/// SCM_RIGHTS message. Tests and fuzz targets send what a hostile shim
/// could (several fds, or none) with it.
pub fn send_fds(sock: impl AsFd, msg: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    let sock = sock.as_fd().as_raw_fd();
    if msg.is_empty() || msg.len() > MAX_MSG {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "message of 1..=256 bytes",
        ));
    }
    if fds.len() > MAX_SEND_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "at most 8 fds with one message",
        ));
    }
    let mut iov = libc::iovec {
        iov_base: msg.as_ptr() as *mut libc::c_void,
        iov_len: msg.len(),
    };
    // u64s: the control buffer must be aligned for cmsghdr.
    let mut cbuf = [0u64; 8];
    let mut raw: [RawFd; MAX_SEND_FDS] = [-1; MAX_SEND_FDS];
    for (r, fd) in raw.iter_mut().zip(fds) {
        *r = fd.as_raw_fd();
    }
    let raw = &raw[..fds.len()];
    let bytes = std::mem::size_of_val(raw) as u32;
    // SAFETY: msghdr is plain data; every pointer set below outlives the call.
    let mut m: libc::msghdr = unsafe { std::mem::zeroed() };
    m.msg_iov = &mut iov;
    m.msg_iovlen = 1;
    if !fds.is_empty() {
        m.msg_control = cbuf.as_mut_ptr().cast();
        // SAFETY: CMSG_SPACE is a pure size computation.
        m.msg_controllen = unsafe { libc::CMSG_SPACE(bytes) } as usize;
        // SAFETY: the control buffer (64 bytes) holds one cmsghdr with room
        // for MAX_SEND_FDS fds (CMSG_SPACE(32) = 48 bytes);
        // CMSG_FIRSTHDR/CMSG_DATA point inside it, and `fds` has exactly
        // the fds.len() values copied.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&m);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(bytes) as usize;
            std::ptr::copy_nonoverlapping(
                raw.as_ptr(),
                libc::CMSG_DATA(c).cast::<RawFd>(),
                raw.len(),
            );
        }
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
pub fn recv_fd(sock: impl AsFd, buf: &mut [u8]) -> io::Result<Option<(usize, OwnedFd)>> {
    let sock = sock.as_fd().as_raw_fd();
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
    // with the libc macros, within msg_controllen; each fd read lies
    // within its message's cmsg_len, which the kernel wrote.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&m);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                // One SCM_RIGHTS message may carry several fds: every one
                // received is now ours, owned (and closed if extra).
                let data = ((*c).cmsg_len as usize).saturating_sub(libc::CMSG_LEN(0) as usize);
                for i in 0..data / std::mem::size_of::<RawFd>() {
                    let fd = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<RawFd>().add(i));
                    let owned = OwnedFd::from_raw_fd(fd);
                    if got.is_none() {
                        got = Some(owned);
                    }
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

/// The uffd features the runner needs from the shim's userfaultfd: faults
/// on shared memory, write-protection on it, WP faults flagged, and the
/// faulting thread's id.
pub const SHIM_FEATURES: u64 = crate::FEATURE_MISSING_SHMEM
    | crate::FEATURE_WP_HUGETLBFS_SHMEM
    | crate::FEATURE_PAGEFAULT_FLAG_WP
    | crate::FEATURE_THREAD_ID;

/// Where user-space addresses end on any x86-64 or arm64 kernel (5-level
/// page tables: 2^57); a mapping that claims to reach past it is not one.
pub const USER_ADDRESS_END: u64 = 1 << 57;

impl Hello {
    /// The runner's check of a hello from QEMU (which runs guest code and
    /// is not trusted): the mapping is page-aligned, non-empty, inside user
    /// space, exactly the guest's `size`, in the process the runner started
    /// (`pid`), with the features the pager needs.
    pub fn check(&self, size: u64, pid: u64) -> Result<(), String> {
        let page = crate::PAGE as u64;
        if self.len != size || self.pid != pid {
            return Err(format!(
                "a hand-over of {} bytes from pid {}, expected {size} bytes from pid {pid}",
                self.len, self.pid
            ));
        }
        if self.len == 0
            || self.base == 0
            || !self.base.is_multiple_of(page)
            || !self.len.is_multiple_of(page)
        {
            return Err(format!(
                "guest RAM at {:#x}, {} bytes: not whole pages",
                self.base, self.len
            ));
        }
        if self
            .base
            .checked_add(self.len)
            .is_none_or(|end| end > USER_ADDRESS_END)
        {
            return Err(format!(
                "guest RAM at {:#x}, {} bytes: past the end of user space",
                self.base, self.len
            ));
        }
        if self.features & SHIM_FEATURES != SHIM_FEATURES {
            return Err(format!(
                "userfaultfd features {:#x} lack {:#x}",
                self.features,
                SHIM_FEATURES & !self.features
            ));
        }
        Ok(())
    }
}

/// The runner's requests to the shim's agent thread inside QEMU (24 bytes:
/// op, offset, length) and its answers (8 bytes: 0 or a negative errno).
pub mod agent {
    use std::io;

    /// Bytes of an encoded [`Request`].
    pub const REQUEST_LEN: usize = 24;
    /// Bytes of an encoded answer.
    pub const REPLY_LEN: usize = 8;
    const ACK: u64 = 1;
    const ZAP: u64 = 2;
    /// The largest errno the kernel returns (`MAX_ERRNO`); an answer
    /// beyond it is not one.
    const MAX_ERRNO: i64 = 4095;

    /// What the runner asks of the agent.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Request {
        /// The first message after the hello: the fd was taken, QEMU may go on.
        Ack,
        /// `madvise(MADV_DONTNEED)` on `[base + off, base + off + len)`:
        /// unmapped in QEMU, kept in the memfd (the sampler's zap).
        Zap {
            /// Offset in the guest RAM mapping, bytes (page-aligned).
            off: u64,
            /// Length, bytes (whole pages, at least one).
            len: u64,
        },
    }

    impl Request {
        /// Its wire form.
        pub fn encode(&self) -> [u8; REQUEST_LEN] {
            let (op, off, len) = match *self {
                Request::Ack => (ACK, 0, 0),
                Request::Zap { off, len } => (ZAP, off, len),
            };
            let mut b = [0u8; REQUEST_LEN];
            b[..8].copy_from_slice(&op.to_le_bytes());
            b[8..16].copy_from_slice(&off.to_le_bytes());
            b[16..].copy_from_slice(&len.to_le_bytes());
            b
        }

        /// Read one for a mapping of `mapping_len` bytes: a zap must be
        /// whole pages inside it. Err: the errno the agent answers with.
        pub fn decode(b: &[u8], mapping_len: u64) -> Result<Request, i32> {
            if b.len() != REQUEST_LEN {
                return Err(libc::EINVAL);
            }
            let w = |i: usize| {
                let mut x = [0u8; 8];
                x.copy_from_slice(&b[i * 8..i * 8 + 8]);
                u64::from_le_bytes(x)
            };
            let page = crate::PAGE as u64;
            match (w(0), w(1), w(2)) {
                (ACK, 0, 0) => Ok(Request::Ack),
                (ZAP, off, len)
                    if len > 0
                        && off.is_multiple_of(page)
                        && len.is_multiple_of(page)
                        && off.checked_add(len).is_some_and(|end| end <= mapping_len) =>
                {
                    Ok(Request::Zap { off, len })
                }
                (ZAP, ..) => Err(libc::ERANGE),
                _ => Err(libc::EINVAL),
            }
        }
    }

    /// The agent's answer: 0, or the errno negated.
    pub fn reply(r: Result<(), i32>) -> [u8; REPLY_LEN] {
        let v: i64 = match r {
            Ok(()) => 0,
            Err(e) => -i64::from(e.clamp(1, MAX_ERRNO as i32)),
        };
        v.to_le_bytes()
    }

    /// Read an answer (from QEMU: anything that is not 0 or an errno is
    /// an error of its own).
    pub fn parse_reply(b: [u8; REPLY_LEN]) -> io::Result<()> {
        match i64::from_le_bytes(b) {
            0 => Ok(()),
            e if (-MAX_ERRNO..0).contains(&e) => Err(io::Error::from_raw_os_error((-e) as i32)),
            e => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("the VM shim's agent answered {e}, not 0 or an errno"),
            )),
        }
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
        send_fd(&a, b"hello", w.as_fd()).unwrap();
        drop(w);
        let mut buf = [0u8; 16];
        let (n, fd) = recv_fd(&b, &mut buf).unwrap().unwrap();
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
    fn the_runner_accepts_only_the_guest_ram_it_started() {
        let h = Hello {
            base: 0x7f00_0000_0000,
            len: 1 << 30,
            pid: 4242,
            features: SHIM_FEATURES | crate::FEATURE_POISON,
        };
        assert_eq!(h.check(1 << 30, 4242), Ok(()));
        for bad in [
            Hello { len: 1 << 29, ..h },
            Hello { pid: 1, ..h },
            Hello {
                base: h.base + 1,
                ..h
            },
            Hello { base: 0, ..h },
            Hello {
                base: u64::MAX - 4095,
                ..h
            },
            Hello {
                features: crate::FEATURE_MISSING_SHMEM,
                ..h
            },
        ] {
            assert!(bad.check(h.len, h.pid).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_agent_zaps_only_whole_pages_inside_the_mapping() {
        use agent::Request;
        let len = 16 * 4096;
        let zap = |off, n| Request::Zap { off, len: n };
        for r in [
            Request::Ack,
            zap(0, 4096),
            zap(15 * 4096, 4096),
            zap(0, len),
        ] {
            assert_eq!(Request::decode(&r.encode(), len), Ok(r));
        }
        for r in [
            zap(0, 0),
            zap(1, 4096),
            zap(0, 100),
            zap(15 * 4096, 8192),
            zap(u64::MAX - 4095, 8192),
        ] {
            assert_eq!(
                Request::decode(&r.encode(), len),
                Err(libc::ERANGE),
                "{r:?}"
            );
        }
        let mut other = Request::Ack.encode();
        other[0] = 9;
        assert_eq!(Request::decode(&other, len), Err(libc::EINVAL));
        assert_eq!(Request::decode(&other[..23], len), Err(libc::EINVAL));
        // Answers: 0, an errno, or an error of their own; never a panic.
        assert!(agent::parse_reply(agent::reply(Ok(()))).is_ok());
        let e = agent::parse_reply(agent::reply(Err(libc::EPERM))).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM));
        for v in [i64::MIN, -4096, 1, i64::MAX] {
            let e = agent::parse_reply(v.to_le_bytes()).unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
        }
    }

    #[test]
    fn every_fd_of_a_message_is_owned_and_extras_are_closed() {
        let (a, b) = UnixDatagram::pair().unwrap();
        let (r, w) = std::io::pipe().unwrap();
        // Three fds in one SCM_RIGHTS message (what a hostile shim could
        // send): the pipe's read end, then its write end twice.
        let fds = [r.as_fd(), w.as_fd(), w.as_fd()];
        send_fds(&a, b"hi", &fds).unwrap();
        drop(r);
        let mut buf = [0u8; 16];
        let (n, kept) = recv_fd(&b, &mut buf).unwrap().unwrap();
        assert_eq!(n, 2);
        // The kept fd is the read end. Once our own write end is closed it
        // reads end of file, which it does only if the two received copies
        // of the write end were closed too (else: would block).
        drop(w);
        let f = std::fs::File::from(kept);
        // SAFETY: fcntl on an fd this test owns.
        unsafe { libc::fcntl(f.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK) };
        let got = std::io::Read::read(&mut &f, &mut buf);
        assert_eq!(got.map_err(|e| e.kind()), Ok(0), "a received fd leaked");
    }

    #[test]
    fn a_message_without_an_fd_is_refused() {
        let (a, b) = UnixDatagram::pair().unwrap();
        a.send(b"no fd").unwrap();
        let mut buf = [0u8; 16];
        assert!(recv_fd(&b, &mut buf).is_err());
    }
}
