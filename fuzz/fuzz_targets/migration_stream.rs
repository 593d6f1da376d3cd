//! The destination of a migration against a source that proved the cluster
//! secret and then sends anything: `dest::authenticate` and
//! `dest::receive_with` over a real loopback TCP connection, then
//! `commit_with` if the stream reached COMMIT (with a region builder that
//! refuses, so nothing runs). The harness plays a legitimate source up to
//! READY with a SPEC of its own (64 KiB, no memory servers: the SPEC names
//! servers the destination connects to, and a fuzzer must not reach beyond
//! loopback), then sends the input: with its first byte odd as raw bytes,
//! else as messages the harness frames (kind, 11-bit length, arg, body),
//! so the fuzzer spends its time inside the message handling. No input may
//! panic the destination, hang it past the end of the input, or make it
//! hold more than its bounds.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pagefleet_api::{GuestSpec, Workload};
use pagefleet_migrate::dest;
use pagefleet_migrate::wire::{Header, Kind, Stream};
use pagefleet_migrate::Spec;
use pagefleet_proto::auth::Secret;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::OnceLock;
use std::time::Duration;

fn listener() -> &'static TcpListener {
    static L: OnceLock<TcpListener> = OnceLock::new();
    L.get_or_init(|| TcpListener::bind("127.0.0.1:0").expect("a loopback port"))
}

fn secret() -> Secret {
    Secret::from_bytes(b"fuzz-secret-fuzz-secret-fuzz-sec", "fuzz").expect("secret")
}

/// The input as the source's bytes after READY.
fn frames(data: &[u8]) -> Vec<u8> {
    if data.first().is_some_and(|b| b & 1 == 1) {
        return data[1..].to_vec();
    }
    let mut out = Vec::new();
    let mut d = data.get(1..).unwrap_or_default();
    while d.len() >= 11 {
        let kind = Kind::from_u8(d[0] % 21).unwrap_or(Kind::Pages);
        let len = (u16::from_le_bytes([d[1], d[2]]) & 0x7ff) as usize;
        let arg = u64::from_le_bytes(d[3..11].try_into().unwrap());
        d = &d[11..];
        let body = &d[..len.min(d.len())];
        d = &d[body.len()..];
        let h = Header {
            kind,
            len: len as u32,
            arg,
        };
        out.extend_from_slice(&h.encode());
        out.extend_from_slice(body);
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let l = listener();
    let addr = l.local_addr().unwrap();
    let input = frames(data);
    let source = std::thread::spawn(move || {
        let Ok(tcp) = TcpStream::connect(addr) else {
            return;
        };
        let Ok(mut raw) = tcp.try_clone() else { return };
        let mut s = Stream::new(tcp);
        s.set_timeout(Some(Duration::from_secs(5)));
        if s.connect_auth(&secret()).is_err() {
            return;
        }
        let spec = Spec {
            name: "fuzz".into(),
            size: 16 * 4096,
            chunk_pages: 4,
            policy: Default::default(),
            region_id: 1,
            servers: Vec::new(),
            budget_pages: 16,
            workload: GuestSpec::new(Workload::Kv {
                listen: "127.0.0.1:1".into(),
                no_evict: false,
            }),
            verify: false,
            gather: false,
        };
        if s.send_json(Kind::Spec, &spec).is_err() || s.expect(Kind::Ready).is_err() {
            return;
        }
        let _ = raw.write_all(&input);
        let _ = raw.shutdown(Shutdown::Write);
        // What the destination answers is read and dropped.
        let mut sink = [0u8; 4096];
        while matches!(raw.read(&mut sink), Ok(n) if n > 0) {}
    });
    let (conn, _) = l.accept().expect("the harness's connection");
    let secret = secret();
    if let Ok(stream) = dest::authenticate(conn, &secret, Duration::from_secs(5)) {
        let progress = dest::Progress::default();
        if let Ok(r) = dest::receive_with(stream, &secret, &progress, None, &mut |_, _| {}) {
            let _ = r.commit_with(&secret, |_| {}, |_| Err("fuzz: no region".into()));
        }
    }
    source.join().expect("the source's side");
});
