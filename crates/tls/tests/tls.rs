//! Real TLS over real sockets: certificates from `certs`, handshakes both
//! ways, data both ways at once, and strangers refused.

use pagefleet_tls::certs::{init_ca, issue, IssueRequest};
use pagefleet_tls::{Identity, Stream};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::time::Duration;

fn identity(ca: &Path, name: &str, out: &Path) -> Identity {
    issue(ca, &IssueRequest::named(name), out).unwrap();
    Identity::load(out).unwrap()
}

struct Dirs {
    _tmp: TempDir,
    good_server: Identity,
    good_client: Identity,
    stranger: Identity,
}

struct TempDir(std::path::PathBuf);
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn dirs(tag: &str) -> Dirs {
    let base = std::env::temp_dir().join(format!("pf-tls-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let (ca, other) = (base.join("ca"), base.join("other-ca"));
    init_ca(&ca).unwrap();
    init_ca(&other).unwrap();
    assert!(init_ca(&ca).is_err(), "init refuses to overwrite a CA");
    Dirs {
        good_server: identity(&ca, "server", &base.join("s")),
        good_client: identity(&ca, "client", &base.join("c")),
        stranger: identity(&other, "stranger", &base.join("x")),
        _tmp: TempDir(base),
    }
}

/// Serve one connection: handshake, then echo until EOF. The result says
/// whether the handshake passed, and the peer's name.
fn serve_one(l: &TcpListener, id: &Identity) -> Result<String, String> {
    let (s, _) = l.accept().unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let st = Stream::tls_server(s, id).unwrap();
    st.handshake().map_err(|e| e.to_string())?;
    let name = st.peer_name().unwrap_or_default();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match (&st).read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => (&st).write_all(&buf[..n]).unwrap(),
        }
    }
    Ok(name)
}

#[test]
fn a_client_of_the_cluster_talks_and_strangers_are_refused() {
    let d = dirs("talk");
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::scope(|sc| {
        let srv = sc.spawn(|| {
            (0..3)
                .map(|_| serve_one(&l, &d.good_server))
                .collect::<Vec<_>>()
        });
        // 1. A cluster client: 4 MiB echoed, written by one thread while
        // another reads (the TLS state is shared, never held while waiting).
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let c = Stream::tls_client(s, &d.good_client, "127.0.0.1").unwrap();
        c.handshake().unwrap();
        assert!(c.is_tls());
        assert_eq!(c.peer_name().as_deref(), Some("server"));
        let data: Vec<u8> = (0..4u32 << 20).map(|i| (i * 7 + i / 4096) as u8).collect();
        let w = c.try_clone().unwrap();
        let got = std::thread::scope(|s2| {
            s2.spawn(|| (&w).write_all(&data).unwrap());
            let mut got = vec![0u8; data.len()];
            (&c).read_exact(&mut got).unwrap();
            got
        });
        assert!(got == data, "echoed bytes differ");
        drop(w);
        drop(c);

        // 2. A client whose certificate another CA signed: the server refuses it.
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let c = Stream::tls_client(s, &d.stranger, "127.0.0.1").unwrap();
        // The stranger does not trust the cluster's server either.
        let e = c.handshake().unwrap_err().to_string();
        assert!(
            e.contains("certificate") || e.contains("UnknownIssuer"),
            "{e}"
        );
        drop(c);

        // 3. The right CA, but the server name the certificate is not for.
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let c = Stream::tls_client(s, &d.good_client, "10.9.9.9").unwrap();
        let e = c.handshake().unwrap_err().to_string();
        assert!(
            e.contains("NotValidForName") || e.contains("not valid for"),
            "{e}"
        );
        drop(c);

        let r = srv.join().unwrap();
        assert_eq!(r[0].as_deref(), Ok("client"));
        // The stranger gave up on the cluster's server first and said why.
        let e = r[1].as_ref().unwrap_err();
        assert!(e.contains("UnknownCA"), "{e}");
        assert!(r[2].is_err(), "a client that gave up was still served");
    });
}

#[test]
fn a_stranger_certificate_is_refused_by_the_server() {
    let d = dirs("refuse");
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::scope(|sc| {
        let srv = sc.spawn(|| serve_one(&l, &d.good_server));
        // A stranger that trusts the cluster's CA (it has ca-cert.pem) but
        // holds a certificate another CA signed.
        let base = d._tmp.0.join("mixed");
        std::fs::create_dir_all(&base).unwrap();
        for f in ["server-cert.pem", "server-key.pem"] {
            std::fs::copy(d.stranger.dir.join(f), base.join(f)).unwrap();
        }
        std::fs::copy(
            d.good_client.dir.join("ca-cert.pem"),
            base.join("ca-cert.pem"),
        )
        .unwrap();
        let mixed = Identity::load(&base).unwrap();
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let c = Stream::tls_client(s, &mixed, "localhost").unwrap();
        // TLS 1.3: the client's side may finish before the server judges its
        // certificate; the first read then sees the server's alert or close.
        let r = c.handshake().and_then(|_| {
            (&c).write_all(b"hello")?;
            let mut b = [0u8; 5];
            (&c).read_exact(&mut b)
        });
        assert!(r.is_err(), "a stranger's certificate was accepted");
        let e = srv.join().unwrap().unwrap_err();
        assert!(
            e.contains("UnknownIssuer") || e.contains("certificate"),
            "{e}"
        );
    });
}
