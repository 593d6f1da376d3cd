//! The two policies, as pure functions of what each tenant did in the last
//! interval, so they are tested on exact sequences.
//!
//! `paper`: Algorithm 1 of paper 004. Every cap_interval, if the tenants'
//! summed bandwidth exceeds the border (90% of the device's maximum), the
//! busiest tenant is capped at rate x its bandwidth for cap_time; IOPS
//! independently; a capped tenant picked again is re-capped from scratch;
//! caps end abruptly when cap_time is over.
//!
//! `guarantee`: every tenant has a minimum (bytes/s and/or IOPS) and a
//! weight. Load is measured as device cost, `IOPS x cost_per_io + bytes/s x
//! cost_per_byte` (a linear model like Linux iocost's, calibrated at startup),
//! as a share of the device. Only while some tenant with demand is below its
//! minimum and the device is busy does it cap tenants above their entitled
//! share (their minimum plus a weighted part of what is left), never below
//! their own minimum, closing half the gap each interval; once nobody has
//! starved for a while caps are raised step by step and finally removed.

use serde::Serialize;

/// One tenant's last interval.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Obs {
    /// Read bytes/s.
    pub rbps: f64,
    /// Write bytes/s.
    pub wbps: f64,
    /// Read IOPS.
    pub riops: f64,
    /// Write IOPS.
    pub wiops: f64,
}

impl Obs {
    /// Bytes/s both ways.
    pub fn bps(&self) -> f64 {
        self.rbps + self.wbps
    }
    /// IOPS both ways.
    pub fn iops(&self) -> f64 {
        self.riops + self.wiops
    }
    /// Whether it did any I/O.
    pub fn active(&self) -> bool {
        self.iops() > 0.0
    }
}

/// A cap on a tenant's total bandwidth and/or IOPS.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Cap {
    /// Bytes/s (None: uncapped).
    pub bps: Option<f64>,
    /// IOPS (None: uncapped).
    pub iops: Option<f64>,
}

impl Cap {
    /// Whether nothing is capped.
    pub fn is_none(&self) -> bool {
        self.bps.is_none() && self.iops.is_none()
    }
}

/// The device's linear cost model: the share of the device one second of
/// this I/O takes.
#[derive(Clone, Copy, Debug, Serialize, serde::Deserialize)]
pub struct Model {
    /// IOPS the device sustains.
    pub max_iops: f64,
    /// Bytes/s it sustains.
    pub max_bps: f64,
}

impl Model {
    /// The share of the device `o` uses.
    pub fn cost(&self, o: &Obs) -> f64 {
        o.iops() / self.max_iops + o.bps() / self.max_bps
    }
}

// ---------------------------------------------------------------- paper

/// Algorithm 1's settings (paper 004).
#[derive(Clone, Debug, Serialize)]
pub struct PaperConfig {
    /// Border: this share of the device's maximum (0.9).
    pub border: f64,
    /// The capped tenant gets rate x its current value.
    pub rate: f64,
    /// How long a cap lasts, s.
    pub cap_time_s: f64,
    /// Seconds between decisions.
    pub cap_interval_s: f64,
}

impl Default for PaperConfig {
    fn default() -> Self {
        PaperConfig {
            border: 0.9,
            rate: 0.5,
            cap_time_s: 60.0,
            cap_interval_s: 5.0,
        }
    }
}

/// Paper 004's Algorithm 1: cap the top tenant when the device is busy.
pub struct Paper {
    /// Its settings.
    pub cfg: PaperConfig,
    /// The device's cost model.
    pub model: Model,
    /// Per tenant: (bandwidth cap, seconds left), (IOPS cap, seconds left).
    bw: Vec<Option<(f64, f64)>>,
    io: Vec<Option<(f64, f64)>>,
}

impl Paper {
    /// The algorithm for `n` tenants.
    pub fn new(cfg: PaperConfig, model: Model, n: usize) -> Paper {
        Paper {
            cfg,
            model,
            bw: vec![None; n],
            io: vec![None; n],
        }
    }

