//! `pagefleet ioqos`: keep every tenant of a shared block device at its
//! minimum (paper 004), and show what the controller sees.

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use pagefleet_ioqos::control::{self, Options, Policy, DEFAULT_STATE};
use pagefleet_ioqos::device::Dev;
use pagefleet_ioqos::policy::{GuaranteeConfig, Model, PaperConfig};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

#[derive(Subcommand)]
pub enum IoqosCmd {
    /// Run the controller until interrupted (root). Tenants are cgroups
    /// (v1 blkio or v2 io) or QEMU drives (qmp:SOCKET@DRIVE):
    ///
    ///   pagefleet ioqos run --device /dev/loop0 \
    ///     --tenants 'a=tenants/a:min=20MiB,b=tenants/b:min=20MiB,c=qmp:/run/vm3.sock@drive0:min=5MiB:weight=2'
    ///
    /// guarantee (default): caps only tenants above their entitled share while
    /// another is starved below its minimum on a busy device, releases caps
    /// gradually; load is device cost (IOPS x per-I/O cost + bytes x per-byte
    /// cost, calibrated with direct reads at startup, or --model).
    /// paper: Algorithm 1 of paper 004 (border, rate, cap-time, cap-interval).
    /// observe: measure only. Every cap is removed on exit.
    #[command(verbatim_doc_comment)]
    Run(RunOpts),
    /// Per tenant: throughput, IOPS, latency (QEMU drives), current cap,
    /// time capped, starved; from the running controller.
    Status {
        #[arg(long)]
        json: bool,
        #[arg(long, default_value = DEFAULT_STATE)]
        state: PathBuf,
    },
}

#[derive(Args)]
pub struct RunOpts {
    /// The shared block device (path or MAJ:MIN).
    #[arg(long)]
    device: String,
    /// NAME=LOCATION[:min=RATE][:min-iops=N][:weight=W], comma-separated.
    #[arg(long)]
    tenants: String,
    /// guarantee, paper or observe.
    #[arg(long, default_value = "guarantee")]
    policy: String,
    /// The device's capacity as MAX_IOPS,MAX_BYTES_PER_S (e.g. 2000,200MiB)
    /// instead of calibrating it with direct reads at startup.
    #[arg(long)]
    model: Option<String>,
    /// Seconds of calibration.
    #[arg(long, default_value_t = 4.0)]
    calibrate_secs: f64,
    /// guarantee: seconds between decisions.
    #[arg(long, default_value_t = 1.0)]
    interval: f64,
    /// paper: border as a share of the device's maximum.
    #[arg(long, default_value = "90%")]
    border: String,
    /// paper: the capped tenant gets rate x its current value.
    #[arg(long, default_value_t = 0.5)]
    rate: f64,
    /// paper: how long a cap lasts, seconds.
    #[arg(long, default_value_t = 60.0)]
    cap_time: f64,
    /// paper: seconds between decisions.
    #[arg(long, default_value_t = 5.0)]
    cap_interval: f64,
    /// Stop after this many seconds (0: until interrupted).
    #[arg(long, default_value_t = 0.0)]
    duration: f64,
    #[arg(long, default_value = DEFAULT_STATE)]
    state: PathBuf,
}

static STOP: AtomicBool = AtomicBool::new(false);
extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

fn share(what: &str, s: &str) -> Result<f64> {
    pagefleet_ksm::parse_share(what, s)
}

