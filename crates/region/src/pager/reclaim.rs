//! Reclaim: keeping resident pages within the budget (victim choice, page-out).

use super::*;

/// How long a wait for the writer lasts before the deadlines are checked
/// again (a hung server is cut off within a slice of its deadline).
const DEADLINE_SLICE: Duration = Duration::from_millis(10);

/// Reclaim's own state: where the victim search stands and whether the
/// pager is between the watermarks.
pub(super) struct Reclaim {
    /// The victim hand and its policy.
    victims: victims::Victims,
    /// When the victim hand last chose victims.
    victims_at: Option<Instant>,
    /// Between the high and low watermarks: keep evicting.
    evicting: bool,
    /// Where `drop_copies` looks next.
    copy_hand: usize,
    /// Said once that every server is full.
    full_warned: bool,
}

impl Reclaim {
    pub fn new(victims: victims::Victims) -> Self {
        Reclaim {
            victims,
            victims_at: None,
            evicting: false,
            copy_hand: 0,
            full_warned: false,
        }
    }

    /// Between the watermarks: more page-out to start.
    pub fn evicting(&self) -> bool {
        self.evicting
    }

    /// Stop evicting (a hold: what is in flight lands, nothing new goes).
    pub fn stop(&mut self) {
        self.evicting = false;
    }

    /// A page of chunk `c` came in ([`victims::Victims::arrived`]).
    pub fn arrived(&mut self, c: usize) {
        self.victims.arrived(c);
    }

    /// The sampling hand passes pages `lo..hi`: the policy ages them.
    pub fn sweep(&self, access: &mut AccessHistory, lo: usize, hi: usize) {
        self.victims.sweep(access, lo, hi);
    }

    /// Whether the sampling hand should rest now: the policy reads the
    /// page tables itself while choosing victims, and chose some within
    /// `quiet` of `now`.
    pub fn sampler_rests(&self, now: Instant, quiet: Duration) -> bool {
        self.victims.reads_refs_itself()
            && self
                .victims_at
                .is_some_and(|t| now.duration_since(t) < quiet)
    }
}

impl Pager {
    /// Over budget: page out cold chunks (chosen by [`victims`]) until a
    /// slack below it.
    ///
    /// Page-outs are jobs for the writer thread: between the watermarks
    /// this returns at once and faults go on being served while victims are
    /// sent. Only when resident memory is over the budget itself does the
    /// pager wait for jobs to land (direct reclaim, counted in the stats).
    pub(super) fn balance(&mut self) {
        self.balance_round();
        // Pages brought in before this round may go in the next (a page is
        // not evicted by the round its own arrival started).
        self.reclaim.victims.round_done();
    }

    fn balance_round(&mut self) {
        let budget = self.shared.budget.load(Relaxed);
        if self.owner.held() || self.loc.state.len() as u64 <= budget {
            self.reclaim.evicting = false;
            return;
        }
        // Watermarks on the pages that stay once the jobs in flight land:
        // start half a slack below the budget, stop a slack below it.
        let slack = crate::paging_slack(budget, self.cp);
        let high = budget.saturating_sub(slack / 2);
        let low = budget.saturating_sub(slack);
        if self.loc.staying() > high {
            self.reclaim.evicting = true;
        }
        let (t0, evicted) = (Instant::now(), self.reclaim.evicting);
        while self.reclaim.evicting && self.writer.in_flight() < MAX_JOBS {
            let staying = self.loc.staying();
            if staying <= low {
                self.reclaim.evicting = false;
                break;
            }
            // Far over: bigger jobs (fewer round trips to catch up).
            let cap = if staying > budget { 512 } else { 64 };
            let chunks = self.chunks();
            let mut probe = self.refs.probe(self.guest.base(), self.cp, chunks);
            let batch =
                self.reclaim
                    .victims
                    .batch(&self.loc, &mut self.access, &mut probe, low, cap);
            // Spared chunks are unmapped again (with the sampler's next
            // tick: one TLB shootdown per run per tick, not per batch).
            self.sampler.spared(&self.reclaim.victims.spared);
            self.reclaim.victims_at = Some(Instant::now());
            if batch.is_empty() || !self.page_out(batch) {
                self.reclaim.evicting = false;
                break;
            }
        }
        if evicted {
            self.meter.page_out(t0);
        }
        // Direct reclaim: memory itself is over the budget; faults wait
        // until enough of what is in flight has landed.
        if self.loc.resident > budget && self.writer.in_flight() > 0 {
            let t0 = Instant::now();
            while self.loc.resident > budget && self.writer.in_flight() > 0 {
                // In slices: a writer blocked on a hung server is cut off
                // by the deadline check (it then answers at once).
                match self.writer.wait_done(DEADLINE_SLICE) {
                    Some(d) => self.job_landed(d),
                    None => self.check_deadlines(),
                }
            }
            let st = &self.shared.stats;
            st.direct_reclaims.fetch_add(1, Relaxed);
            st.direct_reclaim_ns
                .fetch_add(t0.elapsed().as_nanos() as u64, Relaxed);
        }
        self.publish();
    }

