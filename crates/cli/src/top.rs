//! `pagefleet top`: the cluster in a terminal, refreshed in place (like
//! `virt-top`): hosts and their memory, guests with their rates (ops, pages
//! in and out, fault service time over the last interval), migrations in
//! progress.
//!
//! Each frame is two samples of every host's `GET /host` and `GET /guests`
//! (through the registry or `--hosts`); rates are differences over the
//! interval, the fault p99 comes from the difference of the guests' fault
//! histograms (so it is the last interval's, not since start). [`frame`]
//! is a pure function of the two samples, tested without a daemon.

use crate::cluster::{self, Registry};
use anyhow::Result;
use pagefleet_api::{ClusterHost, GuestStatus, HistogramSnapshot};
use pagefleet_common::http::Client;
use pagefleet_common::units::fmt_size;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::time::{Duration, Instant};

/// `pagefleet top`'s options.
#[derive(clap::Args)]
pub struct TopArgs {
    /// Ask these pagefleetd HTTP addresses instead of the registry,
    /// comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub hosts: Vec<String>,
    #[command(flatten)]
    pub reg: Registry,
    /// Seconds between frames.
    #[arg(long, default_value_t = 2.0)]
    pub interval: f64,
    /// Stop after this many frames (default: until interrupted).
    #[arg(long)]
    pub iterations: Option<u64>,
    /// Print frames one after another instead of redrawing the screen (for
    /// a log or a pipe; the default off a terminal).
    #[arg(long)]
    pub plain: bool,
}

/// Every host's report and guests at one moment.
pub struct Sample {
    /// When it was taken.
    pub at: Instant,
    /// The hosts.
    pub hosts: Vec<ClusterHost>,
}

/// Runs `pagefleet top`.
pub fn main(c: &Client, a: &TopArgs) -> Result<()> {
    if !(0.2..=3600.0).contains(&a.interval) {
        anyhow::bail!("--interval: between 0.2 and 3600 seconds");
    }
    let redraw = !a.plain && std::io::IsTerminal::is_terminal(&std::io::stdout());
    let take = || -> Result<Sample> {
        Ok(Sample {
            at: Instant::now(),
            hosts: cluster::hosts(c, &a.reg.registry, &a.hosts)?,
        })
    };
    let mut prev = take()?;
    let mut n = 0u64;
    loop {
        std::thread::sleep(Duration::from_secs_f64(a.interval));
        let now = take()?;
        let text = frame(&prev, &now);
        let mut out = String::new();
        if redraw {
            // Home, then clear to the end: no flicker of a blank screen.
            out.push_str("\x1b[H");
            out.push_str(&text.replace('\n', "\x1b[K\n"));
            out.push_str("\x1b[J");
        } else {
            out.push_str(&text);
            out.push('\n');
        }
        print!("{out}");
        let _ = std::io::Write::flush(&mut std::io::stdout());
        prev = now;
        n += 1;
        if a.iterations.is_some_and(|k| n >= k) {
            return Ok(());
        }
    }
}

/// One guest's rates over the interval.
#[derive(Debug, Default, PartialEq)]
pub struct Rates {
    /// Workload operations per second.
    pub ops: f64,
    /// Pages brought in per second.
    pub page_ins: f64,
    /// Pages sent out per second.
    pub page_outs: f64,
    /// Fault service time, 99th percentile over the interval, seconds.
    pub fault_p99: Option<f64>,
}

/// The rates of `now` against `then` (the same guest `dt` seconds earlier);
/// none when the runner restarted (counters went down).
pub fn rates(then: &GuestStatus, now: &GuestStatus, dt: f64) -> Option<Rates> {
    let d = |a: u64, b: u64| b.checked_sub(a).map(|x| x as f64 / dt.max(1e-3));
    let fault_p99 = match (&then.paging, &now.paging) {
        (Some(t), Some(n)) => {
            delta(&t.fault_seconds, &n.fault_seconds).and_then(|h| h.quantile(0.99))
        }
        _ => None,
    };
    Some(Rates {
        ops: d(then.ops, now.ops)?,
        page_ins: d(then.page_ins, now.page_ins)?,
        page_outs: d(then.page_outs, now.page_outs)?,
        fault_p99,
    })
}

/// What a histogram counted between two snapshots (same bounds).
fn delta(then: &HistogramSnapshot, now: &HistogramSnapshot) -> Option<HistogramSnapshot> {
    if then.bounds != now.bounds && !then.bounds.is_empty() {
        return None;
    }
    let counts: Vec<u64> = now
        .counts
        .iter()
        .enumerate()
        .map(|(i, c)| c.saturating_sub(then.counts.get(i).copied().unwrap_or(0)))
        .collect();
    Some(HistogramSnapshot {
        bounds: now.bounds.clone(),
        counts,
        count: now.count.saturating_sub(then.count),
        sum: (now.sum - then.sum).max(0.0),
    })
}

