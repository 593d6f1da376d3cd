//! Replicas: a server's death, and re-replication.
//!
//! With two replicas every remote page is on two servers (`state` names the
//! one pages are read from, `LocationDb::second` its mirror). A server is
//! *down* once its connection is gone and cannot be made again within a
//! short patience, or it answers as another server (restarted empty: its
//! id changed). Then [`LocationDb::server_lost`] points every page it served
//! at its mirror, GETs in flight on it are woken to fault again (and read
//! from the mirror), and re-replication copies every page left with one
//! copy to another server, under a bandwidth limit, on its own connections
//! (so GET replies on the fault path never queue behind it). The copy is a
//! PUSH: the server holding the surviving copy stores it on the new one
//! itself, so the data crosses one link, not two, and not this host's CPU
//! (relayed through the pager, restoring 1 GiB took 2.5x a PUT stream of
//! it on this machine's loopback; a server without PUSH still gets the
//! relay).
//!
//! A page whose every copy is gone ends the guest loudly, naming the
//! servers; it never reads zeros.

use super::*;
use std::collections::HashMap;

/// Pages re-replication copies per step (the fault loop runs between
/// steps, so a fault waits at most one step: ~8 ms at 1 GB/s). Nothing
/// else runs during a step, so no page-in or page-out can race a copy.
const STEP_PAGES: usize = 2048;
/// How long a replicated region tries to reconnect to a server that
/// dropped its connection before calling it down: its pages have a mirror,
/// and the pager serves no fault while it tries (a server killed refuses
/// at once; one restarted empty is down anyway).
pub(super) const REPLICA_PATIENCE: Duration = Duration::from_millis(20);
/// How long one read or write on a replicated region's server connection
/// waits at most (a connect or HELLO to a server that accepted and then
/// hung; requests are hedged long before, see [`Health`]).
pub(super) const REPLICA_IO_TIMEOUT: Duration = Duration::from_secs(5);
/// A faulting page's reply is late, and its server suspect, after this
/// many times the server's usual reply time...
const HEDGE_FACTOR: f64 = 50.0;
/// ...but never before this (a busy 2-CPU host delays a healthy server's
/// replies by a scheduler slice or two: ~10 ms here under load; 250 ms
/// is 25 of them)...
const HEDGE_MIN: Duration = Duration::from_millis(250);
/// ...and always after this (a stopped server's guest waits no longer).
const HEDGE_MAX: Duration = Duration::from_millis(800);
/// A page-out frame's send or ack waited on for this long: the server hangs
/// (a 64-page frame takes ~1 ms on loopback, ~3 ms on 1 GbE).
const PUT_DEADLINE: Duration = Duration::from_millis(800);
/// How often a server called down is asked whether it answers again.
const PROBE_EVERY: Duration = Duration::from_secs(2);
/// How long a probe waits to connect and for the server's HELLO.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// Most bytes of bandwidth credit re-replication saves up (two steps).
const BURST: f64 = (2 * STEP_PAGES * PAGE) as f64;

/// Replicas of remote pages: how many, re-replication after a server's
/// death, and the health of each server.
pub(super) struct Replication {
    /// Copies of every remote page (1 or 2).
    copies: usize,
    /// Re-replication after a server's death.
    rerep: Rerep,
    /// Hung servers (deadlines) and revival of servers called down.
    health: Health,
}

impl Replication {
    pub fn new(copies: usize, rerep: Rerep, servers: usize) -> Self {
        Replication {
            copies,
            rerep,
            health: Health::new(servers),
        }
    }

    /// Copies of every remote page (1 or 2).
    pub fn copies(&self) -> usize {
        self.copies
    }

    /// A server joined the region (an evacuation's target).
    pub fn add_server(&mut self) {
        self.health.add_server();
        self.rerep.orphans.push(Vec::new());
    }

    /// Some page may have fewer copies than wanted: look for it.
    pub fn degraded(&mut self) {
        self.rerep.active = true;
    }

    /// Page `q`'s copy on server `m` is stale room, to delete before
    /// anything is stored there again.
    pub fn orphan(&mut self, m: usize, q: u64) {
        self.rerep.orphans[m].push(q);
    }

    /// Whether server `s` holds stale copies still to delete.
    pub fn has_orphans(&self, s: usize) -> bool {
        !self.rerep.orphans[s].is_empty()
    }