    /// Take in every page-out job the writer has finished.
    pub(super) fn reap(&mut self) {
        while let Some(d) = self.writer.try_done() {
            self.job_landed(d);
        }
    }

    /// Wait until no page-in or page-out is in flight (before anything that
    /// moves or deletes server copies, or a migration's final copy).
    pub(super) fn quiesce(&mut self) {
        self.drain_gets();
        while self.writer.in_flight() > 0 {
            match self.writer.wait_done(DEADLINE_SLICE) {
                Some(d) => self.job_landed(d),
                None => self.check_deadlines(),
            }
        }
    }

    /// Start paging out these resident pages (sorted). Clean pages (their
    /// kept copy is current) go in a drop job: the writer punches them,
    /// nothing is sent ([`Pager::drop_landed`]). Dirty ones are
    /// write-protected, marked leaving and handed to the writer, bound for
    /// the server that keeps their copy or, without one, the server with the
    /// most free room; the writer punches them once stored and
    /// [`Pager::job_landed`] marks them remote.
    /// Returns false if no server can take them (balancing stops; the guest
    /// keeps running over budget).
    pub(super) fn page_out(&mut self, pages: Vec<usize>) -> bool {
        let cp = self.cp;
        // Chunks paged out from, for the stats (`pages` is sorted).
        let chunks = pages
            .iter()
            .enumerate()
            .filter(|(i, q)| *i == 0 || pages[i - 1] / cp != **q / cp)
            .count();
        let fresh = |copy: &[u8], clean: &[bool]| {
            pages
                .iter()
                .filter(|q| copy[**q] == 0 && !clean[**q])
                .count() as u64
        };
        let pick = |free: &[u64], down: &[bool], new: u64| {
            (0..free.len())
                .filter(|s| free[*s] >= new && !down[*s])
                .max_by_key(|s| free[*s])
        };
        let mut new = fresh(&self.loc.copy, &self.loc.clean);
        let mut chosen = pick(self.servers.rooms(), self.servers.downs(), new);
        if chosen.is_none() && new > 0 && self.loc.copies.iter().any(|c| *c > 0) {
            // Room held by kept copies of resident pages is worth less
            // than room for pages that must leave: give it back.
            if !self.drop_copies(None, new.max(64)) {
                return false;
            }
            new = fresh(&self.loc.copy, &self.loc.clean);
            chosen = pick(self.servers.rooms(), self.servers.downs(), new);
        }
        let Some(s) = chosen.or(if new == 0 { Some(0) } else { None }) else {
            if !self.reclaim.full_warned {
                warn!("every memory server is full: the region stays over its budget");
                self.reclaim.full_warned = true;
            }
            return false;
        };
        // Clean pages: the server's copy is the page; dropping it is local,
        // and the writer does it. (They are write-protected since their
        // page-in: a fault on one, read after its punch or write, waits
        // for the job and then finds the page remote, so it pages back in.)
        // (With two replicas a page is clean only with both copies kept.)
        let whole = |q: usize| self.repl.copies() < 2 || self.loc.second[q] > 0;
        let (clean, dirty): (Vec<usize>, Vec<usize>) = pages
            .into_iter()
            .partition(|q| self.loc.clean[*q] && whole(*q));
        if !clean.is_empty() {
            for &q in &clean {
                self.loc.set_dropping(q);
            }
            self.writer.submit(writer::Job {
                targets: Vec::new(),
                pages: clean.iter().map(|q| *q as u64).collect(),
                drop: true,
            });
        }
        // With two replicas, a mirror for pages without a second copy.
        let need2 = if self.repl.copies() < 2 {
            0
        } else {
            dirty.iter().filter(|q| self.loc.second[**q] == 0).count() as u64
        };
        // No live server with room for the second copies: the pages leave
        // with one copy (degraded: counted, shown, re-replicated once a
        // server has room again) rather than staying — the budget is what
        // keeps this host out of the OOM killer.
        let m = if need2 > 0 {
            let m = self.pick_mirror(s, need2);
            match m {
                Some(_) => self.repl.mirrors_back(),
                None => self
                    .repl
                    .single_copy(self.servers.addrs(), self.servers.downs()),
            }
            m
        } else {
            None
        };
        // Dirty pages: one job per destination (server, mirror).
        let mut jobs: Vec<(Dest, Vec<u64>)> = Vec::new();
        // Pages with no mirror to go to stay resident (not in a job).
        let mut unplaced = Vec::new();
        for &q in &dirty {
            let t = match self.loc.copy[q] {
                0 => s,
                c => c as usize - 1,
            };
            let t2 = match (self.repl.copies(), self.loc.second[q]) {
                (1, _) => None,
                (_, 0) => match m {
                    Some(m) if m != t => Some(m),
                    // Its kept copy is on the chosen mirror: pair it with
                    // the chosen primary instead.
                    _ if s != t => Some(s),
                    _ => self.pick_mirror(t, 1),
                },
                (_, c) => Some(c as usize - 1),
            };
            // A second copy on the page's own server is no copy at all.
            if self.repl.copies() > 1 && t2 == Some(t) {
                unplaced.push(q);
                continue;
            }
            match jobs.iter_mut().find(|(jt, _)| *jt == (t, t2)) {
                Some((_, list)) => list.push(q as u64),
                None => jobs.push(((t, t2), vec![q as u64])),
            }
        }
        let dirty: Vec<usize> = if unplaced.is_empty() {
            dirty
        } else {
            dirty
                .into_iter()
                .filter(|q| !unplaced.contains(q))
                .collect()
        };
        // Write-protect before the writer reads: from here on a write
        // faults, and the fault keeps the page (see `dirtied`).
        for run in consecutive_runs(&dirty) {
            let first = dirty[run.start];
            if let Err(e) =
                self.uffd
                    .writeprotect(self.addr(first), (run.len() * PAGE) as u64, true)
            {
                self.internal(first, e.to_string());
                return false;
            }
        }
        for &q in &dirty {
            self.loc.set_leaving(q);
        }
        self.servers.took(s, new);
        if let Some(m) = m {
            self.servers.took(m, need2);
        }
        for ((t, t2), pages) in jobs {
            let mut targets = vec![self.target(t)];
            if let Some(t2) = t2 {
                targets.push(self.target(t2));
            }
            // Stale copies still to be deleted there go first: a delete
            // landing after this job's PUT would remove the new copy.
            for tg in &targets {
                if self.repl.has_orphans(tg.server) {
                    self.flush_orphans_on(tg.server);
                }
            }
            self.writer.submit(writer::Job {
                targets,
                pages,
                drop: false,
            });
        }
        self.shared
            .stats
            .page_out_chunks
            .fetch_add(chunks as u64, Relaxed);
        true
    }