fn secs(s: Option<f64>) -> String {
    match s {
        None => "-".into(),
        Some(v) if v < 1e-3 => format!("{:.0}µs", v * 1e6),
        Some(v) if v < 1.0 => format!("{:.1}ms", v * 1e3),
        Some(v) => format!("{v:.2}s"),
    }
}

/// One frame: the cluster at `now`, rates against `prev`.
pub fn frame(prev: &Sample, now: &Sample) -> String {
    let dt = now.at.duration_since(prev.at).as_secs_f64();
    let before: BTreeMap<(&str, &str), &GuestStatus> = prev
        .hosts
        .iter()
        .flat_map(|h| {
            h.guests
                .iter()
                .map(move |g| ((h.http.as_str(), g.name.as_str()), g))
        })
        .collect();
    let mut o = String::new();
    let answered = now.hosts.iter().filter(|h| h.host.is_some()).count();
    let guests: usize = now.hosts.iter().map(|h| h.guests.len()).sum();
    let _ = writeln!(
        o,
        "pagefleet top — {} hosts ({} not answering), {} guests, every {:.1} s",
        now.hosts.len(),
        now.hosts.len() - answered,
        guests,
        dt
    );
    let _ = writeln!(o);
    let h = [
        "HOST",
        "MEMORY",
        "AVAILABLE",
        "LENT",
        "LENT USED",
        "GUEST FREE",
        "GUESTS",
        "STATE",
    ];
    let _ = writeln!(
        o,
        "{:<14} {:>10} {:>10} {:>10} {:>10} {:>10} {:>7}  {}",
        h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]
    );
    for h in &now.hosts {
        match &h.host {
            Some(r) => {
                let _ = writeln!(
                    o,
                    "{:<14} {:>10} {:>10} {:>10} {:>10} {:>10} {:>7}  {}",
                    trunc(&r.hostname, 14),
                    fmt_size(r.mem_total),
                    fmt_size(r.mem_available),
                    fmt_size(r.lend_capacity),
                    fmt_size(r.lend_used),
                    fmt_size(r.guest_free),
                    r.guests,
                    if r.cordoned { "cordoned" } else { "up" }
                );
            }
            None => {
                let _ = writeln!(
                    o,
                    "{:<14} {:>10} {:>10} {:>10} {:>10} {:>10} {:>7}  down: {}",
                    trunc(&h.http, 14),
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                    h.error.as_deref().unwrap_or("no answer")
                );
            }
        }
    }
    let _ = writeln!(o);
    let h = [
        "HOST", "GUEST", "STATE", "SIZE", "BUDGET", "RESIDENT", "REMOTE", "OPS/S", "IN/S", "OUT/S",
        "P99",
    ];
    let _ = writeln!(
        o,
        "{:<14} {:<12} {:<9} {:>9} {:>9} {:>9} {:>7} {:>9} {:>8} {:>8} {:>8}",
        h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7], h[8], h[9], h[10]
    );
    let mut migrations = Vec::new();
    for h in &now.hosts {
        for g in &h.guests {
            let r = before
                .get(&(h.http.as_str(), g.name.as_str()))
                .and_then(|t| rates(t, g, dt));
            let total = (g.resident_pages + g.remote_pages).max(1);
            let rate = |f: fn(&Rates) -> f64| {
                r.as_ref()
                    .map_or("-".to_string(), |r| format!("{:.0}", f(r)))
            };
            let _ = writeln!(
                o,
                "{:<14} {:<12} {:<9} {:>9} {:>9} {:>9} {:>6.0}% {:>9} {:>8} {:>8} {:>8}",
                trunc(h.name(), 14),
                trunc(&g.name, 12),
                format!("{:?}", g.state).to_lowercase(),
                fmt_size(g.size),
                fmt_size(pagefleet_units::bytes_of(g.budget_pages)),
                fmt_size(pagefleet_units::bytes_of(g.resident_pages)),
                g.remote_pages as f64 * 100.0 / total as f64,
                rate(|r| r.ops),
                rate(|r| r.page_ins),
                rate(|r| r.page_outs),
                secs(r.as_ref().and_then(|r| r.fault_p99)),
            );
            if let Some(p) = &g.paging {
                if p.degraded_pages > 0 || p.servers_down > 0 {
                    let _ = writeln!(
                        o,
                        "{:<14} {:<12} ! {} pages with one copy, {} memory servers down",
                        "", "", p.degraded_pages, p.servers_down
                    );
                }
            }
            if let Some(m) = &g.migration {
                migrations.push((h.name().to_string(), g.name.clone(), m.clone()));
            }
        }
    }
    if !migrations.is_empty() {
        let _ = writeln!(o);
        let h = [
            "FROM",
            "GUEST",
            "PHASE",
            "ROUND",
            "THIS ROUND",
            "TO MAIN",
            "TO SUBS",
        ];
        let _ = writeln!(
            o,
            "{:<14} {:<12} {:<12} {:>6} {:>22} {:>10} {:>10}",
            h[0], h[1], h[2], h[3], h[4], h[5], h[6]
        );
        for (h, g, m) in migrations {
            let _ = writeln!(
                o,
                "{:<14} {:<12} {:<12} {:>6} {:>22} {:>10} {:>10}",
                trunc(&h, 14),
                trunc(&g, 12),
                trunc(&m.phase, 12),
                m.round,
                format!("{}/{} pages", m.round_sent, m.round_pages),
                fmt_size(m.bytes_main),
                fmt_size(m.bytes_subs),
            );
        }
    }
    o
}

