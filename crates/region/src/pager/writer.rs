//! The page-out writer: a thread that sends victims' contents to memory
//! servers and waits for their acks, so faults never queue behind a
//! page-out (Fastswap's and kswapd's lesson: reclaim off the fault path).
//!
//! Ownership: the pager chooses victims, write-protects them, marks them
//! leaving in its location DB and hands a [`Job`] over; the writer owns its
//! own connection per server (the pager's GET replies never wait behind PUT
//! acks), reads the job's pages from the memfd with `pread` and, once every
//! target acknowledged a page, punches its data out of the memfd. It
//! answers with a [`Done`] and rings the pager's doorbell; the pager then
//! marks the stored pages remote. Nothing else crosses between the two
//! threads. Any fault on a page in a job waits for the job's answer (the
//! pages are write-protected, so what was sent is what the page holds).
//!
//! Clean pages (the server's copy is current) leave by a drop job instead:
//! the writer punches them at once, nothing is sent.
//!
//! Punches are exact runs of the job's pages only (a gap could hold a page
//! the pager is installing meanwhile). The punch is a good part of what
//! evicting a page costs (1.6 µs a page in the sequential scan, 4% of the
//! pager thread's samples in the kv bench), and on the writer it runs beside
//! the pager, on whichever CPU is free.
//!
//! Why `pread` and not a mapping of the memfd: a page read through any
//! mapping in the guest's address space gets a page-table entry there, and
//! punching a mapped page is a TLB shootdown, an IPI to every CPU running
//! the guest (a VM exit each way here). Read with `pread`, a victim the
//! clock hand found unmapped stays unmapped, and its punch flushes nothing.
//! The extra 4 KiB copy into the frame buffer costs less than the minor
//! fault that mapping it took.
//!
//! A server that hangs (stopped, or its host wedged: the connection stays
//! open) would hold the writer in a blocking read for the connection's
//! I/O timeout, 30 s, and the pager's direct reclaim with it. So the two
//! threads share [`Links`] under one lock: the writer says which server
//! it is waiting on and since when, and registers its connections' fds;
//! the pager, finding the wait past its deadline, calls the server down
//! and shuts the writer's socket to it (`shutdown(2)`: the blocked read
//! returns at once), and the writer neither sends to nor reconnects to a
//! server called down until the pager revives it. The lock is taken twice
//! per frame and server (~50 ns each, uncontended), against ~1 ms of
//! sending a 64-page frame.

use pagefleet_client::{ClientError, Conn};
use pagefleet_proto::{auth::Secret, PageSel, MAX_BATCH_PAGES};
use std::collections::{HashMap, HashSet, VecDeque};
use std::fs::File;
use std::os::fd::{OwnedFd, RawFd};
use std::os::unix::fs::FileExt;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::PAGE;

/// The writer thread's name (as `/proc/PID/task/TID/comm` shows it, at most
/// 15 bytes): benchmarks find it by this to place it.
pub const WRITER_THREAD: &str = "pagefleet-write";

/// What the pager and the writer share about servers (see the module
/// comment): one lock, held for a few instructions at a time.
#[derive(Default)]
pub(super) struct Links {
    /// The writer's connection fd per server.
    fds: HashMap<usize, RawFd>,
    /// Servers the pager called down: the writer sends them nothing.
    down: HashSet<usize>,
    /// Servers whose writer connection the pager cut: the writer drops it
    /// before its next job (a revived server gets a fresh one).
    stale: HashSet<usize>,
    /// The server the writer is blocked on (sending a frame or reading an
    /// ack), and since when.
    waiting: Option<(usize, Instant)>,
}

impl Links {
    /// The pager called server `s` down: no more page-outs to it, and a
    /// writer blocked on it returns at once.
    pub(super) fn cut(&mut self, s: usize) {
        self.down.insert(s);
        self.stale.insert(s);
        if let Some(&fd) = self.fds.get(&s) {
            // SAFETY: `fd` is the writer's open socket: the writer removes
            // it from `fds` under this lock before closing it. shutdown
            // only ends its traffic; the fd stays the writer's to close.
            unsafe { crate::sys::shutdown(fd) };
        }
    }

    /// Server `s` answers again: page-outs may go to it.
    pub(super) fn restore(&mut self, s: usize) {
        self.down.remove(&s);
    }

    /// The server the writer has been blocked on, and for how long.
    pub(super) fn waiting(&self) -> Option<(usize, Duration)> {
        self.waiting.map(|(s, t)| (s, t.elapsed()))
    }
}