    /// A page-out job came back: the pages every target stored were punched
    /// by the writer and are remote now; faults that waited on them retry
    /// and page back in. Pages not stored stay resident (and writable unless
    /// change tracking watches them).
    pub(super) fn job_landed(&mut self, d: writer::Done) {
        if d.drop {
            return self.drop_landed(d);
        }
        let t0 = Instant::now();
        // A target called down while the job was out (its death seen on
        // another connection first) holds nothing any more, whatever it
        // acknowledged. The pages count only their live copies.
        let live: Vec<usize> = d
            .servers
            .iter()
            .copied()
            .filter(|x| !self.servers.is_down(*x))
            .collect();
        let (t, t2) = (live.first().copied(), live.get(1).copied());
        let mut sent = 0u64;
        let mut lost = None;
        let mut stayed = Vec::new();
        for (&q, &ok) in d.pages.iter().zip(&d.stored) {
            let q = q as usize;
            self.loc.job_done(q);
            sent += ok as u64;
            match (ok, t) {
                (true, Some(t)) => self.left(q, t, t2),
                // Punched, and every server that stored it died meanwhile.
                (true, None) => lost = lost.or(Some(q)),
                (false, _) => stayed.push(q),
            }
        }
        if !self.changes.on() {
            for run in consecutive_runs(&stayed) {
                let first = stayed[run.start];
                if let Err(e) =
                    self.uffd
                        .writeprotect(self.addr(first), (run.len() * PAGE) as u64, false)
                {
                    self.internal(first, e.to_string());
                }
            }
        }
        if let Some(q) = lost {
            return self.lost_in_job(q);
        }
        if let Some(e) = d.punch_error {
            // Some stored pages may still hold data the location DB now
            // calls remote: nothing sane to go on with.
            return self.internal(d.pages[0] as usize, format!("punching stored pages: {e}"));
        }
        if let Some(e) = d.read_error {
            // The pages not sent stayed resident (and were unprotected
            // above), but the memfd cannot be read: page-out cannot work.
            return self.internal(
                d.pages[0] as usize,
                format!("reading pages to page out: {e}"),
            );
        }
        let st = &self.shared.stats;
        st.page_outs.fetch_add(sent, Relaxed);
        st.bytes_out.fetch_add(sent * PAGE as u64, Relaxed);
        // The writer's CPU for the job; the pager's share is metered.
        st.page_out_cpu_ns.fetch_add(d.cpu_ns, Relaxed);
        if live.len() < self.repl.copies() && sent > 0 {
            self.copies_lost();
        }
        self.wake_job_faults();
        self.meter.page_out(t0);
        for (t, e) in d.errors {
            if e.code() == Some(pagefleet_proto::ErrorCode::OutOfCapacity) {
                debug!("memory server {} is full", self.servers.addr(t));
                self.servers.full(t);
            } else if self.repl.copies() > 1 {
                // Its pages were not stored (they stay here); the other
                // copies it held are served by their mirrors.
                self.server_down(t, &e);
            } else {
                let msg = format!(
                    "pagefleet: cannot page out to memory server {} (region {:#x}): {e}. The server is unusable; \
                     pages already there cannot be trusted to come back.",
                    self.servers.addr(t), self.region_id
                );
                self.fatal(msg, d.pages[0] as usize);
            }
        }
        self.publish();
    }

