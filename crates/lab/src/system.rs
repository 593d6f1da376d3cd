//! The machine under a benchmark: CPU pinning, swap (file or zram),
//! memory cgroups — each undone on drop.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// Pins the calling thread to CPU 0 and the given server processes (all
/// their threads) to CPU 1 while alive; undone on drop. A no-op on one CPU.
pub struct Pinning {
    pids: Vec<u32>,
    active: bool,
}

/// CPUs online (not the calling thread's affinity mask, which pinning changes).
pub fn ncpus() -> usize {
    pagefleet_common::sys::process::online_cpus()
}

pub fn set_affinity(tid: i32, cpus: &[usize]) {
    let _ = pagefleet_common::sys::process::set_affinity(tid, cpus);
}

pub fn set_process_affinity(pid: u32, cpus: &[usize]) {
    for_each_thread(pid, |tid, _| set_affinity(tid, cpus));
}

/// Pin the threads of process `pid` named `comm` (as /proc shows it).
pub fn set_thread_affinity_by_name(pid: u32, comm: &str, cpus: &[usize]) {
    for_each_thread(pid, |tid, dir| {
        let named = std::fs::read_to_string(dir.join("comm")).is_ok_and(|c| c.trim_end() == comm);
        if named {
            set_affinity(tid, cpus);
        }
    });
}

/// Busy (non-idle, non-iowait) jiffies and total jiffies per CPU, from
/// `/proc/stat`; two readings give each CPU's busy share in between.
pub fn cpu_times() -> Vec<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    stat.lines()
        .filter(|l| l.starts_with("cpu") && l.as_bytes().get(3).is_some_and(u8::is_ascii_digit))
        .map(|l| {
            let v: Vec<u64> = l
                .split_whitespace()
                .skip(1)
                .filter_map(|x| x.parse().ok())
                .collect();
            let total: u64 = v.iter().take(8).sum();
            let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
            (total - idle, total)
        })
        .collect()
}

/// Each CPU's busy share between two `cpu_times` readings (0..1).
pub fn cpu_busy(before: &[(u64, u64)], after: &[(u64, u64)]) -> Vec<f64> {
    before
        .iter()
        .zip(after)
        .map(|(b, a)| {
            let total = a.1.saturating_sub(b.1);
            if total == 0 {
                0.0
            } else {
                a.0.saturating_sub(b.0) as f64 / total as f64
            }
        })
        .collect()
}

/// Call `f(tid, /proc/PID/task/TID)` for every thread of process `pid`.
fn for_each_thread(pid: u32, mut f: impl FnMut(i32, &std::path::Path)) {
    if let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in rd.flatten() {
            if let Some(tid) = t.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) {
                f(tid, &t.path());
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

/// Where a bench's swap file lives (one per bench process).
const SWAP_FILE_PREFIX: &str = "/var/tmp/pagefleet-bench-swap-";
/// Where a bench's memory cgroups live (`PID-RANDOM`).
const CGROUP_PREFIX: &str = "/sys/fs/cgroup/memory/pagefleet-bench-";

/// Whether the bench whose pid a leftover's name starts with is gone.
fn owner_gone(rest: &str) -> bool {
    rest.split('-')
        .next()
        .and_then(|p| p.parse::<u32>().ok())
        .is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists())
}

/// Switch off and remove the swap files and memory cgroups that benches
/// killed before their cleanup left behind (their pid no longer runs):
/// a crashed run must not shrink the next one's memory or fail its checks.
pub fn sweep_leftovers() {
    sweep_ssd_swaps();
    let swaps = std::fs::read_to_string("/proc/swaps").unwrap_or_default();
    for f in swaps.lines().filter_map(|l| l.split_whitespace().next()) {
        if f.strip_prefix(SWAP_FILE_PREFIX).is_some_and(owner_gone) {
            eprintln!("switching off {f}, left by a bench that is gone");
            let _ = Command::new("swapoff").arg(f).status();
        }
    }
    if let Ok(d) = std::fs::read_dir("/var/tmp") {
        for e in d.flatten() {
            let p = e.path();
            let name = p.to_string_lossy().into_owned();
            if name.strip_prefix(SWAP_FILE_PREFIX).is_some_and(owner_gone) && !swaps.contains(&name)
            {
                let _ = std::fs::remove_file(&p);
            }
        }
    }
    let (parent, stem) = CGROUP_PREFIX.rsplit_once('/').expect("a path");
    if let Ok(d) = std::fs::read_dir(parent) {
        for e in d.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.strip_prefix(stem).is_some_and(owner_gone) {
                // Fails (and is left) while processes still run in it.
                let _ = std::fs::remove_dir(e.path());
            }
        }
    }
}

