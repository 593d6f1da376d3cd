//! A real Prometheus scrapes a lab (issue 51, items 2 and 3): Debian's
//! `prometheus` binary runs in h1's namespace against every pagefleetd,
//! authenticated the way docs/metrics.md tells an operator to (the bearer
//! token `pagefleet scrape-token` prints, as a `credentials_file`), with
//! the shipped alerting rules loaded. A split migration runs while it
//! scrapes; the test then reads, through Prometheus' HTTP API:
//!
//! - the migration's progress series, sampled while it ran (bytes sent,
//!   remaining, transfer and dirty rate, round, phase), and afterwards the
//!   source's succeeded tally and last downtime, against the report;
//! - every PromQL expression of the shipped Grafana dashboard, evaluated at
//!   a moment of the migration, each with data;
//! - every alerting rule, loaded and evaluated without error;
//!
//! and `promtool check metrics` on every host's `/metrics` taken mid-migration.

use pagefleet_systest::*;
use pagefleet_testbed::Link;
use serde_json::Value;

use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
/// Where Prometheus listens, inside h1's namespace.
const PROM: &str = "127.0.0.1:9090";

/// The repository's `packaging/` directory.
fn packaging() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../packaging")
}

/// Prometheus, killed when dropped.
struct Prometheus(Child);

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `s` as a URL query value.
fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// GET `path` from the lab's Prometheus: (status, body).
fn get(l: &LabRun, path: &str) -> Result<(u16, String), String> {
    http_in(l, 0, PROM, ("GET", path), &[], Duration::from_secs(20)).map(|r| (r.status, r.body))
}

/// An instant query's result vector (at `time`, a Unix timestamp, if given).
fn query(l: &LabRun, expr: &str, time: Option<f64>) -> Vec<Value> {
    let mut path = format!("/api/v1/query?query={}", urlencode(expr));
    if let Some(t) = time {
        path.push_str(&format!("&time={t:.3}"));
    }
    let (status, body) = get(l, &path).unwrap_or_else(|e| panic!("query {expr}: {e}"));
    let v: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{expr}: {e}: {body}"));
    assert_eq!(
        (status, v["status"].as_str()),
        (200, Some("success")),
        "{expr}: {body}"
    );
    v["data"]["result"].as_array().cloned().unwrap_or_default()
}

/// A sample's value.
fn val(s: &Value) -> f64 {
    s["value"][1]
        .as_str()
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

/// The first sample of `expr`'s result, now.
fn one(l: &LabRun, expr: &str) -> Option<f64> {
    query(l, expr, None).first().map(val)
}

/// Every PromQL expression of the shipped dashboard, with its panel's title.
fn dashboard_exprs() -> Vec<(String, String)> {
    let d: Value =
        serde_json::from_slice(&std::fs::read(packaging().join("grafana/pagefleet.json")).unwrap())
            .unwrap();
    let mut out = vec![];
    for p in d["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().into_iter().flatten() {
            if let Some(e) = t["expr"].as_str() {
                out.push((p["title"].as_str().unwrap_or("").to_string(), e.to_string()));
            }
        }
    }
    out
}

