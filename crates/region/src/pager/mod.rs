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
mod victims;
mod writer;
pub use writer::WRITER_THREAD;

use crate::guestmem::GuestMem;
use crate::{Command, Config, OnFatal, RegionError, Shared, Snapshot, PAGE};
use pagefleet_client::{Conn, ConnectOptions, GetMode, Pages};
use pagefleet_proto::{PageSel, MAX_BATCH_PAGES};
use pagefleet_uffd::{self as uffd, Fault, FaultKind, Uffd};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{debug, info, warn};

use location::{AccessHistory, LocationDb, LOCAL, OUT_ARRIVING, OUT_NONE, REMOTE, ZERO};

/// The fault loop's epoll tokens: the uffd, the doorbell, server `s` at
/// `TOKEN_SERVER0 + s`.
const TOKEN_UFFD: u64 = 0;
const TOKEN_DOORBELL: u64 = 1;
const TOKEN_SERVER0: u64 = 2;

/// How long a pager keeps trying to reach a server that is busy or
/// momentarily unreachable before the guest gives up on it.
const CONNECT_PATIENCE: Duration = Duration::from_secs(15);

pub(crate) struct Pager {
    rx: std::sync::mpsc::Receiver<Command>,
    doorbell: Arc<OwnedFd>,
    /// Change tracking for migration: pages whose content or location changed.
    tracking: bool,
    /// Balancing and sampling paused (a migration's final copy).
    hold: bool,
    dirty: Vec<bool>,
    dirty_list: Vec<u32>,
    servers_list: Vec<String>,
    uffd: Uffd,
    guest: GuestMem,
    /// The page-out thread.
    writer: writer::Writer,
    shared: Arc<Shared>,
    region_id: u64,
    on_fatal: OnFatal,
    cp: usize,
    chunks: usize,
    /// Where every page is.
    loc: LocationDb,
    /// What is known of every page's use.
    access: AccessHistory,
    prefetch: crate::Prefetch,
    /// Sequential fault streams for adaptive read-ahead.
    readahead: readahead::Readahead,
    /// The pager's CPU slice: short while it serves a scan.
    slice: sched::SliceSwitch,
    /// Where `drop_copies` looks next.
    copy_hand: usize,
    /// The fault loop's spin (`Config::reply_spin`), while the host has
    /// idle CPUs (`spin_ok`), until `spin_until` (a faulting page's reply
    /// due); `reply_ewma_us`: how long faulting pages' replies take.
    reply_spin: Duration,
    spin_ok: bool,
    spin_until: Option<Instant>,
    reply_ewma_us: f64,
    conns: Vec<Conn>,
    addrs: Vec<String>,
    free: Vec<u64>,
    buf: Vec<u8>,
    faults: Vec<Fault>,
    /// The sampling hand.
    hand: usize,
    /// Where the victim search stands.
    victims: victims::Victims,
    /// Chunks the victim hand spared, to unmap at the next sampling tick.
    rearm_pending: Vec<usize>,
    /// `PAGEMAP_SCAN` for reference bits ([`refs`]); None on kernels
    /// before 6.7 (then only page-ins count as references).
    pagemap: Option<uffd::Pagemap>,
    /// What the victim hand's probe read last ([`refs`]).
    probe_window: refs::ProbeWindow,
    rate: f64,
    max_rate: f64,
    carry: f64,
    last_tick: Instant,
    window_start: Instant,
    window_minor: u64,
    window_zaps: u64,
    /// This thread's CPU in sampling sweeps in the controller's window, ns.
    window_sweep_ns: u64,
    tick_secs: f64,
    cpu_budget: f64,
    minor_cost: Duration,
    zap_cost: Duration,
    full_warned: bool,
    /// CPU per page-in and per page-out ([`meter`]).
    meter: meter::CpuMeter,
    /// Between the high and low watermarks: keep evicting.
    evicting: bool,
    /// When the victim hand last chose victims.
    victims_at: Option<Instant>,
    /// Remote faults of the current batch: (page, server, write fault).
    pending_in: Vec<(usize, usize, bool)>,
    /// Pages whose faults wait for their page-out or drop job.
    job_faults: Vec<usize>,
    /// GETs in flight, per server.
    gets: pagein::GetQueues,
    /// The fault loop waits here: the uffd and the doorbell (level
    /// triggered), every server connection (edge triggered: replies are
    /// read until none is left, bytes nobody asked for are ignored).
    epoll: uffd::Epoll,
    /// The connection fd registered per server (a reconnect replaces it).
    epoll_fds: Vec<std::os::fd::RawFd>,
    /// Servers whose connection reported new bytes in the last wait.
    ready: Vec<bool>,
    /// For connecting to servers added later (evacuation targets).
    secret: Option<pagefleet_proto::auth::Secret>,
    name: String,
    evac: Option<evacuate::Evac>,
    /// Copies of every remote page (1 or 2).
    replicas: usize,
    /// Per server: found dead (its pages are read from their mirrors).
    down: Vec<bool>,
    /// Re-replication after a server's death.
    rerep: replicate::Rerep,
    /// Hung servers (deadlines) and revival of servers called down.
    health: replicate::Health,
    /// How long a reconnect keeps trying.
    patience: Duration,
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
                patience: patience(cfg.replicas),
                io_timeout: io_timeout(cfg.replicas),
            },
        )
        .map_err(|source| RegionError::Io {
            what: "spawn page-out writer thread",
            source,
        })?;
        let mut conns = Vec::new();
        let mut free = Vec::new();
        if let Some(secret) = &cfg.secret {
            for a in &cfg.servers {
                let ready = cfg.adopt.as_ref().and_then(|ad| {
                    let mut v = ad.conns.lock().unwrap();
                    v.iter()
                        .position(|(x, _)| x == a)
                        .map(|i| v.swap_remove(i).1)
                });
                let c = match ready {
                    Some(mut c) => {
                        c.set_window(4);
                        c
                    }
                    None => connect(
                        &cfg.name,
                        a,
                        secret,
                        CONNECT_PATIENCE,
                        io_timeout(cfg.replicas),
                    )?,
                };
                free.push(c.info.capacity_pages.saturating_sub(c.info.used_pages));
                conns.push(c);
            }
        }
        let pages = guest.len() / PAGE;
        let chunks = pages / cfg.chunk_pages;
        let max_rate = chunks as f64 / cfg.sample_period.as_secs_f64().max(0.01);
        let nservers = cfg.servers.len();
        let mut loc = LocationDb::new(pages, cfg.chunk_pages, nservers);
        let mut access = AccessHistory::new(pages);
        let victims = victims::Victims::new(cfg.policy, chunks, cfg.chunk_pages);
        if let Some(a) = &cfg.adopt {
            // Received pages are the memfd's data ranges.
            let runs: Vec<(u64, u64)> = match &a.resident {
                Some(r) => r.clone(),
                None => uffd::data_ranges(a.memfd.as_raw_fd(), guest.len() as u64)
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
                    let _ = uffd::punch_hole(memfd.as_raw_fd(), (q * PAGE) as u64, PAGE as u64);
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
                e.add(u.as_raw_fd(), TOKEN_UFFD, uffd::Trigger::Level)?;
                e.add(doorbell.as_raw_fd(), TOKEN_DOORBELL, uffd::Trigger::Level)?;
                Ok(e)
            })
            .map_err(|source| RegionError::Io {
                what: "epoll for the fault loop",
                source,
            })?;
        Ok(Pager {
            rx,
            doorbell,
            tracking: false,
            hold: false,
            dirty: vec![false; pages],
            dirty_list: Vec::new(),
            servers_list: cfg.servers.clone(),
            uffd: u,
            guest,
            writer,
            shared,
            region_id: cfg.region_id,
            on_fatal: cfg.on_fatal,
            cp: cfg.chunk_pages,
            chunks,
            loc,
            access,
            prefetch: cfg.prefetch,
            readahead: readahead::Readahead::default(),
            slice: sched::SliceSwitch::default(),
            copy_hand: 0,
            reply_spin: cfg.reply_spin,
            spin_ok: true,
            spin_until: None,
            reply_ewma_us: 0.0,
            conns,
            addrs: cfg.servers.clone(),
            free,
            buf: vec![0u8; cfg.chunk_pages.max(MAX_BATCH_PAGES) * PAGE],
            faults: Vec::with_capacity(64),
            hand: 0,
            victims,
            pagemap,
            rearm_pending: Vec::new(),
            probe_window: refs::ProbeWindow::default(),
            // Start slow; the controller raises the rate while faults stay cheap.
            rate: (max_rate / 64.0).clamp(1.0, 64.0),
            max_rate: max_rate.max(10.0),
            carry: 0.0,
            last_tick: Instant::now(),
            window_start: Instant::now(),
            window_minor: 0,
            window_zaps: 0,
            window_sweep_ns: 0,
            // Each tick's zap is a TLB shootdown, and in this VM the TLB
            // refills after one cost ~200 µs of guest time: 5 ms ticks
            // cost the kv guest 4% with everything resident.
            tick_secs: 0.05,
            cpu_budget: cfg.sample_cpu_budget,
            minor_cost: cfg.minor_fault_cost,
            zap_cost: cfg.zap_cost,
            full_warned: false,
            meter: meter::CpuMeter::new(),
            evicting: false,
            victims_at: None,
            pending_in: Vec::new(),
            job_faults: Vec::new(),
            gets: (0..cfg.servers.len()).map(|_| Default::default()).collect(),
            epoll,
            epoll_fds: Vec::new(),
            ready: Vec::new(),
            secret: cfg.secret.clone(),
            name: cfg.name.clone(),
            evac: None,
            replicas: cfg.replicas,
            down: vec![false; cfg.servers.len()],
            rerep,
            health: replicate::Health::new(cfg.servers.len()),
            patience: patience(cfg.replicas),
        })
    }

    fn addr(&self, p: usize) -> u64 {
        self.guest.base() + (p * PAGE) as u64
    }

    pub fn run(mut self) {
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() };
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
            self.watch_servers();
            let buffered =
                (0..self.conns.len()).any(|s| !self.gets[s].is_empty() && self.conns[s].buffered());
            let busy = (self.evicting && self.writer.in_flight < reclaim::MAX_JOBS)
                || self.evac.is_some()
                || self.rerep.ready()
                || buffered
                || self.spinning();
            let (mut faults, mut bell) = (false, false);
            let ready = &mut self.ready;
            ready.iter_mut().for_each(|r| *r = false);
            let waited = self.epoll.wait(if busy { 0 } else { 5 }, &mut |t| match t {
                TOKEN_UFFD => faults = true,
                TOKEN_DOORBELL => bell = true,
                s => {
                    if let Some(r) = ready.get_mut((s - TOKEN_SERVER0) as usize) {
                        *r = true;
                    }
                }
            });
            match waited {
                Ok(_) => {
                    if bell {
                        uffd::drain(self.doorbell.as_raw_fd());
                    }
                    // Replies first: installing a page wakes a guest thread.
                    for s in 0..self.conns.len() {
                        if self.ready[s] {
                            self.conns[s].note_readable();
                        }
                        if !self.gets[s].is_empty() && (self.ready[s] || self.conns[s].buffered()) {
                            self.take_replies(s, false);
                        } else if self.ready[s] {
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
            self.slice.tick();
            while let Ok(c) = self.rx.try_recv() {
                self.command(c);
            }
            self.evacuate_step();
            self.check_deadlines();
            self.revive_step();
            self.rereplicate_step();
            self.meter.turn(&self.shared);
        }
    }

    /// Register connections that are new (a server added, a reconnect)
    /// with the fault loop's epoll; a closed fd left the set by itself.
    fn watch_servers(&mut self) {
        self.ready.resize(self.conns.len(), false);
        self.epoll_fds.resize(self.conns.len(), -1);
        for s in 0..self.conns.len() {
            let fd = self.conns[s].raw_fd();
            if self.epoll_fds[s] != fd {
                match self
                    .epoll
                    .add(fd, TOKEN_SERVER0 + s as u64, uffd::Trigger::Edge)
                {
                    Ok(()) => self.epoll_fds[s] = fd,
                    Err(e) => warn!("watching server {}: {e}", self.addrs[s]),
                }
            }
        }
    }

    /// Index of server `addr`, connecting to it if it is new.
    fn server_index(&mut self, addr: &str) -> Result<usize, String> {
        if let Some(i) = self.addrs.iter().position(|a| a == addr) {
            return Ok(i);
        }
        if self.addrs.len() >= 250 {
            return Err("at most 250 memory servers per region".into());
        }
        let secret = self
            .secret
            .as_ref()
            .ok_or("this region has no cluster secret (it was made without memory servers)")?;
        let c = connect(
            &self.name,
            addr,
            secret,
            CONNECT_PATIENCE,
            io_timeout(self.replicas),
        )
        .map_err(|e| e.to_string())?;
        self.free
            .push(c.info.capacity_pages.saturating_sub(c.info.used_pages));
        self.down.push(false);
        self.health.add_server();
        self.rerep.orphans.push(Vec::new());
        self.conns.push(c);
        self.gets.push(Default::default());
        self.loc.copies.push(0);
        self.addrs.push(addr.to_string());
        self.servers_list.push(addr.to_string());
        self.shared
            .servers
            .lock()
            .unwrap()
            .push((addr.to_string(), false));
        Ok(self.addrs.len() - 1)
    }

    fn mark(&mut self, p: usize) {
        if self.tracking && !self.dirty[p] {
            self.dirty[p] = true;
            self.dirty_list.push(p as u32);
        }
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
        match self.on_fatal {
            OnFatal::Exit => {
                eprintln!("{msg}");
                std::process::exit(75);
            }
            OnFatal::Poison => {
                let _ = self.uffd.poison(self.addr(p), PAGE as u64);
            }
        }
    }

    /// A fresh connection to server `s` in place of a broken one.
    fn reconnect(&mut self, s: usize) -> Result<(), pagefleet_client::ClientError> {
        let secret = self.secret.clone().ok_or_else(|| {
            pagefleet_client::ClientError::Usage("no cluster secret to reconnect with".into())
        })?;
        let c = connect(
            &self.name,
            &self.addrs[s],
            &secret,
            self.patience,
            io_timeout(self.replicas),
        )?;
        if c.info.server_id != self.conns[s].info.server_id {
            // Restarted: whatever it held is gone; reconnecting cannot help.
            return Err(pagefleet_client::ClientError::Protocol {
                addr: self.addrs[s].clone(),
                msg: "the server restarted and lost its pages".into(),
            });
        }
        self.conns[s] = c;
        // The old fd is closed (it left the epoll set); register the new one.
        if let Some(fd) = self.epoll_fds.get_mut(s) {
            *fd = -1;
        }
        Ok(())
    }

    fn lost(&mut self, p: usize, s: usize, e: pagefleet_client::ClientError) {
        self.publish();
        let msg = format!(
            "pagefleet: page {p} of region {:#x} cannot be brought back from memory server {}: {e}. \
             The guest cannot continue without its memory.",
            self.region_id, self.addrs[s]
        );
        self.fatal(msg, p);
    }
}

/// How long a reconnect keeps trying: with one replica, long (the guest
/// cannot go on without the server); with two, briefly (the mirror serves).
fn patience(replicas: usize) -> Duration {
    if replicas > 1 {
        replicate::REPLICA_PATIENCE
    } else {
        CONNECT_PATIENCE
    }
}

/// How long a server connection waits for any one read or write: with one
/// replica, the client's default (30 s: the guest cannot go on without the
/// server, so a slow one is waited for); with two, short — a hung server's
/// requests are hedged to the mirror long before (see `replicate`), and
/// this only bounds a connect or HELLO to a server that accepts and then
/// says nothing.
fn io_timeout(replicas: usize) -> Duration {
    if replicas > 1 {
        replicate::REPLICA_IO_TIMEOUT
    } else {
        ConnectOptions::default().io_timeout
    }
}

/// CPU time this thread has run, ns.
fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// A pager's connection to a memory server: a window of 4 frames, patient
/// with a busy or restarting server.
fn connect(
    name: &str,
    addr: &str,
    secret: &pagefleet_proto::auth::Secret,
    patience: Duration,
    io_timeout: Duration,
) -> Result<Conn, pagefleet_client::ClientError> {
    let opts = ConnectOptions {
        name: format!("{name}-pager"),
        window: 4,
        io_timeout,
        ..Default::default()
    };
    Conn::connect_patiently(addr, secret, &opts, patience)
}

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

    #[test]
    fn runs_split_where_pages_stop_being_consecutive() {
        let pages: [u64; 6] = [3, 4, 5, 9, 11, 12];
        let runs: Vec<_> = consecutive_runs(&pages).collect();
        assert_eq!(runs, vec![0..3, 3..4, 4..6]);
        assert_eq!(consecutive_runs::<usize>(&[]).count(), 0);
    }
}
