//! Page-in: the faulting pages and their read-ahead, from their servers,
//! with many requests in flight. A fault's GET goes out at once; its reply
//! is taken in whenever the server's connection has it, while faults that
//! came meanwhile are read and asked for too. A page whose GET is in flight
//! is *arriving*: another fault on it asks nothing more and waits for the
//! same install (`UFFDIO_COPY` wakes every thread waiting on the page).

use super::*;
use std::collections::VecDeque;

/// One GET in flight on a server connection (replies come in order).
pub(super) struct Get {
    id: u64,
    /// Page numbers asked for, in the request's order.
    pub(super) pages: Vec<u64>,
    /// For a faulting page (a GET of its own): whether the fault was a write.
    pub(super) fault: Option<bool>,
    /// The server keeps its copy (the page is installed clean).
    keep: bool,
    /// When the fault was read (service time is measured from there).
    pub(super) since: Instant,
}

/// A fault that brings this many pages or more is serving a scan (random
/// faults get windows of 1–2 pages): the pager takes its short CPU slice.
const STREAM_PAGES: usize = 8;

/// Bringing pages in: how much read-ahead a fault brings, the fault
/// loop's spin for a reply, the pager's CPU slice while it serves a scan,
/// and the buffer replies are received into.
pub(super) struct PageIn {
    prefetch: crate::Prefetch,
    /// Sequential fault streams for adaptive read-ahead.
    readahead: readahead::Readahead,
    spin: spin::ReplySpin,
    /// The pager's CPU slice: short while it serves a scan.
    slice: sched::SliceSwitch,
    /// Pages received from servers (a chunk or a batch).
    buf: Vec<u8>,
}

impl PageIn {
    pub fn new(cfg: &Config) -> Self {
        PageIn {
            prefetch: cfg.prefetch,
            readahead: readahead::Readahead::default(),
            spin: spin::ReplySpin::new(cfg.reply_spin),
            slice: sched::SliceSwitch::default(),
            buf: vec![0u8; cfg.chunk_pages.max(MAX_BATCH_PAGES) * PAGE],
        }
    }

    /// The receive buffer's first `len` bytes (at most a chunk or a batch).
    pub fn buf_mut(&mut self, len: usize) -> &mut [u8] {
        &mut self.buf[..len]
    }

    /// The loop's turn: give the short CPU slice back once no scan was
    /// served for a while; look at the host's load for the reply spin.
    pub fn tick(&mut self) {
        self.slice.tick();
        self.spin
            .look_at_host(Instant::now(), spin::runqueue_factor);
    }
}

impl Pager {
    /// The pages to bring with a fault at `p` from server `s`: the rest of
    /// its chunk (fixed prefetch) or its stream's window (adaptive), only
    /// those on `s` and not asked for already; they are arriving from now on.
    pub(super) fn prefetch_list(&mut self, p: usize, s: usize) -> Vec<u64> {
        let tag = (REMOTE as usize + s) as u8;
        let (lo, hi) = match self.pagein.prefetch {
            crate::Prefetch::Chunk => {
                let lo = p / self.cp * self.cp;
                (lo, lo + self.cp)
            }
            crate::Prefetch::Adaptive => {
                let cap = (self.shared.budget.load(Relaxed) / 16) as usize;
                let w = self.pagein.readahead.window(p, cap);
                (p, (p + w).min(self.loc.state.len()))
            }
        };
        if hi - lo >= STREAM_PAGES {
            self.pagein.slice.streaming();
        }
        let list: Vec<u64> = (lo..hi)
            .filter(|q| self.loc.state[*q] == tag && self.loc.out[*q] == OUT_NONE)
            .map(|q| q as u64)
            .collect();
        for &q in &list {
            self.loc.set_arriving(q as usize);
        }
        list
    }

