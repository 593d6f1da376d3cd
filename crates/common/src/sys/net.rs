//! Network interfaces.

/// The index of network interface `name` in this thread's network
/// namespace, if there is one.
pub fn interface_index(name: &str) -> Option<u32> {
    let c = std::ffi::CString::new(name).ok()?;
    // SAFETY: a NUL-terminated name that outlives the call; only read.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    (i != 0).then_some(i)
}

/// Whether `name` is a bridge in this thread's network namespace: Ok, or
/// why not. Asked of the kernel through a socket made here (ethtool's
/// driver query: a bridge's driver is "bridge"), so it answers for the
/// namespace the calling thread is in, whatever /sys shows (`nsenter
/// --net` keeps the old /sys).
pub fn check_bridge(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains(['/', '\0']) {
        return Err("not a network device name (1 to 15 bytes, no '/')".into());
    }
    if interface_index(name).is_none() {
        return Err("no such network device here (`ip link` lists them)".into());
    }
    match driver(name) {
        Ok(d) if d == "bridge" => Ok(()),
        Ok(d) => Err(format!(
            "a {d} device, not a bridge (`ip link add NAME type bridge` makes one)"
        )),
        Err(e) => Err(format!("cannot ask its driver: {e}")),
    }
}

/// The driver of network device `name` (`ETHTOOL_GDRVINFO`).
fn driver(name: &str) -> std::io::Result<String> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    const ETHTOOL_GDRVINFO: u32 = 0x0000_0003;
    /// linux/ethtool.h `struct ethtool_drvinfo`.
    #[repr(C)]
    struct DrvInfo {
        cmd: u32,
        driver: [u8; 32],
        version: [u8; 32],
        fw_version: [u8; 32],
        bus_info: [u8; 32],
        erom_version: [u8; 32],
        reserved2: [u8; 12],
        n_priv_flags: u32,
        n_stats: u32,
        testinfo_len: u32,
        eedump_len: u32,
        regdump_len: u32,
    }
    /// linux/if.h `struct ifreq` with the `ifr_data` member.
    #[repr(C)]
    struct IfReqData {
        name: [u8; libc::IFNAMSIZ],
        data: *mut DrvInfo,
        _pad: [u8; 16],
    }
    // SAFETY: plain data of integers and byte arrays; all zeros is valid.
    let mut info: DrvInfo = unsafe { std::mem::zeroed() };
    info.cmd = ETHTOOL_GDRVINFO;
    let mut r = IfReqData {
        name: [0; libc::IFNAMSIZ],
        data: &mut info,
        _pad: [0; 16],
    };
    r.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: creates a descriptor; no memory is passed.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by socket(2) and is owned by nobody else.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: `r` is a complete `struct ifreq` (name NUL-terminated: the
    // name is shorter than IFNAMSIZ) whose data pointer points at `info`,
    // a complete `struct ethtool_drvinfo`; both outlive the call.
    let rc = unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCETHTOOL as _, &mut r) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let end = info.driver.iter().position(|&b| b == 0).unwrap_or(32);
    Ok(String::from_utf8_lossy(&info.driver[..end]).into_owned())
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
