//! `pagefleet ksm`: run the same-page-merging controller, show KSM's state,
//! enrol running processes.

use anyhow::{bail, Result};
use clap::{Args, Subcommand};
use pagefleet_ksm::control::{self, Options, DEFAULT_STATE};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Subcommand)]
pub enum KsmCmd {
    /// Run the KSM controller until interrupted (root). Adaptive (default):
    /// scans faster while merging saves memory per ksmd CPU-second, within a
    /// CPU budget; idles once a pass saves less than it cost; turns KSM off
    /// without memory pressure. ksmtuned: Debian's ksmtuned algorithm and
    /// defaults, with the paper's interval factor. The host's KSM settings
    /// are put back on exit (Ctrl-C, SIGTERM, --duration) unless --keep-settings.
    ///
    /// Example: pagefleet ksm run
    ///          pagefleet ksm run --mode ksmtuned --interval-scale 0.5
    #[command(verbatim_doc_comment)]
    Run(RunOpts),
    /// KSM's counters (saved MiB, general_profit, pages shared/sharing/
    /// unshared/volatile, full scans), ksmd's CPU share over --window, the
    /// scan rate and the running controller's phase.
    Status {
        #[arg(long)]
        json: bool,
        /// Seconds over which ksmd's CPU share is measured.
        #[arg(long, default_value_t = 1.0)]
        window: f64,
        #[arg(long, default_value = DEFAULT_STATE)]
        state: PathBuf,
    },
    /// Make running processes' memory mergeable: PIDs, or cgroup directories
    /// (every process in cgroup.procs). Root; uses ptrace to have the process
    /// call prctl(PR_SET_MEMORY_MERGE) itself. New processes: `pagefleet run --merge -- CMD`.
    Enroll {
        #[arg(required = true)]
        targets: Vec<String>,
    },
}

#[derive(Args)]
pub struct RunOpts {
    /// adaptive or ksmtuned.
    #[arg(long, default_value = "adaptive")]
    mode: String,
    /// ksmtuned: multiply its 60 s monitor interval (the paper compares 0.5, 1, 2).
    #[arg(long, default_value_t = 1.0)]
    interval_scale: f64,
    /// adaptive: ksmd's CPU budget, share of one core (10% or 0.1).
    #[arg(long, default_value = "10%")]
    cpu_budget: String,
    /// adaptive: memory pressure when MemAvailable is below this share of MemTotal.
    #[arg(long, default_value = "20%")]
    pressure_below: String,
    /// adaptive: memory pressure when PSI memory "some" avg10 exceeds this (percent).
    #[arg(long, default_value_t = 10.0)]
    psi_above: f64,
    /// adaptive: seconds between decisions.
    #[arg(long, default_value_t = 1.0)]
    tick: f64,
    /// Leave KSM as the controller last set it when it exits.
    #[arg(long)]
    keep_settings: bool,
    /// Stop after this many seconds (0: until interrupted).
    #[arg(long, default_value_t = 0.0)]
    duration: f64,
    /// Where the controller publishes its state for `pagefleet ksm status`.
    #[arg(long, default_value = DEFAULT_STATE)]
    state: PathBuf,
}


pub fn options(o: &RunOpts) -> Result<Options> {
    if o.duration.is_nan() || o.duration < 0.0 {
        bail!("--duration must not be negative");
    }
    let spec = control::Spec {
        mode: o.mode.clone(),
        interval_scale: o.interval_scale,
        cpu_budget: o.cpu_budget.clone(),
        pressure_below: o.pressure_below.clone(),
        psi_above: o.psi_above,
        tick_s: o.tick,
    };
    spec.options(
        Some(o.state.clone()),
        o.keep_settings,
        (o.duration > 0.0).then(|| Duration::from_secs_f64(o.duration)),
    )
}

pub fn main(c: KsmCmd) -> Result<()> {
    match c {
        KsmCmd::Run(o) => {
            let opts = options(&o)?;
            tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::new(
                    std::env::var("PAGEFLEET_LOG").unwrap_or_else(|_| "info".into()),
                ))
                .with_writer(std::io::stderr)
                .init();
            control::run(&opts, pagefleet_common::signal::stop_flag(), |_| {})
        }
        KsmCmd::Status {
            json,
            window,
            state,
        } => {
            if !(window > 0.0 && window <= 60.0) {
                bail!("--window must be between 0 and 60 seconds");
            }
            let v = control::status(Duration::from_secs_f64(window), &state)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&v)?);
                return Ok(());
            }
            let opt = |o: Option<String>| o.unwrap_or_else(|| "?".into());
            println!(
                "KSM           {}",
                if v.run == 1 { "running" } else { "stopped" }
            );
            println!(
                "saved         {:.1} MiB   (general_profit {:.1} MiB)",
                v.saved_mib, v.general_profit_mib
            );
            println!(
                "pages         shared {}  sharing {}  unshared {}  volatile {}  zero {}",
                v.pages_shared, v.pages_sharing, v.pages_unshared, v.pages_volatile, v.ksm_zero_pages
            );
            println!("full scans    {}", v.full_scans);
            println!(
                "ksmd CPU      {:.1}% of a core, waiting for a CPU {:.0}% of the time, nice {}",
                v.ksmd_cpu_percent,
                v.ksmd_wait_percent,
                opt(v.ksmd_nice.map(|n| n.to_string()))
            );
            println!(
                "scan rate     {:.0} pages/s  (pages_to_scan {}, sleep {} ms, advisor {}, smart_scan {})",
                v.scan_rate_pages_per_s,
                v.pages_to_scan,
                v.sleep_millisecs,
                opt(v.advisor_mode.clone()),
                opt(v.smart_scan.map(|n| n.to_string()))
            );
            println!(
                "memory        {:.1}% available, PSI some avg10 {}",
                v.mem_available_percent,
                opt(v.psi_memory_some_avg10.map(|p| p.to_string()))
            );
            match &v.controller {
                Some(c) => println!(
                    "controller    {} (pid {}): {}, {}",
                    c.policy, c.pid, c.phase, c.why
                ),
                None => println!("controller    none running"),
            }
            Ok(())
        }
        KsmCmd::Enroll { targets } => {
            for t in targets {
                if let Ok(pid) = t.parse::<u32>() {
                    pagefleet_ksm::enroll::enroll_pid(pid)?;
                    println!("process {pid}: enrolled");
                    continue;
                }
                let p = PathBuf::from(&t);
                let dir = if p.is_absolute() {
                    p
                } else {
                    [
                        "/sys/fs/cgroup",
                        "/sys/fs/cgroup/memory",
                        "/sys/fs/cgroup/pids",
                    ]
                    .iter()
                    .map(|r| PathBuf::from(r).join(&t))
                    .find(|d| d.join("cgroup.procs").exists())
                    .unwrap_or(p)
                };
                let pids = pagefleet_ksm::enroll::enroll_cgroup(&dir)?;
                println!(
                    "cgroup {}: {} processes enrolled",
                    dir.display(),
                    pids.len()
                );
            }
            Ok(())
        }
    }
}
