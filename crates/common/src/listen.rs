//! Listening sockets for the daemons' ports.

use std::io;
use std::net::{TcpListener, ToSocketAddrs};

/// The accept queue a daemon's port asks for (the kernel caps it at
/// `net.core.somaxconn`, 4096 on current kernels). std's `bind` asks for
/// 128: a connection flood fills that in microseconds, and from then on
/// the kernel drops every SYN, a real client's too, which then waits a
/// second (and more) for its retransmit.
pub const LISTEN_BACKLOG: i32 = 4096;

/// Bind `addr` (the first of its addresses that binds) and listen with
/// [`LISTEN_BACKLOG`]. SO_REUSEADDR is set, as std does.
pub fn listen(addr: impl ToSocketAddrs) -> io::Result<TcpListener> {
    let mut last = io::Error::new(io::ErrorKind::InvalidInput, "no address to listen on");
    for a in addr.to_socket_addrs()? {
        let s = socket2::Socket::new(
            socket2::Domain::for_address(a),
            socket2::Type::STREAM,
            Some(socket2::Protocol::TCP),
        )?;
        s.set_reuse_address(true)?;
        match s.bind(&a.into()).and_then(|()| s.listen(LISTEN_BACKLOG)) {
            Ok(()) => return Ok(s.into()),
            Err(e) => last = e,
        }
    }
    Err(last)
}

#[cfg(test)]
mod tests {
    #[test]
    fn binds_and_accepts() {
        let l = super::listen("127.0.0.1:0").unwrap();
        let a = l.local_addr().unwrap();
        let _c = std::net::TcpStream::connect(a).unwrap();
        let (_s, _) = l.accept().unwrap();
        assert!(super::listen(a).is_err(), "the port is taken");
    }
}
