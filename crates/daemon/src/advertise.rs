//! The address other hosts reach this one at.
//!
//! A daemon may listen on every address (`0.0.0.0:7070`): the sample
//! configuration does, so that one file serves every host. What it
//! publishes (its memory server in host reports, its HTTP API in the
//! registry, where incoming migrations connect) must then be one address
//! the other hosts can reach. It is, in order: `advertise` if given; the
//! listen address if it names one; the local address of this host's route
//! toward the join host (or the first peer, or the first etcd endpoint),
//! which the kernel picks without sending anything (a UDP socket's
//! `connect`); else loopback, said in a warning.

use crate::error::{Error, Result};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs, UdpSocket};

/// Check that `s` is HOST:PORT (a name or an IP, and a port).
pub fn check_host_port(s: &str) -> Result<()> {
    let ok = s
        .rsplit_once(':')
        .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
    if ok {
        Ok(())
    } else {
        Err(Error::Invalid(format!("{s:?} is not HOST:PORT")))
    }
}

/// The IP address this host publishes for listeners bound to `bound`.
/// `toward`: addresses of other hosts (join host, peers, etcd), the
/// first that resolves tells which of this host's addresses they reach.
pub fn public_ip(bound: IpAddr, advertise: Option<IpAddr>, toward: &[String]) -> IpAddr {
    if let Some(a) = advertise {
        return a;
    }
    if !bound.is_unspecified() {
        return bound;
    }
    for t in toward {
        if let Some(ip) = route_source(t) {
            return ip;
        }
    }
    tracing::warn!(
        "listening on every address with no advertise, join, peers or etcd to tell which one other hosts reach: \
         publishing 127.0.0.1, which only this host can use"
    );
    IpAddr::V4(Ipv4Addr::LOCALHOST)
}

/// `addr` with `ip` in place of an unspecified address (0.0.0.0, ::).
pub fn public(addr: SocketAddr, ip: IpAddr) -> SocketAddr {
    if addr.ip().is_unspecified() {
        SocketAddr::new(ip, addr.port())
    } else {
        addr
    }
}

/// The local address the kernel would send from toward `host_port`
/// (nothing is sent: connecting a UDP socket only picks the route).
fn route_source(host_port: &str) -> Option<IpAddr> {
    let to = host_port
        .trim_start_matches("etcd://")
        .trim_start_matches("https://")
        .trim_start_matches("http://");
    let dest = to.to_socket_addrs().ok()?.next()?;
    let any: SocketAddr = if dest.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let s = UdpSocket::bind(any).ok()?;
    s.connect(dest).ok()?;
    let ip = s.local_addr().ok()?.ip();
    (!ip.is_unspecified()).then_some(ip)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_published_address_is_the_advertised_then_the_bound_then_the_route() {
        let any: IpAddr = "0.0.0.0".parse().unwrap();
        let one: IpAddr = "10.1.2.3".parse().unwrap();
        assert_eq!(public_ip(any, Some(one), &[]), one);
        assert_eq!(
            public_ip("10.9.9.9".parse().unwrap(), None, &[]),
            "10.9.9.9".parse::<IpAddr>().unwrap()
        );
        // Toward loopback the route's source is loopback.
        assert_eq!(
            public_ip(any, None, &["127.0.0.1:7071".into()]),
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        );
        // Nothing to go by: loopback (and a warning).
        assert_eq!(
            public_ip(any, None, &["no such host:1".into()]),
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        );
        assert_eq!(
            public("0.0.0.0:7070".parse().unwrap(), one),
            "10.1.2.3:7070".parse().unwrap()
        );
        assert_eq!(
            public("10.0.0.1:7070".parse().unwrap(), one),
            "10.0.0.1:7070".parse().unwrap()
        );
    }

    #[test]
    fn join_must_be_host_and_port() {
        assert!(check_host_port("10.0.0.1:7071").is_ok());
        assert!(check_host_port("h1.example:7071").is_ok());
        for bad in ["10.0.0.1", ":7071", "h1:0", "h1:port", ""] {
            assert!(check_host_port(bad).is_err(), "{bad}");
        }
    }
}
