//! Test helper: a real pagefleetd child process on loopback, killed on drop.
#![allow(dead_code)]

use pagefleet_client::{Conn, ConnectOptions};
use pagefleet_proto::auth::Secret;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

pub struct Daemon {
    pub child: Child,
    pub addr: String,
    pub metrics: Option<String>,
    pub secret: Secret,
    pub dir: PathBuf,
}

pub use pagefleet_lab::proc::TempDir;

/// A scratch directory for a test, removed on drop.
pub fn tempdir(tag: &str) -> TempDir {
    TempDir::new(&format!("test-{tag}"))
}

impl Daemon {
    pub fn start(lend: &str, extra: &[&str]) -> Daemon {
        let dir = tempdir("daemon").keep();
        let secret_path = dir.join("secret");
        std::fs::write(&secret_path, "test-secret-0123456789abcdef\n").unwrap();
        let secret = Secret::load(&secret_path).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_pagefleetd"))
            .args(["--lend", lend, "--listen", "127.0.0.1:0", "--log", "error"])
            .arg("--secret-file")
            .arg(&secret_path)
            .args(extra)
            .env_remove("PAGEFLEET_SECRET")
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn pagefleetd");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let first = lines.next().expect("pagefleetd printed nothing").unwrap();
        let addr = first
            .strip_prefix("listening ")
            .expect("listening line")
            .to_string();
        let metrics = if extra.contains(&"off") {
            None
        } else {
            lines
                .next()
                .and_then(|l| l.ok())
                .and_then(|l| l.strip_prefix("metrics ").map(str::to_string))
        };
        Daemon {
            child,
            addr,
            metrics,
            secret,
            dir,
        }
    }

    pub fn conn(&self) -> Conn {
        Conn::connect(&self.addr, &self.secret, &ConnectOptions::default()).expect("connect")
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Resident set size of the daemon, bytes.
    pub fn rss(&self) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        let line = s.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
        line.split_whitespace()
            .nth(1)
            .unwrap()
            .parse::<u64>()
            .unwrap()
            * 1024
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Deterministic page contents: every 8-byte word depends on region, page and offset.
pub fn fill_page(region: u64, page: u64, out: &mut [u8]) {
    let mut x = region.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ page.wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
        ^ 0x1656_67B1_9E37_79F9;
    for w in out.chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        w.copy_from_slice(&x.to_le_bytes());
    }
}
