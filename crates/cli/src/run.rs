//! `pagefleet run <workload>`: a native guest on a pagefleet region.

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use pagefleet_api::{self as api, GuestSpec};
use pagefleet_common::units;
use pagefleet_guests::{kv, sort, synthetic, Mem};
use pagefleet_region::{Config, Policy, Region, Secret};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Args, Clone)]
#[command(args_conflicts_with_subcommands = false)]
pub struct RunArgs {
    #[command(subcommand)]
    pub workload: Option<Workload>,
    /// Make the memory mergeable by KSM (prctl PR_SET_MEMORY_MERGE; kept
    /// across fork and exec): `pagefleet run --merge -- CMD ARGS` runs CMD
    /// enrolled; with a workload, the workload's own memory is enrolled.
    #[arg(long, global = true)]
    pub merge: bool,
    /// The command to run (after `--`), instead of a workload.
    #[arg(last = true)]
    pub command: Vec<String>,
    /// Guest memory size (e.g. 2GiB).
    #[arg(long, global = true, default_value = "256MiB", value_parser = units::parse_size)]
    pub size: u64,
    /// Pages allowed resident locally: a size (1GiB) or a percentage of --size (50%).
    /// Default: all of it.
    #[arg(long, global = true)]
    pub budget: Option<String>,
    /// Memory servers, comma-separated HOST:PORT.
    #[arg(long, global = true, value_delimiter = ',')]
    pub servers: Vec<String>,
    /// Victim choice: clock (sum of reference bits per chunk) or aging (max 8-bit age).
    #[arg(long, global = true, default_value = "clock")]
    pub policy: Policy,
    /// Pages per chunk (power of two, 1..64).
    #[arg(long, global = true, default_value_t = 16)]
    pub chunk: usize,
    /// Worker threads.
    #[arg(long, global = true, default_value_t = 2)]
    pub threads: usize,
    /// Stop after this many seconds (kv: serve this long; 0 = until killed).
    #[arg(long, global = true, default_value_t = 10)]
    pub duration: u64,
    /// Plain anonymous memory instead of a pagefleet region (the all-local baseline).
    #[arg(long, global = true)]
    pub plain: bool,
    /// CPU share of one core the sampling faults may cost.
    #[arg(long, global = true, default_value_t = 0.02)]
    pub sample_budget: f64,
    /// Print one JSON object with the outcome and the runtime's counters.
    #[arg(long, global = true)]
    pub json: bool,
    /// Hosted guests (`pagefleet guest start`): a service address that
    /// moves with the guest (added to the host daemon's service device, and
    /// on the destination after a migration). kv: listen on it.
    #[arg(long, global = true)]
    pub service_ip: Option<String>,
}

#[derive(Subcommand, Clone)]
pub enum Workload {
    /// Page-granular accesses: uniform, zipf[:θ], seq, hotcold[:frac:prob].
    Synthetic {
        #[arg(long, default_value = "zipf:0.99")]
        dist: synthetic::Dist,
        /// Fraction of operations that write.
        #[arg(long, default_value_t = 0.3)]
        write_frac: f64,
        /// Write every page once before measuring.
        #[arg(long)]
        prefill: bool,
        /// Operations per second, all threads together (default: as fast as
        /// possible; 0: idle after the prefill).
        #[arg(long)]
        rate: Option<f64>,
        /// Fraction of the pages the accesses fall on (the first ones).
        #[arg(long, default_value_t = 1.0)]
        span: f64,
    },
    /// Generate and sort fixed-size 100-byte records filling the memory (the S-memV sort experiment).
    Sort {
        #[arg(long, default_value_t = 42)]
        seed: u64,
    },
    /// The S-memV sort experiment as a hosted guest (pagefleet guest start
    /// ... -- sortjob): records fill the last --sort-frac of the memory,
    /// other data the rest; it scans its records until asked to sort (control op `sort`).
    Sortjob {
        #[arg(long, default_value_t = 0.5)]
        sort_frac: f64,
        /// Do not scan the records before sorting (the split then has no
        /// access history of the sort).
        #[arg(long)]
        no_warm: bool,
        #[arg(long, default_value_t = 42)]
        seed: u64,
    },
    /// A memcached-protocol key-value server whose table lives in the memory.
    Kv {
        #[arg(long, default_value = "127.0.0.1:11211")]
        listen: String,
    },
}

