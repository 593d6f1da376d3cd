//! systemd's readiness protocol (`sd_notify(3)`): one datagram of
//! `KEY=VALUE` lines to the Unix socket `$NOTIFY_SOCKET` names (a path, or
//! `@name` for the abstract namespace). With `Type=notify` the unit is
//! "started" once the daemon says `READY=1`, not when the process forks;
//! `RELOADING=1` and `STOPPING=1` say the same of a reload and a stop.
//!
//! Without `$NOTIFY_SOCKET` (not under systemd, or `Type=simple`) every
//! call does nothing. Each is one `sendto` (a few µs); nothing is kept.

use std::io;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// Sends `state` (e.g. `"READY=1\nSTATUS=serving"`) to systemd; `Ok(false)`
/// when no one listens (no `$NOTIFY_SOCKET`).
pub fn notify(state: &str) -> io::Result<bool> {
    match std::env::var_os("NOTIFY_SOCKET") {
        Some(p) => notify_to(&p.to_string_lossy(), state).map(|()| true),
        None => Ok(false),
    }
}

/// Sends `state` to the notification socket `socket` (a path, or `@name`).
pub fn notify_to(socket: &str, state: &str) -> io::Result<()> {
    let addr = match socket.strip_prefix('@') {
        Some(name) => SocketAddr::from_abstract_name(name.as_bytes())?,
        None if socket.starts_with('/') => SocketAddr::from_pathname(socket)?,
        None => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("NOTIFY_SOCKET {socket:?}: neither a path nor @name"),
            ))
        }
    };
    let s = UnixDatagram::unbound()?;
    let n = s.send_to_addr(state.as_bytes(), &addr)?;
    if n != state.len() {
        return Err(io::Error::new(
            io::ErrorKind::WriteZero,
            "notification cut short",
        ));
    }
    Ok(())
}

pub use crate::sys::clock::monotonic_usec;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_notification_reaches_a_path_socket_and_an_abstract_one() {
        let dir = std::env::temp_dir().join(format!("pf-sdnotify-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let path = dir.join("notify.sock");
        let _ = std::fs::remove_file(&path);
        let rx = UnixDatagram::bind(&path).unwrap();
        notify_to(path.to_str().unwrap(), "READY=1\nSTATUS=serving").unwrap();
        let mut buf = [0u8; 64];
        let n = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1\nSTATUS=serving");
        let _ = std::fs::remove_dir_all(&dir);

        let name = format!("pf-sdnotify-test-{}", std::process::id());
        let rx = UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap())
            .unwrap();
        notify_to(&format!("@{name}"), "STOPPING=1").unwrap();
        let n = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"STOPPING=1");
    }

    #[test]
    fn a_socket_that_is_neither_a_path_nor_abstract_is_refused() {
        assert!(notify_to("relative/notify.sock", "READY=1").is_err());
    }
}
