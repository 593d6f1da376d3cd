//! `pagefleet run`: a workload run once on this machine, on a pagefleet
//! region paging to memory servers or on plain memory (the all-local
//! baseline), with a progress line per second and a JSON outcome.

use crate::RunnerError;
use pagefleet_common::sys::mapping::{Advice, Mapping};
use pagefleet_common::sys::signal::SignalSet;
use pagefleet_guests::{kv, sort, synthetic, Mem};
use pagefleet_region::{Config, Policy, Region, Secret};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What to run.
#[derive(Clone, Debug)]
pub enum Workload {
    /// Page-granular accesses.
    Synthetic {
        /// The access distribution.
        dist: synthetic::Dist,
        /// Fraction of operations that write.
        write_frac: f64,
        /// Write every page once first.
        prefill: bool,
        /// Operations per second (none: as fast as possible).
        rate: Option<f64>,
        /// Fraction of the pages the accesses fall on.
        span: f64,
        /// Whole-page prefill content (None: one word per page).
        fill: Option<synthetic::Fill>,
    },
    /// Generate and sort 100-byte records filling the memory.
    Sort {
        /// Seed of the records.
        seed: u64,
    },
    /// A memcached-protocol key-value server.
    Kv {
        /// Where it listens.
        listen: String,
        /// Refuse stores when full instead of evicting.
        no_evict: bool,
    },
    /// A QEMU VM on the region (its in-guest workload reports on the console).
    Vm(Box<pagefleet_vm::VmSpec>),
}

/// How to run it.
#[derive(Clone, Debug)]
pub struct LocalRun {
    /// Guest memory, bytes.
    pub size: u64,
    /// Pages allowed resident.
    pub budget_pages: u64,
    /// Memory servers (none: nothing pages out).
    pub servers: Vec<String>,
    /// Copies of every remote page (1 or 2).
    pub replicas: usize,
    /// The cluster secret (needed with servers).
    pub secret: Option<Secret>,
    /// Victim choice.
    pub policy: Policy,
    /// Pages per chunk.
    pub chunk: usize,
    /// What a remote fault brings in besides its page.
    pub prefetch: pagefleet_region::Prefetch,
    /// CPU share the sampling faults may cost.
    pub sample_budget: f64,
    /// The pager's poll for a faulting page's reply, µs (none: the default).
    pub reply_spin_us: Option<u64>,
    /// Worker threads.
    pub threads: usize,
    /// Seconds to run (kv: 0 = until killed).
    pub duration: u64,
    /// Plain anonymous memory instead of a region.
    pub plain: bool,
    /// Print a progress line per second (to stderr).
    pub progress: bool,
}

/// The guest's memory: a region, or a plain mapping.
struct Memory {
    /// Shared with the kv server's `stats` (its connection threads may outlive this command's scope).
    region: Option<Arc<Region>>,
    plain: Option<Mapping>,
}

impl Memory {
    fn mem(&self) -> Mem {
        match (&self.region, &self.plain) {
            // SAFETY: the region/mapping outlives every use in this command.
            (Some(r), _) => unsafe { Mem::new(r.as_ptr(), r.len()) },
            // SAFETY: our own mapping, unmapped only when Memory drops.
            (None, Some(m)) => unsafe { Mem::new(m.as_ptr(), m.len()) },
            _ => unreachable!(),
        }
    }
}

fn open_memory(a: &LocalRun) -> Result<Memory, RunnerError> {
    if a.plain {
        let m = Mapping::anonymous(a.size as usize, false)
            .map_err(|e| RunnerError::io(format!("cannot map {} bytes of memory", a.size), e))?;
        // Same page size as a region: THP off.
        m.advise(0, m.len(), Advice::NoHugePages);
        return Ok(Memory {
            region: None,
            plain: Some(m),
        });
    }
    let r = Region::new(region_config(a))?;
    Ok(Memory {
        region: Some(Arc::new(r)),
        plain: None,
    })
}

fn region_config(a: &LocalRun) -> Config {
    let mut cfg = Config::new(a.size, a.budget_pages);
    cfg.servers = a.servers.clone();
    cfg.replicas = a.replicas;
    cfg.policy = a.policy;
    cfg.chunk_pages = a.chunk;
    cfg.prefetch = a.prefetch;
    cfg.sample_cpu_budget = a.sample_budget;
    if let Some(us) = a.reply_spin_us {
        cfg.reply_spin = std::time::Duration::from_micros(us);
    }
    cfg.name = "pagefleet-run".into();
    cfg.secret = a.secret.clone();
    cfg
}

