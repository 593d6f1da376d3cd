//! Prometheus' own checker on every host's `/metrics` (issue 51, item 1): a
//! lab with a paging guest on h1 whose memory is mostly on h2's memory
//! server. `promtool check metrics` (Debian's `prometheus` package, which
//! `make deps` installs) must find nothing to report on either host, and
//! the series an operator looks for carry data: the guest's fault-time
//! histogram, its resident and remote bytes (per server too), its faults
//! by kind, read-ahead's hits and misses, the server's stored bytes.

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
    start_paging_guest(&l, "g1", &server, 2000, &[]);
    // g2 scans: read-ahead brings pages, writes to them (30 %) show their use.
    start_paging_guest(&l, "g2", &server, 20000, &["--dist", "seq"]);
    // Faults served from h2: the histogram has counted some.
    let faulted = "pagefleet_guest_fault_seconds_count{guest=\"g1\"}";
    // (Its prefill done: most of it out on h2, beside g2's.)
    let remote = "pagefleet_guest_remote_bytes{guest=\"g1\"}";
    wait_for("g1 to fault pages in from h2", 120, || {
        l.get_text(0, "/metrics").ok().is_some_and(|t| {
            value(&t, faulted).is_some_and(|v| v > 0.0)
                && value(&t, remote).is_some_and(|v| v >= (32 * MIB) as f64)
        })
    });
    let h1 = l.get_text(0, "/metrics").unwrap();
    let h2 = l.get_text(1, "/metrics").unwrap();
    for (host, text) in [("h1", &h1), ("h2", &h2)] {
        assert_eq!(
            promtool_check_metrics(text),
            "",
            "promtool check metrics on {host}:\n{text}"
        );
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
    // (Read a moment apart from the total, while g1 pages: close, not equal.)
    let on_h2 = value(
        &h1,
        &format!("pagefleet_guest_remote_server_bytes{{guest=\"g1\",server=\"{server}\"}}"),
    )
    .expect("g1's bytes on h2");
    assert!(
        (on_h2 - remote).abs() <= remote * 0.05,
        "g1 has {on_h2} of its {remote} remote bytes on h2"
    );
    let faults = |g: &str, kind: &str| {
        value(
            &h1,
            &format!("pagefleet_guest_faults_total{{guest=\"{g}\",kind=\"{kind}\"}}"),
        )
        .unwrap_or_else(|| panic!("no {kind} faults series for {g}"))
    };
    assert!(
        faults("g1", "zero") > 0.0,
        "the prefill touched every page first"
    );
    assert!(faults("g1", "remote") > 0.0, "g1 faulted pages in from h2");
    // The scan: read-ahead brought pages and some were used, and what has
    // settled is no more than what came.
    wait_for("g2's read-ahead pages to be used", 120, || {
        l.get_text(0, "/metrics")
            .ok()
            .and_then(|t| value(&t, "pagefleet_guest_prefetch_hits_total{guest=\"g2\"}"))
            .is_some_and(|v| v > 0.0)
    });
    let h1 = l.get_text(0, "/metrics").unwrap();
    assert_eq!(
        promtool_check_metrics(&h1),
        "",
        "promtool check metrics on h1:\n{h1}"
    );
    let g2 = |s: &str| value(&h1, &format!("pagefleet_guest_{s}{{guest=\"g2\"}}")).unwrap();
    let prefetched = g2("prefetched_bytes_total") / 4096.0;
    let settled = g2("prefetch_hits_total") + g2("prefetch_misses_total");
    assert!(
        settled <= prefetched,
        "{settled} settled of {prefetched} read ahead"
    );
    for g in ["g1", "g2"] {
        let (ok, _, err) = l.pf(0, &["guest", "stop", g]);
        assert!(ok, "guest stop {g}: {err}");
    }
}
