//! Fault events: reading them, and serving each by what the location DB says.

use super::*;

/// The faults the loop is serving: the batch read, the remote ones among
/// them (asked for together), and those waiting for a page-out or drop
/// job on their page to land.
#[derive(Default)]
pub(super) struct Faults {
    /// Events read in one batch (kept to reuse the allocation).
    read: Vec<Fault>,
    /// Remote faults of the current batch: (page, server, write fault).
    remote: Vec<(usize, usize, bool)>,
    /// Pages whose faults wait for their job.
    on_jobs: Vec<usize>,
}

impl Faults {
    /// A fault on page `p` waits for the job `p` is in.
    fn wait_for_job(&mut self, p: usize) {
        if !self.on_jobs.contains(&p) {
            self.on_jobs.push(p);
        }
    }

    /// A fault on remote page `p` on server `s` (each page once per batch).
    fn remote(&mut self, p: usize, s: usize, write: bool) {
        if !self.remote.iter().any(|(q, _, _)| *q == p) {
            self.remote.push((p, s, write));
        }
    }

    /// The batch's remote faults, taken.
    pub fn take_remote(&mut self) -> Vec<(usize, usize, bool)> {
        std::mem::take(&mut self.remote)
    }

    /// The pages whose jobs have landed (`in_job` says which have not):
    /// their threads are to be woken.
    pub fn landed(&mut self, in_job: impl Fn(usize) -> bool) -> Vec<usize> {
        let (wait, done) = std::mem::take(&mut self.on_jobs)
            .into_iter()
            .partition(|&p| in_job(p));
        self.on_jobs = wait;
        done
    }
}

impl Pager {
    /// Read and serve the fault events queued now (non-blocking).
    pub(super) fn serve_pending(&mut self) {
        let mut faults = std::mem::take(&mut self.faults.read);
        faults.clear();
        match self.uffd.read_faults(&mut faults, 64) {
            Ok(_) => {
                let t = Instant::now();
                for f in &faults {
                    self.handle(*f);
                }
                // Remote faults of this batch go out together: one pipelined
                // burst per server; the replies are taken in as they come.
                if !self.faults.remote.is_empty() {
                    self.request_faulted(t);
                    self.meter.page_in(t);
                }
                self.shared
                    .stats
                    .fault_ns
                    .fetch_add(t.elapsed().as_nanos() as u64, Relaxed);
            }
            Err(e) => warn!("reading userfaultfd: {e}"),
        }
        self.faults.read = faults;
    }

    pub(super) fn handle(&mut self, f: Fault) {
        let base = self.guest.base();
        if f.addr < base || f.addr >= base + self.guest.len() as u64 {
            return;
        }
        let p = ((f.addr - base) as usize) / PAGE;
        let st = self.loc.state[p];
        let s = &self.shared.stats;
        // (The region is not registered for MINOR faults: a page the
        // sampler unmapped is mapped back by the kernel, see `refs`.)
        match f.kind {
            FaultKind::Missing | FaultKind::Minor => s.missing_faults.fetch_add(1, Relaxed),
            FaultKind::WriteProtect => s.wp_faults.fetch_add(1, Relaxed),
        };
        // A page in a page-out or drop job (the writer punches it once
        // stored, or at once if clean): whatever the fault (a read after
        // the punch, a write before it), it waits for the job — then the
        // page is remote and the retried access pages it back in, or the
        // job failed, the page stayed and the access goes on. (No write can
        // slip between the copy sent and the punch.)
        if self.loc.in_job(p) {
            self.faults.wait_for_job(p);
            return;
        }
        match (f.kind, st) {
            // The first write to a resident page since its page-in (its kept
            // copy is stale from now on) or, while tracking changes, this round.
            (FaultKind::WriteProtect, LOCAL) => {
                self.access.seen_use(p);
                self.dirtied(p);
                if let Err(e) = self.uffd.writeprotect(self.addr(p), PAGE as u64, false) {
                    self.internal(p, e.to_string());
                }
            }
            // A write that waited out a page-out: the page is remote now,
            // the retried write pages it in.
            (FaultKind::WriteProtect, _) => self.wake(p),
            (_, ZERO) => {
                s.zero_faults.fetch_add(1, Relaxed);
                self.zero_fill(p)
            }
            // Stale: the page was installed by a read-ahead meanwhile (a
            // use, which the page tables may never show: it was mapped).
            (_, LOCAL) => {
                self.access.used(p);
                self.wake(p)
            }
            // Arriving: its install wakes this thread too.
            (_, _) if self.loc.out[p] == OUT_ARRIVING => {
                s.remote_faults.fetch_add(1, Relaxed);
                self.access.used(p)
            }
            (_, state) => {
                s.remote_faults.fetch_add(1, Relaxed);
                let s = (state - REMOTE) as usize;
                if self.servers.is_down(s) {
                    // Not expected: a server's pages are re-pointed when
                    // it goes down. Never ask a dead server (nothing would
                    // answer, and the thread would wait forever): re-point
                    // again and let the thread fault anew.
                    warn!(
                        "page {p} was still placed on memory server {}, which is down: re-pointed at its mirror",
                        self.servers.addr(s)
                    );
                    self.repoint(s, &"down");
                    self.copies_lost();
                    return self.wake(p);
                }
                self.faults.remote(p, s, f.write);
            }
        }
    }

    /// Page `p` was written: its kept copy is stale; tracking sees a change.
    pub(super) fn dirtied(&mut self, p: usize) {
        if self.loc.clean[p] {
            self.loc.clean[p] = false;
            self.shared.stats.first_writes.fetch_add(1, Relaxed);
        }
        self.loc.written[p] = true;
        self.mark(p);
    }

    pub(super) fn set_local(&mut self, q: usize) {
        self.mark(q);
        self.loc.set_local(q);
        self.reclaim.arrived(q / self.cp);
    }

    /// First touch: zero-fill every never-touched page of the chunk locally.
    pub(super) fn zero_fill(&mut self, p: usize) {
        let c = p / self.cp;
        let lo = c * self.cp;
        let mut q = lo;
        let mut n = 0;
        while q < lo + self.cp {
            if self.loc.state[q] != ZERO {
                q += 1;
                continue;
            }
            let start = q;
            while q < lo + self.cp && self.loc.state[q] == ZERO {
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
        self.access.refb[p] = 1;
        self.shared
            .stats
            .zero_filled_pages
            .fetch_add(n as u64, Relaxed);
        self.publish();
    }
}