    /// Server `s` answered a faulting page's GET after `us` µs.
    pub fn replied(&mut self, s: usize, us: f64) {
        self.health.replied(s, us);
    }

    /// Re-replication has work it can do now.
    pub fn ready(&self) -> bool {
        self.rerep.ready()
    }

    /// A page-out found no server for a second copy: say so once.
    pub fn single_copy(&mut self, addrs: &[String], down: &[bool]) {
        self.rerep.single_copy(addrs, down);
    }

    /// A page got its mirror back (a page-out with two copies).
    pub fn mirrors_back(&mut self) {
        self.rerep.mirrors_back();
    }
}

/// Re-replication's state.
pub(super) struct Rerep {
    /// Bytes/s (0: unlimited).
    rate: u64,
    /// Bandwidth credit, bytes.
    tokens: f64,
    last: Instant,
    /// Where the scan for degraded pages stands.
    cursor: usize,
    /// Some page may have fewer copies than wanted.
    pub(super) active: bool,
    /// A page behind the cursor may have lost a copy during this pass:
    /// pass once more.
    again: bool,
    /// Look again after this (no server could take copies).
    retry_at: Option<Instant>,
    /// Connections for copying, per server.
    conns: HashMap<usize, Conn>,
    buf: Vec<u8>,
    /// Copies of pages paged in by a take (their mirror's copy is stale
    /// room), to delete, per server.
    pub(super) orphans: Vec<Vec<u64>>,
    warned: bool,
    /// Pages left with one copy since the last count: count soon.
    count_due: bool,
    counted_at: Instant,
    /// Pages are leaving with one copy (no second server has room or is up).
    single: bool,
}

/// Degraded pages are counted (a scan of the location DB, ~0.2 ms per GiB
/// of guest) at most this often while page-outs keep leaving pages with
/// one copy.
const COUNT_EVERY: Duration = Duration::from_millis(250);
/// While some pages have one copy the count is refreshed this often.
const RECOUNT_EVERY: Duration = Duration::from_secs(1);

impl Rerep {
    pub(super) fn new(rate: u64, servers: usize) -> Rerep {
        Rerep {
            rate,
            tokens: BURST,
            last: Instant::now(),
            cursor: 0,
            active: false,
            again: false,
            retry_at: None,
            conns: HashMap::new(),
            buf: Vec::new(),
            orphans: vec![Vec::new(); servers],
            warned: false,
            count_due: false,
            counted_at: Instant::now(),
            single: false,
        }
    }

    /// Page-outs found no second server for their pages: they leave with
    /// one copy. Logged once per episode (until a mirror is found again).
    pub(super) fn single_copy(&mut self, addrs: &[String], down: &[bool]) {
        if !self.single {
            self.single = true;
            let gone: Vec<&str> = (0..addrs.len())
                .filter(|s| down[*s])
                .map(|s| addrs[s].as_str())
                .collect();
            warn!(
                "no second memory server is up with room (down: {}): pages leave with one copy (degraded) so the region keeps its budget; re-replication copies them once a server has room",
                if gone.is_empty() { "none, the others are full".to_string() } else { gone.join(", ") }
            );
        }
    }

    /// A mirror was found again for pages leaving.
    pub(super) fn mirrors_back(&mut self) {
        if std::mem::take(&mut self.single) {
            info!("page-outs have a second memory server again: new pages leave with two copies");
        }
    }

    /// Some pages may have lost a copy: scan every page again, now.
    pub(super) fn look_again(&mut self) {
        if self.active {
            // Finish this pass first (restarting it at every landing
            // page-out would rescan the pages copied already), then once more.
            self.again = true;
        } else {
            self.active = true;
            self.cursor = 0;
        }
        self.retry_at = None;
    }

    /// Whether a step would copy now (the fault loop then does not sleep).
    pub(super) fn ready(&self) -> bool {
        self.active && self.retry_at.is_none_or(|t| Instant::now() >= t)
    }
}