struct Memory {
    /// Shared with the kv server's `stats` (its connection threads may outlive this command's scope).
    region: Option<Arc<Region>>,
    plain: Option<(*mut u8, usize)>,
}

impl Memory {
    fn mem(&self) -> Mem {
        match (&self.region, self.plain) {
            // SAFETY: the region/mapping outlives every use in this command.
            (Some(r), _) => unsafe { Mem::new(r.as_ptr(), r.len()) },
            // SAFETY: our own mapping, unmapped only when Memory drops.
            (None, Some((p, n))) => unsafe { Mem::new(p, n) },
            _ => unreachable!(),
        }
    }
}

impl Drop for Memory {
    fn drop(&mut self) {
        if let Some((p, n)) = self.plain {
            // SAFETY: our mapping.
            unsafe { libc::munmap(p.cast(), n) };
        }
    }
}

fn budget_pages(spec: Option<&str>, size: u64) -> Result<u64> {
    let pages = size.div_ceil(4096);
    Ok(match spec {
        None => pages,
        Some(s) if s.ends_with('%') => {
            let pct: f64 = s
                .trim_end_matches('%')
                .parse()
                .with_context(|| format!("bad --budget {s}"))?;
            if !(0.0..=100.0).contains(&pct) {
                bail!("--budget percentage must be 0..100");
            }
            ((pages as f64) * pct / 100.0) as u64
        }
        Some(s) => units::parse_size(s).map_err(anyhow::Error::msg)? / 4096,
    })
}

fn open_memory(a: &RunArgs, secret_file: Option<&Path>) -> Result<Memory> {
    if a.plain {
        // SAFETY: fresh anonymous mapping.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                a.size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            bail!("cannot map {} of memory", units::fmt_size(a.size));
        }
        // Same page size as a region: THP off.
        // SAFETY: the mapping just made, whole.
        unsafe { libc::madvise(p, a.size as usize, libc::MADV_NOHUGEPAGE) };
        return Ok(Memory {
            region: None,
            plain: Some((p.cast(), a.size as usize)),
        });
    }
    let mut cfg = Config::new(a.size, budget_pages(a.budget.as_deref(), a.size)?);
    cfg.servers = a.servers.clone();
    cfg.policy = a.policy;
    cfg.chunk_pages = a.chunk;
    cfg.sample_cpu_budget = a.sample_budget;
    cfg.name = "pagefleet-run".into();
    if !cfg.servers.is_empty() {
        cfg.secret = Some(Secret::resolve(secret_file)?);
    }
    let r = Region::new(cfg).context("cannot set up the guest's region")?;
    Ok(Memory {
        region: Some(Arc::new(r)),
        plain: None,
    })
}

fn stats_json(m: &Memory) -> serde_json::Value {
    let Some(r) = &m.region else {
        return serde_json::Value::Null;
    };
    let s = r.stats();
    serde_json::json!({
        "budget_pages": s.budget_pages, "resident_pages": s.resident_pages, "remote_pages": s.remote_pages,
        "missing_faults": s.missing_faults, "minor_faults": s.minor_faults, "wp_faults": s.wp_faults,
        "zero_filled_pages": s.zero_filled_pages, "page_ins": s.page_ins, "page_in_requests": s.page_in_requests,
        "page_outs": s.page_outs, "page_out_chunks": s.page_out_chunks, "bytes_in": s.bytes_in, "bytes_out": s.bytes_out,
        "sampled_chunks": s.sampled_chunks, "sample_rate_chunks_per_s": s.sample_rate,
        "page_in_p50_us": s.page_in_p50_us(), "page_in_p99_us": s.page_in_p99_us(),
        "page_in_latency_log2_us_buckets": s.page_in_latency_buckets,
    })
}

