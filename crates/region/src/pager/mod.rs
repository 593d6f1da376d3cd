//! The pager thread: owns the uffd, the location DB, the access history and
//! the connections to memory servers it pages in from. Every change of a
//! page's state happens on this thread; the writer thread ([`writer`]) only
//! sends the contents of pages the pager handed it, so a page-out runs
//! while faults go on being served. A page-out stays atomic with respect to
//! faults: its pages are write-protected before they are sent, the writer
//! punches only what every target acknowledged, and any fault on a page in
//! a job waits until the pager has taken the job's answer in.
//!
//! One file per concern: [`faults`] (reading and dispatching fault events),
//! [`pagein`] (bringing pages and their read-ahead in), [`reclaim`]
//! (watermarks and page-out jobs), [`victims`] (which chunks go),
//! [`writer`] (the thread sending them), [`refs`] (reference bits from
//! the page tables), [`sampling`] (the access-history hand), [`evacuate`] (moving a server's
//! pages elsewhere), [`replicate`] (a server's death with two replicas,
//! re-replication), [`commands`] (what the region's owner asks: tracking,
//! snapshots, holds).

mod changes;
mod commands;
mod evacuate;
mod faults;
mod location;
mod meter;
mod pagein;
mod readahead;
mod reclaim;
mod refs;
mod replicate;
mod sampling;
mod sched;
mod servers;
mod spin;
mod victims;
mod writer;
pub use writer::WRITER_THREAD;

use crate::guestmem::GuestMem;
use crate::{Command, Config, OnFatal, RegionError, Shared, Snapshot, PAGE};
use pagefleet_client::{Conn, GetMode, Pages};
use pagefleet_proto::{PageSel, MAX_BATCH_PAGES};
use pagefleet_uffd::{self as uffd, Fault, FaultKind, Uffd};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{debug, info, warn};

use location::{AccessHistory, LocationDb, LOCAL, OUT_ARRIVING, OUT_NONE, REMOTE, ZERO};

/// The fault loop's epoll tokens: the uffd, the doorbell, server `s` at
/// `TOKEN_SERVER0 + s`.
const TOKEN_UFFD: u64 = 0;
const TOKEN_DOORBELL: u64 = 1;
pub(super) const TOKEN_SERVER0: u64 = 2;

/// How long a pager keeps trying to reach a server that is busy or
/// momentarily unreachable before the guest gives up on it.
pub(super) const CONNECT_PATIENCE: Duration = Duration::from_secs(15);

pub(crate) struct Pager {
    /// The region's owner: its commands, its doorbell, what it wants done
    /// on a fatal error, whether it holds the pager still.
    owner: Owner,
    /// Change tracking for migration: pages whose content or location changed.
    changes: changes::Changes,
    uffd: Uffd,
    guest: GuestMem,
    /// The page-out thread.
    writer: writer::Writer,
    shared: Arc<Shared>,
    region_id: u64,
    /// Pages per chunk.
    cp: usize,
    /// Where every page is.
    loc: LocationDb,
    /// What is known of every page's use.
    access: AccessHistory,
    /// Bringing pages in: read-ahead, the reply spin, the receive buffer.
    pagein: pagein::PageIn,
    /// The memory servers: connections, room, which are down, GETs in flight.
    servers: servers::Servers,
    /// The faults being served.
    faults: faults::Faults,
    /// The sampling hand and its cost controller.
    sampler: sampling::Sampler,
    /// Keeping resident pages within the budget: victims, watermarks.
    reclaim: reclaim::Reclaim,
    /// Reference bits from the page tables.
    refs: refs::RefBits,
    /// CPU per page-in and per page-out ([`meter`]).
    meter: meter::CpuMeter,
    /// The fault loop waits here: the uffd and the doorbell (level
    /// triggered), every server connection (edge triggered: replies are
    /// read until none is left, bytes nobody asked for are ignored).
    epoll: uffd::Epoll,
    evac: Option<evacuate::Evac>,
    /// Replicas: how many, re-replication, hung and revived servers.
    repl: replicate::Replication,
}

