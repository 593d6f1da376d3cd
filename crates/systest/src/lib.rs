//! Helpers for system tests: start real pagefleetd processes on loopback
//! (killed on drop), find the workspace's binaries, fill and check patterns.

// Not a library API: system-test helpers.
#![allow(missing_docs)]

pub mod iorig;
pub use iorig::IoRig;

use pagefleet_proto::auth::Secret;
use std::path::PathBuf;
use std::time::Duration;

/// A binary of this workspace, built next to the test executable's profile dir.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    // target/<profile>/deps/<test> -> target/<profile>/<name>
    let p = exe.parent().unwrap().parent().unwrap().join(name);
    assert!(
        p.exists(),
        "{} not built: run `cargo build --release --workspace` first",
        p.display()
    );
    p
}

pub use pagefleet_lab::proc::TempDir;

/// A scratch directory for a test, removed on drop.
pub fn tempdir(tag: &str) -> TempDir {
    TempDir::new(&format!("systest-{tag}"))
}

/// A real pagefleetd child process on loopback, killed on drop.
pub type Server = pagefleet_lab::proc::ChildDaemon;

fn start_server(lend: &str, secret_file: &std::path::Path) -> Server {
    let bytes = pagefleet_common::units::parse_size(lend).expect("lend size");
    Server::start_bin(&bin("pagefleetd"), bytes, secret_file).expect("start pagefleetd")
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
        let dir = tempdir("cluster").keep();
        let secret_file = dir.join("secret");
        std::fs::write(&secret_file, Secret::generate_hex()).unwrap();
        let secret = Secret::load(&secret_file).unwrap();
        let servers = (0..n).map(|_| start_server(lend, &secret_file)).collect();
        Cluster {
            servers,
            secret,
            secret_file,
            dir,
        }
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
    let mut x = page.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ version.wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
        ^ 0x1656_67B1;
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

pub use pagefleet_lab::LabRun;

/// A testbed lab for one test (removed on drop, even when the test fails).
/// `guest_memory`: per host (the last value repeats).
pub fn lab(
    tag: &str,
    hosts: usize,
    link: pagefleet_testbed::Link,
    lend: u64,
    guest_memory: &[u64],
) -> LabRun {
    lab_with(tag, hosts, link, lend, guest_memory, |_| {})
}

/// [`lab`] with the testbed's options adjusted: `|o| o.etcd = 3` (an etcd
/// member on each of the first 3 hosts as the daemons' registry),
/// `|o| o.tls = true` (a lab CA, each pagefleetd `--tls-dir` with its
/// host's certificate, commands in the lab presenting an admin one).
pub fn lab_with(
    tag: &str,
    hosts: usize,
    link: pagefleet_testbed::Link,
    lend: u64,
    guest_memory: &[u64],
    adjust: impl FnOnce(&mut pagefleet_testbed::Options),
) -> LabRun {
    let bins = bin("pagefleetd").parent().unwrap().to_path_buf();
    LabRun::up_opts(tag, &bins, hosts, link, lend, guest_memory, adjust).expect("testbed up")
}

/// Start a synthetic guest `name` of `mib` MiB on lab host h1 that
/// prefills its memory and then writes `rate` pages a second, and wait until
/// its pages are filled (resident on h1).
pub fn start_synthetic(l: &LabRun, name: &str, mib: u64, rate: u32) {
    let (size, rate_s) = (format!("{mib}MiB"), rate.to_string());
    let (ok, _, err) = l.pf(
        0,
        &[
            "guest",
            "start",
            name,
            "--on",
            "h1",
            "--size",
            &size,
            "--",
            "synthetic",
            "--prefill",
            "--rate",
            &rate_s,
            "--write-frac",
            "1",
        ],
    );
    assert!(ok, "guest start {name}: {err}");
    let pages = mib * 256;
    wait_for(&format!("{name} to fill"), 60, || {
        l.guest(name)
            .is_some_and(|(_, g)| g.pages.as_ref().map_or(0, |p| p.local) >= pages * 97 / 100)
    });
}

/// Start a 64 MiB synthetic guest `name` on lab host h1 that keeps 16
/// MiB resident and pages the rest to memory server `server`: it prefills
/// its memory, then writes `rate` pages a second (0: idle); `extra`: more
/// `synthetic` flags. Returns once the host has taken it.
pub fn start_paging_guest(l: &LabRun, name: &str, server: &str, rate: u32, extra: &[&str]) {
    let rate = rate.to_string();
    let mut args = vec![
        "guest",
        "start",
        name,
        "--on",
        "h1",
        "--size",
        "64MiB",
        "--budget",
        "16MiB",
        "--",
        "synthetic",
        "--servers",
        server,
        "--prefill",
        "--rate",
        &rate,
    ];
    args.extend_from_slice(extra);
    let (ok, _, err) = l.pf(0, &args);
    assert!(ok, "guest start {name}: {err}");
}

/// Start `cmd` with its stdout piped and wait for its `listening ADDR`
/// line (what `pagefleet blockdev serve` and pagefleetd print when ready).
pub fn spawn_listening(cmd: &mut std::process::Command) -> std::process::Child {
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().expect("piped stdout")),
        &mut line,
    )
    .expect("read its first line");
    assert!(line.starts_with("listening"), "it said {line:?}");
    child
}

