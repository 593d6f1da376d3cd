//! Migrations: the request, the progress stream and the report.

use serde::{Deserialize, Serialize};

/// A sub-host: its memory server and how many pages it may take.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct SubHost {
    /// The memory server's address.
    pub addr: String,
    /// Pages it takes.
    pub pages: u64,
}

/// Migrate a guest (control op `migrate`, and the body of
/// `POST /guests/NAME/migrate`): where to, and how.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MigrateRequest {
    /// The destination runner's migration address (main host).
    pub to: String,
    /// Sub-hosts for the pages the main host does not keep.
    #[serde(default)]
    pub subs: Vec<SubHost>,
    /// Pages the main host keeps resident (default: all).
    #[serde(default)]
    pub main_pages: Option<u64>,
    /// Compare region checksums at stop time and at resume.
    #[serde(default)]
    pub verify: bool,
    /// Integrated migration: the destination pulls every page on memory servers too.
    #[serde(default)]
    pub gather: bool,
    /// Paging policy on the main host (default: as on the source).
    #[serde(default)]
    pub policy: Option<crate::Policy>,
    /// Pages per chunk on the main host (default: as on the source).
    #[serde(default)]
    pub chunk: Option<usize>,
    /// Most pre-copy rounds before stop-and-copy.
    #[serde(default)]
    pub max_rounds: Option<u64>,
    /// Stop and copy once a round leaves at most this many changed pages.
    #[serde(default)]
    pub stop_pages: Option<u64>,
    /// Stop and copy once the changed pages would take at most this long
    /// to send at the last round's rate (default 50 ms).
    #[serde(default)]
    pub max_downtime_ms: Option<u64>,
    /// Give a silent destination up after this many seconds (default 30).
    #[serde(default)]
    pub timeout_secs: Option<u64>,
    /// Send every page as data, even where the destination holds its
    /// content (sharing-aware migration is on by default).
    #[serde(default)]
    pub no_dedup: bool,
    /// Ask about every page even where sending every page measures
    /// faster (saves the link's bytes at the cost of time).
    #[serde(default)]
    pub dedup_always: bool,
}

/// `POST /migrations`, sent to the daemon of the host the guest runs on:
/// that daemon runs placement over its registry, starts the destination
/// runner and drives the migration, streaming [`ProgressEvent`]s. The
/// migration goes on if the caller goes away; `POST /guests/NAME/cancel`
/// stops it.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MigrationOrder {
    /// The guest to move (it runs on the host this is sent to).
    pub guest: String,
    /// The main host (name, HTTP or memory-server address; default: the
    /// one with the most free guest memory).
    #[serde(default)]
    pub to: Option<String>,
    /// Sub-hosts for the pages the main host cannot keep (default: the fewest that fit).
    #[serde(default)]
    pub subs: Option<Vec<String>>,
    /// Integrated migration: the whole guest onto one host.
    #[serde(default)]
    pub gather: bool,
    /// Compare region checksums at stop time and at resume.
    #[serde(default)]
    pub verify: bool,
    /// Paging policy on the main host (default: as on the source).
    #[serde(default)]
    pub policy: Option<crate::Policy>,
    /// Pages per chunk on the main host (default: as on the source).
    #[serde(default)]
    pub chunk: Option<usize>,
    /// Most pre-copy rounds before stop-and-copy.
    #[serde(default)]
    pub max_rounds: Option<u64>,
    /// Stop and copy once a round leaves at most this many changed pages.
    #[serde(default)]
    pub stop_pages: Option<u64>,
    /// Stop and copy once the changed pages would take at most this long
    /// to send at the last round's rate (default 50 ms).
    #[serde(default)]
    pub max_downtime_ms: Option<u64>,
    /// Give a silent destination up after this many seconds (default 30).
    #[serde(default)]
    pub timeout_secs: Option<u64>,
    /// A memory cgroup (under /sys/fs/cgroup) on the main host for the destination runner.
    #[serde(default)]
    pub dest_cgroup: Option<String>,
    /// Send every page as data (sharing-aware migration off).
    #[serde(default)]
    pub no_dedup: bool,
    /// Ask about every page even where sending measures faster.
    #[serde(default)]
    pub dedup_always: bool,
}

