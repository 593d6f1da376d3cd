//! A real etcd cluster on loopback for tests and benchmarks (Debian's
//! `etcd-server`): members started here, killed and their data removed on
//! drop.

use crate::proc::TempDir;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One member.
pub struct Member {
    /// Its name (`m0`, `m1`, ...).
    pub name: String,
    /// Its client URL's host:port.
    pub client: String,
    child: Option<Child>,
}

/// An etcd cluster of a few members on 127.0.0.1.
pub struct EtcdCluster {
    /// Its members.
    pub members: Vec<Member>,
    _dir: TempDir,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

impl EtcdCluster {
    /// Start `n` members and wait until the cluster answers (None: no
    /// `etcd` binary here; `make deps` installs it).
    pub fn start(n: usize) -> Option<EtcdCluster> {
        if Command::new("etcd").arg("--version").output().is_err() {
            return None;
        }
        let dir = TempDir::new("etcd");
        let ports: Vec<(u16, u16)> = (0..n).map(|_| (free_port(), free_port())).collect();
        let initial: Vec<String> = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("m{i}=http://127.0.0.1:{peer}"))
            .collect();
        let mut members = Vec::new();
        for (i, (client, peer)) in ports.iter().enumerate() {
            let name = format!("m{i}");
            let log = std::fs::File::create(dir.path().join(format!("{name}.log"))).ok();
            let child = Command::new("etcd")
                .args(["--name", &name])
                .arg("--data-dir")
                .arg(dir.path().join(&name))
                .args([
                    "--listen-client-urls",
                    &format!("http://127.0.0.1:{client}"),
                    "--advertise-client-urls",
                    &format!("http://127.0.0.1:{client}"),
                    "--listen-peer-urls",
                    &format!("http://127.0.0.1:{peer}"),
                    "--initial-advertise-peer-urls",
                    &format!("http://127.0.0.1:{peer}"),
                    "--initial-cluster",
                    &initial.join(","),
                    "--initial-cluster-state",
                    "new",
                    "--initial-cluster-token",
                    &format!("pagefleet-test-{}", std::process::id()),
                ])
                .stdout(Stdio::null())
                .stderr(log.map(Stdio::from).unwrap_or_else(Stdio::null))
                .spawn()
                .ok()?;
            members.push(Member {
                name,
                client: format!("127.0.0.1:{client}"),
                child: Some(child),
            });
        }
        let c = EtcdCluster { members, _dir: dir };
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(30) {
            if c.healthy() {
                return Some(c);
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        panic!("etcd cluster of {n} did not become healthy in 30 s");
    }

    /// `etcd://` address of every member.
    pub fn url(&self) -> String {
        let eps: Vec<&str> = self.members.iter().map(|m| m.client.as_str()).collect();
        format!("etcd://{}", eps.join(","))
    }

    /// Whether `etcdctl endpoint health` says every live member is healthy.
    pub fn healthy(&self) -> bool {
        let eps: Vec<&str> = self
            .members
            .iter()
            .filter(|m| m.child.is_some())
            .map(|m| m.client.as_str())
            .collect();
        Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args(["--endpoints", &eps.join(","), "endpoint", "health"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Index of the current leader (by `etcdctl endpoint status`).
    pub fn leader(&self) -> Option<usize> {
        let eps: Vec<&str> = self.members.iter().map(|m| m.client.as_str()).collect();
        let ep = ask_leader(Command::new("etcdctl"), &eps)?;
        self.members.iter().position(|m| ep.ends_with(&m.client))
    }

    /// Process id of member `i` (None once killed).
    pub fn pid(&self, i: usize) -> Option<u32> {
        self.members[i].child.as_ref().map(|c| c.id())
    }

    /// SIGKILL member `i`.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }
}

/// Ask the members at `endpoints` which is the leader, through `etcdctl`
/// (a command, so a caller may run it in a namespace); its endpoint.
pub fn ask_leader(mut etcdctl: Command, endpoints: &[&str]) -> Option<String> {
    let out = etcdctl
        .env("ETCDCTL_API", "3")
        .args(["--endpoints", &endpoints.join(",")])
        .args(["endpoint", "status", "-w", "json"])
        .output()
        .ok()?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    v.as_array()?.iter().find_map(|e| {
        let leader = e["Status"]["leader"].as_u64()?;
        let me = e["Status"]["header"]["member_id"].as_u64()?;
        (leader == me).then(|| e["Endpoint"].as_str().map(str::to_string))?
    })
}
