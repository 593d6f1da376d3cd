//! The host's content index for sharing-aware migration (docs/dedup.md):
//! a scanner feeds it from the memory of this host's running guests, and
//! the lookup service answers this host's incoming runners from it.
//!
//! The daemon owns the index; it never reads or writes guest memory for
//! anyone else: a runner that asks gets (process, fd, page) hints and
//! reads and checks the pages itself.

use crate::guests::Guests;
use pagefleet_api::{DedupIndexReport, GuestState};
use pagefleet_dedup::lookup::{self, Peer};
use pagefleet_dedup::scan::{find_memfd, HostIndex, STORE};
use pagefleet_dedup::{ContentKey, SourceId};
use pagefleet_memserver::{LocalContent, ServerState, Store};
use pagefleet_proto::auth::Secret;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

/// Most page contents indexed (16 GiB of guest memory; ~45 B each).
pub const MAX_PAGES: usize = 4 << 20;

/// The scanner's settings.
#[derive(Clone, Debug)]
pub struct ScanConfig {
    /// Share of one CPU the scanner may use while it hashes.
    pub cpu: f64,
    /// Pause between passes.
    pub pause: Duration,
}

impl Default for ScanConfig {
    fn default() -> ScanConfig {
        ScanConfig {
            cpu: 0.25,
            pause: Duration::from_secs(10),
        }
    }
}

/// The index, its scanner and its lookup socket.
pub struct Dedup {
    hi: Arc<HostIndex>,
    scanned: AtomicU64,
    scan_ns: AtomicU64,
    passes: AtomicU64,
}

/// The memory server's view of the index: PUT_HASHED pages are filled
/// from guests' memory, the store itself, or the zero page, each checked.
struct HostContent {
    hi: Arc<HostIndex>,
}

impl LocalContent for HostContent {
    fn fill(&self, store: &Store, hashes: &[[u8; 16]], out: &mut [u8]) -> Vec<bool> {
        let mut slot = |s: u32, dst: &mut [u8]| store.copy_published(s, 1, dst)[0];
        self.hi.fill_local(hashes, out, &mut slot)
    }
}

/// Where the lookup socket of a guest directory is.
pub fn socket_path(guest_dir: &Path) -> PathBuf {
    guest_dir.join("dedup.sock")
}

