//! The controller loop: measure every tenant each interval, let the policy
//! decide, apply caps through each tenant's backend, publish the state for
//! `pagefleet ioqos status`, and remove every cap on exit.

use crate::backend::{Backend, Counters, Limit};
use crate::device::Dev;
use crate::error::{Context, Result};
use crate::policy::{Cap, Guarantee, GuaranteeConfig, Min, Model, Obs, Paper, PaperConfig};
use crate::spec::Tenant;
use pagefleet_common::controller::{self, HasPid, StateFile};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tracing::{info, warn};

/// Where a controller publishes its state by default.
pub const DEFAULT_STATE: &str = "/run/pagefleet/ioqos.json";

/// Which algorithm.
#[derive(Clone, Debug)]
pub enum Policy {
    /// Measure only (the "no control" baseline).
    Observe,
    /// Paper 004's Algorithm 1.
    Paper(PaperConfig),
    /// pagefleet's guarantee policy.
    Guarantee(GuaranteeConfig),
}

/// How to run the controller.
#[derive(Clone, Debug)]
pub struct Options {
    /// The shared device.
    pub dev: Dev,
    /// Its tenants.
    pub tenants: Vec<Tenant>,
    /// The algorithm.
    pub policy: Policy,
    /// The device's cost model.
    pub model: Model,
    /// Guarantee: decision interval (paper: its cap_interval).
    pub interval: Duration,
    /// Where to publish its state.
    pub state_file: Option<PathBuf>,
    /// Stop after this long (None: until stopped).
    pub duration: Option<Duration>,
}

/// A tenant as the controller saw it last.
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
pub struct TenantState {
    /// Its name.
    pub name: String,
    /// cgroup-v1, cgroup-v2 or qmp.
    pub backend: String,
    /// Its demand on the device: the share of the device's modelled capacity
    /// its I/O used over the interval (a lower bound while it presses
    /// against a cap).
    pub demand_share: f64,
    /// Using ≥ 90% of its cap: it would take more if let.
    pub pressing_cap: bool,
    /// Bytes/s.
    pub bps: f64,
    /// IOPS.
    pub iops: f64,
    /// Mean time per request over the interval, ms (QMP only).
    pub latency_ms: Option<f64>,
    /// Its cap, bytes/s.
    pub cap_bps: Option<f64>,
    /// Its cap, IOPS.
    pub cap_iops: Option<f64>,
    /// Seconds capped so far.
    pub capped_s: f64,
    /// Below its minimum on a busy device.
    pub starved: bool,
    /// Why it could not be read or capped.
    pub error: Option<String>,
}

/// The controller's published state.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct State {
    /// The controller's process.
    pub pid: u32,
    /// Its policy.
    pub policy: String,
    /// The device.
    pub device: String,
    /// The device's cost model.
    pub model: Model,
    /// Share of the device's capacity in use.
    pub device_share_used: f64,
    /// Every tenant.
    pub tenants: Vec<TenantState>,
    /// When it was written (Unix seconds).
    pub updated_unix: u64,
}

impl HasPid for State {
    fn pid(&self) -> u32 {
        self.pid
    }
}

impl std::fmt::Display for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "policy {} on device {}: {:.0}% of the device in use",
            self.policy,
            self.device,
            self.device_share_used * 100.0
        )?;
        writeln!(
            f,
            "{:<12} {:>16} {:>8} {:>9} {:>9} {:>11} {:>10} {:>9} {:>8}",
            "tenant",
            "backend",
            "demand",
            "MB/s",
            "IOPS",
            "latency ms",
            "cap MB/s",
            "capped s",
            "starved"
        )?;
        for t in &self.tenants {
            let num = |x: Option<f64>, d: f64| {
                x.map(|x| format!("{:.1}", x / d))
                    .unwrap_or_else(|| "-".into())
            };
            // Demand as a share of the device; "+" when it presses against its cap.
            let demand = format!(
                "{:.0}%{}",
                t.demand_share * 100.0,
                if t.pressing_cap { "+" } else { "" }
            );
            writeln!(
                f,
                "{:<12} {:>16} {:>8} {:>9} {:>9} {:>11} {:>10} {:>9} {:>8}{}",
                t.name,
                t.backend,
                demand,
                num(Some(t.bps), 1e6),
                num(Some(t.iops), 1.0),
                num(t.latency_ms, 1.0),
                num(t.cap_bps, 1e6),
                num(Some(t.capped_s), 1.0),
                t.starved,
                t.error
                    .as_deref()
                    .map(|e| format!("  ({e})"))
                    .unwrap_or_default()
            )?;
        }
        writeln!(f, "(demand: share of the device's modelled capacity used; + = pressing against its cap, wants more)")?;
        Ok(())
    }
}

