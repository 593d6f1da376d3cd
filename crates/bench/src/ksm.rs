//! `pagefleet bench ksm` (paper 001): N key-value tenants holding the same
//! dataset plus private data, under host memory pressure, each with a
//! throughput client; in one run each, KSM off / the kernel's defaults /
//! Debian's real ksmtuned at x1/2, x1, x2 its interval / the kernel's
//! scan-time advisor / pagefleet's adaptive controller: memory saved over
//! time, ksmd's CPU, tenant throughput.

use crate::kvload::{self, Spec};
use crate::util::{self, Goal, PlotOutcome};
use anyhow::{anyhow, bail, Context, Result};
use pagefleet_ksm::sysfs::{self, Memory, Settings, Stats};
use serde::Serialize;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

#[derive(Clone, Debug, Serialize)]
pub struct Opts {
    pub tenants: usize,
    /// Each tenant's memory.
    pub tenant_bytes: u64,
    /// Share of a tenant's memory filled with the common dataset, and with private data.
    pub shared_frac: f64,
    pub private_frac: f64,
    pub value_len: usize,
    /// Seconds each configuration runs (after loading).
    pub duration_s: u64,
    /// ksmtuned's monitor interval before scaling (60 s in the script).
    pub ksmtuned_base_s: f64,
    /// MemAvailable the balloon leaves with the tenants loaded, share of
    /// MemTotal (ksmtuned acts below 20%).
    pub leave_available: f64,
    /// A swap file of this size (None: no swap, nothing ever pages). With
    /// it the tenants share one memory cgroup (as guests share a host's
    /// machine slice) that keeps `fit` of the memory they use unmerged in
    /// RAM: the rest pages until merging makes room.
    pub swap: Option<u64>,
    pub fit: f64,
    /// The clients' key distribution (zipf; 0 = uniform, so every tenant's
    /// whole common dataset is its working set).
    pub theta: f64,
    pub only: Option<String>,
    /// Each tenant's client: operations per second (None: a closed loop,
    /// which keeps both CPUs busy).
    pub pace: Option<f64>,
    /// Rounds: every policy runs once per round, policies interleaved, each
    /// run from the same starting state (see `run_one`).
    pub rounds: usize,
    #[serde(skip)]
    pub out_dir: PathBuf,
}