impl Owner {
    /// Balancing, sampling and re-replication paused.
    fn held(&self) -> bool {
        self.hold
    }

    fn hold(&mut self, on: bool) {
        self.hold = on;
    }

    /// The pager's doorbell, for a thread that answers later.
    fn doorbell(&self) -> Arc<OwnedFd> {
        self.doorbell.clone()
    }
}

/// What the region's owner gave the pager and may set while it runs.
struct Owner {
    rx: std::sync::mpsc::Receiver<Command>,
    /// Rung by the owner after each command, by the writer after each job,
    /// by probe threads with an answer.
    doorbell: Arc<OwnedFd>,
    on_fatal: OnFatal,
    /// Balancing, sampling and re-replication paused (a migration's
    /// final copy).
    hold: bool,
}

impl Pager {
    pub fn new(
        cfg: &Config,
        guest: GuestMem,
        memfd: Arc<OwnedFd>,
        shared: Arc<Shared>,
        rx: std::sync::mpsc::Receiver<Command>,
        doorbell: Arc<OwnedFd>,
    ) -> Result<Pager, RegionError> {
        let need = uffd::FEATURE_MISSING_SHMEM
            | uffd::FEATURE_WP_HUGETLBFS_SHMEM
            | uffd::FEATURE_PAGEFAULT_FLAG_WP
            | uffd::FEATURE_THREAD_ID;
        let u = match &guest {
            GuestMem::Local(m) => {
                let u = Uffd::open(need)?;
                // SAFETY: the guest's own shared mapping of its memfd, which
                // no Rust value lives in (guests reach it by raw pointers).
                unsafe {
                    u.register(
                        m.base(),
                        m.len() as u64,
                        // Not MINOR: a resident page the sampler unmapped is mapped
                        // back by the kernel itself, and PAGEMAP_SCAN shows it ([`refs`]).
                        uffd::MODE_MISSING | uffd::MODE_WP,
                    )
                }?;
                u
            }
            GuestMem::Foreign(f) => {
                if f.features & need != need {
                    return Err(RegionError::Config(format!(
                        "the guest's userfaultfd lacks features {:#x}",
                        need & !f.features
                    )));
                }
                let fd = f.take_uffd().ok_or_else(|| {
                    RegionError::Config("the guest's userfaultfd was used already".into())
                })?;
                Uffd::from_fd(fd, f.features)
            }
        };
        let pagemap = match &guest {
            GuestMem::Local(_) => uffd::Pagemap::open(),
            GuestMem::Foreign(f) => uffd::Pagemap::open_pid(f.pid),
        };
        let pagemap = match pagemap {
            Ok(pm) => Some(pm),
            Err(e) => {
                warn!("PAGEMAP_SCAN unavailable ({e}; Linux 6.7+): victims are chosen by page-ins alone");
                None
            }
        };
        let writer = writer::Writer::start(
            &memfd,
            writer::WriterSetup {
                region_id: cfg.region_id,
                name: cfg.name.clone(),
                secret: cfg.secret.clone(),
                doorbell: doorbell.clone(),
                patience: servers::patience(cfg.replicas),
                io_timeout: servers::io_timeout(cfg.replicas),
            },
        )
        .map_err(|source| RegionError::Io {
            what: "spawn page-out writer thread",
            source,
        })?;
        let servers = servers::Servers::open(cfg)?;
        let pages = guest.len() / PAGE;
        let chunks = pages / cfg.chunk_pages;
        let nservers = cfg.servers.len();
        let mut loc = LocationDb::new(pages, cfg.chunk_pages, nservers);
        let mut access = AccessHistory::new(pages);
        let victims = victims::Victims::new(cfg.policy, chunks, cfg.chunk_pages);
        if let Some(a) = &cfg.adopt {
            // Received pages are the memfd's data ranges.
            let runs: Vec<(u64, u64)> = match &a.resident {
                Some(r) => r.clone(),
                None => uffd::data_ranges(&a.memfd, guest.len() as u64)
                    .map_err(|source| RegionError::Io {
                        what: "SEEK_DATA on the adopted memfd",
                        source,
                    })?
                    .into_iter()
                    .map(|(lo, hi)| {
                        (
                            lo / PAGE as u64,
                            hi.div_ceil(PAGE as u64) - lo / PAGE as u64,
                        )
                    })
                    .collect(),
            };
            for (first, count) in runs {
                for q in first as usize..((first + count) as usize).min(pages) {
                    loc.set_local(q);
                }
            }
            for (q, h) in a.history.iter().enumerate().take(pages) {
                access.age[q] = victims.adopted(*h);
                // Placed here because they ranked hottest: every resident
                // page starts referenced, so eviction gives each chunk a
                // full second chance before calling it cold (the history
                // that came along is a sample, not a full picture).
                if loc.state[q] == LOCAL {
                    access.refb[q] = 1;
                }
            }
        }
        for r in &cfg.initial_remote {
            let (srv, mirror) = (r.server, r.mirror.filter(|_| cfg.replicas > 1));
            for q in r.first..r.first + r.count {
                let q = q as usize;
                if loc.state[q] == LOCAL {
                    // A migration's location list wins over stale data.
                    loc.set_remote(q, srv, mirror);
                    let _ = uffd::punch_hole(&memfd, (q * PAGE) as u64, PAGE as u64);
                } else {
                    if loc.state[q] < REMOTE {
                        loc.remote += 1;
                    }
                    loc.state[q] = REMOTE + srv as u8;
                    loc.second[q] = mirror.map_or(0, |m| m as u8 + 1);
                }
            }
        }
        shared.stats.remote_pages.store(loc.remote, Relaxed);
        shared.stats.resident_pages.store(loc.resident, Relaxed);
        let mut rerep = replicate::Rerep::new(cfg.rereplicate_rate, cfg.servers.len());
        // Pages placed with one copy (a migration's) get their second.
        rerep.active =
            cfg.replicas > 1 && (0..pages).any(|q| loc.state[q] >= REMOTE && loc.second[q] == 0);
        let epoll = uffd::Epoll::new()
            .and_then(|e| {
                e.add(u.as_fd(), TOKEN_UFFD, uffd::Trigger::Level)?;
                e.add(doorbell.as_fd(), TOKEN_DOORBELL, uffd::Trigger::Level)?;
                Ok(e)
            })
            .map_err(|source| RegionError::Io {
                what: "epoll for the fault loop",
                source,
            })?;
        Ok(Pager {
            owner: Owner {
                rx,
                doorbell,
                on_fatal: cfg.on_fatal,
                hold: false,
            },
            changes: changes::Changes::new(pages),
            uffd: u,
            guest,
            writer,
            shared,
            region_id: cfg.region_id,
            cp: cfg.chunk_pages,
            loc,
            access,
            pagein: pagein::PageIn::new(cfg),
            servers,
            faults: faults::Faults::default(),
            sampler: sampling::Sampler::new(
                chunks,
                cfg.sample_period,
                sampling::Costs {
                    minor: cfg.minor_fault_cost,
                    zap: cfg.zap_cost,
                },
                Instant::now(),
            ),
            reclaim: reclaim::Reclaim::new(victims),
            refs: refs::RefBits::new(pagemap),
            meter: meter::CpuMeter::new(),
            epoll,
            evac: None,
            repl: replicate::Replication::new(cfg.replicas, rerep, cfg.servers.len()),
        })
    }

