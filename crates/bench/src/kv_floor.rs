//! The kv floor: the kv guest over the least a user-space pager must do to
//! keep it within a budget, as a reference for `bench paging`'s goals
//! against zram (what any userfaultfd pager could reach here, measured in
//! the same run).
//!
//! The fault handler answers MISSING faults from a raw TCP page store (a
//! 9-byte request, the 4 KiB page back; every request of a batch sent
//! before the first reply is read) and installs pages a read faulted in
//! write-protected, so the first write shows (one WP fault). Over the
//! budget it hands the oldest installed pages to an evictor thread (FIFO:
//! no reference tracking at all, no zaps, no page-table reads), which may
//! run on any CPU as pagefleet's writer and the kernel's kswapd do: clean
//! pages are punched, dirty ones write-protected, sent, flushed (one ack
//! per batch) and punched. A fault on a page in a batch waits for the
//! batch, then pages it back in: nothing is lost. No location database, no
//! replicas, no second server, no stats beyond three counters: what
//! pagefleet adds is everything else.
//!
//! `--policy clock` is the same floor with the least a user-space pager
//! pays for reference bits (the kernel's LRU reads accessed bits without a
//! TLB flush; user space cannot): a hand sweeps the region in address
//! order, 64 pages at a time; one `PAGEMAP_SCAN` shows which resident pages
//! were mapped since the hand's last pass, the unmapped ones are victims,
//! and one `madvise(DONTNEED)` unmaps the window again (the memfd keeps the
//! pages; the guest's next touch is a minor fault the kernel serves alone).
//! It answers whether a pager with the kernel's fault count, paying for the
//! bits, gets closer to zram than the FIFO floor.