impl Opts {
    pub fn full(out_dir: PathBuf) -> Opts {
        Opts {
            tenants: 4,
            tenant_bytes: 256 << 20,
            shared_frac: 0.6,
            private_frac: 0.15,
            value_len: 2000,
            // Long enough for the slowest policy to finish: under paging the
            // kernel's advisor (one pass per 200 s target, slower under
            // churn) merges from ~300 s to ~750 s; a shorter run stops it
            // before its work and its CPU are counted.
            duration_s: 900,
            ksmtuned_base_s: 60.0,
            leave_available: 0.15,
            swap: Some(2 << 30),
            fit: 0.6,
            theta: 0.0,
            only: None,
            pace: None,
            rounds: 3,
            out_dir,
        }
    }
    /// A smoke run: small tenants, short runs, ksmtuned's interval cut to 10 s.
    pub fn quick(out_dir: PathBuf) -> Opts {
        Opts {
            tenants: 2,
            tenant_bytes: 96 << 20,
            duration_s: 40,
            ksmtuned_base_s: 10.0,
            swap: Some(512 << 20),
            // Small tenants are mostly code and heap: a gentler squeeze, or
            // the cgroup runs out of memory it can reclaim (OOM kill).
            fit: 0.9,
            rounds: 1,
            ..Opts::full(out_dir)
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Sample {
    pub t: f64,
    pub saved_mib: f64,
    pub profit_mib: f64,
    pub ksmd_cpu_pct: f64,
    pub ops_per_s: f64,
    pub scan_rate: f64,
    pub full_scans: u64,
    /// Swap in use on the host, and major page faults per second.
    pub swap_mib: f64,
    pub majflt_per_s: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct ConfigResult {
    pub name: String,
    /// Which round (from 0) this run was part of.
    pub round: usize,
    /// Swap in use when the policy started (the starting state), MiB.
    pub start_swap_mib: f64,
    pub samples: Vec<Sample>,
    pub final_saved_mib: f64,
    pub final_profit_mib: f64,
    /// Seconds until 90% of the final saving (None: nothing saved).
    pub t90_s: Option<f64>,
    pub ksmd_cpu_mean_pct: f64,
    pub ksmd_cpu_s: f64,
    /// All tenants together, ops/s (mean over the run), and the slowest tenant's.
    pub throughput: f64,
    pub min_tenant_throughput: f64,
    /// Paced operations the clients dropped (over 100 ms behind).
    pub dropped_ops: u64,
    /// Major faults per second over the run, and swap in use at its end.
    pub majflt_per_s: f64,
    pub final_swap_mib: f64,
    pub error: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub opts: Opts,
    pub mem_total_mib: u64,
    pub balloon_mib: u64,
    /// The tenants' resident memory after loading, unmerged and unpressed.
    pub tenants_rss_mib: u64,
    /// The tenants' memory cgroup limit (with swap).
    pub limit_mib: Option<u64>,
    pub configs: Vec<ConfigResult>,
    pub goals: Vec<Goal>,
    #[serde(flatten)]
    pub plot: PlotOutcome,
}

/// One tenant: `pagefleet run kv --plain --merge` (enrolled from its start).
struct Tenant {
    child: Child,
    _out: BufReader<ChildStdout>,
    addr: String,
}

impl Tenant {
    fn start(size: u64) -> Result<Tenant> {
        let bin = util::sibling_binary("pagefleet")?;
        let mut child = Command::new(bin)
            .args([
                "run",
                "--merge",
                "kv",
                "--plain",
                // Sized to hold their data: no eviction, so reads never
                // write an item (an LRU bump would unmerge its page).
                "--no-evict",
                "--size",
                &size.to_string(),
                "--duration",
                "0",
                "--threads",
                "1",
                "--listen",
                "127.0.0.1:0",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("cannot start a kv tenant")?;
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line)?;
        let addr = line
            .trim()
            .strip_prefix("kv listening ")
            .ok_or_else(|| anyhow!("kv tenant said {line:?}"))?
            .to_string();
        Ok(Tenant {
            child,
            _out: out,
            addr,
        })
    }
}

impl Drop for Tenant {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Store items in one fixed order over one connection (so tenants holding
/// the same dataset lay it out byte for byte the same).
fn load(addr: &str, keys: impl Iterator<Item = (String, Vec<u8>)>) -> Result<()> {
    let mut st = TcpStream::connect(addr)?;
    st.set_nodelay(true)?;
    let mut r = BufReader::new(st.try_clone()?);
    let mut line = String::new();
    let mut keys = keys.peekable();
    while keys.peek().is_some() {
        let mut batch = Vec::new();
        let mut n = 0;
        for (k, v) in keys.by_ref().take(64) {
            batch.extend_from_slice(format!("set {k} 0 0 {}\r\n", v.len()).as_bytes());
            batch.extend_from_slice(&v);
            batch.extend_from_slice(b"\r\n");
            n += 1;
        }
        st.write_all(&batch)?;
        for _ in 0..n {
            line.clear();
            r.read_line(&mut line)?;
            if line != "STORED\r\n" {
                bail!("loading {addr}: {line:?}");
            }
        }
    }
    Ok(())
}

/// The KSM policies compared.
#[derive(Clone, Debug)]
enum Policy {
    Off,
    KernelDefaults,
    Ksmtuned(f64),
    Advisor,
    Adaptive,
}

impl Policy {
    fn name(&self) -> String {
        match self {
            Policy::Off => "KSM off".into(),
            Policy::KernelDefaults => "kernel defaults".into(),
            Policy::Ksmtuned(s) => format!("ksmtuned x{s}"),
            Policy::Advisor => "kernel advisor".into(),
            Policy::Adaptive => "pagefleet adaptive".into(),
        }
    }
}

/// ksmd updates its counters only while it runs: after the tenants of a run
/// exit, let it sweep their leftovers until the counters stop moving.
fn settle() -> Result<()> {
    sysfs::write("advisor_mode", "none").ok();
    sysfs::write("pages_to_scan", "20000")?;
    sysfs::write("sleep_millisecs", "10")?;
    sysfs::write("run", "1")?;
    let t = Instant::now();
    let mut last = (u64::MAX, u64::MAX);
    while t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(300));
        let now = (
            sysfs::read_u64("pages_sharing")?,
            sysfs::read_u64("full_scans")?,
        );
        if now.0 == last.0 && now.1 >= last.1 + 2 {
            break;
        }
        if now.0 != last.0 {
            last = now;
        }
    }
    Ok(sysfs::write("run", "0")?)
}

/// A clean slate between runs: stopped, kernel defaults.
fn reset_ksm() -> Result<()> {
    settle()?;
    sysfs::set_ksmd_nice(sysfs::KSMD_DEFAULT_NICE)?;
    sysfs::write("run", "0")?;
    let _ = sysfs::write("advisor_mode", "none");
    sysfs::write("pages_to_scan", "100")?;
    sysfs::write("sleep_millisecs", "20")?;
    let _ = sysfs::write("smart_scan", "1");
    Ok(())
}

/// What drives KSM during one run (a child process for ksmtuned and pagefleet).
struct Driver {
    child: Option<Child>,
    /// ksmtuned daemonises: its loop's process group.
    pgid: Option<i32>,
}

impl Driver {
    fn start(p: &Policy, o: &Opts, dir: &std::path::Path) -> Result<Driver> {
        match p {
            Policy::Off => Ok(Driver {
                child: None,
                pgid: None,
            }),
            Policy::KernelDefaults => {
                sysfs::write("run", "1")?;
                Ok(Driver {
                    child: None,
                    pgid: None,
                })
            }
            Policy::Advisor => {
                sysfs::write("advisor_mode", "scan-time")?;
                sysfs::write("run", "1")?;
                Ok(Driver {
                    child: None,
                    pgid: None,
                })
            }
            Policy::Ksmtuned(scale) => {
                let script = util::which("ksmtuned").or_else(|_| {
                    if std::path::Path::new("/usr/sbin/ksmtuned").exists() {
                        Ok(PathBuf::from("/usr/sbin/ksmtuned"))
                    } else {
                        Err(anyhow!(
                            "ksmtuned is not installed (apt-get install ksmtuned; make deps does)"
                        ))
                    }
                })?;
                let pidfile = dir.join("ksmtuned.pid");
                let _ = std::fs::remove_file(&pidfile);
                // The real script: it reads its variables from the environment
                // (after /etc/ksmtuned.conf, whose settings are commented out by default).
                let st = Command::new("setsid")
                    .arg(&script)
                    .env(
                        "KSM_MONITOR_INTERVAL",
                        format!("{}", (o.ksmtuned_base_s * scale).round() as u64),
                    )
                    .env("PIDFILE", &pidfile)
                    .env("DEBUG", "1")
                    .env("LOGFILE", dir.join(format!("ksmtuned-x{scale}.log")))
                    .status()
                    .context("cannot run ksmtuned")?;
                if !st.success() {
                    bail!("ksmtuned failed to start");
                }
                let t = Instant::now();
                let pid = loop {
                    if let Some(p) = std::fs::read_to_string(&pidfile)
                        .ok()
                        .and_then(|s| s.trim().parse::<i32>().ok())
                    {
                        break p;
                    }
                    if t.elapsed() > Duration::from_secs(5) {
                        bail!("ksmtuned wrote no pid file");
                    }
                    std::thread::sleep(Duration::from_millis(20));
                };
                let pgid = pagefleet_common::sys::process::process_group(pid);
                Ok(Driver {
                    child: None,
                    pgid: Some(pgid.unwrap_or(pid)),
                })
            }
            Policy::Adaptive => {
                let bin = util::sibling_binary("pagefleet")?;
                let child = Command::new(bin)
                    .args(["ksm", "run", "--state"])
                    .arg(dir.join("ksm-state.json"))
                    .env("PAGEFLEET_LOG", "info")
                    .stdout(Stdio::null())
                    .stderr(std::fs::File::create(dir.join("pagefleet-ksm.log"))?)
                    .spawn()
                    .context("cannot start pagefleet ksm run")?;
                Ok(Driver {
                    child: Some(child),
                    pgid: None,
                })
            }
        }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        if let Some(c) = &mut self.child {
            // SIGTERM: the controller puts the settings back itself.
            let _ = pagefleet_common::sys::process::signal(c.id() as i32, libc::SIGTERM);
            let t = Instant::now();
            while t.elapsed() < Duration::from_secs(10) {
                if c.try_wait().ok().flatten().is_some() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        if let Some(g) = self.pgid {
            let _ = pagefleet_common::sys::process::signal(-g, libc::SIGTERM);
        }
    }
}

/// Memory held (and touched) to put the host under pressure; freed on drop.
struct Balloon(#[allow(dead_code)] Option<pagefleet_common::sys::mapping::Mapping>);
impl Balloon {
    fn inflate(bytes: usize) -> Result<Balloon> {
        if bytes == 0 {
            return Ok(Balloon(None));
        }
        let m = pagefleet_common::sys::mapping::Mapping::anonymous(bytes, true).map_err(|e| {
            anyhow::anyhow!(
                "cannot hold {} of memory for the pressure balloon: {e}",
                crate::fmt_bytes(bytes as u64)
            )
        })?;
        Ok(Balloon(Some(m)))
    }
}

/// Start the tenants and load them: the common dataset, then private data.
/// Returns them and the number of common items.
fn loaded_tenants(o: &Opts, cg: Option<&util::MemCgroup>) -> Result<(Vec<Tenant>, u64)> {
    let tenants = (0..o.tenants)
        .map(|_| Tenant::start(o.tenant_bytes))
        .collect::<Result<Vec<_>>>()?;
    if let Some(cg) = cg {
        for t in &tenants {
            std::fs::write(cg.path.join("cgroup.procs"), t.child.id().to_string())
                .context("cannot move a tenant into its memory cgroup")?;
        }
    }
    // Item = 32 B header + key + value, in power-of-two classes.
    let item = (32 + 14 + o.value_len).next_power_of_two() as f64;
    let shared = (o.tenant_bytes as f64 * o.shared_frac / item) as u64;
    let private = (o.tenant_bytes as f64 * o.private_frac / item) as u64;
    let vlen = o.value_len;
    std::thread::scope(|s| -> Result<()> {
        let hs: Vec<_> = tenants
            .iter()
            .enumerate()
            .map(|(t, tn)| {
                let addr = tn.addr.clone();
                s.spawn(move || -> Result<()> {
                    load(
                        &addr,
                        (0..shared).map(|i| (kvload::key(i), kvload::value(i, vlen))),
                    )?;
                    load(
                        &addr,
                        (0..private).map(|i| {
                            (
                                format!("p{t:02}:{i:08}"),
                                kvload::value(i ^ ((t as u64 + 1) << 40), vlen),
                            )
                        }),
                    )
                })
            })
            .collect();
        hs.into_iter()
            .try_for_each(|h| h.join().map_err(|_| anyhow!("loader panicked"))?)
    })?;
    Ok((tenants, shared))
}

/// Resident memory of a process, bytes.
fn rss(pid: u32) -> Result<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|k| k << 10)
        .ok_or_else(|| anyhow!("no VmRSS for {pid}"))
}

/// Host-wide: swap in use (bytes) and major faults so far.
fn swap_and_majflt() -> (u64, u64) {
    let kb = |k: &str, s: &str| {
        s.lines()
            .find_map(|l| l.strip_prefix(k))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    let m = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let swap = kb("SwapTotal:", &m).saturating_sub(kb("SwapFree:", &m)) << 10;
    let v = std::fs::read_to_string("/proc/vmstat").unwrap_or_default();
    let maj = v
        .lines()
        .find_map(|l| l.strip_prefix("pgmajfault "))
        .and_then(|x| x.trim().parse().ok())
        .unwrap_or(0);
    (swap, maj)
}

fn run_one(
    p: &Policy,
    round: usize,
    o: &Opts,
    limit: Option<u64>,
    dir: &std::path::Path,
    log: &mut dyn FnMut(&str),
) -> Result<ConfigResult> {
    reset_ksm()?;
    // Declared before the tenants: removed after they are gone. Loaded
    // without a limit (fast), then squeezed to it: the kernel pages the
    // excess out before the run starts.
    let cg = match limit {
        Some(_) => Some(util::MemCgroup::new(u64::MAX >> 2)?),
        None => None,
    };
    // The same starting state for every run: the page cache dropped, the
    // tenants loaded unmerged, squeezed into their cgroup and the swap-out
    // that causes settled (swap in use still for 2 s, at most 60 s).
    let _ = std::fs::write("/proc/sys/vm/drop_caches", "3");
    let (tenants, shared) = loaded_tenants(o, cg.as_ref())?;
    if let (Some(cg), Some(l)) = (&cg, limit) {
        std::fs::write(cg.path.join("memory.limit_in_bytes"), l.to_string())
            .context("cannot limit the tenants' memory cgroup")?;
        let t = Instant::now();
        let mut last = swap_and_majflt().0;
        let mut still = 0;
        while still < 4 && t.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(500));
            let now = swap_and_majflt().0;
            still = if now.abs_diff(last) < 1 << 20 {
                still + 1
            } else {
                0
            };
            last = now;
        }
    }
    let start_swap_mib = swap_and_majflt().0 as f64 / 1048576.0;
    let item = (32 + 14 + o.value_len).next_power_of_two() as f64;
    let private = (o.tenant_bytes as f64 * o.private_frac / item) as u64;
    let vlen = o.value_len;
    log(&format!(
        "{} (round {}): {} tenants loaded ({} shared + {} private items each), {:.0} MiB in swap; running {} s",
        p.name(),
        round + 1,
        o.tenants,
        shared,
        private,
        start_swap_mib,
        o.duration_s
    ));
    let loads: Vec<_> = tenants
        .iter()
        .map(|t| {
            kvload::Load::start(&Spec {
                addr: t.addr.clone(),
                keys: shared,
                value_len: vlen,
                conns: 1,
                get_frac: 1.0,
                theta: o.theta,
                netns: None,
                reconnect: false,
                pace: o.pace,
            })
        })
        .collect();
    let driver = Driver::start(p, o, dir)?;
    let t0 = Instant::now();
    // Savings are counted from here (other mergeable processes on the host are not ours).
    let first = Stats::read()?;
    let base = first.saved() as f64 / 1048576.0;
    let base_profit = first.general_profit as f64 / 1048576.0;
    let mut prev = first;
    let mut prev_ops: Vec<u64> = loads.iter().map(|l| l.counters.ops.load(Relaxed)).collect();
    let start_ops = prev_ops.clone();
    let mut prev_t = 0.0;
    let (_, maj0) = swap_and_majflt();
    let mut prev_maj = maj0;
    let mut samples = Vec::new();
    for k in 1..=o.duration_s {
        if interrupted().load(Relaxed) {
            bail!("interrupted");
        }
        let until = t0 + Duration::from_secs(k);
        std::thread::sleep(until.saturating_duration_since(Instant::now()));
        let now = t0.elapsed().as_secs_f64();
        let s = Stats::read()?;
        let ops: Vec<u64> = loads.iter().map(|l| l.counters.ops.load(Relaxed)).collect();
        let dt = now - prev_t;
        let dops: u64 = ops.iter().zip(&prev_ops).map(|(a, b)| a - b).sum();
        let (swap, maj) = swap_and_majflt();
        samples.push(Sample {
            full_scans: s.full_scans - first.full_scans,
            swap_mib: swap as f64 / 1048576.0,
            majflt_per_s: maj.saturating_sub(prev_maj) as f64 / dt,
            t: now,
            saved_mib: s.saved() as f64 / 1048576.0 - base,
            profit_mib: s.general_profit as f64 / 1048576.0 - base_profit,
            ksmd_cpu_pct: (s.ksmd_cpu - prev.ksmd_cpu) / dt * 100.0,
            ops_per_s: dops as f64 / dt,
            scan_rate: s.scan_rate(),
        });
        if let Some(e) = loads.iter().find_map(|l| l.error()) {
            bail!("{}: a tenant's client failed: {e}", p.name());
        }
        if k % 15 == 0 {
            let x = samples.last().unwrap();
            log(&format!(
                "{}: t={k}s saved {:.0} MiB, ksmd {:.1}%, {:.0} ops/s, {:.0} major faults/s, swap {:.0} MiB",
                p.name(),
                x.saved_mib,
                x.ksmd_cpu_pct,
                x.ops_per_s,
                x.majflt_per_s,
                x.swap_mib
            ));
        }
        prev = s;
        prev_maj = maj;
        prev_ops = ops;
        prev_t = now;
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let per_tenant: Vec<f64> = loads
        .iter()
        .zip(&start_ops)
        .map(|(l, s)| (l.counters.ops.load(Relaxed) - s) as f64 / elapsed)
        .collect();
    let bad: u64 = loads
        .iter()
        .map(|l| l.counters.bad_values.load(Relaxed))
        .sum();
    let dropped: u64 = loads.iter().map(|l| l.counters.dropped.load(Relaxed)).sum();
    for l in loads {
        l.stop()?;
    }
    drop(driver);
    drop(tenants);
    if bad > 0 {
        bail!("{}: {bad} gets returned a wrong value", p.name());
    }
    let n = samples.len();
    let fin = samples[n.saturating_sub(3)..]
        .iter()
        .map(|s| s.saved_mib)
        .sum::<f64>()
        / samples[n.saturating_sub(3)..].len().max(1) as f64;
    let t90 = (fin > 1.0)
        .then(|| {
            samples
                .iter()
                .find(|s| s.saved_mib >= 0.9 * fin)
                .map(|s| s.t)
        })
        .flatten();
    let cpu_s = prev.ksmd_cpu - first.ksmd_cpu;
    Ok(ConfigResult {
        name: p.name(),
        round,
        start_swap_mib,
        final_saved_mib: fin,
        final_profit_mib: samples.last().map(|s| s.profit_mib).unwrap_or(0.0),
        t90_s: t90,
        ksmd_cpu_mean_pct: cpu_s / elapsed * 100.0,
        ksmd_cpu_s: cpu_s,
        throughput: per_tenant.iter().sum(),
        min_tenant_throughput: per_tenant.iter().cloned().fold(f64::INFINITY, f64::min),
        dropped_ops: dropped,
        majflt_per_s: prev_maj.saturating_sub(maj0) as f64 / elapsed,
        final_swap_mib: samples.last().map(|s| s.swap_mib).unwrap_or(0.0),
        samples,
        error: None,
    })
}

pub fn run(o: &Opts, log: &mut dyn FnMut(&str)) -> Result<Report> {
    if !crate::is_root() {
        bail!("bench ksm drives /sys/kernel/mm/ksm: run it as root");
    }
    sysfs::available()?;
    if o.tenants < 2 {
        bail!("at least 2 tenants are needed for anything to merge");
    }
    std::fs::create_dir_all(&o.out_dir)?;
    // ksmtuned's and the controller's logs stay next to the results.
    let dir = o.out_dir.join("ksm-logs");
    std::fs::create_dir_all(&dir)?;
    let saved = Settings::save()?;
    // Ctrl-C / SIGTERM end the run at the next second, with the host's KSM settings put back.
    let _ = interrupted();
    // What the tenants use unmerged, measured: loaded once without pressure.
    reset_ksm()?;
    let tenants_rss = {
        let (t, _) = loaded_tenants(o, None)?;
        t.iter().map(|t| rss(t.child.id())).sum::<Result<u64>>()?
    };
    let m = Memory::read()?;
    let _swap = match o.swap {
        Some(sz) => Some(util::Swap::file(sz)?),
        None => None,
    };
    let limit = o.swap.map(|_| (tenants_rss as f64 * o.fit) as u64);
    let leave = (m.total_kb as f64 * 1024.0 * o.leave_available) as u64;
    let in_ram = limit.unwrap_or(tenants_rss);
    let balloon = (m.available_kb * 1024).saturating_sub(in_ram + leave) as usize;
    log(&format!("host: {} total, {} available; balloon {} so that ~{:.0}% stays available with the tenants loaded", crate::fmt_bytes(m.total_kb * 1024), crate::fmt_bytes(m.available_kb * 1024), crate::fmt_bytes(balloon as u64), o.leave_available * 100.0));
    if let Some(l) = limit {
        log(&format!("the tenants use {} unmerged; their memory cgroup keeps {} ({:.0}%) in RAM, the rest pages to a {} swap file", crate::fmt_bytes(tenants_rss), crate::fmt_bytes(l), o.fit * 100.0, crate::fmt_bytes(o.swap.unwrap_or(0))));
    }
    let _b = Balloon::inflate(balloon)?;
    let policies = [
        Policy::Off,
        Policy::KernelDefaults,
        Policy::Ksmtuned(0.5),
        Policy::Ksmtuned(1.0),
        Policy::Ksmtuned(2.0),
        Policy::Advisor,
        Policy::Adaptive,
    ];
    let mut configs = Vec::new();
    let chosen: Vec<&Policy> = policies
        .iter()
        .filter(|p| {
            o.only
                .as_deref()
                .is_none_or(|w| w.split(',').any(|w| p.name().contains(w.trim())))
        })
        .collect();
    // Interleaved: a slow drift of the host (its page cache, swap layout)
    // falls on every policy alike.
    for round in 0..o.rounds.max(1) {
        for p in chosen.iter().filter(|_| !interrupted().load(Relaxed)) {
            let r = run_one(p, round, o, limit, &dir, log).unwrap_or_else(|e| {
                log(&format!("{}: FAILED: {e:#}", p.name()));
                ConfigResult {
                    name: p.name(),
                    round,
                    start_swap_mib: 0.0,
                    samples: vec![],
                    final_saved_mib: 0.0,
                    final_profit_mib: 0.0,
                    t90_s: None,
                    ksmd_cpu_mean_pct: 0.0,
                    ksmd_cpu_s: 0.0,
                    throughput: 0.0,
                    min_tenant_throughput: 0.0,
                    dropped_ops: 0,
                    majflt_per_s: 0.0,
                    final_swap_mib: 0.0,
                    error: Some(format!("{e:#}")),
                }
            });
            configs.push(r);
        }
    }
    let _ = settle();
    if let Err(e) = saved.restore() {
        log(&format!("could not restore KSM settings: {e:#}"));
    }
    let mut r = Report {
        opts: o.clone(),
        mem_total_mib: m.total_kb >> 10,
        balloon_mib: (balloon >> 20) as u64,
        tenants_rss_mib: tenants_rss >> 20,
        limit_mib: limit.map(|l| l >> 20),
        goals: goals(&configs, o),
        configs,
        plot: PlotOutcome::default(),
    };
    util::save_with_plot(
        &mut r,
        |r| &mut r.plot,
        &o.out_dir,
        "ksm",
        include_str!("../../../bench/plot_ksm.py"),
    )?;
    Ok(r)
}

/// The middle of `v` (the lower one of two), NaN if empty.
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len().saturating_sub(1) / 2)
        .copied()
        .unwrap_or(f64::NAN)
}

/// Every goal twice: with adaptive's median run and with its worst run (the
/// run worst for that goal), each against the peers' medians. A run that
/// failed counts as the worst. Memory saved is held against the best peer;
/// a t90 counts only for a run that saved 95% of what the best peer saved
/// (otherwise it is the whole run: 90% of little is reached at once).
fn goals(c: &[ConfigResult], o: &Opts) -> Vec<Goal> {
    let runs = |n: &str| -> Vec<&ConfigResult> { c.iter().filter(|x| x.name == n).collect() };
    let ok = |n: &str| -> Vec<&ConfigResult> {
        runs(n).into_iter().filter(|x| x.error.is_none()).collect()
    };
    let med =
        |n: &str, f: &dyn Fn(&ConfigResult) -> f64| median(ok(n).iter().map(|x| f(x)).collect());
    let a_name = "pagefleet adaptive";
    let mut g = Vec::new();
    if runs(a_name).is_empty() {
        return g;
    }
    let a_failed = runs(a_name).iter().any(|x| x.error.is_some());
    let a = ok(a_name);
    let saved = |x: &ConfigResult| x.final_saved_mib;
    let peers: Vec<String> = {
        let mut v: Vec<String> = c
            .iter()
            .map(|x| x.name.clone())
            .filter(|n| n != a_name && n != "KSM off")
            .collect();
        v.dedup();
        v.sort();
        v.dedup();
        v
    };
    let best_peer = peers
        .iter()
        .map(|p| med(p, &saved))
        .filter(|v| v.is_finite())
        .fold(0.0, f64::max);
    // The bar a t90 counts at: 95% of the best peer's median, the same bar
    // as the saved-memory goal (against the best of all, one adaptive run
    // that saved more would push the peers' t90 and adaptive's other runs
    // out), and at least 1 MiB: 90% of nothing is reached at once.
    let t90_bar = (0.95 * best_peer).max(1.0);
    let run_len = o.duration_s as f64;
    let t90 = |x: &ConfigResult| match x.t90_s {
        Some(t) if x.final_saved_mib >= t90_bar => t,
        _ => run_len,
    };
    // Adaptive's value for a goal, median and worst ("worst" by `worse`).
    let both = |f: &dyn Fn(&ConfigResult) -> f64, higher_is_better: bool| -> (f64, f64) {
        let v: Vec<f64> = a.iter().map(|x| f(x)).collect();
        let worst = if a_failed || v.is_empty() {
            f64::NAN
        } else if higher_is_better {
            v.iter().copied().fold(f64::INFINITY, f64::min)
        } else {
            v.iter().copied().fold(f64::NEG_INFINITY, f64::max)
        };
        (median(v), worst)
    };
    let mut push = |name: &str, (m, w): (f64, f64), target: f64, unit: &str, at_least: bool| {
        for (which, v) in [("median", m), ("worst run", w)] {
            let n = format!("{name} ({which})");
            // NaN (a failed run) is met by neither comparison.
            g.push(if at_least {
                Goal::at_least(&n, v, target, unit)
            } else {
                Goal::at_most(&n, v, target, unit)
            });
        }
    };
    if best_peer > 0.0 {
        push(
            "memory saved vs the best peer",
            both(&|x| x.final_saved_mib / best_peer, true),
            0.95,
            "x",
            true,
        );
    }
    for s in ["x0.5", "x1", "x2"] {
        let k = format!("ksmtuned {s}");
        if ok(&k).is_empty() {
            continue;
        }
        let kt90 = med(&k, &t90);
        push(
            &format!("t90 speed-up vs ksmtuned {s}"),
            both(&|x| kt90 / t90(x).max(1.0), true),
            2.0,
            "x",
            true,
        );
        let kops = med(&k, &|x| x.throughput);
        push(
            &format!("throughput vs ksmtuned {s}"),
            both(&|x| x.throughput / kops.max(1.0), true),
            1.0,
            "x",
            true,
        );
    }
    if !ok("kernel advisor").is_empty() {
        let adv_cpu = med("kernel advisor", &|x| x.ksmd_cpu_mean_pct);
        push(
            "ksmd CPU vs kernel advisor",
            both(&|x| x.ksmd_cpu_mean_pct, false),
            adv_cpu,
            "%",
            false,
        );
        // The same CPU for what it bought: the advisor may simply do less.
        let per = |x: &ConfigResult| {
            if x.final_saved_mib >= 1.0 {
                x.ksmd_cpu_s / (x.final_saved_mib / 1024.0)
            } else {
                f64::INFINITY
            }
        };
        let adv_per = med("kernel advisor", &per);
        if adv_per.is_finite() {
            push(
                "ksmd CPU s per GiB saved vs advisor",
                both(&per, false),
                adv_per,
                "s/GiB",
                false,
            );
        }
    }
    push(
        "adaptive saves memory",
        both(&saved, true),
        1.0,
        "MiB",
        true,
    );
    g
}

pub fn print_table(r: &Report, out: &mut dyn std::io::Write) -> std::io::Result<()> {
    let load = r
        .opts
        .pace
        .map(|p| format!("clients paced at {p:.0} ops/s each"))
        .unwrap_or_else(|| "closed-loop clients".into());
    let pressure = match r.opts.swap {
        Some(s) => format!(
            "a {} MiB balloon; the tenants' cgroup keeps {} MiB ({:.0}% of their {} MiB) in RAM, {} swap file",
            r.balloon_mib,
            r.limit_mib.unwrap_or(0),
            r.opts.fit * 100.0,
            r.tenants_rss_mib,
            crate::fmt_bytes(s)
        ),
        None => format!("a {} MiB balloon, no swap", r.balloon_mib),
    };
    writeln!(out, "\nKSM: {} kv tenants x {} ({:.0}% common data, {:.0}% private), {load} (zipf {}), host {} MiB, {pressure}, {} s per run\n", r.opts.tenants, crate::fmt_bytes(r.opts.tenant_bytes), r.opts.shared_frac * 100.0, r.opts.private_frac * 100.0, r.opts.theta, r.mem_total_mib, r.opts.duration_s)?;
    writeln!(
        out,
        "{:<20} {:>5} {:>9} {:>11} {:>11} {:>9} {:>10} {:>9} {:>12} {:>12} {:>12} {:>10} {:>9}",
        "policy",
        "round",
        "swap0 MiB",
        "saved MiB",
        "profit MiB",
        "t90 s",
        "ksmd CPU%",
        "ksmd CPU s",
        "CPU s/GiB",
        "ops/s (sum)",
        "min tenant",
        "majflt/s",
        "dropped"
    )?;
    for c in &r.configs {
        if let Some(e) = &c.error {
            writeln!(out, "{:<20} FAILED: {e}", c.name)?;
            continue;
        }
        let t90 = c
            .t90_s
            .map(|t| format!("{t:.0}"))
            .unwrap_or_else(|| "never".into());
        let per_gib = if c.final_saved_mib >= 1.0 {
            format!("{:.2}", c.ksmd_cpu_s / (c.final_saved_mib / 1024.0))
        } else {
            "-".into()
        };
        writeln!(
            out,
            "{:<20} {:>5} {:>9.0} {:>11.0} {:>11.0} {:>9} {:>10.2} {:>9.1} {:>12} {:>12.0} {:>12.0} {:>10.0} {:>9}",
            c.name,
            c.round + 1,
            c.start_swap_mib,
            c.final_saved_mib,
            c.final_profit_mib,
            t90,
            c.ksmd_cpu_mean_pct,
            c.ksmd_cpu_s,
            per_gib,
            c.throughput,
            c.min_tenant_throughput,
            c.majflt_per_s,
            c.dropped_ops
        )?;
    }
    util::print_goals(&r.goals, out)?;
    r.plot.print(out)
}

/// `pagefleet bench ksm` (root): KSM policies on kv tenants sharing a
/// dataset under memory pressure.
#[derive(clap::Args, Clone, Debug)]
pub struct Args {
    /// Each tenant's memory (default 256MiB; at least 32MiB).
    #[arg(long, value_parser = pagefleet_common::units::parse_size)]
    pub dataset: Option<u64>,
    /// Run only these policies, comma-separated names (e.g. adaptive,ksmtuned).
    #[arg(long)]
    pub only: Option<String>,
    /// Seconds each policy runs (default 900; 20..7200).
    #[arg(long)]
    pub secs: Option<f64>,
    /// Pace each tenant's client at this many ops/s instead of a closed
    /// loop (operations over 100 ms late are dropped).
    #[arg(long)]
    pub pace: Option<f64>,
    /// Swap file size (default 2GiB; 0 = no swap and no memory cgroup:
    /// nothing ever pages).
    #[arg(long, value_parser = pagefleet_common::units::parse_size)]
    pub swap: Option<u64>,
    /// Share of the tenants' unmerged memory their memory cgroup keeps in
    /// RAM (default 0.6; 0.9 with --quick); the rest pages until merging
    /// makes room.
    #[arg(long)]
    pub fit: Option<f64>,
    /// The clients' zipf skew (default 0: uniform, every common key is in
    /// the working set).
    #[arg(long)]
    pub theta: Option<f64>,
    /// Run every policy this many times, interleaved (default 3; --quick 1);
    /// the goals hold adaptive's median and its worst run.
    #[arg(long)]
    pub rounds: Option<usize>,
}

impl crate::Benchmark for Args {
    type Report = Report;
    fn run(&self, c: &crate::Common, log: &mut dyn FnMut(&str)) -> Result<Report> {
        let mut o = c.opts(Opts::quick, Opts::full);
        if let Some(d) = self.dataset {
            o.tenant_bytes = crate::at_least("--dataset", "each tenant's memory", d, 32 << 20)?;
        }
        o.only = self.only.clone();
        if let Some(s) = self.secs {
            if !(20.0..=7200.0).contains(&s) {
                bail!("--secs must be between 20 and 7200");
            }
            o.duration_s = s as u64;
        }
        if let Some(p) = self.pace {
            if p.is_nan() || p <= 0.0 {
                bail!("--pace must be a positive number of operations per second");
            }
            o.pace = Some(p);
        }
        if let Some(s) = self.swap {
            if s != 0 && s < 64 << 20 {
                bail!("--swap must be 0 (no swap) or at least 64MiB");
            }
            o.swap = (s > 0).then_some(s);
        }
        if let Some(f) = self.fit {
            if !(0.1..=1.0).contains(&f) {
                bail!("--fit must be between 0.1 and 1 (share of the tenants' memory that fits in RAM)");
            }
            o.fit = f;
        }
        if let Some(r) = self.rounds {
            if !(1..=20).contains(&r) {
                bail!("--rounds must be between 1 and 20");
            }
            o.rounds = r;
        }
        if let Some(t) = self.theta {
            if !(0.0..1.0).contains(&t) {
                bail!("--theta must be in [0, 1)");
            }
            o.theta = t;
        }
        run(&o, log)
    }
    fn print(r: &Report, out: &mut dyn std::io::Write) -> std::io::Result<()> {
        print_table(r, out)
    }
}

/// Set by SIGINT / SIGTERM (the run then ends at its next check).
fn interrupted() -> &'static std::sync::atomic::AtomicBool {
    pagefleet_common::signal::stop_flag()
}
