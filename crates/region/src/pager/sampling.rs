//! Access sampling: the budgeted hand that ages chunks and re-arms their
//! reference bits.
//!
//! [`Sampler`] owns the hand and its cost controller and decides, per tick,
//! how many resident chunks to visit; it touches no kernel object and is
//! tested here without one. The pager's `sample_tick` (below) is the
//! shell: it reads the page tables, ages the chunks through the victim
//! policy and unmaps them, and reports back what that cost.

use super::*;

/// How often the controller compares what sampling cost with its budget.
const WINDOW: Duration = Duration::from_millis(100);

/// Each tick's zap is a TLB shootdown, and in this VM the TLB refills after
/// one cost ~200 µs of guest time: 5 ms ticks cost the kv guest 4 % with
/// everything resident.
const TICK: Duration = Duration::from_millis(50);

/// A pager that did not run for a while (its process stopped, its host
/// overloaded) resumes at its rate instead of sweeping the whole gap's
/// worth of chunks in one burst: at most this many ticks' worth.
const MAX_CATCH_UP_TICKS: f64 = 4.0;

/// Needing victims soon (resident above this share of the budget): the
/// hand looks `BOOST`× harder, the budget notwithstanding.
const BOOST_AT: f64 = 0.97;
const BOOST: f64 = 4.0;

/// What a sampling fault or zap costs the guest (`Config`'s modelled
/// costs), and the share of one CPU sampling may take.
#[derive(Clone, Copy, Debug)]
pub(super) struct Costs {
    pub minor: Duration,
    pub zap: Duration,
}

/// What the sweeps of the current controller window cost.
#[derive(Clone, Copy, Debug)]
struct Window {
    start: Instant,
    minor: u64,
    zaps: u64,
    sweep_ns: u64,
}

/// The sampling hand and its controller.
pub(super) struct Sampler {
    /// The chunk the hand visits next.
    hand: usize,
    chunks: usize,
    /// Chunks per second the hand may visit now, and at most.
    rate: f64,
    max_rate: f64,
    /// Fractional chunks owed from earlier ticks.
    carry: f64,
    last_tick: Instant,
    window: Window,
    costs: Costs,
    /// Chunks the victim hand spared, to unmap at the next tick (one TLB
    /// shootdown per run per tick, not per batch).
    rearm: Vec<usize>,
}

/// One tick's decision.
#[derive(Debug, PartialEq)]
pub(super) struct Plan {
    /// Resident chunks to visit.
    pub todo: usize,
    /// The controller closed a window and set this rate (chunks/s).
    pub new_rate: Option<f64>,
}

/// The chunks one sweep covers: from `start`, `scanned` chunks (wrapping
/// at the end), of which `visit` are resident.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Span {
    pub start: usize,
    pub scanned: usize,
    pub visit: Vec<usize>,
}

impl Span {
    /// The span as at most two chunk ranges (it may wrap).
    pub fn pieces(&self, chunks: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
        let first = (chunks - self.start).min(self.scanned);
        let rest = self.scanned - first;
        [self.start..self.start + first, 0..rest]
            .into_iter()
            .filter(|r| !r.is_empty())
    }
}

impl Sampler {
    /// A hand over `chunks` chunks that would visit each once per `period`
    /// at full rate.
    pub fn new(chunks: usize, period: Duration, costs: Costs, now: Instant) -> Self {
        let max_rate = chunks as f64 / period.as_secs_f64().max(0.01);
        Sampler {
            hand: 0,
            chunks,
            // Start slow; the controller raises the rate while faults stay cheap.
            rate: (max_rate / 64.0).clamp(1.0, 64.0),
            max_rate: max_rate.max(10.0),
            carry: 0.0,
            last_tick: now,
            window: Window {
                start: now,
                minor: 0,
                zaps: 0,
                sweep_ns: 0,
            },
            costs,
            rearm: Vec::new(),
        }
    }