/// `POST /evacuations`: empty a host for maintenance. Pages guests keep on
/// its memory server move to another memory server (the guests keep
/// running), then guests running there migrate away (their sub-host pages
/// stay). Any daemon whose registry knows the host can carry it out.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EvacuationOrder {
    /// The host to empty (name, HTTP or memory-server address).
    pub host: String,
    /// Where its memory server's pages go (default: for each guest, the host
    /// lending the most free memory that is neither this one nor the guest's).
    #[serde(default)]
    pub to: Option<String>,
    /// Only move the pages its memory server holds; the guests running
    /// there stay (a daemon restart: they outlive it).
    #[serde(default)]
    pub pages_only: bool,
}

/// One line of an evacuation's stream.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum EvacuationEvent {
    /// A guest's pages moved off the host's memory server.
    PagesMoved {
        /// The guest.
        guest: String,
        /// Pages moved.
        pages: u64,
        /// The host emptied.
        from: String,
        /// The host that took them.
        to: String,
    },
    /// A guest running on the host migrates away; its events follow.
    Migrating {
        /// The guest.
        guest: String,
    },
    /// An event of that migration.
    Migration(Box<ProgressEvent>),
    /// Nothing is left on the host (the last line).
    Done {
        /// The host.
        host: String,
        /// Whether anything had to move.
        moved_any: bool,
    },
    /// The evacuation stopped (the last line); what moved so far stays moved.
    Failed {
        /// Why.
        message: String,
    },
}

/// Where placement put a guest (the first event of `POST /migrations`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Placed {
    /// The guest.
    pub guest: String,
    /// The host it leaves.
    pub source: String,
    /// The main host.
    pub main: String,
    /// Pages resident on the main host.
    pub main_pages: u64,
    /// Sub-hosts and the pages each takes.
    pub subs: Vec<(String, u64)>,
}

/// `POST /incoming`: start a runner here that waits for a migration.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct IncomingRequest {
    /// The guest's name.
    pub name: String,
    /// Pages this host gives it.
    pub budget_pages: u64,
    /// A memory cgroup (under /sys/fs/cgroup) to start the runner in.
    #[serde(default)]
    pub cgroup: Option<String>,
}

/// The reply to `POST /incoming`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct IncomingReply {
    /// Where the waiting runner takes the migration stream.
    pub migrate_addr: String,
}

/// Live counters of a migration in progress.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct MigrationProgress {
    /// What it is doing (connecting, round N, stop-and-copy, ...).
    pub phase: String,
    /// Pre-copy round.
    pub round: u64,
    /// Pages this round sends.
    pub round_pages: u64,
    /// Of which sent so far.
    pub round_sent: u64,
    /// Bytes sent to the main host.
    pub bytes_main: u64,
    /// Bytes sent to sub-hosts.
    pub bytes_subs: u64,
    /// Bytes of the current round not sent yet (its pages left, at 4 KiB
    /// each): what this round still has to move, not the pages the guest
    /// dirties meanwhile (those are `dirty_rate`'s).
    #[serde(default)]
    pub remaining_bytes: u64,
    /// Bytes per second the last round moved (main host and sub-hosts
    /// together; 0 until round 1 ends).
    #[serde(default)]
    pub transfer_rate: u64,
    /// Bytes per second the guest dirtied during the last round (0 until
    /// round 1 ends). Pre-copy converges while this stays below
    /// `transfer_rate`.
    #[serde(default)]
    pub dirty_rate: u64,
}

/// Migrations a host remembers having ended (its `HostReport` carries
/// them, so the dashboard shows the last ones of every host).
pub const RECENT_MIGRATIONS: usize = 5;

/// A migration from a host that ended, as its `HostReport` lists it.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct FinishedMigration {
    /// The guest.
    pub guest: String,
    /// When it ended, seconds since the Unix epoch.
    pub at_unix: u64,
    /// The report, when the guest runs at the destination.
    pub report: Option<Report>,
    /// Why it failed, when it did.
    pub error: Option<String>,
}

/// Why a migration ended without moving the guest.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Failure {
    /// What went wrong.
    pub message: String,
    /// True when the guest may be running at the destination: it stays
    /// paused at the source, for a person to check.
    #[serde(default)]
    pub in_doubt: bool,
    /// What was undone, in order (for a person).
    #[serde(default)]
    pub rolled_back: Vec<String>,
}