/// A VM until its workload is done, QEMU exits or `duration` (0: no limit) passes.
fn run_vm(a: &LocalRun, spec: &pagefleet_vm::VmSpec) -> Result<serde_json::Value, RunnerError> {
    if a.plain {
        return Err(RunnerError::Invalid(
            "a VM runs on a region, not --plain memory".into(),
        ));
    }
    let mut spec = spec.clone();
    spec.size = a.size;
    let dir = crate::vm::socket_dir(None, &spec.name);
    let (region, g) = crate::vm::boot(region_config(a), &spec, &dir)?;
    let m = Memory {
        region: Some(Arc::new(region)),
        plain: None,
    };
    let start = Instant::now();
    let mut last_ins = 0;
    let mut sec = 0;
    let exit = loop {
        std::thread::sleep(
            Duration::from_millis(1000).saturating_sub(start.elapsed() - Duration::from_secs(sec)),
        );
        let w = g.vm.console.workload();
        if a.progress {
            progress(&m, sec as usize, w.ops_per_sec, &mut last_ins);
        }
        sec += 1;
        if let Some(st) = g.vm.exited() {
            break Some(st.to_string());
        }
        if w.done
            || INTERRUPTED.load(Ordering::Relaxed)
            || (a.duration > 0 && start.elapsed() >= Duration::from_secs(a.duration))
        {
            break None;
        }
    };
    // vmwork's last lines come right after its "done".
    std::thread::sleep(Duration::from_millis(300));
    let w = g.vm.console.workload();
    drop(g);
    eprintln!(
        "vm: {} ops, {} errors, {} pages verified at the end{}",
        w.ops,
        w.errors,
        w.verified,
        exit.as_deref()
            .map(|e| format!("; QEMU {e}"))
            .unwrap_or_default()
    );
    if w.errors > 0 {
        return Err(RunnerError::Invalid(format!(
            "the VM's workload read {} wrong values: memory corrupted",
            w.errors
        )));
    }
    let mut v = serde_json::json!({"workload": "vm", "ops": w.ops, "done": w.done, "verified": w.verified,
        "errors": w.errors, "per_second": w.history.iter().map(|h| h.1).collect::<Vec<_>>()});
    if let serde_json::Value::Object(o) = &mut v {
        o.insert("region".into(), stats_json(&m));
        o.insert("size".into(), serde_json::json!(a.size));
    }
    Ok(v)
}

fn stats_json(m: &Memory) -> serde_json::Value {
    let Some(r) = &m.region else {
        return serde_json::Value::Null;
    };
    let s = r.stats();
    let mut v: serde_json::Map<String, serde_json::Value> = s
        .named()
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.into()))
        .collect();
    // [upper bound µs, count] of each non-empty bucket.
    let buckets: Vec<(f64, u64)> = s
        .page_in_latency_buckets
        .iter()
        .enumerate()
        .filter(|(_, c)| **c > 0)
        .map(|(i, c)| (pagefleet_region::Histogram::upper_us(i), *c))
        .collect();
    v.insert(
        "page_in_latency_us_buckets".into(),
        serde_json::to_value(buckets).unwrap_or_default(),
    );
    serde_json::Value::Object(v)
}

fn progress(m: &Memory, sec: usize, rate: f64, last_ins: &mut u64) {
    match &m.region {
        Some(r) => {
            let s = r.stats();
            // With replicas, what is missing (a dead server, pages with
            // one copy) is on every line, not only in --json.
            let copies = if s.servers_down > 0 || s.degraded_pages > 0 {
                format!(
                    "  DEGRADED: {} server(s) down, {} pages with one copy, {} hedged reads",
                    s.servers_down, s.degraded_pages, s.hedged_reads
                )
            } else if s.server_failures > 0 {
                format!(
                    "  replicas whole again ({} server failure(s), {} revived, {} hedged reads)",
                    s.server_failures, s.servers_revived, s.hedged_reads
                )
            } else {
                String::new()
            };
            eprintln!(
                "  t={:>3}s  {:>12.0} ops/s  resident {:>8} / {} pages  page-ins/s {:>7}  page-outs {}{copies}",
                sec + 1,
                rate,
                s.resident_pages,
                s.budget_pages,
                s.page_ins - *last_ins,
                s.page_outs
            );
            *last_ins = s.page_ins;
        }
        None => eprintln!("  t={:>3}s  {:>12.0} ops/s  (plain memory)", sec + 1, rate),
    }
}