/// A server a job's pages go to.
#[derive(Clone)]
pub(super) struct Target {
    /// Index of the server in the pager's list.
    pub(super) server: usize,
    /// Its address (the writer connects on first use).
    pub(super) addr: String,
    /// Its id at the pager's HELLO: a reconnect that meets another id met a
    /// restarted server, which lost the region's pages.
    pub(super) server_id: u64,
}

/// Dirty pages bound for one server, or for two (a primary and its mirror:
/// every frame goes to both, pipelined side by side).
pub(super) struct Job {
    /// Where the pages go (empty for a drop job).
    pub(super) targets: Vec<Target>,
    /// Sorted page numbers.
    pub(super) pages: Vec<u64>,
    /// A drop job: punch these (clean) pages' data, send nothing.
    pub(super) drop: bool,
}

/// What became of a job.
pub(super) struct Done {
    /// The servers it went to (indexes), primary first.
    pub(super) servers: Vec<usize>,
    pub(super) pages: Vec<u64>,
    /// Per page: every target acknowledged storing it.
    pub(super) stored: Vec<bool>,
    /// Why some were not stored, per server that failed.
    pub(super) errors: Vec<(usize, ClientError)>,
    /// CPU time the writer spent on the job, ns.
    pub(super) cpu_ns: u64,
    /// It was a drop job (`stored`: punched).
    pub(super) drop: bool,
    /// Why punching the job's stored (or, for a drop job, clean) pages failed.
    pub(super) punch_error: Option<std::io::Error>,
    /// Why reading the job's pages from the memfd failed (the pages not
    /// sent stay resident).
    pub(super) read_error: Option<std::io::Error>,
}

/// The pager's handle on its writer thread.
pub(super) struct Writer {
    /// Shared with the writer thread (see [`Links`]).
    links: Arc<Mutex<Links>>,
    jobs: Option<Sender<Job>>,
    done: Receiver<Done>,
    thread: Option<JoinHandle<()>>,
    /// Jobs handed over and not yet answered.
    in_flight: usize,
}

impl Writer {
    /// Jobs handed over and not yet answered.
    pub(super) fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// The connections' state the pager and the writer share.
    pub(super) fn links(&self) -> std::sync::MutexGuard<'_, Links> {
        self.links.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// What the writer thread needs to reach servers.
pub(super) struct WriterSetup {
    pub(super) region_id: u64,
    pub(super) name: String,
    pub(super) secret: Option<Secret>,
    pub(super) doorbell: Arc<OwnedFd>,
    /// How long a reconnect keeps trying.
    pub(super) patience: Duration,
    /// How long one read or write on a connection waits.
    pub(super) io_timeout: Duration,
}

impl Writer {
    /// Start the writer thread; it reads and punches pages through its own
    /// duplicate of the guest memory's file `memfd`.
    pub(super) fn start(memfd: &OwnedFd, setup: WriterSetup) -> std::io::Result<Writer> {
        let (jtx, jrx) = mpsc::channel();
        let (dtx, drx) = mpsc::channel();
        let links = Arc::new(Mutex::new(Links::default()));
        let conns = WriterConns {
            conns: HashMap::new(),
            links: links.clone(),
        };
        let guest = GuestFile {
            file: File::from(memfd.try_clone()?),
            buf: vec![0; MAX_BATCH_PAGES * PAGE],
        };
        let thread = std::thread::Builder::new()
            .name(WRITER_THREAD.into())
            .spawn(move || run(setup, guest, conns, jrx, dtx))?;
        Ok(Writer {
            links,
            jobs: Some(jtx),
            done: drx,
            thread: Some(thread),
            in_flight: 0,
        })
    }

    pub(super) fn submit(&mut self, job: Job) {
        if let Some(tx) = &self.jobs {
            if tx.send(job).is_ok() {
                self.in_flight += 1;
            }
        }
    }

    /// A finished job, if one is ready.
    pub(super) fn try_done(&mut self) -> Option<Done> {
        let d = self.done.try_recv().ok()?;
        self.in_flight -= 1;
        Some(d)
    }