    /// Whether a tick is due.
    pub fn due(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.last_tick) >= TICK
    }

    /// Decide a due tick: close the controller's window when it is over
    /// (slow down when sampling cost more than `cpu_budget` of a CPU,
    /// speed up when it cost under half), then how many chunks this tick
    /// visits at the rate. `near_full`: victims are needed soon.
    pub fn plan(&mut self, now: Instant, cpu_budget: f64, near_full: bool) -> Plan {
        let dt = now.saturating_duration_since(self.last_tick).as_secs_f64();
        self.last_tick = now;
        let mut new_rate = None;
        let win = now.saturating_duration_since(self.window.start);
        if win >= WINDOW {
            // What sampling costs the guest: each page touched after a zap
            // took a minor fault (resolved by the kernel, no thread waits
            // for the pager), each zap a TLB shootdown; plus what the
            // sweeps cost this thread, measured: reading page tables and
            // zapping run on the guest's host too, and took 2–3x the
            // modelled costs on a slow day (the kv bench, everything
            // resident: 4.5 % for a 2 % budget over 60 interleaved rounds).
            let w = &self.window;
            let used = w.minor as f64 * self.costs.minor.as_secs_f64()
                + w.zaps as f64 * self.costs.zap.as_secs_f64()
                + w.sweep_ns as f64 * 1e-9;
            let allowed = cpu_budget.max(0.0) * win.as_secs_f64();
            if used > allowed {
                self.rate = (self.rate * (allowed / used) * 0.8).max(1.0);
            } else if used < allowed * 0.5 {
                self.rate = (self.rate * 1.25).min(self.max_rate);
            }
            self.window = Window {
                start: now,
                minor: 0,
                zaps: 0,
                sweep_ns: 0,
            };
            new_rate = Some(self.rate);
        }
        // No budget, no sampling: history comes from the victim hand only.
        if cpu_budget <= 0.0 {
            self.carry = 0.0;
            return Plan { todo: 0, new_rate };
        }
        let boost = if near_full { BOOST } else { 1.0 };
        self.carry += self.rate * boost * dt.min(TICK.as_secs_f64() * MAX_CATCH_UP_TICKS);
        let todo = self.carry as usize;
        self.carry -= todo as f64;
        Plan { todo, new_rate }
    }

    /// The hand stays still this tick (the victim hand reads the page
    /// tables itself): nothing owed carries over.
    pub fn quiet(&mut self) {
        self.carry = 0.0;
    }

    /// Move the hand over the next `todo` chunks `resident` says are
    /// resident (at most one lap).
    pub fn advance(&mut self, mut todo: usize, resident: impl Fn(usize) -> bool) -> Span {
        let mut span = Span {
            start: self.hand,
            ..Span::default()
        };
        while todo > 0 && span.scanned < self.chunks {
            let c = self.hand;
            self.hand = (self.hand + 1) % self.chunks;
            span.scanned += 1;
            if resident(c) {
                span.visit.push(c);
                todo -= 1;
            }
        }
        span
    }

    /// What a sweep cost: pages found touched (each a minor fault), zaps,
    /// this thread's CPU.
    pub fn spent(&mut self, minor: u64, zaps: u64, sweep_ns: u64) {
        self.window.minor += minor;
        self.window.zaps += zaps;
        self.window.sweep_ns += sweep_ns;
    }

    /// Remember chunks the victim hand spared, to unmap at the next tick.
    pub fn spared(&mut self, chunks: &[usize]) {
        self.rearm.extend_from_slice(chunks);
    }

    /// The spared chunks to unmap now (deduplicated); give the vector back
    /// with [`Sampler::rearmed`] to keep its allocation.
    pub fn take_spared(&mut self) -> Vec<usize> {
        let mut v = std::mem::take(&mut self.rearm);
        v.sort_unstable();
        v.dedup();
        v
    }

    pub fn rearmed(&mut self, mut v: Vec<usize>) {
        v.clear();
        if self.rearm.is_empty() {
            self.rearm = v;
        }
    }
}

impl Pager {
    /// Advance the sampling hand by as many resident chunks as the rate allows.
    pub(super) fn sample_tick(&mut self) {
        let now = Instant::now();
        if self.owner.held() || !self.sampler.due(now) {
            return;
        }
        // The region's owner may change the budget while the guest runs.
        let cpu_budget = f64::from_bits(self.shared.sample_budget.load(Relaxed));
        let budget = self.shared.budget.load(Relaxed);
        let near_full = (self.loc.pages() as u64) > budget
            && self.loc.resident as f64 > budget as f64 * BOOST_AT;
        let plan = self.sampler.plan(now, cpu_budget, near_full);
        if let Some(rate) = plan.new_rate {
            self.shared.stats.sample_rate.store(rate as u64, Relaxed);
        }
        let cpu0 = thread_cpu_ns();
        // Re-arm what the victim hand spared (whatever the budget: a clock
        // hand that never saw them unmapped would find them referenced
        // forever).
        let spared = self.sampler.take_spared();
        let mut zaps = self.rearm(&spared);
        self.sampler.rearmed(spared);
        // Clock while evicting: the victim hand reads the page tables and
        // re-arms what it spares itself; the sampling hand's zaps would
        // only add minor faults and shootdowns (in the kv bench at 25%:
        // ~4 000 chunks swept per 6 s for the same page-ins per operation).
        // It keeps the history while nothing is evicted, and for aging.
        if self.reclaim.sampler_rests(now, CLOCK_QUIET) {
            self.sampler.quiet();
        } else if plan.todo > 0 {
            // Visit the next resident chunks: read which of their pages
            // were touched since the last zap (reference bits), fold that
            // into the history, then zap the whole swept span with one
            // madvise per contiguous piece: every zap is a TLB shootdown
            // (an IPI to each CPU running the guest), so one per tick, not
            // per chunk.
            let loc = &self.loc;
            let span = self.sampler.advance(plan.todo, |c| loc.chunk_res[c] != 0);
            let cp = self.cp;
            let mut touched = 0;
            for r in span.pieces(self.chunks()) {
                touched += self.read_refs(r.start * cp, r.end * cp);
            }
            for &c in &span.visit {
                self.reclaim.sweep(&mut self.access, c * cp, (c + 1) * cp);
            }
            let st = &self.shared.stats;
            st.sampled_chunks
                .fetch_add(span.visit.len() as u64, Relaxed);
            st.minor_faults.fetch_add(touched, Relaxed);
            if self.refs.available() {
                for r in span.pieces(self.chunks()) {
                    self.zap(r.start * cp, r.end * cp);
                    zaps += 1;
                }
            }
            self.sampler.spent(touched, 0, 0);
        }
        self.sampler
            .spent(0, zaps, thread_cpu_ns().saturating_sub(cpu0));
    }
}