/// Where a bench's SSD-like swap lives (`util::SsdSwap`): a loop device over
/// a file on a FIFO disk its process served.
const SSD_SWAP_PREFIX: &str = "/tmp/pagefleet-bench-ssd-swap-";

/// A swap device over an SSD-like disk whose bench died is worse than none:
/// its disk's server is gone, so every page sent there fails and the
/// kernel kills instead of swapping. Switch it off, detach the loop device,
/// unmount the disk.
fn sweep_ssd_swaps() {
    let swaps = std::fs::read_to_string("/proc/swaps").unwrap_or_default();
    for dev in swaps.lines().filter_map(|l| l.split_whitespace().next()) {
        let Some(loop_name) = dev.strip_prefix("/dev/") else {
            continue;
        };
        let backing = std::fs::read_to_string(format!("/sys/block/{loop_name}/loop/backing_file"))
            .unwrap_or_default();
        let Some(rest) = backing.trim().strip_prefix(SSD_SWAP_PREFIX) else {
            continue;
        };
        if !owner_gone(rest) {
            continue;
        }
        eprintln!(
            "switching off {dev} (over {}), left by a bench that is gone",
            backing.trim()
        );
        let _ = Command::new("swapoff").arg(dev).status();
        let _ = Command::new("losetup").args(["-d", dev]).status();
        if let Some(dir) = rest.split('/').next() {
            let root = format!("{SSD_SWAP_PREFIX}{dir}");
            let _ = Command::new("umount")
                .args(["-l", &format!("{root}/mnt")])
                .status();
            let _ = std::fs::remove_dir_all(&root);
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
        sweep_leftovers();
        let p = PathBuf::from(format!("{SWAP_FILE_PREFIX}{}", std::process::id()));
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
    /// Swap on a block device the caller owns (made a swap area here; only
    /// switched off on drop).
    pub fn device(dev: &Path) -> Result<Swap> {
        let s = Swap {
            dev: dev.to_path_buf(),
            file: false,
        };
        if !Command::new("mkswap")
            .arg(dev)
            .stdout(Stdio::null())
            .status()?
            .success()
            || !Command::new("swapon")
                .args(["-p", "100"])
                .arg(dev)
                .status()?
                .success()
        {
            bail!("cannot enable swap on {}", dev.display());
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
        // swapoff reads every page back into its owner's memory; a process
        // that is still exiting (its cgroup at its limit) can make it fail
        // for a moment. Retried while the swap is still on, for up to 10 s:
        // a swap left on over a device torn down next (a loop over a FUSE
        // disk) makes the kernel OOM-kill instead of swapping afterwards.
        let on = |dev: &Path| {
            std::fs::read_to_string("/proc/swaps")
                .unwrap_or_default()
                .lines()
                .any(|l| l.split_whitespace().next() == dev.to_str())
        };
        for _ in 0..100 {
            let _ = Command::new("swapoff").arg(&self.dev).status();
            if !on(&self.dev) {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        if self.file {
            let _ = std::fs::remove_file(&self.dev);
        } else if self.dev == Path::new("/dev/zram0") {
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
        sweep_leftovers();
        let path = PathBuf::from(format!(
            "{CGROUP_PREFIX}{}-{}",
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

/// Let this process hold at least `n` file descriptors (up to the hard limit).
pub fn allow_fds(n: u64) {
    pagefleet_common::sys::fds::raise_fd_limit(n);
}
