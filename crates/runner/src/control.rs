//! A running guest and its control socket: one typed request line
//! ([`ControlRequest`]), typed reply lines. `migrate` streams
//! [`ProgressEvent`]s and ends with a report (the guest runs on the main
//! host now and this runner ends) or a failure (the guest runs here again).

use crate::service::Service;
use crate::workload::{self, SortJob};
use crate::{Exit, RunnerError};
use pagefleet_api::control::{Budget, Moved};
use pagefleet_api::migration::Failure;
use pagefleet_api::{
    ControlRequest, ErrorReply, GuestSpec, GuestState, GuestStatus, MigrateRequest,
    MigrationProgress, PageLocations, PagingCosts, ProgressEvent,
};
use pagefleet_guests::Gate;
use pagefleet_migrate::source;
use pagefleet_region::{Location, Region, Secret};
use serde::Serialize;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A guest workload running on a region, reachable through its gate.
pub struct Running {
    name: String,
    spec: GuestSpec,
    /// Before `region`: fields drop in order, and QEMU must stop before
    /// the region that serves its faults goes.
    vm: Option<Arc<crate::vm::VmGuest>>,
    region: Arc<Region>,
    gate: Arc<Gate>,
    ops: Arc<AtomicU64>,
    sort: Option<Arc<SortJob>>,
    kv: Option<Arc<workload::KvServer>>,
    service: Option<Service>,
    started: Instant,
    migrating: AtomicBool,
    /// A migration succeeded: the destination owns the pages now.
    migrated: AtomicBool,
    cancel: AtomicBool,
    progress: source::Progress,
    secret: Secret,
}

impl source::Guest for Running {
    fn pause(&self, timeout: Duration) -> bool {
        match &self.vm {
            Some(v) => v.pause(),
            None => self.gate.pause(timeout),
        }
    }
    fn resume(&self) {
        match &self.vm {
            Some(v) => v.resume(),
            None => self.gate.resume(),
        }
    }
    fn release_address(&self) {
        // Stop accepting first (a client reconnecting now must not land on
        // this paused copy), then hang up the clients while the address is
        // still here, so they see the close at once and reconnect to the new
        // host once it claims the address, instead of waiting out their own
        // timeouts.
        if let Some(k) = &self.kv {
            k.stop_accepting();
            let n = k.kv.close_clients();
            tracing::info!("hung up {n} kv clients");
        }
        if let Some(v) = &self.vm {
            v.serve(false);
        }
        if let Some(s) = &self.service {
            s.release();
        }
    }
    fn device_state(&self) -> Result<Option<Vec<u8>>, String> {
        self.vm.as_ref().map(|v| v.device_state()).transpose()
    }
    fn reclaim_address(&self) {
        if let Some(s) = &self.service {
            let _ = s.claim();
        }
        if let Some(v) = &self.vm {
            v.serve(true);
        }
        if let Some(k) = &self.kv {
            if let Err(e) = k.start_accepting() {
                tracing::warn!("kv: {e}");
            }
        }
    }
}

/// Where the region's pages are, by kind and memory server.
fn locations(region: &Region) -> Option<PageLocations> {
    let s = region.snapshot()?;
    let mut p = PageLocations::default();
    let mut remote = vec![0u64; s.servers.len()];
    for l in &s.location {
        match l {
            Location::Local => p.local += 1,
            Location::Zero => p.zero += 1,
            Location::Remote(i, _) => remote[*i] += 1,
        }
    }
    p.remote = s
        .servers
        .iter()
        .zip(&remote)
        .filter(|(_, n)| **n > 0)
        .map(|(a, n)| (a.clone(), *n))
        .collect();
    Some(p)
}

/// Bytes of a round's pages not sent yet.
fn round_sent_left(round_pages: u64, round_sent: u64) -> u64 {
    round_pages.saturating_sub(round_sent) * pagefleet_region::PAGE as u64
}

/// The live counters of the source side as the typed progress.
pub fn progress_of(p: &source::Progress) -> MigrationProgress {
    let (round_pages, round_sent) = (p.round_pages.load(Relaxed), p.round_sent.load(Relaxed));
    MigrationProgress {
        phase: p.phase.lock().map(|s| s.clone()).unwrap_or_default(),
        round: p.round.load(Relaxed),
        round_pages,
        round_sent,
        bytes_main: p.bytes_main.load(Relaxed),
        bytes_subs: p.bytes_subs.load(Relaxed),
        remaining_bytes: round_sent_left(round_pages, round_sent),
        transfer_rate: p.transfer_rate.load(Relaxed),
        dirty_rate: p.dirty_rate.load(Relaxed),
    }
}

