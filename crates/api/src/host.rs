//! Hosts as placement sees them.

use crate::guest::GuestStatus;
use serde::{Deserialize, Serialize};

/// This host's memory as placement sees it, and what its memory server lends
/// (`GET /host`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct HostReport {
    /// The host's name in reports and placement.
    pub hostname: String,
    /// MemTotal, bytes.
    pub mem_total: u64,
    /// MemAvailable, bytes.
    pub mem_available: u64,
    /// The memory server's listen address, if this host lends memory.
    pub memserver: Option<String>,
    /// Bytes the memory server lends.
    pub lend_capacity: u64,
    /// Bytes of it in use.
    pub lend_used: u64,
    /// Regions with pages on the memory server.
    pub regions: u64,
    /// This daemon's HTTP address (what peers and the CLI use).
    #[serde(default)]
    pub http: Option<String>,
    /// Memory this host gives guests (sum of budgets allowed), bytes.
    #[serde(default)]
    pub guest_memory: u64,
    /// What of it is still free, bytes.
    #[serde(default)]
    pub guest_free: u64,
    /// Guests (runners) on this host.
    #[serde(default)]
    pub guests: u64,
    /// The content index sharing-aware migration asks (None: not kept here).
    #[serde(default)]
    pub dedup: Option<DedupIndexReport>,
    /// The name on this host's TLS certificate (None: no identity, its
    /// ports are plaintext only).
    #[serde(default)]
    pub tls: Option<String>,
    /// Cordoned (`pagefleet host cordon` / `drain`): placement puts no
    /// guest and no page here until `pagefleet host uncordon`.
    #[serde(default)]
    pub cordoned: bool,
    /// The daemon's version (`pagefleetd --version`).
    #[serde(default)]
    pub version: String,
    /// When the daemon's process image started, seconds since the Unix
    /// epoch: an in-place restart keeps the pid and changes this.
    #[serde(default)]
    pub started_unix: f64,
    /// The last migrations from this host that ended, newest last (at
    /// most [`crate::migration::RECENT_MIGRATIONS`]).
    #[serde(default)]
    pub migrations: Vec<crate::migration::FinishedMigration>,
    /// The KSM controller's last decision (None: pagefleetd runs none).
    #[serde(default)]
    pub ksm: Option<KsmReport>,
    /// The I/O controller's last state (None: pagefleetd runs none).
    #[serde(default)]
    pub ioqos: Option<IoQosReport>,
}

/// What the KSM controller a pagefleetd runs (`--ksm`) last decided.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct KsmReport {
    /// Its policy (adaptive, or a peer's: ksmtuned, advisor).
    pub policy: String,
    /// Its phase (off, merging, idling; or the peer policy's own).
    pub phase: String,
    /// KSM scanning now.
    pub running: bool,
    /// The scan rate set, pages/s.
    pub scan_pages_per_second: f64,
    /// Memory KSM saves now, bytes.
    pub saved_bytes: u64,
    /// ksmd's share of one core.
    pub ksmd_cpu_ratio: f64,
    /// Memory pressure seen.
    pub pressure: bool,
    /// Why it decided so, for a person.
    pub why: String,
}

/// What the I/O controller a pagefleetd runs (`--ioqos-*`) last saw and set.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct IoQosReport {
    /// Its policy.
    pub policy: String,
    /// The device it shares out.
    pub device: String,
    /// Share of the device's modelled capacity in use.
    pub device_used_ratio: f64,
    /// Every tenant.
    pub tenants: Vec<IoQosTenant>,
}

/// One tenant of the I/O controller.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct IoQosTenant {
    /// Its name.
    pub name: String,
    /// Its I/O over the last interval, bytes/s.
    pub bytes_per_second: f64,
    /// Its I/O requests over the last interval, per second.
    pub iops: f64,
    /// Its cap, bytes/s (None: uncapped).
    pub limit_bytes_per_second: Option<f64>,
    /// Below its minimum on a busy device.
    pub starved: bool,
    /// Why it could not be read or capped.
    pub error: Option<String>,
}

/// `POST /host/restart`'s answer: the daemon execs `binary` once this is
/// sent, handing over its memory server and sockets.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Restarting {
    /// The daemon's process (the same after the restart).
    pub pid: u32,
    /// What it execs.
    pub binary: String,
    /// The version running now.
    pub from_version: String,
    /// What `binary --version` says.
    pub to_version: String,
    /// When the daemon's process image started (the reply of `GET /host`
    /// shows a later time once the next one serves).
    pub started_unix: f64,
}

/// `POST /host/cordon`: keep placement off this host, or let it back.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Cordon {
    /// true: cordon; false: uncordon.
    pub cordoned: bool,
}

