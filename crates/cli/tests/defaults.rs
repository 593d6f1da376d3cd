//! Defaults a user expects: a service (`run kv`) runs until it is
//! interrupted; `guest start` honours or refuses every flag it is given,
//! with the size and percentage forms `run` takes, before it asks anyone.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A secret file for commands that load one before they check their flags.
fn secret() -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("pf-defaults-secret-{}", std::process::id()));
    std::fs::write(&p, "ab".repeat(32)).unwrap();
    p
}

fn pf(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_pagefleet"))
        .arg("--secret-file")
        .arg(secret())
        .args(args)
        .output()
        .expect("run pagefleet");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn guest_start_refuses_what_it_cannot_honour_and_takes_run_forms() {
    let start = |extra: &[&str]| {
        let mut a = vec![
            "guest",
            "start",
            "g",
            "--on",
            "h1",
            "--registry",
            "127.0.0.1:9",
        ];
        a.extend_from_slice(extra);
        pf(&a)
    };
    let (ok, out) = start(&["--size", "64MiB", "--", "kv", "--duration", "5"]);
    assert!(
        !ok && out.contains("--duration") && out.contains("guest stop"),
        "{out}"
    );
    let (ok, out) = start(&["--size", "64MiB", "--", "kv", "--json"]);
    assert!(!ok && out.contains("--json"), "{out}");
    let (ok, out) = start(&["--", "kv"]);
    assert!(!ok && out.contains("--size"), "{out}");
    let (ok, out) = start(&["--size", "64MiB", "--", "kv", "--size", "128MiB"]);
    assert!(!ok && out.contains("--size given twice"), "{out}");
    let (ok, out) = start(&["--size", "64MiB", "--budget", "150%", "--", "kv"]);
    assert!(!ok && out.contains("0..100"), "{out}");
    // The workload's --size and a percentage budget are taken: the next
    // thing it does is ask the registry (nobody listens at port 9).
    for extra in [
        &["--budget", "50%", "--", "kv", "--size", "64MiB"][..],
        &["--size", "64MiB", "--", "synthetic", "--budget", "25%"][..],
    ] {
        let (ok, out) = start(extra);
        assert!(!ok && out.contains("registry"), "{extra:?}: {out}");
    }
}

/// Kills and reaps the child on drop, even when the test fails.
struct Reap(std::process::Child);

impl Drop for Reap {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn run_kv_serves_until_interrupted() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let addr = format!("127.0.0.1:{port}");
    let mut child = Reap(
        Command::new(env!("CARGO_BIN_EXE_pagefleet"))
            .args(["run", "kv", "--size", "16MiB", "--listen", &addr])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let t = Instant::now();
    let s = loop {
        match std::net::TcpStream::connect(&addr) {
            Ok(s) => break s,
            Err(e) => {
                assert!(
                    t.elapsed() < Duration::from_secs(20),
                    "kv never listened: {e}"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    };
    // Past the 10 s `run kv` used to stop at, it still runs and answers.
    std::thread::sleep(Duration::from_secs(12));
    assert!(
        child.0.try_wait().unwrap().is_none(),
        "run kv ended by itself"
    );
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut w = s.try_clone().unwrap();
    w.write_all(b"set k 0 0 1\r\nx\r\n").unwrap();
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    assert_eq!(line, "STORED\r\n");
    // SIGINT (Ctrl-C) ends it cleanly.
    let _ = pagefleet_common::sys::process::signal(child.0.id() as i32, libc::SIGINT);
    let t = Instant::now();
    let st = loop {
        if let Some(st) = child.0.try_wait().unwrap() {
            break st;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "run kv ignored SIGINT"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(st.success(), "{st:?}");
}
