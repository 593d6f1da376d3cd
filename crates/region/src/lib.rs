//! The paging runtime: a guest's memory as a region that lives partly on
//! memory servers (S-memV remote paging), inside the guest process.
//!
//! A region is a memfd mapped `MAP_SHARED` (THP off) and registered on one
//! userfaultfd for MISSING and WP faults. One pager thread owns the
//! uffd, the location DB, the access history and the server connections:
//!
//! - **MISSING** fault: never-touched pages of the chunk are zero-filled
//!   locally; a page on a server is fetched first, installed and its thread
//!   woken, then the rest of its chunk follows (S-memV page-in).
//! - **reference bits**: the sampler and the victim hand unmap resident
//!   pages (the memfd keeps them); the kernel maps a touched one back by
//!   itself and `PAGEMAP_SCAN` shows it as referenced.
//! - **balance**: over budget, the coldest chunks (clock: least sum of bits;
//!   aging: least max age) are paged out atomically: write-protect, send,
//!   punch hole, unprotect.
//! - **sampling**: a clock hand zaps chunks' PTEs at a rate bounded by a CPU
//!   budget for the minor faults and TLB shootdowns it causes, faster while
//!   victims are needed.

pub mod capi;
mod guestmem;
mod pager;
mod stats;
mod sys;

use guestmem::GuestMem;
pub use guestmem::{Foreign, Unmapper};
pub use pagefleet_client::ConnectOptions;
pub use pagefleet_proto::auth::Secret;
pub use pager::WRITER_THREAD;
pub use stats::{Histogram, Stats};

use pagefleet_uffd::{self as uffd, Mapping};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// The page size.
pub const PAGE: usize = pagefleet_units::PAGE_SIZE;

/// The pager keeps resident pages between `budget - slack` and
/// `budget - slack/2` once over them (watermarks). A migration fills a
/// main host only up to `budget - slack`, so the guest does not resume
/// in the middle of an eviction.
///
/// A 128th of the budget (was a 32nd): the slack is memory the guest may
/// use and does not, so every page of it is a page-in more under a skewed
/// load. With the writer evicting off the fault path, 0.8% of the budget
/// (512 pages at 256 MiB) still absorbs the page-ins of the few ms a
/// page-out job takes; the kv bench at a 50% budget took 4–8% fewer
/// page-ins per op (0.0709 vs 0.0773, 0.0710 vs 0.0743) for +1–7% ops/s
/// in the same rounds, the sequential scan was unchanged (0.943 vs 0.938
/// GB/s), and a 512th made faults wait for page-outs (−5%).
pub fn paging_slack(budget_pages: u64, chunk_pages: usize) -> u64 {
    (chunk_pages as u64 * 4).max(budget_pages / 128)
}

/// Re-replication's default bandwidth: 256 MiB/s, a fifth of a 10 Gbit/s
/// link, so restoring copies after a server's death does not starve the
/// guests' own paging.
pub const DEFAULT_REREPLICATE_RATE: u64 = 256 << 20;

/// The victim policy and the prefetch choice: one name list each, in `api`.
pub use pagefleet_api::{Policy, Prefetch};

/// What the runtime does when a page cannot be brought back (its server is
/// gone): the guest cannot continue without its memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnFatal {
    /// Print the error (naming the server) and exit the process with status 75.
    Exit,
    /// Poison the page (the accessing thread gets SIGBUS) and keep the error
    /// for `Region::fatal_error`.
    Poison,
}

/// The sampling hand's default budget (`Config::sample_cpu_budget`): 1%
/// of one core, half the 2% its cost may take from a guest, because the
/// costs it charges are estimates (on the kv bench with everything
/// resident, a 2% budget cost 1.1–1.7% by its interleaved rounds).
pub const DEFAULT_SAMPLE_CPU_BUDGET: f64 = 0.01;

/// How long closing a region waits for a server it called down (hung or
/// dead) to take the delete of its stale copies.
const DOWN_SERVER_CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

