//! `pagefleet bench ioqos`: paper 004 at this machine's scale. fio tenants
//! (direct I/O, 64 KiB random writes) in their own blkio cgroups share one
//! device; one tenant raises its parallelism. Devices: a slow FIFO disk (a
//! FUSE file served one request at a time at a fixed rate, behind a loop
//! device, like the paper's shared array) and this machine's disk (a loop
//! device with direct I/O over a file). Policies side by side in one run: no
//! control, static caps, BFQ weights, the paper's Algorithm 1, guarantee.

use crate::util::{save_with_plot, Goal, PlotOutcome};
use anyhow::{anyhow, bail, Context, Result};
use pagefleet_fifodisk::{FifoDisk, LoopDevice, Pace};
use pagefleet_ioqos::backend::{Backend, Limit};
use pagefleet_ioqos::control::{self, Options, Policy as Ctl};
use pagefleet_ioqos::device::Dev;
use pagefleet_ioqos::policy::{GuaranteeConfig, Model, PaperConfig};
use pagefleet_ioqos::spec::{Location, Tenant};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const V1: &str = "/sys/fs/cgroup/blkio";
/// Samples before this are the start-up transient, left out of the figures.
const WARMUP_S: f64 = 4.0;
/// A tenant's "min throughput" is its lowest mean over windows this long.
const MIN_WINDOW_S: usize = 2;

pub const PLOT_SCRIPT: &str = include_str!("../../../bench/plot_ioqos.py");

pub struct Opts {
    pub out_dir: PathBuf,
    /// Length of each run, seconds.
    pub secs: f64,
    pub devices: Vec<String>,
    pub scenarios: Vec<String>,
    pub policies: Vec<String>,
    pub fifo: Pace,
    pub disk_bytes: u64,
}

pub const DEVICES: [&str; 2] = ["fifo", "disk"];
pub const SCENARIOS: [&str; 3] = ["ramp", "many", "burst4k"];
pub const POLICIES: [&str; 5] = ["none", "static", "bfq", "paper", "guarantee"];

impl Opts {
    pub fn full(out_dir: PathBuf) -> Opts {
        Opts {
            out_dir,
            secs: 80.0,
            devices: DEVICES.iter().map(|s| s.to_string()).collect(),
            scenarios: SCENARIOS.iter().map(|s| s.to_string()).collect(),
            policies: POLICIES.iter().map(|s| s.to_string()).collect(),
            fifo: Pace {
                per_io: Duration::from_micros(500),
                bandwidth: 40.0 * 1048576.0,
            },
            disk_bytes: 1 << 30,
        }
    }
    pub fn quick(out_dir: PathBuf) -> Opts {
        Opts {
            secs: 30.0,
            devices: vec!["fifo".into()],
            scenarios: vec!["ramp".into()],
            disk_bytes: 256 << 20,
            ..Opts::full(out_dir)
        }
    }
}

/// What one tenant runs: fio jobs, each alive over [start, end) seconds.
#[derive(Clone, Debug, Serialize)]
pub struct Load {
    pub name: String,
    pub bs: u32,
    pub jobs: Vec<(f64, f64)>,
    /// Keeps to one job all along: its minimum is a target the policy must hold.
    pub well_behaved: bool,
}

/// Every tenant's guaranteed minimum: this share of what it gets when all
/// the scenario's tenants behave (one process each, measured on the device
/// before the runs) — "keep most of your fair share when a neighbour
/// misbehaves", attainable on any device by construction.
pub const MIN_OF_EQUAL_SHARE: f64 = 0.75;