fn line(w: &mut impl Write, v: &impl Serialize) -> std::io::Result<()> {
    let mut b = serde_json::to_vec(v).map_err(std::io::Error::other)?;
    b.push(b'\n');
    w.write_all(&b)
}

fn err(msg: impl std::fmt::Display) -> ErrorReply {
    ErrorReply {
        error: msg.to_string(),
    }
}

impl Running {
    /// A guest whose workload has been started on `region`.
    pub fn new(
        name: String,
        spec: GuestSpec,
        region: Arc<Region>,
        gate: Arc<Gate>,
        w: workload::Started,
        service: Option<Service>,
        secret: Secret,
    ) -> Running {
        Running {
            name,
            spec,
            vm: w.vm,
            region,
            gate,
            ops: w.ops,
            sort: w.sort,
            kv: w.kv,
            service,
            started: Instant::now(),
            migrating: AtomicBool::new(false),
            migrated: AtomicBool::new(false),
            cancel: AtomicBool::new(false),
            progress: source::Progress::default(),
            secret,
        }
    }

    /// The guest's status.
    pub fn status(&self) -> GuestStatus {
        let s = self.region.stats();
        let migrating = self.migrating.load(Relaxed);
        GuestStatus {
            name: self.name.clone(),
            state: if migrating {
                GuestState::Migrating
            } else {
                GuestState::Running
            },
            pid: std::process::id(),
            workload: Some(self.spec.clone()),
            size: self.region.len() as u64,
            budget_pages: s.budget_pages,
            resident_pages: s.resident_pages,
            remote_pages: s.remote_pages,
            page_ins: s.page_ins,
            page_outs: s.page_outs,
            ops: self.ops.load(Relaxed),
            ready: self.sort.as_ref().is_none_or(|j| j.ready.load(Relaxed)),
            uptime_secs: self.started.elapsed().as_secs_f64(),
            region_id: format!("{:#x}", self.region.region_id),
            pages: locations(&self.region),
            paging: Some(PagingCosts {
                cpu_per_page_in_us: s.cpu_per_page_in_us(),
                cpu_per_page_out_us: s.cpu_per_page_out_us(),
                fault_p50_us: s.page_in_p50_us(),
                fault_p99_us: s.page_in_p99_us(),
                clean_drops: s.clean_drops,
                direct_reclaims: s.direct_reclaims,
                direct_reclaim_ms: s.direct_reclaim_ns as f64 / 1e6,
                replicas: self.spec.replicas,
                degraded_pages: s.degraded_pages,
                servers_down: s.servers_down,
                server_failures: s.server_failures,
                servers_revived: s.servers_revived,
                hedged_reads: s.hedged_reads,
                rereplicated_pages: s.rereplicated_pages,
                fault_seconds: fault_seconds(&s),
                faults: pagefleet_api::FaultCounts {
                    remote: s.remote_faults,
                    zero: s.zero_faults,
                    minor: s.minor_faults,
                    write_protect: s.wp_faults,
                },
                prefetched_pages: s.prefetched_pages,
                prefetch_hits: s.prefetch_hits,
                prefetch_misses: s.prefetch_misses,
            }),
            migration: migrating.then(|| progress_of(&self.progress)),
            vm: self.vm.as_ref().map(|v| v.status()),
            failure: None,
        }
    }

    fn options(&self, req: &MigrateRequest) -> source::Options {
        let main_pages = req.main_pages.unwrap_or(self.region.pages());
        let subs = req
            .subs
            .iter()
            .map(|s| source::SubHost {
                addr: s.addr.clone(),
                pages: s.pages,
            })
            .collect();
        let mut o = source::Options::new(
            req.to.clone(),
            subs,
            main_pages,
            self.secret.clone(),
            self.spec.clone(),
        );
        o.name = self.name.clone();
        o.verify = req.verify;
        o.dedup = !req.no_dedup;
        o.dedup_always = req.dedup_always;
        o.policy = req.policy.unwrap_or(self.spec.policy);
        o.dest_chunk = req.chunk;
        o.gather = req.gather;
        if let Some(n) = req.max_rounds {
            o.max_rounds = n.max(1) as usize;
        }
        if let Some(n) = req.stop_pages {
            o.stop_pages = n;
        }
        if let Some(ms) = req.max_downtime_ms {
            o.max_downtime = Duration::from_millis(ms);
        }
        if let Some(t) = req.timeout_secs {
            o.io_timeout = Duration::from_secs(t.max(1));
        }
        o
    }

