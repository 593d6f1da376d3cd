//! `pagefleet ksm`: run the same-page-merging controller, show KSM's state,
//! enrol running processes.

use crate::control::{self, Options, DEFAULT_STATE};
use crate::Result;
use clap::{Args, Subcommand};
use std::path::PathBuf;
use std::time::Duration;

/// `pagefleet ksm`.
#[derive(Subcommand)]
pub enum Command {
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
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// Seconds over which ksmd's CPU share is measured.
        #[arg(long, default_value_t = 1.0)]
        window: f64,
        /// The running controller's state file.
        #[arg(long, default_value = DEFAULT_STATE)]
        state: PathBuf,
    },
    /// Make running processes' memory mergeable: PIDs, or cgroup directories
    /// (every process in cgroup.procs). Root; uses ptrace to have the process
    /// call prctl(PR_SET_MEMORY_MERGE) itself. New processes: `pagefleet run --merge -- CMD`.
    Enroll {
        /// PIDs or cgroups (paths, or names under /sys/fs/cgroup).
        #[arg(required = true)]
        targets: Vec<String>,
    },
}

/// `pagefleet ksm run` flags.
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

/// The controller's options from the flags.
pub fn options(o: &RunOpts) -> Result<Options> {
    if o.duration.is_nan() || o.duration < 0.0 {
        return Err(crate::Error::Invalid(
            "--duration must not be negative".to_string(),
        ));
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

/// Carry out a `pagefleet ksm` command.
pub fn main(c: Command) -> Result<()> {
    match c {
        Command::Run(o) => {
            let opts = options(&o)?;
            control::run(&opts, pagefleet_common::signal::stop_flag(), |_| {})
        }
        Command::Status {
            json,
            window,
            state,
        } => {
            if !(window > 0.0 && window <= 60.0) {
                return Err(crate::Error::Invalid(
                    "--window must be between 0 and 60 seconds".to_string(),
                ));
            }
            let v = control::status(Duration::from_secs_f64(window), &state)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
                return Ok(());
            }
            print!("{v}");
            Ok(())
        }
        Command::Enroll { targets } => {
            for t in targets {
                if let Ok(pid) = t.parse::<u32>() {
                    crate::enroll::enroll_pid(pid)?;
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
                let pids = crate::enroll::enroll_cgroup(&dir)?;
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
