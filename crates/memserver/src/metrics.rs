//! Server counters and their Prometheus text exposition.

use crate::store::StoreStats;
use pagefleet_proto::{ErrorCode, Opcode};
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

const OPS: [Opcode; 9] = [
    Opcode::Hello,
    Opcode::Put,
    Opcode::Get,
    Opcode::Delete,
    Opcode::Stat,
    Opcode::Ping,
    Opcode::PutHashed,
    Opcode::StartTls,
    Opcode::Push,
];

/// The server's counters (Prometheus text: `render`).
#[derive(Default)]
pub struct Metrics {
    requests: [AtomicU64; 9],
    errors: [AtomicU64; 16],
    /// Bytes read from clients.
    pub bytes_in: AtomicU64,
    /// Bytes sent to clients.
    pub bytes_out: AtomicU64,
    /// Pages stored by PUTs.
    pub pages_put: AtomicU64,
    /// Pages sent by GETs.
    pub pages_got: AtomicU64,
    /// Pages stored on other servers by PUSH.
    pub pages_pushed: AtomicU64,
    /// Pages PUT_HASHED asked about.
    pub pages_hashed: AtomicU64,
    /// Of those, stored from this host's own content (not sent).
    pub pages_hashed_stored: AtomicU64,
    /// Of those, pages removed as sent (take).
    pub pages_taken: AtomicU64,
    /// Connections accepted.
    pub connections_total: AtomicU64,
    /// Connections refused (over max_conns).
    pub connections_refused: AtomicU64,
    /// Connections that failed the cluster-secret proof.
    pub auth_failures: AtomicU64,
    /// Connections dropped for not authenticating in time.
    pub handshake_timeouts: AtomicU64,
    /// Waiting connections dropped to admit newer ones (handshake cap full).
    pub handshake_evictions: AtomicU64,
    /// Connections switched to TLS (handshake completed).
    pub tls_handshakes: AtomicU64,
    /// TLS handshakes that failed (no certificate, a stranger's, garbage).
    pub tls_failures: AtomicU64,
}

impl Metrics {
    /// Count one request of `op`.
    pub fn request(&self, op: Opcode) {
        if let Some(i) = OPS.iter().position(|o| *o == op) {
            self.requests[i].fetch_add(1, Relaxed);
        }
    }
    /// Count one error reply with `code`.
    pub fn error(&self, code: ErrorCode) {
        self.errors[code as usize].fetch_add(1, Relaxed);
    }
    /// Error replies with `code` so far.
    pub fn errors_of(&self, code: ErrorCode) -> u64 {
        self.errors[code as usize].load(Relaxed)
    }
}