    /// One cap_interval: what each tenant did; the caps to apply.
    pub fn step(&mut self, obs: &[Obs], dt: f64) -> Vec<Cap> {
        for c in self.bw.iter_mut().chain(self.io.iter_mut()) {
            if let Some((_, left)) = c {
                *left -= dt;
                if *left <= 0.0 {
                    *c = None;
                }
            }
        }
        let top = |f: &dyn Fn(&Obs) -> f64| {
            obs.iter()
                .enumerate()
                .max_by(|a, b| f(a.1).total_cmp(&f(b.1)))
                .map(|(i, o)| (i, f(o)))
        };
        let b_sum: f64 = obs.iter().map(|o| o.bps()).sum();
        if b_sum > self.cfg.border * self.model.max_bps {
            if let Some((i, b)) = top(&|o: &Obs| o.bps()) {
                self.bw[i] = Some((self.cfg.rate * b, self.cfg.cap_time_s));
            }
        }
        let i_sum: f64 = obs.iter().map(|o| o.iops()).sum();
        if i_sum > self.cfg.border * self.model.max_iops {
            if let Some((i, v)) = top(&|o: &Obs| o.iops()) {
                self.io[i] = Some((self.cfg.rate * v, self.cfg.cap_time_s));
            }
        }
        (0..obs.len())
            .map(|i| Cap {
                bps: self.bw[i].map(|c| c.0),
                iops: self.io[i].map(|c| c.0),
            })
            .collect()
    }
}

// ------------------------------------------------------------ guarantee

/// The guarantee policy's settings.
#[derive(Clone, Debug, Serialize)]
pub struct GuaranteeConfig {
    /// The device counts as busy above this share of its modelled capacity.
    pub busy: f64,
    /// A tenant is starved below this share of its minimum.
    pub starved_below: f64,
    /// Intervals without starvation before caps start to be raised.
    pub release_after: u32,
    /// Caps grow by this factor per interval while released.
    pub release_step: f64,
    /// Caps are raised only while every uncapped tenant is at least this
    /// share of its minimum (or the device has room).
    pub release_margin: f64,
}

impl Default for GuaranteeConfig {
    fn default() -> Self {
        GuaranteeConfig {
            busy: 0.85,
            starved_below: 0.95,
            release_after: 3,
            release_step: 1.15,
            release_margin: 1.1,
        }
    }
}

/// A tenant's guarantee.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Min {
    /// Its minimum, bytes/s.
    pub bps: f64,
    /// Its minimum, IOPS.
    pub iops: f64,
    /// Its share weight.
    pub weight: f64,
}

/// The guarantee policy: caps only tenants above their entitled share while another starves.
pub struct Guarantee {
    /// Its settings.
    pub cfg: GuaranteeConfig,
    /// The device's cost model.
    pub model: Model,
    /// Each tenant's minimum.
    pub mins: Vec<Min>,
    /// Cap per tenant as a device share (cost units).
    caps: Vec<Option<f64>>,
    calm: u32,
    /// Which tenants starved at the last step.
    pub starved: Vec<bool>,
}

impl Guarantee {
    /// The policy for these tenants.
    pub fn new(cfg: GuaranteeConfig, model: Model, mins: Vec<Min>) -> Guarantee {
        let n = mins.len();
        Guarantee {
            cfg,
            model,
            mins,
            caps: vec![None; n],
            calm: 0,
            starved: vec![false; n],
        }
    }

