//! A guest's workload on its region: started in background threads, passing
//! the runner's safepoint gate so a migration can quiesce it.

use crate::RunnerError;
use pagefleet_api::guest::SortResult;
use pagefleet_api::{GuestSpec, Workload};
use pagefleet_guests::{kv, synthetic, Gate, Mem};
use pagefleet_region::Region;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The S-memV sort experiment as a hosted guest: 100-byte records fill the
/// last part of the memory, other data the rest. Before a migration it
/// keeps scanning its records (building the access history the split
/// uses), unless told not to; `sort` (a control op) sorts them and times it.
pub struct SortJob {
    records: Mem,
    stop_warm: AtomicBool,
    warm: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// The records exist (generated, or brought by a migration).
    pub ready: AtomicBool,
}

impl SortJob {
    fn start(mem: Mem, sort_frac: f64, warm: bool, seed: u64, incoming: bool) -> Arc<SortJob> {
        let frac = sort_frac.clamp(0.01, 1.0);
        let rec_bytes = ((mem.len() as f64 * frac) as usize) / pagefleet_units::PAGE_SIZE
            * pagefleet_units::PAGE_SIZE;
        // The records sit at the end: a placement by address alone (no
        // history) keeps the other data and sends the records away.
        let other = mem.len() - rec_bytes;
        let records = mem.sub(other, rec_bytes);
        let job = Arc::new(SortJob {
            records,
            stop_warm: AtomicBool::new(false),
            warm: Mutex::new(None),
            ready: AtomicBool::new(incoming),
        });
        if incoming {
            return job;
        }
        let j = job.clone();
        let h = std::thread::spawn(move || {
            let fill_other = || {
                for off in (0..other).step_by(pagefleet_units::PAGE_SIZE) {
                    mem.write_u64(off, off as u64 | 1);
                }
            };
            // Without warming, the other data is what was touched last:
            // the history then says nothing about the records.
            if warm {
                fill_other();
                pagefleet_guests::sort::generate(j.records, seed);
            } else {
                pagefleet_guests::sort::generate(j.records, seed);
                fill_other();
            }
            j.ready.store(true, Relaxed);
            while warm && !j.stop_warm.load(Relaxed) {
                // Read every record page, as the running sort would.
                let mut sum = 0u64;
                for off in (0..j.records.len()).step_by(pagefleet_units::PAGE_SIZE) {
                    sum = sum.wrapping_add(j.records.read_u64(off));
                }
                std::hint::black_box(sum);
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        *job.warm.lock().unwrap_or_else(|e| e.into_inner()) = Some(h);
        job
    }

    /// Sort the records now (stopping the warm-up scans first).
    pub fn sort(&self, region: &Region) -> SortResult {
        self.stop_warm.store(true, Relaxed);
        if let Some(h) = self.warm.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = h.join();
        }
        let before = region.stats();
        let t = Instant::now();
        let sorted = pagefleet_guests::sort::sort(self.records);
        let sort_secs = t.elapsed().as_secs_f64();
        let after = region.stats();
        SortResult {
            sort_secs,
            sorted,
            records: (self.records.len() / pagefleet_guests::sort::RECORD) as u64,
            page_ins: after.page_ins - before.page_ins,
            page_outs: after.page_outs - before.page_outs,
        }
    }
}

/// A kv guest's server: its table and the thread accepting clients, which
/// a migration stops (and an aborted one starts again).
pub struct KvServer {
    /// The table.
    pub kv: Arc<kv::Kv>,
    listen: String,
    /// The accept loop's stop flag and a handle on its listening socket.
    accepting: Mutex<Option<(Arc<AtomicBool>, std::net::TcpListener)>>,
}

impl KvServer {
    fn start(kv: Arc<kv::Kv>, listen: &str) -> Result<Arc<KvServer>, RunnerError> {
        let s = Arc::new(KvServer {
            kv,
            listen: listen.to_string(),
            accepting: Mutex::new(None),
        });
        s.start_accepting()?;
        Ok(s)
    }

    /// Listen for clients (again).
    pub fn start_accepting(&self) -> Result<(), RunnerError> {
        let mut a = self.accepting.lock().unwrap_or_else(|e| e.into_inner());
        if a.is_some() {
            return Ok(());
        }
        let l = bind_retry(&self.listen)?;
        let handle = l
            .try_clone()
            .map_err(|e| RunnerError::io("kv listener", e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let (k, s) = (self.kv.clone(), stop.clone());
        std::thread::spawn(move || kv::serve(k, l, s));
        *a = Some((stop, handle));
        Ok(())
    }

    /// Stop listening at once: connection attempts are refused from now on
    /// (shutting a listening socket down resets it), and the accept loop
    /// ends on its own.
    pub fn stop_accepting(&self) {
        let taken = self
            .accepting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some((stop, l)) = taken {
            stop.store(true, Relaxed);
            // A dup of the accept loop's socket, which this value owns.
            let _ = pagefleet_common::sys::process::shutdown_socket(&l);
        }
    }
}

/// A started workload: its operation counter and, for the sort job, its handle.
pub struct Started {
    /// Operations done so far.
    pub ops: Arc<AtomicU64>,
    /// The sort job, if that is the workload.
    pub sort: Option<Arc<SortJob>>,
    /// The key-value server, if that is the workload.
    pub kv: Option<Arc<KvServer>>,
    /// The VM, if the guest is one.
    pub vm: Option<Arc<crate::vm::VmGuest>>,
}

impl Started {
    /// The VM as a started workload: its operation count follows vmwork's reports.
    pub fn vm(g: &Arc<crate::vm::VmGuest>) -> Started {
        let ops = Arc::new(AtomicU64::new(0));
        let (o, c) = (ops.clone(), g.vm.console.clone());
        std::thread::spawn(move || loop {
            o.store(c.workload().ops, Relaxed);
            std::thread::sleep(Duration::from_millis(200));
            if Arc::strong_count(&o) == 1 {
                break;
            }
        });
        Started {
            ops,
            sort: None,
            kv: None,
            vm: Some(g.clone()),
        }
    }
}

/// Start `spec`'s workload on the region in background threads.
/// `incoming`: the memory came with a migration (nothing is filled again).
pub fn start(
    spec: &GuestSpec,
    region: &Arc<Region>,
    gate: &Arc<Gate>,
    incoming: bool,
) -> Result<Started, RunnerError> {
    if let Workload::Vm { .. } = spec.workload {
        return Err(RunnerError::Invalid(
            "a VM's region is made with its QEMU (vm::boot)".into(),
        ));
    }
    // SAFETY: the region outlives the workload: the runner keeps it until
    // the process ends.
    let mem = unsafe { Mem::new(region.as_ptr(), region.len()) };
    match &spec.workload {
        Workload::Synthetic {
            dist,
            write_frac,
            prefill,
            rate,
            span,
            fill,
        } => {
            let dist: synthetic::Dist = dist.parse().map_err(RunnerError::Invalid)?;
            let o = synthetic::Opts {
                dist,
                write_frac: *write_frac,
                threads: spec.threads,
                duration: Duration::from_secs(10 * 365 * 86400),
                max_ops: None,
                // A migrated guest keeps its memory: never prefill again.
                prefill: *prefill && !incoming,
                gate: Some(gate.clone()),
                rate: *rate,
                span: *span,
                // A migrated guest keeps its memory: never prefill again.
                fill: fill.filter(|_| !incoming).map(|f| synthetic::Fill {
                    seed: f.seed,
                    shared: f.shared,
                }),
            };
            let ops = Arc::new(AtomicU64::new(0));
            let o2 = ops.clone();
            std::thread::Builder::new()
                .name("synthetic".into())
                .spawn(move || {
                    let mut total = 0u64;
                    synthetic::run(mem, &o, |_, rate| {
                        total += rate as u64;
                        o2.store(total, Relaxed);
                    });
                })
                .map_err(|e| RunnerError::io("starting the workload", e))?;
            Ok(Started {
                ops,
                sort: None,
                kv: None,
                vm: None,
            })
        }
        Workload::Kv { listen, no_evict } => {
            let mut k = kv::Kv::open(mem);
            k.evict = !no_evict;
            let r = region.clone();
            k.extra_stats = Some(Box::new(move || pf_stats(&r.stats())));
            // Requests pass the runner's safepoint gate.
            k.gate = gate.clone();
            let kvs = Arc::new(k);
            let server = KvServer::start(kvs.clone(), listen)?;
            let ops = Arc::new(AtomicU64::new(0));
            let o2 = ops.clone();
            std::thread::spawn(move || loop {
                std::thread::sleep(Duration::from_millis(100));
                o2.store(kvs.ops.load(Relaxed), Relaxed);
            });
            Ok(Started {
                ops,
                sort: None,
                kv: Some(server),
                vm: None,
            })
        }
        Workload::Sortjob {
            sort_frac,
            warm,
            seed,
        } => Ok(Started {
            ops: Arc::new(AtomicU64::new(0)),
            sort: Some(SortJob::start(mem, *sort_frac, *warm, *seed, incoming)),
            kv: None,
            vm: None,
        }),
        Workload::Vm { .. } => unreachable!("returned above"),
    }
}

/// A service address just added may take a moment to become bindable.
fn bind_retry(listen: &str) -> Result<std::net::TcpListener, RunnerError> {
    let mut last = None;
    for _ in 0..50 {
        match pagefleet_common::listen::listen(listen) {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(RunnerError::io(
        format!("kv cannot listen on {listen}"),
        last.unwrap_or_else(|| std::io::Error::other("bind failed")),
    ))
}

/// The region's counters as the kv guest's `stats` lines (`pf_NAME`).
pub(crate) fn pf_stats(s: &pagefleet_region::Stats) -> Vec<(String, u64)> {
    s.named()
        .into_iter()
        .map(|(k, v)| (format!("pf_{k}"), v))
        .collect()
}