/// The fault loop's default spin for a faulting page's reply (`Config::reply_spin`):
/// a loopback or LAN round trip with the server's wake-up in it (p99 of
/// `pagefleet bench paging`'s single faults here: 170–300 µs).
pub const DEFAULT_REPLY_SPIN: Duration = Duration::from_micros(200);

/// How to make a region.
#[derive(Clone, Debug)]
pub struct Config {
    /// Region size in bytes (rounded up to whole chunks).
    pub size: u64,
    /// Pages allowed to be resident locally.
    pub budget_pages: u64,
    /// Pages per chunk (a power of two, 1..=64): the paging and placement unit.
    pub chunk_pages: usize,
    /// Victim choice.
    pub policy: Policy,
    /// What a remote fault brings in besides its page.
    pub prefetch: Prefetch,
    /// How long the fault loop polls for a faulting page's reply before it
    /// sleeps, while the host has idle CPUs (never under load) and such
    /// replies usually come within it; zero: never. See `docs/paging.md`.
    pub reply_spin: Duration,
    /// Memory servers (HOST:PORT) pages may go to.
    pub servers: Vec<String>,
    /// Copies of every remote page, on different servers (1 or 2). With
    /// 2 a page-out counts only when both servers acknowledged it; a dead
    /// server's pages are read from their mirror and re-replicated.
    pub replicas: usize,
    /// Re-replication's bandwidth, bytes/s (0: unlimited).
    pub rereplicate_rate: u64,
    /// The cluster secret (needed with servers).
    pub secret: Option<Secret>,
    /// Region id on the servers (0: random).
    pub region_id: u64,
    /// Fraction of one core the sampling faults may cost the guest; 0: the
    /// sampling hand never moves (the victim hand still reads reference
    /// bits when it looks for victims).
    pub sample_cpu_budget: f64,
    /// Fastest full sweep of all chunks by the sampling hand.
    pub sample_period: Duration,
    /// Estimated guest cost of one page touched after a sampling zap: the
    /// minor fault the kernel resolves (1.1 µs measured with its zap) and
    /// cache misses around it: 10 µs, from the kv bench with everything
    /// resident (charged 5 µs, 1 627 touches/s and 20 zaps/s cost it 1.6%
    /// and 2.3% in two runs, medians of three side-by-side pairs). (As uffd
    /// MINOR faults, a pager round trip that stopped the thread, they were
    /// charged 80 µs.)
    pub minor_fault_cost: Duration,
    /// Estimated guest cost of one zap: a TLB shootdown, and in a VM the
    /// refills of every TLB entry the guest threads then miss. Measured on
    /// the kv bench, everything resident: a zap every 5 ms cost 4% of its
    /// throughput with only 660 touches/s, ~200 µs per zap.
    pub zap_cost: Duration,
    /// What a lost page does to the guest.
    pub on_fatal: OnFatal,
    /// Shown in the memory servers' logs.
    pub name: String,
    /// Pages that start out on memory servers, under `region_id` (a guest
    /// resumed from elsewhere).
    pub initial_remote: Vec<RemoteRun>,
    /// Start from memory a migration filled (see [`Adopt`]) instead of an
    /// empty memfd.
    pub adopt: Option<Arc<Adopt>>,
    /// The guest memory is mapped by another process (a VM), which
    /// registered it with the userfaultfd it passed here; the memfd is
    /// `adopt`'s (required with this).
    pub foreign: Option<Arc<Foreign>>,
}

/// Pages that start out on memory servers: `count` pages from `first` on
/// `servers[server]` (and, with two replicas, also on `servers[mirror]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteRun {
    /// First page.
    pub first: u64,
    /// Pages.
    pub count: u64,
    /// Index into `Config::servers` of the server pages are read from.
    pub server: usize,
    /// Index of the server holding their second copy.
    pub mirror: Option<usize>,
}

