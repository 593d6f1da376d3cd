//! The controller loop: a policy (ksmtuned or adaptive) applied to the real
//! /sys/kernel/mm/ksm every tick, its state published in a JSON file for
//! `pagefleet ksm status`, and the host's settings put back on exit.

use crate::adaptive::{Adaptive, AdaptiveConfig};
use crate::swapin::{self, Sweep};
use crate::sysfs::{self, Memory, Settings, Stats};
use crate::tuned::{self, Action, Tuned, TunedConfig};
use crate::{Error, Result};
use pagefleet_common::controller::{self, HasPid, StateFile};
use pagefleet_common::units::parse_share;
use serde::Serialize;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};
use tracing::{info, warn};

/// Share of a tick a sweep of swapped-out pages may work (the rest of it
/// the controller sleeps, and the swap-ins it caused settle).
const SWEEP_SHARE: f64 = 0.3;

/// Where a controller publishes its state by default.
pub const DEFAULT_STATE: &str = "/run/pagefleet/ksm.json";

/// Which controller.
#[derive(Clone, Debug)]
pub enum Policy {
    /// pagefleet's adaptive controller.
    Adaptive(AdaptiveConfig),
    /// ksmtuned's script; `monitor_interval_s` already scaled.
    Ksmtuned(TunedConfig),
}

/// How to run a controller.
#[derive(Clone, Debug)]
pub struct Options {
    /// Which controller.
    pub policy: Policy,
    /// Adaptive: seconds between decisions.
    pub tick: Duration,
    /// Leave KSM as the controller last set it instead of restoring.
    pub keep_settings: bool,
    /// Where to publish its state (None: nowhere).
    pub state_file: Option<PathBuf>,
    /// Stop by itself after this long (None: until stopped).
    pub duration: Option<Duration>,
}

/// A controller as users describe it (CLI flags, pagefleetd's [ksm] section).
#[derive(Clone, Debug, PartialEq)]
pub struct Spec {
    /// "adaptive" or "ksmtuned".
    pub mode: String,
    /// ksmtuned: factor on its 60 s monitor interval.
    pub interval_scale: f64,
    /// adaptive: "10%" or "0.1".
    pub cpu_budget: String,
    /// adaptive: the MemAvailable share that counts as pressure.
    pub pressure_below: String,
    /// adaptive: PSI memory some avg10 above this is pressure.
    pub psi_above: f64,
    /// adaptive: seconds between decisions.
    pub tick_s: f64,
}

impl Default for Spec {
    fn default() -> Self {
        Spec {
            mode: "adaptive".into(),
            interval_scale: 1.0,
            cpu_budget: "10%".into(),
            pressure_below: "20%".into(),
            psi_above: 10.0,
            tick_s: 1.0,
        }
    }
}

impl Spec {
    /// Checked options (clear errors for bad values).
    pub fn options(
        &self,
        state_file: Option<PathBuf>,
        keep_settings: bool,
        duration: Option<Duration>,
    ) -> Result<Options> {
        if !(self.tick_s > 0.0 && self.tick_s <= 600.0) {
            return Err(crate::Error::Invalid(
                "--tick must be between 0 and 600 seconds".to_string(),
            ));
        }
        let policy = match self.mode.as_str() {
            "adaptive" => Policy::Adaptive(AdaptiveConfig {
                cpu_budget: parse_share("--cpu-budget", &self.cpu_budget)
                    .map_err(|e| Error::Invalid(e.0))?,
                pressure_below: parse_share("--pressure-below", &self.pressure_below)
                    .map_err(|e| Error::Invalid(e.0))?,
                psi_above: self.psi_above,
                ..Default::default()
            }),
            "ksmtuned" => {
                if !(self.interval_scale > 0.0 && self.interval_scale <= 100.0) {
                    return Err(crate::Error::Invalid(
                        "--interval-scale must be positive (the paper uses 0.5, 1 and 2)"
                            .to_string(),
                    ));
                }
                let base = TunedConfig::default();
                Policy::Ksmtuned(TunedConfig {
                    monitor_interval_s: base.monitor_interval_s * self.interval_scale,
                    ..base
                })
            }
            m => {
                return Err(crate::Error::Invalid(format!(
                    "unknown --mode {m}: adaptive or ksmtuned"
                )))
            }
        };
        Ok(Options {
            policy,
            tick: Duration::from_secs_f64(self.tick_s),
            keep_settings,
            state_file,
            duration,
        })
    }
}