/// A controller as a user configures it (CLI flags or pagefleetd's
/// `[ioqos]` section), checked and turned into [`Options`].
#[derive(Clone, Debug, PartialEq)]
pub struct Spec {
    /// The shared block device (path or MAJ:MIN).
    pub device: String,
    /// NAME=LOCATION[:min=RATE][:min-iops=N][:weight=W], comma-separated.
    pub tenants: String,
    /// guarantee, paper or observe.
    pub policy: String,
    /// MAX_IOPS,MAX_BYTES_PER_S; None: calibrate with direct reads.
    pub model: Option<String>,
    /// Seconds the calibration reads.
    pub calibrate_secs: f64,
    /// guarantee: seconds between decisions.
    pub interval: f64,
    /// paper: share of the device's maximum ("90%").
    pub border: String,
    /// paper: the capped tenant gets rate x its current value.
    pub rate: f64,
    /// paper: how long a cap lasts, s.
    pub cap_time: f64,
    /// paper: seconds between decisions.
    pub cap_interval: f64,
}

/// The longest cap the paper's policy may set: a day. Longer is a typo, and
/// the controller keeps each cap's end as a `Duration` from now.
pub const MAX_CAP_TIME_S: f64 = 86_400.0;

/// The longest device calibration: ten minutes of direct reads is already
/// far past where its figures settle (a few seconds).
pub const MAX_CALIBRATE_S: f64 = 600.0;

impl Default for Spec {
    fn default() -> Spec {
        let p = PaperConfig::default();
        Spec {
            device: String::new(),
            tenants: String::new(),
            policy: "guarantee".into(),
            model: None,
            calibrate_secs: 4.0,
            interval: 1.0,
            border: format!("{}%", p.border * 100.0),
            rate: p.rate,
            cap_time: p.cap_time_s,
            cap_interval: p.cap_interval_s,
        }
    }
}

impl Spec {
    /// Everything but the device model, checked (cheap: for config validation).
    pub fn check(&self) -> Result<(Dev, Vec<Tenant>, Policy, Option<Model>)> {
        let dev = Dev::parse(&self.device)?;
        let tenants = crate::spec::parse(&self.tenants)?;
        let policy = match self.policy.as_str() {
            "guarantee" => Policy::Guarantee(GuaranteeConfig::default()),
            "observe" => Policy::Observe,
            "paper" => {
                if !(self.rate > 0.0 && self.rate < 1.0) {
                    return Err(crate::Error::Invalid(
                        "rate must be between 0 and 1 (exclusive)".to_string(),
                    ));
                }
                if !(self.cap_interval > 0.0
                    && self.cap_time > self.cap_interval
                    && self.cap_time <= MAX_CAP_TIME_S)
                {
                    return Err(crate::Error::Invalid(format!(
                        "the paper requires {MAX_CAP_TIME_S} s >= cap_time > cap_interval > 0"
                    )));
                }
                let border = pagefleet_common::units::parse_share("border", &self.border)
                    .map_err(|e| crate::Error::Invalid(e.0))?;
                Policy::Paper(PaperConfig {
                    border,
                    rate: self.rate,
                    cap_time_s: self.cap_time,
                    cap_interval_s: self.cap_interval,
                })
            }
            p => {
                return Err(crate::Error::Invalid(format!(
                    "unknown policy {p}: guarantee, paper or observe"
                )))
            }
        };
        if !(self.calibrate_secs >= 0.0 && self.calibrate_secs <= MAX_CALIBRATE_S) {
            return Err(crate::Error::Invalid(format!(
                "calibrate_secs must be between 0 and {MAX_CALIBRATE_S} seconds"
            )));
        }
        if !(self.interval > 0.0 && self.interval <= 60.0) {
            return Err(crate::Error::Invalid(
                "interval must be between 0 and 60 seconds".to_string(),
            ));
        }
        let model = match &self.model {
            Some(m) => {
                let (i, b) = m
                    .split_once(',')
                    .context("model wants MAX_IOPS,MAX_BYTES_PER_S (e.g. 2000,200MiB)")?;
                let iops: f64 = i
                    .trim()
                    .parse()
                    .ok()
                    .filter(|v: &f64| *v > 0.0 && v.is_finite())
                    .context("model: MAX_IOPS must be a positive number")?;
                let bps = crate::spec::parse_rate(b.trim())? as f64;
                if bps <= 0.0 {
                    return Err(crate::Error::Invalid(
                        "model: MAX_BYTES_PER_S must be positive".to_string(),
                    ));
                }
                Some(Model {
                    max_iops: iops,
                    max_bps: bps,
                })
            }
            None => None,
        };
        Ok((dev, tenants, policy, model))
    }