fn progress(m: &Memory, sec: usize, rate: f64, last_ins: &mut u64) {
    match &m.region {
        Some(r) => {
            let s = r.stats();
            eprintln!(
                "  t={:>3}s  {:>12.0} ops/s  resident {:>8} / {} pages  page-ins/s {:>7}  page-outs {}",
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

/// A hosted guest's typed spec from `run`-style flags (`pagefleet guest
/// start NAME ... -- WORKLOAD FLAGS`): what the host daemon may start.
pub fn guest_spec(a: &RunArgs) -> Result<GuestSpec> {
    if a.merge || !a.command.is_empty() {
        bail!("a hosted guest runs a built-in workload; --merge and commands after -- are for `pagefleet run` on this machine only");
    }
    if a.plain {
        bail!("--plain guests cannot be hosted (they have no region to migrate)");
    }
    let workload = match &a.workload {
        Some(Workload::Synthetic {
            dist,
            write_frac,
            prefill,
            rate,
            span,
        }) => api::Workload::Synthetic {
            dist: dist.to_string(),
            write_frac: *write_frac,
            prefill: *prefill,
            rate: *rate,
            span: *span,
        },
        Some(Workload::Kv { listen }) => api::Workload::Kv {
            listen: listen.clone(),
        },
        Some(Workload::Sortjob {
            sort_frac,
            no_warm,
            seed,
        }) => api::Workload::Sortjob {
            sort_frac: *sort_frac,
            warm: !no_warm,
            seed: *seed,
        },
        Some(Workload::Sort { .. }) => {
            bail!("sort runs to completion; it cannot run hosted (use sortjob)")
        }
        None => bail!("name the guest's workload: synthetic, kv or sortjob"),
    };
    let spec = GuestSpec {
        workload,
        threads: a.threads,
        policy: format!("{:?}", a.policy).to_lowercase(),
        chunk: a.chunk,
        servers: a.servers.clone(),
        sample_budget: a.sample_budget,
        service_ip: a.service_ip.clone(),
    };
    spec.validate().map_err(anyhow::Error::msg)?;
    Ok(spec)
}

pub fn run(a: RunArgs, secret_file: Option<&Path>) -> Result<()> {
    if a.merge {
        pagefleet_ksm::enroll::merge_self()?;
    }
    if !a.command.is_empty() {
        if a.workload.is_some() {
            bail!("give either a workload or a command after --, not both");
        }
        use std::os::unix::process::CommandExt;
        let e = std::process::Command::new(&a.command[0])
            .args(&a.command[1..])
            .exec();
        bail!("cannot run {}: {e}", a.command[0]);
    }
    let Some(workload) = a.workload.clone() else {
        bail!("name a workload (synthetic, sort, sortjob, kv) or a command after --; see pagefleet run --help");
    };
    if a.threads == 0 {
        bail!("--threads must be at least 1");
    }
    if a.service_ip.is_some() {
        bail!("--service-ip is for hosted guests (pagefleet guest start)");
    }
    let m = open_memory(&a, secret_file)?;
    let mem = m.mem();
    let mut last_ins = 0;
    let out = match &workload {
        Workload::Synthetic { dist, write_frac, prefill, rate, span } => {
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
            };
            let r = synthetic::run(mem, &o, |s, rate| {
                if !a.json {
                    progress(&m, s, rate, &mut last_ins)
                }
            });
            eprintln!("synthetic {:?}: {:.0} ops/s over {:.1} s ({} ops)", o.dist, r.ops_per_sec, r.secs, r.ops);
            serde_json::json!({"workload": "synthetic", "ops": r.ops, "secs": r.secs, "ops_per_sec": r.ops_per_sec, "per_second": r.per_second})
        }
        Workload::Sort { seed } => {
            let r = sort::run(mem, *seed, true);
            if !r.sorted {
                bail!("sort produced unsorted output: memory corrupted");
            }
            eprintln!("sort: {} records generated in {:.2} s, sorted in {:.2} s", r.records, r.generate_secs, r.sort_secs);
            serde_json::json!({"workload": "sort", "records": r.records, "generate_secs": r.generate_secs, "sort_secs": r.sort_secs, "sorted": r.sorted})
        }
        Workload::Sortjob { .. } => bail!("sortjob runs hosted (pagefleet guest start NAME --on HOST --size SIZE -- sortjob); for a one-shot sort use `pagefleet run sort`"),
        Workload::Kv { listen } => {
            let mut k = kv::Kv::open(mem);
            if let Some(r) = m.region.clone() {
                k.extra_stats = Some(Box::new(move || {
                    let s = r.stats();
                    vec![
                        ("pf_resident_pages".into(), s.resident_pages),
                        ("pf_budget_pages".into(), s.budget_pages),
                        ("pf_remote_pages".into(), s.remote_pages),
                        ("pf_page_ins".into(), s.page_ins),
                        ("pf_page_in_requests".into(), s.page_in_requests),
                        ("pf_page_outs".into(), s.page_outs),
                        ("pf_minor_faults".into(), s.minor_faults),
                        ("pf_page_in_p50_us".into(), s.page_in_p50_us() as u64),
                        ("pf_page_in_p99_us".into(), s.page_in_p99_us() as u64),
                    ]
                }));
            }
            let kvs = Arc::new(k);
            let l = std::net::TcpListener::bind(listen).with_context(|| format!("cannot listen on {listen}"))?;
            let addr = l.local_addr()?;
            println!("kv listening {addr}");
            use std::io::Write;
            std::io::stdout().flush()?;
            let stop = Arc::new(AtomicBool::new(false));
            let (k2, s2) = (kvs.clone(), stop.clone());
            let h = std::thread::spawn(move || kv::serve(k2, l, s2));
            let start = Instant::now();
            let mut last = 0;
            let mut per_second = Vec::new();
            let mut sec = 0;
            while a.duration == 0 || start.elapsed() < Duration::from_secs(a.duration) {
                std::thread::sleep(Duration::from_millis(1000).saturating_sub(start.elapsed() - Duration::from_secs(sec)));
                let n = kvs.ops.load(Ordering::Relaxed);
                let rate = (n - last) as f64;
                per_second.push(rate);
                if !a.json {
                    progress(&m, sec as usize, rate, &mut last_ins);
                }
                last = n;
                sec += 1;
            }
            stop.store(true, Ordering::Relaxed);
            let _ = h.join();
            serde_json::json!({"workload": "kv", "ops": kvs.ops.load(Ordering::Relaxed), "items": kvs.items(), "per_second": per_second})
        }
    };
    if let Some(r) = &m.region {
        let s = r.stats();
        eprintln!(
            "region: {} resident / {} budget pages; {} page-ins ({} requests), {} page-outs; page-in p50 {:.0} us p99 {:.0} us; \
             {} sampling faults ({} chunks sampled)",
            s.resident_pages, s.budget_pages, s.page_ins, s.page_in_requests, s.page_outs, s.page_in_p50_us(), s.page_in_p99_us(),
            s.minor_faults, s.sampled_chunks
        );
    }
    if a.json {
        let mut v = out;
        if let serde_json::Value::Object(o) = &mut v {
            o.insert("region".into(), stats_json(&m));
            o.insert("size".into(), serde_json::json!(a.size));
        }
        println!("{}", serde_json::to_string(&v)?);
    }
    Ok(())
}
