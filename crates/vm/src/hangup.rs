//! Hanging up the TCP connections QEMU's user-mode network accepted on a
//! forwarded address. `hostfwd_remove` closes only the listening socket:
//! connections already accepted stay open inside the paused source QEMU,
//! and once the address has moved the source can no longer tell their
//! clients anything — they wait out their own timeouts. Shutting them down
//! while the address is still here (as the kv guest hangs up its clients)
//! makes them reconnect at once, to the VM's new host.
//!
//! There is no QMP command for it, so the runner (QEMU's parent) takes a
//! copy of each such socket with `pidfd_getfd` and shuts it down: a
//! shutdown acts on the socket, not on the descriptor, so the FIN goes out.

use pagefleet_common::sys::process;
use std::net::SocketAddrV4;
use std::os::fd::AsFd;

/// TCP sockets of process `pid` bound to `local` that are not listening:
/// their inodes, from `/proc/PID/net/tcp` (the process's network namespace).
fn connection_inodes(pid: u32, local: SocketAddrV4) -> std::io::Result<Vec<u64>> {
    let table = std::fs::read_to_string(format!("/proc/{pid}/net/tcp"))?;
    // The kernel prints the address as the in-memory u32 in hex.
    let want = format!(
        "{:08X}:{:04X}",
        u32::from_ne_bytes(local.ip().octets()),
        local.port()
    );
    Ok(table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // sl local rem st tx:rx tr:when retrnsmt uid timeout inode
            (f.len() > 9 && f[1] == want && f[3] != "0A")
                .then(|| f[9].parse().ok())
                .flatten()
        })
        .collect())
}

/// Shut down every accepted connection of process `pid` on `local`;
/// how many.
pub fn hang_up(pid: u32, local: SocketAddrV4) -> std::io::Result<usize> {
    let inodes = connection_inodes(pid, local)?;
    if inodes.is_empty() {
        return Ok(0);
    }
    let pidfd = process::pidfd_open(pid)?;
    let mut n = 0;
    for e in std::fs::read_dir(format!("/proc/{pid}/fd"))?.flatten() {
        let Ok(target) = std::fs::read_link(e.path()) else {
            continue;
        };
        let target = target.to_string_lossy();
        let Some(inode) = target
            .strip_prefix("socket:[")
            .and_then(|t| t.strip_suffix(']'))
            .and_then(|t| t.parse::<u64>().ok())
        else {
            continue;
        };
        if !inodes.contains(&inode) {
            continue;
        }
        let Some(fd) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(copy) = process::pidfd_getfd(pidfd.as_fd(), fd) else {
            continue; // closed meanwhile
        };
        if process::shutdown_socket(&copy).is_ok() {
            n += 1;
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    /// A connection this process accepted is shut down through a pidfd
    /// copy, and its peer sees the end at once; the listener stays.
    #[test]
    fn a_peer_sees_end_of_file_when_its_connection_is_hung_up() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = match l.local_addr().unwrap() {
            std::net::SocketAddr::V4(a) => a,
            _ => unreachable!(),
        };
        let mut client = std::net::TcpStream::connect(addr).unwrap();
        let (_served, _) = l.accept().unwrap();
        client
            .set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        let n = hang_up(std::process::id(), addr).unwrap();
        assert_eq!(n, 1);
        let mut b = [0u8; 1];
        assert_eq!(client.read(&mut b).unwrap(), 0, "the peer should see EOF");
        // The listener still accepts.
        let _again = std::net::TcpStream::connect(addr).unwrap();
        assert!(l.accept().is_ok());
    }
}