    /// Checked options; calibrates the device when no model was given.
    pub fn options(
        &self,
        state_file: Option<PathBuf>,
        duration: Option<Duration>,
    ) -> Result<Options> {
        let (dev, tenants, policy, model) = self.check()?;
        let model = match model {
            Some(m) => m,
            None => {
                let path = if self.device.starts_with('/') {
                    PathBuf::from(&self.device)
                } else {
                    PathBuf::from(format!("/dev/block/{dev}"))
                };
                info!(
                    "calibrating {} for {:.0} s (direct reads)",
                    path.display(),
                    self.calibrate_secs
                );
                calibrate(&path, self.calibrate_secs.max(0.5))?
            }
        };
        Ok(Options {
            dev,
            tenants,
            policy,
            model,
            interval: Duration::from_secs_f64(self.interval),
            state_file,
            duration,
        })
    }
}

/// Measure the device's limits with direct reads (safe on a device in use):
/// random 4 KiB at depth 16 for IOPS, sequential 1 MiB at depth 4 for bandwidth.
pub fn calibrate(path: &Path, secs: f64) -> Result<Model> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .with_context(|| format!("cannot open {} for calibration", path.display()))?;
    let size = {
        use std::io::Seek;
        let mut g = f.try_clone()?;
        g.seek(std::io::SeekFrom::End(0))?
    };
    if size < 8 << 20 {
        return Err(crate::Error::Invalid(format!(
            "{} is too small to calibrate ({} bytes)",
            path.display(),
            size
        )));
    }
    let run = |bs: usize, threads: usize, random: bool| -> Result<(f64, f64)> {
        let stop = AtomicBool::new(false);
        let t0 = Instant::now();
        let (ios, bytes) = std::thread::scope(|s| {
            let hs: Vec<_> = (0..threads)
                .map(|t| {
                    let (f, stop) = (&f, &stop);
                    s.spawn(move || -> (u64, u64) {
                        let layout = std::alloc::Layout::from_size_align(bs, 4096).unwrap();
                        // SAFETY: aligned buffer for O_DIRECT, freed below.
                        let buf = unsafe { std::alloc::alloc(layout) };
                        let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ t as u64;
                        let blocks = size / bs as u64;
                        let mut off = (t as u64 * blocks / threads as u64) * bs as u64;
                        let (mut n, mut b) = (0u64, 0u64);
                        while !stop.load(Ordering::Relaxed) {
                            if random {
                                x ^= x << 13;
                                x ^= x >> 7;
                                x ^= x << 17;
                                off = (x % blocks) * bs as u64;
                            } else {
                                off = (off + bs as u64) % (blocks * bs as u64);
                            }
                            use std::os::unix::fs::FileExt;
                            // SAFETY: buf is bs bytes.
                            let s = unsafe { std::slice::from_raw_parts_mut(buf, bs) };
                            match f.read_at(s, off) {
                                Ok(k) if k > 0 => {
                                    n += 1;
                                    b += k as u64;
                                }
                                _ => break,
                            }
                        }
                        // SAFETY: `buf` came from alloc with this layout and is freed once.
                        unsafe { std::alloc::dealloc(buf, layout) };
                        (n, b)
                    })
                })
                .collect();
            std::thread::sleep(Duration::from_secs_f64(secs / 2.0));
            stop.store(true, Ordering::Relaxed);
            hs.into_iter()
                .map(|h| h.join().unwrap_or((0, 0)))
                .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
        });
        let dt = t0.elapsed().as_secs_f64();
        Ok((ios as f64 / dt, bytes as f64 / dt))
    };
    let (iops, _) = run(4096, 16, true)?;
    let (_, bps) = run(1 << 20, 4, false)?;
    if iops < 1.0 || bps < 1.0 {
        return Err(crate::Error::Invalid(format!(
            "calibration of {} read nothing",
            path.display()
        )));
    }
    Ok(Model {
        max_iops: iops,
        max_bps: bps,
    })
}