    /// A drop job came back: its pages are remote now (their kept copies
    /// are the pages); faults that waited on them retry and page back in.
    pub(super) fn drop_landed(&mut self, d: writer::Done) {
        let t0 = Instant::now();
        for &q in &d.pages {
            let q = q as usize;
            self.loc.job_done(q);
            if self.loc.copy[q] == 0 {
                // Its server died while the punch ran: no copy anywhere.
                return self.lost_in_job(q);
            }
            let t = self.loc.copy[q] as usize - 1;
            let t2 = self.loc.second[q].checked_sub(1).map(usize::from);
            self.left(q, t, t2);
        }
        if let Some(e) = d.punch_error {
            // Some of the pages may still hold data the location DB now
            // calls remote: nothing sane to go on with.
            return self.internal(d.pages[0] as usize, format!("punching clean pages: {e}"));
        }
        let st = &self.shared.stats;
        st.clean_drops.fetch_add(d.pages.len() as u64, Relaxed);
        st.page_out_cpu_ns.fetch_add(d.cpu_ns, Relaxed);
        self.wake_job_faults();
        self.meter.page_out(t0);
        self.publish();
    }

    /// Wake the threads whose faults waited for a job that has landed.
    fn wake_job_faults(&mut self) {
        let loc = &self.loc;
        for p in self.faults.landed(|p| loc.in_job(p)) {
            self.wake(p);
        }
    }