/// Guest memory received by an incoming migration: the memfd, its guest
/// mapping (not yet registered with userfaultfd; received pages are already
/// mapped in it, so the resumed guest takes no fault on them) and the access
/// history per page. Pages with data in the memfd become resident; holes are
/// never-touched pages unless `initial_remote` places them on a server.
pub struct Adopt {
    /// The memfd holding the received pages.
    pub memfd: Arc<OwnedFd>,
    /// Its guest mapping.
    pub guest: Arc<Mapping>,
    /// Per page: its access history.
    pub history: Vec<u8>,
    /// Connections to the region's servers made ahead (during the
    /// migration, not in its downtime): (address, connection).
    pub conns: Mutex<Vec<(String, pagefleet_client::Conn)>>,
    /// The pages with data, as (first, count) runs, when the filler knows
    /// them (SEEK_DATA over a large memfd costs milliseconds of downtime).
    pub resident: Option<Vec<(u64, u64)>>,
}

impl std::fmt::Debug for Adopt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Adopt({} bytes)", self.guest.len())
    }
}

impl Adopt {
    /// A memfd of `size` bytes and its (unregistered) guest mapping.
    pub fn create(name: &str, size: u64) -> std::io::Result<Adopt> {
        let memfd = uffd::memfd(name, size)?;
        let guest = Mapping::shared(&memfd, size as usize)?;
        guest.madvise(0, guest.len(), sys::MADV_NOHUGEPAGE)?;
        Ok(Adopt {
            memfd: Arc::new(memfd),
            guest: Arc::new(guest),
            history: vec![0; (size as usize).div_ceil(PAGE)],
            conns: Mutex::new(Vec::new()),
            resident: None,
        })
    }
}

impl Config {
    /// A region of `size` bytes keeping at most `budget_pages` resident; the rest default.
    pub fn new(size: u64, budget_pages: u64) -> Config {
        Config {
            size,
            budget_pages,
            chunk_pages: 16,
            policy: Policy::default(),
            prefetch: Prefetch::Adaptive,
            reply_spin: DEFAULT_REPLY_SPIN,
            servers: Vec::new(),
            replicas: 1,
            rereplicate_rate: DEFAULT_REREPLICATE_RATE,
            secret: None,
            region_id: 0,
            sample_cpu_budget: DEFAULT_SAMPLE_CPU_BUDGET,
            sample_period: Duration::from_secs(1),
            minor_fault_cost: Duration::from_micros(10),
            zap_cost: Duration::from_micros(200),
            on_fatal: OnFatal::Exit,
            name: "pagefleet-region".into(),
            initial_remote: Vec::new(),
            adopt: None,
            foreign: None,
        }
    }
}

/// Why a region failed.
#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    /// userfaultfd.
    #[error(transparent)]
    Uffd(#[from] uffd::UffdError),
    /// A system call.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// Why.
        source: std::io::Error,
    },
    /// A memory server.
    #[error(transparent)]
    Client(#[from] pagefleet_client::ClientError),
    /// A configuration the runtime cannot use.
    #[error("bad region configuration: {0}")]
    Config(String),
    /// Moving pages between memory servers failed.
    #[error("evacuating pages: {0}")]
    Evacuate(String),
    /// The pager thread did not answer (it stopped).
    #[error("the region's pager did not answer")]
    PagerGone,
}

/// Requests to the pager thread (it owns the location DB and history).
pub(crate) enum Command {
    TrackDirty(bool, std::sync::mpsc::Sender<()>),
    TakeDirty(std::sync::mpsc::Sender<Vec<u64>>),
    Snapshot(std::sync::mpsc::Sender<Snapshot>),
    /// Location and history of the given pages only.
    Pages(Vec<u64>, std::sync::mpsc::Sender<Vec<(Location, u8)>>),
    /// Pause (true) or resume balancing and sampling: faults are still served.
    Hold(bool, std::sync::mpsc::Sender<()>),
    /// Move every page on server `from` to server `to` (added if new).
    Evacuate {
        from: String,
        to: String,
        reply: std::sync::mpsc::Sender<Result<u64, String>>,
    },
}

/// Where every page is and how hot it has been (for migration planning).
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// The region's id on the memory servers.
    pub region_id: u64,
    /// Pages per chunk.
    pub chunk_pages: usize,
    /// Memory servers (Location::Remote indexes this).
    pub servers: Vec<String>,
    /// Per page: Location.
    pub location: Vec<Location>,
    /// Per page: access history (aging byte; clock: 0x80 if referenced).
    pub history: Vec<u8>,
}

