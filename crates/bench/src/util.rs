//! Shared benchmark plumbing: child daemons, percentiles, goals, plots.

use anyhow::{anyhow, bail, Context, Result};
use serde::Serialize;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One target an issue states, evaluated on this run's measurements.
#[derive(Clone, Debug, Serialize)]
pub struct Goal {
    pub name: String,
    pub value: f64,
    pub target: f64,
    pub unit: String,
    /// ">=" or "<=": how value must compare to target.
    pub cmp: &'static str,
    pub met: bool,
}

impl Goal {
    pub fn at_least(name: &str, value: f64, target: f64, unit: &str) -> Goal {
        Goal {
            name: name.into(),
            value,
            target,
            unit: unit.into(),
            cmp: ">=",
            met: value >= target,
        }
    }
    pub fn at_most(name: &str, value: f64, target: f64, unit: &str) -> Goal {
        Goal {
            name: name.into(),
            value,
            target,
            unit: unit.into(),
            cmp: "<=",
            met: value <= target,
        }
    }
}

pub fn print_goals(goals: &[Goal], out: &mut dyn std::io::Write) -> std::io::Result<()> {
    writeln!(out, "\nGoals (from this run):")?;
    for g in goals {
        writeln!(
            out,
            "  [{}] {:<34} {:>10.3} {} {} {:.3} {}",
            if g.met { "met" } else { "NOT MET" },
            g.name,
            g.value,
            g.unit,
            g.cmp,
            g.target,
            g.unit
        )?;
    }
    Ok(())
}

/// p-th percentile (0..=100) of samples (sorted in place).
pub fn percentile(samples: &mut [f64], p: f64) -> f64 {
    if samples.is_empty() {
        return f64::NAN;
    }
    samples.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let idx = ((p / 100.0) * (samples.len() - 1) as f64).round() as usize;
    samples[idx.min(samples.len() - 1)]
}

pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    percentile(&mut s, 50.0)
}

/// A child pagefleetd on loopback, killed on drop.
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
        let mut child = Command::new(bin)
            .args([
                "--lend",
                &lend_bytes.to_string(),
                "--listen",
                "127.0.0.1:0",
                "--metrics",
                "off",
                "--log",
                "error",
            ])
            .arg("--secret-file")
            .arg(secret_path)
            .env_remove("PAGEFLEET_SECRET")
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

