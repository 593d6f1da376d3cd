//! Helpers for system tests: start real pagefleetd processes on loopback
//! (killed on drop), find the workspace's binaries, fill and check patterns.

use pagefleet_proto::auth::Secret;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

/// A binary of this workspace, built next to the test executable's profile dir.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    // target/<profile>/deps/<test> -> target/<profile>/<name>
    let p = exe.parent().unwrap().parent().unwrap().join(name);
    assert!(p.exists(), "{} not built: run `cargo build --release --workspace` first", p.display());
    p
}

pub fn tempdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pagefleet-systest-{tag}-{}-{}", std::process::id(), pagefleet_proto::auth::random_u64()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

pub struct Server {
    pub child: Child,
    pub addr: String,
}

impl Server {
    pub fn start(lend: &str, secret_file: &std::path::Path) -> Server {
        let mut child = Command::new(bin("pagefleetd"))
            .args(["--lend", lend, "--listen", "127.0.0.1:0", "--metrics", "off", "--log", "error"])
            .arg("--secret-file")
            .arg(secret_file)
            .env_remove("PAGEFLEET_SECRET")
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn pagefleetd");
        let line = BufReader::new(child.stdout.take().unwrap()).lines().next().unwrap().unwrap();
        let addr = line.strip_prefix("listening ").unwrap().to_string();
        Server { child, addr }
    }
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A cluster of memory servers sharing a fresh secret.
pub struct Cluster {
    pub servers: Vec<Server>,
    pub secret: Secret,
    pub secret_file: PathBuf,
    dir: PathBuf,
}

impl Cluster {
    pub fn start(n: usize, lend: &str) -> Cluster {
        let dir = tempdir("cluster");
        let secret_file = dir.join("secret");
        std::fs::write(&secret_file, Secret::generate_hex()).unwrap();
        let secret = Secret::load(&secret_file).unwrap();
        let servers = (0..n).map(|_| Server::start(lend, &secret_file)).collect();
        Cluster { servers, secret, secret_file, dir }
    }
    pub fn addrs(&self) -> Vec<String> {
        self.servers.iter().map(|s| s.addr.clone()).collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for s in &mut self.servers {
            s.kill();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Deterministic contents for (page, version).
pub fn fill(page: u64, version: u64, out: &mut [u8]) {
    let mut x = page.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ version.wrapping_mul(0xC2B2_AE3D_27D4_EB4F) ^ 0x1656_67B1;
    for w in out.chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        w.copy_from_slice(&x.to_le_bytes());
    }
}

pub fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}