    /// Ask for the pages of this batch's remote faults: for every server,
    /// first the faulting pages (a GET each, so each is installed and its
    /// thread woken as soon as it arrives), then their read-ahead. Nothing
    /// here waits for a reply.
    ///
    /// Outside change tracking the server keeps its copy (GET keep) and the
    /// page is installed write-protected: until the guest writes it, evicting
    /// it again is a local drop. A write fault installs its page writable
    /// (dirty at once: no second fault for the write).
    pub(super) fn request_faulted(&mut self, since: Instant) {
        let pending = self.faults.take_remote();
        let mut servers: Vec<usize> = pending.iter().map(|x| x.1).collect();
        servers.sort_unstable();
        servers.dedup();
        for s in servers {
            let firsts: Vec<(usize, bool)> = pending
                .iter()
                .filter(|x| x.1 == s)
                .map(|x| (x.0, x.2))
                .collect();
            // Every page is asked for once (an arriving page is not asked
            // again): the faulting ones first.
            for &(p, _) in &firsts {
                self.loc.set_arriving(p);
            }
            let rests: Vec<Vec<u64>> = firsts
                .iter()
                .map(|&(p, _)| self.prefetch_list(p, s))
                .collect();
            // Pages of a server being emptied are taken, never kept there.
            let keep = !self.changes.on() && self.evac.as_ref().is_none_or(|ev| ev.from != s);
            let mut gets: Vec<Get> = firsts
                .iter()
                .map(|&(p, write)| Get {
                    id: 0,
                    pages: vec![p as u64],
                    fault: Some(write),
                    keep,
                    since,
                })
                .collect();
            for rest in rests {
                for part in rest.chunks(MAX_BATCH_PAGES) {
                    gets.push(Get {
                        id: 0,
                        pages: part.to_vec(),
                        fault: None,
                        keep,
                        since,
                    });
                }
            }
            let from = self.servers.gets_mut(s).len();
            self.servers.gets_mut(s).extend(gets);
            if let Err(e) = self.send_gets(s, from) {
                self.get_failed(s, e);
            }
        }
        self.pagein.spin.sent(since);
    }

    /// Send the GETs of server `s` from index `from` of its queue on.
    fn send_gets(&mut self, s: usize, from: usize) -> Result<(), pagefleet_client::ClientError> {
        let region = self.region_id;
        let (conn, gets) = self.servers.conn_and_gets(s);
        for g in gets.iter_mut().skip(from) {
            let sel = if g.pages.len() == 1 {
                PageSel::Run {
                    first: g.pages[0],
                    count: 1,
                }
            } else {
                PageSel::List(g.pages.clone())
            };
            let mode = if g.keep { GetMode::Keep } else { GetMode::Take };
            g.id = conn.queue_get(region, &sel, mode, false)?;
        }
        conn.flush()
    }

    /// A GET of server `s` failed: a connection that dropped is reconnected
    /// once and every GET in flight asked again (a keep GET can be repeated;
    /// a take cannot: the server may have dropped the pages already).
    /// Anything else ends the guest.
    fn get_failed(&mut self, s: usize, e: pagefleet_client::ClientError) {
        let repeatable = self.servers.gets_mut(s).iter().all(|g| g.keep);
        if repeatable && e.is_transient() {
            match self.servers.reconnect(s) {
                Ok(()) => match self.send_gets(s, 0) {
                    Ok(()) => return,
                    Err(e2) if self.repl.copies() > 1 => return self.server_down(s, &e2),
                    Err(e2) => return self.lose_gets(s, e2),
                },
                Err(e2) if self.repl.copies() > 1 => return self.server_down(s, &e2),
                Err(_) => {}
            }
        }
        if self.repl.copies() > 1 && e.code().is_none() {
            // Not a refusal: the connection or the server is broken.
            return self.server_down(s, &e);
        }
        self.lose_gets(s, e)
    }

    /// Server `s` cannot give its pages back: the guest cannot go on.
    fn lose_gets(&mut self, s: usize, e: pagefleet_client::ClientError) {
        let gets = self.servers.take_gets(s);
        let first = gets
            .iter()
            .find(|g| g.fault.is_some())
            .or(gets.front())
            .map_or(0, |g| g.pages[0] as usize);
        self.lost(first, s, e);
        // (Only reached when the guest is not ended outright: every page
        // asked for is poisoned, so no thread waits for it forever.)
        for g in gets {
            for q in g.pages {
                let _ = self.uffd.poison(self.addr(q as usize), PAGE as u64);
            }
        }
    }

    /// Take in the replies server `s` has ready (or, with `wait`, every
    /// reply in flight), installing each page as it arrives.
    pub(super) fn take_replies(&mut self, s: usize, wait: bool) {
        let t0 = Instant::now();
        let mut n = 0u64;
        let mut retried = false;
        while !self.servers.gets_mut(s).is_empty()
            && (wait || self.servers.conn_mut(s).reply_ready())
        {
            if let Err(e) = self.take_reply(s) {
                // Reconnect once per call: a server that keeps dropping
                // the connection is not ridden out forever.
                if retried && self.repl.copies() > 1 {
                    self.server_down(s, &e);
                } else if retried {
                    self.lose_gets(s, e);
                } else {
                    retried = true;
                    self.get_failed(s, e);
                }
            }
            n += 1;
        }
        if n > 0 {
            // (Waiting for replies, `wait`, is no CPU: only a turn that
            // takes what is there counts as paging-in work.)
            if !wait {
                self.meter.page_in(t0);
            }
            self.shared
                .stats
                .fault_ns
                .fetch_add(t0.elapsed().as_nanos() as u64, Relaxed);
            self.publish();
        }
    }

