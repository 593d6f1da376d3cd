//! pagefleetd's HTTP API refuses strangers on every route, before doing
//! anything: unsigned, wrongly signed, stale and replayed requests, bodies
//! that try to smuggle a command, oversized and malformed requests. The
//! daemon's runner is a recording script here, so "nothing was started"
//! is checked by what the script wrote (and that it does write when a
//! properly signed, typed request comes in).

mod common;

use common::*;
use pagefleet_common::httpauth;
use pagefleet_proto::auth::Secret;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// A daemon with the guest host service, whose runner records each start.
struct Host {
    d: Daemon,
    http: String,
    record: PathBuf,
    // Removed on drop, after the daemon (fields drop in order).
    _dir: common::TempDir,
}

fn host() -> Host {
    let dir = tempdir("api");
    let record = dir.join("runner-started");
    let runner = dir.join("runner.sh");
    // Records its arguments and the launch message, then exits without
    // saying "ready" (so the daemon reports that it did not start).
    std::fs::write(
        &runner,
        format!(
            "#!/bin/sh\necho \"$@\" >> {r}\nhead -c 100000 >> {r}.stdin\nexit 1\n",
            r = record.display()
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&runner, std::fs::Permissions::from_mode(0o755)).unwrap();
    let d = Daemon::start(
        "16MiB",
        &[
            "--guest-memory",
            "64MiB",
            "--runner",
            runner.to_str().unwrap(),
            "--guest-dir",
            dir.join("guests").to_str().unwrap(),
            "--service-dev",
            "lo",
        ],
    );
    let http = d.metrics.clone().expect("HTTP address");
    assert!(
        http.starts_with("127.0.0.1:"),
        "loopback by default: {http}"
    );
    Host {
        d,
        http,
        record,
        _dir: dir,
    }
}

/// A raw request; (status, body).
fn raw(addr: &str, req: &[u8]) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(req).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let status = out
        .split_whitespace()
        .nth(1)
        .and_then(|x| x.parse().ok())
        .unwrap_or(0);
    let body = out
        .split_once("\r\n\r\n")
        .map(|x| x.1)
        .unwrap_or("")
        .to_string();
    (status, body)
}