pub fn options(o: &RunOpts) -> Result<Options> {
    let dev = Dev::parse(&o.device)?;
    let tenants = pagefleet_ioqos::spec::parse(&o.tenants)?;
    let policy = match o.policy.as_str() {
        "guarantee" => Policy::Guarantee(GuaranteeConfig::default()),
        "observe" => Policy::Observe,
        "paper" => {
            if !(o.rate > 0.0 && o.rate < 1.0) {
                bail!("--rate must be between 0 and 1 (exclusive)");
            }
            if !(o.cap_interval > 0.0 && o.cap_time > o.cap_interval) {
                bail!("the paper requires cap_time > cap_interval > 0");
            }
            Policy::Paper(PaperConfig {
                border: share("--border", &o.border)?,
                rate: o.rate,
                cap_time_s: o.cap_time,
                cap_interval_s: o.cap_interval,
            })
        }
        p => bail!("unknown --policy {p}: guarantee, paper or observe"),
    };
    if !(o.interval > 0.0 && o.interval <= 60.0) {
        bail!("--interval must be between 0 and 60 seconds");
    }
    if o.duration.is_nan() || o.duration < 0.0 {
        bail!("--duration must not be negative");
    }
    let model = match &o.model {
        Some(m) => {
            let (i, b) = m
                .split_once(',')
                .context("--model wants MAX_IOPS,MAX_BYTES_PER_S (e.g. 2000,200MiB)")?;
            let iops: f64 = i
                .trim()
                .parse()
                .ok()
                .filter(|v: &f64| *v > 0.0)
                .context("--model: MAX_IOPS must be a positive number")?;
            let bps = pagefleet_ioqos::spec::parse_rate(b)? as f64;
            if bps <= 0.0 {
                bail!("--model: MAX_BYTES_PER_S must be positive");
            }
            Model {
                max_iops: iops,
                max_bps: bps,
            }
        }
        None => {
            let path = if o.device.starts_with('/') {
                PathBuf::from(&o.device)
            } else {
                PathBuf::from(format!("/dev/block/{dev}"))
            };
            eprintln!(
                "calibrating {} for {:.0} s (direct reads)...",
                path.display(),
                o.calibrate_secs
            );
            let m = control::calibrate(&path, o.calibrate_secs.max(0.5))?;
            eprintln!(
                "device model: {:.0} IOPS (4 KiB random), {:.1} MB/s (1 MiB sequential)",
                m.max_iops,
                m.max_bps / 1e6
            );
            m
        }
    };
    Ok(Options {
        dev,
        tenants,
        policy,
        model,
        interval: Duration::from_secs_f64(o.interval),
        state_file: Some(o.state.clone()),
        duration: (o.duration > 0.0).then(|| Duration::from_secs_f64(o.duration)),
    })
}

pub fn main(c: IoqosCmd) -> Result<()> {
    match c {
        IoqosCmd::Run(o) => {
            tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::new(
                    std::env::var("PAGEFLEET_LOG").unwrap_or_else(|_| "info".into()),
                ))
                .with_writer(std::io::stderr)
                .init();
            let opts = options(&o)?;
            // SAFETY: the handler only stores to an atomic.
            unsafe {
                libc::signal(libc::SIGINT, on_signal as *const () as usize);
                libc::signal(libc::SIGTERM, on_signal as *const () as usize);
            }
            control::run(&opts, &STOP, |_| {})
        }
        IoqosCmd::Status { json, state } => {
            let v: serde_json::Value = std::fs::read(&state)
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok())
                .filter(|v: &serde_json::Value| {
                    v["pid"]
                        .as_u64()
                        .is_some_and(|p| std::path::Path::new(&format!("/proc/{p}")).exists())
                })
                .with_context(|| {
                    format!(
                        "no I/O controller is running (no fresh state at {})",
                        state.display()
                    )
                })?;
            if json {
                println!("{}", serde_json::to_string_pretty(&v)?);
                return Ok(());
            }
            println!(
                "policy {} on device {}: {:.0}% of the device in use",
                v["policy"].as_str().unwrap_or("?"),
                v["device"].as_str().unwrap_or("?"),
                v["device_share_used"].as_f64().unwrap_or(0.0) * 100.0
            );
            println!(
                "{:<12} {:>16} {:>9} {:>11} {:>14} {:>11} {:>9} {:>8}",
                "tenant",
                "backend",
                "MB/s",
                "IOPS",
                "latency ms",
                "cap MB/s",
                "capped s",
                "starved"
            );
            for t in v["tenants"].as_array().into_iter().flatten() {
                let f = |k: &str, d: f64| {
                    t[k].as_f64()
                        .map(|x| format!("{:.1}", x / d))
                        .unwrap_or_else(|| "-".into())
                };
                println!(
                    "{:<12} {:>16} {:>9} {:>11} {:>14} {:>11} {:>9} {:>8}{}",
                    t["name"].as_str().unwrap_or("?"),
                    t["backend"].as_str().unwrap_or("?"),
                    f("bps", 1e6),
                    f("iops", 1.0),
                    f("latency_ms", 1.0),
                    f("cap_bps", 1e6),
                    f("capped_s", 1.0),
                    t["starved"],
                    t["error"]
                        .as_str()
                        .map(|e| format!("  ({e})"))
                        .unwrap_or_default()
                );
            }
            Ok(())
        }
    }
}