    /// Receive the reply to the oldest GET of server `s` and install its pages.
    fn take_reply(&mut self, s: usize) -> Result<(), pagefleet_client::ClientError> {
        let len = self.servers.gets_mut(s)[0].pages.len() * PAGE;
        let id = self.servers.gets_mut(s)[0].id;
        self.servers
            .conn_mut(s)
            .recv_get(id, &mut self.pagein.buf[..len])?;
        let g = self
            .servers
            .gets_mut(s)
            .pop_front()
            .expect("a GET in flight");
        let st = self.shared.clone();
        let st = &st.stats;
        if let Some(write) = g.fault {
            let p = g.pages[0] as usize;
            // Clean (write-protected) unless this is a write, or the page
            // was written when it was here before (its WP fault would come).
            let hinted = !write && self.loc.write_hint[p] > 0;
            let wp = g.keep && !write && !hinted;
            if let Err(e) = self
                .uffd
                .copy_mode(self.addr(p), &self.pagein.buf[..PAGE], false, wp)
            {
                self.internal(p, e.to_string());
                return Ok(());
            }
            self.arrived(p, s, g.keep, wp);
            if write {
                self.loc.written[p] = true;
            } else if hinted && g.keep {
                st.write_hinted_pages.fetch_add(1, Relaxed);
            }
            self.access.used(p);
            let us = g.since.elapsed().as_secs_f64() * 1e6;
            st.page_in_latency.record_us(us);
            self.pagein.spin.replied(us);
            self.repl.replied(s, us);
            st.page_ins.fetch_add(1, Relaxed);
            st.page_in_requests.fetch_add(1, Relaxed);
            st.bytes_in.fetch_add(PAGE as u64, Relaxed);
            return Ok(());
        }
        // Read-ahead: install contiguous runs with one ioctl each.
        let part = &g.pages;
        for run in consecutive_runs(part) {
            let q = part[run.start] as usize;
            let data = &self.pagein.buf[run.start * PAGE..run.end * PAGE];
            if let Err(e) = self.uffd.copy_mode(self.addr(q), data, false, g.keep) {
                self.internal(q, e.to_string());
                return Ok(());
            }
            for r in &part[run.clone()] {
                self.arrived(*r as usize, s, g.keep, g.keep);
            }
            self.access.read_ahead(q, q + run.len());
        }
        st.page_ins.fetch_add(part.len() as u64, Relaxed);
        st.prefetched_pages.fetch_add(part.len() as u64, Relaxed);
        st.page_in_requests.fetch_add(1, Relaxed);
        st.bytes_in.fetch_add(len as u64, Relaxed);
        Ok(())
    }

    /// The fault loop should poll rather than sleep: a faulting page's
    /// reply is due (see [`spin`]).
    pub(super) fn spinning(&mut self) -> bool {
        let waiting = self.servers.any_in_flight();
        self.pagein.spin.spinning(Instant::now(), waiting)
    }

    /// Wait for every GET in flight (before anything that needs settled
    /// locations: change tracking, a hold, an evacuation).
    pub(super) fn drain_gets(&mut self) {
        for s in 0..self.servers.len() {
            self.take_replies(s, true);
        }
    }

    /// Page `q` arrived from server `s` and is resident now; with `keep` the
    /// server still holds it (clean while installed write-protected).
    pub(super) fn arrived(&mut self, q: usize, s: usize, keep: bool, clean: bool) {
        // (A mirror keeps its copy: a second kept copy from now on.)
        self.set_local(q);
        if keep {
            self.loc.keep_copy(q, s, clean);
        } else {
            self.servers.freed(s, 1);
            // Taken: the mirror's copy is stale room, deleted before
            // anything is stored there again.
            if let Some(m) = self.loc.forget_second(q) {
                self.repl.orphan(m, q as u64);
            }
        }
    }
}

/// GETs in flight per server.
pub(super) type GetQueues = Vec<VecDeque<Get>>;