    /// Chunks in the region.
    fn chunks(&self) -> usize {
        self.loc.pages() / self.cp
    }

    fn addr(&self, p: usize) -> u64 {
        self.guest.base() + (p * PAGE) as u64
    }

    pub fn run(mut self) {
        let tid = crate::sys::gettid();
        self.shared.pager_tid.store(tid, Relaxed);
        // The CPU clock read is this thread's.
        self.meter = meter::CpuMeter::new();
        // The pager runs at the guest threads' priority. It used to raise
        // itself to nice -20 so that a fault never waited for a CPU, but
        // then every fault and every reply preempted a guest thread at
        // once: with 16 threads faulting one at a time between 60 µs of
        // work each, the guest host's CPU per page-in was 34.8 µs at nice
        // -20 and 8.1 µs at nice 0 (the raw floor: 9.8 µs), and the kv
        // guest at 25% went from 0.72x zram to 0.85x. At equal priority a
        // fault waits until a running guest thread's slice ends, and the
        // pager then serves every fault and reply queued meanwhile in one
        // turn. On an idle CPU it runs at once either way.
        //
        // While it serves a scan it asks for a short slice, though
        // (sched.rs): at equal weight a reply or a fault then preempts the
        // running guest thread instead of waiting out its slice.
        while !self.shared.stop.load(Relaxed) {
            // Sleep until a fault, a reply, a command or a finished
            // page-out comes; with more page-out to start, or reply bytes
            // already read ahead (which epoll does not see), only look.
            self.servers.watch(&self.epoll);
            let buffered = self.servers.buffered();
            let busy = (self.reclaim.evicting() && self.writer.in_flight() < reclaim::MAX_JOBS)
                || self.evac.is_some()
                || self.repl.ready()
                || buffered
                || self.spinning();
            let (mut faults, mut bell) = (false, false);
            let servers = &mut self.servers;
            servers.clear_ready();
            let waited = self.epoll.wait(if busy { 0 } else { 5 }, &mut |t| match t {
                TOKEN_UFFD => faults = true,
                TOKEN_DOORBELL => bell = true,
                s => {
                    servers.mark_ready((s - TOKEN_SERVER0) as usize);
                }
            });
            match waited {
                Ok(_) => {
                    if bell {
                        uffd::drain(self.owner.doorbell.as_ref());
                    }
                    // Replies first: installing a page wakes a guest thread.
                    for s in 0..self.servers.len() {
                        let ready = self.servers.is_ready(s);
                        if ready {
                            self.servers.conn_mut(s).note_readable();
                        }
                        if self.servers.reply_due(s, ready) {
                            self.take_replies(s, false);
                        } else if ready {
                            // Nothing asked: a closed connection?
                            self.check_idle(s);
                        }
                    }
                    if faults {
                        self.serve_pending();
                    }
                }
                Err(e) => warn!("waiting for faults: {e}"),
            }
            self.reap();
            self.balance();
            self.sample_tick();
            self.pagein.tick();
            while let Ok(c) = self.owner.rx.try_recv() {
                self.command(c);
            }
            self.evacuate_step();
            self.check_deadlines();
            self.revive_step();
            self.rereplicate_step();
            self.meter.turn(&self.shared);
        }
    }