    /// Migrate away, streaming progress to `out`. True when the guest runs
    /// at the destination now.
    fn migrate(&self, req: &MigrateRequest, out: &mut UnixStream) -> Result<bool, RunnerError> {
        if self.migrating.swap(true, Relaxed) {
            return Err(RunnerError::Invalid(format!(
                "a migration of {} is already running",
                self.name
            )));
        }
        self.cancel.store(false, Relaxed);
        // Counters of an earlier attempt must not show as this one's start.
        self.progress.reset();
        let o = self.options(req);
        let done = AtomicBool::new(false);
        let w = Mutex::new(
            out.try_clone()
                .map_err(|e| RunnerError::io("control socket", e))?,
        );
        let result = std::thread::scope(|sc| {
            sc.spawn(|| {
                while !done.load(Relaxed) {
                    let ev = ProgressEvent::Progress(progress_of(&self.progress));
                    let mut w = w.lock().unwrap_or_else(|e| e.into_inner());
                    // The caller went away (its write fails, or it hung up
                    // between writes): that is a Ctrl-C — cancel at once,
                    // before the migration passes its point of no return.
                    if line(&mut *w, &ev).is_err() || pagefleet_proto::io::peer_hung_up(&*out, 200)
                    {
                        self.cancel.store(true, Relaxed);
                        break;
                    }
                }
            });
            let r = source::migrate(&self.region, self, &o, &self.progress, &self.cancel);
            done.store(true, Relaxed);
            r
        });
        let mut w = w.into_inner().unwrap_or_else(|e| e.into_inner());
        match result {
            Ok(rep) => {
                tracing::info!("migrated out: {} -> {}", rep.guest, rep.main_host);
                if let Some(v) = &self.vm {
                    // Its device state runs on the destination now.
                    v.retire();
                }
                self.migrated.store(true, Relaxed);
                let _ = line(&mut w, &ProgressEvent::Report(Box::new(rep)));
                let _ = w.flush();
                Ok(true)
            }
            Err(e) => {
                self.migrating.store(false, Relaxed);
                let _ = line(
                    &mut w,
                    &ProgressEvent::Failed(Failure {
                        in_doubt: matches!(e, source::MigrateError::InDoubt(_)),
                        message: e.to_string(),
                        rolled_back: self.progress.rollback(),
                    }),
                );
                Ok(false)
            }
        }
    }

    /// Serve one control connection. Some(exit) when the runner must end.
    fn serve_one(&self, mut c: UnixStream) -> Option<Exit> {
        let mut text = String::new();
        let _ = c.set_read_timeout(Some(Duration::from_secs(10)));
        if BufReader::new((&c).take(1 << 20))
            .read_line(&mut text)
            .is_err()
        {
            return None;
        }
        let _ = c.set_read_timeout(None);
        let req = match serde_json::from_str::<ControlRequest>(&text) {
            Ok(r) => r,
            Err(e) => {
                let _ = line(&mut c, &err(format!("bad request: {e}")));
                return None;
            }
        };
        let busy = || err(format!("{} is migrating", self.name));
        let r = match req {
            ControlRequest::Status => line(&mut c, &self.status()),
            ControlRequest::Migrate(m) => match self.migrate(&m, &mut c) {
                Ok(true) => return Some(Exit::MigratedAway),
                Ok(false) => Ok(()),
                Err(e) => line(&mut c, &err(e)),
            },
            ControlRequest::Evacuate { .. } | ControlRequest::Sort
                if self.migrating.load(Relaxed) =>
            {
                line(&mut c, &busy())
            }
            ControlRequest::Evacuate { from, to } => match self.region.evacuate(&from, &to) {
                Ok(n) => line(&mut c, &Moved { moved: n }),
                Err(e) => line(&mut c, &err(e)),
            },
            ControlRequest::Sort => match &self.sort {
                Some(j) => line(&mut c, &j.sort(&self.region)),
                None => line(&mut c, &err("only a sortjob guest sorts")),
            },
            ControlRequest::Cancel => {
                self.cancel.store(true, Relaxed);
                line(&mut c, &pagefleet_api::Ok::default())
            }
            ControlRequest::SetBudget { pages } => {
                self.region.set_budget(pages);
                line(
                    &mut c,
                    &Budget {
                        budget_pages: self.region.budget(),
                    },
                )
            }
            ControlRequest::Stop => {
                // Before the reply, so the caller sees the pages gone.
                let r = match self.end() {
                    Ok(_) => line(&mut c, &pagefleet_api::Ok::default()),
                    Err(e) => line(&mut c, &err(format!("pages on memory servers: {e}"))),
                };
                let _ = r;
                return Some(Exit::Stopped);
            }
        };
        if let Err(e) = r {
            tracing::debug!("control reply: {e}");
        }
        None
    }
}

