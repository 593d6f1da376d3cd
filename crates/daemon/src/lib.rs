//! pagefleetd services: the memory server, the guest host service, the
//! registry (every host's report, gathered from its peers) and metrics.

pub mod config;
pub mod guests;
pub mod http;
pub mod units;

use anyhow::{Context, Result};
use pagefleet_memserver::{server, ServerConfig, ServerState, Store};
use pagefleet_proto::auth::Secret;
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;

/// A memory server bound to its socket and serving on a background thread.
pub struct MemServer {
    pub state: Arc<ServerState>,
    pub addr: SocketAddr,
}

impl MemServer {
    pub fn start(
        listen: &str,
        lend_bytes: u64,
        secret: Secret,
        cfg: ServerConfig,
    ) -> Result<MemServer> {
        let store = Store::new(lend_bytes).context("cannot create the page store")?;
        let listener = TcpListener::bind(listen).with_context(|| {
            format!("cannot listen on {listen} (address in use? pick another with --listen)")
        })?;
        let addr = listener.local_addr()?;
        let state = Arc::new(ServerState::new(store, secret, cfg));
        let st = state.clone();
        std::thread::Builder::new()
            .name("memserver accept".into())
            .spawn(move || server::serve(listener, st))?;
        Ok(MemServer { state, addr })
    }
}

/// This host's memory as placement sees it, and what its memory server lends.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct HostReport {
    pub hostname: String,
    pub mem_total: u64,
    pub mem_available: u64,
    /// The memory server: listen address, capacity and bytes stored.
    pub memserver: Option<String>,
    pub lend_capacity: u64,
    pub lend_used: u64,
    pub regions: u64,
    /// This daemon's HTTP address (what peers and the CLI use).
    #[serde(default)]
    pub http: Option<String>,
    /// The guest host service: memory it gives guests, what is still free, guests running.
    #[serde(default)]
    pub guest_memory: u64,
    #[serde(default)]
    pub guest_free: u64,
    #[serde(default)]
    pub guests: u64,
}

/// MemTotal and MemAvailable from /proc/meminfo, in bytes.
pub fn meminfo() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let get = |k: &str| {
        s.lines()
            .find(|l| l.starts_with(k))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
            * 1024
    };
    (get("MemTotal:"), get("MemAvailable:"))
}

impl HostReport {
    pub fn collect(ms: Option<(&ServerState, SocketAddr)>) -> HostReport {
        let (mem_total, mem_available) = meminfo();
        let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .unwrap_or_default()
            .trim()
            .to_string();
        let (memserver, cap, used, regions) = match ms {
            Some((st, addr)) => {
                let s = st.store.stats(0);
                (
                    Some(addr.to_string()),
                    s.capacity_pages * 4096,
                    s.stored_pages * 4096,
                    s.region_count,
                )
            }
            None => (None, 0, 0, 0),
        };
        HostReport {
            hostname,
            mem_total,
            mem_available,
            memserver,
            lend_capacity: cap,
            lend_used: used,
            regions,
            http: None,
            guest_memory: 0,
            guest_free: 0,
            guests: 0,
        }
    }
}

/// The registry view: this host and every peer, each with its report and
/// guests (`GET /cluster`). Peers are asked in parallel; one that does not
/// answer is listed with its error.
pub fn cluster(me: serde_json::Value, peers: &[String]) -> serde_json::Value {
    let t = std::time::Duration::from_secs(2);
    let others: Vec<serde_json::Value> = std::thread::scope(|s| {
        let hs: Vec<_> = peers
            .iter()
            .map(|p| {
                s.spawn(move || {
                    let r = http::get(p, "/host", t).and_then(|h| {
                        let host: serde_json::Value = serde_json::from_str(&h)?;
                        let guests: serde_json::Value = http::get(p, "/guests", t)
                            .ok()
                            .and_then(|g| serde_json::from_str(&g).ok())
                            .unwrap_or(serde_json::json!([]));
                        Ok(serde_json::json!({"http": p, "host": host, "guests": guests}))
                    });
                    r.unwrap_or_else(|e| serde_json::json!({"http": p, "error": e.to_string()}))
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or(serde_json::Value::Null))
            .collect()
    });
    let mut all = vec![me];
    all.extend(others);
    serde_json::json!({ "hosts": all })
}