/// What the state file holds.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct State {
    /// The controller's process.
    pub pid: u32,
    /// Its policy.
    pub policy: String,
    /// Its phase.
    pub phase: String,
    /// KSM running.
    pub run: bool,
    /// pages_to_scan set.
    pub pages_to_scan: u64,
    /// sleep_millisecs set.
    pub sleep_millisecs: u64,
    /// The scan rate set, pages/s.
    pub scan_rate: f64,
    /// Why, for a person.
    pub why: String,
    /// Memory pressure seen.
    pub pressure: bool,
    /// ksmd's CPU share.
    pub ksmd_cpu_share: f64,
    /// ksmd's nice value.
    pub ksmd_nice: i32,
    /// Memory KSM saves.
    pub saved_bytes: u64,
    /// Adaptive: merged memory lost since it started (the sum of every
    /// tick's fall in memory saved: merged pages swapped out and back in as
    /// copies, or unmerged by a write).
    #[serde(default)]
    pub lost_bytes: u64,
    /// Adaptive: pages are being swapped in.
    #[serde(default)]
    pub paging: bool,
    /// Decisions so far.
    pub decisions: u64,
    /// When it was written (Unix seconds).
    pub updated_unix: u64,
}

impl HasPid for State {
    fn pid(&self) -> u32 {
        self.pid
    }
}

fn apply(run: bool, pages: u64, sleep: u64) -> Result<()> {
    if run {
        sysfs::write("pages_to_scan", &pages.to_string())?;
        sysfs::write("sleep_millisecs", &sleep.to_string())?;
        if sysfs::read_u64("run")? != 1 {
            sysfs::write("run", "1")?;
        }
    } else if sysfs::read_u64("run")? != 0 {
        sysfs::write("run", "0")?;
    }
    Ok(())
}

/// Puts the saved settings back when dropped (also on panic).
struct Restore(Option<Settings>);
impl Drop for Restore {
    fn drop(&mut self) {
        if let Some(s) = self.0.take() {
            match s.restore() {
                Ok(()) => info!(
                    "KSM settings restored (run={}, pages_to_scan={}, sleep_millisecs={})",
                    s.run, s.pages_to_scan, s.sleep_millisecs
                ),
                Err(e) => warn!("could not restore KSM settings: {e:#}"),
            }
        }
    }
}