    /// What tenant i's minimum costs the device: at its current I/O size
    /// when it is doing I/O (64 KiB writes cost per request as well as per
    /// byte), but never more than the larger of its bytes-only cost and an
    /// equal split among the active tenants, so a minimum in bytes/s does
    /// not entitle a 4 KiB tenant to the whole device.
    fn min_cost(&self, i: usize, obs: &[Obs]) -> f64 {
        let m = &self.mins[i];
        let o = &obs[i];
        let nominal = m.iops / self.model.max_iops + m.bps / self.model.max_bps;
        if !(o.active() && o.iops() > 0.0 && o.bps() > 0.0) {
            return nominal;
        }
        let size = o.bps() / o.iops();
        let by_bytes = m.bps / self.model.max_bps + m.bps / size / self.model.max_iops;
        let by_ios = m.iops / self.model.max_iops + m.iops * size / self.model.max_bps;
        let n_active = obs.iter().filter(|o| o.active()).count().max(1) as f64;
        by_bytes.max(by_ios).min(nominal.max(1.0 / n_active))
    }

    /// Below its minimum in its own terms *and* in device cost: a tenant
    /// doing small I/O that occupies its share of the device is not starved
    /// just because its bytes/s are low.
    fn below(&self, i: usize, obs: &[Obs], k: f64) -> bool {
        let m = &self.mins[i];
        let o = &obs[i];
        let own = (m.bps > 0.0 && o.bps() < k * m.bps) || (m.iops > 0.0 && o.iops() < k * m.iops);
        own && self.model.cost(o) < k * self.min_cost(i, obs)
    }

    /// Each tenant's entitled device share: its minimum plus a weighted part
    /// of what the minimums of the active tenants leave.
    pub fn entitlement(&self, obs: &[Obs]) -> Vec<f64> {
        let active: Vec<bool> = obs.iter().map(|o| o.active()).collect();
        let sum_min: f64 = (0..obs.len())
            .filter(|&i| active[i])
            .map(|i| self.min_cost(i, obs))
            .sum();
        let sum_w: f64 = (0..obs.len())
            .filter(|&i| active[i])
            .map(|i| self.mins[i].weight)
            .sum::<f64>()
            .max(1e-9);
        let spare = (1.0 - sum_min).max(0.0);
        (0..obs.len())
            .map(|i| {
                self.min_cost(i, obs)
                    + if active[i] {
                        spare * self.mins[i].weight / sum_w
                    } else {
                        0.0
                    }
            })
            .collect()
    }

