//! The service address that moves with a guest: a secondary IPv4 address
//! on a device, added over rtnetlink (no `ip` process: this runs inside a
//! migration's downtime) and announced with a gratuitous ARP.

use std::time::Duration;
use tracing::warn;

/// Why the service address could not be moved.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// The address is not IPv4.
    #[error("service address {0:?} is not IPv4")]
    NotIpv4(String),
    /// No such network device.
    #[error("no network device {0:?}")]
    NoDevice(String),
    /// A socket call failed.
    #[error("{0}: {1}")]
    Os(&'static str, std::io::Error),
}

/// The service address that moves with the guest (secondary IP on a device).
#[derive(Clone, Debug)]
pub struct Service {
    /// The address.
    pub ip: String,
    /// The device it goes on.
    pub dev: String,
}

impl Service {
    /// Add the address here and tell the neighbours.
    pub fn claim(&self) -> Result<(), ServiceError> {
        addr_change(&self.dev, &self.ip, true)?;
        // Tell the neighbours (gratuitous ARP) so clients need not wait for
        // their caches to time out; off the critical path of a migration.
        let (dev, ip) = (self.dev.clone(), self.ip.clone());
        std::thread::spawn(move || {
            if let Err(e) = gratuitous_arp(&dev, &ip) {
                warn!("gratuitous ARP for {ip} on {dev}: {e}");
            }
        });
        Ok(())
    }

    /// Remove the address here (the destination takes it over).
    pub fn release(&self) {
        if let Err(e) = addr_change(&self.dev, &self.ip, false) {
            warn!("removing service address {}: {e}", self.ip);
        }
    }
}

/// Add or remove `ip`/32 on `dev` over rtnetlink (no `ip` process: this
/// runs inside a migration's downtime). Adding an address that is there,
/// or removing one that is not, is not an error.
fn addr_change(dev: &str, ip: &str, add: bool) -> Result<(), ServiceError> {
    let ip: std::net::Ipv4Addr = ip
        .parse()
        .map_err(|_| ServiceError::NotIpv4(ip.to_string()))?;
    let name = std::ffi::CString::new(dev).map_err(|_| ServiceError::NoDevice(dev.to_string()))?;
    // SAFETY: plain syscalls on buffers we own; the fd is closed below.
    unsafe {
        let index = libc::if_nametoindex(name.as_ptr());
        if index == 0 {
            return Err(ServiceError::NoDevice(dev.to_string()));
        }
        let fd = libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        );
        if fd < 0 {
            return Err(ServiceError::Os(
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
            return Err(ServiceError::Os("netlink send", e));
        }
        let mut buf = [0u8; 512];
        let n = libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0);
        libc::close(fd);
        if n < 36 {
            return Err(ServiceError::Os(
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
                return Err(ServiceError::Os(
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
fn gratuitous_arp(dev: &str, ip: &str) -> Result<(), ServiceError> {
    let ip: std::net::Ipv4Addr = ip
        .parse()
        .map_err(|_| ServiceError::NotIpv4(ip.to_string()))?;
    let name = std::ffi::CString::new(dev).map_err(|_| ServiceError::NoDevice(dev.to_string()))?;
    // SAFETY: plain syscalls with valid arguments; every fd is closed below.
    unsafe {
        let ifindex = libc::if_nametoindex(name.as_ptr());
        if ifindex == 0 {
            return Err(ServiceError::NoDevice(dev.to_string()));
        }
        let fd = libc::socket(
            libc::AF_PACKET,
            libc::SOCK_DGRAM,
            (libc::ETH_P_ARP as u16).to_be() as i32,
        );
        if fd < 0 {
            return Err(ServiceError::Os(
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
            return Err(ServiceError::Os("hardware address", e));
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
            return Err(ServiceError::Os("sending ARP", e));
        }
    }
    Ok(())
}