#[test]
fn prometheus_scrapes_a_split_migration_and_every_panel_and_rule_has_data() {
    if !is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    // h1 runs the guests; h2 is the main host (64 MiB of guest memory) and
    // g2's memory server; h3 the sub-host.
    let l = lab("prom", 3, Link::Gbit1, 256 * MIB, &[320 * MIB, 64 * MIB, 0]);
    let dir = tempdir("prom");
    let (ok, token, err) = l.pf(0, &["scrape-token"]);
    assert!(ok, "pagefleet scrape-token: {err}");
    let token_file = dir.path().join("pagefleet.token");
    std::fs::write(&token_file, token.trim()).unwrap();
    let targets: Vec<String> = l
        .lab
        .hosts
        .iter()
        .map(|h| format!("\"{}\"", h.http()))
        .collect();
    let config = format!(
        "global:\n  scrape_interval: 500ms\n  scrape_timeout: 500ms\n  evaluation_interval: 1s\n\
         rule_files:\n  - {}\n\
         scrape_configs:\n  - job_name: pagefleet\n    authorization:\n      credentials_file: {}\n    \
         static_configs:\n      - targets: [{}]\n",
        rules_path().canonicalize().unwrap().display(),
        token_file.display(),
        targets.join(", ")
    );
    let config_file = dir.path().join("prometheus.yml");
    std::fs::write(&config_file, &config).unwrap();
    let log = std::fs::File::create(dir.path().join("prometheus.log")).unwrap();
    let _prom = Prometheus(
        l.lab
            .exec(0, "prometheus")
            .arg(format!("--config.file={}", config_file.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={PROM}"))
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("prometheus (Debian's prometheus package: make deps installs it)"),
    );
    wait_for("Prometheus to be ready", 60, || {
        get(&l, "/-/ready").is_ok_and(|(s, _)| s == 200)
    });

    // g2 pages to h2's memory server (faults, remote bytes, requests);
    // g1 dirties 2000 pages a second and migrates.
    let h2 = l.lab.hosts[1].addr.clone();
    start_paging_guest(&l, "g2", &h2, 2000, &[]);
    start_synthetic(&l, "g1", 256, 2000);
    // Every target up with the token, and g2's faults in the histogram.
    wait_for("Prometheus to scrape every host with the token", 60, || {
        query(&l, "up{job=\"pagefleet\"} == 1", None).len() == 3
    });
    wait_for("g2's faults to reach Prometheus", 120, || {
        one(&l, "pagefleet_guest_fault_seconds_count{guest=\"g2\"}").is_some_and(|v| v > 0.0)
    });
    // A minute of rates needs two samples of each counter at least.
    std::thread::sleep(Duration::from_secs(5));

    let mut during: Option<f64> = None;
    let mut texts: Vec<String> = vec![];
    let report = std::thread::scope(|s| {
        let m = s.spawn(|| {
            l.pf(
                0,
                &[
                    "migrate", "--json", "g1", "--to", "h2", "--sub", "h3", "--verify",
                ],
            )
        });
        let t0 = Instant::now();
        while !m.is_finished() && t0.elapsed() < Duration::from_secs(300) {
            if during.is_none() {
                if let Some(x) = query(
                    &l,
                    "pagefleet_migration_data_processed_bytes{guest=\"g1\"} > 0",
                    None,
                )
                .first()
                {
                    during = x["value"][0].as_f64();
                    texts = (0..3)
                        .filter_map(|h| l.get_text(h, "/metrics").ok())
                        .collect();
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        m.join().unwrap()
    });
    let (ok, out, err) = report;
    assert!(ok, "migrate g1: {err}");
    let r: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("report: {e}: {out}"));
    assert_eq!(r["checksum_source"], r["checksum_dest"], "{r}");
    assert!(
        !r["sub_hosts"].as_array().unwrap().is_empty(),
        "a split migration: {r}"
    );
    let at = during.expect("Prometheus saw the migration's progress while it ran");

    // The progress series, as Prometheus stored them.
    let sent: u64 = r["bytes_main"].as_u64().unwrap()
        + r["bytes_subs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap())
            .sum::<u64>();
    let series = |name: &str| {
        let e = format!("max_over_time(pagefleet_migration_{name}{{guest=\"g1\"}}[10m])");
        one(&l, &e).unwrap_or_else(|| panic!("no {name} in Prometheus"))
    };
    let processed = series("data_processed_bytes");
    assert!(
        processed > 0.0 && processed <= sent as f64,
        "processed {processed} of {sent}"
    );
    assert!(series("round") >= 1.0);
    let phases = query(
        &l,
        "count_over_time(pagefleet_migration_phase{guest=\"g1\"}[10m])",
        None,
    );
    assert!(!phases.is_empty(), "no phase samples");
    wait_for("the source's tallies in Prometheus", 30, || {
        one(&l, "sum(pagefleet_migrations_succeeded_total)") == Some(1.0)
    });
    let downtime = one(&l, "max(pagefleet_migration_last_downtime_seconds)").unwrap();
    let reported = r["downtime_ms"].as_f64().unwrap() / 1e3;
    assert!(
        (downtime - reported).abs() < 1e-3,
        "last downtime {downtime} s, the report says {reported} s"
    );
    assert_eq!(one(&l, "sum(pagefleet_migrations_failed_total)"), Some(0.0));
    // g1 runs on h2 now: its per-guest series moved with it.
    wait_for("g1's series from h2", 30, || {
        query(&l, "pagefleet_guest_resident_bytes{guest=\"g1\"}", None)
            .iter()
            .any(|s| s["metric"]["instance"] == l.lab.hosts[1].http().as_str())
    });

    // Every dashboard panel's expression has data at that moment.
    let mut empty = vec![];
    let exprs = dashboard_exprs();
    assert!(exprs.len() >= 20, "{} expressions", exprs.len());
    for (title, e) in &exprs {
        let e = e.replace("$instance", ".+");
        if query(&l, &e, Some(at)).is_empty() {
            empty.push(format!("{title}: {e}"));
        }
    }
    assert!(
        empty.is_empty(),
        "dashboard expressions without data:\n{}",
        empty.join("\n")
    );

    // Every alerting rule loaded and evaluated cleanly.
    let (_, body) = get(&l, "/api/v1/rules").unwrap();
    let v: Value = serde_json::from_str(&body).unwrap();
    let rules: Vec<&Value> = v["data"]["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap())
        .collect();
    let shipped = std::fs::read_to_string(rules_path()).unwrap();
    assert_eq!(rules.len(), shipped.matches("- alert:").count(), "{body}");
    for r in &rules {
        assert_eq!(r["health"], "ok", "rule {}: {r}", r["name"]);
    }

    // Prometheus' checker on every host, mid-migration.
    assert_eq!(texts.len(), 3, "every host's /metrics mid-migration");
    for (h, t) in texts.iter().enumerate() {
        assert_eq!(
            promtool_check_metrics(t),
            "",
            "promtool check metrics on h{}:\n{t}",
            h + 1
        );
    }
    for g in ["g1", "g2"] {
        let (ok, _, err) = l.pf(0, &["guest", "stop", g]);
        assert!(ok, "guest stop {g}: {err}");
    }
}

fn rules_path() -> PathBuf {
    packaging().join("prometheus/rules.yml")
}
