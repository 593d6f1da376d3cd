//! Server counters and their Prometheus text exposition.

use crate::store::StoreStats;
use pagefleet_common::metrics::Kind;
use pagefleet_proto::{ErrorCode, Opcode};
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

/// The Prometheus text (version 0.0.4) for these counters, the store's `s`
/// and `connections` open.
pub fn render(m: &Metrics, s: &StoreStats, connections: u32) -> String {
    use pagefleet_common::metrics::{Exposition, Kind::*};
    let mut e = Exposition::new();
    let page = pagefleet_proto::PAGE_SIZE as u64;
    e.single(
        "pagefleet_memserver_capacity_bytes",
        Gauge,
        "Memory lent by this server.",
        s.capacity_pages * page,
    );
    e.single(
        "pagefleet_memserver_stored_pages",
        Gauge,
        "Pages currently stored.",
        s.stored_pages,
    );
    e.single(
        "pagefleet_memserver_stored_bytes",
        Gauge,
        "Bytes currently stored.",
        s.stored_pages * page,
    );
    e.single(
        "pagefleet_memserver_used_slots",
        Gauge,
        "Slots not free (stored, arriving, or being sent).",
        s.used_slots,
    );
    e.single(
        "pagefleet_memserver_touched_bytes",
        Gauge,
        "Pool bytes ever touched (bound on pool RSS).",
        s.touched_slots * page,
    );
    e.single(
        "pagefleet_memserver_regions",
        Gauge,
        "Regions with at least one page.",
        s.region_count,
    );
    e.single(
        "pagefleet_memserver_connections",
        Gauge,
        "Open authenticated sessions.",
        connections,
    );
    let counters: [(&str, &str, &AtomicU64); 15] = [
        (
            "connections_total",
            "Connections accepted.",
            &m.connections_total,
        ),
        (
            "connections_refused_total",
            "Connections refused (limit).",
            &m.connections_refused,
        ),
        (
            "auth_failures_total",
            "Failed HELLO authentications.",
            &m.auth_failures,
        ),
        (
            "handshake_timeouts_total",
            "Connections closed for not authenticating in time.",
            &m.handshake_timeouts,
        ),
        (
            "handshake_evictions_total",
            "Unauthenticated connections dropped to admit newer ones.",
            &m.handshake_evictions,
        ),
        (
            "tls_handshakes_total",
            "Connections switched to TLS.",
            &m.tls_handshakes,
        ),
        (
            "tls_failures_total",
            "TLS handshakes that failed (no or a stranger's certificate).",
            &m.tls_failures,
        ),
        (
            "received_bytes_total",
            "Bytes received in frames.",
            &m.bytes_in,
        ),
        ("sent_bytes_total", "Bytes sent in frames.", &m.bytes_out),
        ("pages_put_total", "Pages received by PUT.", &m.pages_put),
        (
            "pages_got_total",
            "Pages sent by GET (keep or take).",
            &m.pages_got,
        ),
        (
            "pages_pushed_total",
            "Pages stored on other memory servers by PUSH (re-replication).",
            &m.pages_pushed,
        ),
        (
            "pages_taken_total",
            "Pages removed by GET take.",
            &m.pages_taken,
        ),
        (
            "pages_hashed_total",
            "Pages PUT_HASHED named by content (sharing-aware migration).",
            &m.pages_hashed,
        ),
        (
            "pages_hashed_stored_total",
            "Of those, stored from this host's own content instead of being sent.",
            &m.pages_hashed_stored,
        ),
    ];
    for (name, help, c) in counters {
        e.single(
            &format!("pagefleet_memserver_{name}"),
            Counter,
            help,
            c.load(Relaxed),
        );
    }
    let mut f = e.family(
        "pagefleet_memserver_requests_total",
        Counter,
        "Requests by operation.",
    );
    for (i, op) in OPS.iter().enumerate() {
        f.sample(&[("op", op.name())], m.requests[i].load(Relaxed));
    }
    let mut f = e.family(
        "pagefleet_memserver_errors_total",
        Counter,
        "Error replies by code.",
    );
    for c in ErrorCode::ALL {
        f.sample(&[("code", c.name())], m.errors_of(c));
    }
    let regions: Vec<String> = s.regions.iter().map(|r| format!("{:#x}", r.0)).collect();
    // A region as `StoreStats` lists it: (id, pages, bytes received, bytes sent).
    type PerRegion = (
        &'static str,
        Kind,
        &'static str,
        fn(&(u64, u64, u64, u64)) -> u64,
    );
    let per_region: [PerRegion; 3] = [
        ("region_pages", Gauge, "Pages stored per region.", |r| r.1),
        (
            "region_received_bytes_total",
            Counter,
            "Page bytes received per region.",
            |r| r.2,
        ),
        (
            "region_sent_bytes_total",
            Counter,
            "Page bytes sent per region.",
            |r| r.3,
        ),
    ];
    for (name, kind, help, get) in per_region {
        let mut f = e.family(&format!("pagefleet_memserver_{name}"), kind, help);
        for (r, id) in s.regions.iter().zip(&regions) {
            f.sample(&[("region", id.as_str())], get(r));
        }
    }
    e.single(
        "process_cpu_seconds_total",
        Counter,
        "CPU time of pagefleetd (the memory server and whatever else it runs); \
         per page moved: divide by pages put + pages got.",
        process_cpu_secs(),
    );
    e.finish()
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
    let hz = pagefleet_common::sys::process::clock_ticks() as f64;
    f.iter().sum::<u64>() as f64 / hz
}