/// SIGINT / SIGTERM asked the run to end.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);
/// The run has returned (its region dropped: its pages deleted).
static RETURNED: AtomicBool = AtomicBool::new(false);
/// The run's region, for the signal thread (weak: the run's own drop
/// deletes its pages when it returns).
static REGION: std::sync::OnceLock<std::sync::Weak<Region>> = std::sync::OnceLock::new();

/// Nothing is left on the memory servers when the run is interrupted:
/// kv and VM runs end at their next second and report as usual; a run
/// that cannot stop midway (synthetic, sort) is abandoned after 3 s — its
/// faults no longer served, its pages deleted — and the process exits 130.
fn watch_signals() {
    let signals = pagefleet_common::signal::TermSignals::block();
    let _ = std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            signals.wait();
            INTERRUPTED.store(true, Ordering::Relaxed);
            eprintln!("interrupted: ending the run");
            let t = Instant::now();
            while t.elapsed() < Duration::from_secs(3) {
                if RETURNED.load(Ordering::Relaxed) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            if let Some(r) = REGION.get().and_then(|w| w.upgrade()) {
                match r.abandon() {
                    Ok(()) => eprintln!("interrupted: its pages on the memory servers are deleted"),
                    Err(e) => {
                        eprintln!("interrupted: deleting its pages on the memory servers: {e}")
                    }
                }
            }
            std::process::exit(130);
        });
}

/// SIGUSR1 stops the access sampling hand, SIGUSR2 restarts it at the
/// run's `--sample-budget`: what sampling costs a running guest can be
/// measured on the same process, memory and threads (`bench paging`
/// toggles it between short windows).
/// Block both in this thread (call before any thread starts: they
/// inherit the mask), then [`watch_sampling_signals`].
fn block_sampling_signals() -> SignalSet {
    SignalSet::of(&[libc::SIGUSR1, libc::SIGUSR2]).block()
}

fn watch_sampling_signals(set: SignalSet, budget: f64) {
    let _ = std::thread::Builder::new()
        .name("sampling-signals".into())
        .spawn(move || loop {
            let Some(sig) = set.wait() else {
                return;
            };
            let share = if sig == libc::SIGUSR1 { 0.0 } else { budget };
            if let Some(r) = REGION.get().and_then(|w| w.upgrade()) {
                r.set_sample_budget(share);
            }
        });
}

/// Run `w` once; its outcome as JSON (the region's counters included).
/// SIGINT / SIGTERM end it early without leaving pages on the memory servers.
pub fn run(a: &LocalRun, w: &Workload) -> Result<serde_json::Value, RunnerError> {
    let sampling = block_sampling_signals();
    watch_signals();
    watch_sampling_signals(sampling, a.sample_budget);
    struct Returned;
    impl Drop for Returned {
        fn drop(&mut self) {
            RETURNED.store(true, Ordering::Relaxed);
        }
    }
    let _returned = Returned;
    run_workload(a, w)
}