    /// One decision: every tenant's cap from what each did.
    pub fn step(&mut self, obs: &[Obs]) -> Vec<Cap> {
        let cost: Vec<f64> = obs.iter().map(|o| self.model.cost(o)).collect();
        let busy = cost.iter().sum::<f64>() >= self.cfg.busy;
        // Starved: has demand, is below its minimum, and is not held there by
        // our own cap (a cap it does not reach is not what holds it down).
        let held = |i: usize| self.caps[i].is_some_and(|c| cost[i] >= 0.9 * c);
        self.starved = (0..obs.len())
            .map(|i| {
                obs[i].active() && self.below(i, obs, self.cfg.starved_below) && !held(i) && busy
            })
            .collect();
        // A cap left on a tenant that is now below its minimum is wrong: gone.
        for i in 0..obs.len() {
            if self.starved[i] {
                self.caps[i] = None;
            }
        }
        let ent = self.entitlement(obs);
        if self.starved.iter().any(|s| *s) {
            self.calm = 0;
            for i in 0..obs.len() {
                // A cap its tenant no longer presses against (burst over) is let go step by step.
                if let Some(c) = self.caps[i] {
                    if cost[i] < 0.5 * c {
                        let v = c * self.cfg.release_step;
                        self.caps[i] = (v < 1.0).then_some(v);
                        continue;
                    }
                }
                if self.starved[i] || cost[i] <= ent[i] {
                    continue;
                }
                // Close half the gap to its entitlement; never below its own minimum.
                let target = (cost[i] - 0.5 * (cost[i] - ent[i])).max(self.min_cost(i, obs));
                self.caps[i] = Some(self.caps[i].map_or(target, |c| c.min(target)));
            }
        } else {
            // Caps are raised only with room to spare: the device has idle
            // capacity, or every uncapped tenant with a minimum is clear of
            // it. Otherwise the cap that made the others whole is what keeps
            // them whole, and it holds.
            let room = !busy
                || (0..obs.len()).all(|i| {
                    !obs[i].active()
                        || self.caps[i].is_some()
                        || !self.below(i, obs, self.cfg.release_margin)
                });
            self.calm = if room { self.calm + 1 } else { 0 };
            if self.calm > self.cfg.release_after {
                for c in self.caps.iter_mut() {
                    if let Some(v) = c {
                        *v *= self.cfg.release_step;
                        if *v >= 1.0 {
                            *c = None;
                        }
                    }
                }
            }
        }
        (0..obs.len())
            .map(|i| match self.caps[i] {
                None => Cap::default(),
                Some(share) => {
                    // The share at this tenant's current I/O mix, as bytes/s and IOPS.
                    let o = &obs[i];
                    let c = cost[i].max(1e-9);
                    if o.active() {
                        let f = share / c;
                        Cap {
                            bps: Some((o.bps() * f).max(1.0)),
                            iops: Some((o.iops() * f).max(1.0)),
                        }
                    } else {
                        Cap {
                            bps: Some(share * self.model.max_bps),
                            iops: Some(share * self.model.max_iops),
                        }
                    }
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: Model = Model {
        max_iops: 1000.0,
        max_bps: 100e6,
    };

    fn w(bps: f64, iops: f64) -> Obs {
        Obs {
            wbps: bps,
            wiops: iops,
            ..Default::default()
        }
    }

    #[test]
    fn paper_caps_the_busiest_and_forgets_after_cap_time() {
        let mut p = Paper::new(PaperConfig::default(), M, 3);
        // 95 MB/s in total > 90: the top one (60 MB/s) gets 30 MB/s for 60 s.
        let c = p.step(&[w(60e6, 100.0), w(20e6, 100.0), w(15e6, 100.0)], 5.0);
        assert_eq!(c[0].bps, Some(30e6));
        assert!(c[1].is_none() && c[2].is_none());
        // Picked again (it is still the top): re-capped from scratch at rate x its new value.
        let c = p.step(&[w(50e6, 100.0), w(25e6, 100.0), w(20e6, 100.0)], 5.0);
        assert_eq!(c[0].bps, Some(25e6));
        // Below the border: nothing new, the cap runs out after 60 s.
        for _ in 0..11 {
            assert_eq!(
                p.step(&[w(25e6, 10.0), w(20e6, 10.0), w(20e6, 10.0)], 5.0)[0].bps,
                Some(25e6)
            );
        }
        assert!(p.step(&[w(25e6, 10.0), w(20e6, 10.0), w(20e6, 10.0)], 5.0)[0].is_none());
        // IOPS independently.
        let c = p.step(&[w(1e6, 200.0), w(1e6, 800.0), w(1e6, 10.0)], 5.0);
        assert_eq!((c[1].iops, c[1].bps), (Some(400.0), None));
    }

    #[test]
    fn guarantee_caps_only_while_someone_starves_and_releases_gradually() {
        let mins = vec![
            Min {
                bps: 20e6,
                iops: 0.0,
                weight: 1.0
            };
            3
        ];
        let mut g = Guarantee::new(GuaranteeConfig::default(), M, mins);
        // Busy but everyone at their minimum: no caps.
        assert!(g
            .step(&[w(40e6, 300.0), w(25e6, 200.0), w(25e6, 200.0)])
            .iter()
            .all(|c| c.is_none()));
        // Tenant 0 hogs the device (64 KiB writes), 1 and 2 starve.
        let hog = [w(80e6, 1200.0), w(5e6, 80.0), w(5e6, 80.0)];
        let c = g.step(&hog);
        assert!(g.starved[1] && g.starved[2] && !g.starved[0]);
        let first = c[0].bps.unwrap();
        assert!(
            (20e6..80e6).contains(&first),
            "capped, never below its minimum: {first}"
        );
        assert!(c[1].is_none() && c[2].is_none());
        // Still starving: the cap tightens further.
        let c = g.step(&hog);
        assert!(c[0].bps.unwrap() <= first);
        // Everyone fine now: caps stay for release_after intervals, then grow, then go.
        let ok = [w(30e6, 450.0), w(25e6, 400.0), w(25e6, 400.0)];
        let held = g.step(&ok)[0];
        assert!(!held.is_none());
        let mut last = 0.0;
        let mut released = false;
        for _ in 0..60 {
            let c = g.step(&ok)[0];
            match c.bps {
                Some(b) => {
                    assert!(b >= last * 0.999 || last == 0.0, "raised step by step");
                    last = b;
                }
                None => {
                    released = true;
                    break;
                }
            }
        }
        assert!(released, "the cap is removed in the end");
    }

    #[test]
    fn guarantee_charges_small_ios_by_their_cost() {
        // 4 KiB I/O: 900 IOPS is only 3.7 MB/s but 90% of the device.
        let mins = vec![
            Min {
                bps: 20e6,
                iops: 0.0,
                weight: 1.0
            };
            2
        ];
        let mut g = Guarantee::new(GuaranteeConfig::default(), M, mins);
        let c = g.step(&[w(3.7e6, 900.0), w(5e6, 80.0)]);
        assert!(g.starved[1]);
        assert!(
            c[0].iops.unwrap() < 900.0,
            "the 4 KiB tenant is the one capped: {c:?}"
        );
    }

    #[test]
    fn a_burst_that_ends_loses_its_cap_even_while_another_starves() {
        let mins = vec![
            Min {
                bps: 90e6,
                iops: 0.0,
                weight: 1.0,
            },
            Min {
                bps: 1e6,
                iops: 0.0,
                weight: 1.0,
            },
        ];
        let mut g = Guarantee::new(GuaranteeConfig::default(), M, mins);
        assert!(!g.step(&[w(30e6, 500.0), w(70e6, 1100.0)])[1].is_none());
        // The burst is over; tenant 0 still wants more than the device gives.
        let mut gone = false;
        for _ in 0..40 {
            if g.step(&[w(80e6, 1250.0), Obs::default()])[1].is_none() {
                gone = true;
                break;
            }
        }
        assert!(gone);
    }

    #[test]
    fn idle_device_or_idle_tenant_is_not_starvation() {
        let mins = vec![
            Min {
                bps: 20e6,
                iops: 0.0,
                weight: 1.0
            };
            2
        ];
        let mut g = Guarantee::new(GuaranteeConfig::default(), M, mins);
        // Below minimum but the device is nearly idle: the tenant just wants less.
        assert!(g
            .step(&[w(10e6, 100.0), w(1e6, 10.0)])
            .iter()
            .all(|c| c.is_none()));
        assert!(!g.starved.iter().any(|s| *s));
    }

    #[test]
    fn a_cap_holds_while_the_others_are_just_at_their_minimum() {
        let mins = vec![
            Min {
                bps: 20e6,
                iops: 0.0,
                weight: 1.0
            };
            2
        ];
        let mut g = Guarantee::new(GuaranteeConfig::default(), M, mins);
        // 64 KiB writes: tenant 1 starves while tenant 0 takes the device.
        let c = g.step(&[w(60e6, 915.0), w(5e6, 76.0)]);
        let first = c[0].bps.expect("the hog is capped");
        // The others are back at their minimum, the device still busy: the cap
        // neither goes nor grows (raising it would starve them again).
        for _ in 0..20 {
            let c = g.step(&[w(first, first / 65536.0), w(20e6, 305.0)]);
            assert!(c[0].bps.is_some_and(|b| b <= first * 1.001), "{c:?}");
        }
        // With room to spare (the other one is well above its minimum), it is let go.
        let mut gone = false;
        for _ in 0..60 {
            if g.step(&[w(first, first / 65536.0), w(30e6, 458.0)])[0].is_none() {
                gone = true;
                break;
            }
        }
        assert!(gone);
    }
}
