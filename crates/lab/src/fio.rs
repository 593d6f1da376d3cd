//! fio's JSON output (`--output-format=json`), the parts benchmarks read.

use serde::Deserialize;
use std::collections::BTreeMap;

/// fio's whole report.
#[derive(Debug, Deserialize)]
pub struct Output {
    /// One entry per job (group reporting gives one).
    pub jobs: Vec<Job>,
}

/// One job's results.
#[derive(Debug, Deserialize)]
pub struct Job {
    /// Reads.
    pub read: Side,
    /// Writes.
    pub write: Side,
}

/// One direction of a job.
#[derive(Debug, Default, Deserialize)]
pub struct Side {
    /// I/Os per second.
    #[serde(default)]
    pub iops: f64,
    /// Bytes per second.
    #[serde(default)]
    pub bw_bytes: f64,
    /// Completion latency.
    #[serde(default)]
    pub clat_ns: Option<Latency>,
}

/// A latency distribution.
#[derive(Debug, Default, Deserialize)]
pub struct Latency {
    /// Percentiles by name ("99.000000") in nanoseconds.
    #[serde(default)]
    pub percentile: BTreeMap<String, f64>,
}

impl Output {
    /// Parse fio's output, which may start with engine messages before the JSON.
    pub fn parse(text: &str) -> Result<Output, String> {
        let json = text
            .find("\n{")
            .map(|i| &text[i + 1..])
            .or_else(|| text.starts_with('{').then_some(text))
            .ok_or("no JSON in fio's output")?;
        serde_json::from_str(json).map_err(|e| format!("fio JSON: {e}"))
    }

    /// The first job (fio runs with group reporting here).
    pub fn job(&self) -> Result<&Job, String> {
        self.jobs
            .first()
            .ok_or_else(|| "fio reported no job".to_string())
    }
}

impl Side {
    /// The 99th-percentile completion latency, ms.
    pub fn p99_ms(&self) -> Option<f64> {
        self.clat_ns
            .as_ref()
            .and_then(|l| l.percentile.get("99.000000"))
            .map(|ns| ns / 1e6)
    }
}