use anyhow::{bail, Context, Result};
use pagefleet_guests::{kv, Mem};
use pagefleet_region::Histogram;
use pagefleet_uffd::{self as uffd, FaultKind, Uffd};
use std::collections::VecDeque;
use std::io::{BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;

const P: usize = pagefleet_region::PAGE;
/// Store request: `g`, `p` or `f`, then the page number (little endian); a
/// `p` is followed by the page, a `g` answered with it, an `f` with one
/// byte once everything before it on the connection is stored.
const REQ: usize = 9;
/// Pages evicted together (one WP, one send, one punch per run).
const EVICT_BATCH: usize = 32;
/// Batches out at once.
const MAX_BATCHES: usize = 4;

/// The evictor thread's name: `bench paging` lets it run on any CPU.
pub const EVICT_THREAD: &str = "kv-floor-evict";

/// Pages the clock hand reads and unmaps at a time (one `PAGEMAP_SCAN`,
/// one `madvise`, so one TLB shootdown per window).
const WINDOW: usize = 64;

/// How the floor pager chooses victims.
#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
pub enum FloorPolicy {
    /// The oldest installed page: no reference bits at all.
    Fifo,
    /// Second chance in address order, reference bits from unmapping
    /// (zap) and `PAGEMAP_SCAN`.
    Clock,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    /// Never written: a fault gets a zero page.
    Zero,
    /// Here, the store's copy current (write-protected).
    Clean,
    /// Here, written since it came (or never stored).
    Dirty,
    /// In a batch with the evictor.
    Leaving,
    /// On the store only.
    Remote,
}

#[derive(Default)]
struct Counters {
    page_ins: AtomicU64,
    page_outs: AtomicU64,
    clean_drops: AtomicU64,
    /// `madvise` calls of the clock hand (each a TLB shootdown).
    unmaps: AtomicU64,
    /// Page-in service time, read of the fault to its page installed (as
    /// pagefleet's region measures it), so the two compare under one load.
    service: Histogram,
}

/// Pages to evict: (page, dirty), sorted.
type Batch = Vec<(usize, bool)>;
/// Run the kv guest (`pagefleet bench kv-floor-guest`) on `size` bytes paged
/// against the store at `store` within `budget_pages`; prints
/// `kv listening ADDR` as `pagefleet run kv` does and serves until killed.
pub fn guest_main(size: u64, budget_pages: u64, store: &str, policy: FloorPolicy) -> Result<()> {
    if size < (32 << 20) || !size.is_multiple_of(P as u64) {
        bail!("--size must be a multiple of 4 KiB, at least 32 MiB");
    }
    let pages = size / P as u64;
    if budget_pages < EVICT_BATCH as u64 * 4 || budget_pages > pages {
        bail!(
            "--budget-pages must be between {} and {pages}",
            EVICT_BATCH * 4
        );
    }
    let fd = Arc::new(uffd::memfd("kv-floor", size)?);
    let m = Arc::new(uffd::Mapping::shared(&fd, size as usize)?);
    m.madvise(0, m.len(), libc::MADV_NOHUGEPAGE)?;
    let u = Uffd::open(
        uffd::FEATURE_MISSING_SHMEM
            | uffd::FEATURE_WP_HUGETLBFS_SHMEM
            | uffd::FEATURE_PAGEFAULT_FLAG_WP,
    )?;
    // SAFETY: the floor's own mapping of its memfd, reached only by raw pointers.
    unsafe { u.register(m.base(), size, uffd::MODE_MISSING | uffd::MODE_WP) }?;
    let mut conn = TcpStream::connect(store).with_context(|| format!("page store {store}"))?;
    conn.set_nodelay(true)?;
    let mut hello = [b'S'; 9];
    hello[1..].copy_from_slice(&size.to_le_bytes());
    conn.write_all(&hello)?;
    let mut evict_conn =
        TcpStream::connect(store).with_context(|| format!("page store {store}"))?;
    evict_conn.set_nodelay(true)?;
    evict_conn.write_all(&hello)?;
    let counters = Arc::new(Counters::default());
    let u = Arc::new(u);
    let doorbell = Arc::new(uffd::eventfd()?);
    let (jobs, job_rx) = mpsc::channel::<Batch>();
    let (done_tx, done) = mpsc::channel::<Batch>();
    let ev = Evictor {
        u: u.clone(),
        file: std::fs::File::from(fd.try_clone()?),
        base: m.base(),
        conn: evict_conn,
        counters: counters.clone(),
        doorbell: doorbell.clone(),
    };
    std::thread::Builder::new()
        .name(EVICT_THREAD.into())
        .spawn(move || {
            if let Err(e) = ev.run(job_rx, done_tx) {
                eprintln!("kv floor evictor: {e:#}");
                std::process::exit(1);
            }
        })?;
    let mut h = Handler {
        u,
        base: m.base(),
        state: vec![State::Zero; pages as usize],
        resident: 0,
        victims: match policy {
            FloorPolicy::Fifo => Victims::Fifo(VecDeque::new()),
            FloorPolicy::Clock => Victims::Clock(Clock {
                pm: uffd::Pagemap::open().context("PAGEMAP_SCAN (Linux 6.7+)")?,
                map: m.clone(),
                hand: 0,
                armed: vec![false; pages as usize],
            }),
        },
        budget: budget_pages,
        reader: BufReader::with_capacity(64 * P, conn.try_clone()?),
        conn,
        counters: counters.clone(),
        out: Vec::new(),
        jobs,
        done,
        doorbell,
        out_batches: 0,
        leaving: 0,
        waiting: Vec::new(),
    };
    std::thread::Builder::new()
        .name("kv-floor-pager".into())
        .spawn(move || {
            if let Err(e) = h.run() {
                // The guest cannot go on without its pages.
                eprintln!("kv floor pager: {e:#}");
                std::process::exit(1);
            }
        })?;
    // SAFETY: the mapping lives until the process exits (this function
    // serves until killed and never drops `m` before returning).
    let mem = unsafe { Mem::new(m.addr(), size as usize) };
    let mut k = kv::Kv::open(mem);
    let c = counters.clone();
    k.extra_stats = Some(Box::new(move || {
        // Percentiles as the region's stats give them (bucket bound, µs).
        let service = c.service.counts();
        let lat = |p| Histogram::percentile(&service, p) as u64;
        vec![
            ("pf_page_ins".into(), c.page_ins.load(Relaxed)),
            ("pf_page_outs".into(), c.page_outs.load(Relaxed)),
            ("pf_clean_drops".into(), c.clean_drops.load(Relaxed)),
            ("pf_unmaps".into(), c.unmaps.load(Relaxed)),
            ("pf_page_in_p50_us".into(), lat(50.0)),
            ("pf_page_in_p99_us".into(), lat(99.0)),
        ]
    }));
    let l = TcpListener::bind("127.0.0.1:0")?;
    println!("kv listening {}", l.local_addr()?);
    std::io::stdout().flush()?;
    kv::serve(Arc::new(k), l, Arc::new(AtomicBool::new(false)));
    drop(m);
    Ok(())
}

struct Handler {
    u: Arc<Uffd>,
    base: u64,
    state: Vec<State>,
    /// Installed pages (clean or dirty, not leaving).
    resident: u64,
    victims: Victims,
    budget: u64,
    conn: TcpStream,
    reader: BufReader<TcpStream>,
    counters: Arc<Counters>,
    /// Outgoing requests of one batch.
    out: Vec<u8>,
    jobs: Sender<Batch>,
    done: Receiver<Batch>,
    doorbell: Arc<OwnedFd>,
    out_batches: usize,
    /// Pages in batches out.
    leaving: u64,
    /// Faults on leaving pages, woken when their batch is done.
    waiting: Vec<usize>,
}

impl Handler {
    fn addr(&self, p: usize) -> u64 {
        self.base + (p * P) as u64
    }

    fn run(&mut self) -> Result<()> {
        let mut faults = Vec::new();
        let mut gets: Vec<(usize, bool)> = Vec::new();
        let mut page = vec![0u8; P];
        loop {
            use pagefleet_common::sys::poll::{poll, pollfd};
            let mut fds = [
                pollfd(&self.u, libc::POLLIN),
                pollfd(&self.doorbell, libc::POLLIN),
            ];
            poll(&mut fds, 1000)?;
            if fds[1].revents != 0 {
                uffd::drain(&self.doorbell);
                while let Ok(b) = self.done.try_recv() {
                    self.landed(b)?;
                }
            }
            faults.clear();
            self.u.read_faults(&mut faults, 64)?;
            let t = std::time::Instant::now();
            gets.clear();
            for f in &faults {
                let p = ((f.addr - self.base) / P as u64) as usize;
                match (f.kind, self.state[p]) {
                    // Whatever the fault, it waits for the batch.
                    (_, State::Leaving) => self.waiting.push(p),
                    (FaultKind::WriteProtect, State::Clean) => {
                        self.state[p] = State::Dirty;
                        self.u.writeprotect(self.addr(p), P as u64, false)?;
                    }
                    (FaultKind::WriteProtect, _) => self.u.wake(self.addr(p), P as u64)?,
                    (_, State::Zero) => {
                        self.u.zeropage(self.addr(p), P as u64)?;
                        self.installed(p, State::Dirty);
                    }
                    (_, State::Clean | State::Dirty) => self.u.wake(self.addr(p), P as u64)?,
                    (_, State::Remote) => {
                        if !gets.iter().any(|(q, _)| *q == p) {
                            gets.push((p, f.write));
                        }
                    }
                }
            }
            if !gets.is_empty() {
                self.out.clear();
                for &(p, _) in &gets {
                    request(&mut self.out, b'g', p);
                }
                self.conn.write_all(&self.out)?;
                for &(p, write) in &gets {
                    self.reader.read_exact(&mut page)?;
                    // A read installs the page write-protected: its first
                    // write is the one WP fault that marks it dirty.
                    self.u.copy_mode(self.addr(p), &page, false, !write)?;
                    self.installed(p, if write { State::Dirty } else { State::Clean });
                    self.counters
                        .service
                        .record_us(t.elapsed().as_nanos() as f64 / 1e3);
                }
                self.counters.page_ins.fetch_add(gets.len() as u64, Relaxed);
            }
            self.balance()?;
        }
    }

    fn installed(&mut self, p: usize, s: State) {
        self.state[p] = s;
        self.resident += 1;
        match &mut self.victims {
            Victims::Fifo(fifo) => fifo.push_back(p as u32),
            // Just used: spared by the hand's next pass, which arms it.
            Victims::Clock(c) => c.armed[p] = false,
        }
    }

    /// Up to `n` pages to evict, oldest first or by the clock.
    fn victims(&mut self, n: usize) -> Result<Batch> {
        let state = &self.state;
        match &mut self.victims {
            Victims::Fifo(fifo) => Ok(fifo
                .drain(..n.min(fifo.len()))
                .map(|p| (p as usize, state[p as usize] == State::Dirty))
                .collect()),
            Victims::Clock(c) => {
                let (b, unmaps) = c.sweep(state, n)?;
                self.counters.unmaps.fetch_add(unmaps, Relaxed);
                Ok(b)
            }
        }
    }

    /// Keep installed pages a few batches below the budget; wait for the
    /// evictor only when memory itself is over it.
    fn balance(&mut self) -> Result<()> {
        let low = self.budget - (MAX_BATCHES * EVICT_BATCH) as u64;
        while self.resident > low && self.out_batches < MAX_BATCHES {
            let mut b = self.victims(EVICT_BATCH)?;
            if b.is_empty() {
                break;
            }
            b.sort_unstable();
            for &(p, _) in &b {
                self.state[p] = State::Leaving;
            }
            self.resident -= b.len() as u64;
            self.leaving += b.len() as u64;
            self.out_batches += 1;
            if self.jobs.send(b).is_err() {
                bail!("the evictor stopped");
            }
        }
        while self.resident + self.leaving > self.budget {
            let Ok(b) = self.done.recv() else {
                bail!("the evictor stopped");
            };
            self.landed(b)?;
        }
        Ok(())
    }

    /// A batch is out: its pages are on the store only; faults that waited
    /// on them retry (and page them back in).
    fn landed(&mut self, b: Batch) -> Result<()> {
        for &(p, _) in &b {
            self.state[p] = State::Remote;
        }
        self.leaving -= b.len() as u64;
        self.out_batches -= 1;
        for p in std::mem::take(&mut self.waiting) {
            if self.state[p] == State::Leaving {
                self.waiting.push(p);
            } else {
                self.u.wake(self.addr(p), P as u64)?;
            }
        }
        Ok(())
    }
}

/// How the handler picks pages to evict.
enum Victims {
    /// Installed pages, oldest first.
    Fifo(VecDeque<u32>),
    Clock(Clock),
}

struct Clock {
    pm: uffd::Pagemap,
    /// The region's mapping, unmapped a window at a time.
    map: Arc<uffd::Mapping>,
    /// The next page the hand reads.
    hand: usize,
    /// Unmapped by the hand since it was installed: mapped again means used.
    armed: Vec<bool>,
}

impl Clock {
    /// Advance the hand until it has `n` victims: resident pages not mapped
    /// since its last pass. The pages it passes and spares are unmapped
    /// again, a window at a time. After two laps without enough (every
    /// page in use), any resident page will do. Returns the victims and
    /// the `madvise` calls made.
    fn sweep(&mut self, state: &[State], n: usize) -> Result<(Batch, u64)> {
        let (pages, base) = (state.len(), self.map.base());
        let mut victims = Batch::new();
        let mut mapped = [false; WINDOW];
        let (mut passed, mut unmaps) = (0, 0);
        while victims.len() < n && passed < 3 * pages {
            let force = passed >= 2 * pages;
            let lo = self.hand;
            let mut hi = (lo + WINDOW).min(pages);
            mapped.fill(false);
            self.pm.present(
                base + (lo * P) as u64,
                ((hi - lo) * P) as u64,
                &mut |a, b| mapped[a..b].fill(true),
            )?;
            let mut resident = false;
            for p in lo..hi {
                let dirty = match state[p] {
                    State::Clean => false,
                    State::Dirty => true,
                    _ => continue,
                };
                resident = true;
                if force || (self.armed[p] && !mapped[p - lo]) {
                    victims.push((p, dirty));
                    if victims.len() == n {
                        hi = p + 1;
                        break;
                    }
                } else {
                    self.armed[p] = true;
                }
            }
            if resident {
                // DONTNEED on a shared memfd mapping only drops page-table
                // entries: the memfd keeps the pages (and a uffd-wp marker
                // keeps protection), so the next touch maps the same page.
                self.map
                    .madvise(lo * P, (hi - lo) * P, libc::MADV_DONTNEED)
                    .context("madvise(DONTNEED)")?;
                unmaps += 1;
            }
            passed += hi - lo;
            self.hand = if hi == pages { 0 } else { hi };
        }
        Ok((victims, unmaps))
    }
}

struct Evictor {
    u: Arc<Uffd>,
    /// The memfd (a dup): pages are read from it and punched out.
    file: std::fs::File,
    base: u64,
    conn: TcpStream,
    counters: Arc<Counters>,
    doorbell: Arc<OwnedFd>,
}

impl Evictor {
    fn run(mut self, jobs: Receiver<Batch>, done: Sender<Batch>) -> Result<()> {
        let mut out = Vec::new();
        for b in jobs {
            let dirty: Vec<usize> = b.iter().filter(|(_, d)| *d).map(|(p, _)| *p).collect();
            // Protect before reading: a write from here on waits in its WP
            // fault until the batch is done, then pages the page back in.
            for r in runs(&dirty) {
                self.u
                    .writeprotect(self.base + (r.0 * P) as u64, (r.1 * P) as u64, true)?;
            }
            if !dirty.is_empty() {
                out.clear();
                for &p in &dirty {
                    request(&mut out, b'p', p);
                    // Read from the file, not through the mapping: a page
                    // mapped to be read makes its punch a TLB shootdown
                    // (as pagefleet's writer does, for the same reason).
                    let at = out.len();
                    out.resize(at + P, 0);
                    self.file.read_exact_at(&mut out[at..], (p * P) as u64)?;
                }
                request(&mut out, b'f', 0);
                self.conn.write_all(&out)?;
                let mut ack = [0u8; 1];
                self.conn.read_exact(&mut ack)?;
            }
            let pages: Vec<usize> = b.iter().map(|(p, _)| *p).collect();
            for r in runs(&pages) {
                uffd::punch_hole(&self.file, (r.0 * P) as u64, (r.1 * P) as u64)?;
            }
            self.counters
                .page_outs
                .fetch_add(dirty.len() as u64, Relaxed);
            self.counters
                .clean_drops
                .fetch_add((b.len() - dirty.len()) as u64, Relaxed);
            if done.send(b).is_err() {
                return Ok(());
            }
            uffd::ring(&self.doorbell);
        }
        Ok(())
    }
}

/// Append a store request for page `p`.
fn request(out: &mut Vec<u8>, op: u8, p: usize) {
    out.push(op);
    out.extend_from_slice(&(p as u64).to_le_bytes());
}

/// Runs of consecutive pages in sorted `v`: (first, count).
fn runs(v: &[usize]) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    for &p in v {
        match out.last_mut() {
            Some((a, n)) if *a + *n == p => *n += 1,
            _ => out.push((p, 1)),
        }
    }
    out
}

