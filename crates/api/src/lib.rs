//! The typed messages between pagefleet processes: what the CLI, pagefleetd,
//! guest runners, benchmarks and tests send each other over HTTP, a
//! runner's control socket and the migration stream. Every message is a
//! serde type here; nobody indexes untyped JSON.
//!
//! - [`host`]: a host's report and the registry's view of the cluster.
//! - [`guest`]: what a guest runs ([`GuestSpec`]), starting one, its status.
//! - [`migration`]: a migrate request, its progress events and report.
//! - [`control`]: the requests a runner's control socket takes.
//! - [`paging`]: the paging runtime's choices (victim policy, prefetch).

#![warn(missing_docs)]

pub mod control;
pub mod guest;
pub mod histogram;
pub mod host;
pub mod launch;
pub mod migration;
pub mod net;
pub mod paging;

pub use control::{ControlReply, ControlRequest};
pub use guest::{
    ContentFill, DiskFormat, FaultCounts, GuestFailure, GuestSpec, GuestState, GuestStatus,
    PageLocations, PagingCosts, SortResult, StartGuest, VmDisk, VmFirmware, VmMachine, Workload,
    MAX_VM_DISKS,
};
pub use histogram::HistogramSnapshot;
pub use host::{
    Claimed, ClusterHost, ClusterView, Cordon, DedupIndexReport, DropRegion, Dropped, GcReport,
    GcRequest, HostRemoved, HostReport, IoQosReport, IoQosTenant, JoinReply, JoinRequest,
    KsmReport, MemRegion, RemoveHost, Restarting,
};
pub use migration::{
    DedupReport, EvacuationEvent, EvacuationOrder, Failure, FinishedMigration, IncomingReply,
    IncomingRequest, MigrateRequest, MigrationOrder, MigrationProgress, Placed, ProgressEvent,
    Report, SubHost,
};
pub use net::{Ipv4Net, MacAddr, VmNic};
pub use paging::{Policy, Prefetch};

/// The body of every error reply (HTTP and control socket).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct ErrorReply {
    /// What went wrong, for a person.
    pub error: String,
}

/// A bare acknowledgement.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct Ok {
    /// Always true.
    pub ok: bool,
}

impl Default for Ok {
    fn default() -> Ok {
        Ok { ok: true }
    }
}
