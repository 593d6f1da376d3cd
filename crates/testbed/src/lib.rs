//! A multi-host lab on one machine. Hosts are network namespaces; a switch
//! namespace holds a bridge; each host is joined to it by a veth pair whose
//! two ends are shaped with `tc tbf` (so both directions see the link rate);
//! every host runs a `pagefleetd`. Nothing is created in the root namespace,
//! and no host has a route anywhere but the lab's own subnet.
//!
//! Names carry a lab prefix (default `pf`), so several labs (e.g. parallel
//! tests) can coexist, and `down` removes everything with that prefix, also
//! what a crashed run left behind.

// Not a library API: a lab harness (network namespaces) for tests, benchmarks and the demo.
#![allow(missing_docs)]

pub mod error;
pub use error::{Error, Result};

use crate::error::Context;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The bridge in each VM host's namespace that its VMs' NICs join
/// (`pagefleetd --vm-bridge`), linked to the lab's switch.
pub const VM_BRIDGE: &str = "vmbr0";

/// Link rates the lab can shape to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Link {
    Gbit1,
    Gbit10,
    /// No shaping (veth at memory speed).
    Unshaped,
}

impl std::str::FromStr for Link {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Link, String> {
        match s {
            "1gbit" => Ok(Link::Gbit1),
            "10gbit" => Ok(Link::Gbit10),
            "none" | "unshaped" => Ok(Link::Unshaped),
            _ => Err(format!("unknown link {s:?}: use 1gbit, 10gbit or none")),
        }
    }
}

