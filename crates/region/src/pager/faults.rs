//! Fault events: reading them, and serving each by what the location DB says.

use super::*;

impl Pager {
    /// Read and serve the fault events queued now (non-blocking).
    pub(super) fn serve_pending(&mut self) {
        self.faults.clear();
        let mut faults = std::mem::take(&mut self.faults);
        match self.uffd.read_faults(&mut faults, 64) {
            Ok(_) => {
                let t = Instant::now();
                for f in &faults {
                    self.handle(*f);
                }
                // Remote faults of this batch go out together: one pipelined
                // burst per server; the replies are taken in as they come.
                if !self.pending_in.is_empty() {
                    let c0 = thread_cpu_ns();
                    self.request_faulted(t);
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

    pub(super) fn handle(&mut self, f: Fault) {
        let base = self.guest.base();
        if f.addr < base || f.addr >= base + self.guest.len() as u64 {
            return;
        }
        let p = ((f.addr - base) as usize) / PAGE;
        let st = self.loc.state[p];
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
                self.access.refb[p] = 1;
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
                while a > lo && self.loc.state[a - 1] == LOCAL {
                    a -= 1;
                }
                while b < lo + self.cp && self.loc.state[b] == LOCAL {
                    b += 1;
                }
                // Pages whose writes must be seen (tracking, clean copies)
                // are mapped write-protected; a write maps only its own
                // page writable (it is dirty now).
                let guarded = self.tracking
                    || self.loc.clean[a..b].iter().any(|c| *c)
                    || self.loc.out[a..b].contains(&OUT_LEAVING);
                let whole = if b - a > 1 && !(f.write && guarded) {
                    self.uffd
                        .continue_mode(self.addr(a), ((b - a) * PAGE) as u64, guarded)
                } else {
                    Ok(Fill::Exists)
                };
                let wp = !f.write
                    && (self.tracking || self.loc.clean[p] || self.loc.out[p] == OUT_LEAVING);
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
            // Arriving: its install wakes this thread too.
            (_, _) if self.loc.out[p] == OUT_ARRIVING => {}
            (_, s) => {
                let s = (s - REMOTE) as usize;
                if !self.pending_in.iter().any(|(q, _, _)| *q == p) {
                    self.pending_in.push((p, s, f.write));
                }
            }
        }
    }

    /// Page `p` was written: its kept copy is stale; tracking sees a change;
    /// a page-out in flight leaves it resident (the copy it sends is stale).
    pub(super) fn dirtied(&mut self, p: usize) {
        if self.loc.rescue(p) {
            self.shared.stats.rescued_pages.fetch_add(1, Relaxed);
        }
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