/// At most `n` characters (a long name ends in `~`).
fn trunc(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(n - 1).collect();
        t.push('~');
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pagefleet_api::{GuestState, HostReport, PagingCosts};

    fn guest(ops: u64, ins: u64, faults: Vec<u64>) -> GuestStatus {
        let mut g = GuestStatus::placeholder("kv1", GuestState::Running, 4096, 42);
        g.ops = ops;
        g.page_ins = ins;
        g.size = 1 << 30;
        g.resident_pages = 1 << 17;
        g.remote_pages = 1 << 17;
        g.paging = Some(PagingCosts {
            fault_seconds: HistogramSnapshot {
                bounds: vec![1e-4, 1e-3, 1e-2],
                count: faults.iter().sum(),
                counts: faults,
                sum: 0.0,
            },
            ..Default::default()
        });
        g
    }

    fn host(g: GuestStatus) -> ClusterHost {
        ClusterHost {
            http: "10.0.0.1:7071".into(),
            host: Some(HostReport {
                hostname: "h1".into(),
                mem_total: 8 << 30,
                ..Default::default()
            }),
            guests: vec![g],
            error: None,
            claimed: None,
        }
    }

    #[test]
    fn rates_and_the_p99_are_the_intervals_own() {
        // Since start: 1000 fast faults. In the interval: 100 more, 10 of
        // them slow (1-10 ms): the interval's p99 is in the slow bucket.
        let then = guest(1000, 500, vec![1000, 0, 0]);
        let now = guest(3000, 700, vec![1090, 0, 10]);
        let r = rates(&then, &now, 2.0).unwrap();
        assert_eq!((r.ops, r.page_ins), (1000.0, 100.0));
        let p99 = r.fault_p99.unwrap();
        assert!(p99 > 1e-3 && p99 <= 1e-2, "{p99}");
        // A runner that restarted (counters went down): no rates.
        assert!(rates(&now, &then, 2.0).is_none());
    }

    #[test]
    fn a_frame_shows_hosts_guests_and_a_host_that_does_not_answer() {
        let t0 = Instant::now();
        let prev = Sample {
            at: t0,
            hosts: vec![host(guest(1000, 500, vec![1000, 0, 0]))],
        };
        let mut down = host(guest(0, 0, vec![]));
        down.http = "10.0.0.2:7071".into();
        down.host = None;
        down.guests.clear();
        down.error = Some("timed out".into());
        let now = Sample {
            at: t0 + Duration::from_secs(2),
            hosts: vec![host(guest(3000, 700, vec![1090, 0, 10])), down],
        };
        let f = frame(&prev, &now);
        assert!(f.contains("2 hosts (1 not answering), 1 guests"), "{f}");
        let row = f
            .lines()
            .find(|l| l.contains("kv1"))
            .expect("the guest's row");
        assert!(
            row.contains("running") && row.contains("50%") && row.contains("1000"),
            "{row}"
        );
        assert!(
            f.lines()
                .any(|l| l.starts_with("10.0.0.2:7071") && l.contains("down: timed out")),
            "{f}"
        );
    }

    #[test]
    fn long_names_are_cut_visibly() {
        assert_eq!(trunc("short", 14), "short");
        assert_eq!(trunc("a-very-long-guest-name", 8), "a-very-~");
    }
}