    /// Wait at most `limit` for the next finished job (None: nothing in
    /// flight, or none finished in time).
    pub(super) fn wait_done(&mut self, limit: Duration) -> Option<Done> {
        if self.in_flight == 0 {
            return None;
        }
        match self.done.recv_timeout(limit) {
            Ok(d) => {
                self.in_flight -= 1;
                Some(d)
            }
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => {
                self.in_flight = 0;
                None
            }
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        // Closing the job channel ends the thread after its current job.
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The writer's connections, each fd registered in [`Links`] while open.
struct WriterConns {
    conns: HashMap<usize, Conn>,
    links: Arc<Mutex<Links>>,
}

impl WriterConns {
    fn insert(&mut self, s: usize, c: Conn) {
        self.links.lock().unwrap().fds.insert(s, c.raw_fd());
        if let Some(old) = self.conns.insert(s, c) {
            drop(old);
        }
    }

    fn remove(&mut self, s: usize) {
        // Unregistered before it closes: the pager never shuts down an fd
        // number that was reused.
        self.links.lock().unwrap().fds.remove(&s);
        self.conns.remove(&s);
    }

    /// Drop the connections the pager cut.
    fn drop_stale(&mut self) {
        let stale: Vec<usize> = self.links.lock().unwrap().stale.drain().collect();
        for s in stale {
            self.remove(s);
        }
    }

    fn is_down(&self, s: usize) -> bool {
        self.links.lock().unwrap().down.contains(&s)
    }

    /// Say the writer is about to block on server `s` (None: not blocked).
    fn waiting_on(&self, s: Option<usize>) {
        self.links.lock().unwrap().waiting = s.map(|s| (s, Instant::now()));
    }
}

fn run(
    setup: WriterSetup,
    mut guest: GuestFile,
    mut conns: WriterConns,
    jobs: Receiver<Job>,
    done: Sender<Done>,
) {
    for job in jobs {
        conns.drop_stale();
        let c0 = super::thread_cpu_ns();
        let n = job.pages.len();
        // A drop job's pages all leave, nothing is sent; a page-out's
        // pages leave once every target stored them.
        let (stored, errors, read_error) = if job.drop {
            (vec![true; n], Vec::new(), None)
        } else {
            put_job(&setup, &mut guest, &mut conns, &job)
        };
        // Leaving pages' data goes from the memfd (faults on them wait for
        // this job, so nothing reads or writes them meanwhile).
        let gone: Vec<u64> = job
            .pages
            .iter()
            .zip(&stored)
            .filter(|(_, ok)| **ok)
            .map(|(q, _)| *q)
            .collect();
        let punch_error = guest.punch(&gone).err();
        let d = Done {
            servers: job.targets.iter().map(|t| t.server).collect(),
            stored: if job.drop {
                vec![punch_error.is_none(); n]
            } else {
                stored
            },
            pages: job.pages,
            errors,
            cpu_ns: super::thread_cpu_ns().saturating_sub(c0),
            drop: job.drop,
            punch_error,
            read_error,
        };
        if done.send(d).is_err() {
            return;
        }
        pagefleet_uffd::ring(&setup.doorbell);
    }
}

/// PUT a page-out job's pages to every target; per page whether every
/// target acknowledged it, the errors met, and why reading the pages
/// failed if it did.
fn put_job(
    setup: &WriterSetup,
    guest: &mut GuestFile,
    conns: &mut WriterConns,
    job: &Job,
) -> (Vec<bool>, Vec<(usize, ClientError)>, Option<std::io::Error>) {
    let n = job.pages.len();
    let mut acked: Vec<Vec<bool>> = vec![vec![false; n]; job.targets.len()];
    let (mut errors, mut read_error) = write_job(setup, guest, conns, job, &mut acked);
    // A PUT can be repeated (it overwrites): ride out a dropped
    // connection by reconnecting once and sending what is unacked.
    if read_error.is_none() && errors.iter().any(|(_, e)| e.is_transient()) {
        for (t, e) in &errors {
            if e.is_transient() {
                conns.remove(*t);
            }
        }
        (errors, read_error) = write_job(setup, guest, conns, job, &mut acked);
    }
    let stored = (0..n).map(|i| acked.iter().all(|a| a[i])).collect();
    (stored, errors, read_error)
}

/// The writer's handle on the guest memory's file: reads a frame's pages
/// into one buffer, one `pread` per run (see the module comment for why
/// not through a mapping), and punches pages that left.
struct GuestFile {
    file: File,
    buf: Vec<u8>,
}

impl GuestFile {
    /// The contents of `pages` (sorted, at most one frame's), one after
    /// another. The buffer is sized once: no zero-fill per frame.
    fn read(&mut self, pages: &[u64]) -> std::io::Result<&[u8]> {
        for r in super::consecutive_runs(pages) {
            self.file.read_exact_at(
                &mut self.buf[r.start * PAGE..r.end * PAGE],
                pages[r.start] * PAGE as u64,
            )?;
        }
        Ok(&self.buf[..pages.len() * PAGE])
    }

    /// Punch the data of `pages` (sorted), one `fallocate` per run.
    fn punch(&self, pages: &[u64]) -> std::io::Result<()> {
        for r in super::consecutive_runs(pages) {
            pagefleet_uffd::punch_hole(
                &self.file,
                pages[r.start] * PAGE as u64,
                r.len() as u64 * PAGE as u64,
            )?;
        }
        Ok(())
    }
}

/// Send the job's pages not yet acknowledged by each target, in frames of
/// up to MAX_BATCH_PAGES, every frame to every target before the next
/// (both streams in flight side by side), and read every ack. Per target
/// the first error is returned after its in-flight acks are read (a
/// refused frame leaves the connection usable).
fn write_job(
    setup: &WriterSetup,
    guest: &mut GuestFile,
    conns: &mut WriterConns,
    job: &Job,
    acked: &mut [Vec<bool>],
) -> (Vec<(usize, ClientError)>, Option<std::io::Error>) {
    let mut read_error = None;
    let mut errors: Vec<(usize, ClientError)> = Vec::new();
    // Targets with something left to send and a connection.
    let mut live: Vec<usize> = Vec::new();
    for (k, t) in job.targets.iter().enumerate() {
        if acked[k].iter().all(|a| *a) {
            continue;
        }
        match target_conn(setup, conns, t) {
            Ok(()) => live.push(k),
            Err(e) => errors.push((t.server, e)),
        }
    }
    let mut acks: Vec<VecDeque<(u64, Vec<usize>)>> = vec![VecDeque::new(); job.targets.len()];
    let todo: Vec<usize> = (0..job.pages.len())
        .filter(|i| live.iter().any(|k| !acked[*k][*i]))
        .collect();
    for frame in todo.chunks(MAX_BATCH_PAGES) {
        let list: Vec<u64> = frame.iter().map(|i| job.pages[*i]).collect();
        let contiguous = list.windows(2).all(|w| w[1] == w[0] + 1);
        let sel = if contiguous {
            PageSel::Run {
                first: list[0],
                count: list.len() as u32,
            }
        } else {
            PageSel::List(list.clone())
        };
        // The pages are write-protected (a guest write waits for the job)
        // and punched only by this thread after their acks: what is read
        // here is what they hold.
        let data = match guest.read(&list) {
            Ok(d) => d,
            Err(e) => {
                read_error = Some(e);
                break;
            }
        };
        live.retain(|&k| {
            let server = job.targets[k].server;
            conns.waiting_on(Some(server));
            let conn = conns.conns.get_mut(&server).expect("connected above");
            let sent = conn.send_put(setup.region_id, &sel, data);
            conns.waiting_on(None);
            match sent {
                Ok(id) => {
                    acks[k].push_back((id, frame.to_vec()));
                    true
                }
                Err(e) => {
                    errors.push((server, e));
                    false
                }
            }
        });
        if live.is_empty() {
            break;
        }
    }
    for (k, queue) in acks.into_iter().enumerate() {
        let server = job.targets[k].server;
        if !conns.conns.contains_key(&server) {
            continue;
        }
        for (id, frame) in queue {
            conns.waiting_on(Some(server));
            let conn = conns.conns.get_mut(&server).expect("checked above");
            let got = conn.recv_put(id);
            conns.waiting_on(None);
            match got {
                Ok(_) => frame.iter().for_each(|i| acked[k][*i] = true),
                Err(e) => {
                    let broken = e.code().is_none();
                    if !errors.iter().any(|(s, _)| *s == server) {
                        errors.push((server, e));
                    }
                    if broken {
                        break;
                    }
                }
            }
        }
    }
    (errors, read_error)
}

/// Make sure the writer has a connection to `t` (a new one checked against
/// the id the pager met: a restarted server lost the region's pages).
fn target_conn(
    setup: &WriterSetup,
    conns: &mut WriterConns,
    t: &Target,
) -> Result<(), ClientError> {
    if conns.is_down(t.server) {
        return Err(ClientError::Unresponsive {
            addr: t.addr.clone(),
            waited_ms: 0,
            usual_us: 0,
        });
    }
    if conns.conns.contains_key(&t.server) {
        return Ok(());
    }
    let Some(secret) = &setup.secret else {
        return Err(ClientError::Usage(
            "no cluster secret to reach memory servers with".into(),
        ));
    };
    conns.waiting_on(Some(t.server));
    let c = super::servers::connect(
        &setup.name,
        &t.addr,
        secret,
        setup.patience,
        setup.io_timeout,
    );
    conns.waiting_on(None);
    let c = c?;
    if c.info.server_id != t.server_id {
        return Err(ClientError::Protocol {
            addr: t.addr.clone(),
            msg: "the server restarted and lost its pages".into(),
        });
    }
    conns.insert(t.server, c);
    Ok(())
}