impl Dedup {
    /// Index the memory of `guests`' running guests and the pages `server`
    /// stores, as `cfg` says, until `stop`; serve lookups on `socket` (mode
    /// 0600) to the guests' runners, and PUT_HASHED requests to `server`.
    pub fn start(
        socket: Option<&Path>,
        secret: &Secret,
        guests: Option<Arc<Guests>>,
        server: Option<Arc<ServerState>>,
        cfg: ScanConfig,
        stop: &'static AtomicBool,
    ) -> std::io::Result<Arc<Dedup>> {
        let d = Arc::new(Dedup {
            hi: Arc::new(HostIndex::new(ContentKey::from_secret(secret), MAX_PAGES)),
            scanned: AtomicU64::new(0),
            scan_ns: AtomicU64::new(0),
            passes: AtomicU64::new(0),
        });
        if let (Some(socket), Some(guests)) = (socket, &guests) {
            let _ = std::fs::remove_file(socket);
            let l = std::os::unix::net::UnixListener::bind(socket)?;
            std::fs::set_permissions(socket, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
            // Only this daemon's runners, by the kernel's word on the peer.
            let me = pagefleet_common::sys::process::euid();
            let g = guests.clone();
            let authorize = Arc::new(move |p: Peer| {
                (p.uid == 0 || p.uid == me) && g.runners().iter().any(|(pid, _)| *pid == p.pid)
            });
            let hi = d.hi.clone();
            let slots = server.clone().map(|s| {
                Arc::new(move |slot: u32, dst: &mut [u8]| s.store.copy_published(slot, 1, dst)[0])
                    as lookup::StoreSlots
            });
            std::thread::Builder::new()
                .name("dedup lookups".into())
                .spawn(move || lookup::serve(l, hi, authorize, slots))?;
        }
        if let Some(s) = &server {
            s.set_content(Arc::new(HostContent { hi: d.hi.clone() }));
        }
        let d2 = d.clone();
        std::thread::Builder::new()
            .name("dedup scanner".into())
            .spawn(move || d2.scan_loop(guests.as_deref(), server.as_deref(), &cfg, stop))?;
        Ok(d)
    }

    fn scan_loop(
        &self,
        guests: Option<&Guests>,
        server: Option<&ServerState>,
        cfg: &ScanConfig,
        stop: &AtomicBool,
    ) {
        // Nice 19: a weight of 15 against a normal task's 1024. Not the idle
        // class: the scanner takes the store's lock and pins the slots it
        // copies, and a thread of the idle class preempted there can wait a
        // second for the CPU on a busy host while every connection waits on
        // the lock, or a client that deleted pages to make room waits for
        // the pins (the idle class measured no gain either).
        pagefleet_common::sys::process::set_thread_nice(19);
        while !stop.load(Relaxed) {
            let running: Vec<u32> = guests
                .map(|g| g.list())
                .unwrap_or_default()
                .into_iter()
                .filter(|g| matches!(g.state, GuestState::Running | GuestState::Migrating))
                .map(|g| g.pid)
                .collect();
            let mut live = Vec::new();
            for pid in running {
                let Some(at) = find_memfd(pid) else { continue };
                let id = SourceId(pid);
                live.push((id, at));
                let t = pagefleet_common::clock::thread_cpu_secs();
                if let Some(n) = self.hi.scan(id, at, cfg.cpu, stop) {
                    self.scanned.fetch_add(n, Relaxed);
                }
                self.scan_ns.fetch_add(
                    ((pagefleet_common::clock::thread_cpu_secs() - t) * 1e9) as u64,
                    Relaxed,
                );
            }
            self.hi.retain(&live);
            if let Some(s) = server {
                let t = pagefleet_common::clock::thread_cpu_secs();
                let store = &s.store;
                // Only what changed since the last pass is read and hashed.
                let mut read =
                    |first: u32, n: usize, buf: &mut [u8]| store.copy_changed(first, n, buf);
                if let Some(n) =
                    self.hi
                        .scan_slots(STORE, store.touched_slots(), &mut read, cfg.cpu, stop)
                {
                    self.scanned.fetch_add(n, Relaxed);
                }
                self.scan_ns.fetch_add(
                    ((pagefleet_common::clock::thread_cpu_secs() - t) * 1e9) as u64,
                    Relaxed,
                );
            }
            self.passes.fetch_add(1, Relaxed);
            let mut waited = Duration::ZERO;
            while waited < cfg.pause && !stop.load(Relaxed) {
                std::thread::sleep(Duration::from_millis(100));
                waited += Duration::from_millis(100);
            }
        }
    }

    /// The index's state for `/host`.
    pub fn report(&self) -> DedupIndexReport {
        let s = self.hi.lock().stats();
        DedupIndexReport {
            pages_indexed: s.pages_indexed,
            sources: s.sources,
            bytes: s.bytes,
            bytes_per_page: s.bytes_per_page(),
            lookups: s.lookups,
            hits: s.hits,
            hit_rate: s.hit_rate(),
            pages_scanned: self.scanned.load(Relaxed),
            scan_cpu_secs: self.scan_ns.load(Relaxed) as f64 / 1e9,
            passes: self.passes.load(Relaxed),
        }
    }

    /// Prometheus text.
    pub fn metrics(&self) -> String {
        use pagefleet_common::metrics::{Exposition, Kind::*};
        let r = self.report();
        let mut e = Exposition::new();
        e.single(
            "pagefleet_dedup_pages_indexed",
            Gauge,
            "Distinct page contents in this host's index.",
            r.pages_indexed,
        );
        e.single(
            "pagefleet_dedup_index_bytes",
            Gauge,
            "Memory the content index holds.",
            r.bytes,
        );
        e.single(
            "pagefleet_dedup_lookups_total",
            Counter,
            "Contents incoming migrations asked about.",
            r.lookups,
        );
        e.single(
            "pagefleet_dedup_hits_total",
            Counter,
            "Of those, found on this host.",
            r.hits,
        );
        e.single(
            "pagefleet_dedup_scanned_pages_total",
            Counter,
            "Pages the scanner hashed.",
            r.pages_scanned,
        );
        e.single(
            "pagefleet_dedup_scan_cpu_seconds_total",
            Counter,
            "CPU the scanner used.",
            r.scan_cpu_secs,
        );
        e.finish()
    }
}
