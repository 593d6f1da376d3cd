//! Prometheus' own checker on every host's `/metrics` (issue 51, item 1): a
//! lab with a paging guest on h1 whose memory is mostly on h2's memory
//! server. `promtool check metrics` (Debian's `prometheus` package, which
//! `make deps` installs) must find nothing to report on either host, and
//! the series an operator looks for carry data: the guest's fault-time
//! histogram, its resident and remote bytes, the server's stored bytes.

use pagefleet_systest::*;
use pagefleet_testbed::Link;

const MIB: u64 = 1 << 20;


/// The value of the first sample of `series` (name and labels as written).
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

#[test]
fn promtool_finds_nothing_on_any_host_and_the_guest_series_carry_data() {
    if !is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    let l = lab("metrics", 2, Link::Gbit10, 256 * MIB, &[256 * MIB, 0]);
    let server = l.lab.hosts[1].addr.clone();
    let (ok, _, err) = l.pf(
        0,
        &[
            "guest", "start", "g1", "--on", "h1", "--size", "64MiB", "--budget", "16MiB", "--",
            "synthetic", "--servers", &server, "--prefill", "--rate", "2000",
        ],
    );
    assert!(ok, "guest start g1: {err}");
    // Faults served from h2: the histogram has counted some.
    let faulted = "pagefleet_guest_fault_seconds_count{guest=\"g1\"}";
    wait_for("g1 to fault pages in from h2", 120, || {
        l.get_text(0, "/metrics")
            .ok()
            .and_then(|t| value(&t, faulted))
            .is_some_and(|v| v > 0.0)
    });
    let h1 = l.get_text(0, "/metrics").unwrap();
    let h2 = l.get_text(1, "/metrics").unwrap();
    for (host, text) in [("h1", &h1), ("h2", &h2)] {
        assert_eq!(promtool_check_metrics(text), "", "promtool check metrics on {host}:\n{text}");
    }
    let n = value(&h1, faulted).unwrap();
    let inf = value(
        &h1,
        "pagefleet_guest_fault_seconds_bucket{guest=\"g1\",le=\"+Inf\"}",
    )
    .expect("an +Inf bucket");
    assert_eq!(inf, n, "the +Inf bucket holds every fault");
    let sum = value(&h1, "pagefleet_guest_fault_seconds_sum{guest=\"g1\"}").unwrap();
    assert!(sum > 0.0 && sum / n < 1.0, "mean fault time {} s", sum / n);
    let resident = value(&h1, "pagefleet_guest_resident_bytes{guest=\"g1\"}").unwrap();
    let remote = value(&h1, "pagefleet_guest_remote_bytes{guest=\"g1\"}").unwrap();
    assert!(resident <= (16 * MIB) as f64 * 1.05, "resident {resident}");
    assert!(remote >= (32 * MIB) as f64, "remote {remote}");
    let stored = value(&h2, "pagefleet_memserver_stored_bytes").unwrap();
    assert!(stored >= remote, "h2 stores {stored} of g1's {remote}");
    let (ok, _, err) = l.pf(0, &["guest", "stop", "g1"]);
    assert!(ok, "guest stop: {err}");
}
