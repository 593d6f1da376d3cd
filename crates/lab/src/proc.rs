//! Child processes and the machine's binaries: pagefleetd children killed on
//! drop, sibling binaries, free ports, temporary directories.

use anyhow::{anyhow, bail, Context, Result};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Let the child `cmd` starts die with the thread that starts it
/// (`PR_SET_PDEATHSIG`): a test or bench that is interrupted (Ctrl-C, a
/// kill, a panic that aborts) leaves no daemon or guest behind, which
/// `Drop` alone cannot promise. Start such children from a thread that
/// outlives them (the kernel signals when the forking *thread* exits).
pub fn die_with_parent(cmd: &mut Command) {
    pagefleet_common::sys::process::die_with_parent(cmd)
}

/// A child pagefleetd on loopback, killed on drop (and with its parent).
pub struct ChildDaemon {
    pub child: Child,
    pub addr: String,
    pub secret_path: PathBuf,
}

impl ChildDaemon {
    pub fn start(lend_bytes: u64, secret_path: &Path) -> Result<ChildDaemon> {
        Self::start_bin(&sibling_binary("pagefleetd")?, lend_bytes, secret_path)
    }

    /// Start a given pagefleetd binary (tests pass the one cargo built).
    pub fn start_bin(bin: &Path, lend_bytes: u64, secret_path: &Path) -> Result<ChildDaemon> {
        Self::start_bin_args(bin, lend_bytes, secret_path, &[])
    }

    /// [`ChildDaemon::start`] with more pagefleetd flags (e.g. `--tls-dir`).
    pub fn start_args(
        lend_bytes: u64,
        secret_path: &Path,
        extra: &[&std::ffi::OsStr],
    ) -> Result<ChildDaemon> {
        Self::start_bin_args(
            &sibling_binary("pagefleetd")?,
            lend_bytes,
            secret_path,
            extra,
        )
    }

    /// A given pagefleetd binary with more flags.
    pub fn start_bin_args(
        bin: &Path,
        lend_bytes: u64,
        secret_path: &Path,
        extra: &[&std::ffi::OsStr],
    ) -> Result<ChildDaemon> {
        Self::start_bin_at(bin, lend_bytes, secret_path, "127.0.0.1:0", extra)
    }

    /// A given pagefleetd binary listening at `listen` (e.g. where a killed
    /// one listened: a restart).
    pub fn start_bin_at(
        bin: &Path,
        lend_bytes: u64,
        secret_path: &Path,
        listen: &str,
        extra: &[&std::ffi::OsStr],
    ) -> Result<ChildDaemon> {
        let mut cmd = Command::new(bin);
        die_with_parent(&mut cmd);
        let mut child = cmd
            .args([
                "--lend",
                &lend_bytes.to_string(),
                "--listen",
                listen,
                "--metrics",
                "off",
                "--log",
                "error",
            ])
            .arg("--secret-file")
            .arg(secret_path)
            .args(extra)
            .env_remove("PAGEFLEET_SECRET")
            .env_remove("PAGEFLEET_TLS_DIR")
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot start {}", bin.display()))?;
        let line = BufReader::new(child.stdout.take().unwrap())
            .lines()
            .next()
            .ok_or_else(|| anyhow!("pagefleetd exited before listening"))??;
        let addr = line
            .strip_prefix("listening ")
            .ok_or_else(|| anyhow!("unexpected pagefleetd output {line:?}"))?
            .to_string();
        Ok(ChildDaemon {
            child,
            addr,
            secret_path: secret_path.to_path_buf(),
        })
    }
    pub fn rss_bytes(&self) -> Result<u64> {
        rss_of(self.child.id())
    }

    /// Kill the daemon now (a dead peer for failure tests).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ChildDaemon {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The numeric fields of `/proc/PID/stat` after the command name, from the
/// state on (field 3 of proc(5) is index 0 here); empty when gone.
fn stat_fields(pid: u32) -> Vec<String> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The command name (which may hold spaces) ends with the last ')'.
    let rest = s.rsplit_once(')').map_or("", |x| x.1);
    rest.split_whitespace().map(str::to_string).collect()
}

/// Field `n` of proc(5)'s `/proc/PID/stat` (1-based, n >= 3) as a number (0 when gone).
fn stat_field(f: &[String], n: usize) -> u64 {
    f.get(n - 3).and_then(|x| x.parse().ok()).unwrap_or(0)
}

/// CPU seconds (user + system) process `pid` has used so far (0 when gone).
pub fn cpu_secs(pid: u32) -> f64 {
    let f = stat_fields(pid);
    let hz = pagefleet_common::sys::process::clock_ticks() as f64;
    (stat_field(&f, 14) + stat_field(&f, 15)) as f64 / hz
}

/// Page faults process `pid` has taken without I/O so far (minflt: minor
/// faults the kernel resolved, userfaultfd faults included; 0 when gone).
pub fn minor_faults(pid: u32) -> u64 {
    stat_field(&stat_fields(pid), 10)
}

pub fn rss_of(pid: u32) -> Result<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let l = s
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .ok_or_else(|| anyhow!("no VmRSS"))?;
    Ok(l.split_whitespace().nth(1).unwrap_or("0").parse::<u64>()? * 1024)
}

