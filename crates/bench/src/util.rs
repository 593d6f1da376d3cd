//! Benchmark plumbing: goals, and the lab's helpers under one name.

use serde::Serialize;
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
