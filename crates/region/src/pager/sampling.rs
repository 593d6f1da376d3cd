//! Access sampling: the budgeted hand that ages chunks and re-arms their reference bits.

use super::*;

impl Pager {
    /// Advance the sampling hand by as many resident chunks as the rate allows.
    pub(super) fn sample_tick(&mut self) {
        let now = Instant::now();
        let dt = now.duration_since(self.last_tick).as_secs_f64();
        if self.hold || dt < self.tick_secs {
            return;
        }
        self.last_tick = now;
        // The region's owner may change the budget while the guest runs.
        self.cpu_budget = f64::from_bits(self.shared.sample_budget.load(Relaxed));
        // Controller: keep the guest's cost of sampling faults within budget.
        let win = now.duration_since(self.window_start).as_secs_f64();
        if win >= 0.1 {
            // What sampling costs the guest: each page touched after a zap
            // took a minor fault (resolved by the kernel, no thread waits
            // for the pager), each zap a TLB shootdown.
            let (per_fault, per_zap) = (self.minor_cost.as_secs_f64(), self.zap_cost.as_secs_f64());
            // Spinning for replies only pays on a host with idle CPUs: on an
            // oversubscribed one it takes the CPU the server or a guest needs.
            self.spin_ok = runqueue_factor() <= 1.0;
            // Plus what the sweeps cost this thread, measured: reading page
            // tables and zapping run on the guest's host too, and took 2–3x
            // the modelled costs on a slow day (the kv bench, everything
            // resident: 4.5% for a 2% budget over 60 interleaved rounds).
            let used = self.window_minor as f64 * per_fault
                + self.window_zaps as f64 * per_zap
                + self.window_sweep_ns as f64 * 1e-9;
            let allowed = self.cpu_budget * win;
            if used > allowed {
                self.rate = (self.rate * (allowed / used) * 0.8).max(1.0);
            } else if used < allowed * 0.5 {
                self.rate = (self.rate * 1.25).min(self.max_rate);
            }
            self.window_start = now;
            self.window_minor = 0;
            self.window_zaps = 0;
            self.window_sweep_ns = 0;
            self.shared
                .stats
                .sample_rate
                .store(self.rate as u64, Relaxed);
        }
        // No budget, no sampling: history comes from the victim hand only.
        if self.cpu_budget <= 0.0 {
            return;
        }
        // Needing victims soon: look harder, the budget notwithstanding.
        let budget = self.shared.budget.load(Relaxed);
        let boost = if self.can_overflow() && self.loc.resident as f64 > budget as f64 * 0.97 {
            4.0
        } else {
            1.0
        };
        // A pager that did not run for a while (its process stopped, its
        // host overloaded) resumes at its rate instead of sweeping the
        // whole gap's worth of chunks in one burst.
        self.carry += self.rate * boost * dt.min(self.tick_secs * 4.0);
        let todo = self.carry as usize;
        self.carry -= todo as f64;
        let cpu0 = thread_cpu_ns();
        self.sweep(now, todo);
        self.window_sweep_ns += thread_cpu_ns().saturating_sub(cpu0);
    }

    /// Whether the region has more pages than its budget, so that some
    /// may have to leave (else everything can stay resident).
    fn can_overflow(&self) -> bool {
        (self.loc.state.len() as u64) > self.shared.budget.load(Relaxed)
    }

    /// Re-arm what the victim hand spared, then visit the next `todo`
    /// resident chunks.
    fn sweep(&mut self, now: Instant, mut todo: usize) {
        if !self.rearm_pending.is_empty() {
            let mut spared = std::mem::take(&mut self.rearm_pending);
            spared.dedup();
            self.window_zaps += self.rearm(&mut spared);
            spared.clear();
            self.rearm_pending = spared;
        }
        // Clock while evicting: the victim hand reads the page tables and
        // re-arms what it spares itself; the sampling hand's zaps would
        // only add minor faults and shootdowns (in the kv bench at 25%:
        // ~4 000 chunks swept per 6 s for the same page-ins per operation).
        // It keeps the history while nothing is evicted, and for aging.
        if self.victims.reads_refs_itself()
            && self
                .victims_at
                .is_some_and(|t| now.duration_since(t) < CLOCK_QUIET)
        {
            self.carry = 0.0;
            return;
        }
        if todo == 0 {
            return;
        }
        // Visit the next resident chunks: read which of their pages were
        // touched since the last zap (reference bits), fold that into the
        // history, then zap the whole swept span with one madvise per
        // contiguous piece: every zap is a TLB shootdown (an IPI to each
        // CPU running the guest), so one per tick, not per chunk.
        let mut scanned = 0;
        let start = self.hand;
        let mut visit = Vec::new();
        while todo > 0 && scanned < self.chunks {
            let c = self.hand;
            self.hand = (self.hand + 1) % self.chunks;
            scanned += 1;
            if self.loc.chunk_res[c] == 0 {
                continue;
            }
            visit.push(c);
            todo -= 1;
        }
        let first = (self.chunks - start).min(scanned);
        let mut touched = self.read_refs(start * self.cp, (start + first) * self.cp);
        if scanned > first {
            touched += self.read_refs(0, (scanned - first) * self.cp);
        }
        for c in visit {
            self.victims
                .sweep(&mut self.access, c * self.cp, (c + 1) * self.cp);
            self.shared.stats.sampled_chunks.fetch_add(1, Relaxed);
        }
        self.window_minor += touched;
        self.shared.stats.minor_faults.fetch_add(touched, Relaxed);
        if self.pagemap.is_none() {
            return;
        }
        self.zap(start * self.cp, (start + first) * self.cp);
        if scanned > first {
            self.zap(0, (scanned - first) * self.cp);
        }
        self.window_zaps += 1 + (scanned > first) as u64;
    }
}

/// How long after the victim hand last chose victims the clock's sampling
/// hand stays still.
const CLOCK_QUIET: Duration = Duration::from_secs(1);

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