    /// Index of server `addr`, connecting to it if it is new.
    fn server_index(&mut self, addr: &str) -> Result<usize, String> {
        if let Some(i) = self.servers.index_of(addr) {
            return Ok(i);
        }
        let i = self.servers.add(addr)?;
        self.repl.add_server();
        self.loc.copies.push(0);
        self.shared
            .servers
            .lock()
            .unwrap()
            .push((addr.to_string(), false));
        Ok(i)
    }

    fn mark(&mut self, p: usize) {
        self.changes.mark(p);
    }

    fn publish(&self) {
        self.shared
            .stats
            .resident_pages
            .store(self.loc.resident, Relaxed);
        self.shared
            .stats
            .remote_pages
            .store(self.loc.remote, Relaxed);
        let st = &self.shared.stats;
        st.prefetch_hits.store(self.access.prefetch.hits, Relaxed);
        st.prefetch_misses
            .store(self.access.prefetch.misses, Relaxed);
    }

    fn wake(&self, p: usize) {
        let _ = self.uffd.wake(self.addr(p), PAGE as u64);
    }

    fn internal(&self, p: usize, e: String) {
        // Not a server problem: the mapping itself misbehaves. Nothing sane to do.
        self.fatal(
            format!(
                "pagefleet: internal paging error at page {p} of region {:#x}: {e}",
                self.region_id
            ),
            p,
        );
    }