/// Where a page is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Location {
    /// Never touched: reads as zeros.
    Zero,
    /// Resident here.
    Local,
    /// On `servers[i]` (pages are read from it), and with two replicas
    /// also on `servers[m]`: `Remote(i, Some(m))`.
    Remote(usize, Option<usize>),
}

/// Shared between the guest-facing handle and the pager thread.
pub(crate) struct Shared {
    pub budget: AtomicU64,
    /// The sampling hand's CPU budget (an f64's bits; 0: the hand stands).
    pub sample_budget: AtomicU64,
    pub stop: AtomicBool,
    /// The pager (and its writer, its page-outs done) has ended.
    pub exited: AtomicBool,
    pub stats: stats::Counters,
    pub fatal: Mutex<Option<String>>,
    /// Kernel thread id of the pager (for CPU pinning in benchmarks).
    pub pager_tid: std::sync::atomic::AtomicI32,
    /// Every memory server the region used (those added for an evacuation
    /// too) and whether the pager found it dead: closing deletes the
    /// region's pages on the live ones.
    pub servers: Mutex<Vec<(String, bool)>>,
}

/// A region: guest memory whose pages live locally or on memory servers.
pub struct Region {
    cmd: Mutex<std::sync::mpsc::Sender<Command>>,
    /// Rung after each command so the pager answers at once, not at its next poll timeout.
    doorbell: Arc<OwnedFd>,
    guest: GuestMem,
    memfd: Arc<OwnedFd>,
    shared: Arc<Shared>,
    pager: Option<JoinHandle<()>>,
    /// The region's id on the memory servers.
    pub region_id: u64,
    /// Pages per chunk.
    pub chunk_pages: usize,
    secret: Option<Secret>,
}