/// What the pager knows of its servers' health: how fast each answers,
/// which were called down, and the probes asking whether they are back.
///
/// A faulting page whose reply is later than [`Health::deadline`] (derived
/// from the server's usual reply time) makes its server *suspect*. If every
/// page that server holds has a live mirror, it is called down at once: its
/// GETs in flight are asked of the mirrors (hedged reads), it gets no more
/// page-outs, and the writer's socket to it is shut so a page-out blocked
/// on it returns. Every [`PROBE_EVERY`] a thread tries a fresh connection;
/// when one gets a HELLO the server is *revived*: the region's stale copies
/// there are deleted (same server id) or were lost already (restarted
/// empty: a new id), and the server takes page-outs and re-replicated
/// copies again. A suspect server holding some page's only copy is not
/// called down (that would end the guest): its requests are waited for.
pub(super) struct Health {
    /// Per server: its faulting pages' usual reply time, µs (EWMA).
    usual_us: Vec<f64>,
    /// Per server: when to probe it next (only while down).
    probe_at: Vec<Option<Instant>>,
    /// Per server: a probe is out.
    probing: Vec<bool>,
    /// Probes' answers: (server, a fresh connection or why not).
    answers: std::sync::mpsc::Receiver<(usize, Result<Conn, pagefleet_client::ClientError>)>,
    answer_tx: std::sync::mpsc::Sender<(usize, Result<Conn, pagefleet_client::ClientError>)>,
    /// A suspect server was kept (sole copies): said once per episode.
    kept_warned: Vec<bool>,
}

impl Health {
    pub(super) fn new(servers: usize) -> Health {
        let (answer_tx, answers) = std::sync::mpsc::channel();
        Health {
            usual_us: vec![0.0; servers],
            probe_at: vec![None; servers],
            probing: vec![false; servers],
            answers,
            answer_tx,
            kept_warned: vec![false; servers],
        }
    }

    pub(super) fn add_server(&mut self) {
        self.usual_us.push(0.0);
        self.probe_at.push(None);
        self.probing.push(false);
        self.kept_warned.push(false);
    }

    /// A faulting page's reply from `s` took `us`.
    pub(super) fn replied(&mut self, s: usize, us: f64) {
        if let Some(u) = self.usual_us.get_mut(s) {
            *u += (us - *u) / 16.0;
        }
    }

    /// How long a faulting page's GET to `s` may wait before it is hedged.
    pub(super) fn deadline(&self, s: usize) -> Duration {
        let usual = Duration::from_secs_f64(
            self.usual_us.get(s).copied().unwrap_or(0.0) * HEDGE_FACTOR / 1e6,
        );
        usual.clamp(HEDGE_MIN, HEDGE_MAX)
    }
}

/// The host part of `HOST:PORT` (replicas go to different hosts when they can).
fn host(addr: &str) -> &str {
    addr.rsplit_once(':').map_or(addr, |(h, _)| h)
}

impl Pager {
    /// A server for a page's other copy: live, not `avoid`, with room for
    /// `need` pages, on another host than `avoid` if any such has room;
    /// the most free room first.
    pub(super) fn pick_mirror(&self, avoid: usize, need: u64) -> Option<usize> {
        let ok =
            |s: &usize| *s != avoid && !self.servers.is_down(*s) && self.servers.room(*s) >= need;
        let other_host = (0..self.servers.len())
            .filter(ok)
            .filter(|s| host(self.servers.addr(*s)) != host(self.servers.addr(avoid)))
            .max_by_key(|s| self.servers.room(*s));
        other_host.or_else(|| {
            (0..self.servers.len())
                .filter(ok)
                .max_by_key(|s| self.servers.room(*s))
        })
    }

    /// The pager's connection to `s` reported bytes with nothing asked:
    /// if the server closed it, reconnect or call the server down.
    pub(super) fn check_idle(&mut self, s: usize) {
        if self.repl.copies < 2 || self.servers.is_down(s) || !self.servers.gets_mut(s).is_empty() {
            return;
        }
        if !self.servers.conn_mut(s).peer_closed() {
            return;
        }
        if let Err(e) = self.servers.reconnect(s) {
            self.server_down(s, &e);
        }
    }

