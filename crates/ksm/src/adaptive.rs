//! The adaptive controller: scan fast while merging pays, within a CPU
//! budget for ksmd, idle along at a trickle once nothing new turns up, and
//! switch KSM off when the host has no memory pressure and nothing is left
//! to gain.
//!
//! "Nothing new": one empty pass (one that saved less than the pay
//! threshold for the CPU it cost) after a pass that merged, two over new
//! memory — ksmd only offers a page for merging once its checksum has
//! stayed the same across a pass, so the first pass over new memory never
//! merges anything. Idle passes are paced by what a pass costs: ksmd spends
//! about the same CPU on a pass whatever its speed, so an idle pass lasts
//! long enough to stay within a small idle budget (0.1% of a core), and
//! longer after every pass that finds nothing.
//!
//! Under paging the counters mislead: a pass's net gain is what it merged
//! less the merged pages reclaim swapped out meanwhile (they come back in
//! as separate copies), so a pass that merged plenty can net nothing, and
//! while idling the savings drain away as the tenants swap — the host then
//! pages for memory merging would free (`pagefleet bench ksm` saw 51 MiB
//! saved where ksmtuned saved 456). And a duplicate merges only while both
//! of its copies are resident, so a slow pass misses the pairs the churn
//! splits. So while pages are being swapped in: a pass pays if it netted
//! any real gain at all, or if what it merged gross (its net plus the
//! merged pages lost meanwhile, `lost_pages`) pays for its CPU; ksmd may
//! spend `paging_budget_factor` times its budget; and an idle controller
//! whose last merging phase merged starts again once `lost_wake_pages` of
//! its savings are lost or `swap_wake_pages` have been swapped back in
//! (ksmd skips swapped-out pages: a duplicate whose second copy was in
//! swap is a candidate only once both are resident).
//!
//! Cold duplicates in swap are never touched, so neither wake fires for
//! them and ksmd never sees them. So an idle controller under pressure
//! with `sweep_min_pages` in swap asks for a sweep
//! ([`crate::swapin`]: the tenants' swapped mergeable pages read back in,
//! as far as their memory cgroups and the host have room) and merges what
//! it brought in, if the duplicates among what it read would pay for the
//! two passes that takes. A sweep that brings in too few duplicates, or
//! whose merging then saves little, is not repeated until swap has grown by
//! `sweep_regrow_pages`. While merging what a sweep brought in, ksmd's
//! smart_scan is off: the resident partners of the swept pages have gone
//! passes without merging, and smart_scan would skip them for up to 8
//! more.

use crate::sysfs::{Memory, Stats, PAGE};
use serde::Serialize;

/// Passes ksmd makes over all the mergeable memory to merge what a sweep
/// brought in: the first only checksums the pages it has not seen.
const SWEEP_MERGE_PASSES: f64 = 2.0;

/// While merging, one pass over the pages ksmd tracks takes at least this
/// long: the controller judges passes at its one-second ticks, and a pass
/// shorter than a tick or two ends unjudged — at the fastest rates two
/// passes ended per tick and a merging phase's tail spent 0.7 CPU-s on
/// 7 MiB (`pagefleet bench ksm`) before the empty pass that ends it was
/// seen. Never below `start_rate`: ksmd's page count is unknown until its
/// first pass.
const MIN_MERGING_PASS_S: f64 = 1.5;

/// The adaptive controller's settings.
#[derive(Clone, Debug, Serialize)]
pub struct AdaptiveConfig {
    /// ksmd's CPU share of one core the controller allows (0.10 = 10%).
    pub cpu_budget: f64,
    /// Memory pressure: MemAvailable below this fraction of MemTotal...
    pub pressure_below: f64,
    /// ...or PSI memory "some" avg10 above this percentage.
    pub psi_above: f64,
    /// Pages per second while idling along (new duplicates are still found).
    pub min_rate: f64,
    /// Pages per second when merging starts.
    pub start_rate: f64,
    /// Pages per second at most.
    pub max_rate: f64,
    /// Merging pays while it saves at least this much per ksmd CPU-second.
    pub pay_bytes_per_cpu_s: f64,
    /// A pass "found nothing" when it saved fewer pages than this.
    pub min_gain_pages: u64,
    /// ksmd's sleep between batches at normal rates, ms.
    pub sleep_ms: u64,
    /// While idling, one pass over the mergeable memory takes at least this
    /// long, and long enough that ksmd stays within idle_cpu_budget at the
    /// CPU the last pass cost; every pass that finds nothing doubles it, up
    /// to max_idle_pass_s (an idle ksmd costs next to nothing on a settled host).
    pub idle_pass_s: f64,
    /// ksmd's CPU share while idling.
    pub idle_cpu_budget: f64,
    /// Longest idle pass, seconds.
    pub max_idle_pass_s: f64,
    /// While idling, MemAvailable falling by this share of MemTotal (new
    /// memory in use, maybe new duplicates) starts merging again.
    pub wake_on_growth: f64,
    /// The highest priority ksmd is given when it starves while merging pays.
    pub min_nice: i32,
    /// While idling after a merging phase that merged, this many merged
    /// pages lost (swapped out and back in as copies, or written) start
    /// merging again.
    pub lost_wake_pages: u64,
    /// ...and so do this many pages swapped back in host-wide (duplicates
    /// whose second copy was in swap, candidates now that both are
    /// resident: ksmd skips swapped-out pages).
    pub swap_wake_pages: u64,
    /// While pages are swapped in, ksmd may spend this multiple of
    /// `cpu_budget`: a pair merges only while both copies are resident, so
    /// the scan has to outrun the churn.
    pub paging_budget_factor: f64,
    /// "Paging": at least this many pages per second swapped in host-wide
    /// (`pswpin`) under memory pressure.
    pub paging_pages_per_s: f64,
    /// An idle controller under pressure sweeps the tenants' swapped
    /// mergeable pages back in when at least this many pages are in swap.
    pub sweep_min_pages: u64,
    /// After a sweep that paid nothing, none again until swap has grown by
    /// this many pages.
    pub sweep_regrow_pages: u64,
}

impl Default for AdaptiveConfig {
    fn default() -> Self {
        AdaptiveConfig {
            cpu_budget: 0.10,
            pressure_below: 0.20,
            psi_above: 10.0,
            min_rate: 500.0,
            start_rate: 50_000.0,
            max_rate: 2_000_000.0,
            pay_bytes_per_cpu_s: 16.0 * 1048576.0,
            min_gain_pages: 256,
            sleep_ms: 20,
            idle_pass_s: 120.0,
            idle_cpu_budget: 0.001,
            max_idle_pass_s: 1920.0,
            wake_on_growth: 0.05,
            min_nice: -10,
            lost_wake_pages: 1024,
            swap_wake_pages: 4096,
            paging_budget_factor: 1.5,
            paging_pages_per_s: 64.0,
            sweep_min_pages: 4096,
            sweep_regrow_pages: 16384,
        }
    }
}

