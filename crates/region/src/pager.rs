//! The pager thread: owns the uffd, the location DB, the access history and
//! the connections to memory servers. Single-threaded by design: page-out
//! (write-protect, send, punch, unprotect) is atomic with respect to faults
//! because every fault is served by this same thread.

use crate::{Command, Config, Location, OnFatal, Policy, RegionError, Shared, Snapshot, PAGE};
use pagefleet_client::{Conn, ConnectOptions, GetMode, Pages};
use pagefleet_proto::{PageSel, MAX_BATCH_PAGES};
use pagefleet_uffd::{self as uffd, Fault, FaultKind, Fill, Mapping, Uffd};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{debug, warn};

/// Location DB values: never touched, resident here, or on server `s` (REMOTE + s).
const ZERO: u8 = 0;
const LOCAL: u8 = 1;
const REMOTE: u8 = 2;

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
    guest: Arc<Mapping>,
    memfd: Arc<OwnedFd>,
    shadow: Mapping,
    shared: Arc<Shared>,
    region_id: u64,
    policy: Policy,
    on_fatal: OnFatal,
    cp: usize,
    chunks: usize,
    state: Vec<u8>,
    refb: Vec<u8>,
    hist: Vec<u8>,
    chunk_res: Vec<u16>,
    /// Server holding a slot for a resident page (server + 1; 0: none):
    /// what a page-in kept there (a later page-out overwrites it in place).
    copy: Vec<u8>,
    /// The kept copy equals the resident page (write-protected since page-in,
    /// no write seen): evicting it is a local drop, nothing is sent.
    clean: Vec<bool>,
    /// Pages with a kept copy, per server.
    copies: Vec<u64>,
    prefetch: crate::Prefetch,
    /// Sequential fault streams for adaptive read-ahead.
    streams: [Stream; STREAMS],
    stream_next: usize,
    /// Where `drop_copies` looks next.
    copy_hand: usize,
    reply_spin: Duration,
    resident: u64,
    remote: u64,
    conns: Vec<Conn>,
    addrs: Vec<String>,
    free: Vec<u64>,
    buf: Vec<u8>,
    faults: Vec<Fault>,
    // sampling hand and victim hand
    hand: usize,
    victim_hand: usize,
    rate: f64,
    max_rate: f64,
    carry: f64,
    last_tick: Instant,
    window_start: Instant,
    window_minor: u64,
    window_zaps: u64,
    tick_secs: f64,
    cpu_budget: f64,
    minor_cost: Duration,
    full_warned: bool,
    /// Between the high and low watermarks: keep evicting.
    evicting: bool,
    /// Remote faults of the current batch: (page, server, write fault).
    pending_in: Vec<(usize, usize, bool)>,
    /// For connecting to servers added later (evacuation targets).
    secret: Option<pagefleet_proto::auth::Secret>,
    name: String,
    evac: Option<Evac>,
}

/// Faults that continue a stream (at or just past where its last read-ahead
/// window ended) double its window, up to this many pages; any other fault
/// starts a new stream with a window of one page (Leap's trend detection,
/// Linux readahead's window growth). Random access (kv) thus moves one page
/// per fault, a scan moves up to 1 MiB per round trip.
const MAX_READAHEAD: usize = 256;
const STREAMS: usize = 8;

#[derive(Clone, Copy, Default)]
struct Stream {
    /// First page after the last window brought in.
    next: usize,
    /// Its window, pages.
    window: usize,
}

/// An evacuation in progress: pages on server `from` move to `to`.
struct Evac {
    from: usize,
    to: usize,
    cursor: usize,
    moved: u64,
    reply: std::sync::mpsc::Sender<Result<u64, String>>,
}

