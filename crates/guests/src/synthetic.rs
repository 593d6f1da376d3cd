//! `synthetic`: page-granular accesses with a chosen distribution and
//! read/write mix; reports ops/s every second.

use crate::{Mem, Rng};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// How accesses fall on the pages.
#[derive(Clone, Debug, PartialEq)]
pub enum Dist {
    /// Every page alike.
    Uniform,
    /// Zipf over page numbers with exponent θ (YCSB's generator); low pages hottest.
    Zipf(f64),
    /// Page after page, wrapping around.
    Sequential,
    /// `hot_frac` of the pages get `hot_prob` of the accesses.
    HotCold {
        /// Share of the pages that are hot.
        hot_frac: f64,
        /// Share of the accesses that go to them.
        hot_prob: f64,
    },
}

impl std::str::FromStr for Dist {
    type Err = String;
    /// `uniform`, `zipf` / `zipf:0.99`, `seq`, `hotcold` / `hotcold:0.2:0.8`.
    fn from_str(s: &str) -> Result<Dist, String> {
        let mut parts = s.split(':');
        let name = parts.next().unwrap_or("");
        let num = |v: Option<&str>, d: f64| -> Result<f64, String> {
            v.map_or(Ok(d), |x| {
                x.parse::<f64>()
                    .map_err(|_| format!("bad number {x:?} in {s:?}"))
            })
        };
        match name {
            "uniform" => Ok(Dist::Uniform),
            "zipf" => {
                let t = num(parts.next(), 0.99)?;
                if !(0.0..1.0).contains(&t) || t == 0.0 {
                    return Err(format!("zipf θ must be in (0, 1), got {t}"));
                }
                Ok(Dist::Zipf(t))
            }
            "seq" | "sequential" => Ok(Dist::Sequential),
            "hotcold" => {
                let f = num(parts.next(), 0.2)?;
                let p = num(parts.next(), 0.8)?;
                if !(0.0..=1.0).contains(&f) || !(0.0..=1.0).contains(&p) {
                    return Err("hotcold fractions must be within 0..1".into());
                }
                Ok(Dist::HotCold { hot_frac: f, hot_prob: p })
            }
            _ => Err(format!("unknown distribution {s:?}: use uniform, zipf[:θ], seq, hotcold[:hot_frac:hot_prob]")),
        }
    }
}

impl std::fmt::Display for Dist {
    /// The form `FromStr` reads back.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Dist::Uniform => write!(f, "uniform"),
            Dist::Zipf(t) => write!(f, "zipf:{t}"),
            Dist::Sequential => write!(f, "seq"),
            Dist::HotCold { hot_frac, hot_prob } => write!(f, "hotcold:{hot_frac}:{hot_prob}"),
        }
    }
}

/// YCSB's zipfian generator (Gray et al.), constant time per draw.
pub struct Zipf {
    n: u64,
    theta: f64,
    alpha: f64,
    zetan: f64,
    eta: f64,
}

impl Zipf {
    /// Zipf over `n` items with exponent `theta`.
    pub fn new(n: u64, theta: f64) -> Zipf {
        let zeta = |k: u64| (1..=k).map(|i| 1.0 / (i as f64).powf(theta)).sum::<f64>();
        let zetan = zeta(n);
        let zeta2 = zeta(2.min(n));
        let eta = (1.0 - (2.0 / n as f64).powf(1.0 - theta)) / (1.0 - zeta2 / zetan);
        Zipf {
            n,
            theta,
            alpha: 1.0 / (1.0 - theta),
            zetan,
            eta,
        }
    }
    /// The item for uniform `u` in [0, 1).
    #[inline]
    pub fn sample(&self, u: f64) -> u64 {
        let uz = u * self.zetan;
        if uz < 1.0 {
            return 0;
        }
        if uz < 1.0 + 0.5f64.powf(self.theta) {
            return 1.min(self.n - 1);
        }
        ((self.n as f64 * (self.eta * u - self.eta + 1.0).powf(self.alpha)) as u64).min(self.n - 1)
    }
}

/// Whole-page content for the prefill (sharing-aware migration's
/// controlled sharing, like paper 002's mmap program): every page gets
/// pseudo-random bytes; a `shared` fraction of the pages, spread over the
/// memory, get content that depends only on the page number (the same on
/// every guest filled this way), the others content of their own `seed`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fill {
    /// Seed of the pages of this guest's own.
    pub seed: u64,
    /// Fraction of the pages with the common content, 0 to 1.
    pub shared: f64,
}

/// Seed of the common content (every guest's `shared` pages).
const COMMON_SEED: u64 = 0x5ace_d00d;

fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Fill {
    /// Whether page `p` has the common content.
    pub fn is_shared(&self, p: u64) -> bool {
        let mut x = p ^ 0xC0DE;
        (splitmix(&mut x) % 10_000) < (self.shared.clamp(0.0, 1.0) * 10_000.0).round() as u64
    }

    /// Write page `p`'s content.
    pub fn write(&self, mem: &Mem, p: u64) {
        let seed = if self.is_shared(p) {
            COMMON_SEED
        } else {
            self.seed
        };
        let mut x = seed ^ p.wrapping_mul(0x2545_F491_4F6C_DD1D);
        for w in 0..512 {
            mem.write_u64(
                p as usize * pagefleet_units::PAGE_SIZE + w * 8,
                splitmix(&mut x),
            );
        }
    }
}