/// The controller's phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// KSM stopped (run=0): no pressure and nothing to gain.
    Off,
    /// Scanning as fast as the CPU budget allows while it pays.
    Merging,
    /// Nothing new in two passes: a trickle that still notices new duplicates.
    Idling,
}

/// What to set, and why.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Decision {
    /// KSM running (run=1).
    pub run: bool,
    /// Pages per batch.
    pub pages_to_scan: u64,
    /// Sleep between batches, ms.
    pub sleep_millisecs: u64,
    /// ksmd's nice value (the kernel's 5 unless it starved while merging paid).
    pub ksmd_nice: i32,
    /// The phase.
    pub phase: Phase,
    /// Bring the tenants' swapped-out mergeable pages back in now (see
    /// [`crate::swapin`]); report what it brought with [`Adaptive::swept`].
    pub sweep: bool,
    /// ksmd's smart_scan: on, but off while merging what a sweep brought
    /// in (smart_scan skips a page for up to 8 passes once it has gone 3
    /// without merging, and the resident copy of a duplicate whose partner
    /// was in swap has gone many: it would wait out its skips).
    pub smart_scan: bool,
    /// Why, for a person.
    pub why: String,
}

/// Where sweeping stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SweepState {
    /// A sweep may run (idle under pressure).
    Ready,
    /// A sweep was asked for and is under way: its own swap-ins are no
    /// sign of duplicates coming back.
    Running,
    /// A sweep brought pages in; ksmd is merging them. Pages saved when it
    /// began.
    Merging { saved_before: u64 },
    /// The last sweep brought or saved too little: none again until swap
    /// grows by `sweep_regrow_pages` from this many pages.
    Spent { swap_pages: u64 },
}

/// The adaptive controller: scans while merging pays, within a CPU budget.
pub struct Adaptive {
    /// Its settings.
    pub cfg: AdaptiveConfig,
    phase: Phase,
    rate: f64,
    last: Option<Stats>,
    cpu: f64,
    /// Saved bytes when the current pass began, and the gains of the last passes.
    pass_start_saved: u64,
    empty_passes: u32,
    /// The host is under memory pressure.
    pub pressure: bool,
    /// ksmd's CPU share over the last tick.
    pub cpu_share: f64,
    /// Bytes saved per ksmd CPU-second lately.
    pub yield_bytes_per_cpu_s: f64,
    /// Share of the last tick ksmd spent runnable but without a CPU.
    pub wait_share: f64,
    nice: i32,
    /// The idle pass length now, and MemAvailable (kB) when idling began.
    idle_pass: f64,
    idle_avail_kb: u64,
    /// A full pass of the current merging phase saved something.
    merged_this_phase: bool,
    /// ksmd's CPU time when the current pass began, and what the last whole pass cost (s).
    pass_start_cpu: f64,
    last_pass_cpu: f64,
    /// The pass under way began before this merging phase did.
    partial_pass: bool,
    /// Pages swapped in (host-wide) when the current pass began, and when
    /// idling began.
    pass_start_swpin: u64,
    /// Merged pages lost since the controller started (the sum of every
    /// tick's fall in pages saved), when the current pass began, and when
    /// idling began.
    lost_pages: u64,
    pass_start_lost: u64,
    idle_lost: u64,
    /// Pages swapped in (host-wide) when idling began.
    idle_swpin: u64,
    /// Pages were swapped in over the last tick (under pressure), and the
    /// host's swap-in count at that tick.
    paging: bool,
    tick_swpin: u64,
    sweep: SweepState,
}

impl Adaptive {
    /// A controller starting off.
    pub fn new(cfg: AdaptiveConfig) -> Adaptive {
        let rate = cfg.start_rate;
        Adaptive {
            cfg,
            phase: Phase::Off,
            rate,
            last: None,
            cpu: 0.0,
            pass_start_saved: 0,
            empty_passes: 0,
            pressure: false,
            cpu_share: 0.0,
            yield_bytes_per_cpu_s: 0.0,
            wait_share: 0.0,
            nice: crate::sysfs::KSMD_DEFAULT_NICE,
            idle_pass: 60.0,
            idle_avail_kb: 0,
            merged_this_phase: false,
            pass_start_cpu: 0.0,
            last_pass_cpu: 0.0,
            partial_pass: false,
            pass_start_swpin: 0,
            lost_pages: 0,
            pass_start_lost: 0,
            idle_lost: 0,
            idle_swpin: 0,
            paging: false,
            tick_swpin: 0,
            sweep: SweepState::Ready,
        }
    }

    /// The current length of one idle pass, seconds.
    pub fn idle_pass_s(&self) -> f64 {
        self.idle_pass
    }

    /// Its phase now.
    pub fn phase(&self) -> Phase {
        self.phase
    }
    /// Its scan rate now, pages/s.
    pub fn rate(&self) -> f64 {
        self.rate
    }

    fn under_pressure(&self, m: &Memory) -> bool {
        m.available_frac() < self.cfg.pressure_below
            || m.psi_some10.is_some_and(|p| p > self.cfg.psi_above)
    }

    /// ksmd's knobs for a rate: the normal sleep with a batch to match, or
    /// at low rates a small batch and a longer sleep (fewer wakeups).
    pub fn knobs(&self, rate: f64) -> (u64, u64) {
        let per = rate * self.cfg.sleep_ms as f64 / 1000.0;
        if per >= 32.0 {
            (per.round() as u64, self.cfg.sleep_ms)
        } else {
            (
                32,
                ((32.0 * 1000.0 / rate.max(1.0)).round() as u64).clamp(self.cfg.sleep_ms, 10_000),
            )
        }
    }

    /// The pages ksmd tracks: its rmap items, recovered from
    /// general_profit = sharing x 4096 - rmap_items x 64.
    fn rmap_pages(s: &Stats) -> f64 {
        ((s.pages_sharing + s.ksm_zero_pages) as i64 * PAGE as i64 - s.general_profit).max(0) as f64
            / 64.0
    }

    /// One pass per idle pass length over the pages ksmd tracks.
    fn idle_rate(&self, s: &Stats) -> f64 {
        (Self::rmap_pages(s) / self.idle_pass).max(self.cfg.min_rate)
    }