impl Link {
    fn tbf(self) -> Option<(&'static str, &'static str)> {
        // (rate, burst): burst must cover rate x timer granularity.
        match self {
            Link::Gbit1 => Some(("1gbit", "256kb")),
            Link::Gbit10 => Some(("10gbit", "2mb")),
            Link::Unshaped => None,
        }
    }
    /// The shaped rate in bytes per second (None: unshaped).
    pub fn bytes_per_sec(self) -> Option<f64> {
        match self {
            Link::Gbit1 => Some(1e9 / 8.0),
            Link::Gbit10 => Some(10e9 / 8.0),
            Link::Unshaped => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Link::Gbit1 => "1gbit",
            Link::Gbit10 => "10gbit",
            Link::Unshaped => "none",
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Host {
    pub name: String,
    pub netns: String,
    pub ip: String,
    /// Memory-server address of this host's pagefleetd.
    pub addr: String,
    pub pid: u32,
    /// Memory its guest host service gives guests (0: runs no guests).
    #[serde(default)]
    pub guest_memory: u64,
}

impl Host {
    /// This host's pagefleetd HTTP address (registry, guests, metrics).
    pub fn http(&self) -> String {
        format!("{}:7071", self.ip)
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Lab {
    pub prefix: String,
    pub link: Link,
    pub subnet: String,
    pub hosts: Vec<Host>,
    pub dir: PathBuf,
    pub secret_file: PathBuf,
    /// With TLS: the identity commands run in the lab present (an "admin"
    /// certificate the lab's CA signed); each host's is `tls_dir(host)`.
    #[serde(default)]
    pub admin_tls: Option<PathBuf>,
}

#[derive(Clone, Debug)]
pub struct Options {
    pub prefix: String,
    pub hosts: usize,
    pub link: Link,
    /// Memory each host's pagefleetd lends.
    pub lend: u64,
    /// Guest memory per host (h1, h2, ...; the last value repeats; empty:
    /// no guest host service). All lab hosts share this machine's RAM, so
    /// this is what placement sees as each host's memory.
    pub guest_memory: Vec<u64>,
    /// Third octet of the lab's 10.200.X.0/24 subnet.
    pub subnet_octet: u8,
    pub pagefleetd: PathBuf,
    /// Where state, logs and the lab's secret live.
    pub dir: PathBuf,
    /// Directories VM guests' images may come from (`--vm-images`).
    pub vm_images: Vec<PathBuf>,
    /// Run an etcd member on each of the first N hosts (client port 2379)
    /// and make it the daemons' registry (`--registry etcd://...`) instead
    /// of `--peers`. 0: the embedded peers registry.
    pub etcd: usize,
    /// Give the lab a CA, each host a certificate for its address and its
    /// pagefleetd `--tls-dir` (every port then takes only TLS from the
    /// other hosts), and commands run in the lab an admin certificate.
    pub tls: bool,
    /// More pagefleetd flags for every host (e.g. `--gc-grace 2`).
    pub daemon_args: Vec<String>,
    /// More pagefleetd flags for one host, by name (`("h1", ["--ksm",
    /// "adaptive"])`): for what a machine has only once, such as KSM.
    pub host_args: Vec<(String, Vec<String>)>,
    /// Form the embedded registry as the sample configuration does: every
    /// daemon listens on 0.0.0.0 and is given `--join` h1's API, none
    /// `--peers`.
    pub join: bool,
}

impl Options {
    pub fn new(hosts: usize, link: Link, pagefleetd: PathBuf) -> Options {
        Options {
            prefix: "pf".into(),
            hosts,
            link,
            lend: 1 << 30,
            guest_memory: Vec::new(),
            subnet_octet: 77,
            pagefleetd,
            dir: PathBuf::from("/run/pagefleet/testbed"),
            vm_images: Vec::new(),
            etcd: 0,
            tls: false,
            daemon_args: Vec::new(),
            host_args: Vec::new(),
            join: false,
        }
    }
}

fn run(args: &[&str]) -> Result<()> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .with_context(|| format!("cannot run {} (is iproute2 installed?)", args[0]))?;
    if !out.status.success() {
        return Err(crate::Error::Invalid(format!(
            "`{}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

fn netns_list() -> Vec<String> {
    std::fs::read_dir("/run/netns")
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default()
}

fn state_path(dir: &Path, prefix: &str) -> PathBuf {
    dir.join(format!("{prefix}.json"))
}

impl Lab {
    /// Create the lab. Anything left by an earlier lab with the same prefix is removed first.
    pub fn up(o: &Options) -> Result<Lab> {
        if !pagefleet_common::sys::process::is_root() {
            return Err(crate::Error::Invalid(
                "the testbed creates network namespaces: run it as root".to_string(),
            ));
        }
        if o.hosts == 0 || o.hosts > 200 {
            return Err(crate::Error::Invalid("--hosts must be 1..=200".to_string()));
        }
        if !o.prefix.chars().all(|c| c.is_ascii_alphanumeric())
            || o.prefix.is_empty()
            || o.prefix.len() > 6
        {
            return Err(crate::Error::Invalid(
                "lab prefix must be 1-6 letters or digits".to_string(),
            ));
        }
        down_prefix(&o.dir, &o.prefix)?;
        std::fs::create_dir_all(&o.dir)?;
        let secret_file = o.dir.join(format!("{}-secret", o.prefix));
        std::fs::write(&secret_file, pagefleet_proto::auth::Secret::generate_hex())?;
        let sw = format!("{}-sw", o.prefix);
        let subnet = format!("10.200.{}", o.subnet_octet);
        let mut lab = Lab {
            prefix: o.prefix.clone(),
            link: o.link,
            subnet: format!("{subnet}.0/24"),
            hosts: vec![],
            dir: o.dir.clone(),
            secret_file,
            admin_tls: None,
        };
        // Save as we go: a failure half-way leaves a state `down` can clean.
        let r = (|| -> Result<()> {
            run(&["ip", "netns", "add", &sw])?;
            run(&["ip", "-n", &sw, "link", "add", "br0", "type", "bridge"])?;
            run(&["ip", "-n", &sw, "link", "set", "br0", "up"])?;
            for i in 0..o.hosts {
                let name = format!("h{}", i + 1);
                let ns = format!("{}-{name}", o.prefix);
                let ip = format!("{subnet}.{}", i + 1);
                run(&["ip", "netns", "add", &ns])?;
                let peer = format!("{}{}", o.prefix, name); // switch-side name, < 16 chars
                run(&[
                    "ip", "link", "add", "eth0", "netns", &ns, "type", "veth", "peer", "name",
                    &peer, "netns", &sw,
                ])?;
                run(&[
                    "ip",
                    "-n",
                    &ns,
                    "addr",
                    "add",
                    &format!("{ip}/24"),
                    "dev",
                    "eth0",
                ])?;
                run(&["ip", "-n", &ns, "link", "set", "eth0", "up"])?;
                run(&["ip", "-n", &ns, "link", "set", "lo", "up"])?;
                run(&["ip", "-n", &sw, "link", "set", &peer, "master", "br0"])?;
                run(&["ip", "-n", &sw, "link", "set", &peer, "up"])?;
                if let Some((rate, burst)) = o.link.tbf() {
                    for (n, dev) in [(&ns, "eth0"), (&sw, peer.as_str())] {
                        run(&[
                            "ip", "netns", "exec", n, "tc", "qdisc", "add", "dev", dev, "root",
                            "tbf", "rate", rate, "burst", burst, "latency", "50ms",
                        ])?;
                    }
                }
                let guest_memory = o
                    .guest_memory
                    .get(i)
                    .or(o.guest_memory.last())
                    .copied()
                    .unwrap_or(0);
                if guest_memory > 0 && !o.vm_images.is_empty() {
                    // The host's VM bridge: VMs' taps join it, and a second
                    // link joins it to the lab's switch, so a VM is a
                    // station on the lab's network with its own MAC and
                    // address, whichever host runs it. (The host's own
                    // address stays on eth0.)
                    let up = format!("{}{name}v", o.prefix);
                    run(&["ip", "-n", &ns, "link", "add", VM_BRIDGE, "type", "bridge"])?;
                    run(&[
                        "ip", "link", "add", "vmup", "netns", &ns, "type", "veth", "peer", "name",
                        &up, "netns", &sw,
                    ])?;
                    run(&["ip", "-n", &ns, "link", "set", "vmup", "master", VM_BRIDGE])?;
                    for dev in ["vmup", VM_BRIDGE] {
                        run(&["ip", "-n", &ns, "link", "set", dev, "up"])?;
                    }
                    run(&["ip", "-n", &sw, "link", "set", &up, "master", "br0"])?;
                    run(&["ip", "-n", &sw, "link", "set", &up, "up"])?;
                    if let Some((rate, burst)) = o.link.tbf() {
                        for (n, dev) in [(&ns, "vmup"), (&sw, up.as_str())] {
                            run(&[
                                "ip", "netns", "exec", n, "tc", "qdisc", "add", "dev", dev, "root",
                                "tbf", "rate", rate, "burst", burst, "latency", "50ms",
                            ])?;
                        }
                    }
                }
                lab.hosts.push(Host {
                    name,
                    netns: ns,
                    ip: ip.clone(),
                    addr: format!("{ip}:7070"),
                    pid: 0,
                    guest_memory,
                });
                lab.save()?;
            }
            if o.tls {
                lab.issue_certificates()?;
                lab.save()?;
            }
            let registry = if o.etcd > 0 {
                Some(start_etcd(o, &lab.hosts[..o.etcd.min(lab.hosts.len())])?)
            } else {
                None
            };
            let peers: Vec<String> = lab.hosts.iter().map(|h| h.http()).collect();
            let seed = lab.hosts.first().map(|h| h.http());
            for h in lab.hosts.iter_mut() {
                let others: Vec<String> = match &registry {
                    Some(_) => vec![],
                    None if o.join => vec![],
                    None => peers.iter().filter(|p| **p != h.http()).cloned().collect(),
                };
                let tls = lab
                    .admin_tls
                    .is_some()
                    .then(|| tls_dir(&o.dir, &o.prefix, &h.name));
                h.pid = start_daemon(
                    o,
                    h,
                    &lab.secret_file,
                    &others,
                    seed.as_deref().filter(|_| o.join),
                    registry.as_deref(),
                    tls.as_deref(),
                )?;
            }
            lab.save()?;
            for h in &lab.hosts {
                wait_listening(&h.netns, &h.addr)?;
            }
            Ok(())
        })();
        if let Err(e) = r {
            let _ = down_prefix(&o.dir, &o.prefix);
            return Err(Error::Failed(pagefleet_common::context::Failed {
                what: "testbed up failed; everything it created was removed".into(),
                cause: Some(Box::new(e)),
            }));
        }
        Ok(lab)
    }

    /// A CA for the lab, a certificate per host (its name and address) and
    /// the admin identity, all under the lab's directory.
    fn issue_certificates(&mut self) -> Result<()> {
        let ca = self.dir.join(format!("{}-tls-ca", self.prefix));
        pagefleet_tls::certs::init_ca(&ca).map_err(|e| Error::Invalid(e.to_string()))?;
        let mut ids: Vec<(String, Vec<std::net::IpAddr>)> = self
            .hosts
            .iter()
            .map(|h| (h.name.clone(), h.ip.parse().into_iter().collect()))
            .collect();
        ids.push(("admin".into(), vec![]));
        for (name, ips) in ids {
            let req = pagefleet_tls::certs::IssueRequest {
                ips,
                ..pagefleet_tls::certs::IssueRequest::named(&name)
            };
            pagefleet_tls::certs::issue(&ca, &req, &tls_dir(&self.dir, &self.prefix, &name))
                .map_err(|e| Error::Invalid(e.to_string()))?;
        }
        self.admin_tls = Some(tls_dir(&self.dir, &self.prefix, "admin"));
        Ok(())
    }

    /// Host `h`'s TLS identity directory (when the lab has TLS).
    pub fn host_tls(&self, h: usize) -> Option<PathBuf> {
        self.admin_tls
            .as_ref()
            .map(|_| tls_dir(&self.dir, &self.prefix, &self.hosts[h].name))
    }

    fn save(&self) -> Result<()> {
        std::fs::write(
            state_path(&self.dir, &self.prefix),
            serde_json::to_vec_pretty(self)?,
        )?;
        Ok(())
    }

    pub fn load(dir: &Path, prefix: &str) -> Result<Lab> {
        let p = state_path(dir, prefix);
        let b = std::fs::read(&p)
            .with_context(|| format!("no testbed {prefix:?} is up (no {})", p.display()))?;
        Ok(serde_json::from_slice(&b)?)
    }

    /// A command to run inside a host's namespace.
    /// Inside, `pagefleet` finds the lab's registry and secret by itself.
    pub fn exec(&self, host: usize, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.hosts[host].netns])
            .arg(program);
        c.env("PAGEFLEET_REGISTRY", self.hosts[host].http())
            .env("PAGEFLEET_SECRET_FILE", &self.secret_file);
        if let Some(t) = &self.admin_tls {
            c.env("PAGEFLEET_TLS_DIR", t);
        }
        c
    }

    /// A guest service address in the lab subnet (`.200 + n`), e.g. for guest n.
    pub fn service_ip(&self, n: u8) -> String {
        let base = self.subnet.trim_end_matches(".0/24");
        format!("{base}.{}", 200u16 + n as u16)
    }

    /// The `n`th address for VMs' own NICs on the lab's network
    /// (`.150+n`, with the lab's prefix length): they join the lab's
    /// switch through their host's [`VM_BRIDGE`].
    pub fn vm_ip(&self, n: u8) -> String {
        let base = self.subnet.trim_end_matches(".0/24");
        format!("{base}.{}/24", 150u16 + n as u16)
    }

    /// Put a guest's service address on host `to` (removing it from every
    /// other host first) and make every host forget where it was, so the
    /// address moves with the guest.
    pub fn place_service_ip(&self, ip: &str, to: usize) -> Result<()> {
        for h in &self.hosts {
            let _ = run(&[
                "ip",
                "-n",
                &h.netns,
                "addr",
                "del",
                &format!("{ip}/32"),
                "dev",
                "eth0",
            ]);
        }
        run(&[
            "ip",
            "-n",
            &self.hosts[to].netns,
            "addr",
            "add",
            &format!("{ip}/32"),
            "dev",
            "eth0",
        ])?;
        for h in &self.hosts {
            let _ = run(&["ip", "-n", &h.netns, "neigh", "flush", "to", ip]);
        }
        Ok(())
    }

    /// Which host holds the service address, if any.
    pub fn service_ip_host(&self, ip: &str) -> Option<usize> {
        self.hosts.iter().position(|h| {
            Command::new("ip")
                .args(["-n", &h.netns, "-o", "addr", "show", "dev", "eth0"])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).contains(&format!("{ip}/32")))
                .unwrap_or(false)
        })
    }

    pub fn down(&self) -> Result<()> {
        down_prefix(&self.dir, &self.prefix)
    }
}

/// Start an etcd member in each of `hosts`' namespaces (data under the
/// lab's directory, removed with it); their `etcd://` address.
fn start_etcd(o: &Options, hosts: &[Host]) -> Result<String> {
    let initial: Vec<String> = hosts
        .iter()
        .map(|h| format!("{}=http://{}:2380", h.name, h.ip))
        .collect();
    for h in hosts {
        let log = std::fs::File::create(o.dir.join(format!("{}-etcd.log", h.netns)))?;
        Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", h.netns))
            .args(["--", "etcd", "--name", &h.name, "--data-dir"])
            .arg(o.dir.join(format!("{}-etcd", h.netns)))
            .args([
                "--listen-client-urls",
                &format!("http://{}:2379", h.ip),
                "--advertise-client-urls",
                &format!("http://{}:2379", h.ip),
                "--listen-peer-urls",
                &format!("http://{}:2380", h.ip),
                "--initial-advertise-peer-urls",
                &format!("http://{}:2380", h.ip),
                "--initial-cluster",
                &initial.join(","),
                "--initial-cluster-state",
                "new",
                "--initial-cluster-token",
                &o.prefix,
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("cannot start etcd (make deps installs etcd-server)")?;
    }
    let eps: Vec<String> = hosts.iter().map(|h| format!("{}:2379", h.ip)).collect();
    Ok(format!("etcd://{}", eps.join(",")))
}

impl Lab {
    /// Start host `i`'s pagefleetd again as `up` started it (after it was
    /// stopped: a restart, e.g. an upgrade); its new pid is recorded.
    pub fn restart_daemon(&mut self, o: &Options, i: usize) -> Result<()> {
        let registry = (o.etcd > 0).then(|| {
            let eps: Vec<String> = self.hosts[..o.etcd.min(self.hosts.len())]
                .iter()
                .map(|h| format!("{}:2379", h.ip))
                .collect();
            format!("etcd://{}", eps.join(","))
        });
        let me = self.hosts[i].http();
        let peers: Vec<String> = match &registry {
            Some(_) => vec![],
            None => self
                .hosts
                .iter()
                .map(|h| h.http())
                .filter(|p| *p != me)
                .collect(),
        };
        let tls = self
            .admin_tls
            .is_some()
            .then(|| tls_dir(&o.dir, &o.prefix, &self.hosts[i].name));
        // The run before keeps its log, as NETNS.log.1.
        let log = o.dir.join(format!("{}.log", self.hosts[i].netns));
        let _ = std::fs::rename(&log, o.dir.join(format!("{}.log.1", self.hosts[i].netns)));
        let seed = self.hosts[0].http();
        let pid = start_daemon(
            o,
            &self.hosts[i],
            &self.secret_file,
            &peers,
            Some(seed.as_str()).filter(|_| o.join),
            registry.as_deref(),
            tls.as_deref(),
        )?;
        self.hosts[i].pid = pid;
        wait_listening(&self.hosts[i].netns, &self.hosts[i].addr)?;
        // The API starts after the memory server: wait for it too.
        wait_listening(&self.hosts[i].netns, &self.hosts[i].http())?;
        self.save()
    }
}

fn start_daemon(
    o: &Options,
    h: &Host,
    secret: &Path,
    peers: &[String],
    join: Option<&str>,
    registry: Option<&str>,
    tls: Option<&Path>,
) -> Result<u32> {
    let log = std::fs::File::create(o.dir.join(format!("{}.log", h.netns)))?;
    // nsenter, not `ip netns exec`: the latter also remounts /sys, hiding
    // the cgroup hierarchy the guest host service may put runners into.
    let mut cmd = Command::new("nsenter");
    // Its own session: the daemon outlives `testbed up` and its terminal.
    pagefleet_common::sys::process::new_session(&mut cmd);
    let child = cmd
        .arg(format!("--net=/run/netns/{}", h.netns))
        .arg("--")
        .arg(&o.pagefleetd)
        .args([
            "--lend",
            &o.lend.to_string(),
            "--listen",
            // Every address, as the sample configuration has it, with --join;
            // else the lab address.
            &if join.is_some() {
                "0.0.0.0:7070".to_string()
            } else {
                h.addr.clone()
            },
            // The API on the lab address: the other hosts are its peers.
            "--metrics",
            &if join.is_some() {
                "0.0.0.0:7071".to_string()
            } else {
                h.http()
            },
            "--log",
            "warn",
            "--name",
            &h.name,
        ])
        .arg("--secret-file")
        .arg(secret)
        .args(
            tls.map(|t| vec!["--tls-dir".into(), t.as_os_str().to_owned()])
                .unwrap_or_default(),
        )
        .args(if peers.is_empty() || join.is_some() {
            vec![]
        } else {
            vec!["--peers".to_string(), peers.join(",")]
        })
        .args(
            join.map(|j| vec!["--join".to_string(), j.to_string()])
                .unwrap_or_default(),
        )
        .args(
            registry
                .map(|r| vec!["--registry".to_string(), r.to_string()])
                .unwrap_or_default(),
        )
        .args(if h.guest_memory > 0 {
            vec![
                "--guest-memory".to_string(),
                h.guest_memory.to_string(),
                "--guest-dir".into(),
                o.dir
                    .join(format!("{}-guests", h.netns))
                    .display()
                    .to_string(),
            ]
        } else {
            vec![]
        })
        .args(if h.guest_memory > 0 && !o.vm_images.is_empty() {
            let dirs: Vec<String> = o
                .vm_images
                .iter()
                .map(|d| d.display().to_string())
                .collect();
            vec![
                "--vm-images".to_string(),
                dirs.join(","),
                "--vm-bridge".into(),
                VM_BRIDGE.into(),
            ]
        } else {
            vec![]
        })
        .args(&o.daemon_args)
        .args(
            o.host_args
                .iter()
                .filter(|(n, _)| *n == h.name)
                .flat_map(|(_, a)| a),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .with_context(|| format!("cannot start {}", o.pagefleetd.display()))?;
    // nsenter execs the daemon, so the child pid is the daemon's.
    Ok(child.id())
}

fn wait_listening(ns: &str, addr: &str) -> Result<()> {
    let t = Instant::now();
    let port = addr.rsplit(':').next().unwrap_or("7070");
    while t.elapsed() < Duration::from_secs(10) {
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                ns,
                "ss",
                "-Hltn",
                &format!("sport = :{port}"),
            ])
            .output()?;
        if !String::from_utf8_lossy(&out.stdout).trim().is_empty() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(crate::Error::Invalid(format!("pagefleetd in {ns} did not start listening on {addr}; see its log in the testbed directory")))
}

/// Remove every namespace, daemon and file of the lab `prefix`. Safe to run
/// twice, and also cleans what a crashed run left (found by name).
pub fn down_prefix(dir: &Path, prefix: &str) -> Result<()> {
    if let Ok(lab) = Lab::load(dir, prefix) {
        for h in &lab.hosts {
            if h.pid != 0 {
                let _ = pagefleet_common::sys::process::signal(h.pid as i32, libc::SIGKILL);
            }
        }
    }
    let ours: Vec<String> = netns_list()
        .into_iter()
        .filter(|n| n.starts_with(&format!("{prefix}-")))
        .collect();
    for ns in &ours {
        // Kill whatever still runs in the namespace (e.g. a daemon from a crashed run).
        if let Ok(out) = Command::new("ip").args(["netns", "pids", ns]).output() {
            for pid in String::from_utf8_lossy(&out.stdout)
                .split_whitespace()
                .filter_map(|p| p.parse::<i32>().ok())
            {
                let _ = pagefleet_common::sys::process::signal(pid, libc::SIGKILL);
            }
        }
    }
    for ns in &ours {
        let _ = run(&["ip", "netns", "del", ns]);
    }
    // Daemons this process started (Lab::up) are its children: reap them
    // (a benchmark brings many labs up and down; killed children left
    // unreaped stay in the process table as zombies until it exits).
    if let Ok(lab) = Lab::load(dir, prefix) {
        for h in lab.hosts.iter().filter(|h| h.pid != 0) {
            let t = std::time::Instant::now();
            while pagefleet_common::sys::process::alive(h.pid as i32)
                && pagefleet_common::sys::process::reap_if_ended(h.pid).is_none()
                && t.elapsed() < std::time::Duration::from_secs(2)
            {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        }
    }
    let _ = std::fs::remove_file(state_path(dir, prefix));
    let _ = std::fs::remove_file(dir.join(format!("{prefix}-secret")));
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            if n.starts_with(&format!("{prefix}-"))
                && (n.ends_with("-guests") || n.ends_with("-etcd") || n.contains("-tls-"))
            {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    let left: Vec<String> = netns_list()
        .into_iter()
        .filter(|n| n.starts_with(&format!("{prefix}-")))
        .collect();
    if !left.is_empty() {
        return Err(crate::Error::Invalid(format!(
            "could not remove namespaces {left:?}"
        )));
    }
    Ok(())
}

/// Move the calling thread into a network namespace (sockets it opens from
/// now on live there). Use a thread of its own: it does not come back.
pub fn enter_netns(netns: &str) -> Result<()> {
    let f = std::fs::File::open(format!("/run/netns/{netns}"))
        .with_context(|| format!("no network namespace {netns}"))?;
    if let Err(e) = pagefleet_common::sys::process::enter_netns(&f) {
        return Err(crate::Error::Invalid(format!("setns into {netns}: {e}")));
    }
    Ok(())
}

impl Lab {
    /// Run `f` on a new thread inside host `host`'s network namespace.
    pub fn spawn_in<T: Send + 'static>(
        &self,
        host: usize,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> std::thread::JoinHandle<Result<T>> {
        let ns = self.hosts[host].netns.clone();
        std::thread::spawn(move || {
            enter_netns(&ns)?;
            Ok(f())
        })
    }
}

/// Where a lab identity (a host's, "ca" or "admin") lives.
fn tls_dir(dir: &Path, prefix: &str, name: &str) -> PathBuf {
    dir.join(format!("{prefix}-tls-{name}"))
}