/// How to run the synthetic workload.
#[derive(Clone, Debug)]
pub struct Opts {
    /// The access distribution.
    pub dist: Dist,
    /// Fraction of operations that write.
    pub write_frac: f64,
    /// Worker threads.
    pub threads: usize,
    /// How long to run.
    pub duration: Duration,
    /// Stop after this many operations in total (whichever comes first).
    pub max_ops: Option<u64>,
    /// Touch every page once (writing) before measuring.
    pub prefill: bool,
    /// Safepoint gate (entered around every 256 operations), for migration.
    pub gate: Option<std::sync::Arc<crate::Gate>>,
    /// Operations per second over all threads (None: as fast as possible;
    /// 0: idle after the prefill).
    pub rate: Option<f64>,
    /// Fraction of the pages the accesses fall on (the first ones).
    pub span: f64,
    /// Prefill whole pages with this content (None: one word per page).
    pub fill: Option<Fill>,
}

/// What a run measured.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    /// Operations done.
    pub ops: u64,
    /// Seconds it ran.
    pub secs: f64,
    /// Operations per second.
    pub ops_per_sec: f64,
    /// ops/s in each whole second of the run.
    pub per_second: Vec<f64>,
}

/// Run the workload over `mem`; `tick` is called every second with (second, ops/s).
pub fn run(mem: Mem, o: &Opts, mut tick: impl FnMut(usize, f64)) -> Outcome {
    let all_pages = (mem.len / pagefleet_units::PAGE_SIZE) as u64;
    let pages = ((all_pages as f64 * o.span.clamp(0.0, 1.0)) as u64).clamp(1, all_pages);
    if o.prefill || o.fill.is_some() {
        std::thread::scope(|s| {
            for t in 0..o.threads as u64 {
                s.spawn(move || {
                    let per = all_pages.div_ceil(o.threads as u64);
                    if let Some(g) = &o.gate {
                        g.enter();
                    }
                    for p in t * per..((t + 1) * per).min(all_pages) {
                        match &o.fill {
                            Some(f) => f.write(&mem, p),
                            None => mem.write_u64(p as usize * pagefleet_units::PAGE_SIZE, p),
                        }
                    }
                    if let Some(g) = &o.gate {
                        g.exit();
                    }
                });
            }
        });
    }
    let zipf = match o.dist {
        Dist::Zipf(t) => Some(Zipf::new(pages, t)),
        _ => None,
    };
    let done = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let start = Instant::now();
    let mut per_second = Vec::new();
    std::thread::scope(|s| {
        for t in 0..o.threads {
            let (zipf, done, stop, gate) = (&zipf, &done, &stop, o.gate.as_deref());
            s.spawn(move || {
                let mut rng = Rng::new(0xC0FFEE + t as u64);
                let mut seq = (pages / o.threads as u64) * t as u64;
                let mut local = 0u64;
                let t0 = Instant::now();
                let mut batches = 0u64;
                let per_thread = o.rate.map(|r| r / o.threads as f64);
                while !stop.load(Relaxed) {
                    // Bounded load: batch k starts no earlier than k*256/rate.
                    match per_thread {
                        Some(r) if r <= 0.0 => {
                            if let Some(g) = gate {
                                g.enter();
                                g.exit();
                            }
                            std::thread::sleep(Duration::from_millis(10));
                            continue;
                        }
                        Some(r) => {
                            let due = Duration::from_secs_f64(batches as f64 * 256.0 / r);
                            if let Some(w) = due.checked_sub(t0.elapsed()) {
                                std::thread::sleep(w.min(Duration::from_millis(50)));
                                continue;
                            }
                            batches += 1;
                        }
                        None => {}
                    }
                    if let Some(g) = gate {
                        g.enter();
                    }
                    for _ in 0..256 {
                        let page = match &o.dist {
                            Dist::Uniform => rng.next_u64() % pages,
                            Dist::Zipf(_) => zipf.as_ref().unwrap().sample(rng.unit()),
                            Dist::Sequential => {
                                seq = (seq + 1) % pages;
                                seq
                            }
                            Dist::HotCold { hot_frac, hot_prob } => {
                                let hot = ((pages as f64 * hot_frac) as u64).max(1);
                                if rng.unit() < *hot_prob {
                                    rng.next_u64() % hot
                                } else {
                                    hot + rng.next_u64() % (pages - hot).max(1)
                                }
                            }
                        };
                        let off = page as usize * pagefleet_units::PAGE_SIZE
                            + ((local as usize) & 511) * 8;
                        if rng.unit() < o.write_frac {
                            mem.write_u64(off, mem.read_u64(off).wrapping_add(1));
                        } else {
                            std::hint::black_box(mem.read_u64(off));
                        }
                        local += 1;
                    }
                    if let Some(g) = gate {
                        g.exit();
                    }
                    done.fetch_add(256, Relaxed);
                    local = 0;
                }
            });
        }
        let mut last = 0u64;
        let mut sec = 0;
        loop {
            std::thread::sleep(Duration::from_millis(50));
            let el = start.elapsed();
            let n = done.load(Relaxed);
            if el.as_secs() as usize > sec {
                let rate = (n - last) as f64;
                per_second.push(rate);
                tick(sec, rate);
                last = n;
                sec += 1;
            }
            if el >= o.duration || o.max_ops.is_some_and(|m| n >= m) {
                stop.store(true, Relaxed);
                break;
            }
        }
    });
    let secs = start.elapsed().as_secs_f64();
    let ops = done.load(Relaxed);
    Outcome {
        ops,
        secs,
        ops_per_sec: ops as f64 / secs,
        per_second,
    }
}