    /// The fastest merging rate: a pass over the pages ksmd tracks in
    /// `MIN_MERGING_PASS_S`, but never below `start_rate`, and never above
    /// `max_rate`.
    fn merging_rate_cap(&self, s: &Stats) -> f64 {
        (Self::rmap_pages(s) / MIN_MERGING_PASS_S)
            .max(self.cfg.start_rate)
            .min(self.cfg.max_rate)
    }

    /// The shortest idle pass that keeps ksmd within the idle CPU budget,
    /// at what the last pass cost.
    fn budget_pass_s(&self) -> f64 {
        (self.last_pass_cpu / self.cfg.idle_cpu_budget.max(1e-6)).max(self.cfg.idle_pass_s)
    }

    /// Merging `gain` bytes for `cpu` ksmd CPU-seconds pays: enough pages,
    /// and at least the pay threshold per CPU-second (a tick or a pass).
    fn pays(&self, gain: u64, cpu: f64) -> bool {
        gain >= self.cfg.min_gain_pages * PAGE
            && gain as f64 >= self.cfg.pay_bytes_per_cpu_s * cpu.max(1e-4)
    }

    /// Merged pages lost since the controller started: every tick's fall in
    /// pages saved (swapped out and back in as copies, unmerged by a write).
    pub fn lost_pages(&self) -> u64 {
        self.lost_pages
    }

    /// Pages were being swapped in over the last tick.
    pub fn paging(&self) -> bool {
        self.paging
    }

    /// ksmd's CPU budget now: larger while the tenants page.
    fn budget(&self) -> f64 {
        if self.paging {
            self.cfg.cpu_budget * self.cfg.paging_budget_factor
        } else {
            self.cfg.cpu_budget
        }
    }

    /// What the last whole pass cost ksmd, CPU-seconds.
    pub fn last_pass_cpu_s(&self) -> f64 {
        self.last_pass_cpu
    }

    fn start_idling(&mut self, m: &Memory) {
        self.phase = Phase::Idling;
        self.idle_pass = self.budget_pass_s().min(self.cfg.max_idle_pass_s);
        self.idle_avail_kb = m.available_kb;
        self.idle_lost = self.lost_pages;
        self.idle_swpin = m.swapped_in_pages;
    }

    fn decide(&self, why: String) -> Decision {
        let (p, s) = self.knobs(self.rate);
        Decision {
            run: self.phase != Phase::Off,
            pages_to_scan: p,
            sleep_millisecs: s,
            ksmd_nice: self.nice,
            phase: self.phase,
            sweep: false,
            smart_scan: !matches!(self.sweep, SweepState::Merging { .. }),
            why,
        }
    }

    /// What the sweep a decision asked for brought back in: if merging its
    /// duplicates pays for the two passes ksmd needs over the mergeable
    /// memory to merge them (a page it has not seen is only checksummed on
    /// its first), ksmd merges them (the decision to apply); otherwise
    /// sweeping waits for swap to grow.
    pub fn swept(
        &mut self,
        p: &crate::swapin::Progress,
        s: &Stats,
        m: &Memory,
    ) -> Option<Decision> {
        if self.sweep != SweepState::Running {
            return None;
        }
        let cost = SWEEP_MERGE_PASSES * self.last_pass_cpu;
        if self.pressure && self.pays(p.duplicate_pages * PAGE, cost) {
            self.sweep = SweepState::Merging {
                saved_before: s.saved(),
            };
            return Some(self.start_merging(
                s,
                &format!(
                    "{} MiB of the tenants' swapped-out mergeable memory brought back in, {} MiB of it duplicates: merging them",
                    p.brought_pages >> 8,
                    p.duplicate_pages >> 8
                ),
            ));
        }
        self.sweep = SweepState::Spent {
            swap_pages: m.swap_used_pages(),
        };
        // The sweep's own swap-ins were weighed above: they are no sign of
        // duplicates made resident, so they must not wake merging (bench
        // ksm saw 33 MiB of them wake a 9 s merging phase that found
        // nothing).
        self.idle_swpin = m.swapped_in_pages;
        None
    }

    fn start_merging(&mut self, s: &Stats, why: &str) -> Decision {
        self.phase = Phase::Merging;
        // Merging for another reason ends a sweep under way (the caller
        // drops it): it may run again once idle.
        if self.sweep == SweepState::Running {
            self.sweep = SweepState::Ready;
        }
        // Unless a pass has just ended, ksmd is part-way through one: what
        // that pass finds is no evidence about the memory it did not cover.
        self.partial_pass = self.last.is_none_or(|l| l.full_scans == s.full_scans);
        self.rate = self.cfg.start_rate;
        self.empty_passes = 0;
        self.merged_this_phase = false;
        self.pass_start_saved = s.saved();
        self.pass_start_lost = self.lost_pages;
        self.decide(why.to_string())
    }