    /// Hedging: a server whose oldest faulting GET is past its deadline,
    /// or on which the writer has been blocked past [`PUT_DEADLINE`], is
    /// suspect; it is called down (its GETs asked of their mirrors) if
    /// every page it holds has a live mirror. See [`Health`].
    pub(super) fn check_deadlines(&mut self) {
        if self.repl.copies < 2 {
            return;
        }
        let writer_wait = self.writer.links().waiting();
        for s in 0..self.servers.len() {
            if self.servers.is_down(s) {
                continue;
            }
            let deadline = self.repl.health.deadline(s);
            let late_get = self
                .servers
                .gets_mut(s)
                .iter()
                .find(|g| g.fault.is_some())
                .map(|g| g.since.elapsed())
                .filter(|w| *w > deadline);
            let late_put = writer_wait
                .filter(|(w, t)| *w == s && *t > PUT_DEADLINE)
                .map(|(_, t)| t);
            let Some(waited) = late_get.or(late_put) else {
                continue;
            };
            if late_put.is_none() {
                // Reply bytes waiting: the pager was slow to look, not the
                // server to answer.
                self.servers.conn_mut(s).note_readable();
                if self.servers.conn_mut(s).reply_ready() {
                    continue;
                }
            }
            let sole = self.loc.sole_copies(s);
            if sole > 0 {
                if !std::mem::replace(&mut self.repl.health.kept_warned[s], true) {
                    warn!(
                        "memory server {} has not answered for {} ms, but it holds the only copy of {sole} pages of region {:#x}: waiting for it",
                        self.servers.addr(s),
                        waited.as_millis(),
                        self.region_id
                    );
                }
                continue;
            }
            self.repl.health.kept_warned[s] = false;
            let hedged: u64 = self
                .servers
                .gets_mut(s)
                .iter()
                .filter(|g| g.fault.is_some())
                .map(|g| g.pages.len() as u64)
                .sum();
            self.shared.stats.hedged_reads.fetch_add(hedged, Relaxed);
            let why = pagefleet_client::ClientError::Unresponsive {
                addr: self.servers.addr(s).to_string(),
                waited_ms: waited.as_millis() as u64,
                usual_us: self.repl.health.usual_us[s] as u64,
            };
            self.server_down(s, &why);
        }
    }

    /// Probe servers called down, and revive those that answer.
    pub(super) fn revive_step(&mut self) {
        if self.repl.copies < 2 {
            return;
        }
        while let Ok((s, r)) = self.repl.health.answers.try_recv() {
            self.repl.health.probing[s] = false;
            match r {
                Ok(c) if self.servers.is_down(s) => self.revive(s, c),
                Ok(_) => {}
                Err(e) => debug!("memory server {} is still down: {e}", self.servers.addr(s)),
            }
        }
        let now = Instant::now();
        for s in 0..self.servers.len() {
            if !self.servers.is_down(s) || self.repl.health.probing[s] {
                continue;
            }
            let due = *self.repl.health.probe_at[s].get_or_insert(now + PROBE_EVERY);
            if now < due {
                continue;
            }
            let Some((addr, secret, opts)) = self.servers.probe(s, PROBE_TIMEOUT) else {
                return;
            };
            self.repl.health.probe_at[s] = Some(now + PROBE_EVERY);
            self.repl.health.probing[s] = true;
            let (tx, bell) = (self.repl.health.answer_tx.clone(), self.owner.doorbell());
            let spawned = std::thread::Builder::new()
                .name("pagefleet-probe".into())
                .spawn(move || {
                    let r = Conn::connect(&addr, &secret, &opts);
                    if tx.send((s, r)).is_ok() {
                        pagefleet_uffd::ring(&bell);
                    }
                });
            if spawned.is_err() {
                self.repl.health.probing[s] = false;
            }
        }
    }