/// Run until `stop` is set (or the duration passes). `on_decision` sees
/// every state published (the CLI prints changes).
pub fn run(o: &Options, stop: &AtomicBool, mut on_decision: impl FnMut(&State)) -> Result<()> {
    sysfs::available()?;
    let state = o
        .state_file
        .as_deref()
        .map(|p| {
            StateFile::lock::<State>(
                p,
                "KSM controller (two would fight over /sys/kernel/mm/ksm)",
            )
        })
        .transpose()?;
    let publish = |st: &State| {
        if let Some(f) = &state {
            f.publish(st)
        }
    };
    let saved = Settings::save()?;
    // Check we may write before deciding anything (clear error for non-root).
    sysfs::write("pages_to_scan", &saved.pages_to_scan.to_string())
        .map_err(|e| Error::Invalid(format!("the KSM controller must run as root: {e}")))?;
    let _restore = Restore((!o.keep_settings).then_some(saved));
    let end = o.duration.map(|d| Instant::now() + d);
    let mut st = State {
        pid: std::process::id(),
        policy: String::new(),
        phase: String::new(),
        run: false,
        pages_to_scan: 0,
        sleep_millisecs: 0,
        scan_rate: 0.0,
        why: String::new(),
        pressure: false,
        ksmd_cpu_share: 0.0,
        ksmd_nice: sysfs::ksmd_nice().unwrap_or(sysfs::KSMD_DEFAULT_NICE),
        saved_bytes: 0,
        lost_bytes: 0,
        paging: false,
        decisions: 0,
        updated_unix: 0,
    };
    let result = match &o.policy {
        Policy::Adaptive(cfg) => {
            st.policy = "adaptive".into();
            // The kernel's advisor would fight over pages_to_scan; smart_scan saves CPU.
            let _ = sysfs::write("advisor_mode", "none");
            let _ = sysfs::write("smart_scan", "1");
            let mut a = Adaptive::new(cfg.clone());
            let mut nice = sysfs::ksmd_nice().unwrap_or(sysfs::KSMD_DEFAULT_NICE);
            let mut last = Instant::now();
            let mut prev_why = String::new();
            let mut prev_phase = String::new();
            let mut sweep: Option<Sweep> = None;
            let mut smart_scan = true;
            loop {
                let s = Stats::read()?;
                let m = Memory::read()?;
                let dt = last.elapsed().as_secs_f64();
                last = Instant::now();
                let mut d = a.step(&s, &m, dt);
                if let Err(e) = apply(d.run, d.pages_to_scan, d.sleep_millisecs) {
                    warn!("{e:#}");
                }
                // A sweep runs in part of each tick while the controller
                // asks for it, and is dropped once it moves on.
                if !d.sweep {
                    sweep = None;
                } else {
                    let sw = sweep.get_or_insert_with(|| {
                        let sw = Sweep::new(swapin::find_areas());
                        info!(
                            "{} (found {} MiB in swap in mergeable memory)",
                            d.why,
                            sw.progress().found_pages >> 8
                        );
                        sw
                    });
                    sw.step(Instant::now() + o.tick.mul_f64(SWEEP_SHARE));
                    if sw.is_done() {
                        let p = sw.progress();
                        sweep = None;
                        info!(
                            "sweep done: {} MiB brought back in ({} MiB duplicates among them), {} areas left where there was no room",
                            p.brought_pages >> 8,
                            p.duplicate_pages >> 8,
                            p.full_areas
                        );
                        // Read after the sweep's last slice: its swap-ins
                        // are its own, not the tenants'.
                        let m = Memory::read()?;
                        if let Some(d2) = a.swept(&p, &s, &m) {
                            if let Err(e) = apply(d2.run, d2.pages_to_scan, d2.sleep_millisecs) {
                                warn!("{e:#}");
                            }
                            d = d2;
                        }
                    }
                }
                if d.ksmd_nice != nice {
                    match sysfs::set_ksmd_nice(d.ksmd_nice) {
                        Ok(()) => nice = d.ksmd_nice,
                        Err(e) => warn!("{e:#}"),
                    }
                }
                st.phase = format!("{:?}", d.phase).to_lowercase();
                st.run = d.run;
                st.pages_to_scan = d.pages_to_scan;
                st.sleep_millisecs = d.sleep_millisecs;
                st.scan_rate = if d.run {
                    d.pages_to_scan as f64 * 1000.0 / d.sleep_millisecs as f64
                } else {
                    0.0
                };
                st.why = d.why.clone();
                st.pressure = a.pressure;
                st.ksmd_cpu_share = a.cpu_share;
                st.ksmd_nice = nice;
                st.saved_bytes = s.saved();
                st.lost_bytes = a.lost_pages() * sysfs::PAGE;
                st.paging = a.paging();
                st.decisions += 1;
                st.updated_unix = pagefleet_common::httpauth::unix_now();
                publish(&st);
                if st.phase != prev_phase {
                    info!(
                        "{} (scan {:.0} pages/s, ksmd {:.1}% CPU, saved {} MiB, lost {} MiB{})",
                        d.why,
                        st.scan_rate,
                        a.cpu_share * 100.0,
                        s.saved() >> 20,
                        st.lost_bytes >> 20,
                        if st.paging { ", paging" } else { "" }
                    );
                    prev_phase = st.phase.clone();
                } else if d.why != prev_why {
                    tracing::debug!(
                        "{} (scan {:.0} pages/s, ksmd {:.1}% CPU, saved {} MiB, lost {} MiB{})",
                        d.why,
                        st.scan_rate,
                        a.cpu_share * 100.0,
                        s.saved() >> 20,
                        st.lost_bytes >> 20,
                        if st.paging { ", paging" } else { "" }
                    );
                }
                prev_why = d.why;
                if d.smart_scan != smart_scan {
                    // Kernels before 6.7 have no smart_scan: nothing to switch.
                    let _ = sysfs::write("smart_scan", if d.smart_scan { "1" } else { "0" });
                    smart_scan = d.smart_scan;
                }
                on_decision(&st);
                if controller::wait(o.tick, stop, end) {
                    break Ok(());
                }
            }
        }
        Policy::Ksmtuned(cfg) => {
            st.policy = format!("ksmtuned (every {:.0} s)", cfg.monitor_interval_s);
            let mut t = Tuned::new(cfg.clone());
            st.phase = "waiting".into();
            st.why = "ksmtuned sleeps a monitor interval before its first adjust".into();
            publish(&st);
            loop {
                if controller::wait(Duration::from_secs_f64(cfg.monitor_interval_s), stop, end) {
                    break Ok(());
                }
                let m = Memory::read()?;
                let committed = tuned::committed_kb();
                let a = t.adjust(&m, committed);
                let (run, p, s) = match a {
                    Action::Stop => (false, 0, 0),
                    Action::Start {
                        pages_to_scan,
                        sleep_millisecs,
                    } => (true, pages_to_scan, sleep_millisecs),
                };
                if let Err(e) = apply(run, p, s) {
                    warn!("{e:#}");
                }
                let thres = t.thres_kb(m.total_kb);
                st.phase = if run {
                    "running".into()
                } else {
                    "stopped".into()
                };
                st.run = run;
                st.pages_to_scan = p;
                st.sleep_millisecs = s;
                st.scan_rate = if run {
                    p as f64 * 1000.0 / s as f64
                } else {
                    0.0
                };
                st.why = match a {
                    Action::Stop => format!("committed {committed} kB + thres {thres} kB < total and free {} kB > thres: stop", m.free_kb),
                    Action::Start { .. } if m.free_kb < thres => format!("free {} kB < thres {thres} kB: boost", m.free_kb),
                    Action::Start { .. } => format!("free {} kB > thres {thres} kB: decay", m.free_kb),
                };
                st.pressure = m.free_kb < thres;
                st.saved_bytes = Stats::read().map(|s| s.saved()).unwrap_or(0);
                st.decisions += 1;
                st.updated_unix = pagefleet_common::httpauth::unix_now();
                publish(&st);
                info!("{}", st.why);
                on_decision(&st);
            }
        }
    };
    // The state file goes with `state` (dropped here).
    result
}