/// Render every metric in Prometheus text format (version 0.0.4).
/// The Prometheus text for these counters, the store's `s` and `connections` open.
pub fn render(m: &Metrics, s: &StoreStats, connections: u32) -> String {
    let mut o = String::with_capacity(4096);
    let mut gauge = |name: &str, help: &str, kind: &str, v: u64| {
        let _ = writeln!(
            o,
            "# HELP pagefleet_{name} {help}\n# TYPE pagefleet_{name} {kind}\npagefleet_{name} {v}"
        );
    };
    gauge(
        "memserver_capacity_bytes",
        "Memory lent by this server.",
        "gauge",
        s.capacity_pages * 4096,
    );
    gauge(
        "memserver_stored_pages",
        "Pages currently stored.",
        "gauge",
        s.stored_pages,
    );
    gauge(
        "memserver_stored_bytes",
        "Bytes currently stored.",
        "gauge",
        s.stored_pages * 4096,
    );
    gauge(
        "memserver_used_slots",
        "Slots not free (stored, arriving, or being sent).",
        "gauge",
        s.used_slots,
    );
    gauge(
        "memserver_touched_bytes",
        "Pool bytes ever touched (bound on pool RSS).",
        "gauge",
        s.touched_slots * 4096,
    );
    gauge(
        "memserver_regions",
        "Regions with at least one page.",
        "gauge",
        s.region_count,
    );
    gauge(
        "memserver_connections",
        "Open authenticated sessions.",
        "gauge",
        connections as u64,
    );
    gauge(
        "memserver_connections_total",
        "Connections accepted.",
        "counter",
        m.connections_total.load(Relaxed),
    );
    gauge(
        "memserver_connections_refused_total",
        "Connections refused (limit).",
        "counter",
        m.connections_refused.load(Relaxed),
    );
    gauge(
        "memserver_auth_failures_total",
        "Failed HELLO authentications.",
        "counter",
        m.auth_failures.load(Relaxed),
    );
    gauge(
        "memserver_handshake_timeouts_total",
        "Connections closed for not authenticating in time.",
        "counter",
        m.handshake_timeouts.load(Relaxed),
    );
    gauge(
        "memserver_handshake_evictions_total",
        "Unauthenticated connections dropped to admit newer ones.",
        "counter",
        m.handshake_evictions.load(Relaxed),
    );
    gauge(
        "memserver_tls_handshakes_total",
        "Connections switched to TLS.",
        "counter",
        m.tls_handshakes.load(Relaxed),
    );
    gauge(
        "memserver_tls_failures_total",
        "TLS handshakes that failed (no or a stranger's certificate).",
        "counter",
        m.tls_failures.load(Relaxed),
    );
    gauge(
        "memserver_received_bytes_total",
        "Bytes received in frames.",
        "counter",
        m.bytes_in.load(Relaxed),
    );
    gauge(
        "memserver_sent_bytes_total",
        "Bytes sent in frames.",
        "counter",
        m.bytes_out.load(Relaxed),
    );
    gauge(
        "memserver_pages_put_total",
        "Pages received by PUT.",
        "counter",
        m.pages_put.load(Relaxed),
    );
    gauge(
        "memserver_pages_got_total",
        "Pages sent by GET (keep or take).",
        "counter",
        m.pages_got.load(Relaxed),
    );
    gauge(
        "memserver_pages_pushed_total",
        "Pages stored on other memory servers by PUSH (re-replication).",
        "counter",
        m.pages_pushed.load(Relaxed),
    );
    gauge(
        "memserver_pages_taken_total",
        "Pages removed by GET take.",
        "counter",
        m.pages_taken.load(Relaxed),
    );
    gauge(
        "memserver_pages_hashed_total",
        "Pages PUT_HASHED named by content (sharing-aware migration).",
        "counter",
        m.pages_hashed.load(Relaxed),
    );
    gauge(
        "memserver_pages_hashed_stored_total",
        "Of those, stored from this host's own content instead of being sent.",
        "counter",
        m.pages_hashed_stored.load(Relaxed),
    );
    let _ = writeln!(o, "# HELP pagefleet_memserver_requests_total Requests by operation.\n# TYPE pagefleet_memserver_requests_total counter");
    for (i, op) in OPS.iter().enumerate() {
        let _ = writeln!(
            o,
            "pagefleet_memserver_requests_total{{op=\"{}\"}} {}",
            op.name(),
            m.requests[i].load(Relaxed)
        );
    }
    let _ = writeln!(o, "# HELP pagefleet_memserver_errors_total Error replies by code.\n# TYPE pagefleet_memserver_errors_total counter");
    for c in ErrorCode::ALL {
        let _ = writeln!(
            o,
            "pagefleet_memserver_errors_total{{code=\"{}\"}} {}",
            c.name(),
            m.errors_of(c)
        );
    }
    let _ = writeln!(o, "# HELP pagefleet_memserver_region_pages Pages stored per region.\n# TYPE pagefleet_memserver_region_pages gauge");
    for r in &s.regions {
        let _ = writeln!(
            o,
            "pagefleet_memserver_region_pages{{region=\"{:#x}\"}} {}",
            r.0, r.1
        );
    }
    let _ = writeln!(o, "# HELP pagefleet_memserver_region_received_bytes_total Page bytes received per region.\n# TYPE pagefleet_memserver_region_received_bytes_total counter");
    for r in &s.regions {
        let _ = writeln!(
            o,
            "pagefleet_memserver_region_received_bytes_total{{region=\"{:#x}\"}} {}",
            r.0, r.2
        );
    }
    let _ = writeln!(o, "# HELP pagefleet_memserver_region_sent_bytes_total Page bytes sent per region.\n# TYPE pagefleet_memserver_region_sent_bytes_total counter");
    for r in &s.regions {
        let _ = writeln!(
            o,
            "pagefleet_memserver_region_sent_bytes_total{{region=\"{:#x}\"}} {}",
            r.0, r.3
        );
    }
    let _ = writeln!(
        o,
        "# HELP process_cpu_seconds_total CPU time of pagefleetd (the memory server and whatever else it runs); \
         per page moved: divide by pages put + pages got.\n# TYPE process_cpu_seconds_total counter\n\
         process_cpu_seconds_total {:.3}",
        process_cpu_secs()
    );
    o
}

/// CPU time of this process so far, seconds (utime + stime).
fn process_cpu_secs() -> f64 {
    let Ok(s) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Fields after the command name (which may hold spaces) end with ')'.
    let rest = s.rsplit_once(')').map_or("", |x| x.1);
    let f: Vec<u64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|x| x.parse().ok())
        .collect();
    // SAFETY: sysconf has no preconditions.
    let hz = (unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).max(1) as f64;
    f.iter().sum::<u64>() as f64 / hz
}