fn run_workload(a: &LocalRun, w: &Workload) -> Result<serde_json::Value, RunnerError> {
    if let Workload::Vm(spec) = w {
        return run_vm(a, spec);
    }
    let m = open_memory(a)?;
    if let Some(r) = &m.region {
        let _ = REGION.set(Arc::downgrade(r));
    }
    let mem = m.mem();
    let mut last_ins = 0;
    let out = match w {
        Workload::Synthetic {
            dist,
            write_frac,
            prefill,
            rate,
            span,
            fill,
        } => {
            let o = synthetic::Opts {
                dist: dist.clone(),
                write_frac: *write_frac,
                threads: a.threads,
                duration: Duration::from_secs(a.duration.max(1)),
                max_ops: None,
                prefill: *prefill,
                gate: None,
                rate: *rate,
                span: *span,
                fill: *fill,
            };
            let r = synthetic::run(mem, &o, |s, rate| {
                if a.progress {
                    progress(&m, s, rate, &mut last_ins)
                }
            });
            eprintln!(
                "synthetic {:?}: {:.0} ops/s over {:.1} s ({} ops)",
                o.dist, r.ops_per_sec, r.secs, r.ops
            );
            serde_json::json!({"workload": "synthetic", "ops": r.ops, "secs": r.secs, "ops_per_sec": r.ops_per_sec, "per_second": r.per_second})
        }
        Workload::Sort { seed } => {
            let r = sort::run(mem, *seed, true);
            if !r.sorted {
                return Err(RunnerError::Invalid(
                    "sort produced unsorted output: memory corrupted".into(),
                ));
            }
            eprintln!(
                "sort: {} records generated in {:.2} s, sorted in {:.2} s",
                r.records, r.generate_secs, r.sort_secs
            );
            serde_json::json!({"workload": "sort", "records": r.records, "generate_secs": r.generate_secs, "sort_secs": r.sort_secs, "sorted": r.sorted})
        }
        Workload::Kv { listen, no_evict } => {
            let mut k = kv::Kv::open(mem);
            k.evict = !no_evict;
            if let Some(r) = m.region.clone() {
                k.extra_stats = Some(Box::new(move || crate::workload::pf_stats(&r.stats())));
            }
            let kvs = Arc::new(k);
            let l = pagefleet_common::listen::listen(listen)
                .map_err(|e| RunnerError::io(format!("cannot listen on {listen}"), e))?;
            let addr = l
                .local_addr()
                .map_err(|e| RunnerError::io("kv listener", e))?;
            println!("kv listening {addr}");
            use std::io::Write;
            let _ = std::io::stdout().flush();
            let stop = Arc::new(AtomicBool::new(false));
            let (k2, s2) = (kvs.clone(), stop.clone());
            let h = std::thread::spawn(move || kv::serve(k2, l, s2));
            let start = Instant::now();
            let mut last = 0;
            let mut per_second = Vec::new();
            let mut sec = 0;
            while (a.duration == 0 || start.elapsed() < Duration::from_secs(a.duration))
                && !INTERRUPTED.load(Ordering::Relaxed)
            {
                std::thread::sleep(
                    Duration::from_millis(1000)
                        .saturating_sub(start.elapsed() - Duration::from_secs(sec)),
                );
                let n = kvs.ops.load(Ordering::Relaxed);
                let rate = (n - last) as f64;
                per_second.push(rate);
                if a.progress {
                    progress(&m, sec as usize, rate, &mut last_ins);
                }
                last = n;
                sec += 1;
            }
            stop.store(true, Ordering::Relaxed);
            let _ = h.join();
            serde_json::json!({"workload": "kv", "ops": kvs.ops.load(Ordering::Relaxed), "items": kvs.items(), "per_second": per_second})
        }
        Workload::Vm(_) => unreachable!("run_vm"),
    };
    if let Some(r) = &m.region {
        let s = r.stats();
        eprintln!(
            "region: {} resident / {} budget pages; {} page-ins ({} requests), {} page-outs; page-in p50 {:.0} us p99 {:.0} us; \
             {} sampling faults ({} chunks sampled)",
            s.resident_pages, s.budget_pages, s.page_ins, s.page_in_requests, s.page_outs, s.page_in_p50_us(), s.page_in_p99_us(),
            s.minor_faults, s.sampled_chunks
        );
        if s.servers_down > 0 || s.degraded_pages > 0 {
            eprintln!(
                "region DEGRADED: {} memory server(s) down now ({} failures, {} revived); {} pages have fewer copies than the {} asked for; {} pages re-replicated; {} hedged reads",
                s.servers_down,
                s.server_failures,
                s.servers_revived,
                s.degraded_pages,
                a.replicas,
                s.rereplicated_pages,
                s.hedged_reads
            );
        } else if s.server_failures > 0 {
            eprintln!(
                "region: two copies of every remote page again after {} memory server failure(s) ({} revived); {} pages re-replicated; {} hedged reads",
                s.server_failures, s.servers_revived, s.rereplicated_pages, s.hedged_reads
            );
        }
    }
    let mut v = out;
    if let serde_json::Value::Object(o) = &mut v {
        o.insert("region".into(), stats_json(&m));
        o.insert("size".into(), serde_json::json!(a.size));
    }
    Ok(v)
}
