//! The device's I/O engine: every request is split by the layout into
//! runs contiguous on one server (at most 32 blocks, 128 KiB, one
//! memory-server frame), and each run goes to its server's **lane**: one
//! connection split into a sending and a receiving half, shared by every
//! NBD connection of the export, so many frames are in flight on every
//! server at once. A request completes when its last run does; the thread
//! that completes it replies to the client.
//!
//! Who owns what, and what crosses between threads:
//!
//! - the NBD connection's reader thread builds a job ([`Engine::read`],
//!   [`Engine::write`], [`Engine::trim`]) and sends its runs' frames itself,
//!   under the engine's order lock and each lane's lock: two requests that
//!   touch the same block reach each server, and so each copy of a
//!   mirrored block, in the same order. A large PUT goes out at once
//!   (vectored, from the client's buffer, no copy); GETs, DELETEs and small
//!   PUTs (copied, [`SMALL_PUT`]) of a burst wait in the lane
//!   ([`Engine::cork`]) until the reader's input runs dry
//!   ([`Engine::flush`]): one write per server per burst. The op itself
//!   crosses to the lane's receiver through a channel, in send order;
//! - a lane's receiver thread owns the receiving half: it waits on its
//!   server, never on the dispatcher (an op enters the channel right
//!   after its frame is sent, so it is there when its reply is: one
//!   wake-up per burst of replies), reads the replies in order (a server
//!   answers a connection in order), 32 KiB ahead, GET data straight into
//!   the run's buffer, and completes the run;
//!   completions in a burst of replies defer their client writes
//!   ([`defer`]) to go out together when the receiver next waits;
//! - a job's counters are atomics; its buffers are the runs' own (a read's
//!   reply is written from them, no copy into one buffer). A read that
//!   fails on one copy is dispatched again to the next copy from a thread
//!   of its own (a receiver never waits for the order lock).
//!
//! Promises: a write is acknowledged after every copy on a server that is
//! up stored it (mirrors written in parallel, on two lanes); a server that
//! fails is marked down and its copies are skipped from then on (a
//! mirrored device goes on with the other copy, a lost run is read from
//! it). Never-written blocks read as holes without asking a server; a
//! written block no server holds is an I/O error ([`IoError::Lost`]).
//!
//! Measured (`pagefleet bench blockdev`, 2 servers linear, loopback, 2
//! CPUs): against a forwarder that does nothing but the two hops (the
//! bench's floor) and nbdkit's memory plugin in the same run; see
//! docs/blockdev.md for the figures and what bounds them.

use crate::backend::{IoError, Shared, BLOCK};
use pagefleet_client::{ClientError, Conn, ConnectOptions, GetMode, RecvHalf, SendHalf};
use pagefleet_proto::PageSel;
use pagefleet_proto::{ErrorCode, MAX_BATCH_PAGES};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::AcqRel, Ordering::Relaxed};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};

