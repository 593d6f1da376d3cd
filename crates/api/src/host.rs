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