impl Running {
    /// The guest ends here (a stop request, SIGINT or SIGTERM): a
    /// migration in flight is cancelled (and rolls back), the guest is
    /// paused (a VM's vCPUs too, so nothing faults on pages being deleted)
    /// and its pages on the memory servers are deleted. A migration already
    /// past its point of no return finishes instead: the guest then runs
    /// at the destination, which owns the pages (MigratedAway).
    pub fn end(&self) -> Result<Exit, pagefleet_region::RegionError> {
        self.cancel.store(true, Relaxed);
        let t = Instant::now();
        while self.migrating.load(Relaxed)
            && !self.migrated.load(Relaxed)
            && t.elapsed() < Duration::from_secs(120)
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        if self.migrated.load(Relaxed) {
            return Ok(Exit::MigratedAway);
        }
        source::Guest::release_address(self);
        source::Guest::pause(self, Duration::from_secs(5));
        // The pager stops first: a page-out still in flight must not store
        // a page again after the region was deleted.
        self.region.abandon().map(|_| Exit::Stopped)
    }
}

/// What SIGINT / SIGTERM do once a guest runs here.
static ON_SIGNAL: std::sync::OnceLock<Box<dyn Fn() + Send + Sync>> = std::sync::OnceLock::new();

/// Wait for SIGINT / SIGTERM (blocked in every other thread) on a thread
/// of its own. Before a guest runs here the runner just exits: nothing is
/// its yet (an incoming migration's source rolls back when the stream
/// ends). Once one runs ([`serve`]), the guest ends as a stop request
/// ends it: its pages on the memory servers are deleted.
pub fn watch_signals() {
    let _ = std::thread::Builder::new()
        .name("signals".into())
        .spawn(|| {
            pagefleet_common::signal::TermSignals::current().wait();
            match ON_SIGNAL.get() {
                Some(end) => end(),
                None => {
                    tracing::info!("stopping on a signal before any guest ran here");
                    std::process::exit(143);
                }
            }
        });
}

/// Serve the control socket until a request ends the runner.
pub fn serve(path: &Path, r: Arc<Running>) -> Result<Exit, RunnerError> {
    let _ = std::fs::remove_file(path);
    let l = UnixListener::bind(path).map_err(|e| {
        RunnerError::io(
            format!("cannot create control socket {}", path.display()),
            e,
        )
    })?;
    // The control socket is the host daemon's (same user) alone: connecting
    // to a unix socket needs write permission on it.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| RunnerError::io(format!("cannot restrict {}", path.display()), e))?;
    let (tx, rx) = std::sync::mpsc::channel::<Exit>();
    let (r2, tx2) = (r.clone(), tx.clone());
    let accept = move |tx: Sender<Exit>| {
        for c in l.incoming() {
            let Ok(c) = c else { continue };
            let (r, tx) = (r.clone(), tx.clone());
            std::thread::spawn(move || {
                if let Some(exit) = r.serve_one(c) {
                    let _ = tx.send(exit);
                }
            });
        }
    };
    // SIGINT / SIGTERM end the guest as a stop request does: nothing is
    // left on the memory servers.
    let _ = ON_SIGNAL.set(Box::new(move || {
        tracing::info!("{}: stopping on a signal", r2.name);
        let exit = match r2.end() {
            Ok(exit) => exit,
            Err(e) => {
                tracing::warn!("{}: pages on memory servers: {e}", r2.name);
                Exit::Stopped
            }
        };
        let _ = tx2.send(exit);
    }));
    std::thread::Builder::new()
        .name("control".into())
        .spawn(move || accept(tx))
        .map_err(|e| RunnerError::io("control thread", e))?;
    rx.recv()
        .map_err(|_| RunnerError::Invalid("the control socket closed".into()))
}

/// The pager's fault service times in the exported bounds: its
/// quarter-octave buckets (µs) folded into powers of two (s), exactly.
fn fault_seconds(s: &pagefleet_region::Stats) -> pagefleet_api::HistogramSnapshot {
    use pagefleet_common::metrics::{fold, SERVICE_TIME_BOUNDS_S};
    let upper: Vec<f64> = (0..s.page_in_latency_buckets.len())
        .map(|i| pagefleet_region::Histogram::upper_us(i) * 1e-6)
        .collect();
    fold(
        &upper,
        &s.page_in_latency_buckets,
        &SERVICE_TIME_BOUNDS_S,
        s.page_in_latency_sum_ns as f64 * 1e-9,
    )
}