/// What `pagefleet ksm status` shows (its `--json`).
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct Status {
    /// KSM run (1: running).
    pub run: u64,
    /// Memory saved, MiB.
    pub saved_mib: f64,
    /// The kernel's general_profit, MiB.
    pub general_profit_mib: f64,
    /// KSM pages in use.
    pub pages_shared: u64,
    /// Sites sharing them.
    pub pages_sharing: u64,
    /// Pages checked, unique.
    pub pages_unshared: u64,
    /// Pages changing too fast.
    pub pages_volatile: u64,
    /// Zero pages merged.
    pub ksm_zero_pages: u64,
    /// Full scans done.
    pub full_scans: u64,
    /// ksmd's CPU, % of a core.
    pub ksmd_cpu_percent: f64,
    /// Time ksmd waited for a CPU, %.
    pub ksmd_wait_percent: f64,
    /// ksmd's nice value.
    pub ksmd_nice: Option<i32>,
    /// pages_to_scan set.
    pub pages_to_scan: u64,
    /// sleep_millisecs set.
    pub sleep_millisecs: u64,
    /// Scan rate, pages/s.
    pub scan_rate_pages_per_s: f64,
    /// The kernel's scan-time advisor mode.
    pub advisor_mode: Option<String>,
    /// smart_scan setting.
    pub smart_scan: Option<u64>,
    /// MemAvailable, % of MemTotal.
    pub mem_available_percent: f64,
    /// PSI memory some avg10.
    pub psi_memory_some_avg10: Option<f64>,
    /// The running controller's state, if one runs (its state file is fresh).
    pub controller: Option<State>,
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let opt = |o: Option<String>| o.unwrap_or_else(|| "?".into());
        writeln!(
            f,
            "KSM           {}",
            if self.run == 1 { "running" } else { "stopped" }
        )?;
        writeln!(
            f,
            "saved         {:.1} MiB   (general_profit {:.1} MiB)",
            self.saved_mib, self.general_profit_mib
        )?;
        writeln!(
            f,
            "pages         shared {}  sharing {}  unshared {}  volatile {}  zero {}",
            self.pages_shared,
            self.pages_sharing,
            self.pages_unshared,
            self.pages_volatile,
            self.ksm_zero_pages
        )?;
        writeln!(f, "full scans    {}", self.full_scans)?;
        writeln!(
            f,
            "ksmd CPU      {:.1}% of a core, waiting for a CPU {:.0}% of the time, nice {}",
            self.ksmd_cpu_percent,
            self.ksmd_wait_percent,
            opt(self.ksmd_nice.map(|n| n.to_string()))
        )?;
        writeln!(
            f,
            "scan rate     {:.0} pages/s  (pages_to_scan {}, sleep {} ms, advisor {}, smart_scan {})",
            self.scan_rate_pages_per_s,
            self.pages_to_scan,
            self.sleep_millisecs,
            opt(self.advisor_mode.clone()),
            opt(self.smart_scan.map(|n| n.to_string()))
        )?;
        writeln!(
            f,
            "memory        {:.1}% available, PSI some avg10 {}",
            self.mem_available_percent,
            opt(self.psi_memory_some_avg10.map(|p| p.to_string()))
        )?;
        match &self.controller {
            Some(c) => writeln!(
                f,
                "controller    {} (pid {}): {}, {}",
                c.policy, c.pid, c.phase, c.why
            ),
            None => writeln!(f, "controller    none running"),
        }
    }
}

