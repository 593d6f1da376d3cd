//! pagefleetd services: the memory server, the guest host service, the
//! registry (every host's report, gathered from its peers), metrics, and
//! the signed HTTP API that serves them all.

pub mod advertise;
pub mod api;
pub mod app;
pub mod config;
pub mod controllers;
pub mod dedup;
pub mod error;
pub mod gc;
pub mod guests;
pub mod handover;
pub mod http;
pub mod orchestrate;
pub mod registry;
pub mod reload;
pub mod service;
mod sys;
pub mod ui;

use crate::error::Context;
pub use error::{Error, Result};
pub use pagefleet_api::HostReport;
pub use pagefleet_common::units::{fmt_size, parse_size};
use pagefleet_memserver::{gate, ServerConfig, ServerState, Store};
use pagefleet_proto::auth::Secret;
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;

/// A memory server bound to its socket and serving on a background thread.
pub struct MemServer {
    /// Its pages and connections.
    pub state: Arc<ServerState>,
    /// Where it listens.
    pub addr: SocketAddr,
    /// A second handle on its listening socket (for an in-place restart).
    pub listener: TcpListener,
}

impl MemServer {
    /// Bind `listen` and serve `lend_bytes` of pages to clients holding
    /// `secret` — or go on serving what the previous process of an
    /// in-place restart handed over (`inherited`: its socket, pages and id).
    pub fn start(
        listen: &str,
        lend_bytes: u64,
        secret: Secret,
        cfg: ServerConfig,
        inherited: Option<handover::InheritedServer>,
    ) -> Result<MemServer> {
        let (listener, state) = match inherited {
            Some(h) => {
                let cap = pagefleet_units::bytes_of(h.store.capacity_pages());
                if cap != pagefleet_units::bytes_of(pagefleet_units::pages_in(lend_bytes)) {
                    tracing::warn!(
                        "--lend {} differs from the {} the handed-over pool holds: it keeps {} until pagefleetd is stopped and started",
                        fmt_size(lend_bytes),
                        fmt_size(cap),
                        fmt_size(cap)
                    );
                }
                (
                    h.listener,
                    ServerState::with_id(h.store, secret, cfg, h.server_id),
                )
            }
            None => {
                let store = Store::new(lend_bytes).context("cannot create the page store")?;
                let listener = pagefleet_common::listen::listen(listen).with_context(|| {
                    format!(
                        "cannot listen on {listen} (address in use? pick another with --listen)"
                    )
                })?;
                (listener, ServerState::new(store, secret, cfg))
            }
        };
        let addr = listener.local_addr()?;
        let state = Arc::new(state);
        let st = state.clone();
        let kept = listener.try_clone()?;
        std::thread::Builder::new()
            .name("memserver accept".into())
            .spawn(move || gate::serve(listener, st))?;
        Ok(MemServer {
            state,
            addr,
            listener: kept,
        })
    }
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

/// This host's report: its memory and what its memory server lends.
pub fn host_report(ms: Option<(&ServerState, SocketAddr)>) -> HostReport {
    let (mem_total, mem_available) = meminfo();
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap_or_default()
        .trim()
        .to_string();
    let mut r = HostReport {
        hostname,
        mem_total,
        mem_available,
        ..HostReport::default()
    };
    if let Some((st, addr)) = ms {
        let s = st.store.stats(0);
        r.memserver = Some(addr.to_string());
        r.lend_capacity = pagefleet_units::bytes_of(s.capacity_pages);
        r.lend_used = pagefleet_units::bytes_of(s.stored_pages);
        r.regions = s.region_count;
    }
    r
}