impl Region {
    /// Create the region and start its pager thread.
    pub fn new(mut cfg: Config) -> Result<Region, RegionError> {
        if !cfg.chunk_pages.is_power_of_two() || cfg.chunk_pages > 64 {
            return Err(RegionError::Config(format!(
                "chunk of {} pages: use a power of two from 1 to 64",
                cfg.chunk_pages
            )));
        }
        let chunk_bytes = (cfg.chunk_pages * PAGE) as u64;
        if cfg.size == 0 {
            return Err(RegionError::Config("size 0".into()));
        }
        cfg.size = cfg.size.div_ceil(chunk_bytes) * chunk_bytes;
        let pages = cfg.size / PAGE as u64;
        if cfg.budget_pages < cfg.chunk_pages as u64 * 2 && cfg.budget_pages < pages {
            return Err(RegionError::Config(format!(
                "budget of {} pages is below two chunks ({} pages)",
                cfg.budget_pages,
                cfg.chunk_pages * 2
            )));
        }
        if cfg.budget_pages < pages && cfg.servers.is_empty() {
            return Err(RegionError::Config(format!(
                "budget {} pages < region {} pages but no memory servers given: pages could not go anywhere",
                cfg.budget_pages, pages
            )));
        }
        if cfg.servers.len() > 250 {
            return Err(RegionError::Config(
                "at most 250 memory servers per region".into(),
            ));
        }
        if !(1..=2).contains(&cfg.replicas) {
            return Err(RegionError::Config(format!(
                "{} replicas: use 1 or 2",
                cfg.replicas
            )));
        }
        // (No servers: nothing pages out; the replicas apply once it does.)
        if cfg.replicas > 1 && !cfg.servers.is_empty() && cfg.servers.len() < cfg.replicas {
            return Err(RegionError::Config(format!(
                "{} replicas need at least {} memory servers ({} given)",
                cfg.replicas,
                cfg.replicas,
                cfg.servers.len()
            )));
        }
        if !cfg.servers.is_empty() && cfg.secret.is_none() {
            cfg.secret =
                Some(Secret::resolve(None).map_err(|e| RegionError::Config(e.to_string()))?);
        }
        if cfg.region_id == 0 {
            cfg.region_id = pagefleet_proto::auth::random_u64() | 1;
        }
        let (memfd, guest) = match &cfg.adopt {
            Some(a) => {
                if a.guest.len() as u64 != cfg.size || a.history.len() as u64 != pages {
                    return Err(RegionError::Config(format!(
                        "adopted memory is {} bytes, region {}",
                        a.guest.len(),
                        cfg.size
                    )));
                }
                let guest = match &cfg.foreign {
                    Some(f) if f.len != cfg.size => {
                        return Err(RegionError::Config(format!(
                            "the guest maps {} bytes, the region is {}",
                            f.len, cfg.size
                        )))
                    }
                    Some(f) => GuestMem::Foreign(f.clone()),
                    None => GuestMem::Local(a.guest.clone()),
                };
                (a.memfd.clone(), guest)
            }
            None if cfg.foreign.is_some() => {
                return Err(RegionError::Config(
                    "a guest mapped elsewhere needs the memfd it maps (adopt)".into(),
                ))
            }
            None => {
                let memfd = uffd::memfd(&cfg.name, cfg.size).map_err(|source| RegionError::Io {
                    what: "memfd_create",
                    source,
                })?;
                let guest = Mapping::shared(&memfd, cfg.size as usize).map_err(|source| {
                    RegionError::Io {
                        what: "mmap",
                        source,
                    }
                })?;
                // Paging works per 4 KiB page and chunk: no transparent huge pages.
                guest
                    .madvise(0, guest.len(), sys::MADV_NOHUGEPAGE)
                    .map_err(|source| RegionError::Io {
                        what: "madvise",
                        source,
                    })?;
                (Arc::new(memfd), GuestMem::Local(Arc::new(guest)))
            }
        };
        let shared = Arc::new(Shared {
            budget: AtomicU64::new(cfg.budget_pages),
            sample_budget: AtomicU64::new(cfg.sample_cpu_budget.max(0.0).to_bits()),
            stop: AtomicBool::new(false),
            exited: AtomicBool::new(false),
            stats: stats::Counters::default(),
            fatal: Mutex::new(None),
            pager_tid: std::sync::atomic::AtomicI32::new(0),
            servers: Mutex::new(cfg.servers.iter().map(|s| (s.clone(), false)).collect()),
        });
        for r in &cfg.initial_remote {
            let n = cfg.servers.len();
            if r.server >= n
                || r.mirror.is_some_and(|m| m >= n || m == r.server)
                || r.first.checked_add(r.count).is_none_or(|e| e > pages)
            {
                return Err(RegionError::Config(format!(
                    "initial remote range {}+{} on server {} (mirror {:?}) is out of bounds",
                    r.first, r.count, r.server, r.mirror
                )));
            }
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let doorbell = Arc::new(uffd::eventfd().map_err(|source| RegionError::Io {
            what: "eventfd",
            source,
        })?);
        let p = pager::Pager::new(
            &cfg,
            guest.clone(),
            memfd.clone(),
            shared.clone(),
            rx,
            doorbell.clone(),
        )?;
        let sh = shared.clone();
        let handle = std::thread::Builder::new()
            .name("pagefleet-pager".into())
            .spawn(move || {
                p.run();
                sh.exited.store(true, Ordering::Relaxed);
            })
            .map_err(|source| RegionError::Io {
                what: "spawn pager thread",
                source,
            })?;
        Ok(Region {
            cmd: Mutex::new(tx),
            doorbell,
            guest,
            memfd,
            shared,
            pager: Some(handle),
            region_id: cfg.region_id,
            chunk_pages: cfg.chunk_pages,
            secret: cfg.secret.clone(),
        })
    }

    /// Guest memory, bytes.
    pub fn len(&self) -> usize {
        self.guest.len()
    }
    /// Whether it has no memory.
    pub fn is_empty(&self) -> bool {
        self.guest.len() == 0
    }
    /// Guest memory, pages.
    pub fn pages(&self) -> u64 {
        (self.guest.len() / PAGE) as u64
    }
    /// The guest memory (valid as long as the region).
    ///
    /// # Panics
    /// If the memory is mapped by another process (a VM): it has no
    /// address here.
    pub fn as_ptr(&self) -> *mut u8 {
        self.local().addr()
    }

    fn local(&self) -> &Mapping {
        match &self.guest {
            GuestMem::Local(m) => m,
            GuestMem::Foreign(f) => {
                panic!(
                    "the region's memory is mapped by process {}, not here",
                    f.pid
                )
            }
        }
    }

    /// The guest memory. Threads may read and write it concurrently (with
    /// their own synchronisation); faults are served by the pager.
    ///
    /// # Safety
    /// The caller must not create overlapping `&mut` views from several threads.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self) -> &mut [u8] {
        // SAFETY: the guest mapping lives as long as the region; aliasing is
        // the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.local().addr(), self.guest.len()) }
    }

