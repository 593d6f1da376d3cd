//! `systemctl reload` (SIGHUP) reads the configuration again and applies
//! what can change without a restart (issue 51): the same process then
//! serves `/metrics` unsigned once the file says `public_metrics = true`,
//! logs at the new level, names what waits for a restart (`lend`), and
//! tells systemd RELOADING=1 then READY=1; a file that does not parse
//! changes nothing.

use pagefleet_lab::rawhttp::{exchange, Request};
use pagefleet_systest::*;
use std::io::{BufRead, BufReader};
use std::os::unix::net::UnixDatagram;
use std::process::{Command, Stdio};
use std::time::Duration;

fn config(dir: &std::path::Path, public: bool, log: &str, lend: &str) -> String {
    format!(
        "log = \"{log}\"\nsecret_file = \"{}\"\n[memserver]\nlend = \"{lend}\"\nlisten = \"127.0.0.1:0\"\nmetrics = \"127.0.0.1:0\"\npublic_metrics = {public}\n",
        dir.join("secret").display()
    )
}

struct Daemon(std::process::Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn signal(pid: u32, sig: i32) {
    let _ = pagefleet_common::sys::process::signal(pid as i32, sig);
}

/// The next sd_notify message (None within 20 s).
fn notified(rx: &UnixDatagram) -> Option<String> {
    let mut buf = [0u8; 512];
    let n = rx.recv(&mut buf).ok()?;
    Some(String::from_utf8_lossy(&buf[..n]).into_owned())
}

#[test]
fn sighup_rereads_the_config_in_the_same_process() {
    let dir = tempdir("reload");
    let cfg = dir.join("pagefleetd.toml");
    std::fs::write(&cfg, config(&dir, false, "info", "16MiB")).unwrap();
    let sock = dir.join("notify.sock");
    let rx = UnixDatagram::bind(&sock).unwrap();
    rx.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let log = dir.join("pagefleetd.log");
    let mut d = Daemon(
        Command::new(bin("pagefleetd"))
            .arg("--config")
            .arg(&cfg)
            .env("NOTIFY_SOCKET", &sock)
            .env_remove("PAGEFLEET_LOG")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    let pid = d.0.id();
    let mut http = None;
    for l in BufReader::new(d.0.stdout.take().unwrap()).lines().take(2) {
        if let Some(a) = l.unwrap().strip_prefix("metrics ") {
            http = Some(a.to_string());
        }
    }
    let http = http.expect("the daemon printed its HTTP address");
    assert!(notified(&rx).is_some_and(|m| m.contains("READY=1")));
    let metrics = || {
        exchange(&http, &Request::get("/metrics"), Duration::from_secs(5))
            .map(|r| r.status)
            .unwrap_or(0)
    };
    assert_eq!(metrics(), 401, "a stranger, before the reload");

    std::fs::write(&cfg, config(&dir, true, "debug", "32MiB")).unwrap();
    signal(pid, libc::SIGHUP);
    let m = notified(&rx).expect("a reload notice");
    assert!(
        m.contains("RELOADING=1") && m.contains("MONOTONIC_USEC="),
        "{m}"
    );
    assert!(
        notified(&rx).is_some_and(|m| m.contains("READY=1")),
        "ready again"
    );
    assert_eq!(metrics(), 200, "public_metrics applied");
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("reloaded:")
            && text.contains("public_metrics false -> true")
            && text.contains("log info -> debug"),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.contains("WARN") && l.contains("lend") && l.contains("next restart")),
        "names what waits: {text}"
    );
    assert!(!text.contains("restarted in place"), "{text}");
    assert!(
        d.0.try_wait().unwrap().is_none() && std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "the same process serves"
    );

    // A file that does not parse: nothing changes, the error is logged.
    std::fs::write(&cfg, "[memserver\nlend = ").unwrap();
    signal(pid, libc::SIGHUP);
    assert!(notified(&rx).is_some_and(|m| m.contains("RELOADING=1")));
    assert!(notified(&rx).is_some_and(|m| m.contains("READY=1")));
    assert_eq!(metrics(), 200, "the running settings stay");
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.lines().any(|l| l.contains("ERROR")
            && l.contains("reload:")
            && l.contains("running settings stay")),
        "{text}"
    );
    signal(pid, libc::SIGTERM);
    assert!(
        wait_child(&mut d.0, Duration::from_secs(20)),
        "stops on SIGTERM"
    );
}

fn wait_child(c: &mut std::process::Child, limit: Duration) -> bool {
    let t = std::time::Instant::now();
    while t.elapsed() < limit {
        if c.try_wait().unwrap().is_some() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}