pub fn scenario(name: &str, t: f64) -> Result<Vec<Load>> {
    let steady = |name: String| Load {
        name,
        bs: 64 << 10,
        jobs: vec![(0.0, t)],
        well_behaved: true,
    };
    Ok(match name {
        // Paper Figs. 3-4: the bursty VM adds a process at a time up to 10.
        "ramp" => {
            let mut v = vec![Load {
                name: "hog".into(),
                bs: 64 << 10,
                jobs: (0..10)
                    .map(|k| (0.05 * t + k as f64 * 0.06 * t, t))
                    .collect(),
                well_behaved: false,
            }];
            v.extend((1..4).map(|i| steady(format!("t{i}"))));
            v
        }
        // Paper's 20-VM run at this scale: 12 tenants, 3 of them bursty
        // (6 processes in on/off bursts, out of phase).
        "many" => {
            let period = t / 4.0;
            let mut v: Vec<Load> = (0..3)
                .map(|b| {
                    let phase = 0.05 * t + b as f64 * period / 3.0;
                    let mut jobs = vec![];
                    let mut s = phase;
                    while s < t - 1.0 {
                        for _ in 0..6 {
                            jobs.push((s, (s + period / 2.0).min(t)));
                        }
                        s += period;
                    }
                    Load {
                        name: format!("burst{}", b + 1),
                        bs: 64 << 10,
                        jobs,
                        well_behaved: false,
                    }
                })
                .collect();
            v.extend((1..10).map(|i| steady(format!("t{i}"))));
            v
        }
        // Paper Fig. 5's weakness: 4 KiB I/O costs the device more than its
        // bandwidth shows.
        "burst4k" => {
            let mut v = vec![Load {
                name: "hog4k".into(),
                bs: 4 << 10,
                jobs: vec![(0.15 * t, 0.85 * t); 16],
                well_behaved: false,
            }];
            v.extend((1..4).map(|i| steady(format!("t{i}"))));
            v
        }
        _ => bail!("unknown scenario {name:?} (use {})", SCENARIOS.join(", ")),
    })
}

#[derive(Clone, Debug, Serialize)]
pub struct Calibration {
    /// 64 KiB random writes, 8 processes.
    pub write64k_bps: f64,
    pub write64k_iops: f64,
    /// 4 KiB random writes, 16 processes.
    pub write4k_iops: f64,
    /// The linear cost model fitted through both points (what the
    /// controllers are given).
    pub model: Model,
    /// (tenants, each one's throughput) with that many single-process 64 KiB
    /// writers at once: the equal share the minimums derive from.
    pub equal_share_bps: Vec<(usize, f64)>,
}

#[derive(Clone, Debug, Serialize)]
pub struct TenantResult {
    pub name: String,
    pub well_behaved: bool,
    pub min_bps: f64,
    pub mean_bps: f64,
    pub min_window_bps: f64,
    pub mean_iops: f64,
    pub p99_ms: Option<f64>,
    pub capped_s: f64,
    /// mean / its minimum (well-behaved tenants).
    pub isolation: Option<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct RunResult {
    pub device: String,
    pub scenario: String,
    pub policy: String,
    pub tenants: Vec<TenantResult>,
    pub total_bps: f64,
    /// Lowest isolation among well-behaved tenants.
    pub worst_isolation: f64,
    /// Lowest min-window throughput among well-behaved tenants.
    pub worst_min_bps: f64,
    /// Total throughput / the no-control run's.
    pub work_conservation: Option<f64>,
    /// Per second: time, per tenant MB/s, per tenant cap MB/s.
    pub t: Vec<f64>,
    pub bps: Vec<Vec<f64>>,
    pub cap_bps: Vec<Vec<Option<f64>>>,
    /// Per second (controllers only): the device share the controller saw
    /// in use and which tenants it judged starved.
    pub ctl_device_share: Vec<Option<f64>>,
    pub ctl_starved: Vec<Vec<bool>>,
    pub error: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub secs: f64,
    pub fifo_per_io_ms: f64,
    pub fifo_bandwidth_bps: f64,
    pub calibration: Vec<(String, Calibration)>,
    pub runs: Vec<RunResult>,
    pub goals: Vec<Goal>,
    #[serde(flatten)]
    pub plot: PlotOutcome,
}

/// The shared device under test, torn down on drop (loop device first).
struct Device {
    lo: Option<LoopDevice>,
    fifo: Option<FifoDisk>,
    file: Option<PathBuf>,
    dev: Dev,
}

impl Device {
    fn open(kind: &str, o: &Opts) -> Result<Device> {
        let (lo, fifo, file) = match kind {
            "fifo" => {
                let dir =
                    std::env::temp_dir().join(format!("pagefleet-fifo-{}", std::process::id()));
                let d = FifoDisk::mount(&dir, o.disk_bytes, o.fifo)?;
                let lo = LoopDevice::attach(&d.file(), true)?;
                (lo, Some(d), None)
            }
            "disk" => {
                let p = PathBuf::from(format!(
                    "/var/tmp/pagefleet-bench-ioqos-{}.img",
                    std::process::id()
                ));
                let f = std::fs::File::create(&p)
                    .with_context(|| format!("cannot create {}", p.display()))?;
                // Allocated up front so the runs overwrite blocks, not allocate them.
                use std::os::fd::AsFd;
                if pagefleet_common::sys::mapping::allocate(f.as_fd(), o.disk_bytes).is_err() {
                    f.set_len(o.disk_bytes)?;
                }
                drop(f);
                match LoopDevice::attach(&p, true) {
                    Ok(lo) => (lo, None, Some(p)),
                    Err(e) => {
                        let _ = std::fs::remove_file(&p);
                        return Err(e.into());
                    }
                }
            }
            _ => bail!("unknown device {kind:?} (use {})", DEVICES.join(", ")),
        };
        let dev = Dev::parse(&lo.path.display().to_string())?;
        Ok(Device {
            lo: Some(lo),
            fifo,
            file,
            dev,
        })
    }

