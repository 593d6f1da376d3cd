//! pagefleetd's log lines (issue 51, item 6): plain text without colour
//! codes when stderr is not a terminal (a file, the journal), and one JSON
//! object per line with `--log-format json`.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

/// pagefleetd on loopback with `extra` flags: its stderr lines up to the
/// one that says it serves (it always says so at start).
fn lines_until_serving(extra: &[&str]) -> Vec<String> {
    let dir = pagefleet_lab::proc::TempDir::new("test-logs");
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "test-secret-0123456789abcdef\n").unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_pagefleetd"))
        .args([
            "--lend",
            "16MiB",
            "--listen",
            "127.0.0.1:0",
            "--metrics",
            "127.0.0.1:0",
        ])
        .args(["--log", "info"])
        .arg("--secret-file")
        .arg(&secret)
        .args(extra)
        .env_remove("PAGEFLEET_SECRET")
        .env_remove("PAGEFLEET_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn pagefleetd");
    let mut child = Reaped(child);
    let err = child.0.stderr.take().unwrap();
    let mut got = Vec::new();
    for l in BufReader::new(err).lines() {
        let l = l.expect("a log line");
        let done = l.contains("memory server lending");
        got.push(l);
        if done {
            return got;
        }
    }
    panic!("pagefleetd ended before it served: {got:?}");
}

struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn logs_are_plain_off_a_terminal_and_json_when_asked() {
    let plain = lines_until_serving(&[]);
    assert!(
        plain.iter().all(|l| !l.contains('\x1b')),
        "colour codes in a pipe: {plain:?}"
    );

    let json = lines_until_serving(&["--log-format", "json"]);
    for l in &json {
        let v: serde_json::Value = serde_json::from_str(l)
            .unwrap_or_else(|e| panic!("not one JSON object per line ({e}): {l}"));
        assert!(v["timestamp"].is_string() && v["level"].is_string(), "{v}");
        assert!(v["fields"]["message"].is_string(), "{v}");
    }
    let last: serde_json::Value = serde_json::from_str(json.last().unwrap()).unwrap();
    assert_eq!(last["level"], "INFO", "{last}");
}