/// A binary installed next to the running one (cargo puts all of a
/// workspace's binaries in the same directory).
pub fn sibling_binary(name: &str) -> Result<PathBuf> {
    let me = std::env::current_exe()?;
    let p = me.parent().unwrap().join(name);
    if p.exists() {
        return Ok(p);
    }
    if let Ok(p) = which(name) {
        return Ok(p);
    }
    bail!(
        "cannot find {name} next to {} or on PATH; build it with `cargo build --release`",
        me.display()
    )
}

pub fn which(name: &str) -> Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    for d in
        std::env::split_paths(&path).chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/bin")])
    {
        let p = d.join(name);
        if p.is_file() {
            return Ok(p);
        }
    }
    bail!("{name} not found on PATH")
}

/// A free loopback TCP port (bound then released).
pub fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Wait until something accepts connections at addr.
pub fn wait_listening(addr: &str, timeout: Duration) -> Result<()> {
    let t = Instant::now();
    while t.elapsed() < timeout {
        if std::net::TcpStream::connect(addr).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    bail!("nothing listening on {addr} after {timeout:?}")
}

pub fn temp_dir(tag: &str) -> Result<PathBuf> {
    let d = std::env::temp_dir().join(format!("pagefleet-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d)?;
    Ok(d)
}

/// A uniquely named scratch directory under the temp dir, removed with its
/// contents on drop (also when a test fails); `keep` hands its path over
/// for an owner that removes it itself.
pub struct TempDir(PathBuf);

impl TempDir {
    /// `pagefleet-PREFIX-PID-RANDOM`, created now.
    pub fn new(prefix: &str) -> TempDir {
        let d = std::env::temp_dir().join(format!(
            "pagefleet-{prefix}-{}-{}",
            std::process::id(),
            pagefleet_proto::auth::random_u64()
        ));
        std::fs::create_dir_all(&d)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", d.display()));
        TempDir(d)
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        &self.0
    }

    /// Keep the directory; the caller removes it.
    pub fn keep(self) -> PathBuf {
        let me = std::mem::ManuallyDrop::new(self);
        me.0.clone()
    }
}

impl std::ops::Deref for TempDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for TempDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<std::ffi::OsStr> for TempDir {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.0.as_os_str()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A connect flood on `addr` from a thread of its own: new connections as
/// fast as one thread can open them, each held until `hold` newer ones are
/// open, until `stop` is set, `limit` elapses or `max` connections were
/// made. The thread's result is the number made.
pub fn connect_flood(
    addr: String,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    hold: usize,
    limit: Duration,
    max: u64,
) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let mut open = std::collections::VecDeque::new();
        let mut made = 0u64;
        let t = Instant::now();
        while !stop.load(std::sync::atomic::Ordering::Relaxed) && t.elapsed() < limit && made < max
        {
            if let Ok(s) = std::net::TcpStream::connect(&addr) {
                made += 1;
                open.push_back(s);
                if open.len() > hold {
                    open.pop_front();
                }
            }
        }
        made
    })
}

/// A process stopped with SIGSTOP (a hung peer in a drill), resumed with
/// SIGCONT however the drill ends.
pub struct Stopped(i32);

impl Stopped {
    /// Stop process `pid` (a child of the caller's).
    pub fn stop(pid: u32) -> Stopped {
        let _ = pagefleet_common::sys::process::signal(pid as i32, libc::SIGSTOP);
        Stopped(pid as i32)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        let _ = pagefleet_common::sys::process::signal(self.0, libc::SIGCONT);
    }
}

/// A copy of a file beside it, named `TAG.<ext>`-style (`bench-TAG.qcow2`
/// for `debian.qcow2`), removed on drop: a VM's writable disk made from
/// the image `make vm` built (the guest writes its root file system; the
/// copy stays in the image directory, which hosts allow).
pub struct TempCopy(pub PathBuf);

impl TempCopy {
    /// Copy `src` to `TAG.EXT` in its directory.
    pub fn of(src: &Path, tag: &str) -> Result<TempCopy> {
        let ext = src
            .extension()
            .map(|e| format!(".{}", e.to_string_lossy()))
            .unwrap_or_default();
        let dst = src.with_file_name(format!("{tag}{ext}"));
        std::fs::copy(src, &dst)
            .with_context(|| format!("copying {} to {}", src.display(), dst.display()))?;
        Ok(TempCopy(dst))
    }

    /// Its path as text (paths here are UTF-8: they come from ours).
    pub fn path(&self) -> &str {
        self.0.to_str().unwrap_or_default()
    }
}

impl Drop for TempCopy {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[cfg(test)]
mod stat_tests {
    use super::*;

    #[test]
    fn minor_faults_count_first_touches_and_cpu_time_grows() {
        let me = std::process::id();
        let (f0, c0) = (minor_faults(me), cpu_secs(me));
        // 16 MiB of fresh pages: each first touch is a minor fault.
        let mut v = vec![0u8; 16 << 20];
        for i in (0..v.len()).step_by(4096) {
            v[i] = 1;
        }
        std::hint::black_box(&v);
        let mut x = 0u64;
        let t = std::time::Instant::now();
        while t.elapsed() < std::time::Duration::from_millis(50) {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        }
        std::hint::black_box(x);
        assert!(
            minor_faults(me) >= f0 + 1000,
            "{f0} -> {}",
            minor_faults(me)
        );
        assert!(cpu_secs(me) > c0, "{c0} -> {}", cpu_secs(me));
        assert_eq!((minor_faults(u32::MAX), cpu_secs(u32::MAX)), (0, 0.0));
    }
}
