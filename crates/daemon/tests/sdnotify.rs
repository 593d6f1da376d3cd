//! systemd readiness (`Type=notify` in packaging/pagefleetd.service): a real
//! pagefleetd told of a notification socket says `READY=1` once it serves
//! (its listening line printed, the memory server answering) and
//! `STOPPING=1` when a SIGTERM stops it.

mod common;

use common::Daemon;
use std::io::{BufRead, BufReader};
use std::os::unix::net::UnixDatagram;
use std::process::{Command, Stdio};
use std::time::Duration;

#[test]
fn the_daemon_says_ready_once_serving_and_stopping_on_sigterm() {
    let dir = common::tempdir("sdnotify").keep();
    let sock = dir.join("notify.sock");
    let rx = UnixDatagram::bind(&sock).unwrap();
    rx.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let secret_path = dir.join("secret");
    std::fs::write(&secret_path, "test-secret-0123456789abcdef\n").unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_pagefleetd"))
        .args([
            "--lend",
            "16MiB",
            "--listen",
            "127.0.0.1:0",
            "--log",
            "error",
        ])
        .arg("--secret-file")
        .arg(&secret_path)
        .env_remove("PAGEFLEET_SECRET")
        .env("NOTIFY_SOCKET", &sock)
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn pagefleetd");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines.next().expect("pagefleetd printed nothing").unwrap();
    let addr = first.strip_prefix("listening ").expect("listening line");
    let mut buf = [0u8; 256];
    let n = rx.recv(&mut buf).expect("READY=1 within 60 s");
    let got = String::from_utf8_lossy(&buf[..n]).to_string();
    assert!(got.lines().any(|l| l == "READY=1"), "{got:?}");
    // Ready means serving: the memory server answers now.
    let mut d = Daemon {
        child,
        addr: addr.to_string(),
        metrics: None,
        secret: pagefleet_proto::auth::Secret::load(&secret_path).unwrap(),
        dir: dir.clone(),
    };
    d.conn();
    pagefleet_common::sys::process::signal(d.pid() as i32, libc::SIGTERM).unwrap();
    let n = rx.recv(&mut buf).expect("STOPPING=1 after SIGTERM");
    assert_eq!(&buf[..n], b"STOPPING=1");
    let st = d.child.wait().unwrap();
    assert!(st.success(), "pagefleetd ended with {st}");
}
