//! The VM's serial console: every line goes to the runner's log, the last
//! ones are kept, the in-guest workload's reports (`vmwork: ...` lines, see
//! `crates/systest/vm/vmwork.c`) become counters, and a guest's
//! `pagefleet-guest: ready ...` line (the Debian image's, once its
//! services answer) is kept as its ready line.

use serde::Serialize;
use std::collections::VecDeque;
use std::io::BufRead;
use std::sync::Mutex;

/// Lines kept for status and error messages.
const KEEP: usize = 200;

/// How a guest says on its console that it serves (the Debian image's
/// `pagefleet-ready`).
pub const READY: &str = "pagefleet-guest: ready";

/// What the in-guest workload reported last.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Workload {
    /// Seconds into its run phase.
    pub t: f64,
    /// Operations so far.
    pub ops: u64,
    /// Operations per second over its last report interval.
    pub ops_per_sec: f64,
    /// Wrong words read so far (must stay 0).
    pub errors: u64,
    /// It finished its run and its final full check.
    pub done: bool,
    /// Pages its final pass verified.
    pub verified: u64,
    /// O_DIRECT reads of its disk so far (`vmwork_disk=N`), each checked.
    pub disk_reads: u64,
    /// Every report of the run phase: (host time it arrived, Unix seconds;
    /// ops/s over the second before).
    pub history: Vec<(f64, f64)>,
    /// The guest said it serves: the words after `pagefleet-guest: ready`
    /// (e.g. `host=deb1 ip=10.200.77.151/24 memcached=1.6.18`).
    pub ready: Option<String>,
}

/// The console's state, shared between its reader thread and the runner.
#[derive(Default)]
pub struct Console {
    lines: Mutex<VecDeque<String>>,
    work: Mutex<Workload>,
}

impl Console {
    /// Read `input` (QEMU's serial output) to its end, logging each line
    /// with `log`.
    pub fn pump(&self, input: impl std::io::Read, log: &dyn Fn(&str)) {
        let r = std::io::BufReader::new(input);
        for line in r.split(b'\n') {
            let Ok(raw) = line else { break };
            let text = String::from_utf8_lossy(&raw);
            let text = text.trim_end_matches('\r').to_string();
            log(&text);
            self.feed(&text);
        }
    }

    /// Take one console line.
    pub fn feed(&self, line: &str) {
        if let Some(rest) = line.trim_start().strip_prefix("vmwork:") {
            let mut w = self.work.lock().unwrap_or_else(|e| e.into_inner());
            parse_report(rest, &mut w);
        } else if let Some(rest) = line.trim_start().strip_prefix(READY) {
            let mut w = self.work.lock().unwrap_or_else(|e| e.into_inner());
            w.ready = Some(rest.trim().to_string());
        }
        let mut l = self.lines.lock().unwrap_or_else(|e| e.into_inner());
        if l.len() == KEEP {
            l.pop_front();
        }
        l.push_back(line.to_string());
    }

    /// The workload's counters now.
    pub fn workload(&self) -> Workload {
        self.work.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The last `n` lines.
    pub fn tail(&self, n: usize) -> Vec<String> {
        let l = self.lines.lock().unwrap_or_else(|e| e.into_inner());
        l.iter().skip(l.len().saturating_sub(n)).cloned().collect()
    }
}

fn field<T: std::str::FromStr>(rest: &str, key: &str) -> Option<T> {
    rest.split_whitespace()
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
}

fn parse_report(rest: &str, w: &mut Workload) {
    let rest = rest.trim();
    if rest.starts_with("done") {
        w.done = true;
        w.ops = field(rest, "ops").unwrap_or(w.ops);
        w.errors = field(rest, "errors").unwrap_or(w.errors);
        w.verified = field(rest, "verified").unwrap_or(0);
        w.disk_reads = field(rest, "disk_reads").unwrap_or(w.disk_reads);
    } else if rest.starts_with("ERROR") {
        // Counted by the next report; at least one.
        w.errors = w.errors.max(1);
    } else if rest.contains("phase=run") {
        w.t = field(rest, "t").unwrap_or(w.t);
        w.ops = field(rest, "ops").unwrap_or(w.ops);
        w.ops_per_sec = field(rest, "ops_s").unwrap_or(w.ops_per_sec);
        w.errors = field(rest, "errors").unwrap_or(w.errors);
        w.disk_reads = field(rest, "disk_reads").unwrap_or(w.disk_reads);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        w.history.push((now, w.ops_per_sec));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_become_counters_and_other_lines_are_kept() {
        let c = Console::default();
        for l in [
            "[    0.000000] Linux version 6.1",
            "vmwork: start mb=64 secs=5 write=10",
            "vmwork: t=1 ops=4000 ops_s=4000 errors=0 phase=run",
            "vmwork: t=2 ops=9000 ops_s=5000 errors=0 phase=run",
            "vmwork: done ops=9100 errors=0 verified=16384 disk_reads=12",
        ] {
            c.feed(l);
        }
        let w = c.workload();
        assert_eq!(w.ops, 9100);
        assert_eq!(w.ops_per_sec, 5000.0);
        assert!(w.done);
        assert_eq!(w.verified, 16384);
        assert_eq!(w.disk_reads, 12);
        let rates: Vec<f64> = w.history.iter().map(|h| h.1).collect();
        assert_eq!(rates, vec![4000.0, 5000.0]);
        assert!(w.history[1].0 >= w.history[0].0 && w.history[0].0 > 1.7e9);
        assert_eq!(
            c.tail(2)[1],
            "vmwork: done ops=9100 errors=0 verified=16384 disk_reads=12"
        );
    }

    #[test]
    fn a_guest_ready_line_is_kept() {
        let c = Console::default();
        c.feed("[  OK  ] Started memcached.service");
        assert_eq!(c.workload().ready, None);
        c.feed("pagefleet-guest: ready host=deb1 ip=10.200.77.151/24 memcached=1.6.18");
        assert_eq!(
            c.workload().ready.as_deref(),
            Some("host=deb1 ip=10.200.77.151/24 memcached=1.6.18")
        );
    }

    #[test]
    fn an_error_line_counts_before_the_next_report() {
        let c = Console::default();
        c.feed("vmwork: ERROR page 7 version 2: 512 bad words");
        assert_eq!(c.workload().errors, 1);
        c.feed("vmwork: t=1 ops=10 ops_s=10 errors=512 phase=run");
        assert_eq!(c.workload().errors, 512);
    }
}