    /// Server `s`, called down, answered a probe with `c`: delete what the
    /// region left there (stale since its pages were repointed) and use it
    /// again for page-outs and second copies.
    fn revive(&mut self, s: usize, mut c: Conn) {
        let restarted = c.info.server_id != self.servers.conn(s).info.server_id;
        match c.delete_region(self.region_id) {
            Ok(_) => {}
            Err(e) if e.code().is_some() => {}
            Err(e) => {
                debug!(
                    "memory server {} answered, then failed: {e}",
                    self.servers.addr(s)
                );
                return;
            }
        }
        let free = match c.stat(false) {
            Ok(st) => st.capacity_pages.saturating_sub(st.used_pages),
            Err(e) => {
                debug!(
                    "memory server {} answered, then failed: {e}",
                    self.servers.addr(s)
                );
                return;
            }
        };
        info!(
            "memory server {} answers again{}: region {:#x} uses it for page-outs and second copies",
            self.servers.addr(s),
            if restarted { " (restarted empty)" } else { "" },
            self.region_id
        );
        c.set_window(4);
        self.servers.replace(s, c);
        self.servers.set_down(s, false);
        self.servers.set_room(s, free);
        self.repl.health.probe_at[s] = None;
        self.repl.health.usual_us[s] = 0.0;
        self.writer.links().restore(s);
        if let Some(x) = self.shared.servers.lock().unwrap().get_mut(s) {
            x.1 = false;
        }
        let st = &self.shared.stats;
        st.servers_down.fetch_sub(1, Relaxed);
        st.servers_revived.fetch_add(1, Relaxed);
        self.repl.rerep.look_again();
        self.repl.rerep.retry_at = None;
        self.publish();
    }

    /// Server `s` is gone (or restarted empty): serve its pages from their
    /// mirrors and start re-replication. With one replica, or for a page
    /// with no other copy, the guest cannot go on.
    pub(super) fn server_down(&mut self, s: usize, why: &pagefleet_client::ClientError) {
        if self.servers.is_down(s) {
            return;
        }
        // No more page-outs to it; a writer blocked on it returns now.
        self.writer.links().cut(s);
        warn!(
            "memory server {} is down ({why}): region {:#x} reads its pages from their mirrors and re-replicates them",
            self.servers.addr(s), self.region_id
        );
        self.servers.set_down(s, true);
        self.servers.full(s);
        if let Some(x) = self.shared.servers.lock().unwrap().get_mut(s) {
            x.1 = true;
        }
        let gets = self.servers.take_gets(s);
        self.repoint(s, why);
        // Pages asked of it: fault again, and read from the mirror.
        for g in gets {
            for q in g.pages {
                let q = q as usize;
                if self.loc.out[q] == OUT_ARRIVING {
                    self.loc.out[q] = OUT_NONE;
                }
                self.wake(q);
            }
        }
        self.repl.rerep.orphans[s].clear();
        self.repl.rerep.conns.remove(&s);
        if let Some(ev) = self.evac.take() {
            if ev.from == s || ev.to == s {
                let _ = ev.reply.send(Err(format!(
                    "memory server {} went down during the evacuation ({} pages moved)",
                    self.servers.addr(s),
                    ev.moved
                )));
            } else {
                self.evac = Some(ev);
            }
        }
        self.copies_lost();
        // (After the count: a reader seeing the server down sees its
        // degraded pages too.)
        self.shared.stats.servers_down.fetch_add(1, Relaxed);
        self.shared.stats.server_failures.fetch_add(1, Relaxed);
        self.publish();
    }

    /// Point every page server `s` (down) held at its mirror; a page
    /// without one ends the guest, naming the servers gone.
    pub(super) fn repoint(&mut self, s: usize, why: &dyn std::fmt::Display) {
        let lost = self.loc.server_lost(s);
        if let Some(&p) = lost.first() {
            let gone: Vec<&str> = (0..self.servers.len())
                .filter(|x| self.servers.is_down(*x))
                .map(|x| self.servers.addr(x))
                .collect();
            let msg = format!(
                "pagefleet: page {p} of region {:#x} ({} pages in all) had no copy left: memory servers {} are gone ({why}). \
                 The guest cannot continue without its memory.",
                self.region_id,
                lost.len(),
                gone.join(", ")
            );
            self.publish();
            self.fatal(msg, p);
            // (Poisoning instead of exiting: every lost page is poisoned,
            // so no thread reads zeros or waits forever.)
            for q in lost {
                let _ = self.uffd.poison(self.addr(q), PAGE as u64);
            }
        }
    }

    /// Some pages may have fewer copies than wanted now: count them and
    /// let re-replication look again.
    pub(super) fn copies_lost(&mut self) {
        self.repl.rerep.look_again();
        if self.repl.rerep.counted_at.elapsed() >= COUNT_EVERY {
            self.count_degraded();
        } else {
            self.repl.rerep.count_due = true;
        }
    }

