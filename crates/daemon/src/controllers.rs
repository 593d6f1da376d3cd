//! The KSM and I/O controllers pagefleetd runs (`--ksm`, `--ioqos-*`) as
//! Prometheus series: each controller thread publishes its state after
//! every decision into a [`Latest`], and a scrape writes the last one.

use pagefleet_common::metrics::{Exposition, Kind::*};
use std::sync::{Arc, Mutex};

/// The last state a controller published (none before its first decision).
pub struct Latest<T>(Arc<Mutex<Option<T>>>);

impl<T> Clone for Latest<T> {
    fn clone(&self) -> Self {
        Latest(self.0.clone())
    }
}

impl<T: Clone> Latest<T> {
    /// Nothing published yet.
    pub fn new() -> Latest<T> {
        Latest(Arc::new(Mutex::new(None)))
    }
    /// Publish `s`.
    pub fn set(&self, s: &T) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(s.clone());
    }
    /// The last published.
    pub fn get(&self) -> Option<T> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl<T: Clone> Default for Latest<T> {
    fn default() -> Self {
        Self::new()
    }
}

/// The KSM controller's state as the host report carries it.
pub fn ksm_report(s: &pagefleet_ksm::control::State) -> pagefleet_api::KsmReport {
    pagefleet_api::KsmReport {
        policy: s.policy.clone(),
        phase: s.phase.clone(),
        running: s.run,
        scan_pages_per_second: s.scan_rate,
        saved_bytes: s.saved_bytes,
        ksmd_cpu_ratio: s.ksmd_cpu_share,
        pressure: s.pressure,
        why: s.why.clone(),
    }
}

/// The I/O controller's state as the host report carries it.
pub fn ioqos_report(s: &pagefleet_ioqos::control::State) -> pagefleet_api::IoQosReport {
    pagefleet_api::IoQosReport {
        policy: s.policy.clone(),
        device: s.device.clone(),
        device_used_ratio: s.device_share_used,
        tenants: s
            .tenants
            .iter()
            .map(|t| pagefleet_api::IoQosTenant {
                name: t.name.clone(),
                bytes_per_second: t.bps,
                iops: t.iops,
                limit_bytes_per_second: t.cap_bps,
                starved: t.starved,
                error: t.error.clone(),
            })
            .collect(),
    }
}

/// The KSM controller's series.
pub fn ksm_metrics(s: &pagefleet_ksm::control::State, e: &mut Exposition) {
    e.single(
        "pagefleet_ksm_running",
        Gauge,
        "1 while the controller has KSM scanning (run=1).",
        s.run,
    );
    let mut f = e.family(
        "pagefleet_ksm_phase",
        Gauge,
        "1 for the controller's phase (off, merging, idling; or the peer policy's own).",
    );
    f.sample(
        &[("policy", s.policy.as_str()), ("phase", s.phase.as_str())],
        1u64,
    );
    e.single(
        "pagefleet_ksm_saved_bytes",
        Gauge,
        "Memory KSM saves now (pages sharing and zero pages merged).",
        s.saved_bytes,
    );
    e.single(
        "pagefleet_ksm_pages_sharing",
        Gauge,
        "The kernel's pages_sharing: pages that point at a shared page.",
        pagefleet_ksm::sysfs::read_u64("pages_sharing").unwrap_or(0),
    );
    e.single(
        "pagefleet_ksm_ksmd_cpu_ratio",
        Gauge,
        "ksmd's CPU over the last tick, as a share of one core.",
        s.ksmd_cpu_share,
    );
    e.single(
        "pagefleet_ksm_scan_pages_per_second",
        Gauge,
        "The scan rate the controller set.",
        s.scan_rate,
    );
    e.single(
        "pagefleet_ksm_memory_pressure",
        Gauge,
        "1 while the host is under memory pressure (MemAvailable or PSI).",
        s.pressure,
    );
    e.single(
        "pagefleet_ksm_lost_bytes_total",
        Counter,
        "Merged memory lost since the controller started (swapped out and back in as copies, or unmerged by writes).",
        s.lost_bytes,
    );
    e.single(
        "pagefleet_ksm_decisions_total",
        Counter,
        "Decisions the controller made.",
        s.decisions,
    );
}