    fn fatal(&self, msg: String, p: usize) {
        *self.shared.fatal.lock().unwrap() = Some(msg.clone());
        match self.owner.on_fatal {
            OnFatal::Exit => {
                eprintln!("{msg}");
                std::process::exit(75);
            }
            OnFatal::Poison => {
                let _ = self.uffd.poison(self.addr(p), PAGE as u64);
            }
        }
    }

    fn lost(&mut self, p: usize, s: usize, e: pagefleet_client::ClientError) {
        self.publish();
        let msg = format!(
            "pagefleet: page {p} of region {:#x} cannot be brought back from memory server {}: {e}. \
             The guest cannot continue without its memory.",
            self.region_id, self.servers.addr(s)
        );
        self.fatal(msg, p);
    }
}

use crate::sys::thread_cpu_ns;

/// Index ranges of the runs of consecutive page numbers in sorted `pages`:
/// each run is one syscall (`pread`, `fallocate`, write-protect).
fn consecutive_runs<T>(pages: &[T]) -> impl Iterator<Item = std::ops::Range<usize>> + '_
where
    T: Copy + PartialEq + std::ops::Add<Output = T> + From<u8>,
{
    let mut i = 0;
    std::iter::from_fn(move || {
        if i == pages.len() {
            return None;
        }
        let start = i;
        i += 1;
        while i < pages.len() && pages[i] == pages[i - 1] + T::from(1) {
            i += 1;
        }
        Some(start..i)
    })
}

#[cfg(test)]
mod tests {
    use super::consecutive_runs;

    /// Each part's state is its own: no file under `pager/` reaches into
    /// another part's fields (`self.PART.FIELD` not followed by a call),
    /// only the part's own file does.
    #[test]
    fn no_file_reaches_into_another_parts_fields() {
        const PARTS: &[(&str, &str)] = &[
            ("servers", "servers.rs"),
            ("sampler", "sampling.rs"),
            ("pagein", "pagein.rs"),
            ("faults", "faults.rs"),
            ("reclaim", "reclaim.rs"),
            ("refs", "refs.rs"),
            ("changes", "changes.rs"),
            ("repl", "replicate.rs"),
            ("owner", "mod.rs"),
            ("writer", "writer.rs"),
        ];
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/pager");
        let mut found = Vec::new();
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let file = e.file_name().to_string_lossy().into_owned();
            if !file.ends_with(".rs") {
                continue;
            }
            let text = std::fs::read_to_string(e.path()).unwrap();
            for (part, home) in PARTS.iter().filter(|(_, h)| *h != file) {
                let needle = format!("self.{part}.");
                let mut rest = text.as_str();
                while let Some(i) = rest.find(&needle) {
                    rest = &rest[i + needle.len()..];
                    let field: String = rest
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    let after = rest[field.len()..].trim_start();
                    if !after.starts_with('(') && !after.starts_with("::") {
                        found.push(format!(
                            "{file}: self.{part}.{field} (the part lives in {home})"
                        ));
                    }
                }
            }
        }
        assert!(found.is_empty(), "{}", found.join("\n"));
    }

    #[test]
    fn runs_split_where_pages_stop_being_consecutive() {
        let pages: [u64; 6] = [3, 4, 5, 9, 11, 12];
        let runs: Vec<_> = consecutive_runs(&pages).collect();
        assert_eq!(runs, vec![0..3, 3..4, 4..6]);
        assert_eq!(consecutive_runs::<usize>(&[]).count(), 0);
    }
}