/// Poll `f` every 200 ms until it holds; panic after `secs` naming `what`.
pub fn wait_for(what: &str, secs: u64, mut f: impl FnMut() -> bool) {
    let t = std::time::Instant::now();
    while !f() {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(secs),
            "timed out after {secs} s waiting for {what}"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

/// Send `sig` to every process of lab host `h` whose command line contains
/// `pattern` (0: none, only see whether one lives); whether there was one.
pub fn signal_in(l: &LabRun, h: usize, pattern: &str, sig: i32) -> bool {
    let out = std::process::Command::new("ip")
        .args(["netns", "pids", &l.lab.hosts[h].netns])
        .output()
        .expect("ip netns pids");
    let mut hit = false;
    for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
        let cmd = std::fs::read_to_string(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if let (true, Ok(pid)) = (cmd.contains(pattern), pid.parse::<i32>()) {
            let _ = pagefleet_common::sys::process::signal(pid, sig);
            hit = true;
        }
    }
    hit
}

/// SIGKILL every process of lab host `h` whose command line contains
/// `pattern`; whether there was one.
pub fn kill_in(l: &LabRun, h: usize, pattern: &str) -> bool {
    signal_in(l, h, pattern, libc::SIGKILL)
}

/// A guest's status from its runner's control socket (None: it did not answer).
pub fn guest_status(path: &std::path::Path) -> Option<pagefleet_api::GuestStatus> {
    pagefleet_common::control::call(
        path,
        &pagefleet_api::ControlRequest::Status,
        std::time::Duration::from_secs(5),
    )
    .ok()
}

pub use pagefleet_lab::is_root;

/// The VM guest image (kernel + initramfs running vmwork), built by
/// `crates/systest/vm/build.sh` into `target/vm` (`make test` builds it;
/// rebuilt here if missing or older than its sources): (vmlinuz, initrd.gz).
pub fn vm_image() -> (PathBuf, PathBuf) {
    let dir = bin("pagefleet")
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("vm");
    // Tests of one binary run as threads: one builds, the others wait for it
    // (two builds would race on the image's temporary files).
    static BUILD: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = BUILD.lock().unwrap_or_else(|e| e.into_inner());
    // build.sh returns at once when the image is newer than its sources.
    {
        let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("vm/build.sh");
        let st = std::process::Command::new(script)
            .arg(&dir)
            .status()
            .expect("run vm/build.sh");
        assert!(st.success(), "building the VM image failed");
    }
    (dir.join("vmlinuz"), dir.join("initrd.gz"))
}

/// The Debian VM image (`make vm`: target/vm/debian.qcow2, built here if
/// missing — a few minutes, once per machine).
pub fn debian_image() -> PathBuf {
    let (kernel, _) = vm_image();
    let dir = kernel.parent().unwrap().to_path_buf();
    static BUILD: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = BUILD.lock().unwrap_or_else(|e| e.into_inner());
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("vm/build-debian.sh");
    let st = std::process::Command::new(script)
        .arg(&dir)
        .status()
        .expect("run vm/build-debian.sh");
    assert!(st.success(), "building the Debian VM image failed");
    dir.join("debian.qcow2")
}

/// A writable copy of the Debian image for one test (a VM writes its root
/// file system), beside it (so hosts allow it), removed on drop.
pub fn debian_disk(tag: &str) -> pagefleet_lab::proc::TempCopy {
    pagefleet_lab::proc::TempCopy::of(&debian_image(), &format!("debian-{tag}"))
        .expect("copy the Debian image")
}

/// A native guest: `pagefleet run ARGS --servers <the cluster's>` as a child
/// process, its stderr in a file (read it when it fails), killed on drop.
pub struct GuestProc {
    /// The `pagefleet run` process (its stdout piped).
    pub child: std::process::Child,
    /// Where its stderr goes.
    pub stderr_path: PathBuf,
}

impl GuestProc {
    /// Start `pagefleet run ARGS` against every server of `c`.
    pub fn start(c: &Cluster, args: &[&str], dir: &std::path::Path) -> GuestProc {
        let stderr_path = dir.join(format!("guest-{}.err", pagefleet_proto::auth::random_u64()));
        let child = std::process::Command::new(bin("pagefleet"))
            .arg("--secret-file")
            .arg(&c.secret_file)
            .arg("run")
            .args(args)
            .arg("--servers")
            .arg(c.addrs().join(","))
            .stdout(std::process::Stdio::piped())
            .stderr(std::fs::File::create(&stderr_path).unwrap())
            .spawn()
            .expect("spawn pagefleet run");
        GuestProc { child, stderr_path }
    }

    /// Its exit status once it exits within `limit`; None if it still runs.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let t = std::time::Instant::now();
        while t.elapsed() < limit {
            if let Some(s) = self.child.try_wait().unwrap() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    /// What it wrote to stderr so far.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }
}

impl Drop for GuestProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A reply to [`http_in`]: status, head (lines), body.
pub use pagefleet_lab::rawhttp::Reply as RawReply;

/// One request without a body from inside lab host `h`'s namespace to
/// `addr`, as a browser or an outside client would send it (no signature
/// unless `headers` carries one); the whole reply, read by its length or
/// until the server closes (at most `timeout`: what a stream sent by then).
pub fn http_in(
    l: &LabRun,
    h: usize,
    addr: &str,
    (method, path): (&str, &str),
    headers: &[(&str, &str)],
    timeout: Duration,
) -> Result<RawReply, String> {
    let (addr, method, path) = (addr.to_string(), method.to_string(), path.to_string());
    let headers: Vec<(String, String)> = headers
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    l.lab
        .spawn_in(h, move || {
            let hs: Vec<(&str, &str)> = headers
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            let req = pagefleet_lab::rawhttp::Request {
                method: &method,
                path: &path,
                headers: &hs,
                body: &[],
            };
            pagefleet_lab::rawhttp::exchange(&addr, &req, timeout)
        })
        .join()
        .map_err(|_| "the request thread panicked".to_string())?
        .map_err(|e| e.to_string())?
}

/// What `promtool check metrics` (Debian's `prometheus` package, which
/// `make deps` installs) says about an exposition: empty when nothing.
pub fn promtool_check_metrics(text: &str) -> String {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let mut c = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian's prometheus package: make deps installs it)");
    c.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let o = c.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    if o.status.success() {
        said
    } else {
        format!("exit {}: {said}", o.status)
    }
}
