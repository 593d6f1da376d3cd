//! The messages between a VM guest's runner and the shim inside QEMU
//! (which runs guest code and is not trusted by the runner), over a real
//! Unix socket pair: the hand-over (`recv_fd` with 0 to 3 file descriptors
//! attached, `Hello::decode`, `Hello::check`), then the agent's requests
//! (`agent::Request::decode`, what the shim obeys) and answers
//! (`agent::parse_reply`, what the runner believes). Nothing may panic, no
//! received fd may stay open once dropped, an accepted hello is whole pages
//! of user space of the expected size, and an obeyed zap is whole pages
//! inside the mapping.
//!
//! Input: byte 0 = fds attached (mod 4), byte 1 = the hello's length (mod
//! 65, at least 1), then the hello's bytes, then 24-byte requests and
//! 8-byte answers alternately.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pagefleet_uffd::handoff::{self, agent, Hello, USER_ADDRESS_END};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;

/// The guest size and QEMU pid the runner expects.
const SIZE: u64 = 64 << 20;
const PID: u64 = 4242;

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 3 {
        return;
    }
    let nfds = (data[0] % 4) as usize;
    let hello_len = ((data[1] % 65) as usize).max(1).min(data.len() - 2);
    let (hello_bytes, rest) = data[2..].split_at(hello_len);
    let before = open_fds();
    {
        let (qemu, runner) = UnixStream::pair().expect("socketpair");
        let (r, w) = std::io::pipe().expect("pipe");
        handoff::send_fds(&qemu, hello_bytes, &[w.as_fd(); 3][..nfds])
            .expect("sendmsg over a socket pair");
        drop(qemu);
        drop((r, w));
        let mut buf = [0u8; 64];
        match handoff::recv_fd(&runner, &mut buf) {
            Ok(Some((n, _uffd))) => {
                assert!(nfds > 0, "an fd from a message that had none");
                assert_eq!(n, hello_bytes.len());
                if let Some(h) = Hello::decode(&buf[..n]) {
                    assert_eq!(h.encode().as_slice(), &buf[..n]);
                    if h.check(SIZE, PID).is_ok() {
                        assert_eq!((h.len, h.pid), (SIZE, PID));
                        assert!(h.base > 0 && h.base % 4096 == 0);
                        assert!(h.base + h.len <= USER_ADDRESS_END);
                        assert_eq!(h.features & handoff::SHIM_FEATURES, handoff::SHIM_FEATURES);
                    }
                }
            }
            Ok(None) => {}
            Err(_) => assert!(nfds == 0, "a message with an fd refused"),
        }
    }
    assert_eq!(open_fds(), before, "a received fd stayed open");
    let mut d = rest;
    while d.len() >= agent::REQUEST_LEN {
        let (req, tail) = d.split_at(agent::REQUEST_LEN);
        if let Ok(r) = agent::Request::decode(req, SIZE) {
            assert_eq!(r.encode().as_slice(), req);
            if let agent::Request::Zap { off, len } = r {
                assert!(len > 0 && off % 4096 == 0 && len % 4096 == 0);
                assert!(off.checked_add(len).is_some_and(|e| e <= SIZE));
            }
        }
        d = tail;
        if d.len() >= agent::REPLY_LEN {
            let (a, tail) = d.split_at(agent::REPLY_LEN);
            let v = i64::from_le_bytes(a.try_into().expect("8 bytes"));
            assert_eq!(agent::parse_reply(v.to_le_bytes()).is_ok(), v == 0);
            d = tail;
        }
    }
});