/// Find a Python with matplotlib: $PAGEFLEET_PYTHON, the repository's
/// .venv (made by `make`), then python3.
pub fn python() -> Option<PathBuf> {
    let mut cands = Vec::new();
    if let Some(p) = std::env::var_os("PAGEFLEET_PYTHON") {
        cands.push(PathBuf::from(p));
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    cands.push(repo.join(".venv/bin/python3"));
    if let Ok(exe) = std::env::current_exe() {
        // target/release/pagefleet -> repo/.venv
        if let Some(r) = exe
            .parent()
            .and_then(|p| p.parent())
            .and_then(|p| p.parent())
        {
            cands.push(r.join(".venv/bin/python3"));
        }
    }
    cands.push(PathBuf::from("python3"));
    cands.into_iter().find(|p| {
        Command::new(p)
            .args(["-c", "import matplotlib"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}

/// Where a benchmark's PNG went, or why it was not written (top-level
/// `plot` / `plot_error` in the JSON).
#[derive(Debug, Default, Serialize)]
pub struct PlotOutcome {
    pub plot: Option<String>,
    pub plot_error: Option<String>,
}

impl PlotOutcome {
    pub fn print(&self, out: &mut dyn std::io::Write) -> std::io::Result<()> {
        match (&self.plot, &self.plot_error) {
            (Some(p), _) => writeln!(out, "\nPlot: {p}"),
            (None, Some(e)) => writeln!(out, "\nPlot not written: {e}"),
            _ => Ok(()),
        }
    }
}

/// Write `DIR/NAME.json`, render `DIR/NAME.png` with the embedded plot
/// script, record the outcome in the report and write the JSON again.
pub fn save_with_plot<R: Serialize>(
    report: &mut R,
    outcome: fn(&mut R) -> &mut PlotOutcome,
    dir: &Path,
    name: &str,
    script: &str,
) -> Result<()> {
    let json_path = dir.join(format!("{name}.json"));
    std::fs::write(&json_path, serde_json::to_vec_pretty(report)?)?;
    let o = match plot(
        &format!("plot_{name}.py"),
        script,
        &json_path,
        &dir.join(format!("{name}.png")),
    ) {
        Ok(p) => PlotOutcome {
            plot: Some(p.display().to_string()),
            plot_error: None,
        },
        Err(e) => PlotOutcome {
            plot: None,
            plot_error: Some(format!("{e:#}")),
        },
    };
    *outcome(report) = o;
    std::fs::write(&json_path, serde_json::to_vec_pretty(report)?)?;
    Ok(())
}

/// Run an embedded plot script on a results JSON file; returns the PNG path.
pub fn plot(script_name: &str, script: &str, json_path: &Path, png: &Path) -> Result<PathBuf> {
    let py = python().ok_or_else(|| {
        anyhow!("no Python with matplotlib found (run `make deps`, or set PAGEFLEET_PYTHON); results are in {}", json_path.display())
    })?;
    let dir = json_path.parent().unwrap();
    let sp = dir.join(script_name);
    std::fs::write(&sp, script)?;
    let out = Command::new(&py)
        .arg(&sp)
        .arg(json_path)
        .arg(png)
        .output()?;
    if !out.status.success() {
        bail!(
            "plot script failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(png.to_path_buf())
}

pub fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

/// Pins the calling thread to CPU 0 and the given server processes (all
/// their threads) to CPU 1 while alive; undone on drop. A no-op on one CPU.
pub struct Pinning {
    pids: Vec<u32>,
    active: bool,
}

/// CPUs online (not the calling thread's affinity mask, which pinning changes).
pub fn ncpus() -> usize {
    // SAFETY: sysconf has no preconditions.
    (unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }).max(1) as usize
}

pub fn set_affinity(tid: i32, cpus: &[usize]) {
    // SAFETY: cpu_set_t is plain data; sched_setaffinity reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for c in cpus {
            libc::CPU_SET(*c, &mut set);
        }
        libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

pub fn set_process_affinity(pid: u32, cpus: &[usize]) {
    if let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in rd.flatten() {
            if let Some(tid) = t.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) {
                set_affinity(tid, cpus);
            }
        }
    }
}

impl Pinning {
    pub fn split(server_pids: &[u32]) -> Pinning {
        let active = ncpus() >= 2;
        if active {
            set_affinity(0, &[0]);
            for p in server_pids {
                set_process_affinity(*p, &[1]);
            }
        }
        Pinning {
            pids: server_pids.to_vec(),
            active,
        }
    }
    /// Pin threads a server created since (its new connection thread).
    pub fn repin(pid: u32) {
        if ncpus() >= 2 {
            set_process_affinity(pid, &[1]);
        }
    }
}

impl Drop for Pinning {
    fn drop(&mut self) {
        if self.active {
            let all: Vec<usize> = (0..ncpus()).collect();
            set_affinity(0, &all);
            for p in &self.pids {
                set_process_affinity(*p, &all);
            }
        }
    }
}

/// Swap the kernel can use: a swap file, or zram; switched off and removed on drop.
pub struct Swap {
    dev: PathBuf,
    file: bool,
}

impl Swap {
    pub fn file(size: u64) -> Result<Swap> {
        let p = PathBuf::from(format!(
            "/var/tmp/pagefleet-bench-swap-{}",
            std::process::id()
        ));
        let ok = Command::new("fallocate")
            .arg("-l")
            .arg(size.to_string())
            .arg(&p)
            .status()?
            .success()
            && std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o600))
                .is_ok()
            && Command::new("mkswap")
                .arg(&p)
                .stdout(Stdio::null())
                .status()?
                .success();
        let s = Swap {
            dev: p.clone(),
            file: true,
        };
        if !ok || !Command::new("swapon").arg(&p).status()?.success() {
            bail!(
                "cannot set up swap file {} (needs root and mkswap/swapon)",
                p.display()
            );
        }
        Ok(s)
    }
    pub fn zram(size: u64) -> Result<Swap> {
        let dev = PathBuf::from("/dev/zram0");
        if !dev.exists() {
            bail!("no /dev/zram0 on this machine");
        }
        let _ = std::fs::write("/sys/block/zram0/reset", "1");
        std::fs::write("/sys/block/zram0/disksize", size.to_string()).context("zram disksize")?;
        let s = Swap {
            dev: dev.clone(),
            file: false,
        };
        if !Command::new("mkswap")
            .arg(&dev)
            .stdout(Stdio::null())
            .status()?
            .success()
            || !Command::new("swapon")
                .args(["-p", "100"])
                .arg(&dev)
                .status()?
                .success()
        {
            bail!("cannot enable zram swap");
        }
        Ok(s)
    }
}

impl Drop for Swap {
    fn drop(&mut self) {
        let _ = Command::new("swapoff").arg(&self.dev).status();
        if self.file {
            let _ = std::fs::remove_file(&self.dev);
        } else {
            let _ = std::fs::write("/sys/block/zram0/reset", "1");
        }
    }
}

/// A cgroup v1 memory group; removed on drop (after its processes are gone).
pub struct MemCgroup {
    pub path: PathBuf,
}

impl MemCgroup {
    pub fn new(limit: u64) -> Result<MemCgroup> {
        let path = PathBuf::from(format!(
            "/sys/fs/cgroup/memory/pagefleet-bench-{}-{}",
            std::process::id(),
            pagefleet_proto::auth::random_u64() & 0xffff
        ));
        std::fs::create_dir_all(&path).context("cgroup v1 memory controller not available")?;
        let g = MemCgroup { path };
        std::fs::write(g.path.join("memory.limit_in_bytes"), limit.to_string())?;
        let _ = std::fs::write(g.path.join("memory.swappiness"), "60");
        Ok(g)
    }
}

impl Drop for MemCgroup {
    fn drop(&mut self) {
        for _ in 0..50 {
            if std::fs::remove_dir(&self.path).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