    /// Count remote pages with fewer copies than wanted (for the stats).
    fn count_degraded(&mut self) {
        self.repl.rerep.count_due = false;
        self.repl.rerep.counted_at = Instant::now();
        let n = if self.repl.copies < 2 {
            0
        } else {
            (0..self.loc.pages())
                .filter(|&q| self.loc.state[q] >= REMOTE && self.loc.replicas(q) < self.repl.copies)
                .count() as u64
        };
        self.shared.stats.degraded_pages.store(n, Relaxed);
    }

    /// A connection of re-replication's own to server `s`.
    fn rerep_conn(&mut self, s: usize) -> Result<&mut Conn, pagefleet_client::ClientError> {
        if !self.repl.rerep.conns.contains_key(&s) {
            let mut c = self
                .servers
                .connect_again(s, REPLICA_PATIENCE, REPLICA_IO_TIMEOUT)?;
            c.set_window(32);
            self.repl.rerep.conns.insert(s, c);
        }
        Ok(self.repl.rerep.conns.get_mut(&s).expect("inserted"))
    }

    /// Copy one step's worth of degraded pages to a new mirror, within
    /// the bandwidth limit; also delete orphaned copies.
    pub(super) fn rereplicate_step(&mut self) {
        if self.repl.copies < 2 || self.owner.held() {
            return;
        }
        // Due after a loss; while pages have one copy, also refreshed every
        // RECOUNT_EVERY (pages paged back in leave the count).
        let age = self.repl.rerep.counted_at.elapsed();
        if (self.repl.rerep.count_due && age >= COUNT_EVERY)
            || (self.repl.rerep.active && age >= RECOUNT_EVERY)
        {
            self.count_degraded();
        }
        self.flush_orphans(false);
        if !self.repl.rerep.ready() {
            return;
        }
        let now = Instant::now();
        if self.repl.rerep.rate > 0 {
            let dt = now.duration_since(self.repl.rerep.last).as_secs_f64();
            self.repl.rerep.tokens =
                (self.repl.rerep.tokens + dt * self.repl.rerep.rate as f64).min(BURST);
        }
        self.repl.rerep.last = now;
        if self.repl.rerep.rate > 0 && self.repl.rerep.tokens < (STEP_PAGES * PAGE) as f64 {
            return;
        }
        // The next pages with one copy, by the server holding it: every such
        // server pushes at once. (A region's chunks alternate between
        // servers, so a step per run of one server's pages copied ~80 pages
        // per round trip: 1 GiB restored at 2.4–3.5x a PUT stream's time.)
        let n = self.loc.pages();
        let mut by_src: Vec<(usize, Vec<u64>)> = Vec::new();
        while self.repl.rerep.cursor < n && by_src.iter().all(|(_, l)| l.len() < STEP_PAGES) {
            let q = self.repl.rerep.cursor;
            let st = self.loc.state[q];
            if st >= REMOTE && self.loc.second[q] == 0 && self.loc.out[q] == OUT_NONE {
                let s = (st - REMOTE) as usize;
                match by_src.iter_mut().find(|(x, _)| *x == s) {
                    Some((_, l)) => l.push(q as u64),
                    None => by_src.push((s, vec![q as u64])),
                }
            }
            self.repl.rerep.cursor += 1;
        }
        if by_src.is_empty() {
            // A full pass found none: done (pages that were arriving are
            // caught by the next pass if they leave again with one copy).
            self.repl.rerep.cursor = 0;
            if std::mem::take(&mut self.repl.rerep.again) {
                return;
            }
            self.repl.rerep.active = false;
            self.count_degraded();
            return;
        }
        // A new mirror for each source's pages (its room taken now, so two
        // sources do not both count on the same room).
        let mut copies = Vec::with_capacity(by_src.len());
        let mut no_room = Vec::new();
        for (s, list) in by_src {
            match self.pick_mirror(s, list.len() as u64) {
                Some(t) => {
                    self.servers.took(t, list.len() as u64);
                    copies.push((s, t, list));
                }
                None => no_room.push(list[0]),
            }
        }
        if copies.is_empty() {
            if !self.repl.rerep.warned {
                warn!(
                    "region {:#x}: no live memory server has room for second copies; pages stay single until one does",
                    self.region_id
                );
                self.repl.rerep.warned = true;
            }
            self.repl.rerep.cursor = 0;
            self.repl.rerep.retry_at = Some(now + Duration::from_secs(5));
            return;
        }
        let t0 = Instant::now();
        let sent: Vec<_> = copies
            .iter()
            .map(|(s, t, list)| self.start_copy(*s, *t, list))
            .collect();
        // Every reply read before any failure is acted on (calling a server
        // down drops connections another copy still reads from).
        let done: Vec<_> = copies
            .iter()
            .zip(sent)
            .map(|((s, t, list), sent)| self.finish_copy(*s, *t, list, sent))
            .collect();
        let mut again = no_room.into_iter().min();
        for ((_, t, list), r) in copies.into_iter().zip(done) {
            match r {
                Ok(()) => {
                    for &q in &list {
                        self.loc.second[q as usize] = t as u8 + 1;
                    }
                    let st = &self.shared.stats;
                    st.rereplicated_pages.fetch_add(list.len() as u64, Relaxed);
                    st.degraded_pages
                        .fetch_update(Relaxed, Relaxed, |d| {
                            Some(d.saturating_sub(list.len() as u64))
                        })
                        .ok();
                    self.repl.rerep.tokens -= (list.len() * PAGE) as f64;
                }
                Err((bad, e)) => {
                    self.servers.freed(t, list.len() as u64);
                    self.repl.rerep.conns.remove(&bad);
                    if e.code() == Some(pagefleet_proto::ErrorCode::OutOfCapacity) {
                        self.servers.full(bad);
                    } else {
                        self.server_down(bad, &e);
                    }
                    again = Some(again.map_or(list[0], |a| a.min(list[0])));
                }
            }
        }
        // Look at the pages not copied again.
        if let Some(q) = again {
            self.repl.rerep.cursor = q as usize;
        }
        self.meter.page_out(t0);
    }