    /// Change the budget while running: shrinking pages out, growing just allows more.
    pub fn set_budget(&self, pages: u64) {
        self.shared
            .budget
            .store(pages.max(self.chunk_pages as u64 * 2), Ordering::Relaxed);
    }
    /// Change the sampling hand's CPU budget (share of one core; 0 stops
    /// the hand, the victim hand still reads reference bits) from its next
    /// tick on.
    pub fn set_sample_budget(&self, share: f64) {
        let share = if share.is_finite() {
            share.clamp(0.0, 1.0)
        } else {
            0.0
        };
        self.shared
            .sample_budget
            .store(share.to_bits(), Ordering::Relaxed);
    }

    /// The sampling hand's CPU budget now.
    pub fn sample_budget(&self) -> f64 {
        f64::from_bits(self.shared.sample_budget.load(Ordering::Relaxed))
    }

    /// Pages allowed resident now.
    pub fn budget(&self) -> u64 {
        self.shared.budget.load(Ordering::Relaxed)
    }

    /// Its counters now.
    pub fn stats(&self) -> Stats {
        self.shared.stats.snapshot(self.budget())
    }

    /// Kernel thread id of the pager thread (0 until it has started).
    pub fn pager_tid(&self) -> i32 {
        self.shared.pager_tid.load(Ordering::Relaxed)
    }

    /// The error that made a page unreachable, if one did (with `OnFatal::Poison`).
    pub fn fatal_error(&self) -> Option<String> {
        self.shared.fatal.lock().unwrap().clone()
    }

    fn ask<T>(&self, make: impl FnOnce(std::sync::mpsc::Sender<T>) -> Command) -> Option<T> {
        self.ask_within(make, Duration::from_secs(60))
    }

    fn ask_within<T>(
        &self,
        make: impl FnOnce(std::sync::mpsc::Sender<T>) -> Command,
        t: Duration,
    ) -> Option<T> {
        let (tx, rx) = std::sync::mpsc::channel();
        self.cmd.lock().unwrap().send(make(tx)).ok()?;
        uffd::ring(&self.doorbell);
        rx.recv_timeout(t).ok()
    }

    /// Move every page this region has on memory server `from` to `to`
    /// (S-memV: empty a sub-host for maintenance): copy, store, then delete
    /// at the old server, a batch at a time between faults, which the pager
    /// keeps serving. Pages never page out to `from` again. Returns how many
    /// pages moved.
    pub fn evacuate(&self, from: &str, to: &str) -> Result<u64, RegionError> {
        let (from, to) = (from.to_string(), to.to_string());
        self.ask_within(
            |reply| Command::Evacuate { from, to, reply },
            Duration::from_secs(3600),
        )
        .ok_or(RegionError::PagerGone)?
        .map_err(RegionError::Evacuate)
    }

    /// Start (or stop) tracking which pages change: content written, or
    /// location changed (paged in or out, first touched). Writes to resident
    /// pages are caught with write protection (one fault per page per round).
    pub fn track_changes(&self, on: bool) -> bool {
        self.ask(|tx| Command::TrackDirty(on, tx)).is_some()
    }