thread_local! {
    /// This thread dispatches a burst: GET and DELETE frames wait in their
    /// lane until [`Engine::flush`] (see [`Engine::cork`]).
    static CORKED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Work a receiver thread runs before it waits for its server: what
    /// completions deferred while more replies were at hand.
    static DEFERRED: std::cell::RefCell<Vec<Box<dyn FnOnce()>>> =
        const { std::cell::RefCell::new(Vec::new()) };
    /// This thread is a receiver with more replies already read.
    static IN_BURST: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the calling thread is a lane's receiver completing runs whose
/// replies it already holds, with more to come: a completion may then
/// defer its client-facing write ([`defer`]) to go out with the others.
pub fn in_burst() -> bool {
    IN_BURST.with(|b| b.get())
}

/// Run `f` when this receiver next waits for its server (at once if the
/// thread is not a receiver in a burst).
pub fn defer(f: Box<dyn FnOnce()>) {
    if in_burst() {
        DEFERRED.with(|d| d.borrow_mut().push(f));
    } else {
        f()
    }
}

fn run_deferred() {
    let work = DEFERRED.with(|d| std::mem::take(&mut *d.borrow_mut()));
    for f in work {
        f();
    }
}

/// One run of blocks on one server: what a lane sends as one frame.
struct Op {
    /// First block on the server.
    sb: u64,
    /// Blocks (1..=32 for reads and writes).
    count: u64,
    kind: Kind,
    done: Box<dyn FnOnce(Outcome) + Send>,
}

enum Kind {
    /// Read the run into a new buffer.
    Get,
    /// Store `count` blocks of `data` from byte `off`.
    Put { data: Arc<Vec<u8>>, off: usize },
    /// Free the run.
    Delete,
}

/// How a run ended.
enum Outcome {
    /// Read: the blocks (zeros where the server held none) and how many it did not hold.
    Got(Vec<u8>, u64),
    /// Written or deleted.
    Done,
    /// The server is down (now or before).
    Down,
    /// The server refused it (full, or another request-level error).
    Refused(ClientError),
}

/// One memory server's lane: its connection's sending half and the
/// channel to its receiver thread, used by whichever thread dispatches
/// (under the lock, so frames and what the receiver expects stay in order).
struct Lane {
    send: Mutex<Option<LaneSend>>,
    /// Frames wait in its sending half (a corked burst).
    dirty: AtomicBool,
}

struct LaneSend {
    tx: SendHalf,
    inflight: Sender<(u64, Op)>,
}

/// The engine: one lane per memory server.
pub struct Engine {
    sh: Arc<Shared>,
    lanes: Vec<Lane>,
    /// Held while a job enqueues its runs (see the module docs).
    order: Mutex<()>,
}

impl Engine {
    /// Connect a lane to every server (a server that cannot be reached is
    /// marked down).
    pub fn start(sh: Arc<Shared>) -> Arc<Engine> {
        let lanes = (0..sh.servers.len())
            .map(|s| Lane {
                send: Mutex::new(start_lane(&sh, s)),
                dirty: AtomicBool::new(false),
            })
            .collect();
        Arc::new(Engine {
            sh,
            lanes,
            order: Mutex::new(()),
        })
    }

    /// Cork the calling thread: from now on the GET, DELETE and small PUT frames it
    /// dispatches wait in their lanes until it calls [`Engine::flush`] — a
    /// burst of requests goes to each server in one write. For a thread
    /// that reads many requests at once (an NBD connection's reader); it
    /// must flush before it waits for anything.
    pub fn cork(&self) {
        CORKED.with(|c| c.set(true));
    }

    /// Send what corked dispatches left in the lanes.
    pub fn flush(&self) {
        for (s, l) in self.lanes.iter().enumerate() {
            if !l.dirty.swap(false, AcqRel) {
                continue;
            }
            let mut lane = l.send.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(ls) = lane.as_mut() {
                if let Err(e) = ls.tx.flush() {
                    ls.tx.shutdown();
                    lane.take();
                    drop(lane);
                    self.mark_down(s, &e.to_string());
                }
            }
        }
    }

    /// The shared device state.
    pub fn shared(&self) -> &Arc<Shared> {
        &self.sh
    }

    /// Stop the lanes (requests in flight complete as Down).
    pub fn stop(&self) {
        for l in &self.lanes {
            if let Some(l) = l.send.lock().unwrap_or_else(|e| e.into_inner()).take() {
                l.tx.shutdown();
            }
        }
    }

    /// Send `op` to server `s`; the op back if the lane cannot take it (the
    /// server is down). The caller completes such ops as Down after it let
    /// go of the order lock: a completion may dispatch again.
    fn enqueue(&self, s: usize, op: Op) -> Option<Op> {
        if self.sh.down[s].load(Relaxed) {
            return Some(op);
        }
        let mut lane = self.lanes[s].send.lock().unwrap_or_else(|e| e.into_inner());
        let Some(l) = lane.as_mut() else {
            return Some(op);
        };
        let corked = CORKED.with(|c| c.get());
        match send_op(self.sh.region, l, op, corked) {
            Ok(queued) => {
                if queued {
                    self.lanes[s].dirty.store(true, Relaxed);
                }
                None
            }
            Err(failed) => {
                let (op, e) = *failed;
                lane.take();
                drop(lane);
                self.mark_down(s, &e.to_string());
                Some(op)
            }
        }
    }

    /// Enqueue ops in one order (see the module docs), then complete the
    /// ones no lane took. The ops are made as they are enqueued (no list
    /// of them is built: this runs for every request).
    fn enqueue_all(&self, ops: impl IntoIterator<Item = (usize, Op)>) {
        let mut undelivered = Vec::new();
        {
            let _order = self.order.lock().unwrap_or_else(|e| e.into_inner());
            for (s, op) in ops {
                if let Some(op) = self.enqueue(s, op) {
                    undelivered.push(op);
                }
            }
        }
        for op in undelivered {
            (op.done)(Outcome::Down);
        }
    }

    /// Read `count` blocks from `first`; `done` gets the pieces in order.
    pub fn read(
        self: &Arc<Self>,
        first: u64,
        count: u64,
        done: impl FnOnce(Result<Vec<Piece>, IoError>) + Send + 'static,
    ) {
        let copies = self.sh.t.runs(first, count, MAX_BATCH_PAGES as u64);
        let mut pieces = Vec::with_capacity(copies[0].len());
        let mut asks = Vec::with_capacity(copies[0].len());
        for &(vb, s, sb, n) in &copies[0] {
            if self.sh.written.count(vb, n) == 0 {
                // Never written (or trimmed): a hole, no server asked.
                pieces.push(Piece::Hole(n));
            } else {
                asks.push((pieces.len(), vb, s, sb, n));
                pieces.push(Piece::Data(Vec::new()));
            }
        }
        let job = Arc::new(ReadJob {
            eng: self.clone(),
            copies,
            pieces: Mutex::new(pieces),
            left: AtomicUsize::new(asks.len() + 1),
            error: Mutex::new(None),
            done: Mutex::new(Some(Box::new(done))),
        });
        self.enqueue_all(
            asks.into_iter()
                .map(|(i, vb, s, sb, n)| (s, job.ask(i, 0, vb, s, sb, n, 0))),
        );
        job.finish_one();
    }

    /// Write `count` whole blocks from `first`, their bytes `data[off..]`,
    /// on every copy; `done` after the last copy stored them.
    pub fn write(
        self: &Arc<Self>,
        first: u64,
        data: Arc<Vec<u8>>,
        off: usize,
        count: u64,
        done: impl FnOnce(Result<(), IoError>) + Send + 'static,
    ) {
        assert!(
            off + count as usize * BLOCK <= data.len(),
            "a write past its buffer"
        );
        let copies = self.sh.t.runs(first, count, MAX_BATCH_PAGES as u64);
        self.change(first, count, copies, true, done, |vb| Kind::Put {
            data: data.clone(),
            off: off + ((vb - first) as usize) * BLOCK,
        });
    }

    /// Free blocks (they read as zeros again) on every copy.
    pub fn trim(
        self: &Arc<Self>,
        first: u64,
        count: u64,
        done: impl FnOnce(Result<(), IoError>) + Send + 'static,
    ) {
        // Cleared first: a read racing the delete sees zeros, not a loss.
        self.sh.written.clear(first, count);
        let copies = self.sh.t.runs(first, count, u32::MAX as u64);
        self.change(first, count, copies, false, done, |_| Kind::Delete);
    }

    /// A write or trim: one op per run of every copy (`kind` of the run's
    /// first virtual block), done when all are.
    fn change(
        self: &Arc<Self>,
        first: u64,
        count: u64,
        copies: Vec<Vec<(u64, usize, u64, u64)>>,
        write: bool,
        done: impl FnOnce(Result<(), IoError>) + Send + 'static,
        kind: impl Fn(u64) -> Kind,
    ) {
        let job = Arc::new(ChangeJob::new(
            self,
            (first, count, write),
            copies.len(),
            done,
        ));
        let mut ops = Vec::with_capacity(copies.iter().map(Vec::len).sum());
        for (c, runs) in copies.iter().enumerate() {
            for &(vb, s, sb, n) in runs {
                job.left.fetch_add(1, Relaxed);
                let j = job.clone();
                let op = Op {
                    sb,
                    count: n,
                    kind: kind(vb),
                    done: Box::new(move |o| j.copy_done(c, s, o)),
                };
                ops.push((s, op));
            }
        }
        self.enqueue_all(ops);
        job.finish_one();
    }

    fn mark_down(&self, s: usize, why: &str) {
        mark_down(&self.sh, s, why);
    }
}

fn mark_down(sh: &Shared, s: usize, why: &str) {
    if !sh.down[s].swap(true, Relaxed) {
        tracing::warn!(
            "memory server {} is down ({why}); using the other copies",
            sh.servers[s]
        );
    }
}

/// A read's result, in order: blocks of data, or a hole of `n` blocks
/// (never written: reads as zeros).
pub enum Piece {
    /// The blocks' bytes.
    Data(Vec<u8>),
    /// `n` blocks that read as zeros.
    Hole(u64),
}

type ReadDone = Box<dyn FnOnce(Result<Vec<Piece>, IoError>) + Send>;

struct ReadJob {
    eng: Arc<Engine>,
    /// Every copy's runs of the request (copy 0 decides the pieces).
    copies: Vec<Vec<(u64, usize, u64, u64)>>,
    pieces: Mutex<Vec<Piece>>,
    /// Runs in flight, plus one while the job is being enqueued.
    left: AtomicUsize,
    error: Mutex<Option<IoError>>,
    done: Mutex<Option<ReadDone>>,
}

impl ReadJob {
    /// The op asking server `s` for `n` blocks at `sb` (virtual `vb`, copy
    /// `c`), into piece `i` at block offset `at` (a run of another copy
    /// fills part of a piece).
    #[allow(clippy::too_many_arguments)]
    fn ask(
        self: &Arc<Self>,
        i: usize,
        c: usize,
        vb: u64,
        s: usize,
        sb: u64,
        n: u64,
        at: u64,
    ) -> Op {
        if c != 0 || at != 0 {
            self.left.fetch_add(1, Relaxed);
        }
        let j = self.clone();
        Op {
            sb,
            count: n,
            kind: Kind::Get,
            done: Box::new(move |o| j.got(i, c, vb, s, n, at, o)),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn got(self: &Arc<Self>, i: usize, c: usize, vb: u64, s: usize, n: u64, at: u64, o: Outcome) {
        let sh = &self.eng.sh;
        let failed = match o {
            Outcome::Got(data, missing) => {
                let unwritten = n - sh.written.count(vb, n);
                if missing > unwritten {
                    self.eng.mark_down(
                        s,
                        &format!(
                            "it no longer holds {} written block(s) of this device",
                            missing - unwritten
                        ),
                    );
                    Some(IoError::Lost(vb))
                } else {
                    let mut p = self.pieces.lock().unwrap_or_else(|e| e.into_inner());
                    let whole = self.piece_len(i);
                    match &mut p[i] {
                        Piece::Data(d) if d.is_empty() && data.len() == whole => *d = data,
                        Piece::Data(d) => {
                            // Part of a piece, read from another copy.
                            if d.is_empty() {
                                d.resize(whole, 0);
                            }
                            let lo = at as usize * BLOCK;
                            d[lo..lo + data.len()].copy_from_slice(&data);
                        }
                        Piece::Hole(_) => unreachable!("holes are not asked for"),
                    }
                    None
                }
            }
            Outcome::Down => Some(IoError::Unreachable(vb)),
            Outcome::Refused(e) => {
                self.eng.mark_down(s, &e.to_string());
                Some(IoError::Unreachable(vb))
            }
            Outcome::Done => None,
        };
        if let Some(err) = failed {
            if c + 1 < self.copies.len() {
                // The same blocks on the next copy (split as that copy is).
                let base = self.piece_first(i);
                let runs: Vec<_> = self.copies[c + 1]
                    .iter()
                    .filter(|r| r.0 < vb + n && r.0 + r.3 > vb)
                    .copied()
                    .collect();
                let ops: Vec<_> = runs
                    .into_iter()
                    .map(|(rv, s2, sb2, n2)| {
                        let (a, b) = (rv.max(vb), (rv + n2).min(vb + n));
                        (
                            s2,
                            self.ask(i, c + 1, a, s2, sb2 + (a - rv), b - a, a - base),
                        )
                    })
                    .collect();
                // Not on this thread: a receiver must keep reading its
                // server's replies while another dispatcher holds the locks.
                let eng = self.eng.clone();
                std::thread::spawn(move || eng.enqueue_all(ops));
            } else {
                let mut e = self.error.lock().unwrap_or_else(|e| e.into_inner());
                // A lost block says more than an unreachable one.
                if e.is_none() || matches!(err, IoError::Lost(_)) {
                    *e = Some(err);
                }
            }
        }
        self.finish_one();
    }

    /// The virtual block piece `i` starts at.
    fn piece_first(&self, i: usize) -> u64 {
        self.copies[0][i].0
    }

    fn piece_len(&self, i: usize) -> usize {
        self.copies[0][i].3 as usize * BLOCK
    }

    fn finish_one(&self) {
        if self.left.fetch_sub(1, AcqRel) != 1 {
            return;
        }
        let done = self.done.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(done) = done else { return };
        let err = self.error.lock().unwrap_or_else(|e| e.into_inner()).take();
        match err {
            Some(e) => done(Err(e)),
            None => {
                let pieces =
                    std::mem::take(&mut *self.pieces.lock().unwrap_or_else(|e| e.into_inner()));
                done(Ok(pieces))
            }
        }
    }
}

type ChangeDone = Box<dyn FnOnce(Result<(), IoError>) + Send>;

/// A write or a trim: done when every copy's runs are.
struct ChangeJob {
    eng: Arc<Engine>,
    first: u64,
    count: u64,
    /// A write (sets the written bits when it succeeds), not a trim.
    write: bool,
    /// Runs in flight, plus one while the job is being enqueued.
    left: AtomicUsize,
    /// Copy c had a run fail.
    copy_failed: Vec<AtomicBool>,
    no_space: Mutex<Option<String>>,
    done: Mutex<Option<ChangeDone>>,
}

impl ChangeJob {
    fn new(
        eng: &Arc<Engine>,
        (first, count, write): (u64, u64, bool),
        copies: usize,
        done: impl FnOnce(Result<(), IoError>) + Send + 'static,
    ) -> ChangeJob {
        ChangeJob {
            eng: eng.clone(),
            first,
            count,
            write,
            left: AtomicUsize::new(1),
            copy_failed: (0..copies).map(|_| AtomicBool::new(false)).collect(),
            no_space: Mutex::new(None),
            done: Mutex::new(Some(Box::new(done))),
        }
    }

    fn copy_done(&self, c: usize, s: usize, o: Outcome) {
        match o {
            Outcome::Done | Outcome::Got(..) => {}
            Outcome::Down => self.copy_failed[c].store(true, Relaxed),
            Outcome::Refused(e) if e.code() == Some(ErrorCode::OutOfCapacity) => {
                self.copy_failed[c].store(true, Relaxed);
                *self.no_space.lock().unwrap_or_else(|e| e.into_inner()) =
                    Some(format!("memory server {} is full", self.eng.sh.servers[s]));
            }
            Outcome::Refused(e) => {
                self.eng.mark_down(s, &e.to_string());
                self.copy_failed[c].store(true, Relaxed);
            }
        }
        self.finish_one();
    }

    fn finish_one(&self) {
        if self.left.fetch_sub(1, AcqRel) != 1 {
            return;
        }
        let done = self.done.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(done) = done else { return };
        if let Some(m) = self
            .no_space
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            return done(Err(IoError::NoSpace(m)));
        }
        if self.copy_failed.iter().all(|f| f.load(Relaxed)) {
            return done(Err(IoError::Unreachable(self.first)));
        }
        if self.write {
            // Stored on every copy that is up: it reads back from now on.
            self.eng.sh.written.set(self.first, self.count);
        }
        done(Ok(()))
    }
}

/// Connect server `s`'s lane: the sending half for the dispatchers, a
/// receiver thread for the replies. None (the server marked down) when it
/// cannot be reached.
fn start_lane(sh: &Arc<Shared>, s: usize) -> Option<LaneSend> {
    let (tx, rh) = match connect(sh, s) {
        Ok(halves) => halves,
        Err(e) => {
            mark_down(sh, s, &e.to_string());
            return None;
        }
    };
    let (itx, irx) = mpsc::channel::<(u64, Op)>();
    let sh2 = sh.clone();
    let started = std::thread::Builder::new()
        .name(format!("blockdev-recv-{s}"))
        .spawn(move || receive(&sh2, s, rh, irx));
    if let Err(e) = started {
        mark_down(sh, s, &format!("cannot start its receiver: {e}"));
        return None;
    }
    Some(LaneSend { tx, inflight: itx })
}

fn connect(sh: &Shared, s: usize) -> Result<(SendHalf, RecvHalf), ClientError> {
    let opts = ConnectOptions {
        name: sh.client_name.clone(),
        ..Default::default()
    };
    Conn::connect(&sh.servers[s], &sh.secret, &opts)?.split()
}

/// Send `op` on a lane (the caller holds the lane's lock): the frame goes
/// out (or, `corked`, a GET or DELETE waits in the sending half: Ok(true)),
/// then the receiver is told what to expect. The op back if sending failed
/// (the lane is closed then).
/// PUTs up to this size wait in a corked lane (copied: a copy of 16 KiB
/// costs less than the system call it saves); larger ones are sent from
/// the client's buffer at once.
const SMALL_PUT: usize = 16 << 10;

fn send_op(
    region: u64,
    lane: &mut LaneSend,
    op: Op,
    corked: bool,
) -> Result<bool, Box<(Op, ClientError)>> {
    let sel = PageSel::Run {
        first: op.sb,
        count: op.count as u32,
    };
    let small = op.count as usize * BLOCK <= SMALL_PUT;
    let queued = corked && (small || !matches!(op.kind, Kind::Put { .. }));
    let sent = match &op.kind {
        Kind::Put { data, off } => {
            let pages: Vec<&[u8]> = data[*off..*off + op.count as usize * BLOCK]
                .chunks(BLOCK)
                .collect();
            if queued {
                // A burst's small PUTs are copied and go out together.
                lane.tx.queue_put_pages(region, &sel, &pages)
            } else {
                // A large PUT is written at once, from the client's
                // buffer: frames queued before it go first.
                lane.tx
                    .flush()
                    .and_then(|_| lane.tx.send_put_pages(region, &sel, &pages))
            }
        }
        Kind::Get => lane.tx.queue_get(region, &sel, GetMode::Keep, true),
        Kind::Delete => lane.tx.queue_delete(region, &sel),
    };
    let sent = match sent {
        Ok(id) if !queued => lane.tx.flush().map(|_| id),
        other => other,
    };
    match sent {
        // The receiver reads replies in the order frames were sent: it is
        // told under the same lock.
        Ok(id) => {
            lane.inflight
                .send((id, op))
                .map(|_| queued)
                .map_err(|mpsc::SendError((_, op))| {
                    Box::new((op, ClientError::Usage("its receiver ended".into())))
                })
        }
        Err(e) => {
            lane.tx.shutdown();
            Err(Box::new((op, e)))
        }
    }
}

/// The receiver: replies in order, each run completed.
fn receive(sh: &Shared, s: usize, mut rh: RecvHalf, irx: Receiver<(u64, Op)>) {
    rh.set_read_ahead(RECV_AHEAD);
    let mut dead = false;
    loop {
        // Replies already at hand: completions may batch their writes to
        // clients; about to wait: what they deferred goes out first. With
        // no op in flight no reply can be at hand: not asked (a system
        // call saved per request at queue depth 1). An op sent but not yet
        // in the channel is found by `recv` below, as ever.
        let queued = irx.try_recv().ok();
        if queued.is_none() || !rh.reply_ready() {
            IN_BURST.with(|b| b.set(false));
            run_deferred();
        }
        // Wait on the server, not on the dispatcher: the next op is in
        // the channel by the time its reply is here (it is sent right
        // after its frame), so a dispatcher never wakes this thread — one
        // wake-up per burst of replies, not two.
        let mut next = queued;
        if !dead {
            match rh.wait_reply() {
                // Here (or closed: the op's receive says so).
                Ok(_) => {}
                // Past the I/O timeout: idle if nothing is in flight; an
                // op in flight waits the timeout again in its receive,
                // then reports it.
                Err(ClientError::TimedOut { .. }) if next.is_none() => match irx.try_recv() {
                    Ok(op) => next = Some(op),
                    Err(mpsc::TryRecvError::Empty) => continue,
                    Err(mpsc::TryRecvError::Disconnected) => break,
                },
                Err(_) => {}
            }
        }
        let Some((id, op)) = next.or_else(|| irx.recv().ok()) else {
            break;
        };
        if dead {
            (op.done)(Outcome::Down);
            continue;
        }
        IN_BURST.with(|b| b.set(true));
        let r = match op.kind {
            Kind::Get => {
                let mut buf = vec![0u8; op.count as usize * BLOCK];
                rh.recv_get(id, &mut buf)
                    .map(|g| Outcome::Got(buf, g.missing.len() as u64))
            }
            Kind::Put { .. } => rh.recv_put(id).map(|_| Outcome::Done),
            Kind::Delete => rh.recv_delete(id).map(|_| Outcome::Done),
        };
        match r {
            Ok(o) => (op.done)(o),
            Err(e @ ClientError::Server { .. }) if !e.code().is_some_and(|c| c.is_fatal()) => {
                (op.done)(Outcome::Refused(e))
            }
            Err(e) => {
                dead = true;
                mark_down(sh, s, &e.to_string());
                (op.done)(Outcome::Down);
            }
        }
    }
    IN_BURST.with(|b| b.set(false));
    run_deferred();
}

/// Bytes a receiver reads ahead: several small replies per system call,
/// and a whole reply of up to 32 KiB of data with its header (a guest's
/// swap-in reads 32 KiB at queue depth 1: with 32 KiB exactly, the last
/// bytes of every such reply took a second system call).
const RECV_AHEAD: usize = (32 << 10) + 256;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Written;
    use crate::layout::Translator;
    use pagefleet_memserver::{Backing, ServerConfig, ServerState, Store};
    use pagefleet_proto::auth::Secret;
    use std::sync::atomic::AtomicBool;

    /// A memory server on loopback, in this process: its address and a
    /// switch that closes its listener's accepted connections' fate (the
    /// server's state is dropped with the test).
    fn server(secret: &Secret, blocks: u64) -> (String, Arc<ServerState>) {
        let st = Arc::new(ServerState::new(
            Store::with_backing(blocks * BLOCK as u64, Backing::Memfd).unwrap(),
            secret.clone(),
            ServerConfig::default(),
        ));
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let st2 = st.clone();
        std::thread::spawn(move || pagefleet_memserver::gate::serve(l, st2));
        (addr, st)
    }

    fn device(servers: &[String], secret: &Secret, blocks: u64, mirror: bool) -> Arc<Engine> {
        let cap: Vec<u64> = servers.iter().map(|_| blocks * 2).collect();
        Engine::start(Arc::new(Shared {
            t: Translator::new(&cap, blocks, None, mirror).unwrap(),
            region: 0x7e57,
            servers: servers.to_vec(),
            secret: secret.clone(),
            down: servers.iter().map(|_| AtomicBool::new(false)).collect(),
            written: Written::new(blocks),
            client_name: "engine-test".into(),
        }))
    }

    fn wait<T: Send + 'static>(f: impl FnOnce(Box<dyn FnOnce(T) + Send>)) -> T {
        let (tx, rx) = mpsc::channel();
        f(Box::new(move |v| {
            let _ = tx.send(v);
        }));
        rx.recv_timeout(std::time::Duration::from_secs(20))
            .expect("the request completes")
    }

    fn read(e: &Arc<Engine>, first: u64, count: u64) -> Result<Vec<u8>, IoError> {
        let pieces = wait(|d| e.read(first, count, d))?;
        let mut out = Vec::new();
        for p in pieces {
            match p {
                Piece::Data(d) => out.extend_from_slice(&d),
                Piece::Hole(n) => out.resize(out.len() + n as usize * BLOCK, 0),
            }
        }
        Ok(out)
    }

    fn write(e: &Arc<Engine>, first: u64, data: Vec<u8>) -> Result<(), IoError> {
        let n = (data.len() / BLOCK) as u64;
        wait(|d| e.write(first, Arc::new(data), 0, n, d))
    }

    fn pattern(first: u64, count: u64, salt: u8) -> Vec<u8> {
        (0..count as usize * BLOCK)
            .map(|i| (i as u64 / 7 + first * 13) as u8 ^ salt)
            .collect()
    }

    #[test]
    fn writes_read_back_across_servers_and_holes_stay_holes() {
        let secret = Secret::generate();
        let (a, _sa) = server(&secret, 256);
        let (b, _sb) = server(&secret, 256);
        // 2 servers, linear: 100 blocks on the first, the rest on the second.
        let e = Engine::start(Arc::new(Shared {
            t: Translator::new(&[100, 256], 200, None, false).unwrap(),
            region: 0x7e57,
            servers: vec![a, b],
            secret: secret.clone(),
            down: vec![AtomicBool::new(false), AtomicBool::new(false)],
            written: Written::new(200),
            client_name: "engine-test".into(),
        }));
        // A write across the boundary, bigger than a frame.
        write(&e, 80, pattern(80, 60, 1)).unwrap();
        assert_eq!(read(&e, 80, 60).unwrap(), pattern(80, 60, 1));
        let pieces = wait(|d| e.read(0, 200, d)).unwrap();
        let holes: u64 = pieces
            .iter()
            .map(|p| if let Piece::Hole(n) = p { *n } else { 0 })
            .sum();
        // Runs (at most 32 blocks, split at the server boundary at 100)
        // with no written block are holes: 0-31, 32-63 and 164-199.
        assert_eq!(holes, 100, "never-written runs come back as holes");
        wait(|d| e.trim(90, 10, d)).unwrap();
        let r = read(&e, 80, 60).unwrap();
        assert!(r[10 * BLOCK..20 * BLOCK].iter().all(|b| *b == 0));
        assert_eq!(r[..10 * BLOCK], pattern(80, 60, 1)[..10 * BLOCK]);
    }

    #[test]
    fn many_requests_in_flight_complete_and_the_last_write_wins() {
        let secret = Secret::generate();
        let (a, _sa) = server(&secret, 1024);
        let (b, _sb) = server(&secret, 1024);
        let e = device(&[a, b], &secret, 256, true);
        // 64 writes in flight at once, the same 8 blocks rewritten by each
        // in turn: every copy must end with the last one enqueued.
        let (tx, rx) = mpsc::channel();
        for k in 0..64u8 {
            let tx = tx.clone();
            e.write(8, Arc::new(pattern(8, 8, k)), 0, 8, move |r| {
                tx.send(r).unwrap();
            });
        }
        for _ in 0..64 {
            rx.recv_timeout(std::time::Duration::from_secs(20))
                .unwrap()
                .unwrap();
        }
        assert_eq!(read(&e, 8, 8).unwrap(), pattern(8, 8, 63));
        // Both copies hold it: with the first server down, the mirror answers.
        e.sh.down[0].store(true, Relaxed);
        assert_eq!(read(&e, 8, 8).unwrap(), pattern(8, 8, 63));
    }

    #[test]
    fn a_lost_copy_is_read_from_the_mirror_and_a_lost_block_is_an_error() {
        let secret = Secret::generate();
        let (a, sa) = server(&secret, 1024);
        let (b, sb) = server(&secret, 1024);
        let e = device(&[a, b], &secret, 64, true);
        write(&e, 0, pattern(0, 32, 9)).unwrap();
        // The first copy's server forgets the region (as after a restart).
        sa.store.delete(0x7e57, None);
        assert_eq!(read(&e, 0, 32).unwrap(), pattern(0, 32, 9));
        assert!(
            e.sh.down[0].load(Relaxed),
            "the server that lost blocks is down"
        );
        // Then the second's: no copy holds the blocks any more.
        sb.store.delete(0x7e57, None);
        assert!(matches!(read(&e, 0, 32), Err(IoError::Lost(_))));
    }
}
