//! Benchmark plumbing: goals, and the lab's helpers under one name.

use anyhow::Result;
use pagefleet_fifodisk::{FifoDisk, LoopDevice, Pace};
use serde::Serialize;
use std::path::PathBuf;
use std::time::Duration;

pub use pagefleet_lab::plot::*;
pub use pagefleet_lab::proc::*;
pub use pagefleet_lab::stats::*;
pub use pagefleet_lab::system::*;

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
    /// A goal this run could not measure (a configuration failed, nothing
    /// qualified): reported, and never met.
    pub fn not_measured(name: &str, target: f64, unit: &str) -> Goal {
        Goal {
            name: format!("{name} (not measured)"),
            value: 0.0,
            target,
            unit: unit.into(),
            cmp: "measured",
            met: false,
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

pub fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

/// Swap on an SSD-like device: the FIFO disk (kept in this process's
/// memory, served by one FUSE thread) with an NVMe-like service time, as a
/// loop device with direct I/O. Torn down in order: swap, loop, disk.
pub struct SsdSwap {
    swap: Option<Swap>,
    dev: Option<LoopDevice>,
    disk: Option<FifoDisk>,
    dir: PathBuf,
}

impl SsdSwap {
    /// ~80 µs per 4 KiB read and ~2 GB/s: a datacenter NVMe drive's read
    /// latency and bandwidth (one queue: requests are served in order).
    const PACE: Pace = Pace {
        per_io: Duration::from_micros(78),
        bandwidth: 2e9,
    };

    /// Swap of `size` bytes on a new SSD-like disk (root).
    pub fn new(size: u64) -> Result<SsdSwap> {
        let dir = temp_dir("bench-ssd-swap")?;
        let mut s = SsdSwap {
            swap: None,
            dev: None,
            disk: None,
            dir: dir.clone(),
        };
        let disk = FifoDisk::mount(&dir.join("mnt"), size.next_multiple_of(4096), Self::PACE)?;
        let dev = LoopDevice::attach(&disk.file(), true);
        s.disk = Some(disk);
        s.dev = Some(dev?);
        s.swap = Some(Swap::device(&s.dev.as_ref().unwrap().path)?);
        Ok(s)
    }
}

impl Drop for SsdSwap {
    fn drop(&mut self) {
        drop(self.swap.take());
        drop(self.dev.take());
        drop(self.disk.take());
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
