//! pagefleetd services. Today: the memory server and the metrics endpoint.

pub mod config;
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
    pub fn start(listen: &str, lend_bytes: u64, secret: Secret, cfg: ServerConfig) -> Result<MemServer> {
        let store = Store::new(lend_bytes).context("cannot create the page store")?;
        let listener = TcpListener::bind(listen)
            .with_context(|| format!("cannot listen on {listen} (address in use? pick another with --listen)"))?;
        let addr = listener.local_addr()?;
        let state = Arc::new(ServerState::new(store, secret, cfg));
        let st = state.clone();
        std::thread::Builder::new().name("memserver accept".into()).spawn(move || server::serve(listener, st))?;
        Ok(MemServer { state, addr })
    }
}