    /// One tick: the counters now, the host's memory, seconds since the last tick.
    pub fn step(&mut self, s: &Stats, m: &Memory, dt: f64) -> Decision {
        self.pressure = self.under_pressure(m);
        let Some(last) = self.last.replace(*s) else {
            self.pass_start_cpu = s.ksmd_cpu;
            self.pass_start_swpin = m.swapped_in_pages;
            self.tick_swpin = m.swapped_in_pages;
            return if self.pressure {
                self.start_merging(s, "memory pressure: start merging")
            } else {
                self.phase = Phase::Off;
                self.decide("no memory pressure: KSM off".into())
            };
        };
        let dt = dt.max(1e-3);
        let lost_now = last.saved().saturating_sub(s.saved()) / PAGE;
        self.lost_pages += lost_now;
        self.paging = self.pressure
            && m.swapped_in_pages.saturating_sub(self.tick_swpin) as f64
                >= self.cfg.paging_pages_per_s * dt;
        self.tick_swpin = m.swapped_in_pages;
        let cpu_now = ((s.ksmd_cpu - last.ksmd_cpu) / dt).max(0.0);
        self.cpu = 0.5 * self.cpu + 0.5 * cpu_now;
        self.cpu_share = self.cpu;
        self.wait_share = ((s.ksmd_wait - last.ksmd_wait) / dt).clamp(0.0, 1.0);
        let gained = s.saved().saturating_sub(last.saved());
        self.yield_bytes_per_cpu_s = gained as f64 / ((s.ksmd_cpu - last.ksmd_cpu).max(1e-4));
        let pays = self.pays(gained, s.ksmd_cpu - last.ksmd_cpu);
        let mut empty_pass_done = false;
        if s.full_scans > last.full_scans
            && self.partial_pass
            && s.full_scans == last.full_scans + 1
        {
            // The end of a pass this phase saw only part of: start counting now.
            self.partial_pass = false;
            self.pass_start_saved = s.saved();
            self.pass_start_cpu = s.ksmd_cpu;
            self.pass_start_swpin = m.swapped_in_pages;
            self.pass_start_lost = self.lost_pages;
        } else if s.full_scans > last.full_scans {
            self.partial_pass = false;
            let pass_gain = s.saved().saturating_sub(self.pass_start_saved);
            // Exact when one pass ended this tick (always, but at the fastest rates).
            let passes = (s.full_scans - last.full_scans) as f64;
            let pass_cpu = (s.ksmd_cpu - self.pass_start_cpu).max(0.0);
            self.last_pass_cpu = pass_cpu / passes;
            self.pass_start_cpu = s.ksmd_cpu;
            self.pass_start_saved = s.saved();
            let swapped_in = m.swapped_in_pages.saturating_sub(self.pass_start_swpin);
            self.pass_start_swpin = m.swapped_in_pages;
            let pass_lost = self.lost_pages - self.pass_start_lost;
            self.pass_start_lost = self.lost_pages;
            // A pass that merged less than it cost (by the pay threshold) is
            // as good as empty on a settled host: chasing a few stragglers
            // at full speed costs more than the idle passes that pick them
            // up anyway. Under paging its net gain hides what it merged
            // (merged pages swapped out meanwhile): any real net gain pays,
            // and so does a gross gain (net plus what was lost) worth its CPU.
            let paging = self.pressure && swapped_in >= self.cfg.min_gain_pages;
            let paid = if paging {
                pass_gain >= self.cfg.min_gain_pages * PAGE
                    || self.pays(pass_gain + pass_lost * PAGE, pass_cpu)
            } else {
                self.pays(pass_gain, pass_cpu)
            };
            empty_pass_done = !paid;
            if paid {
                self.merged_this_phase = true;
                self.empty_passes = 0;
            } else {
                self.empty_passes += 1;
            }
        }
        // Two empty passes prove new memory has nothing (its first pass only
        // checksums); after a pass that merged, one empty pass is enough —
        // the idle passes still catch stragglers, and each pass costs the
        // same CPU whatever its speed.
        let nothing_left =
            self.empty_passes >= 2 || (self.empty_passes == 1 && self.merged_this_phase);
        match self.phase {
            Phase::Off => {
                self.nice = crate::sysfs::KSMD_DEFAULT_NICE;
                if self.pressure {
                    return self.start_merging(s, "memory pressure: start merging");
                }
                self.decide("no memory pressure: KSM off".into())
            }
            Phase::Idling => {
                if pays {
                    return self.start_merging(s, "new duplicates found: merging again");
                }
                self.nice = crate::sysfs::KSMD_DEFAULT_NICE;
                if !self.pressure {
                    self.phase = Phase::Off;
                    return self
                        .decide("no memory pressure and nothing left to gain: KSM off".into());
                }
                if self.empty_passes == 0 {
                    return self
                        .start_merging(s, "the last pass found new duplicates: merging again");
                }
                let sweeping = self.sweep == SweepState::Running;
                let lost = self.lost_pages - self.idle_lost;
                if self.merged_this_phase && !sweeping && lost >= self.cfg.lost_wake_pages {
                    return self.start_merging(
                        s,
                        &format!(
                            "{} MiB of merged pages lost since idling began (swapped out, back as copies): merging again",
                            lost >> 8
                        ),
                    );
                }
                let back = m.swapped_in_pages.saturating_sub(self.idle_swpin);
                if self.merged_this_phase && !sweeping && back >= self.cfg.swap_wake_pages {
                    return self.start_merging(
                        s,
                        &format!(
                            "{} MiB swapped back in since idling began (duplicates whose copy was in swap): merging again",
                            back >> 8
                        ),
                    );
                }
                let grown = self.idle_avail_kb.saturating_sub(m.available_kb);
                if grown as f64 > self.cfg.wake_on_growth * m.total_kb as f64 {
                    return self.start_merging(
                        s,
                        &format!(
                            "{} MiB more memory in use since idling began: merging again",
                            grown >> 10
                        ),
                    );
                }
                // Follow memory being freed, so growth is measured from the low point.
                self.idle_avail_kb = self.idle_avail_kb.max(m.available_kb);
                if empty_pass_done {
                    self.idle_pass = (self.idle_pass * 2.0)
                        .max(self.budget_pass_s())
                        .min(self.cfg.max_idle_pass_s);
                }
                self.rate = self.idle_rate(s);
                if self.cpu > self.cfg.cpu_budget / 4.0 {
                    self.rate = self.cfg.min_rate;
                }
                let swap = m.swap_used_pages();
                if let SweepState::Spent { swap_pages } = self.sweep {
                    if swap >= swap_pages + self.cfg.sweep_regrow_pages {
                        self.sweep = SweepState::Ready;
                    }
                }
                // Not only after merging that merged: tenants wholly in
                // swap leave ksmd nothing to merge until a sweep.
                if sweeping || (self.sweep == SweepState::Ready && swap >= self.cfg.sweep_min_pages)
                {
                    self.sweep = SweepState::Running;
                    let mut d = self.decide(format!(
                        "nothing new to merge: idling; {} MiB in swap: bringing the tenants' swapped-out mergeable pages back in",
                        swap >> 8
                    ));
                    d.sweep = true;
                    return d;
                }
                self.decide(format!(
                    "nothing new to merge: idling (a pass per {:.0} s)",
                    self.idle_pass
                ))
            }
            Phase::Merging => {
                if nothing_left {
                    if let SweepState::Merging { saved_before } = self.sweep {
                        let gain = s.saved().saturating_sub(saved_before);
                        self.sweep = if gain >= self.cfg.min_gain_pages * PAGE {
                            SweepState::Ready
                        } else {
                            SweepState::Spent {
                                swap_pages: m.swap_used_pages(),
                            }
                        };
                    }
                    if self.pressure {
                        self.start_idling(m);
                    } else {
                        self.phase = Phase::Off;
                    }
                    self.rate = self.idle_rate(s);
                    self.nice = crate::sysfs::KSMD_DEFAULT_NICE;
                    return self.decide(
                        if self.pressure {
                            "nothing left worth a pass's CPU: idling"
                        } else {
                            "nothing left to gain and no memory pressure: KSM off"
                        }
                        .into(),
                    );
                }
                let budget = self.budget();
                // A busy host can keep nice-5 ksmd waiting for a CPU for
                // seconds, whatever its batch size: raise its priority (the
                // budget still bounds its CPU through the rate).
                if self.wait_share > 0.3 && self.cpu < 0.5 * budget && self.nice > self.cfg.min_nice
                {
                    self.nice = (self.nice - 5).max(self.cfg.min_nice);
                    self.rate = (self.rate * 1.5).min(self.merging_rate_cap(s));
                    return self.decide(format!(
                        "ksmd waited {:.0}% of the last second for a CPU: priority up to nice {}",
                        self.wait_share * 100.0,
                        self.nice
                    ));
                }
                let why = if self.cpu > budget {
                    self.rate = (self.rate * budget / self.cpu * 0.9).max(self.cfg.min_rate);
                    format!(
                        "ksmd at {:.0}% of a core, over the {:.0}% budget: slower",
                        self.cpu * 100.0,
                        budget * 100.0
                    )
                } else if self.cpu < 0.8 * budget && s.run == 1 {
                    self.rate = (self.rate * 1.5).min(self.merging_rate_cap(s));
                    if pays {
                        "merging pays: faster".to_string()
                    } else {
                        "looking for duplicates within the budget: faster".to_string()
                    }
                } else {
                    "at the CPU budget".to_string()
                };
                self.decide(why)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mem(avail: f64) -> Memory {
        Memory {
            total_kb: 1 << 20,
            available_kb: ((1u64 << 20) as f64 * avail) as u64,
            free_kb: 0,
            psi_some10: None,
            swapped_in_pages: 0,
            swap_used_kb: 0,
        }
    }
    /// Under pressure, `swapped` pages swapped in since boot.
    fn paging(swapped: u64) -> Memory {
        Memory {
            swapped_in_pages: swapped,
            ..mem(0.1)
        }
    }
    fn st(sharing: u64, scans: u64, cpu: f64) -> Stats {
        Stats {
            run: 1,
            pages_sharing: sharing,
            full_scans: scans,
            ksmd_cpu: cpu,
            ..Default::default()
        }
    }

    #[test]
    fn off_without_pressure_merging_with_it() {
        let mut a = Adaptive::new(AdaptiveConfig::default());
        let d = a.step(&st(0, 0, 0.0), &mem(0.9), 1.0);
        assert!(!d.run && d.phase == Phase::Off);
        let d = a.step(&st(0, 0, 0.0), &mem(0.1), 1.0);
        assert!(d.run && d.phase == Phase::Merging);
    }

    #[test]
    fn faster_under_budget_slower_over_it() {
        let mut a = Adaptive::new(AdaptiveConfig::default());
        a.step(&st(0, 0, 0.0), &mem(0.1), 1.0);
        let r0 = a.rate();
        a.step(&st(10_000, 0, 0.01), &mem(0.1), 1.0);
        assert!(a.rate() > r0, "cheap and paying: faster");
        let r1 = a.rate();
        // ksmd burns half a core: back under budget.
        a.step(&st(20_000, 0, 0.51), &mem(0.1), 1.0);
        a.step(&st(30_000, 0, 1.01), &mem(0.1), 1.0);
        assert!(a.rate() < r1, "over budget: slower");
    }

    #[test]
    fn two_empty_passes_idle_then_off_without_pressure() {
        let mut a = Adaptive::new(AdaptiveConfig::default());
        a.step(&st(0, 0, 0.0), &mem(0.1), 1.0);
        // The end of the pass ksmd was in when merging began: no evidence.
        let d = a.step(&st(0, 1, 0.01), &mem(0.1), 1.0);
        assert_eq!(d.phase, Phase::Merging);
        a.step(&st(5000, 2, 0.05), &mem(0.1), 1.0);
        // That pass merged: one empty pass after it is enough.
        let d = a.step(&st(5000, 3, 0.10), &mem(0.1), 1.0);
        assert_eq!(d.phase, Phase::Idling);
        assert!(d.run);
        let d = a.step(&st(5000, 4, 0.15), &mem(0.9), 1.0);
        assert_eq!(d.phase, Phase::Off);
        assert!(!d.run);
        // Pressure again: merging again.
        let d = a.step(&st(5000, 4, 0.15), &mem(0.1), 1.0);
        assert_eq!(d.phase, Phase::Merging);
    }

    #[test]
    fn a_starving_ksmd_gets_priority_back_to_default_when_done() {
        let mut a = Adaptive::new(AdaptiveConfig::default());
        let st = |sharing, scans, cpu, wait| Stats {
            run: 1,
            pages_sharing: sharing,
            full_scans: scans,
            ksmd_cpu: cpu,
            ksmd_wait: wait,
            ..Default::default()
        };
        a.step(&st(0, 0, 0.0, 0.0), &mem(0.1), 1.0);
        // Runnable 90% of the second, on a CPU 0.1%.
        let d = a.step(&st(0, 0, 0.001, 0.9), &mem(0.1), 1.0);
        assert_eq!(d.ksmd_nice, 0);
        let d = a.step(&st(0, 0, 0.002, 1.8), &mem(0.1), 1.0);
        assert_eq!(d.ksmd_nice, -5);
        let d = a.step(&st(0, 0, 0.003, 2.7), &mem(0.1), 1.0);
        assert_eq!(d.ksmd_nice, -10);
        let d = a.step(&st(0, 0, 0.004, 3.6), &mem(0.1), 1.0);
        assert_eq!(d.ksmd_nice, -10, "never above the configured ceiling");
        // A partial pass, then two empty passes: idling at the kernel's priority.
        a.step(&st(0, 1, 0.005, 3.6), &mem(0.1), 1.0);
        a.step(&st(0, 2, 0.006, 3.6), &mem(0.1), 1.0);
        let d = a.step(&st(0, 3, 0.007, 3.6), &mem(0.1), 1.0);
        assert_eq!((d.phase, d.ksmd_nice), (Phase::Idling, 5));
    }

    #[test]
    fn knobs_cover_low_rates_with_longer_sleeps() {
        let a = Adaptive::new(AdaptiveConfig::default());
        assert_eq!(a.knobs(50_000.0), (1000, 20));
        assert_eq!(a.knobs(500.0), (32, 64));
    }

    #[test]
    fn idle_passes_back_off_and_memory_growth_wakes_merging() {
        let mut a = Adaptive::new(AdaptiveConfig::default());
        let st = |scans, cpu: f64| Stats {
            run: 1,
            pages_sharing: 100_000,
            general_profit: 100_000 * 4096 - 400_000 * 64,
            full_scans: scans,
            ksmd_cpu: cpu,
            ..Default::default()
        };
        a.step(&st(0, 0.0), &mem(0.1), 1.0);
        a.step(&st(1, 0.05), &mem(0.1), 1.0);
        let d = a.step(&st(2, 0.1), &mem(0.1), 1.0);
        assert_eq!(
            d.phase,
            Phase::Merging,
            "one empty pass over new memory proves nothing"
        );
        let d = a.step(&st(3, 0.2), &mem(0.1), 1.0);
        assert_eq!(d.phase, Phase::Idling);
        let r0 = a.rate();
        assert_eq!(a.idle_pass_s(), 120.0);
        // Each empty idle pass doubles the pass length (halves the rate), up to the ceiling.
        for (k, want) in [(4, 240.0), (5, 480.0), (6, 960.0), (7, 1920.0), (8, 1920.0)] {
            let d = a.step(&st(k, 0.2), &mem(0.1), 1.0);
            assert_eq!((d.phase, a.idle_pass_s()), (Phase::Idling, want));
        }
        assert!(a.rate() < r0 / 4.0 + 1.0);
        // 5% of memory more in use: merging again, from the start rate.
        let d = a.step(&st(8, 0.2), &mem(0.04), 1.0);
        assert_eq!(d.phase, Phase::Merging, "{}", d.why);
        assert!(d.why.contains("more memory in use"), "{}", d.why);
    }

    #[test]
    fn a_pass_that_saves_less_than_it_costs_ends_merging() {
        let mut a = Adaptive::new(AdaptiveConfig::default());
        a.step(&st(0, 0, 0.0), &mem(0.1), 1.0);
        a.step(&st(0, 1, 0.3), &mem(0.1), 1.0);
        // 400 MiB for 0.3 CPU-s: pays.
        let d = a.step(&st(102_400, 2, 0.6), &mem(0.1), 1.0);
        assert_eq!(d.phase, Phase::Merging);
        // 4 MiB (pages swapped back in since) for 0.3 CPU-s: 13 MiB per
        // CPU-s, under the 16 MiB threshold — nothing left worth chasing.
        let d = a.step(&st(103_424, 3, 0.9), &mem(0.1), 1.0);
        assert_eq!(d.phase, Phase::Idling, "{}", d.why);
    }

    #[test]
    fn idle_passes_stay_within_the_idle_cpu_budget() {
        let mut a = Adaptive::new(AdaptiveConfig::default());
        let st = |sharing, scans, cpu: f64| Stats {
            run: 1,
            pages_sharing: sharing,
            full_scans: scans,
            ksmd_cpu: cpu,
            ..Default::default()
        };
        a.step(&st(0, 0, 10.0), &mem(0.1), 1.0);
        a.step(&st(0, 1, 10.1), &mem(0.1), 1.0);
        a.step(&st(100_000, 2, 10.6), &mem(0.1), 1.0);
        // The confirming pass cost 0.5 CPU-s: at 0.1% of a core, 500 s per idle pass.
        let d = a.step(&st(100_000, 3, 11.1), &mem(0.1), 1.0);
        assert_eq!(d.phase, Phase::Idling);
        assert!((a.last_pass_cpu_s() - 0.5).abs() < 1e-9);
        assert!(
            (a.idle_pass_s() - 500.0).abs() < 1e-6,
            "{}",
            a.idle_pass_s()
        );
    }

    /// What `pagefleet bench ksm` met on 2026-11-28: tenants paging when the
    /// controller starts. A pass that merged 90 MiB, then passes that net a
    /// few MiB for their CPU (merged pages are swapped out as fast as new
    /// ones merge): while pages are swapped in, merging goes on; idling
    /// after it, swap-ins wake it again.
    #[test]
    fn under_paging_a_pass_that_nets_little_keeps_merging() {
        let mut a = Adaptive::new(AdaptiveConfig::default());
        a.step(&st(0, 0, 0.0), &paging(0), 1.0);
        a.step(&st(0, 1, 0.3), &paging(10_000), 1.0);
        let d = a.step(&st(23_040, 2, 0.6), &paging(20_000), 1.0);
        assert_eq!(d.phase, Phase::Merging);
        // 4 MiB net for 0.3 CPU-s (13 MiB per CPU-s, under the threshold
        // that would end merging on a settled host), 40 MiB swapped in.
        let d = a.step(&st(24_064, 3, 0.9), &paging(30_240), 1.0);
        assert_eq!(d.phase, Phase::Merging, "{}", d.why);
        let d = a.step(&st(25_088, 4, 1.2), &paging(40_480), 1.0);
        assert_eq!(d.phase, Phase::Merging, "{}", d.why);
        // A pass that nets nothing (under a MiB) ends it, paging or not.
        let d = a.step(&st(25_100, 5, 1.5), &paging(50_720), 1.0);
        assert_eq!(d.phase, Phase::Idling, "{}", d.why);
        // 2 MiB of merged pages lost: not yet; 4 MiB: merging again.
        let d = a.step(&st(24_600, 5, 1.5), &paging(51_000), 1.0);
        assert_eq!(d.phase, Phase::Idling, "{}", d.why);
        let d = a.step(&st(24_000, 5, 1.5), &paging(51_300), 1.0);
        assert_eq!(d.phase, Phase::Merging, "{}", d.why);
        assert!(d.why.contains("merged pages lost"), "{}", d.why);
        assert_eq!(a.lost_pages(), 1100);
    }

    /// What the last round of a full-size run showed: idling at 451 MiB
    /// while the tenants still faulted in copies of duplicates from swap;
    /// nothing merged was lost, so only the swap-ins can tell.
    #[test]
    fn idle_wakes_when_duplicates_come_back_from_swap() {
        let mut a = Adaptive::new(AdaptiveConfig::default());
        a.step(&st(0, 0, 0.0), &paging(0), 1.0);
        a.step(&st(0, 1, 0.3), &paging(10_000), 1.0);
        a.step(&st(115_000, 2, 0.6), &paging(20_000), 1.0);
        let d = a.step(&st(115_100, 3, 0.9), &paging(30_000), 1.0);
        assert_eq!(d.phase, Phase::Idling, "{}", d.why);
        let d = a.step(&st(115_100, 3, 0.9), &paging(32_000), 1.0);
        assert_eq!(d.phase, Phase::Idling, "{}", d.why);
        let d = a.step(&st(115_100, 3, 0.9), &paging(34_200), 1.0);
        assert_eq!(d.phase, Phase::Merging, "{}", d.why);
        assert!(d.why.contains("swapped back in"), "{}", d.why);
    }

    /// The flapping a full-size run showed: passes that net nothing because
    /// the churn swaps out as much as they merge. What a pass merged gross
    /// (its net plus the merged pages lost meanwhile) keeps it merging
    /// while that pays for its CPU.
    #[test]
    fn under_paging_what_a_pass_merged_gross_keeps_merging() {
        let mut a = Adaptive::new(AdaptiveConfig::default());
        a.step(&st(0, 0, 0.0), &paging(0), 1.0);
        a.step(&st(0, 1, 0.3), &paging(10_000), 1.0);
        a.step(&st(30_000, 2, 0.6), &paging(20_000), 1.0);
        // 10 000 merged pages lost, 10 100 merged again: nets 100 pages.
        a.step(&st(20_000, 2, 0.7), &paging(30_000), 1.0);
        let d = a.step(&st(30_100, 3, 0.9), &paging(40_000), 1.0);
        assert_eq!(d.phase, Phase::Merging, "{}", d.why);
        // The same pass on a settled host (no swap-ins) ends merging.
        let mut b = Adaptive::new(AdaptiveConfig::default());
        b.step(&st(0, 0, 0.0), &mem(0.1), 1.0);
        b.step(&st(0, 1, 0.3), &mem(0.1), 1.0);
        b.step(&st(30_000, 2, 0.6), &mem(0.1), 1.0);
        b.step(&st(20_000, 2, 0.7), &mem(0.1), 1.0);
        let d = b.step(&st(30_100, 3, 0.9), &mem(0.1), 1.0);
        assert_eq!(d.phase, Phase::Idling, "{}", d.why);
    }

    #[test]
    fn while_paging_ksmd_gets_a_larger_budget() {
        let mut a = Adaptive::new(AdaptiveConfig::default());
        a.step(&st(0, 0, 0.0), &paging(0), 1.0);
        // 15% of a core (smoothed): over the 10% budget on a settled host...
        let d = a.step(&st(1000, 0, 0.3), &mem(0.1), 1.0);
        assert!(d.why.contains("over the 10% budget"), "{}", d.why);
        // ...within the 15% one (12.5% smoothed) while 1000 pages/s are
        // swapped in.
        let d = a.step(&st(2000, 0, 0.4), &paging(1000), 1.0);
        assert!(a.paging());
        assert!(!d.why.contains("over the"), "{}", d.why);
    }

    #[test]
    fn swap_ins_do_not_wake_a_controller_whose_merging_found_nothing() {
        let mut a = Adaptive::new(AdaptiveConfig::default());
        a.step(&st(0, 0, 0.0), &paging(0), 1.0);
        a.step(&st(0, 1, 0.3), &paging(10_000), 1.0);
        a.step(&st(0, 2, 0.6), &paging(20_000), 1.0);
        let d = a.step(&st(0, 3, 0.9), &paging(30_000), 1.0);
        assert_eq!(d.phase, Phase::Idling, "{}", d.why);
        let d = a.step(&st(0, 3, 0.9), &paging(90_000), 1.0);
        assert_eq!(d.phase, Phase::Idling, "{}", d.why);
    }

    #[test]
    fn without_paging_the_cpu_threshold_still_ends_merging() {
        let mut a = Adaptive::new(AdaptiveConfig::default());
        a.step(&st(0, 0, 0.0), &paging(0), 1.0);
        a.step(&st(0, 1, 0.3), &paging(0), 1.0);
        a.step(&st(102_400, 2, 0.6), &paging(0), 1.0);
        let d = a.step(&st(103_424, 3, 0.9), &paging(100), 1.0);
        assert_eq!(d.phase, Phase::Idling, "{}", d.why);
    }

    /// Under pressure with `swap_mib` MiB in swap, nothing swapped in.
    fn in_swap(swap_mib: u64) -> Memory {
        Memory {
            swap_used_kb: swap_mib << 10,
            ..mem(0.1)
        }
    }

    /// Merge 115 000 pages, then idle, with `swap` MiB in swap throughout:
    /// the first idle tick's decision.
    fn idle_after_merging(swap: u64) -> (Adaptive, Decision) {
        let mut a = Adaptive::new(AdaptiveConfig::default());
        a.step(&st(0, 0, 0.0), &in_swap(swap), 1.0);
        a.step(&st(0, 1, 0.3), &in_swap(swap), 1.0);
        a.step(&st(115_000, 2, 0.6), &in_swap(swap), 1.0);
        let d = a.step(&st(115_100, 3, 0.9), &in_swap(swap), 1.0);
        assert_eq!(d.phase, Phase::Idling, "{}", d.why);
        let d = a.step(&st(115_100, 3, 0.9), &in_swap(swap), 1.0);
        (a, d)
    }

    /// The stall's last form (`pagefleet bench ksm`, a round at 462 MiB
    /// where others reached 506): cold duplicates in swap that nothing
    /// touches. An idle controller with swap in use asks for a sweep, and
    /// merges what it brought in.
    #[test]
    fn idle_with_swap_in_use_sweeps_and_merges_what_came_back() {
        let (mut a, d) = idle_after_merging(320);
        assert_eq!(d.phase, Phase::Idling, "{}", d.why);
        assert!(d.sweep, "{}", d.why);
        // The sweep brought 100 MiB back in: merging again.
        let s = st(115_100, 3, 0.9);
        let d = a
            .swept(&swept(25_600, 12_800), &s, &in_swap(220))
            .expect("merging");
        assert_eq!(d.phase, Phase::Merging, "{}", d.why);
        assert!(!d.sweep);
        assert!(
            !d.smart_scan,
            "smart_scan would skip the swept pages' partners"
        );
        assert!(d.why.contains("100 MiB"), "{}", d.why);
        assert!(d.why.contains("50 MiB of it duplicates"), "{}", d.why);
        // Its passes merge 11 000 pages, then one finds nothing: idle, and
        // since that paid, another sweep may follow.
        a.step(&st(115_100, 4, 1.2), &in_swap(220), 1.0);
        a.step(&st(126_100, 5, 1.5), &in_swap(220), 1.0);
        let mut d = a.step(&st(126_100, 6, 1.8), &in_swap(220), 1.0);
        for scans in 7..10 {
            if d.phase == Phase::Idling {
                break;
            }
            d = a.step(&st(126_100, scans, 2.1), &in_swap(220), 1.0);
        }
        assert_eq!(d.phase, Phase::Idling, "{}", d.why);
        assert!(d.smart_scan);
        let d = a.step(&st(126_100, 9, 2.1), &in_swap(220), 1.0);
        assert!(d.sweep, "{}", d.why);
    }

    fn swept(brought_pages: u64, duplicate_pages: u64) -> crate::swapin::Progress {
        crate::swapin::Progress {
            brought_pages,
            duplicate_pages,
            ..Default::default()
        }
    }

    /// `pagefleet bench ksm` saw a sweep bring 25 MiB back in with no
    /// duplicates among them and ksmd then spend 1.2 CPU-seconds, a fifth of
    /// its whole run, finding nothing: merging what a sweep brought must pay
    /// for ksmd's two passes over the mergeable memory.
    #[test]
    fn a_sweep_merges_only_duplicates_worth_two_passes() {
        let (mut a, d) = idle_after_merging(320);
        assert!(d.sweep);
        // Passes cost 0.3 CPU-s here: two pay for 9.6 MiB at 16 MiB/CPU-s.
        assert!((a.last_pass_cpu_s() - 0.3).abs() < 1e-6);
        let s = st(115_100, 3, 0.9);
        assert!(a.swept(&swept(6_400, 0), &s, &in_swap(295)).is_none());
        let d = a.step(&s, &in_swap(295), 1.0);
        assert!(!d.sweep, "{}", d.why);
        assert_eq!(d.phase, Phase::Idling, "{}", d.why);
        let (mut a, _) = idle_after_merging(320);
        assert!(a.swept(&swept(6_400, 2_000), &s, &in_swap(295)).is_none());
        let (mut a, _) = idle_after_merging(320);
        let d = a
            .swept(&swept(6_400, 2_600), &s, &in_swap(295))
            .expect("merging");
        assert_eq!(d.phase, Phase::Merging, "{}", d.why);
    }

    #[test]
    fn a_sweeps_own_swap_ins_do_not_wake_merging() {
        let (mut a, d) = idle_after_merging(320);
        assert!(d.sweep);
        let s = st(115_100, 3, 0.9);
        // It brought 42 MiB in, none of them duplicates.
        let after = Memory {
            swapped_in_pages: 42 << 8,
            ..in_swap(278)
        };
        assert!(a.swept(&swept(42 << 8, 0), &s, &after).is_none());
        let d = a.step(&s, &after, 1.0);
        assert_eq!(d.phase, Phase::Idling, "{}", d.why);
        // Clients swapping pages back in afterwards still wake it.
        let later = Memory {
            swapped_in_pages: (42 << 8) + 8192,
            ..in_swap(278)
        };
        let d = a.step(&s, &later, 1.0);
        assert_eq!(d.phase, Phase::Merging, "{}", d.why);
    }

    #[test]
    fn a_sweep_that_brings_little_waits_for_swap_to_grow() {
        let (mut a, d) = idle_after_merging(320);
        assert!(d.sweep);
        let s = st(115_100, 3, 0.9);
        assert!(a.swept(&swept(100, 100), &s, &in_swap(320)).is_none());
        let d = a.step(&s, &in_swap(320), 1.0);
        assert!(!d.sweep, "{}", d.why);
        // 64 MiB more in swap: worth another look.
        let d = a.step(&s, &in_swap(384), 1.0);
        assert!(d.sweep, "{}", d.why);
    }

    #[test]
    fn a_sweep_whose_merging_saves_little_is_not_repeated() {
        let (mut a, _) = idle_after_merging(320);
        let s = st(115_100, 3, 0.9);
        a.swept(&swept(25_600, 12_800), &s, &in_swap(220))
            .expect("merging");
        a.step(&st(115_100, 4, 1.2), &in_swap(220), 1.0);
        a.step(&st(115_150, 5, 1.5), &in_swap(220), 1.0);
        let mut d = a.step(&st(115_150, 6, 1.8), &in_swap(220), 1.0);
        for scans in 7..10 {
            if d.phase == Phase::Idling {
                break;
            }
            d = a.step(&st(115_150, scans, 2.1), &in_swap(220), 1.0);
        }
        assert_eq!(d.phase, Phase::Idling, "{}", d.why);
        let d = a.step(&st(115_150, 9, 2.1), &in_swap(220), 1.0);
        assert_eq!(d.phase, Phase::Idling, "{}", d.why);
        assert!(!d.sweep, "{}", d.why);
    }

    #[test]
    fn no_sweep_with_little_in_swap_but_one_when_all_duplicates_are_in_it() {
        let (_, d) = idle_after_merging(8);
        assert_eq!(d.phase, Phase::Idling);
        assert!(!d.sweep, "8 MiB in swap is not worth a sweep");
        // Merging found nothing (the duplicates are all in swap): a sweep,
        // and once it brings nothing, no more.
        let mut a = Adaptive::new(AdaptiveConfig::default());
        a.step(&st(0, 0, 0.0), &in_swap(320), 1.0);
        a.step(&st(0, 1, 0.3), &in_swap(320), 1.0);
        a.step(&st(0, 2, 0.6), &in_swap(320), 1.0);
        let d = a.step(&st(0, 3, 0.9), &in_swap(320), 1.0);
        assert_eq!(d.phase, Phase::Idling, "{}", d.why);
        let d = a.step(&st(0, 3, 0.9), &in_swap(320), 1.0);
        assert!(d.sweep, "{}", d.why);
        assert!(a
            .swept(&swept(0, 0), &st(0, 3, 0.9), &in_swap(320))
            .is_none());
        let d = a.step(&st(0, 3, 0.9), &in_swap(320), 1.0);
        assert!(!d.sweep, "{}", d.why);
    }

    #[test]
    fn merging_never_runs_a_pass_faster_than_the_floor() {
        // 300 000 pages tracked (general_profit = -rmap x 64 with nothing
        // shared): the rate stops at 200 000 pages/s, a pass per 1.5 s,
        // however cheap ksmd's passes are.
        let tracked = |scans, cpu| Stats {
            general_profit: -300_000 * 64,
            ..st(0, scans, cpu)
        };
        let mut a = Adaptive::new(AdaptiveConfig::default());
        a.step(&tracked(0, 0.0), &mem(0.1), 1.0);
        for i in 1..20 {
            let d = a.step(&tracked(0, 0.001 * i as f64), &mem(0.1), 1.0);
            assert_eq!(d.phase, Phase::Merging, "{}", d.why);
        }
        assert!((a.rate() - 200_000.0).abs() < 1.0, "rate {}", a.rate());
        // Before ksmd has seen any page, the start rate is the floor.
        let mut a = Adaptive::new(AdaptiveConfig::default());
        a.step(&st(0, 0, 0.0), &mem(0.1), 1.0);
        for i in 1..10 {
            a.step(&st(0, 0, 0.001 * i as f64), &mem(0.1), 1.0);
        }
        assert_eq!(a.rate(), AdaptiveConfig::default().start_rate);
    }
}
