//! `pagefleet ioqos`: keep every tenant of a shared block device at its
//! minimum (paper 004), and show what the controller sees.

use crate::control::{self, Options, DEFAULT_STATE};
use crate::error::{Context, Result};
use clap::{Args, Subcommand};
use std::path::PathBuf;
use std::time::Duration;

/// `pagefleet ioqos`.
#[derive(Subcommand)]
pub enum Command {
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
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// The running controller's state file.
        #[arg(long, default_value = DEFAULT_STATE)]
        state: PathBuf,
    },
    /// A slow shared disk with one FIFO queue (for trying the controllers
    /// where parallelism takes the queue, as on paper 004's array): a file
    /// on a FUSE filesystem served one request at a time, in arrival order,
    /// each taking --per-io plus its size over --bandwidth, held in memory.
    /// With --loop it is attached as a loop device with direct I/O, whose
    /// path is printed; runs until interrupted, then detaches and unmounts.
    ///
    ///   pagefleet ioqos fifodisk --dir /run/fifo --size 1GiB --bandwidth 48MiB --per-io 0.2 --loop
    #[command(verbatim_doc_comment)]
    Fifodisk {
        /// Mount point (created if missing); the disk is DIR/disk.
        #[arg(long)]
        dir: PathBuf,
        /// The disk's size.
        #[arg(long, default_value = "1GiB", value_parser = pagefleet_common::units::parse_size)]
        size: u64,
        /// Transfer rate, bytes per second (e.g. 48MiB).
        #[arg(long, default_value = "48MiB", value_parser = pagefleet_common::units::parse_size)]
        bandwidth: u64,
        /// Fixed cost of every request, milliseconds.
        #[arg(long, default_value_t = 0.2)]
        per_io: f64,
        /// Attach a loop device (direct I/O) over the disk and print its path.
        #[arg(long = "loop")]
        attach_loop: bool,
    },
}

/// `pagefleet ioqos run` flags.
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

/// The controller's options from the flags.
pub fn options(o: &RunOpts) -> Result<Options> {
    let spec = control::Spec {
        device: o.device.clone(),
        tenants: o.tenants.clone(),
        policy: o.policy.clone(),
        model: o.model.clone(),
        calibrate_secs: o.calibrate_secs,
        interval: o.interval,
        border: o.border.clone(),
        rate: o.rate,
        cap_time: o.cap_time,
        cap_interval: o.cap_interval,
    };
    let duration = if o.duration.is_nan() || o.duration < 0.0 {
        return Err(crate::Error::Invalid(
            "--duration must not be negative".to_string(),
        ));
    } else {
        (o.duration > 0.0).then(|| Duration::from_secs_f64(o.duration))
    };
    let opts = spec.options(Some(o.state.clone()), duration)?;
    if o.model.is_none() {
        eprintln!(
            "device model: {:.0} IOPS (4 KiB random), {:.1} MB/s (1 MiB sequential)",
            opts.model.max_iops,
            opts.model.max_bps / 1e6
        );
    }
    Ok(opts)
}

/// Carry out a `pagefleet ioqos` command.
pub fn main(c: Command) -> Result<()> {
    match c {
        Command::Run(o) => {
            let opts = options(&o)?;
            control::run(&opts, pagefleet_common::signal::stop_flag(), |_| {})
        }
        Command::Fifodisk {
            dir,
            size,
            bandwidth,
            per_io,
            attach_loop,
        } => fifodisk(&dir, size, bandwidth, per_io, attach_loop),
        Command::Status { json, state } => {
            let v: control::State =
                pagefleet_common::controller::read_live(&state).with_context(|| {
                    format!(
                        "no I/O controller is running (no fresh state at {})",
                        state.display()
                    )
                })?;
            if json {
                println!("{}", serde_json::to_string_pretty(&v)?);
                return Ok(());
            }
            print!("{v}");
            Ok(())
        }
    }
}

fn fifodisk(
    dir: &std::path::Path,
    size: u64,
    bandwidth: u64,
    per_io: f64,
    attach_loop: bool,
) -> Result<()> {
    use pagefleet_fifodisk::{FifoDisk, LoopDevice, Pace};
    if !(0.0..=1000.0).contains(&per_io) || per_io.is_nan() {
        return Err(crate::Error::Invalid(
            "--per-io is milliseconds per request, 0 to 1000".to_string(),
        ));
    }
    if bandwidth == 0 {
        return Err(crate::Error::Invalid(
            "--bandwidth must be positive".to_string(),
        ));
    }
    let pace = Pace {
        per_io: Duration::from_secs_f64(per_io / 1000.0),
        bandwidth: bandwidth as f64,
    };
    // Interrupt and terminate end it cleanly: blocked here, waited for below.
    let signals = pagefleet_common::signal::TermSignals::block();
    let disk = FifoDisk::mount(dir, size, pace)?;
    let lo = if attach_loop {
        Some(LoopDevice::attach(&disk.file(), true)?)
    } else {
        None
    };
    match &lo {
        Some(l) => println!("{}", l.path.display()),
        None => println!("{}", disk.file().display()),
    }
    eprintln!(
        "FIFO disk of {size} bytes: {:.1} MB/s, {per_io} ms per request; Ctrl-C to stop",
        bandwidth as f64 / 1e6
    );
    use std::io::Write;
    std::io::stdout().flush()?;
    signals.wait();
    drop(lo);
    Ok(disk.unmount()?)
}
