//! Benchmarks behind `pagefleet bench <what>`. Each one runs pagefleet and
//! its baselines/peers side by side in one run, prints a table, writes a PNG
//! (through `bench/plot_*.py`), and with `--json` prints one JSON object with
//! every measurement and a `goals` list computed from this run.
//!
//! Every benchmark has the same shape ([`Benchmark`]):
//!
//! - options: `Opts`, its two presets (`--quick` and the full run), and its
//!   clap `Args`, only the knobs a person may turn (so `pagefleet bench X
//!   --help` lists X's flags only), applied over the preset, beside the
//!   flags all of them take ([`Common`]);
//! - `run`: measure, everything in one run, into its `Report`;
//! - `judge`: the goals, a pure function of the measurements (tested
//!   without running anything where the rules are more than a comparison);
//!   a goal whose measurement failed is reported unmet
//!   ([`util::Goal::not_measured`]), never dropped;
//! - `print_table` and the plot (`bench/plot_X.py`, through
//!   [`util::save_with_plot`]).

// Not a library API: a benchmark harness: what its reports mean is documented in docs/*.md.
#![allow(missing_docs)]

pub mod blockdev;
pub mod dashboard;
pub mod dedup;
pub mod hang;
pub mod ioqos;
pub mod ksm;
pub mod kv_floor;
pub mod memserver;
pub mod migration;
pub mod paging;
pub mod registry;
pub mod replicas;
pub mod restart;
pub mod scale;
pub mod soak;
pub mod split_floor;
pub mod strangers;
pub mod tls_floor;
pub mod util;
pub mod vm_debian;
pub mod vm_migration;

use anyhow::Result;
pub use pagefleet_lab::{fmt_bytes, is_root, kvload, LabRun};
use std::path::PathBuf;

/// Flags every benchmark takes.
#[derive(clap::Args, Clone, Debug)]
pub struct Common {
    /// Print one JSON object with every result and the goals (the table goes to stderr).
    #[arg(long)]
    pub json: bool,
    /// Small dataset and one repetition: a smoke run, not for the record.
    #[arg(long)]
    pub quick: bool,
    /// Directory for the results JSON and the PNG plot.
    #[arg(long, default_value = "bench-results")]
    pub out: PathBuf,
}

impl Common {
    /// A benchmark's options: its quick set or its full one, writing to `--out`.
    pub fn opts<O>(&self, quick: fn(PathBuf) -> O, full: fn(PathBuf) -> O) -> O {
        if self.quick {
            quick(self.out.clone())
        } else {
            full(self.out.clone())
        }
    }
}

/// One benchmark: its flags are the implementing type.
pub trait Benchmark {
    /// Everything it measured, with its `goals`.
    type Report: serde::Serialize;
    /// Run it, logging progress lines to `log`.
    fn run(&self, common: &Common, log: &mut dyn FnMut(&str)) -> Result<Self::Report>;
    /// The table a person reads.
    fn print(report: &Self::Report, out: &mut dyn std::io::Write) -> std::io::Result<()>;
}

/// Run a benchmark and print its table (to stdout, or to stderr with the
/// JSON on stdout under `--json`).
pub fn main<B: Benchmark>(common: &Common, b: &B) -> Result<()> {
    let mut log = |m: &str| eprintln!("  .. {m}");
    let report = b.run(common, &mut log)?;
    if common.json {
        B::print(&report, &mut std::io::stderr())?;
        println!("{}", serde_json::to_string(&report)?);
    } else {
        B::print(&report, &mut std::io::stdout())?;
    }
    Ok(())
}

/// A size flag's lower bound, said in the flag's terms.
fn at_least(flag: &str, what: &str, v: u64, min: u64) -> Result<u64> {
    if v < min {
        anyhow::bail!("{flag} ({what}) must be at least {}", fmt_bytes(min));
    }
    Ok(v)
}