/// How long after the victim hand last chose victims the clock's sampling
/// hand stays still.
const CLOCK_QUIET: Duration = Duration::from_secs(1);

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn costs() -> Costs {
        Costs {
            minor: Duration::from_micros(10),
            zap: Duration::from_micros(200),
        }
    }

    #[test]
    fn a_span_that_wraps_is_two_pieces() {
        let mut s = Sampler::new(10, Duration::from_secs(1), costs(), Instant::now());
        let all = s.advance(7, |_| true);
        assert_eq!(all.pieces(10).collect::<Vec<_>>(), vec![0..7]);
        let wrapped = s.advance(5, |c| c != 8);
        assert_eq!(wrapped.visit, vec![7, 9, 0, 1, 2]);
        assert_eq!(wrapped.pieces(10).collect::<Vec<_>>(), vec![7..10, 0..3]);
    }

    #[test]
    fn the_hand_stops_after_one_lap() {
        let mut s = Sampler::new(8, Duration::from_secs(1), costs(), Instant::now());
        let span = s.advance(100, |c| c % 4 == 0);
        assert_eq!((span.scanned, span.visit), (8, vec![0, 4]));
    }

    #[test]
    fn no_budget_visits_nothing() {
        let t0 = Instant::now();
        let mut s = Sampler::new(1000, Duration::from_secs(1), costs(), t0);
        for i in 1..50 {
            let plan = s.plan(t0 + TICK * i, 0.0, true);
            assert_eq!(plan.todo, 0);
        }
    }

    #[test]
    fn spared_chunks_come_back_once_each() {
        let mut s = Sampler::new(100, Duration::from_secs(1), costs(), Instant::now());
        s.spared(&[5, 3, 5]);
        s.spared(&[3, 9]);
        let v = s.take_spared();
        assert_eq!(v, vec![3, 5, 9]);
        s.rearmed(v);
        assert!(s.take_spared().is_empty());
    }

    proptest! {
        /// Whatever the sweeps cost, the rate stays within [1, max] and a
        /// tick never visits more than the catch-up allowance at it.
        #[test]
        fn rate_stays_bounded(
            chunks in 1usize..100_000,
            budget in 0.0f64..0.2,
            steps in prop::collection::vec((1u64..2000, 0u64..5000, 0u64..20, 0u64..50_000_000, any::<bool>()), 1..60),
        ) {
            let t0 = Instant::now();
            let mut s = Sampler::new(chunks, Duration::from_secs(1), costs(), t0);
            let mut now = t0;
            for (ms, minor, zaps, ns, near) in steps {
                now += Duration::from_millis(ms);
                let before = s.rate;
                let plan = s.plan(now, budget, near);
                prop_assert!(s.rate >= 1.0 && s.rate <= s.max_rate);
                let most = before.max(s.rate) * BOOST * TICK.as_secs_f64() * MAX_CATCH_UP_TICKS + 1.0;
                prop_assert!((plan.todo as f64) <= most, "{} > {}", plan.todo, most);
                s.spent(minor, zaps, ns);
            }
        }

        /// Over budget the rate falls, well under it the rate rises.
        #[test]
        fn the_controller_follows_the_cost(minor in 0u64..100_000, budget in 0.001f64..0.1) {
            let t0 = Instant::now();
            let mut s = Sampler::new(1 << 20, Duration::from_secs(1), costs(), t0);
            s.rate = 1000.0;
            s.spent(minor, 0, 0);
            s.plan(t0 + WINDOW, budget, false);
            let used = minor as f64 * 10e-6;
            let allowed = budget * WINDOW.as_secs_f64();
            if used > allowed {
                prop_assert!(s.rate < 1000.0);
            } else if used < allowed * 0.5 {
                prop_assert!(s.rate > 1000.0);
            } else {
                prop_assert_eq!(s.rate, 1000.0);
            }
        }

        /// A long stop does not turn into one burst.
        #[test]
        fn a_long_pause_is_not_a_burst(pause_s in 1u64..100_000) {
            let t0 = Instant::now();
            let mut s = Sampler::new(1 << 20, Duration::from_secs(1), costs(), t0);
            let rate = s.rate;
            let plan = s.plan(t0 + Duration::from_secs(pause_s), 0.01, false);
            // The window closed with nothing spent: the rate rose by 1.25×.
            prop_assert!((plan.todo as f64) <= rate * 1.25 * TICK.as_secs_f64() * MAX_CATCH_UP_TICKS + 1.0);
        }
    }
}