/// The I/O controller's series, per tenant.
pub fn ioqos_metrics(s: &pagefleet_ioqos::control::State, e: &mut Exposition) {
    let mut f = e.family(
        "pagefleet_ioqos_device_used_ratio",
        Gauge,
        "Share of the device's modelled capacity in use.",
    );
    f.sample(&[("device", s.device.as_str())], s.device_share_used);
    type Get = fn(&pagefleet_ioqos::control::TenantState) -> Option<f64>;
    let series: [(&str, &str, Get); 6] = [
        (
            "tenant_bytes_per_second",
            "A tenant's I/O over the last interval.",
            |t| Some(t.bps),
        ),
        (
            "tenant_iops",
            "A tenant's I/O requests per second over the last interval.",
            |t| Some(t.iops),
        ),
        (
            "tenant_limit_bytes_per_second",
            "The cap the controller set on a tenant (absent: none).",
            |t| t.cap_bps,
        ),
        (
            "tenant_demand_ratio",
            "A tenant's demand: the share of the device's capacity its I/O used.",
            |t| Some(t.demand_share),
        ),
        (
            "tenant_starved",
            "1 while a tenant is below its minimum on a busy device.",
            |t| Some(if t.starved { 1.0 } else { 0.0 }),
        ),
        (
            "tenant_request_seconds",
            "Mean time per request over the last interval (QMP tenants only).",
            |t| t.latency_ms.map(|ms| ms / 1e3),
        ),
    ];
    for (name, help, get) in series {
        let mut f = e.family(&format!("pagefleet_ioqos_{name}"), Gauge, help);
        for t in &s.tenants {
            if let Some(v) = get(t) {
                f.sample(
                    &[("tenant", t.name.as_str()), ("policy", s.policy.as_str())],
                    v,
                );
            }
        }
    }
    let mut f = e.family(
        "pagefleet_ioqos_tenant_capped_seconds_total",
        Counter,
        "Time a tenant has spent capped.",
    );
    for t in &s.tenants {
        f.sample(
            &[("tenant", t.name.as_str()), ("policy", s.policy.as_str())],
            t.capped_s,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn promtool(text: &str) -> String {
        let mut c = std::process::Command::new("promtool")
            .args(["check", "metrics"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("promtool (Debian's prometheus package: make deps installs it)");
        c.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
        let o = c.wait_with_output().unwrap();
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    }

    #[test]
    fn the_controllers_series_pass_promtool() {
        let k = pagefleet_ksm::control::State {
            pid: 1,
            policy: "adaptive".into(),
            phase: "merging".into(),
            run: true,
            pages_to_scan: 1000,
            sleep_millisecs: 20,
            scan_rate: 50_000.0,
            why: "memory pressure: start merging".into(),
            pressure: true,
            ksmd_cpu_share: 0.08,
            ksmd_nice: 5,
            saved_bytes: 1 << 30,
            lost_bytes: 4096,
            paging: false,
            decisions: 12,
            updated_unix: 0,
        };
        let q: pagefleet_ioqos::control::State = serde_json::from_value(serde_json::json!({
            "pid": 1, "policy": "guarantee", "device": "/dev/loop0",
            "model": {"max_iops": 20000.0, "max_bps": 5e8},
            "device_share_used": 0.7, "updated_unix": 0,
            "tenants": [
                {"name": "db", "backend": "cgroup-v1", "demand_share": 0.5, "pressing_cap": false,
                 "bps": 1e8, "iops": 2000.0, "latency_ms": null, "cap_bps": null, "cap_iops": null,
                 "capped_s": 0.0, "starved": false, "error": null},
                {"name": "batch", "backend": "qmp", "demand_share": 0.2, "pressing_cap": true,
                 "bps": 4e7, "iops": 300.0, "latency_ms": 1.5, "cap_bps": 4.2e7, "cap_iops": null,
                 "capped_s": 12.5, "starved": false, "error": null}
            ]
        }))
        .unwrap();
        let mut e = Exposition::new();
        ksm_metrics(&k, &mut e);
        ioqos_metrics(&q, &mut e);
        let text = e.finish();
        assert_eq!(promtool(&text), "", "{text}");
        assert!(text.contains("pagefleet_ioqos_tenant_limit_bytes_per_second{tenant=\"batch\",policy=\"guarantee\"} 42000000"), "{text}");
        assert!(
            !text.contains("pagefleet_ioqos_tenant_limit_bytes_per_second{tenant=\"db\""),
            "no cap, no sample: {text}"
        );
        assert!(text.contains("pagefleet_ksm_ksmd_cpu_ratio 0.08"), "{text}");
    }
}