    /// Resident page `q` is on server `t` (and mirror `t2`) now (its data
    /// punched out here).
    fn left(&mut self, q: usize, t: usize, t2: Option<usize>) {
        self.mark(q);
        self.loc.set_remote(q, t, t2);
        self.access.evicted(q);
    }

    /// A page was punched while the servers holding its copies died: it
    /// is gone.
    fn lost_in_job(&mut self, q: usize) {
        let gone: Vec<&str> = (0..self.servers.len())
            .filter(|x| self.servers.is_down(*x))
            .map(|x| self.servers.addr(x))
            .collect();
        let msg = format!(
            "pagefleet: page {q} of region {:#x} had no copy left after memory servers {} went down. \
             The guest cannot continue without its memory.",
            self.region_id,
            gone.join(", ")
        );
        self.fatal(msg, q);
    }

    /// Where a job for server `t` goes.
    fn target(&self, t: usize) -> writer::Target {
        writer::Target {
            server: t,
            addr: self.servers.addr(t).to_string(),
            server_id: self.servers.conn(t).info.server_id,
        }
    }

    /// Delete kept copies of resident pages (on server `only`, or on any),
    /// at most `max` of them; their pages become plain resident (dirty).
    /// Returns false if a server could not be told (the guest is ended).
    pub(super) fn drop_copies(&mut self, only: Option<usize>, max: u64) -> bool {
        let mut lists: Vec<Vec<u64>> = vec![Vec::new(); self.servers.len()];
        let mut n = 0u64;
        // A hand, so repeated small calls do not rescan the same pages.
        let len = self.loc.copy.len();
        for i in 0..len {
            if n >= max {
                self.reclaim.copy_hand = (self.reclaim.copy_hand + i) % len;
                break;
            }
            let q = (self.reclaim.copy_hand + i) % len;
            let (c, c2) = (self.loc.copy[q], self.loc.second[q]);
            // A page in a page-out job keeps its slot: the PUT in flight
            // (on the writer's connection) could land after a delete.
            if self.loc.state[q] != LOCAL || (c == 0 && c2 == 0) || self.loc.out[q] != OUT_NONE {
                continue;
            }
            let hit = |x: u8| x > 0 && only.is_none_or(|o| o + 1 == x as usize);
            if !hit(c) && !hit(c2) {
                continue;
            }
            // Both copies go (a lone second copy is no use as a kept copy).
            if let Some(s) = self.loc.forget_copy(q) {
                lists[s].push(q as u64);
            }
            if let Some(s) = self.loc.forget_second(q) {
                lists[s].push(q as u64);
            }
            n += 1;
        }
        let region = self.region_id;
        for (s, list) in lists.into_iter().enumerate() {
            if list.is_empty() || self.servers.is_down(s) {
                continue;
            }
            for part in list.chunks(pagefleet_proto::MAX_DELETE_LIST) {
                // Replies on this connection come in order: the GETs in
                // flight first.
                self.take_replies(s, true);
                let mut r = self.servers.conn_mut(s).delete(region, Pages::List(part));
                if r.as_ref().is_err_and(|e| e.is_transient()) && self.servers.reconnect(s).is_ok()
                {
                    r = self.servers.conn_mut(s).delete(region, Pages::List(part));
                }
                if let Err(e) = r {
                    if self.repl.copies() > 1 {
                        // Down: what it kept is gone anyway.
                        self.server_down(s, &e);
                        break;
                    }
                    let msg = format!(
                        "pagefleet: cannot free kept pages on memory server {} (region {:#x}): {e}",
                        self.servers.addr(s),
                        self.region_id
                    );
                    self.fatal(msg, part[0] as usize);
                    return false;
                }
            }
            self.servers.freed(s, list.len() as u64);
        }
        true
    }
}

/// Where a page-out job goes: a server and, with two replicas, its mirror.
type Dest = (usize, Option<usize>);

/// Page-out jobs in flight at once: enough to keep the writer busy while
/// the pager takes each answer in.
pub(super) const MAX_JOBS: usize = 4;
