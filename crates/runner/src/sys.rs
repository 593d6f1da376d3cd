//! This crate's raw system calls, each behind a function whose `SAFETY:`
//! comments say why the call is sound (the architecture test keeps
//! `libc::` calls in `sys` modules): the service address's rtnetlink
//! change and gratuitous ARP, and stdout's redirection.

use std::os::fd::{AsFd, AsRawFd};
use std::time::Duration;

/// What a network change could not do.
#[derive(Debug)]
pub(crate) enum NetError {
    /// The address is not IPv4.
    NotIpv4(String),
    /// No such network device.
    NoDevice(String),
    /// A socket call failed: which, and why.
    Os(&'static str, std::io::Error),
}

/// Point this process's stdout (fd 1) at `f` (dup2). Hold stdout's lock:
/// no other thread may write meanwhile.
pub(crate) fn replace_stdout(f: &impl AsFd) -> std::io::Result<()> {
    // SAFETY: dup2 onto fd 1 from a descriptor the borrow keeps open; fd 1
    // is the process's stdout, which std reopens nothing over.
    if unsafe { libc::dup2(f.as_fd().as_raw_fd(), 1) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Add or remove `ip`/32 on `dev` over rtnetlink (no `ip` process: this
/// runs inside a migration's downtime). Adding an address that is there,
/// or removing one that is not, is not an error.
pub(crate) fn addr_change(dev: &str, ip: &str, add: bool) -> Result<(), NetError> {
    let ip: std::net::Ipv4Addr = ip.parse().map_err(|_| NetError::NotIpv4(ip.to_string()))?;
    let name = std::ffi::CString::new(dev).map_err(|_| NetError::NoDevice(dev.to_string()))?;
    // SAFETY: plain syscalls on buffers we own; the fd is closed below.
    unsafe {
        let index = libc::if_nametoindex(name.as_ptr());
        if index == 0 {
            return Err(NetError::NoDevice(dev.to_string()));
        }
        let fd = libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        );
        if fd < 0 {
            return Err(NetError::Os(
                "netlink socket",
                std::io::Error::last_os_error(),
            ));
        }
        // nlmsghdr (16) + ifaddrmsg (8) + IFA_LOCAL (8) + IFA_ADDRESS (8)
        let mut m = Vec::with_capacity(40);
        let flags = (libc::NLM_F_REQUEST | libc::NLM_F_ACK) as u16
            | if add {
                (libc::NLM_F_CREATE | libc::NLM_F_EXCL) as u16
            } else {
                0
            };
        m.extend_from_slice(&40u32.to_ne_bytes());
        m.extend_from_slice(
            &(if add {
                libc::RTM_NEWADDR
            } else {
                libc::RTM_DELADDR
            })
            .to_ne_bytes(),
        );
        m.extend_from_slice(&flags.to_ne_bytes());
        m.extend_from_slice(&1u32.to_ne_bytes());
        m.extend_from_slice(&0u32.to_ne_bytes());
        m.extend_from_slice(&[libc::AF_INET as u8, 32, 0, 0]);
        m.extend_from_slice(&index.to_ne_bytes());
        for ty in [libc::IFA_LOCAL, libc::IFA_ADDRESS] {
            m.extend_from_slice(&8u16.to_ne_bytes());
            m.extend_from_slice(&ty.to_ne_bytes());
            m.extend_from_slice(&ip.octets());
        }
        let mut sa: libc::sockaddr_nl = std::mem::zeroed();
        sa.nl_family = libc::AF_NETLINK as u16;
        let sent = libc::sendto(
            fd,
            m.as_ptr().cast(),
            m.len(),
            0,
            (&sa as *const libc::sockaddr_nl).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as u32,
        );
        if sent < 0 {
            let e = std::io::Error::last_os_error();
            libc::close(fd);
            return Err(NetError::Os("netlink send", e));
        }
        let mut buf = [0u8; 512];
        let n = libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0);
        libc::close(fd);
        if n < 36 {
            return Err(NetError::Os(
                "netlink reply",
                std::io::Error::other("short reply"),
            ));
        }
        // NLMSG_ERROR carries an errno (0: the ack).
        let ty = u16::from_ne_bytes([buf[4], buf[5]]);
        if ty == libc::NLMSG_ERROR as u16 {
            let errno = -i32::from_ne_bytes([buf[16], buf[17], buf[18], buf[19]]);
            let benign = if add {
                libc::EEXIST
            } else {
                libc::EADDRNOTAVAIL
            };
            if errno != 0 && errno != benign {
                return Err(NetError::Os(
                    "netlink",
                    std::io::Error::from_raw_os_error(errno),
                ));
            }
        }
    }
    Ok(())
}

/// Broadcast a gratuitous ARP (a request for our own address) on `dev`, a
/// few times, so every neighbour maps `ip` to this host's MAC now.
pub(crate) fn gratuitous_arp(dev: &str, ip: &str) -> Result<(), NetError> {
    let ip: std::net::Ipv4Addr = ip.parse().map_err(|_| NetError::NotIpv4(ip.to_string()))?;
    let name = std::ffi::CString::new(dev).map_err(|_| NetError::NoDevice(dev.to_string()))?;
    // SAFETY: plain syscalls with valid arguments; every fd is closed below.
    unsafe {
        let ifindex = libc::if_nametoindex(name.as_ptr());
        if ifindex == 0 {
            return Err(NetError::NoDevice(dev.to_string()));
        }
        let fd = libc::socket(
            libc::AF_PACKET,
            libc::SOCK_DGRAM,
            (libc::ETH_P_ARP as u16).to_be() as i32,
        );
        if fd < 0 {
            return Err(NetError::Os(
                "packet socket",
                std::io::Error::last_os_error(),
            ));
        }
        let mut ifr: libc::ifreq = std::mem::zeroed();
        for (i, b) in dev.bytes().take(15).enumerate() {
            ifr.ifr_name[i] = b as libc::c_char;
        }
        if libc::ioctl(fd, libc::SIOCGIFHWADDR, &mut ifr) != 0 {
            let e = std::io::Error::last_os_error();
            libc::close(fd);
            return Err(NetError::Os("hardware address", e));
        }
        let mac: [u8; 6] = std::array::from_fn(|i| ifr.ifr_ifru.ifru_hwaddr.sa_data[i] as u8);
        // ARP request: who-has ip tell ip, from our MAC.
        let mut pkt = Vec::with_capacity(28);
        pkt.extend_from_slice(&[0, 1, 8, 0, 6, 4, 0, 1]);
        pkt.extend_from_slice(&mac);
        pkt.extend_from_slice(&ip.octets());
        pkt.extend_from_slice(&[0; 6]);
        pkt.extend_from_slice(&ip.octets());
        let mut sll: libc::sockaddr_ll = std::mem::zeroed();
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = (libc::ETH_P_ARP as u16).to_be();
        sll.sll_ifindex = ifindex as i32;
        sll.sll_halen = 6;
        sll.sll_addr[..6].copy_from_slice(&[0xff; 6]);
        let mut err = None;
        for _ in 0..3 {
            let n = libc::sendto(
                fd,
                pkt.as_ptr().cast(),
                pkt.len(),
                0,
                (&sll as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            );
            if n < 0 {
                err = Some(std::io::Error::last_os_error());
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        libc::close(fd);
        if let Some(e) = err {
            return Err(NetError::Os("sending ARP", e));
        }
    }
    Ok(())
}