    /// Ask `s` to push `list` to `t` (the replies are read by
    /// [`Pager::finish_copy`]).
    fn start_copy(
        &mut self,
        s: usize,
        t: usize,
        list: &[u64],
    ) -> Result<pagefleet_client::PushIds, pagefleet_client::ClientError> {
        let region = self.region_id;
        let (tid, taddr) = (
            self.servers.conn(t).info.server_id,
            self.servers.addr(t).to_string(),
        );
        self.rerep_conn(s)
            .and_then(|c| c.send_push(region, tid, &taddr, list))
    }

    /// `s`'s answer to a push of `list` to `t`; a server without PUSH gets
    /// the pages relayed through here, each GET reply sent on as a PUT as
    /// soon as it is in. Err names the server that failed.
    fn finish_copy(
        &mut self,
        s: usize,
        t: usize,
        list: &[u64],
        sent: Result<pagefleet_client::PushIds, pagefleet_client::ClientError>,
    ) -> Result<(), (usize, pagefleet_client::ClientError)> {
        let region = self.region_id;
        let taddr = self.servers.addr(t).to_string();
        let pushed = sent.and_then(|ids| match self.repl.rerep.conns.get_mut(&s) {
            Some(c) => c.recv_push(ids),
            None => Err(pagefleet_client::ClientError::Usage(
                "re-replication's connection is gone".into(),
            )),
        });
        match pushed {
            Ok(_) => return Ok(()),
            Err(e) if e.code() == Some(pagefleet_proto::ErrorCode::UnknownOpcode) => {}
            Err(e) if e.code() == Some(pagefleet_proto::ErrorCode::PeerFailed) => {
                // The new server failed: dead, or only full (or unreachable
                // from there)? Ask it.
                let alive = self.rerep_conn(t).and_then(|c| c.ping()).is_ok();
                if alive {
                    warn!(
                        "re-replication: {e}; not using {} for copies",
                        self.servers.addr(t)
                    );
                    return Err((
                        t,
                        pagefleet_client::ClientError::Server {
                            addr: taddr,
                            err: pagefleet_proto::WireError::new(
                                pagefleet_proto::ErrorCode::OutOfCapacity,
                                e.to_string(),
                            ),
                        },
                    ));
                }
                return Err((t, e));
            }
            Err(e) => return Err((s, e)),
        }
        // A server without PUSH: relay the pages through here.
        self.rerep_conn(t).map_err(|e| (t, e))?;
        let mut buf = std::mem::take(&mut self.repl.rerep.buf);
        buf.resize(list.len() * PAGE, 0);
        let mut src = self.repl.rerep.conns.remove(&s).expect("connected");
        let mut dst = self.repl.rerep.conns.remove(&t).expect("connected");
        let r = relay(&mut src, &mut dst, region, list, &mut buf);
        self.repl.rerep.conns.insert(s, src);
        self.repl.rerep.conns.insert(t, dst);
        self.repl.rerep.buf = buf;
        r.map_err(|(from_src, e)| (if from_src { s } else { t }, e))
    }