enum Engine {
    Observe,
    Paper(Paper),
    Guarantee(Guarantee),
}

/// A cap as per-direction limits, split by the tenant's read/write mix.
fn limit(cap: &Cap, o: &Obs) -> Limit {
    let rshare = if o.iops() > 0.0 {
        (o.riops / o.iops()).clamp(0.05, 0.95)
    } else {
        0.5
    };
    let split = |v: Option<f64>, share: f64| v.map(|v| (v * share).max(1.0) as u64);
    Limit {
        rbps: split(cap.bps, rshare),
        wbps: split(cap.bps, 1.0 - rshare),
        riops: split(cap.iops, rshare),
        wiops: split(cap.iops, 1.0 - rshare),
    }
}

/// Run until `stop` is set (or the duration passes), removing every cap at the end; `on_tick` sees each state published.
pub fn run(o: &Options, stop: &AtomicBool, mut on_tick: impl FnMut(&State)) -> Result<()> {
    let state = o
        .state_file
        .as_deref()
        .map(|p| StateFile::lock::<State>(p, "I/O controller"))
        .transpose()?;
    let n = o.tenants.len();
    let mut backends: Vec<Option<Backend>> = Vec::new();
    for t in &o.tenants {
        backends.push(
            match Backend::open(&t.location).and_then(|mut b| b.attach(o.dev).map(|_| b)) {
                Ok(b) => Some(b),
                Err(e) => {
                    warn!("tenant {}: {e:#}; will retry", t.name);
                    None
                }
            },
        );
    }
    let (policy_name, mut engine, interval) = match &o.policy {
        Policy::Observe => ("observe".to_string(), Engine::Observe, o.interval),
        Policy::Paper(c) => (
            "paper".to_string(),
            Engine::Paper(Paper::new(c.clone(), o.model, n)),
            Duration::from_secs_f64(c.cap_interval_s),
        ),
        Policy::Guarantee(c) => {
            let mins = o
                .tenants
                .iter()
                .map(|t| Min {
                    bps: t.min_bps as f64,
                    iops: t.min_iops as f64,
                    weight: t.weight,
                })
                .collect();
            (
                "guarantee".to_string(),
                Engine::Guarantee(Guarantee::new(c.clone(), o.model, mins)),
                o.interval,
            )
        }
    };
    let mut last: Vec<Option<Counters>> = vec![None; n];
    let mut applied: Vec<Limit> = vec![Limit::none(); n];
    let mut st = State {
        pid: std::process::id(),
        policy: policy_name,
        device: o.dev.to_string(),
        model: o.model,
        device_share_used: 0.0,
        tenants: o
            .tenants
            .iter()
            .map(|t| TenantState {
                name: t.name.clone(),
                ..Default::default()
            })
            .collect(),
        updated_unix: 0,
    };
    let started = Instant::now();
    let mut t_last = Instant::now();
    let result = loop {
        let dt = t_last.elapsed().as_secs_f64().max(1e-3);
        t_last = Instant::now();
        let mut obs = vec![Obs::default(); n];
        for i in 0..n {
            let t = &o.tenants[i];
            if backends[i].is_none() {
                backends[i] = Backend::open(&t.location)
                    .and_then(|mut b| b.attach(o.dev).map(|_| b))
                    .ok();
            }
            let Some(b) = backends[i].as_mut() else {
                st.tenants[i].error = Some("not reachable (cgroup or QEMU gone?)".into());
                continue;
            };
            st.tenants[i].backend = b.kind().into();
            match b.read(o.dev) {
                Ok(c) => {
                    if let Some(p) = last[i] {
                        let d = |a: u64, b: u64| a.saturating_sub(b) as f64 / dt;
                        obs[i] = Obs {
                            rbps: d(c.rbytes, p.rbytes),
                            wbps: d(c.wbytes, p.wbytes),
                            riops: d(c.rios, p.rios),
                            wiops: d(c.wios, p.wios),
                        };
                        let ios = (c.rios + c.wios).saturating_sub(p.rios + p.wios);
                        st.tenants[i].latency_ms = match (c.io_time_ns, p.io_time_ns) {
                            (Some(a), Some(b)) if ios > 0 => {
                                Some(a.saturating_sub(b) as f64 / ios as f64 / 1e6)
                            }
                            _ => None,
                        };
                    }
                    last[i] = Some(c);
                    st.tenants[i].error = None;
                }
                Err(e) => {
                    if st.tenants[i].error.is_none() {
                        warn!("tenant {}: {e:#}", t.name);
                    }
                    st.tenants[i].error = Some(format!("{e:#}"));
                    backends[i] = None;
                    last[i] = None;
                }
            }
        }
        let caps: Vec<Cap> = match &mut engine {
            Engine::Observe => vec![Cap::default(); n],
            Engine::Paper(p) => p.step(&obs, dt),
            Engine::Guarantee(g) => {
                let c = g.step(&obs);
                for i in 0..n {
                    st.tenants[i].starved = g.starved[i];
                }
                c
            }
        };
        for i in 0..n {
            let l = limit(&caps[i], &obs[i]);
            // Rewrite only on a real change (5%), and always when a cap goes.
            let changed = l.is_none() != applied[i].is_none() || differs(&l, &applied[i]);
            if changed {
                if let Some(b) = backends[i].as_mut() {
                    match b.set(o.dev, &l) {
                        Ok(()) => {
                            if l.is_none() != applied[i].is_none() {
                                info!(
                                    "tenant {}: {}",
                                    o.tenants[i].name,
                                    if l.is_none() {
                                        "cap removed".to_string()
                                    } else {
                                        format!(
                                            "capped at {:.1} MB/s, {:.0} IOPS",
                                            caps[i].bps.unwrap_or(0.0) / 1e6,
                                            caps[i].iops.unwrap_or(0.0)
                                        )
                                    }
                                );
                            }
                            applied[i] = l;
                        }
                        Err(e) => warn!("tenant {}: {e:#}", o.tenants[i].name),
                    }
                }
            }
            let ts = &mut st.tenants[i];
            ts.bps = obs[i].bps();
            ts.iops = obs[i].iops();
            ts.cap_bps = caps[i].bps;
            ts.cap_iops = caps[i].iops;
            ts.demand_share = o.model.cost(&obs[i]);
            ts.pressing_cap = caps[i].bps.is_some_and(|c| obs[i].bps() >= 0.9 * c)
                || caps[i].iops.is_some_and(|c| obs[i].iops() >= 0.9 * c);
            if !caps[i].is_none() {
                ts.capped_s += dt;
            }
        }
        st.device_share_used = obs.iter().map(|x| o.model.cost(x)).sum();
        st.updated_unix = pagefleet_common::httpauth::unix_now();
        if let Some(f) = &state {
            f.publish(&st);
        }
        on_tick(&st);
        if controller::wait(interval, stop, o.duration.map(|d| started + d)) {
            break Ok(());
        }
    };
    // Nothing stays throttled (or ruled) after the controller is gone.
    for (b, t) in backends.iter_mut().zip(&o.tenants) {
        if let Some(b) = b.as_mut() {
            if let Err(e) = b.detach(o.dev) {
                warn!("tenant {}: could not remove its cap: {e:#}", t.name);
            }
        }
    }
    // The state file goes with `state` (dropped here).
    result
}

fn differs(a: &Limit, b: &Limit) -> bool {
    let f = |x: Option<u64>, y: Option<u64>| match (x, y) {
        (Some(x), Some(y)) => (x as f64 - y as f64).abs() > 0.05 * y.max(1) as f64,
        (None, None) => false,
        _ => true,
    };
    f(a.rbps, b.rbps) || f(a.wbps, b.wbps) || f(a.riops, b.riops) || f(a.wiops, b.wiops)
}