/// One line of a migration's progress stream.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "lowercase")]
pub enum ProgressEvent {
    /// Where placement put the guest (orchestrated migrations only, first).
    Placed(Placed),
    /// Counters, every few hundred milliseconds.
    Progress(MigrationProgress),
    /// The guest runs at the destination now (the last line).
    Report(Box<Report>),
    /// The migration failed and was rolled back (the last line).
    Failed(Failure),
}

/// The outcome of a migration, as `pagefleet migrate` prints it.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Report {
    /// The guest.
    pub guest: String,
    /// Where it runs now.
    pub main_host: String,
    /// Memory servers that took pages.
    pub sub_hosts: Vec<String>,
    /// Start to resumed at the destination (checksum time excluded).
    pub total_secs: f64,
    /// Guest paused to guest running at the destination (checksum time excluded).
    pub downtime_ms: f64,
    /// Pre-copy rounds.
    pub rounds: usize,
    /// Pages of the stop-and-copy round.
    pub last_round_pages: u64,
    /// Pages sent to the main host.
    pub pages_main: u64,
    /// Pages sent to each sub-host.
    pub pages_subs: Vec<u64>,
    /// Bytes sent to the main host.
    pub bytes_main: u64,
    /// Bytes sent to each sub-host.
    pub bytes_subs: Vec<u64>,
    /// Pages sent again after they changed.
    pub pages_sent_twice: u64,
    /// Seconds of the first round.
    pub round1_secs: f64,
    /// Bytes of the first round.
    pub round1_bytes: u64,
    /// Of the commit, the time the runtime took to build the region.
    pub region_build_ms: f64,
    #[serde(default)]
    /// Pages the destination pulled from memory servers.
    pub pages_pulled: u64,
    #[serde(default)]
    /// Pulled pages replaced by newer data from the main host.
    pub pulled_then_replaced: u64,
    #[serde(default)]
    /// Downtime part: reaching the safepoint.
    pub pause_ms: f64,
    #[serde(default)]
    /// The last round.
    pub final_copy_ms: f64,
    #[serde(default)]
    /// COMMIT to PREPARED.
    pub commit_ms: f64,
    #[serde(default)]
    /// GO to STARTED.
    pub start_ms: f64,
    /// Region checksum at stop time (with verify).
    pub checksum_source: Option<String>,
    /// Region checksum at resume (with verify).
    pub checksum_dest: Option<String>,
    /// Sharing-aware migration to the main host (None: not used).
    #[serde(default)]
    pub dedup_main: Option<Box<DedupReport>>,
    /// Sharing-aware migration toward each sub-host, in `sub_hosts` order
    /// (empty when it was off). Pages the memory server stored from its
    /// own host; its filling time is not reported (it is the server's).
    #[serde(default)]
    pub dedup_subs: Vec<DedupReport>,
}

/// What sharing-aware migration saved toward one destination.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct DedupReport {
    /// Pages whose content the source hashed (every page, or a probe of a
    /// batch when recent batches found nothing; zero pages are found by a
    /// scan and asked about without hashing).
    pub pages_hashed: u64,
    /// Pages not sent: the destination filled them from its own host.
    pub pages_not_sent: u64,
    /// Of those, zero pages.
    pub zero_pages: u64,
    /// Index hints at the destination that were stale (the page was sent).
    pub stale_hints: u64,
    /// Bytes of hashes sent.
    pub hash_bytes: u64,
    /// Page bytes not sent minus hash bytes sent (negative: it cost more
    /// than it saved).
    pub bytes_saved: i64,
    /// Batches the source only probed (hashing one page in 32).
    pub probe_batches: u64,
    /// Source CPU seconds spent hashing.
    pub source_hash_secs: f64,
    /// Destination seconds spent looking up, reading and checking.
    pub dest_fill_secs: f64,
    /// Destination CPU seconds of that.
    #[serde(default)]
    pub dest_fill_cpu_secs: f64,
    /// Of which waiting for its host's lookup service.
    #[serde(default)]
    pub dest_ask_secs: f64,
    /// Of which reading and checking pages.
    #[serde(default)]
    pub dest_check_secs: f64,
    /// Pages sent as data without asking, because sending every page
    /// measured cheaper than asking in this migration (docs/dedup.md).
    #[serde(default)]
    pub pages_sent_unasked: u64,
    /// Wall µs per page last measured asking (None: not measured).
    #[serde(default)]
    pub ask_us_per_page: Option<f64>,
    /// Wall µs per page last measured sending every page as data.
    #[serde(default)]
    pub send_us_per_page: Option<f64>,
}