fn request(method: &str, path: &str, auth: Option<&str>, body: &[u8]) -> Vec<u8> {
    let mut r = format!("{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n");
    if let Some(a) = auth {
        r.push_str(&format!("Authorization: {a}\r\n"));
    }
    if method == "POST" {
        r.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    r.push_str("\r\n");
    let mut v = r.into_bytes();
    v.extend_from_slice(body);
    v
}

/// Every route, with a body a legitimate caller might send.
fn routes() -> Vec<(&'static str, &'static str, &'static str)> {
    let start =
        r#"{"name":"g1","size":4096,"spec":{"workload":{"kind":"kv","listen":"127.0.0.1:0"}}}"#;
    vec![
        ("GET", "/", ""),
        ("GET", "/metrics", ""),
        ("GET", "/healthz", ""),
        ("GET", "/readyz", ""),
        ("GET", "/host", ""),
        ("GET", "/cluster", ""),
        ("GET", "/guests", ""),
        ("GET", "/guests/g1", ""),
        ("POST", "/guests", start),
        ("POST", "/incoming", r#"{"name":"g1","budget_pages":1}"#),
        ("POST", "/guests/g1/stop", "{}"),
        ("POST", "/guests/g1/cancel", "{}"),
        ("POST", "/guests/g1/sort", "{}"),
        ("POST", "/guests/g1/set_budget", r#"{"pages":1}"#),
        (
            "POST",
            "/guests/g1/evacuate",
            r#"{"from":"a:1","to":"b:1"}"#,
        ),
        (
            "POST",
            "/guests/g1/migrate",
            r#"{"to":"127.0.0.1:1","subs":[]}"#,
        ),
        ("POST", "/migrations", r#"{"guest":"g1"}"#),
        ("POST", "/evacuations", r#"{"host":"h9"}"#),
    ]
}

fn nothing_started(h: &Host) {
    assert!(
        !h.record.exists(),
        "a runner was started: {}",
        std::fs::read_to_string(&h.record).unwrap_or_default()
    );
}

#[test]
fn every_route_refuses_strangers() {
    let h = host();
    let wrong = Secret::from_bytes(b"not-the-cluster-secret-at-all", "test").unwrap();
    for (m, p, b) in routes() {
        // No signature.
        let (st, body) = raw(&h.http, &request(m, p, None, b.as_bytes()));
        assert_eq!(st, 401, "{m} {p} unsigned: {body}");
        assert!(body.contains("authentication required"), "{body}");
        // Another cluster's secret.
        let a = httpauth::sign(&wrong, m, p, b.as_bytes());
        let (st, body) = raw(&h.http, &request(m, p, Some(&a), b.as_bytes()));
        assert_eq!(st, 401, "{m} {p} wrong secret: {body}");
        assert!(body.contains("bad signature"), "{body}");
        // Signed for another path, or another body.
        let a = httpauth::sign(&h.d.secret, m, "/host", b.as_bytes());
        if p != "/host" {
            let (st, _) = raw(&h.http, &request(m, p, Some(&a), b.as_bytes()));
            assert_eq!(st, 401, "{m} {p} signed for /host");
        }
        if m == "POST" {
            let a = httpauth::sign(&h.d.secret, m, p, br#"{"other":1}"#);
            let (st, _) = raw(&h.http, &request(m, p, Some(&a), b.as_bytes()));
            assert_eq!(st, 401, "{m} {p} signed for another body");
        }
        // Ten minutes old.
        let old = httpauth::unix_now() - 600;
        let a = httpauth::sign_at(&h.d.secret, m, p, b.as_bytes(), old);
        let (st, body) = raw(&h.http, &request(m, p, Some(&a), b.as_bytes()));
        assert_eq!(st, 401, "{m} {p} stale: {body}");
        // Garbage in the header.
        let (st, _) = raw(
            &h.http,
            &request(m, p, Some("PF1 t=1,n=zz,m=00"), b.as_bytes()),
        );
        assert_eq!(st, 401, "{m} {p} malformed signature");
    }
    nothing_started(&h);
}

#[test]
fn a_replayed_request_is_refused() {
    let h = host();
    for (m, p, b) in routes() {
        let a = httpauth::sign(&h.d.secret, m, p, b.as_bytes());
        let req = request(m, p, Some(&a), b.as_bytes());
        let (first, _) = raw(&h.http, &req);
        assert_ne!(first, 401, "{m} {p}: a fresh signed request was refused");
        let (again, body) = raw(&h.http, &req);
        assert_eq!(again, 401, "{m} {p} replayed: {body}");
        assert!(body.contains("replayed"), "{body}");
        // Only the start route may start a runner; take its record away so
        // the next routes are checked from clean.
        let _ = std::fs::remove_file(&h.record);
        let _ = std::fs::remove_file(h.record.with_extension("stdin"));
    }
}

/// A signed request still cannot name a program: argv fields, unknown
/// workload kinds and extra fields are refused before anything starts.
#[test]
fn signed_requests_cannot_smuggle_a_command() {
    let h = host();
    let c = pagefleet_common::http::Client::new(h.d.secret.clone());
    let bodies = [
        // The old API's shape.
        r#"{"name":"g1","size":4096,"args":["--merge","--","id"]}"#,
        r#"{"name":"g1","size":4096,"args":["kv"],"spec":{"workload":{"kind":"kv","listen":"127.0.0.1:0"}}}"#,
        r#"{"name":"g1","size":4096,"spec":{"workload":{"kind":"exec","argv":["id"]}}}"#,
        r#"{"name":"g1","size":4096,"spec":{"workload":{"kind":"kv","listen":"127.0.0.1:0","command":"id"}}}"#,
        r#"{"name":"g1","size":4096,"spec":{"workload":{"kind":"kv","listen":"127.0.0.1:0"},"runner":"/bin/sh"}}"#,
        r#"{"name":"--help","size":4096,"spec":{"workload":{"kind":"kv","listen":"127.0.0.1:0"}}}"#,
        r#"{"name":"g1;id","size":4096,"spec":{"workload":{"kind":"kv","listen":"127.0.0.1:0"}}}"#,
        r#"{"name":"g1","size":4096,"spec":{"workload":{"kind":"kv","listen":"127.0.0.1:0"},"policy":"clock --merge"}}"#,
        r#"not json"#,
    ];
    for b in bodies {
        let v: serde_json::Value = serde_json::from_str(b).unwrap_or(serde_json::Value::Null);
        let e = c
            .post::<_, serde_json::Value>(&h.http, "/guests", &v)
            .unwrap_err();
        assert!(e.to_string().contains("HTTP 400"), "{b}: {e}");
    }
    let inc = [
        r#"{"name":"g1","budget_pages":1,"args":["id"]}"#,
        r#"{"name":"g1","budget_pages":1,"cgroup":"/tmp"}"#,
        r#"{"name":"g1","budget_pages":1,"cgroup":"/sys/fs/cgroup/../../tmp"}"#,
    ];
    for b in inc {
        let v: serde_json::Value = serde_json::from_str(b).unwrap();
        let e = c
            .post::<_, serde_json::Value>(&h.http, "/incoming", &v)
            .unwrap_err();
        assert!(e.to_string().contains("HTTP 400"), "{b}: {e}");
    }
    nothing_started(&h);
    // The control: a typed, signed start does reach the runner, with a
    // fixed subcommand, the name as a label, and no secret on its argv.
    let ok: serde_json::Value = serde_json::from_str(
        r#"{"name":"g1","size":4096,"spec":{"workload":{"kind":"kv","listen":"127.0.0.1:0"}}}"#,
    )
    .unwrap();
    let e = c
        .post::<_, serde_json::Value>(&h.http, "/guests", &ok)
        .unwrap_err();
    assert!(e.to_string().contains("did not start"), "{e}");
    let argv = std::fs::read_to_string(&h.record).unwrap();
    assert_eq!(argv.trim(), "runner-guest --name=g1");
    let stdin = std::fs::read_to_string(h.record.with_extension("stdin")).unwrap();
    assert!(stdin.contains(r#""mode":"guest""#), "{stdin}");
    assert!(!argv.contains("secret"), "{argv}");
}

/// Oversized and malformed requests get a clear refusal and cost the
/// daemon no memory to speak of.
#[test]
fn oversized_and_malformed_requests_are_refused() {
    let h = host();
    let rss0 = h.d.rss();
    // A request line that never ends: the daemon hangs up long before 64 MiB.
    let mut s = TcpStream::connect(&h.http).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
    let chunk = vec![b'A'; 1 << 20];
    let mut sent = 0usize;
    let t = Instant::now();
    s.write_all(b"GET /").unwrap();
    while sent < 64 << 20 && t.elapsed() < Duration::from_secs(20) {
        match s.write(&chunk) {
            Ok(n) => sent += n,
            Err(_) => break,
        }
    }
    assert!(
        sent < 64 << 20,
        "the daemon took {sent} bytes of one request line"
    );
    drop(s);
    let grew = h.d.rss().saturating_sub(rss0);
    assert!(grew < 32 << 20, "RSS grew {grew} bytes");
    // Headers past the limit.
    let big = format!(
        "GET /host HTTP/1.1\r\nHost: x\r\nX-Pad: {}\r\n\r\n",
        "a".repeat(64 << 10)
    );
    let (st, _) = raw(&h.http, big.as_bytes());
    assert!(
        st == 431 || st == 400 || st == 0,
        "oversized head: HTTP {st}"
    );
    // A body over 1 MiB, even signed.
    let body = vec![b' '; 2 << 20];
    let a = httpauth::sign(&h.d.secret, "POST", "/guests", &body);
    let (st, b) = raw(&h.http, &request("POST", "/guests", Some(&a), &body));
    assert_eq!(st, 413, "{b}");
    // Not HTTP at all.
    let (st, _) = raw(&h.http, b"\x16\x03\x01\x02\x00garbage\r\n\r\n");
    assert!(st == 400 || st == 0, "garbage: HTTP {st}");
    // A client that connects and says nothing is dropped within seconds.
    let mut s = TcpStream::connect(&h.http).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let t = Instant::now();
    let mut buf = [0u8; 64];
    let _ = s.read(&mut buf);
    assert!(
        t.elapsed() < Duration::from_secs(15),
        "an idle client was kept {:?}",
        t.elapsed()
    );
    // The daemon still serves signed requests.
    let c = pagefleet_common::http::Client::new(h.d.secret.clone());
    let r: pagefleet_api::HostReport = c.get(&h.http, "/host").unwrap();
    assert_eq!(r.guest_memory, 64 << 20);
    nothing_started(&h);
}

#[test]
fn metrics_are_closed_unless_opened() {
    let h = host();
    let (st, _) = raw(&h.http, &request("GET", "/metrics", None, b""));
    assert_eq!(st, 401);
    // The cluster's scrape token opens GET /metrics and nothing else;
    // another cluster's does not.
    let token = format!("Bearer {}", httpauth::scrape_token(&h.d.secret));
    let (st, body) = raw(
        &h.http,
        &request("GET", "/metrics", Some(token.as_str()), b""),
    );
    assert_eq!(st, 200, "{body}");
    assert!(
        body.contains("pagefleet_memserver_capacity_bytes"),
        "{body}"
    );
    for (m, p) in [("GET", "/host"), ("GET", "/guests"), ("POST", "/metrics")] {
        let (st, _) = raw(&h.http, &request(m, p, Some(token.as_str()), b""));
        assert_eq!(st, 401, "{m} {p} with the scrape token");
    }
    let wrong = Secret::from_bytes(b"not-the-cluster-secret-at-all", "test").unwrap();
    let other = format!("Bearer {}", httpauth::scrape_token(&wrong));
    let (st, _) = raw(
        &h.http,
        &request("GET", "/metrics", Some(other.as_str()), b""),
    );
    assert_eq!(st, 401);
    let open = Daemon::start("16MiB", &["--public-metrics"]);
    let addr = open.metrics.clone().unwrap();
    let (st, body) = raw(&addr, &request("GET", "/metrics", None, b""));
    assert_eq!(st, 200, "{body}");
    // Only /metrics is open.
    let (st, _) = raw(&addr, &request("GET", "/host", None, b""));
    assert_eq!(st, 401);
}

#[test]
fn health_probes_are_closed_unless_opened_and_tell_nothing_else() {
    let h = host();
    for path in ["/healthz", "/readyz"] {
        let (st, _) = raw(&h.http, &request("GET", path, None, b""));
        assert_eq!(st, 401, "{path}");
    }
    let open = Daemon::start("16MiB", &["--public-health"]);
    let addr = open.metrics.clone().unwrap();
    let (st, body) = raw(&addr, &request("GET", "/healthz", None, b""));
    assert_eq!((st, body.as_str()), (200, "ok\n"));
    let (st, body) = raw(&addr, &request("GET", "/readyz", None, b""));
    assert_eq!((st, body.as_str()), (200, "ready\n"));
    // Nothing else is open: not the metrics, not a POST to a probe.
    let (st, _) = raw(&addr, &request("GET", "/metrics", None, b""));
    assert_eq!(st, 401);
    let (st, _) = raw(&addr, &request("POST", "/readyz", None, b"{}"));
    assert_eq!(st, 401);
}

/// Strangers that take every connection slot — heads that never end, and
/// unsigned heads announcing a megabyte body sent a byte at a time — keep
/// no signed request out, and no stranger's body is buffered.
#[test]
fn strangers_holding_every_slot_keep_no_signed_client_out() {
    let h = host();
    let rss0 = h.d.rss();
    let mut strangers = Vec::new();
    // 300 heads that never end (more than the 256 slots), then 50 slow bodies.
    for i in 0..350 {
        let mut s = TcpStream::connect(&h.http).unwrap();
        s.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
        let head = if i < 300 {
            // A head that never ends.
            "POST /guests HTTP/1.1\r\nHost: x\r\n".to_string()
        } else {
            // An unsigned head for a body that never comes.
            "POST /guests HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n{".to_string()
        };
        let _ = s.write_all(head.as_bytes());
        strangers.push(s);
    }
    // The slow bodies were answered 401 at once, unread.
    let mut refused = 0;
    for s in strangers.iter_mut().skip(300).take(20) {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        if out.starts_with("HTTP/1.1 401") {
            refused += 1;
        }
    }
    assert_eq!(
        refused, 20,
        "an unsigned head with a body is refused before the body"
    );
    let c = pagefleet_common::http::Client::new(h.d.secret.clone());
    for _ in 0..40 {
        // New strangers keep coming while the signed client works.
        for _ in 0..10 {
            if let Ok(mut s) = TcpStream::connect(&h.http) {
                let _ = s.write_all(b"GET /host HTTP/1.1\r\n");
                strangers.push(s);
            }
        }
        let r: pagefleet_api::HostReport = c
            .get(&h.http, "/host")
            .expect("a signed request while strangers hold the slots");
        assert_eq!(r.guest_memory, 64 << 20);
    }
    let grew = h.d.rss().saturating_sub(rss0);
    assert!(
        grew < 32 << 20,
        "RSS grew {grew} bytes with strangers connected"
    );
    drop(strangers);
    nothing_started(&h);
}