impl Pager {
    pub fn new(
        cfg: &Config,
        guest: Arc<Mapping>,
        memfd: Arc<OwnedFd>,
        shared: Arc<Shared>,
        rx: std::sync::mpsc::Receiver<Command>,
        doorbell: Arc<OwnedFd>,
    ) -> Result<Pager, RegionError> {
        let need = uffd::FEATURE_MISSING_SHMEM
            | uffd::FEATURE_MINOR_SHMEM
            | uffd::FEATURE_WP_HUGETLBFS_SHMEM
            | uffd::FEATURE_PAGEFAULT_FLAG_WP
            | uffd::FEATURE_THREAD_ID;
        let u = Uffd::open(need)?;
        u.register(
            guest.base(),
            guest.len() as u64,
            uffd::MODE_MISSING | uffd::MODE_MINOR | uffd::MODE_WP,
        )?;
        let shadow =
            Mapping::shared(memfd.as_raw_fd(), guest.len()).map_err(|source| RegionError::Io {
                what: "mmap shadow",
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
                let mut c = match ready {
                    Some(mut c) => {
                        c.set_window(4);
                        c
                    }
                    None => {
                        let opts = ConnectOptions {
                            name: format!("{}-pager", cfg.name),
                            window: 4,
                            ..Default::default()
                        };
                        Conn::connect_patiently(a, secret, &opts, CONNECT_PATIENCE)?
                    }
                };
                // Optionally spin for replies rather than sleep through a
                // wake-up (Config::reply_spin).
                c.set_spin(cfg.reply_spin);
                free.push(c.info.capacity_pages.saturating_sub(c.info.used_pages));
                conns.push(c);
            }
        }
        let pages = guest.len() / PAGE;
        let chunks = pages / cfg.chunk_pages;
        let max_rate = chunks as f64 / cfg.sample_period.as_secs_f64().max(0.01);
        let mut state = vec![ZERO; pages];
        let mut refb = vec![0u8; pages];
        let mut hist = vec![0u8; pages];
        let mut chunk_res = vec![0u16; chunks];
        let mut resident = 0u64;
        let nservers = cfg.servers.len();
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
                    state[q] = LOCAL;
                    chunk_res[q / cfg.chunk_pages] += 1;
                    resident += 1;
                }
            }
            for (q, h) in a.history.iter().enumerate() {
                match cfg.policy {
                    Policy::Clock => hist[q] = h & 1,
                    Policy::Aging => hist[q] = *h,
                }
                // Placed here because they ranked hottest: every resident
                // page starts referenced, so eviction gives each chunk a
                // full second chance before calling it cold (the history
                // that came along is a sample, not a full picture).
                if state[q] == LOCAL {
                    refb[q] = 1;
                }
            }
        }
        let mut remote = 0u64;
        for &(first, count, srv) in &cfg.initial_remote {
            for q in first..first + count {
                let q = q as usize;
                if state[q] == LOCAL {
                    // A migration's location list wins over stale data.
                    chunk_res[q / cfg.chunk_pages] -= 1;
                    resident -= 1;
                    let _ = uffd::punch_hole(memfd.as_raw_fd(), (q * PAGE) as u64, PAGE as u64);
                }
                if state[q] < REMOTE {
                    remote += 1;
                }
                state[q] = REMOTE + srv as u8;
            }
        }
        shared.stats.remote_pages.store(remote, Relaxed);
        shared.stats.resident_pages.store(resident, Relaxed);
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
            memfd,
            shadow,
            shared,
            region_id: cfg.region_id,
            policy: cfg.policy,
            on_fatal: cfg.on_fatal,
            cp: cfg.chunk_pages,
            chunks,
            state,
            refb,
            hist,
            chunk_res,
            copy: vec![0; pages],
            clean: vec![false; pages],
            copies: vec![0; nservers],
            prefetch: cfg.prefetch,
            streams: [Stream::default(); STREAMS],
            stream_next: 0,
            copy_hand: 0,
            reply_spin: cfg.reply_spin,
            resident,
            remote,
            conns,
            addrs: cfg.servers.clone(),
            free,
            buf: vec![0u8; cfg.chunk_pages.max(MAX_BATCH_PAGES) * PAGE],
            faults: Vec::with_capacity(64),
            hand: 0,
            victim_hand: 0,
            // Start slow; the controller raises the rate while faults stay cheap.
            rate: (max_rate / 64.0).clamp(1.0, 64.0),
            max_rate: max_rate.max(10.0),
            carry: 0.0,
            last_tick: Instant::now(),
            window_start: Instant::now(),
            window_minor: 0,
            window_zaps: 0,
            tick_secs: 0.005,
            cpu_budget: cfg.sample_cpu_budget,
            minor_cost: cfg.minor_fault_cost,
            full_warned: false,
            evicting: false,
            pending_in: Vec::new(),
            secret: cfg.secret.clone(),
            name: cfg.name.clone(),
            evac: None,
        })
    }

    fn addr(&self, p: usize) -> u64 {
        self.guest.base() + (p * PAGE) as u64
    }

    pub fn run(mut self) {
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() };
        self.shared.pager_tid.store(tid, Relaxed);
        // Faults wait for this thread: on a busy host it must get a CPU as
        // soon as a fault arrives, not after a scheduler slice of every busy
        // guest thread. Highest nice (works as root / with CAP_SYS_NICE;
        // otherwise the default priority stays).
        // SAFETY: plain syscall on our own thread id.
        if unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as u32, -20) } != 0 {
            debug!("pager runs at normal priority (no permission to raise it)");
        }
        while !self.shared.stop.load(Relaxed) {
            // While evicting, only peek for faults; otherwise sleep until one comes.
            let busy = self.evicting || self.evac.is_some();
            match self
                .uffd
                .poll_with(self.doorbell.as_raw_fd(), if busy { 0 } else { 5 })
            {
                Ok((faults, bell)) => {
                    if bell {
                        uffd::drain(self.doorbell.as_raw_fd());
                    }
                    if faults {
                        self.serve_pending();
                    }
                }
                Err(e) => warn!("polling userfaultfd: {e}"),
            }
            self.balance();
            self.sample_tick();
            while let Ok(c) = self.rx.try_recv() {
                self.command(c);
            }
            self.evacuate_step();
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
        let opts = ConnectOptions {
            name: format!("{}-pager", self.name),
            window: 4,
            ..Default::default()
        };
        let mut c = Conn::connect_patiently(addr, secret, &opts, CONNECT_PATIENCE)
            .map_err(|e| e.to_string())?;
        c.set_spin(self.reply_spin);
        self.free
            .push(c.info.capacity_pages.saturating_sub(c.info.used_pages));
        self.conns.push(c);
        self.copies.push(0);
        self.addrs.push(addr.to_string());
        self.servers_list.push(addr.to_string());
        Ok(self.addrs.len() - 1)
    }

    /// Move up to a few batches of an evacuation, then go back to faults.
    fn evacuate_step(&mut self) {
        let Some(mut ev) = self.evac.take() else {
            return;
        };
        let tag = REMOTE + ev.from as u8;
        let region = self.region_id;
        for _ in 0..4 {
            let mut list = Vec::with_capacity(MAX_BATCH_PAGES);
            while ev.cursor < self.state.len() && list.len() < MAX_BATCH_PAGES {
                if self.state[ev.cursor] == tag {
                    list.push(ev.cursor as u64);
                }
                ev.cursor += 1;
            }
            if list.is_empty() {
                let _ = ev.reply.send(Ok(ev.moved));
                return;
            }
            let n = list.len();
            let buf = &mut self.buf[..n * PAGE];
            // Copy, store at the new server, and only then delete at the old one.
            let r = self.conns[ev.from]
                .get(
                    region,
                    Pages::List(&list),
                    buf,
                    GetMode::Keep,
                    false,
                    MAX_BATCH_PAGES,
                )
                .and_then(|_| {
                    self.conns[ev.to].put(region, Pages::List(&list), buf, MAX_BATCH_PAGES)
                })
                .and_then(|_| self.conns[ev.from].delete(region, Pages::List(&list)));
            if let Err(e) = r {
                let _ = ev.reply.send(Err(format!(
                    "moving pages from {} to {}: {e} ({} moved before)",
                    self.addrs[ev.from], self.addrs[ev.to], ev.moved
                )));
                return;
            }
            for &p in &list {
                self.state[p as usize] = REMOTE + ev.to as u8;
                self.mark(p as usize);
            }
            self.free[ev.to] = self.free[ev.to].saturating_sub(n as u64);
            ev.moved += n as u64;
        }
        self.evac = Some(ev);
    }

    fn mark(&mut self, p: usize) {
        if self.tracking && !self.dirty[p] {
            self.dirty[p] = true;
            self.dirty_list.push(p as u32);
        }
    }

    fn command(&mut self, c: Command) {
        let (base, len) = (self.guest.base(), self.guest.len() as u64);
        match c {
            Command::TrackDirty(on, reply) => {
                for p in std::mem::take(&mut self.dirty_list) {
                    self.dirty[p as usize] = false;
                }
                self.tracking = on;
                // A migration moves resident pages itself: copies kept on
                // servers would be orphaned there, so they go now (and
                // page-ins take while tracking).
                if on {
                    self.drop_copies(None, u64::MAX);
                }
                // Mapped resident pages fault on their next write; unmapped
                // ones fault MINOR first and are mapped write-protected.
                if let Err(e) = self.uffd.writeprotect(base, len, on) {
                    warn!("change tracking: {e}");
                }
                let _ = reply.send(());
            }
            Command::TakeDirty(reply) => {
                let mut list: Vec<u64> = std::mem::take(&mut self.dirty_list)
                    .into_iter()
                    .map(u64::from)
                    .collect();
                list.sort_unstable();
                for &p in &list {
                    self.dirty[p as usize] = false;
                }
                // Re-arm: resident pages written this round fault on their next write.
                let mut i = 0;
                while i < list.len() {
                    let mut j = i + 1;
                    while j < list.len() && list[j] == list[j - 1] + 1 {
                        j += 1;
                    }
                    if self.tracking {
                        let _ = self.uffd.writeprotect(
                            self.addr(list[i] as usize),
                            ((j - i) * PAGE) as u64,
                            true,
                        );
                    }
                    i = j;
                }
                let _ = reply.send(list);
            }
            Command::Evacuate { from, to, reply } => {
                if self.evac.is_some() {
                    let _ = reply.send(Err("an evacuation is already running".into()));
                    return;
                }
                let Some(f) = self.addrs.iter().position(|a| *a == from) else {
                    let _ = reply.send(Ok(0));
                    return;
                };
                if from == to {
                    let _ = reply.send(Err("evacuating a server onto itself".into()));
                    return;
                }
                match self.server_index(&to) {
                    Ok(t) => {
                        // Nothing pages out to the server being emptied,
                        // and nothing stays kept there.
                        self.drop_copies(Some(f), u64::MAX);
                        self.free[f] = 0;
                        self.evac = Some(Evac {
                            from: f,
                            to: t,
                            cursor: 0,
                            moved: 0,
                            reply,
                        });
                    }
                    Err(e) => {
                        let _ = reply.send(Err(format!("cannot use {to}: {e}")));
                    }
                }
            }
            Command::Hold(on, reply) => {
                self.hold = on;
                self.evicting = false;
                let _ = reply.send(());
            }
            Command::Pages(pages, reply) => {
                let v = pages
                    .iter()
                    .map(|&p| {
                        let p = (p as usize).min(self.state.len() - 1);
                        (self.location(p), self.hist[p] | (self.refb[p] << 7))
                    })
                    .collect();
                let _ = reply.send(v);
            }
            Command::Snapshot(reply) => {
                let location = (0..self.state.len()).map(|p| self.location(p)).collect();
                let history = self
                    .hist
                    .iter()
                    .zip(&self.refb)
                    .map(|(h, r)| h | (r << 7))
                    .collect();
                let _ = reply.send(Snapshot {
                    region_id: self.region_id,
                    chunk_pages: self.cp,
                    servers: self.servers_list.clone(),
                    location,
                    history,
                });
            }
        }
    }

    fn location(&self, p: usize) -> Location {
        match self.state[p] {
            ZERO => Location::Zero,
            LOCAL => Location::Local,
            r => Location::Remote((r - REMOTE) as usize),
        }
    }

    /// Read and serve the fault events queued now (non-blocking).
    fn serve_pending(&mut self) {
        self.faults.clear();
        let mut faults = std::mem::take(&mut self.faults);
        match self.uffd.read_faults(&mut faults, 64) {
            Ok(_) => {
                let t = Instant::now();
                for f in &faults {
                    self.handle(*f);
                }
                // Remote faults of this batch go out together: one pipelined
                // burst per server, so their round trips overlap.
                if !self.pending_in.is_empty() {
                    let c0 = thread_cpu_ns();
                    self.page_in_batch(t);
                    self.shared
                        .stats
                        .page_in_cpu_ns
                        .fetch_add(thread_cpu_ns().saturating_sub(c0), Relaxed);
                }
                self.shared
                    .stats
                    .fault_ns
                    .fetch_add(t.elapsed().as_nanos() as u64, Relaxed);
            }
            Err(e) => warn!("reading userfaultfd: {e}"),
        }
        self.faults = faults;
    }

    fn publish(&self) {
        self.shared
            .stats
            .resident_pages
            .store(self.resident, Relaxed);
        self.shared.stats.remote_pages.store(self.remote, Relaxed);
    }

    fn handle(&mut self, f: Fault) {
        let base = self.guest.base();
        if f.addr < base || f.addr >= base + self.guest.len() as u64 {
            return;
        }
        let p = ((f.addr - base) as usize) / PAGE;
        let st = self.state[p];
        let s = &self.shared.stats;
        match f.kind {
            FaultKind::Missing => s.missing_faults.fetch_add(1, Relaxed),
            // Only MINOR faults on resident pages are sampling faults; a MINOR
            // fault on a remote page is a stale event served as a page-in.
            FaultKind::Minor if st == LOCAL => s.minor_faults.fetch_add(1, Relaxed),
            FaultKind::Minor => s.missing_faults.fetch_add(1, Relaxed),
            FaultKind::WriteProtect => s.wp_faults.fetch_add(1, Relaxed),
        };
        match (f.kind, st) {
            // The first write to a resident page since its page-in (its kept
            // copy is stale from now on) or, while tracking changes, this round.
            (FaultKind::WriteProtect, LOCAL) => {
                self.dirtied(p);
                if let Err(e) = self.uffd.writeprotect(self.addr(p), PAGE as u64, false) {
                    self.internal(p, e.to_string());
                }
            }
            // A write that waited out a page-out: unprotecting woke it already.
            (FaultKind::WriteProtect, _) => self.wake(p),
            (_, ZERO) => self.zero_fill(p),
            (FaultKind::Minor, LOCAL) => {
                self.window_minor += 1;
                self.refb[p] = 1;
                if f.write {
                    self.dirtied(p);
                }
                // Map the whole run of resident pages of this chunk that the
                // sampler unmapped, not just this page: one sampling fault
                // per touched chunk instead of one per page (placement and
                // eviction rank chunks), so the same CPU budget samples
                // many more chunks. Pages of the run the guest then touches
                // set no bits of their own: the chunk already counts as used.
                let lo = p / self.cp * self.cp;
                let (mut a, mut b) = (p, p + 1);
                while a > lo && self.state[a - 1] == LOCAL {
                    a -= 1;
                }
                while b < lo + self.cp && self.state[b] == LOCAL {
                    b += 1;
                }
                // Pages whose writes must be seen (tracking, clean copies)
                // are mapped write-protected; a write maps only its own
                // page writable (it is dirty now).
                let guarded = self.tracking || self.clean[a..b].iter().any(|c| *c);
                let whole = if b - a > 1 && !(f.write && guarded) {
                    self.uffd
                        .continue_mode(self.addr(a), ((b - a) * PAGE) as u64, guarded)
                } else {
                    Ok(Fill::Exists)
                };
                let wp = !f.write && (self.tracking || self.clean[p]);
                match whole {
                    Ok(Fill::Done) => {}
                    // Part of the run was mapped already: just this page.
                    Ok(Fill::Exists) => {
                        match self.uffd.continue_mode(self.addr(p), PAGE as u64, wp) {
                            Ok(Fill::Done) => {}
                            Ok(Fill::Exists) => self.wake(p),
                            Err(e) => self.internal(p, e.to_string()),
                        }
                    }
                    Err(e) => self.internal(p, e.to_string()),
                }
            }
            // Stale: the page was installed by a read-ahead meanwhile.
            (FaultKind::Missing, LOCAL) => self.wake(p),
            (_, s) => {
                let s = (s - REMOTE) as usize;
                if !self.pending_in.iter().any(|(q, _, _)| *q == p) {
                    self.pending_in.push((p, s, f.write));
                }
            }
        }
    }

    /// Page `p` was written: its kept copy is stale; tracking sees a change.
    fn dirtied(&mut self, p: usize) {
        if self.clean[p] {
            self.clean[p] = false;
            self.shared.stats.first_writes.fetch_add(1, Relaxed);
        }
        self.mark(p);
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

    fn set_local(&mut self, q: usize) {
        self.mark(q);
        let c = q / self.cp;
        if self.state[q] >= REMOTE {
            self.remote -= 1;
        }
        self.state[q] = LOCAL;
        self.chunk_res[c] += 1;
        self.resident += 1;
    }

    /// First touch: zero-fill every never-touched page of the chunk locally.
    fn zero_fill(&mut self, p: usize) {
        let c = p / self.cp;
        let lo = c * self.cp;
        let mut q = lo;
        let mut n = 0;
        while q < lo + self.cp {
            if self.state[q] != ZERO {
                q += 1;
                continue;
            }
            let start = q;
            while q < lo + self.cp && self.state[q] == ZERO {
                q += 1;
            }
            match self
                .uffd
                .zeropage(self.addr(start), ((q - start) * PAGE) as u64)
            {
                Ok(_) => {}
                Err(e) => return self.internal(p, e.to_string()),
            }
            for r in start..q {
                self.set_local(r);
            }
            n += q - start;
        }
        self.refb[p] = 1;
        self.shared
            .stats
            .zero_filled_pages
            .fetch_add(n as u64, Relaxed);
        self.publish();
    }

    /// The read-ahead window for a remote fault at `p` (pages, p included).
    fn readahead(&mut self, p: usize) -> usize {
        match self.prefetch {
            crate::Prefetch::Chunk => return self.cp,
            crate::Prefetch::Adaptive => {}
        }
        if let Some(st) = self
            .streams
            .iter_mut()
            .find(|st| st.window > 0 && p >= st.next && p <= st.next + st.window)
        {
            st.window = (st.window * 2).min(MAX_READAHEAD);
            st.next = p + st.window;
            return st.window;
        }
        self.streams[self.stream_next] = Stream {
            next: p + 1,
            window: 1,
        };
        self.stream_next = (self.stream_next + 1) % STREAMS;
        1
    }

    /// The pages to bring with a fault at `p` from server `s`: the rest of
    /// its chunk (fixed prefetch) or its stream's window (adaptive), only
    /// those on `s` and not asked for already.
    fn prefetch_list(&mut self, p: usize, s: usize, skip: &[usize]) -> Vec<u64> {
        let tag = (REMOTE as usize + s) as u8;
        let (lo, hi) = match self.prefetch {
            crate::Prefetch::Chunk => {
                let lo = p / self.cp * self.cp;
                (lo, lo + self.cp)
            }
            crate::Prefetch::Adaptive => {
                let w = self.readahead(p);
                (p, (p + w).min(self.state.len()))
            }
        };
        (lo..hi)
            .filter(|q| *q != p && self.state[*q] == tag && !skip.contains(q))
            .map(|q| q as u64)
            .collect()
    }

    /// Bring back the pages of this batch's remote faults: for every server,
    /// first the faulting pages (each installed, and its thread woken, as
    /// soon as it arrives), then their read-ahead that lives there.
    ///
    /// Outside change tracking the server keeps its copy (GET keep) and the
    /// page is installed write-protected: until the guest writes it, evicting
    /// it again is a local drop. A write fault installs its page writable
    /// (dirty at once: no second fault for the write).
    fn page_in_batch(&mut self, t_read: Instant) {
        let pending = std::mem::take(&mut self.pending_in);
        let mut servers: Vec<usize> = pending.iter().map(|x| x.1).collect();
        servers.sort_unstable();
        servers.dedup();
        for s in servers {
            let firsts: Vec<(usize, bool)> = pending
                .iter()
                .filter(|x| x.1 == s)
                .map(|x| (x.0, x.2))
                .collect();
            let skip: Vec<usize> = firsts.iter().map(|x| x.0).collect();
            let mut rests = Vec::with_capacity(firsts.len());
            for &(p, _) in &firsts {
                let mut r = self.prefetch_list(p, s, &skip);
                r.retain(|q| !rests.iter().any(|v: &Vec<u64>| v.contains(q)));
                rests.push(r);
            }
            // Pages of a server being emptied are taken, never kept there.
            let keep = !self.tracking && self.evac.as_ref().is_none_or(|ev| ev.from != s);
            let Err((p, e)) = self.fetch(s, &firsts, &rests, keep, t_read) else {
                continue;
            };
            // A keep GET can be repeated: ride out a dropped connection or a
            // restarting proxy by reconnecting once (a take cannot: the
            // server may have dropped the pages already).
            if !(keep && e.is_transient()) || self.reconnect(s).is_err() {
                return self.lost(p, s, e);
            }
            let tag = (REMOTE as usize + s) as u8;
            let firsts: Vec<(usize, bool)> = firsts
                .into_iter()
                .filter(|x| self.state[x.0] == tag)
                .collect();
            for r in rests.iter_mut() {
                r.retain(|q| self.state[*q as usize] == tag);
            }
            if let Err((p, e)) = self.fetch(s, &firsts, &rests, keep, t_read) {
                return self.lost(p, s, e);
            }
        }
        self.publish();
    }

    /// A fresh connection to server `s` in place of a broken one.
    fn reconnect(&mut self, s: usize) -> Result<(), pagefleet_client::ClientError> {
        let secret = self.secret.clone().ok_or_else(|| {
            pagefleet_client::ClientError::Usage("no cluster secret to reconnect with".into())
        })?;
        let opts = ConnectOptions {
            name: format!("{}-pager", self.name),
            window: 4,
            ..Default::default()
        };
        let mut c = Conn::connect_patiently(&self.addrs[s], &secret, &opts, CONNECT_PATIENCE)?;
        c.set_spin(self.reply_spin);
        if c.info.server_id != self.conns[s].info.server_id {
            // Restarted: whatever it held is gone; reconnecting cannot help.
            return Err(pagefleet_client::ClientError::Protocol {
                addr: self.addrs[s].clone(),
                msg: "the server restarted and lost its pages".into(),
            });
        }
        self.conns[s] = c;
        Ok(())
    }

    /// GET the faulting pages, then their read-ahead, from server `s`, and
    /// install each as it arrives. On failure: the page that could not be
    /// brought in and why.
    fn fetch(
        &mut self,
        s: usize,
        firsts: &[(usize, bool)],
        rests: &[Vec<u64>],
        keep: bool,
        t_read: Instant,
    ) -> Result<(), (usize, pagefleet_client::ClientError)> {
        let region = self.region_id;
        let mode = if keep { GetMode::Keep } else { GetMode::Take };
        let conn = &mut self.conns[s];
        let mut first_ids = Vec::new();
        let mut rest_ids = Vec::new();
        let queued: Result<(), pagefleet_client::ClientError> = (|| {
            for &(p, _) in firsts {
                first_ids.push(conn.queue_get(
                    region,
                    &PageSel::Run {
                        first: p as u64,
                        count: 1,
                    },
                    mode,
                    false,
                )?);
            }
            for rest in rests {
                for part in rest.chunks(MAX_BATCH_PAGES) {
                    rest_ids.push((
                        conn.queue_get(region, &PageSel::List(part.to_vec()), mode, false)?,
                        part.to_vec(),
                    ));
                }
            }
            conn.flush()
        })();
        if let Err(e) = queued {
            return Err((firsts.first().map_or(0, |x| x.0), e));
        }
        let shared = self.shared.clone();
        let st = &shared.stats;
        for (&(p, write), id) in firsts.iter().zip(first_ids) {
            if let Err(e) = self.conns[s].recv_get(id, &mut self.buf[..PAGE]) {
                return Err((p, e));
            }
            let wp = keep && !write;
            if let Err(e) = self
                .uffd
                .copy_mode(self.addr(p), &self.buf[..PAGE], false, wp)
            {
                self.internal(p, e.to_string());
                return Ok(());
            }
            self.arrived(p, s, keep, wp);
            self.refb[p] = 1;
            st.page_in_latency
                .record_us(t_read.elapsed().as_secs_f64() * 1e6);
            st.page_ins.fetch_add(1, Relaxed);
            st.page_in_requests.fetch_add(1, Relaxed);
            st.bytes_in.fetch_add(PAGE as u64, Relaxed);
        }
        for (id, part) in rest_ids {
            let len = part.len() * PAGE;
            if let Err(e) = self.conns[s].recv_get(id, &mut self.buf[..len]) {
                return Err((part[0] as usize, e));
            }
            // Install contiguous runs with one ioctl each.
            let mut i = 0;
            while i < part.len() {
                let mut j = i + 1;
                while j < part.len() && part[j] == part[j - 1] + 1 {
                    j += 1;
                }
                let q = part[i] as usize;
                if let Err(e) =
                    self.uffd
                        .copy_mode(self.addr(q), &self.buf[i * PAGE..j * PAGE], false, keep)
                {
                    self.internal(q, e.to_string());
                    return Ok(());
                }
                for r in part[i..j].iter() {
                    self.arrived(*r as usize, s, keep, keep);
                }
                i = j;
            }
            st.page_ins.fetch_add(part.len() as u64, Relaxed);
            st.prefetched_pages.fetch_add(part.len() as u64, Relaxed);
            st.page_in_requests.fetch_add(1, Relaxed);
            st.bytes_in.fetch_add(len as u64, Relaxed);
        }
        Ok(())
    }

    /// Page `q` arrived from server `s` and is resident now; with `keep` the
    /// server still holds it (clean while installed write-protected).
    fn arrived(&mut self, q: usize, s: usize, keep: bool, clean: bool) {
        self.set_local(q);
        if keep {
            self.copy[q] = s as u8 + 1;
            self.copies[s] += 1;
            self.clean[q] = clean;
        } else {
            self.free[s] += 1;
        }
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

    fn hotness(&self, c: usize) -> u32 {
        let lo = c * self.cp;
        let (h, r) = (&self.hist[lo..lo + self.cp], &self.refb[lo..lo + self.cp]);
        match self.policy {
            Policy::Clock => h.iter().zip(r).map(|(a, b)| (a | b) as u32 & 1).sum(),
            Policy::Aging => h
                .iter()
                .zip(r)
                .map(|(a, b)| (*a | (b << 7)) as u32)
                .max()
                .unwrap_or(0),
        }
    }

    /// Over budget: page out cold chunks until a slack below it. A victim
    /// hand sweeps the chunks (LRU approximation): clock evicts a chunk with
    /// no reference bit and gives the others a second chance (bits cleared,
    /// PTEs zapped so the next touch sets them again); aging evicts the chunk
    /// with the least max age among the next few resident chunks.
    fn balance(&mut self) {
        let budget = self.shared.budget.load(Relaxed);
        if self.hold || self.state.len() as u64 <= budget {
            self.evicting = false;
            return;
        }
        // Watermarks: start evicting half a slack below the budget, stop a
        // slack below it; evict in small batches between fault batches so a
        // fault never waits behind a long eviction.
        let slack = crate::paging_slack(budget, self.cp);
        let high = budget.saturating_sub(slack / 2);
        let low = budget.saturating_sub(slack);
        if self.resident > high {
            self.evicting = true;
        }
        if !self.evicting {
            return;
        }
        if self.resident <= low {
            self.evicting = false;
            return;
        }
        // Over the budget itself: get back under it now, in batches of up
        // to 2 MiB; between the watermarks: one small batch per loop.
        let mut steps = 0usize;
        loop {
            // Serve the faults queued meanwhile first: a queued touch is a
            // reference, and a page about to be used must not be chosen.
            if self.uffd.poll(0).unwrap_or(false) {
                self.serve_pending();
            }
            let over = self.resident > budget;
            let cap = if over { 512 } else { 64 };
            let mut batch = Vec::new();
            let mut pages = 0u64;
            while self.resident - pages > low && pages < cap && steps < self.chunks * 3 {
                let Some(c) = self.next_victim(&mut steps) else {
                    break;
                };
                if batch.contains(&c) {
                    break;
                }
                pages += self.chunk_res[c] as u64;
                batch.push(c);
            }
            let c0 = thread_cpu_ns();
            let t0 = Instant::now();
            let ok = !batch.is_empty() && self.page_out(&batch);
            let st = &self.shared.stats;
            st.page_out_cpu_ns
                .fetch_add(thread_cpu_ns().saturating_sub(c0), Relaxed);
            if over {
                // Over the budget itself: faults queue behind this page-out
                // (direct reclaim); between the watermarks they do not wait
                // long (one small batch between fault batches).
                st.direct_reclaims.fetch_add(1, Relaxed);
                st.direct_reclaim_ns
                    .fetch_add(t0.elapsed().as_nanos() as u64, Relaxed);
            }
            if !ok {
                self.evicting = false;
                break;
            }
            if self.resident <= budget || !over {
                break;
            }
        }
        self.publish();
    }

    fn next_resident(&mut self, steps: &mut usize) -> Option<usize> {
        for _ in 0..self.chunks {
            let c = self.victim_hand;
            self.victim_hand = (self.victim_hand + 1) % self.chunks;
            *steps += 1;
            if self.chunk_res[c] > 0 {
                return Some(c);
            }
        }
        None
    }

    fn next_victim(&mut self, steps: &mut usize) -> Option<usize> {
        match self.policy {
            Policy::Clock => loop {
                let c = self.next_resident(steps)?;
                if self.hotness(c) == 0 || *steps > self.chunks * 2 {
                    return Some(c);
                }
                // Second chance: clear the bits. Whether the chunk is touched
                // again is seen by the (budgeted) sampler or by a page-in:
                // zapping here too would make every hot chunk fault once per
                // revolution, unbudgeted.
                let lo = c * self.cp;
                self.refb[lo..lo + self.cp].fill(0);
                self.hist[lo..lo + self.cp].fill(0);
            },
            Policy::Aging => {
                const WINDOW: usize = 32;
                let mut best: Option<(u32, usize)> = None;
                let mut seen = 0;
                while seen < WINDOW {
                    let Some(c) = self.next_resident(steps) else {
                        break;
                    };
                    let h = self.hotness(c);
                    if best.is_none_or(|(bh, _)| h < bh) {
                        best = Some((h, c));
                    }
                    seen += 1;
                    if h == 0 {
                        break;
                    }
                }
                let (_, c) = best?;
                // Resume right after the victim: the rest of the window is looked at again.
                self.victim_hand = (c + 1) % self.chunks;
                Some(c)
            }
        }
    }

    /// Page out the chunks atomically: write-protect them; send each dirty
    /// resident page (straight from the shadow mapping, pipelined) to the
    /// server that keeps its copy, or, without one, to the server with the
    /// most free room; wait for every ack; punch the holes; update the
    /// location DB; unprotect (which wakes blocked writers; their retry faults
    /// MISSING and pages back in). Clean pages (their kept copy is current)
    /// are only dropped. Returns false if no server can take the dirty pages
    /// (balancing stops; the guest keeps running over budget).
    fn page_out(&mut self, chunks: &[usize]) -> bool {
        let mut pages = Vec::new();
        for &c in chunks {
            let lo = c * self.cp;
            pages.extend((lo..lo + self.cp).filter(|q| self.state[*q] == LOCAL));
        }
        let n = pages.len() as u64;
        let fresh = |copy: &[u8]| pages.iter().filter(|q| copy[**q] == 0).count() as u64;
        let pick = |free: &[u64], new: u64| {
            (0..free.len())
                .filter(|s| free[*s] >= new)
                .max_by_key(|s| free[*s])
        };
        let mut new = fresh(&self.copy);
        let mut chosen = pick(&self.free, new);
        if chosen.is_none() && new > 0 && self.copies.iter().any(|c| *c > 0) {
            // Room held by kept copies of resident pages is worth less
            // than room for pages that must leave: give it back.
            if !self.drop_copies(None, new.max(64)) {
                return false;
            }
            new = fresh(&self.copy);
            chosen = pick(&self.free, new);
        }
        let Some(s) = chosen.or(if new == 0 { Some(0) } else { None }) else {
            if !self.full_warned {
                warn!("every memory server is full: the region stays over its budget");
                self.full_warned = true;
            }
            return false;
        };
        let target = |q: usize, copy: &[u8]| {
            if copy[q] > 0 {
                copy[q] as usize - 1
            } else {
                s
            }
        };
        let span = (self.cp * PAGE) as u64;
        for &c in chunks {
            if let Err(e) = self.uffd.writeprotect(self.addr(c * self.cp), span, true) {
                self.internal(c * self.cp, e.to_string());
                return false;
            }
        }
        // Dirty pages per destination server, in frames of up to
        // MAX_BATCH_PAGES (scattered pages share a frame: one send and one
        // ack per 32 pages, not per run).
        let mut batches: Vec<(usize, Vec<u64>)> = Vec::new();
        for &q in &pages {
            if self.clean[q] {
                continue;
            }
            let t = target(q, &self.copy);
            match batches
                .iter_mut()
                .rev()
                .find(|(bt, b)| *bt == t && b.len() < MAX_BATCH_PAGES)
            {
                Some((_, b)) => b.push(q as u64),
                None => batches.push((t, vec![q as u64])),
            }
        }
        let region = self.region_id;
        let mut failed: Option<(usize, pagefleet_client::ClientError)> = None;
        let mut servers: Vec<usize> = batches.iter().map(|r| r.0).collect();
        servers.sort_unstable();
        servers.dedup();
        for t in servers {
            let sent: Result<(), pagefleet_client::ClientError> = (|| {
                let mut ids = std::collections::VecDeque::new();
                for (_, list) in batches.iter().filter(|r| r.0 == t) {
                    let data: Vec<&[u8]> = list
                        .iter()
                        .map(|&q| {
                            // SAFETY: inside the shadow mapping; the page is
                            // resident and write-protected until it is punched.
                            unsafe {
                                std::slice::from_raw_parts(
                                    self.shadow.addr().add(q as usize * PAGE),
                                    PAGE,
                                )
                            }
                        })
                        .collect();
                    let contiguous = list.windows(2).all(|w| w[1] == w[0] + 1);
                    let sel = if contiguous {
                        PageSel::Run {
                            first: list[0],
                            count: list.len() as u32,
                        }
                    } else {
                        PageSel::List(list.clone())
                    };
                    ids.push_back(self.conns[t].send_put_pages(region, &sel, &data)?);
                    // Bound the acks outstanding so neither side's buffers fill up.
                    if ids.len() >= 64 {
                        self.conns[t].recv_put(ids.pop_front().unwrap())?;
                    }
                }
                for id in ids {
                    self.conns[t].recv_put(id)?;
                }
                Ok(())
            })();
            if let Err(e) = sent {
                failed = Some((t, e));
                break;
            }
        }
        if let Some((t, e)) = failed {
            for &c in chunks {
                let _ = self.uffd.writeprotect(self.addr(c * self.cp), span, false);
            }
            if e.code() == Some(pagefleet_proto::ErrorCode::OutOfCapacity) {
                debug!("memory server {} is full", self.addrs[t]);
                self.free[t] = 0;
                return true;
            }
            let msg = format!(
                "pagefleet: cannot page out to memory server {} (region {:#x}): {e}. The server is unusable; \
                 pages already there cannot be trusted to come back.",
                self.addrs[t], self.region_id
            );
            self.fatal(msg, chunks[0] * self.cp);
            return false;
        }
        // Punch holes, coalescing adjacent pages.
        let mut i = 0;
        while i < pages.len() {
            let mut j = i + 1;
            while j < pages.len() && pages[j] == pages[j - 1] + 1 {
                j += 1;
            }
            if let Err(e) = uffd::punch_hole(
                self.memfd.as_raw_fd(),
                (pages[i] * PAGE) as u64,
                ((j - i) * PAGE) as u64,
            ) {
                self.internal(pages[i], e.to_string());
                return false;
            }
            i = j;
        }
        let mut dropped = 0u64;
        for &q in &pages {
            if self.tracking && !self.dirty[q] {
                self.dirty[q] = true;
                self.dirty_list.push(q as u32);
            }
            let t = target(q, &self.copy);
            if self.copy[q] > 0 {
                self.copies[t] -= 1;
                if self.clean[q] {
                    dropped += 1;
                }
            }
            self.state[q] = REMOTE + t as u8;
            self.copy[q] = 0;
            self.clean[q] = false;
            self.hist[q] = 0;
            self.refb[q] = 0;
        }
        for &c in chunks {
            self.chunk_res[c] = 0;
        }
        self.resident -= n;
        self.remote += n;
        self.free[s] -= new;
        let st = &self.shared.stats;
        st.page_outs.fetch_add(n - dropped, Relaxed);
        st.clean_drops.fetch_add(dropped, Relaxed);
        st.page_out_chunks.fetch_add(chunks.len() as u64, Relaxed);
        st.bytes_out.fetch_add((n - dropped) * PAGE as u64, Relaxed);
        for &c in chunks {
            if let Err(e) = self.uffd.writeprotect(self.addr(c * self.cp), span, false) {
                self.internal(c * self.cp, e.to_string());
                return false;
            }
        }
        true
    }

    /// Delete kept copies of resident pages (on server `only`, or on any),
    /// at most `max` of them; their pages become plain resident (dirty).
    /// Returns false if a server could not be told (the guest is ended).
    fn drop_copies(&mut self, only: Option<usize>, max: u64) -> bool {
        let mut lists: Vec<Vec<u64>> = vec![Vec::new(); self.conns.len()];
        let mut n = 0u64;
        // A hand, so repeated small calls do not rescan the same pages.
        let len = self.copy.len();
        for i in 0..len {
            if n >= max {
                self.copy_hand = (self.copy_hand + i) % len;
                break;
            }
            let q = (self.copy_hand + i) % len;
            let c = self.copy[q];
            if c == 0 || only.is_some_and(|o| o + 1 != c as usize) {
                continue;
            }
            lists[c as usize - 1].push(q as u64);
            self.copy[q] = 0;
            self.clean[q] = false;
            n += 1;
        }
        let region = self.region_id;
        for (s, list) in lists.into_iter().enumerate() {
            if list.is_empty() {
                continue;
            }
            for part in list.chunks(pagefleet_proto::MAX_DELETE_LIST) {
                if let Err(e) = self.conns[s].delete(region, Pages::List(part)) {
                    let msg = format!(
                        "pagefleet: cannot free kept pages on memory server {} (region {:#x}): {e}",
                        self.addrs[s], self.region_id
                    );
                    self.fatal(msg, part[0] as usize);
                    return false;
                }
            }
            self.copies[s] -= list.len() as u64;
            self.free[s] += list.len() as u64;
        }
        true
    }

    /// Advance the sampling hand by as many resident chunks as the rate allows.
    fn sample_tick(&mut self) {
        let now = Instant::now();
        let dt = now.duration_since(self.last_tick).as_secs_f64();
        if self.hold || dt < self.tick_secs {
            return;
        }
        self.last_tick = now;
        // Controller: keep the guest's cost of sampling faults within budget.
        let win = now.duration_since(self.window_start).as_secs_f64();
        if win >= 0.1 {
            // Each sampling fault and each zap (a TLB shootdown) costs the
            // guest. A fault also turns a running thread into one waiting for
            // a CPU: on an oversubscribed host that wait grows with the run
            // queue, so the estimated cost does too.
            let rq = runqueue_factor();
            let per = self.minor_cost.as_secs_f64() * rq;
            // Spinning for replies only pays on a host with idle CPUs: on an
            // oversubscribed one it takes the CPU the server or a guest needs.
            let spin = if rq <= 1.0 {
                self.reply_spin
            } else {
                Duration::ZERO
            };
            for c in self.conns.iter_mut() {
                c.set_spin(spin);
            }
            let used = (self.window_minor as f64 + self.window_zaps as f64) * per;
            let allowed = self.cpu_budget * win;
            if used > allowed {
                self.rate = (self.rate * (allowed / used) * 0.8).max(1.0);
            } else if used < allowed * 0.5 {
                self.rate = (self.rate * 1.25).min(self.max_rate);
            }
            self.window_start = now;
            self.window_minor = 0;
            self.window_zaps = 0;
            self.shared
                .stats
                .sample_rate
                .store(self.rate as u64, Relaxed);
        }
        // Needing victims soon: look harder, the budget notwithstanding.
        let budget = self.shared.budget.load(Relaxed);
        let can_overflow = (self.state.len() as u64) > budget;
        let boost = if can_overflow && self.resident as f64 > budget as f64 * 0.97 {
            4.0
        } else {
            1.0
        };
        self.carry += self.rate * boost * dt;
        let mut todo = self.carry as usize;
        self.carry -= todo as f64;
        if todo == 0 {
            return;
        }
        // Visit the next resident chunks, then zap the whole swept span with
        // one madvise per contiguous piece: every zap is a TLB shootdown (an
        // IPI to each CPU running the guest), so one per tick, not per chunk.
        let mut scanned = 0;
        let start = self.hand;
        while todo > 0 && scanned < self.chunks {
            let c = self.hand;
            self.hand = (self.hand + 1) % self.chunks;
            scanned += 1;
            if self.chunk_res[c] == 0 {
                continue;
            }
            self.visit(c);
            todo -= 1;
        }
        let first = (self.chunks - start).min(scanned);
        let _ = self.guest.madvise(
            start * self.cp * PAGE,
            first * self.cp * PAGE,
            libc::MADV_DONTNEED,
        );
        if scanned > first {
            let _ = self
                .guest
                .madvise(0, (scanned - first) * self.cp * PAGE, libc::MADV_DONTNEED);
        }
        self.window_zaps += 1 + (scanned > first) as u64;
    }

    fn visit(&mut self, c: usize) {
        let lo = c * self.cp;
        for q in lo..lo + self.cp {
            let r = self.refb[q];
            self.hist[q] = match self.policy {
                Policy::Aging => (self.hist[q] >> 1) | (r << 7),
                Policy::Clock => r,
            };
            self.refb[q] = 0;
        }
        // The caller zaps the PTEs (page cache stays): the next touch is a MINOR fault.
        self.shared.stats.sampled_chunks.fetch_add(1, Relaxed);
    }
}

/// Runnable threads per CPU right now (at least 1), from /proc/loadavg.
fn runqueue_factor() -> f64 {
    let Ok(s) = std::fs::read_to_string("/proc/loadavg") else {
        return 1.0;
    };
    let running = s
        .split_whitespace()
        .nth(3)
        .and_then(|f| f.split('/').next())
        .and_then(|r| r.parse::<f64>().ok());
    // SAFETY: sysconf has no preconditions.
    let cpus = (unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }).max(1) as f64;
    running.map_or(1.0, |r| (r / cpus).max(1.0))
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