    fn path(&self) -> &Path {
        &self.lo.as_ref().unwrap().path
    }

    fn set_scheduler(&self, s: &str) -> Result<()> {
        Ok(self.lo.as_ref().unwrap().set_scheduler(s)?)
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        if let Some(l) = &self.lo {
            let _ = l.set_scheduler("none");
        }
        self.lo.take();
        if let Some(f) = self.fifo.take() {
            let _ = f.unmount();
        }
        if let Some(p) = self.file.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// The tenants' blkio cgroups; their processes killed and the groups
/// removed on drop.
struct Groups(Vec<PathBuf>);

impl Groups {
    fn create(loads: &[Load]) -> Result<Groups> {
        let mut g = Groups(vec![]);
        for l in loads {
            let p = PathBuf::from(V1).join(format!(
                "pagefleet-bench-{}-{}",
                std::process::id(),
                l.name
            ));
            std::fs::create_dir_all(&p)
                .with_context(|| format!("cannot create cgroup {}", p.display()))?;
            g.0.push(p);
        }
        Ok(g)
    }
}

impl Drop for Groups {
    fn drop(&mut self) {
        for g in &self.0 {
            for _ in 0..50 {
                let procs = std::fs::read_to_string(g.join("cgroup.procs")).unwrap_or_default();
                for p in procs
                    .split_whitespace()
                    .filter_map(|p| p.parse::<i32>().ok())
                {
                    let _ = pagefleet_common::sys::process::signal(p, libc::SIGKILL);
                }
                if std::fs::remove_dir(g).is_ok() || !g.exists() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

fn fio_bin() -> Result<PathBuf> {
    crate::util::which("fio").map_err(|_| anyhow!("fio is not installed (make deps installs it)"))
}

/// fio with no cgroup: (bytes/s, IOPS) for `jobs` processes of `bs` random writes.
fn fio_plain(dev: &Path, bs: u32, jobs: u32, secs: u32, size: u64) -> Result<(f64, f64)> {
    let out = Command::new(fio_bin()?)
        .args([
            "--name=cal",
            "--rw=randwrite",
            "--direct=1",
            "--ioengine=psync",
            "--time_based",
            "--group_reporting",
            "--output-format=json",
        ])
        .arg(format!("--filename={}", dev.display()))
        .arg(format!("--bs={bs}"))
        .arg(format!("--numjobs={jobs}"))
        .arg(format!("--runtime={secs}"))
        .arg(format!("--size={size}"))
        .output()?;
    if !out.status.success() {
        bail!("fio: {}", String::from_utf8_lossy(&out.stderr));
    }
    let f = pagefleet_lab::fio::Output::parse(&String::from_utf8_lossy(&out.stdout))
        .map_err(anyhow::Error::msg)?;
    let w = &f.job().map_err(anyhow::Error::msg)?.write;
    Ok((w.bw_bytes, w.iops))
}

fn calibrate(d: &Device, size: u64, tenant_counts: &[usize]) -> Result<Calibration> {
    let mut equal_share_bps = vec![];
    for &n in tenant_counts {
        let (b, _) = fio_plain(d.path(), 64 << 10, n as u32, 4, size)?;
        equal_share_bps.push((n, b / n as f64));
    }
    let (bps64, iops64) = fio_plain(d.path(), 64 << 10, 8, 4, size)?;
    let (_, iops4) = fio_plain(d.path(), 4 << 10, 16, 4, size)?;
    if bps64 <= 0.0 || iops4 <= 0.0 {
        bail!("calibration wrote nothing");
    }
    // cost(io) = c_io + bytes * c_b through both points (64 KiB, 4 KiB).
    let (a, b) = (1.0 / iops4, 1.0 / iops64);
    let c_b = ((b - a) / (61440.0)).max(1e-12);
    let c_io = (a - 4096.0 * c_b).max(1e-9);
    Ok(Calibration {
        write64k_bps: bps64,
        write64k_iops: iops64,
        write4k_iops: iops4,
        model: Model {
            max_iops: 1.0 / c_io,
            max_bps: 1.0 / c_b,
        },
        equal_share_bps,
    })
}

/// One fio process per tenant, in its cgroup, one job section per process.
fn start_fio(
    dev: &Path,
    group: &Path,
    l: &Load,
    offset: u64,
    size: u64,
    out: &Path,
) -> Result<Child> {
    let mut job = format!(
        "[global]\nfilename={}\ndirect=1\nioengine=psync\nrw=randwrite\nbs={}\noffset={offset}\nsize={size}\ntime_based\ngroup_reporting\n",
        dev.display(),
        l.bs
    );
    for (k, (s, e)) in l.jobs.iter().enumerate() {
        job += &format!(
            "[j{k}]\nstartdelay={}ms\nruntime={}ms\n",
            (s * 1000.0) as u64,
            ((e - s) * 1000.0).max(1.0) as u64
        );
    }
    let jf = out.with_extension("fio");
    std::fs::write(&jf, job)?;
    let script = format!(
        "echo $$ > {} && exec {} --output-format=json --output={} {}",
        group.join("cgroup.procs").display(),
        fio_bin()?.display(),
        out.display(),
        jf.display()
    );
    Ok(Command::new("sh")
        .arg("-c")
        .arg(script)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?)
}

fn fio_p99_ms(out: &Path) -> Option<f64> {
    let text = std::fs::read_to_string(out).ok()?;
    let f = pagefleet_lab::fio::Output::parse(&text).ok()?;
    f.job().ok()?.write.p99_ms()
}

fn run_one(
    d: &Device,
    devname: &str,
    cal: &Calibration,
    sc: &str,
    policy: &str,
    o: &Opts,
    log: &mut dyn FnMut(&str),
) -> Result<RunResult> {
    let loads = scenario(sc, o.secs)?;
    let n = loads.len();
    let groups = Groups::create(&loads)?;
    let equal = cal
        .equal_share_bps
        .iter()
        .find(|(k, _)| *k == n)
        .map(|(_, b)| *b)
        .ok_or_else(|| anyhow!("no equal-share calibration for {n} tenants"))?;
    let mins: Vec<f64> = vec![MIN_OF_EQUAL_SHARE * equal; n];
    let tenants: Vec<Tenant> = loads
        .iter()
        .zip(&groups.0)
        .zip(&mins)
        .map(|((l, g), m)| Tenant {
            name: l.name.clone(),
            location: Location::CgroupV1(g.clone()),
            min_bps: *m as u64,
            min_iops: 0,
            weight: 1.0,
        })
        .collect();
    // The bench's own view of each tenant (also what makes v1 count its I/O).
    let mut meters = vec![];
    for t in &tenants {
        let mut b = Backend::open(&t.location)?;
        b.attach(d.dev)?;
        meters.push(b);
    }
    let caps: Arc<Mutex<Vec<Option<f64>>>> = Arc::new(Mutex::new(vec![None; n]));
    let capped: Arc<Mutex<Vec<f64>>> = Arc::new(Mutex::new(vec![0.0; n]));
    let seen: Arc<Mutex<(Option<f64>, Vec<bool>)>> = Arc::new(Mutex::new((None, vec![false; n])));
    match policy {
        "static" => {
            // Everyone gets 1/n of the device, always (bytes and IOPS).
            for (i, m) in meters.iter_mut().enumerate() {
                let l = Limit {
                    wbps: Some((cal.write64k_bps / n as f64) as u64),
                    wiops: Some((cal.write4k_iops / n as f64) as u64),
                    ..Limit::none()
                };
                m.set(d.dev, &l)?;
                caps.lock().unwrap()[i] = l.wbps.map(|x| x as f64);
            }
        }
        "bfq" => {
            d.set_scheduler("bfq")?;
            for g in &groups.0 {
                std::fs::write(g.join("blkio.bfq.weight"), "100").context("blkio.bfq.weight")?;
            }
        }
        _ => {}
    }
    let ctl_policy = match policy {
        "paper" => Some(Ctl::Paper(PaperConfig::default())),
        "guarantee" => Some(Ctl::Guarantee(GuaranteeConfig::default())),
        _ => None,
    };
    let stop = Arc::new(AtomicBool::new(false));
    let ctl = ctl_policy.map(|p| {
        // The paper's border is a share of "the device's max": what the device
        // achieves for this workload (64 KiB writes; 4 KiB writes for IOPS).
        // The guarantee policy gets the fitted linear cost model.
        let model = match p {
            Ctl::Paper(_) => Model {
                max_iops: cal.write4k_iops,
                max_bps: cal.write64k_bps,
            },
            _ => cal.model,
        };
        let opts = Options {
            dev: d.dev,
            tenants: tenants.clone(),
            policy: p,
            model,
            interval: Duration::from_secs(1),
            state_file: None,
            duration: None,
        };
        let (stop, caps, capped, seen) = (stop.clone(), caps.clone(), capped.clone(), seen.clone());
        std::thread::spawn(move || {
            control::run(&opts, &stop, |st| {
                *seen.lock().unwrap() = (
                    Some(st.device_share_used),
                    st.tenants.iter().map(|t| t.starved).collect(),
                );
                let mut c = caps.lock().unwrap();
                let mut k = capped.lock().unwrap();
                for (i, t) in st.tenants.iter().enumerate() {
                    c[i] = t.cap_bps;
                    k[i] = t.capped_s;
                }
            })
        })
    });
    let logs = o.out_dir.join("ioqos-logs");
    std::fs::create_dir_all(&logs)?;
    let region = (o.disk_bytes / n as u64) / (1 << 20) * (1 << 20);
    let mut fios = vec![];
    let outs: Vec<PathBuf> = loads
        .iter()
        .map(|l| logs.join(format!("{devname}-{sc}-{policy}-{}.json", l.name)))
        .collect();
    for (i, l) in loads.iter().enumerate() {
        let _ = std::fs::remove_file(&outs[i]);
        fios.push(start_fio(
            d.path(),
            &groups.0[i],
            l,
            i as u64 * region,
            region,
            &outs[i],
        )?);
    }
    let t0 = Instant::now();
    let mut last: Vec<_> = meters
        .iter_mut()
        .map(|m| m.read(d.dev).unwrap_or_default())
        .collect();
    let (mut ts, mut bps, mut iops, mut capv) =
        (vec![], vec![vec![]; n], vec![vec![]; n], vec![vec![]; n]);
    let (mut shares, mut starved) = (vec![], vec![]);
    let mut t_prev = Instant::now();
    let mut next = 1.0;
    let mut error = None;
    while t0.elapsed().as_secs_f64() < o.secs + 0.5 {
        if interrupted().load(Relaxed) {
            error = Some("interrupted".to_string());
            break;
        }
        let wait = next - t0.elapsed().as_secs_f64();
        if wait > 0.0 {
            std::thread::sleep(Duration::from_secs_f64(wait.min(0.2)));
            continue;
        }
        next += 1.0;
        let dt = t_prev.elapsed().as_secs_f64();
        t_prev = Instant::now();
        ts.push(t0.elapsed().as_secs_f64());
        let c = caps.lock().unwrap().clone();
        let (sh, sv) = seen.lock().unwrap().clone();
        shares.push(sh);
        starved.push(sv);
        for i in 0..n {
            let now = meters[i].read(d.dev).unwrap_or(last[i]);
            bps[i].push(now.wbytes.saturating_sub(last[i].wbytes) as f64 / dt);
            iops[i].push(now.wios.saturating_sub(last[i].wios) as f64 / dt);
            capv[i].push(c[i]);
            last[i] = now;
        }
        if ts.len() % 10 == 0 {
            let tot: f64 = (0..n).map(|i| bps[i].last().unwrap()).sum();
            log(&format!(
                "{devname}/{sc}/{policy}: {:.0}/{:.0} s, device {:.1} MB/s",
                t0.elapsed().as_secs_f64(),
                o.secs,
                tot / 1e6
            ));
        }
    }
    // fio ends at the run's end; anything left is killed with the groups.
    let deadline = Instant::now() + Duration::from_secs(15);
    for f in fios.iter_mut() {
        while f.try_wait()?.is_none() && Instant::now() < deadline && !interrupted().load(Relaxed) {
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = f.kill();
        let _ = f.wait();
    }
    stop.store(true, Relaxed);
    if let Some(h) = ctl {
        match h.join() {
            Ok(Err(e)) => error = Some(format!("controller: {e:#}")),
            Err(_) => error = Some("controller panicked".into()),
            _ => {}
        }
    }
    for m in meters.iter_mut() {
        let _ = m.detach(d.dev);
    }
    if policy == "bfq" {
        let _ = d.set_scheduler("none");
    }
    drop(groups);
    // Figures from the samples after warm-up.
    let skip = ts.iter().take_while(|&&t| t < WARMUP_S).count();
    let capped_s = capped.lock().unwrap().clone();
    let mut tr = vec![];
    for i in 0..n {
        let s = &bps[i][skip.min(bps[i].len())..];
        let mean = s.iter().sum::<f64>() / s.len().max(1) as f64;
        let minw = s
            .windows(MIN_WINDOW_S)
            .map(|w| w.iter().sum::<f64>() / MIN_WINDOW_S as f64)
            .fold(f64::INFINITY, f64::min);
        let si = &iops[i][skip.min(iops[i].len())..];
        let static_capped = policy == "static";
        tr.push(TenantResult {
            name: loads[i].name.clone(),
            well_behaved: loads[i].well_behaved,
            min_bps: mins[i],
            mean_bps: mean,
            min_window_bps: if minw.is_finite() { minw } else { 0.0 },
            mean_iops: si.iter().sum::<f64>() / si.len().max(1) as f64,
            p99_ms: fio_p99_ms(&outs[i]),
            capped_s: if static_capped {
                ts.last().copied().unwrap_or(0.0)
            } else {
                capped_s[i]
            },
            isolation: loads[i].well_behaved.then(|| mean / mins[i]),
        });
    }
    let total = tr.iter().map(|t| t.mean_bps).sum();
    let wb = tr.iter().filter(|t| t.well_behaved);
    Ok(RunResult {
        device: devname.into(),
        scenario: sc.into(),
        policy: policy.into(),
        worst_isolation: wb
            .clone()
            .filter_map(|t| t.isolation)
            .fold(f64::INFINITY, f64::min),
        worst_min_bps: wb.map(|t| t.min_window_bps).fold(f64::INFINITY, f64::min),
        tenants: tr,
        total_bps: total,
        work_conservation: None,
        t: ts,
        bps,
        cap_bps: capv,
        ctl_device_share: shares,
        ctl_starved: starved,
        error,
    })
}

pub fn run(o: &Opts, log: &mut dyn FnMut(&str)) -> Result<Report> {
    if !crate::is_root() {
        bail!("bench ioqos needs root (cgroups, loop devices, FUSE)");
    }
    if !Path::new(V1)
        .join("blkio.throttle.write_bps_device")
        .exists()
    {
        bail!("bench ioqos needs cgroup v1 blkio throttling at {V1}");
    }
    fio_bin()?;
    for s in &o.scenarios {
        scenario(s, o.secs)?;
    }
    if let Some(p) = o.policies.iter().find(|p| !POLICIES.contains(&p.as_str())) {
        bail!("unknown policy {p:?} (use {})", POLICIES.join(", "));
    }
    std::fs::create_dir_all(&o.out_dir)?;
    // Ctrl-C / SIGTERM end the run at the next second, with everything torn down.
    let _ = interrupted();
    let mut calibration = vec![];
    let mut runs = vec![];
    'dev: for devname in &o.devices {
        let d = Device::open(devname, o)?;
        log(&format!(
            "{devname}: {} (direct I/O); calibrating with fio",
            d.path().display()
        ));
        // The machine's disk gets the main scenario only: it has no FIFO queue to fight over.
        let scs: Vec<&String> = o
            .scenarios
            .iter()
            .filter(|s| devname == "fifo" || s.as_str() == "ramp")
            .collect();
        let mut counts: Vec<usize> = vec![];
        for sc in &scs {
            let n = scenario(sc, o.secs)?.len();
            if !counts.contains(&n) {
                counts.push(n);
            }
        }
        let cal = calibrate(&d, o.disk_bytes, &counts)?;
        log(&format!(
            "{devname}: 64 KiB writes {:.1} MB/s ({:.0} IOPS), 4 KiB writes {:.0} IOPS; model {:.0} IOPS + {:.1} MB/s",
            cal.write64k_bps / 1e6,
            cal.write64k_iops,
            cal.write4k_iops,
            cal.model.max_iops,
            cal.model.max_bps / 1e6
        ));
        for (n, b) in &cal.equal_share_bps {
            log(&format!(
                "{devname}: {n} single-process writers get {:.2} MB/s each",
                b / 1e6
            ));
        }
        calibration.push((devname.clone(), cal.clone()));
        for sc in scs {
            for p in &o.policies {
                if interrupted().load(Relaxed) {
                    break 'dev;
                }
                log(&format!("{devname}/{sc}/{p}: {} s", o.secs));
                let r = run_one(&d, devname, &cal, sc, p, o, log)?;
                log(&format!(
                    "{devname}/{sc}/{p}: device {:.1} MB/s, worst well-behaved {:.0}% of its minimum, lowest {:.2} MB/s",
                    r.total_bps / 1e6,
                    r.worst_isolation * 100.0,
                    r.worst_min_bps / 1e6
                ));
                runs.push(r);
            }
        }
    }
    if interrupted().load(Relaxed) {
        log("interrupted: the runs so far are reported");
    }
    // Work conservation against the same device and scenario with no control.
    let base: Vec<(String, String, f64)> = runs
        .iter()
        .filter(|r| r.policy == "none")
        .map(|r| (r.device.clone(), r.scenario.clone(), r.total_bps))
        .collect();
    for r in runs.iter_mut() {
        r.work_conservation = base
            .iter()
            .find(|b| b.0 == r.device && b.1 == r.scenario)
            .map(|b| r.total_bps / b.2);
    }
    let goals = goals(&runs);
    let mut rep = Report {
        secs: o.secs,
        fifo_per_io_ms: o.fifo.per_io.as_secs_f64() * 1e3,
        fifo_bandwidth_bps: o.fifo.bandwidth,
        calibration,
        runs,
        goals,
        plot: PlotOutcome::default(),
    };
    save_with_plot(&mut rep, |r| &mut r.plot, &o.out_dir, "ioqos", PLOT_SCRIPT)?;
    Ok(rep)
}

/// The targets for every device and scenario measured.
pub fn goals(runs: &[RunResult]) -> Vec<Goal> {
    let mut g = vec![];
    let mut seen: Vec<(String, String)> = vec![];
    for r in runs {
        let k = (r.device.clone(), r.scenario.clone());
        if seen.contains(&k) {
            continue;
        }
        seen.push(k);
        let find = |p: &str| {
            runs.iter()
                .find(|x| x.device == r.device && x.scenario == r.scenario && x.policy == p)
        };
        let Some(gu) = find("guarantee") else {
            continue;
        };
        let tag = format!("{}/{}", r.device, r.scenario);
        g.push(Goal::at_least(
            &format!("{tag}: guarantee, worst well-behaved tenant's throughput / its minimum"),
            gu.worst_isolation * 100.0,
            95.0,
            "%",
        ));
        if let Some(w) = gu.work_conservation {
            g.push(Goal::at_least(
                &format!("{tag}: guarantee, device throughput / no control's"),
                w * 100.0,
                90.0,
                "%",
            ));
        }
        if let Some(pa) = find("paper") {
            let ratio = gu.worst_min_bps / pa.worst_min_bps.max(1.0);
            let mut goal = Goal::at_least(
                &format!("{tag}: worst tenant's min throughput, guarantee / paper (must beat)"),
                ratio,
                1.0,
                "x",
            );
            goal.cmp = ">";
            goal.met = ratio > 1.0;
            g.push(goal);
        }
    }
    g
}

pub fn print_table(r: &Report, out: &mut dyn std::io::Write) -> std::io::Result<()> {
    writeln!(
        out,
        "I/O guarantee (paper 004): fio tenants, 64 KiB random direct writes, {} s per run",
        r.secs
    )?;
    for (d, c) in &r.calibration {
        writeln!(
            out,
            "  device {d}: 64 KiB writes {:.1} MB/s, 4 KiB writes {:.0} IOPS (model: {:.0} IOPS + {:.1} MB/s); equal share {}",
            c.write64k_bps / 1e6,
            c.write4k_iops,
            c.model.max_iops,
            c.model.max_bps / 1e6,
            c.equal_share_bps
                .iter()
                .map(|(n, b)| format!("{:.2} MB/s of {n}", b / 1e6))
                .collect::<Vec<_>>()
                .join(", ")
        )?;
    }
    let mut keys: Vec<(String, String)> = vec![];
    for x in &r.runs {
        let k = (x.device.clone(), x.scenario.clone());
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    for (d, s) in keys {
        let runs: Vec<&RunResult> = r
            .runs
            .iter()
            .filter(|x| x.device == d && x.scenario == s)
            .collect();
        writeln!(out, "\n{d} / {s}")?;
        writeln!(
            out,
            "  {:<10} {:>10} {:>10} {:>14} {:>14} {:>12} {:>12}",
            "policy",
            "device MB/s",
            "work cons.",
            "worst WB mean",
            "worst WB min",
            "isolation",
            "max WB p99"
        )?;
        for x in &runs {
            let wb_p99 = x
                .tenants
                .iter()
                .filter(|t| t.well_behaved)
                .filter_map(|t| t.p99_ms)
                .fold(0.0, f64::max);
            let worst_mean = x
                .tenants
                .iter()
                .filter(|t| t.well_behaved)
                .map(|t| t.mean_bps)
                .fold(f64::INFINITY, f64::min);
            writeln!(
                out,
                "  {:<10} {:>10.2} {:>9.0}% {:>10.2} MB/s {:>9.2} MB/s {:>11.0}% {:>9.0} ms{}",
                x.policy,
                x.total_bps / 1e6,
                x.work_conservation.unwrap_or(f64::NAN) * 100.0,
                worst_mean / 1e6,
                x.worst_min_bps / 1e6,
                x.worst_isolation * 100.0,
                wb_p99,
                x.error
                    .as_ref()
                    .map(|e| format!("  ({e})"))
                    .unwrap_or_default()
            )?;
        }
        // Per tenant: mean / min MB/s and p99 under each policy.
        write!(out, "  {:<8} {:>7}", "tenant", "min")?;
        for x in &runs {
            write!(out, " {:>22}", format!("{} mean/min p99", x.policy))?;
        }
        writeln!(out)?;
        if let Some(first) = runs.first() {
            for (i, t) in first.tenants.iter().enumerate() {
                write!(out, "  {:<8} {:>7.2}", t.name, t.min_bps / 1e6)?;
                for x in &runs {
                    let u = &x.tenants[i];
                    write!(
                        out,
                        " {:>22}",
                        format!(
                            "{:.2}/{:.2} {}",
                            u.mean_bps / 1e6,
                            u.min_window_bps / 1e6,
                            u.p99_ms.map(|p| format!("{p:.0}ms")).unwrap_or("-".into())
                        )
                    )?;
                }
                writeln!(out)?;
            }
        }
    }
    writeln!(out, "\n(MB/s = 10^6 bytes/s; WB = well-behaved tenants; min = lowest {MIN_WINDOW_S} s mean after {WARMUP_S} s; a tenant's minimum = {:.0}% of its share when every tenant runs one process; isolation = mean / the tenant's minimum)", MIN_OF_EQUAL_SHARE * 100.0)?;
    crate::util::print_goals(&r.goals, out)?;
    r.plot.print(out)
}

/// `pagefleet bench ioqos` (root): paper 004 with fio tenants on a slow
/// FIFO disk and this machine's disk.
#[derive(clap::Args, Clone, Debug)]
pub struct Args {
    /// Seconds each run lasts (default 80; 20..3600).
    #[arg(long)]
    pub secs: Option<f64>,
    /// Devices (fifo, disk), scenarios (ramp, many, burst4k) and policies
    /// (none, static, bfq, paper, guarantee) to run, comma-separated.
    #[arg(long)]
    pub only: Option<String>,
    /// The shared device's size (at least 64MiB).
    #[arg(long, value_parser = pagefleet_common::units::parse_size)]
    pub dataset: Option<u64>,
}

impl crate::Benchmark for Args {
    type Report = Report;
    fn run(&self, c: &crate::Common, log: &mut dyn FnMut(&str)) -> Result<Report> {
        let mut o = c.opts(Opts::quick, Opts::full);
        if let Some(s) = self.secs {
            if !(20.0..=3600.0).contains(&s) {
                bail!("--secs must be between 20 and 3600");
            }
            o.secs = s;
        }
        if let Some(only) = &self.only {
            let words: Vec<&str> = only
                .split(',')
                .map(str::trim)
                .filter(|w| !w.is_empty())
                .collect();
            if let Some(bad) = words.iter().find(|w| {
                ![&DEVICES[..], &SCENARIOS[..], &POLICIES[..]]
                    .iter()
                    .any(|set| set.contains(w))
            }) {
                bail!(
                    "--only {bad:?}: use devices ({}), scenarios ({}), policies ({})",
                    DEVICES.join(","),
                    SCENARIOS.join(","),
                    POLICIES.join(",")
                );
            }
            let pick = |all: &[&str], cur: &mut Vec<String>| {
                let sel: Vec<String> = all
                    .iter()
                    .filter(|x| words.contains(x))
                    .map(|x| x.to_string())
                    .collect();
                if !sel.is_empty() {
                    *cur = sel;
                }
            };
            pick(&DEVICES, &mut o.devices);
            pick(&SCENARIOS, &mut o.scenarios);
            pick(&POLICIES, &mut o.policies);
        }
        if let Some(d) = self.dataset {
            let d = crate::at_least("--dataset", "the shared device's size", d, 64 << 20)?;
            o.disk_bytes = d / (4 << 20) * (4 << 20);
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