    /// Delete orphaned copies (stale room on mirrors of pages a take
    /// brought in) where a server's list is long, or with `all` every one.
    pub(super) fn flush_orphans(&mut self, all: bool) {
        for s in 0..self.repl.rerep.orphans.len() {
            let len = self.repl.rerep.orphans[s].len();
            if len > 0 && (all || len >= pagefleet_proto::MAX_DELETE_LIST) {
                self.flush_orphans_on(s);
            }
        }
    }

    /// Delete the orphaned copies on server `s` now.
    pub(super) fn flush_orphans_on(&mut self, s: usize) {
        let list = std::mem::take(&mut self.repl.rerep.orphans[s]);
        if list.is_empty() || self.servers.is_down(s) {
            return;
        }
        let region = self.region_id;
        let r = self
            .rerep_conn(s)
            .and_then(|c| c.delete(region, Pages::List(&list)));
        match r {
            Ok(_) => self.servers.freed(s, list.len() as u64),
            Err(e) => {
                self.repl.rerep.conns.remove(&s);
                self.server_down(s, &e);
            }
        }
    }
}

/// GET `list` (keep) from `src` and PUT each frame on `dst` as soon as it is
/// in; Err says whether the source (true) or the destination failed.
fn relay(
    src: &mut Conn,
    dst: &mut Conn,
    region: u64,
    list: &[u64],
    buf: &mut [u8],
) -> Result<(), (bool, pagefleet_client::ClientError)> {
    let frames: Vec<&[u64]> = list.chunks(MAX_BATCH_PAGES).collect();
    let mut gets = Vec::with_capacity(frames.len());
    for f in &frames {
        let id = src
            .queue_get(region, &PageSel::List(f.to_vec()), GetMode::Keep, false)
            .map_err(|e| (true, e))?;
        gets.push(id);
    }
    src.flush().map_err(|e| (true, e))?;
    let mut puts = Vec::with_capacity(frames.len());
    let mut at = 0;
    for (f, id) in frames.iter().zip(gets) {
        let part = &mut buf[at..at + f.len() * PAGE];
        src.recv_get(id, part).map_err(|e| (true, e))?;
        let id = dst
            .send_put(region, &PageSel::List(f.to_vec()), part)
            .map_err(|e| (false, e))?;
        puts.push(id);
        at += f.len() * PAGE;
    }
    for id in puts {
        dst.recv_put(id).map_err(|e| (false, e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deadline_follows_the_servers_usual_replies_within_its_bounds() {
        let mut h = Health::new(2);
        // Nothing measured yet: the floor.
        assert_eq!(h.deadline(0), HEDGE_MIN);
        // Fast replies (100 µs): still the floor, not 5 ms.
        for _ in 0..64 {
            h.replied(0, 100.0);
        }
        assert_eq!(h.deadline(0), HEDGE_MIN);
        // A slow link (10 ms a reply): 50x that.
        for _ in 0..256 {
            h.replied(1, 10_000.0);
        }
        let d = h.deadline(1);
        assert!(d > HEDGE_MIN && d < HEDGE_MAX, "{d:?}");
        assert!((d.as_secs_f64() - 0.5).abs() < 0.01, "{d:?}");
        // Replies that take seconds never push the deadline past the cap.
        for _ in 0..256 {
            h.replied(1, 5e6);
        }
        assert_eq!(h.deadline(1), HEDGE_MAX);
        // One server's replies leave the other's deadline alone.
        assert_eq!(h.deadline(0), HEDGE_MIN);
        // A server added later starts at the floor; unknown ones too.
        h.add_server();
        assert_eq!(h.deadline(2), HEDGE_MIN);
        assert_eq!(h.deadline(9), HEDGE_MIN);
    }
}