impl Report {
    /// Print the report for a person (what `pagefleet migrate` shows).
    pub fn print(&self) {
        print!("{self}");
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        writeln!(
            f,
            "migrated {} to {} in {:.2} s, downtime {:.1} ms, {} rounds",
            self.guest, self.main_host, self.total_secs, self.downtime_ms, self.rounds
        )?;
        writeln!(
            f,
            "  main host {:<22} {:>8} pages  {:>9.1} MiB sent",
            self.main_host,
            self.pages_main,
            mib(self.bytes_main)
        )?;
        for (i, s) in self.sub_hosts.iter().enumerate() {
            writeln!(
                f,
                "  sub-host  {:<22} {:>8} pages  {:>9.1} MiB sent",
                s,
                self.pages_subs[i],
                mib(self.bytes_subs[i])
            )?;
        }
        if let Some(d) = self.dedup_main.as_ref().filter(|d| d.pages_not_sent == 0) {
            writeln!(
                f,
                "  sharing-aware: the main host held none of these pages ({:.1} MiB of hashes, hashing {:.2} s here)",
                mib(d.hash_bytes),
                d.source_hash_secs
            )?;
        } else if let Some(d) = &self.dedup_main {
            writeln!(
                f,
                "  sharing-aware: {} pages not sent (the main host held their content; {} zero pages), {:.1} MiB saved after {:.1} MiB of hashes; hashing {:.2} s here, filling {:.2} s there",
                d.pages_not_sent,
                d.zero_pages,
                d.bytes_saved as f64 / (1 << 20) as f64,
                mib(d.hash_bytes),
                d.source_hash_secs,
                d.dest_fill_secs
            )?;
        }
        if let Some(d) = self
            .dedup_main
            .as_ref()
            .filter(|d| d.pages_sent_unasked > 0)
        {
            let us = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
            writeln!(
                f,
                "  sharing-aware: {} pages sent without asking (measured µs per page: asking {}, sending {})",
                d.pages_sent_unasked,
                us(d.ask_us_per_page),
                us(d.send_us_per_page)
            )?;
        }
        for (s, d) in self.sub_hosts.iter().zip(&self.dedup_subs) {
            writeln!(
                f,
                "  sharing-aware to sub-host {s}: {} of {} pages hashed were stored from its host's content, {:.1} MiB saved after {:.1} MiB of hashes; hashing {:.2} s here",
                d.pages_not_sent,
                d.pages_hashed,
                d.bytes_saved as f64 / (1 << 20) as f64,
                mib(d.hash_bytes),
                d.source_hash_secs
            )?;
        }
        if self.pages_pulled > 0 {
            writeln!(
            f,
                "  pulled from memory servers by the destination: {} pages ({} replaced by newer data from the main host)",
                self.pages_pulled, self.pulled_then_replaced
            )?;
        }
        writeln!(
            f,
            "  round 1: {:.1} MiB in {:.2} s ({:.0} MiB/s); pages sent twice: {}; last round {} pages",
            mib(self.round1_bytes),
            self.round1_secs,
            mib(self.round1_bytes) / self.round1_secs.max(1e-9),
            self.pages_sent_twice,
            self.last_round_pages
        )?;
        writeln!(
            f,
            "  downtime: pause {:.1} ms, last round {:.1} ms, destination builds its region {:.1} ms (of which {:.1} ms in the runtime), start {:.1} ms",
            self.pause_ms, self.final_copy_ms, self.commit_ms, self.region_build_ms, self.start_ms
        )?;
        if let (Some(a), Some(b)) = (&self.checksum_source, &self.checksum_dest) {
            writeln!(
                f,
                "  region checksum at stop {a}, at resume {b}: {}",
                if a == b { "equal" } else { "DIFFERENT" }
            )?;
        }
        Ok(())
    }
}