    /// Pages changed since tracking started or since the last call, sorted;
    /// tracking re-arms for them.
    pub fn take_changed(&self) -> Vec<u64> {
        self.ask(Command::TakeDirty).unwrap_or_default()
    }

    /// The location DB and access history, consistent at one instant.
    pub fn snapshot(&self) -> Option<Snapshot> {
        self.ask(Command::Snapshot)
    }

    /// Location and access history of `pages` only (cheaper than a full
    /// snapshot when few pages matter, e.g. a migration's last round).
    /// Server indexes refer to the full snapshot's `servers`.
    pub fn page_info(&self, pages: Vec<u64>) -> Option<Vec<(Location, u8)>> {
        self.ask(|tx| Command::Pages(pages, tx))
    }

    /// The memfd backing the region (for handing to another runtime).
    pub fn memfd(&self) -> &OwnedFd {
        &self.memfd
    }

    /// Pause balancing and sampling (faults are still served), e.g. while a
    /// migration takes its final copy; `false` resumes them.
    pub fn hold_paging(&self, on: bool) -> bool {
        self.ask(|tx| Command::Hold(on, tx)).is_some()
    }

    /// Stop paging but leave the region's pages on the servers: another
    /// runner (the migration's destination) owns them now.
    pub fn detach(mut self) {
        self.stop_pager();
        self.secret = None;
    }

    fn stop_pager(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.pager.take() {
            let _ = h.join();
        }
    }

    /// Stop paging and drop the region's pages on every server.
    pub fn close(mut self) -> Result<(), RegionError> {
        self.stop_pager();
        self.forget_remote()
    }

    fn forget_remote(&mut self) -> Result<(), RegionError> {
        let r = self.delete_remote();
        self.secret = None;
        r
    }

    /// The guest is ending (stopped, or the process is ending on a signal
    /// while guest threads may still run): stop serving faults (a thread
    /// faulting from now on waits until the process exits), let the
    /// page-outs in flight finish, then delete the region's pages on every
    /// server, so none is stored again after the delete.
    pub fn abandon(&self) -> Result<(), RegionError> {
        self.shared.stop.store(true, Ordering::Relaxed);
        let t = std::time::Instant::now();
        while !self.shared.exited.load(Ordering::Relaxed)
            && t.elapsed() < std::time::Duration::from_secs(5)
        {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        self.delete_remote()
    }

    /// Delete the region's pages on every server (the guest is ending: the
    /// caller makes sure nothing touches the memory any more).
    pub fn delete_remote(&self) -> Result<(), RegionError> {
        let Some(secret) = self.secret.clone() else {
            return Ok(());
        };
        let opts = ConnectOptions {
            name: "pagefleet-region-close".into(),
            ..Default::default()
        };
        // A server called down may only have hung (and hold the region's
        // stale copies): it is asked too, briefly, and its failure to
        // answer is not the close's failure. Every server at once, so a
        // hung one costs the close its timeout, not one per server.
        let brief = ConnectOptions {
            connect_timeout: DOWN_SERVER_CLOSE_TIMEOUT,
            io_timeout: DOWN_SERVER_CLOSE_TIMEOUT,
            ..opts.clone()
        };
        let servers = self.shared.servers.lock().unwrap().clone();
        let region = self.region_id;
        let results: Vec<(bool, pagefleet_client::Result<u64>)> = std::thread::scope(|sc| {
            let handles: Vec<_> = servers
                .iter()
                .map(|(s, down)| {
                    let (secret, o) = (&secret, if *down { &brief } else { &opts });
                    let down = *down;
                    sc.spawn(move || {
                        (
                            down,
                            pagefleet_client::Conn::connect(s, secret, o)
                                .and_then(|mut c| c.delete_region(region)),
                        )
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("delete thread"))
                .collect()
        });
        let mut first = None;
        for (down, r) in results {
            if let Err(e) = r {
                if !down {
                    first.get_or_insert(e);
                }
            }
        }
        first.map_or(Ok(()), |e| Err(e.into()))
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        self.stop_pager();
        let _ = self.forget_remote();
    }
}