/// A host's content index (sharing-aware migration).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct DedupIndexReport {
    /// Distinct page contents indexed.
    pub pages_indexed: u64,
    /// Sources (guests' memories) it was fed from.
    pub sources: u64,
    /// Memory the index holds, bytes.
    pub bytes: u64,
    /// Memory per indexed page, bytes.
    pub bytes_per_page: f64,
    /// Lookups answered (contents asked about by incoming migrations).
    pub lookups: u64,
    /// Of which found here.
    pub hits: u64,
    /// hits / lookups.
    pub hit_rate: f64,
    /// Pages the scanner has hashed since the daemon started.
    pub pages_scanned: u64,
    /// CPU seconds the scanner spent on it.
    pub scan_cpu_secs: f64,
    /// Full passes over every guest's memory finished.
    pub passes: u64,
}

/// One host in the registry's view: its report and guests, or why it did
/// not answer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ClusterHost {
    /// The host's pagefleetd HTTP address.
    pub http: String,
    /// Its report (absent when it did not answer).
    #[serde(default)]
    pub host: Option<HostReport>,
    /// Its guests.
    #[serde(default)]
    pub guests: Vec<GuestStatus>,
    /// Why it did not answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Memory promised on it to migrations on their way (etcd registry
    /// only: the embedded one holds no claims).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claimed: Option<Claimed>,
}

/// Memory promised on a host to migrations on their way, bytes.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Claimed {
    /// Of its guest memory (it is a migration's main host).
    pub guest_bytes: u64,
    /// Of its memory server's lending (it is a migration's sub-host).
    pub lend_bytes: u64,
}

impl ClusterHost {
    /// The host's name, or its address when it did not report.
    pub fn name(&self) -> &str {
        self.host
            .as_ref()
            .map(|r| r.hostname.as_str())
            .unwrap_or(&self.http)
    }

    /// Its memory server's address, if it lends memory.
    pub fn memserver(&self) -> Option<&str> {
        self.host.as_ref().and_then(|r| r.memserver.as_deref())
    }
}

/// The registry view: this host and every peer (`GET /cluster`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ClusterView {
    /// Every host, this one first.
    pub hosts: Vec<ClusterHost>,
}

/// One region a memory server holds (`GET /memserver/regions`).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct MemRegion {
    /// Its id (hex, as guests show theirs).
    pub region: String,
    /// Pages stored.
    pub pages: u64,
    /// The client that created it (its name at the protocol's HELLO:
    /// `pagefleet-runner NAME`, `pagefleet-run`, a block device export).
    pub owner: String,
    /// Seconds since its first page was stored.
    pub age_secs: f64,
    /// Seconds since its last PUT or GET.
    pub idle_secs: f64,
    /// Connected clients that used it.
    pub sessions: u32,
}

/// `POST /memserver/drop`: free one region's pages.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DropRegion {
    /// The region id (hex).
    pub region: String,
}

/// What a drop freed.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Dropped {
    /// The region id (hex).
    pub region: String,
    /// Pages freed.
    pub pages: u64,
}

/// `POST /gc`: collect this host's memory server's orphaned regions.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct GcRequest {
    /// A region idle less than this long is kept.
    pub grace_secs: f64,
    /// Only say what would be freed.
    #[serde(default)]
    pub dry_run: bool,
    /// The operator says the hosts that cannot be asked are gone: collect
    /// what no guest of the hosts that answer owns.
    #[serde(default)]
    pub unreachable_gone: bool,
}

/// What a collection freed on one memory server.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct GcReport {
    /// The memory server.
    pub server: String,
    /// Regions freed (or, in a dry run, that would be).
    pub freed: Vec<MemRegion>,
    /// Pages freed.
    pub pages_freed: u64,
    /// Regions kept: a live guest's, in use by a connected client, or
    /// idle less than the grace period.
    pub kept: u64,
    /// Whether this was a dry run.
    pub dry_run: bool,
}

/// `POST /registry/remove`: take a dead host out of the registry.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RemoveHost {
    /// The host: its name or HTTP address.
    pub host: String,
}

/// `POST /registry/join`: a host announces itself to the join host.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct JoinRequest {
    /// The announcing host's HTTP API address.
    pub http: String,
}

/// The join host's answer: whom it knows.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct JoinReply {
    /// The join host's own HTTP API address.
    pub me: String,
    /// Every other host it knows, the announcing one included.
    pub peers: Vec<String>,
}

/// What `POST /registry/remove` removed on the daemon asked.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct HostRemoved {
    /// The peer address it no longer asks (embedded registry).
    pub peer: Option<String>,
    /// The host's records in etcd were there and are gone.
    pub registry: bool,
    /// Its etcd cluster member was removed too.
    pub etcd_member: bool,
}