/// `pagefleet ksm status`: the counters, ksmd's CPU share over `window`, and
/// the running controller's state (if its state file is fresh).
pub fn status(window: Duration, state_file: &std::path::Path) -> Result<Status> {
    sysfs::available()?;
    let a = Stats::read()?;
    let t0 = Instant::now();
    std::thread::sleep(window);
    let b = Stats::read()?;
    let secs = t0.elapsed().as_secs_f64();
    let m = Memory::read()?;
    let controller = controller::read_live::<State>(state_file);
    Ok(Status {
        run: b.run,
        saved_mib: b.saved() as f64 / 1048576.0,
        general_profit_mib: b.general_profit as f64 / 1048576.0,
        pages_shared: b.pages_shared,
        pages_sharing: b.pages_sharing,
        pages_unshared: b.pages_unshared,
        pages_volatile: b.pages_volatile,
        ksm_zero_pages: b.ksm_zero_pages,
        full_scans: b.full_scans,
        ksmd_cpu_percent: (b.ksmd_cpu - a.ksmd_cpu) / secs * 100.0,
        ksmd_wait_percent: (b.ksmd_wait - a.ksmd_wait) / secs * 100.0,
        ksmd_nice: sysfs::ksmd_nice().ok(),
        pages_to_scan: b.pages_to_scan,
        sleep_millisecs: b.sleep_millisecs,
        scan_rate_pages_per_s: b.scan_rate(),
        advisor_mode: sysfs::selected("advisor_mode").ok(),
        smart_scan: sysfs::read_u64("smart_scan").ok(),
        mem_available_percent: m.available_frac() * 100.0,
        psi_memory_some_avg10: m.psi_some10,
        controller,
    })
}
