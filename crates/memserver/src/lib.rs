//! The memory server: lends this host's spare memory to remote regions.
//!
//! - `pool`: the slots' memory, a file that can outlive the process (in-place restart);
//! - [`store`]: pages kept per (region, page number) in page arrays inside
//!   one pre-sized pool, so memory use never exceeds the lent capacity;
//! - [`gate`]: one thread where connections wait until they authenticate;
//! - [`server`]: the protocol-v1 session loop (pipelining, errors, per-frame deadlines);
//! - [`metrics`]: counters and their Prometheus text rendering;
//! - [`content`]: the host content a PUT_HASHED page may be stored from.

pub mod content;
pub mod gate;
pub mod metrics;
mod pool;
mod push;
pub mod server;
pub mod store;
mod sys;

pub use content::LocalContent;
pub use pool::{Backing, PoolError};
pub use server::{ServerConfig, ServerState};
pub use store::{Frozen, RegionInfo, Store, StoreError};