/// The page store's side of a connection (`S` mode of `bench raw-server`):
/// `total` bytes of pages, zero until written, shared by the connections
/// of this process (the floor's handler and its evictor).
pub(crate) fn serve_store(s: TcpStream, total: usize) -> std::io::Result<()> {
    static STORE: std::sync::OnceLock<std::sync::Mutex<Vec<u8>>> = std::sync::OnceLock::new();
    let store = STORE.get_or_init(|| std::sync::Mutex::new(vec![0u8; total]));
    // The first connection sized the store.
    let total = store.lock().unwrap_or_else(|e| e.into_inner()).len();
    let mut r = BufReader::with_capacity(64 * P, s.try_clone()?);
    let mut w = s;
    let mut req = [0u8; REQ];
    let mut page = vec![0u8; P];
    while r.read_exact(&mut req).is_ok() {
        let p = u64::from_le_bytes(req[1..].try_into().expect("8 bytes")) as usize;
        let Some(at) = p.checked_mul(P).filter(|a| a + P <= total) else {
            return Ok(());
        };
        let lock = || store.lock().unwrap_or_else(|e| e.into_inner());
        match req[0] {
            b'g' => {
                page.copy_from_slice(&lock()[at..at + P]);
                w.write_all(&page)?
            }
            b'p' => {
                r.read_exact(&mut page)?;
                lock()[at..at + P].copy_from_slice(&page);
            }
            b'f' => w.write_all(&[1])?,
            _ => return Ok(()),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The clock hand on a real shared memfd mapping: the first lap only
    /// arms (unmaps) pages, the next takes those not touched since, and a
    /// page touched after its unmap is spared.
    #[test]
    fn clock_takes_pages_untouched_since_the_last_pass() {
        const N: usize = 256;
        let fd = uffd::memfd("clock-test", (N * P) as u64).unwrap();
        let m = Arc::new(uffd::Mapping::shared(&fd, N * P).unwrap());
        let touch = |p: usize| {
            // SAFETY: page p is inside the mapping, which outlives this
            // closure; nothing else uses it.
            unsafe { std::ptr::write_volatile(m.addr().add(p * P), 1u8) }
        };
        (0..N).for_each(touch);
        let state = vec![State::Clean; N];
        let mut c = Clock {
            pm: uffd::Pagemap::open().unwrap(),
            map: m.clone(),
            hand: 0,
            armed: vec![false; N],
        };
        let (v, unmaps) = c.sweep(&state, 8).unwrap();
        let pages: Vec<usize> = v.iter().map(|(p, _)| *p).collect();
        assert_eq!(
            pages,
            (0..8).collect::<Vec<_>>(),
            "second lap, from the start"
        );
        assert_eq!(
            unmaps,
            (N / WINDOW + 1) as u64,
            "one unmap per window passed"
        );
        // Touched after the hand passed: spared on its next pass.
        (8..16).for_each(touch);
        let (v, _) = c.sweep(&state, 8).unwrap();
        let pages: Vec<usize> = v.iter().map(|(p, _)| *p).collect();
        assert_eq!(pages, (16..24).collect::<Vec<_>>());
        // Pages not resident are never victims.
        let mut state = state;
        state[24..32].fill(State::Remote);
        let (v, _) = c.sweep(&state, 8).unwrap();
        assert!(v.iter().all(|(p, dirty)| *p >= 32 && !dirty));
    }

    #[test]
    fn runs_split_at_gaps() {
        assert_eq!(runs(&[1, 2, 3, 7, 9, 10]), vec![(1, 3), (7, 1), (9, 2)]);
        assert!(runs(&[]).is_empty());
    }
}
