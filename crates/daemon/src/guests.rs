//! The guest host service: starts and stops this host's runners, hands
//! out this host's guest memory (a budget per guest, never more in total
//! than `--guest-memory`), starts runners for incoming migrations, and
//! forwards requests to a guest's runner (its control socket).
//!
//! A runner is always the configured runner binary with a fixed hidden
//! subcommand; what it runs comes as one typed [`Launch`] message on its
//! stdin (a [`GuestSpec`], never a command line a caller chose), and the
//! cluster secret with it (never on a command line).
//!
//! Runners outlive their daemon: a restarted pagefleetd (an upgrade) reads
//! `GUESTDIR/runners.json`, which lists its running guests' runners, and
//! adopts each one that still runs as that guest and answers on its
//! control socket; it watches an adopted runner through a pidfd (it is not
//! its child, so its exit status is not known: an adopted runner that ends
//! without a stop or a migration is recorded as failed).

use pagefleet_api::control::ControlRequest;
use pagefleet_api::launch::{to_hex, Job, Launch};
use pagefleet_api::{
    GuestFailure, GuestState, GuestStatus, IncomingReply, IncomingRequest, StartGuest,
};
use pagefleet_common::control::{self, ControlError};
use pagefleet_proto::auth::Secret;
use serde::de::DeserializeOwned;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tracing::info;

/// Runner logs kept per guest name: `NAME.log` (the current runner's) and
/// `NAME.log.1` … `NAME.log.4`, older first out. A runner that failed keeps
/// its log when the next runner of that name starts.
const LOGS_KEPT: usize = 5;

/// A failed guest's reason: at most this many of its log's last lines.
const REASON_LINES: usize = 4;

/// The guest host service's settings.
#[derive(Clone, Debug)]
pub struct GuestConfig {
    /// Memory this host gives guests (sum of budgets), bytes.
    pub memory: u64,
    /// The `pagefleet` binary runners are started from.
    pub runner: PathBuf,
    /// Control sockets and runner logs.
    pub dir: PathBuf,
    /// Device a guest's service address goes on.
    pub service_dev: String,
    /// IP this host's runners listen on for incoming migrations.
    pub ip: String,
    /// The cluster secret, handed to runners on their stdin.
    pub secret: Secret,
    /// Directories VM guests' files may come from.
    pub vm_images: Vec<PathBuf>,
    /// The bridge VMs' own NICs join (None: none here).
    pub vm_bridge: Option<String>,
    /// The content lookup socket handed to incoming runners (None: no
    /// sharing-aware migration into this host).
    pub dedup_socket: Option<PathBuf>,
    /// The host's TLS identity directory, handed to runners.
    pub tls_dir: Option<PathBuf>,
}

/// A refused or failed request: the HTTP status and what to tell the caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// HTTP status.
    pub status: u16,
    /// For the caller.
    pub message: String,
}

impl Refusal {
    /// A refusal with its HTTP status.
    pub fn new(status: u16, message: impl std::fmt::Display) -> Refusal {
        Refusal {
            status,
            message: message.to_string(),
        }
    }
}

impl From<ControlError> for Refusal {
    fn from(e: ControlError) -> Refusal {
        match e {
            ControlError::Refused(m) => Refusal::new(409, m),
            e => Refusal::new(502, e),
        }
    }
}

struct Entry {
    pid: u32,
    control: PathBuf,
    budget_pages: u64,
    incoming: bool,
    /// What its runner last reported (kept for the failed record).
    last: Option<GuestStatus>,
    /// Asked to stop (an adopted runner's end is then no failure).
    stopping: bool,
}

/// A running guest's runner as `runners.json` lists it for the next daemon.
#[derive(serde::Serialize, serde::Deserialize)]
struct Listed {
    name: String,
    pid: u32,
    control: PathBuf,
    budget_pages: u64,
    /// Started for an incoming migration (adopted only if it has become
    /// a running guest).
    #[serde(default)]
    incoming: bool,
}

type SpawnReq = (Command, std::sync::mpsc::Sender<std::io::Result<Child>>);

/// This host's guests.
pub struct Guests {
    /// Its settings.
    pub cfg: GuestConfig,
    map: Mutex<BTreeMap<String, Entry>>,
    /// Guests whose runner ended on its own: their records, until
    /// `guest rm` (or a new guest of that name).
    failed: Mutex<BTreeMap<String, GuestStatus>>,
    /// Runners that failed since the daemon started.
    failures: AtomicU64,
    /// Migrations of guests from this host since the daemon started.
    migrations: Mutex<MigrationTally>,
    /// Runners are forked by one long-lived thread: their parent-death
    /// signal fires when the forking *thread* exits, not just the daemon.
    spawner: Mutex<std::sync::mpsc::Sender<SpawnReq>>,
}

/// Migrations from this host since the daemon started: how many ended
/// each way, and the last one that succeeded.
#[derive(Debug, Default)]
struct MigrationTally {
    succeeded: u64,
    failed: u64,
    /// Its downtime and its whole time (start to running at the
    /// destination), seconds.
    last_downtime_s: f64,
    last_total_s: f64,
    /// The last ones that ended, oldest first.
    recent: std::collections::VecDeque<pagefleet_api::FinishedMigration>,
}

/// A migration's phase as a label: every pre-copy round is `precopy`
/// (the round is its own series), the others as the runner names them.
fn phase_label(phase: &str) -> &str {
    if phase.starts_with("round") {
        "precopy"
    } else if phase.is_empty() {
        "starting"
    } else {
        phase
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Guests {
    /// Start the service (creates its directory).
    pub fn new(cfg: GuestConfig) -> std::io::Result<Arc<Guests>> {
        std::fs::create_dir_all(&cfg.dir).map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("cannot create guest directory {}: {e}", cfg.dir.display()),
            )
        })?;
        let (tx, rx) = std::sync::mpsc::channel::<SpawnReq>();
        std::thread::Builder::new()
            .name("runner spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            })?;
        Ok(Arc::new(Guests {
            cfg,
            map: Mutex::new(BTreeMap::new()),
            failed: Mutex::new(BTreeMap::new()),
            failures: AtomicU64::new(0),
            migrations: Mutex::new(MigrationTally::default()),
            spawner: Mutex::new(tx),
        }))
    }

    /// Pages reserved by guests here.
    pub fn used_pages(&self) -> u64 {
        lock(&self.map).values().map(|e| e.budget_pages).sum()
    }
    /// Guest memory still free, bytes.
    pub fn free_bytes(&self) -> u64 {
        self.cfg
            .memory
            .saturating_sub(pagefleet_units::bytes_of(self.used_pages()))
    }
    /// A migration of `guest` from this host ended: with its report when
    /// the guest runs at the destination, with why when it failed (rolled
    /// back, in doubt, or never placed).
    pub fn migration_ended(&self, guest: &str, outcome: Result<&pagefleet_api::Report, &str>) {
        let mut t = lock(&self.migrations);
        match outcome {
            Ok(r) => {
                t.succeeded += 1;
                t.last_downtime_s = r.downtime_ms / 1e3;
                t.last_total_s = r.total_secs;
            }
            Err(_) => t.failed += 1,
        }
        if t.recent.len() >= pagefleet_api::migration::RECENT_MIGRATIONS {
            t.recent.pop_front();
        }
        t.recent.push_back(pagefleet_api::FinishedMigration {
            guest: guest.to_string(),
            at_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            report: outcome.ok().cloned(),
            error: outcome.err().map(str::to_string),
        });
    }

    /// The last migrations from this host that ended, oldest first.
    pub fn recent_migrations(&self) -> Vec<pagefleet_api::FinishedMigration> {
        lock(&self.migrations).recent.iter().cloned().collect()
    }

    /// Runners here.
    pub fn count(&self) -> usize {
        lock(&self.map).len()
    }

    /// Prometheus text for the guest host service: this host's guest
    /// memory, and per guest what its runner reports (asked over its control
    /// socket: call from a blocking context).
    pub fn metrics(&self) -> String {
        use pagefleet_common::metrics::{Exposition, Kind::*};
        const PAGE: f64 = pagefleet_units::PAGE_SIZE as f64;
        let mut e = Exposition::new();
        let used: u64 = lock(&self.map).values().map(|e| e.budget_pages).sum();
        // Every runner's own state (a runner that received its migration
        // says running, not incoming), and the failed records.
        let all = self.list();
        e.single(
            "pagefleet_host_guest_memory_bytes",
            Gauge,
            "Memory this host gives guests (sum of budgets allowed).",
            self.cfg.memory,
        );
        e.single(
            "pagefleet_host_guest_budget_bytes",
            Gauge,
            "Sum of the budgets of the guests here.",
            pagefleet_units::bytes_of(used),
        );
        let mut f = e.family(
            "pagefleet_guests",
            Gauge,
            "Guests on this host by state (incoming: a runner waiting for a migration; failed: records kept until `guest rm`).",
        );
        for (state, name) in [
            (GuestState::Starting, "starting"),
            (GuestState::Incoming, "incoming"),
            (GuestState::Running, "running"),
            (GuestState::Migrating, "migrating"),
            (GuestState::Failed, "failed"),
        ] {
            f.sample(
                &[("state", name)],
                all.iter().filter(|g| g.state == state).count(),
            );
        }
        e.single(
            "pagefleet_guest_failures_total",
            Counter,
            "Runners that ended on their own or were killed (not stopped, not migrated away).",
            self.failures.load(Relaxed),
        );
        type Get = fn(&GuestStatus) -> f64;
        let series: [(&str, pagefleet_common::metrics::Kind, &str, Get); 22] = [
            ("size_bytes", Gauge, "The guest's memory size.", |g| g.size as f64),
            ("budget_bytes", Gauge, "Memory the guest may keep resident here.", |g| {
                g.budget_pages as f64 * PAGE
            }),
            ("resident_bytes", Gauge, "Guest memory resident on this host.", |g| {
                g.resident_pages as f64 * PAGE
            }),
            ("remote_bytes", Gauge, "Guest memory on memory servers.", |g| {
                g.remote_pages as f64 * PAGE
            }),
            (
                "paged_in_bytes_total",
                Counter,
                "Guest memory brought in from memory servers.",
                |g| g.page_ins as f64 * PAGE,
            ),
            (
                "paged_out_bytes_total",
                Counter,
                "Guest memory sent to memory servers.",
                |g| g.page_outs as f64 * PAGE,
            ),
            ("ops_total", Counter, "Operations the guest's workload completed.", |g| {
                g.ops as f64
            }),
            (
                "clean_drops_total",
                Counter,
                "Evictions that sent nothing (clean pages).",
                |g| g.paging.as_ref().map_or(0.0, |p| p.clean_drops as f64),
            ),
            (
                "page_in_cpu_seconds",
                Gauge,
                "Pager CPU per page brought in.",
                |g| g.paging.as_ref().map_or(0.0, |p| p.cpu_per_page_in_us * 1e-6),
            ),
            (
                "page_out_cpu_seconds",
                Gauge,
                "Pager CPU per page evicted.",
                |g| g.paging.as_ref().map_or(0.0, |p| p.cpu_per_page_out_us * 1e-6),
            ),
            (
                "direct_reclaims_total",
                Counter,
                "Page-outs run over the budget (faults waited).",
                |g| g.paging.as_ref().map_or(0.0, |p| p.direct_reclaims as f64),
            ),
            (
                "direct_reclaim_seconds_total",
                Counter,
                "Time page-outs over the budget took (faults waited meanwhile).",
                |g| g.paging.as_ref().map_or(0.0, |p| p.direct_reclaim_ms * 1e-3),
            ),
            (
                "replicas",
                Gauge,
                "Copies of every remote page the guest keeps (1 or 2).",
                |g| g.paging.as_ref().map_or(0.0, |p| p.replicas as f64),
            ),
            (
                "degraded_pages",
                Gauge,
                "Remote pages with fewer copies than the guest's replicas (until re-replication restores them).",
                |g| g.paging.as_ref().map_or(0.0, |p| p.degraded_pages as f64),
            ),
            (
                "servers_down",
                Gauge,
                "Memory servers the guest found dead or hung and not answering since.",
                |g| g.paging.as_ref().map_or(0.0, |p| p.servers_down as f64),
            ),
            (
                "server_failures_total",
                Counter,
                "Times the guest found a memory server dead or hung.",
                |g| g.paging.as_ref().map_or(0.0, |p| p.server_failures as f64),
            ),
            (
                "servers_revived_total",
                Counter,
                "Times a memory server the guest called down answered again and was used again.",
                |g| g.paging.as_ref().map_or(0.0, |p| p.servers_revived as f64),
            ),
            (
                "hedged_reads_total",
                Counter,
                "Faulting pages asked of a mirror because their memory server missed its deadline.",
                |g| g.paging.as_ref().map_or(0.0, |p| p.hedged_reads as f64),
            ),
            (
                "prefetched_bytes_total",
                Counter,
                "Guest memory read-ahead brought in besides the faulting pages.",
                |g| g.paging.as_ref().map_or(0.0, |p| p.prefetched_pages as f64 * PAGE),
            ),
            (
                "prefetch_hits_total",
                Counter,
                "Read-ahead pages the guest used after they came.",
                |g| g.paging.as_ref().map_or(0.0, |p| p.prefetch_hits as f64),
            ),
            (
                "prefetch_misses_total",
                Counter,
                "Read-ahead pages evicted with no use seen (an upper bound: a read of a mapped page shows only after the sampler unmaps it).",
                |g| g.paging.as_ref().map_or(0.0, |p| p.prefetch_misses as f64),
            ),
            (
                "rereplicated_pages_total",
                Counter,
                "Pages re-replication copied to another memory server.",
                |g| g.paging.as_ref().map_or(0.0, |p| p.rereplicated_pages as f64),
            ),
        ];
        let guests: Vec<&GuestStatus> = all.iter().filter(|g| g.state.is_live()).collect();
        for (name, kind, help, get) in series {
            let mut f = e.family(&format!("pagefleet_guest_{name}"), kind, help);
            for g in &guests {
                f.sample(&[("guest", g.name.as_str())], get(g));
            }
        }
        let mut f = e.family(
            "pagefleet_guest_remote_server_bytes",
            Gauge,
            "Guest memory read from each memory server (its pages' first copies; mirrors not counted).",
        );
        for g in &guests {
            for (server, pages) in g.pages.iter().flat_map(|p| &p.remote) {
                f.sample(
                    &[("guest", g.name.as_str()), ("server", server.as_str())],
                    *pages as f64 * PAGE,
                );
            }
        }
        let mut f = e.family(
            "pagefleet_guest_faults_total",
            Counter,
            "Page faults by what served them: remote (waited for a memory server), zero (first touch), \
             minor (resident, mapped back by the kernel after the sampler's unmap), write_protect (first write since a clean install or a migration round).",
        );
        for g in &guests {
            if let Some(p) = &g.paging {
                for (kind, n) in p.faults.by_kind() {
                    f.sample(&[("guest", g.name.as_str()), ("kind", kind)], n);
                }
            }
        }
        let mut f = e.family(
            "pagefleet_guest_fault_seconds",
            Histogram,
            "Fault service time: the fault read to the page installed.",
        );
        for g in &guests {
            if let Some(p) = &g.paging {
                f.histogram(&[("guest", g.name.as_str())], &p.fault_seconds);
            }
        }
        self.migration_metrics(&mut e, &all);
        e.finish()
    }

    /// The migration series: per guest migrating from here (KubeVirt's
    /// names where they fit, `kubevirt_vmi_migration_*`), and this host's
    /// tallies.
    fn migration_metrics(
        &self,
        e: &mut pagefleet_common::metrics::Exposition,
        all: &[GuestStatus],
    ) {
        use pagefleet_api::MigrationProgress as P;
        use pagefleet_common::metrics::Kind::*;
        let moving: Vec<(&str, &P)> = all
            .iter()
            .filter_map(|g| Some((g.name.as_str(), g.migration.as_ref()?)))
            .collect();
        type Get = fn(&P) -> u64;
        let series: [(&str, &str, Get); 5] = [
            (
                "data_processed_bytes",
                "Bytes the migration has sent (main host and sub-hosts).",
                |p| p.bytes_main + p.bytes_subs,
            ),
            (
                "data_remaining_bytes",
                "Bytes of the current round not sent yet.",
                |p| p.remaining_bytes,
            ),
            (
                "transfer_rate_bytes",
                "Bytes per second the last round moved.",
                |p| p.transfer_rate,
            ),
            (
                "dirty_memory_rate_bytes",
                "Bytes per second the guest dirtied during the last round (pre-copy converges while this stays below the transfer rate).",
                |p| p.dirty_rate,
            ),
            ("round", "The pre-copy round under way (the last is stop-and-copy).", |p| p.round),
        ];
        for (name, help, get) in series {
            let mut f = e.family(&format!("pagefleet_migration_{name}"), Gauge, help);
            for (guest, p) in &moving {
                f.sample(&[("guest", guest)], get(p));
            }
        }
        let mut f = e.family(
            "pagefleet_migration_phase",
            Gauge,
            "1 for the phase a guest's migration is in (connecting, precopy, stop-and-copy, commit, done, aborting).",
        );
        for (guest, p) in &moving {
            f.sample(&[("guest", guest), ("phase", phase_label(&p.phase))], 1u64);
        }
        let t = {
            let t = lock(&self.migrations);
            (t.succeeded, t.failed, t.last_downtime_s, t.last_total_s)
        };
        let (succeeded, failed, last_downtime_s, last_total_s) = t;
        e.single(
            "pagefleet_migration_last_downtime_seconds",
            Gauge,
            "Downtime of the last migration from this host that succeeded (0 before one).",
            last_downtime_s,
        );
        e.single(
            "pagefleet_migration_last_duration_seconds",
            Gauge,
            "Start to running at the destination, of the last migration from this host that succeeded (0 before one).",
            last_total_s,
        );
        e.single(
            "pagefleet_migrations_succeeded_total",
            Counter,
            "Migrations from this host that left the guest running at the destination.",
            succeeded,
        );
        e.single(
            "pagefleet_migrations_failed_total",
            Counter,
            "Migrations from this host that failed (rolled back, or in doubt).",
            failed,
        );
    }

    /// Reserve memory, start a runner for `job` and wait for its ready line.
    fn spawn(
        self: &Arc<Guests>,
        name: &str,
        job: Job,
        budget_pages: u64,
        cgroup: Option<PathBuf>,
    ) -> Result<String, Refusal> {
        let (sub, incoming, ready) = match &job {
            Job::Guest { .. } => ("runner-guest", false, "guest "),
            Job::Incoming { .. } => ("runner-incoming", true, "migrate listening "),
        };
        let control = self.cfg.dir.join(format!("{name}.sock"));
        let log_path = self.cfg.dir.join(format!("{name}.log"));
        let launch = Launch {
            secret_hex: to_hex(self.cfg.secret.expose()),
            control: control.clone(),
            service_dev: self.cfg.service_dev.clone(),
            job,
            dedup_socket: self.cfg.dedup_socket.clone(),
            tls_dir: self.cfg.tls_dir.clone(),
            vm_bridge: self.cfg.vm_bridge.clone(),
        };
        let mut cmd = Command::new(&self.cfg.runner);
        // The name (validated: letters, digits, - and _) only labels the
        // process for `ps`; the runner takes its job from stdin.
        cmd.arg(sub)
            .arg(format!("--name={name}"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        // No parent-death signal: a runner outlives its daemon (a restart
        // adopts it). Its own session, so a terminal's or a process
        // group's signals for the daemon do not reach it.
        pagefleet_common::sys::process::new_session(&mut cmd);
        {
            let mut m = lock(&self.map);
            if m.contains_key(name) {
                return Err(Refusal::new(
                    409,
                    format!("guest {name:?} already exists on this host"),
                ));
            }
            let used: u64 = m.values().map(|e| e.budget_pages).sum();
            if pagefleet_units::bytes_of(used + budget_pages) > self.cfg.memory {
                return Err(Refusal::new(
                    409,
                    format!(
                        "not enough guest memory here: {} asked, {} free",
                        crate::fmt_size(pagefleet_units::bytes_of(budget_pages)),
                        crate::fmt_size(
                            self.cfg
                                .memory
                                .saturating_sub(pagefleet_units::bytes_of(used))
                        )
                    ),
                ));
            }
            // Reserve before starting, so two requests cannot both take the same memory.
            m.insert(
                name.to_string(),
                Entry {
                    pid: 0,
                    control: control.clone(),
                    budget_pages,
                    incoming,
                    last: None,
                    stopping: false,
                },
            );
            if lock(&self.failed).remove(name).is_some() {
                info!("guest {name}: a new runner replaces the failed guest's record (its log is {name}.log.1)");
            }
        }
        // Under the reservation: no other runner of this name writes logs now.
        let log = rotate_logs(&log_path)
            .and_then(|()| std::fs::File::create(&log_path))
            .map_err(|e| {
                lock(&self.map).remove(name);
                Refusal::new(500, format!("runner log {}: {e}", log_path.display()))
            })?;
        cmd.stderr(log);
        let forget = |me: &Guests| {
            lock(&me.map).remove(name);
        };
        let (tx, rx) = std::sync::mpsc::channel();
        let sent = lock(&self.spawner).send((cmd, tx));
        let spawned = match sent {
            Ok(()) => rx
                .recv()
                .unwrap_or_else(|_| Err(std::io::Error::other("spawner thread gone"))),
            Err(_) => Err(std::io::Error::other("spawner thread gone")),
        };
        let mut child: Child = match spawned {
            Ok(c) => c,
            Err(e) => {
                forget(self);
                return Err(Refusal::new(
                    500,
                    format!("cannot start runner {}: {e}", self.cfg.runner.display()),
                ));
            }
        };
        let pid = child.id();
        let fail = |child: &mut Child, me: &Guests, r: Refusal| {
            let _ = child.kill();
            let _ = child.wait();
            forget(me);
            Err(r)
        };
        if let Some(cg) = &cgroup {
            // Before it reads its launch message, so before any guest memory exists.
            if let Err(e) = std::fs::write(cg.join("cgroup.procs"), pid.to_string()) {
                let r = Refusal::new(
                    400,
                    format!("cannot put the runner into cgroup {}: {e}", cg.display()),
                );
                return fail(&mut child, self, r);
            }
        }
        let wrote = child.stdin.take().map(|mut i| {
            let mut b = serde_json::to_vec(&launch).unwrap_or_default();
            b.push(b'\n');
            i.write_all(&b)
        });
        if !matches!(wrote, Some(Ok(()))) {
            return fail(
                &mut child,
                self,
                Refusal::new(500, "cannot hand the runner its launch message"),
            );
        }
        let Some(stdout) = child.stdout.take() else {
            return fail(&mut child, self, Refusal::new(500, "runner has no stdout"));
        };
        let mut out = BufReader::new(stdout);
        let mut line = String::new();
        let got = out.read_line(&mut line).unwrap_or(0);
        if got == 0 || !line.starts_with(ready) {
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            let r = Refusal::new(
                500,
                format!("runner for {name} did not start: {}", log.trim()),
            );
            return fail(&mut child, self, r);
        }
        if let Some(e) = lock(&self.map).get_mut(name) {
            e.pid = pid;
        }
        info!(
            "guest {name} {} (runner {pid}, budget {}, log {})",
            if incoming {
                "waits for its incoming migration"
            } else {
                "started"
            },
            crate::fmt_size(pagefleet_units::bytes_of(budget_pages)),
            log_path.display()
        );
        self.save_runners();
        // Reap it; its memory goes back when it exits (stopped or migrated away).
        let me = self.clone();
        let n = name.to_string();
        std::thread::spawn(move || {
            let mut sink = String::new();
            while out.read_line(&mut sink).unwrap_or(0) > 0 {
                sink.clear();
            }
            let st = child.wait();
            // A VM runner's socket directory (its QEMU is gone with it).
            let _ = std::fs::remove_dir_all(me.cfg.dir.join(format!("{n}.{pid}.vm")));
            let mut m = lock(&me.map);
            let ended = match m.get(&n) {
                Some(e) if e.pid == pid => {
                    let e = m.remove(&n);
                    let _ = std::fs::remove_file(me.cfg.dir.join(format!("{n}.qmp")));
                    e
                }
                // A guest of that name runs here again: the socket is its.
                Some(_) => None,
                // Stopped through the daemon or migrated away (forgotten).
                None => {
                    let _ = std::fs::remove_file(me.cfg.dir.join(format!("{n}.qmp")));
                    None
                }
            };
            drop(m);
            me.save_runners();
            let exit = match &st {
                Ok(s) => describe_exit(*s),
                Err(e) => format!("unknown ({e})"),
            };
            let failed = !matches!(&st, Ok(s) if s.success());
            match ended {
                // A runner that was (or had become) a guest here ended on
                // its own: its record stays, failed, with the reason.
                Some(e)
                    if failed
                        && (!e.incoming || e.last.as_ref().is_some_and(|l| l.state.is_live())) =>
                {
                    me.record_failure(&n, pid, e, exit);
                }
                _ => info!("guest {n} (runner {pid}) ended: {exit}"),
            }
        });
        Ok(line.trim().to_string())
    }

    /// `POST /guests`: start a guest from its typed spec.
    pub fn start(self: &Arc<Guests>, mut req: StartGuest) -> Result<(), Refusal> {
        if !pagefleet_api::guest::valid_name(&req.name) {
            return Err(Refusal::new(
                400,
                "guest name: 1-32 letters, digits, - or _, starting with a letter or digit",
            ));
        }
        if req.size < pagefleet_units::PAGE_SIZE as u64 {
            return Err(Refusal::new(400, "size: at least one 4 KiB page"));
        }
        req.spec.validate().map_err(|e| Refusal::new(400, e))?;
        check_vm_files(&mut req.spec.workload, &self.cfg.vm_images)?;
        let budget_pages = req
            .budget_pages
            .unwrap_or(pagefleet_units::pages_for(req.size));
        let job = Job::Guest {
            name: req.name.clone(),
            size: req.size,
            budget_pages,
            spec: Box::new(req.spec),
        };
        self.spawn(&req.name, job, budget_pages, None).map(|_| ())
    }

    /// `POST /incoming`: a runner waiting for a migration.
    pub fn incoming(self: &Arc<Guests>, req: IncomingRequest) -> Result<IncomingReply, Refusal> {
        if !pagefleet_api::guest::valid_name(&req.name) {
            return Err(Refusal::new(
                400,
                "guest name: 1-32 letters, digits, - or _, starting with a letter or digit",
            ));
        }
        // Optionally inside a memory cgroup the caller set up (e.g. a
        // destination whose memory is limited, with the kernel swapping).
        let cgroup = req.cgroup.as_ref().map(PathBuf::from);
        if let Some(cg) = &cgroup {
            let canonical = cg.canonicalize().unwrap_or_default();
            if !canonical.starts_with("/sys/fs/cgroup/") || !canonical.join("cgroup.procs").exists()
            {
                return Err(Refusal::new(
                    400,
                    format!("{} is not a cgroup", cg.display()),
                ));
            }
        }
        let job = Job::Incoming {
            name: req.name.clone(),
            listen: format!("{}:0", self.cfg.ip),
            budget_pages: req.budget_pages,
            timeout_secs: 60,
        };
        let line = self.spawn(&req.name, job, req.budget_pages, cgroup)?;
        Ok(IncomingReply {
            migrate_addr: line
                .trim_start_matches("migrate listening ")
                .trim()
                .to_string(),
        })
    }

    /// Guest `name`'s runner (pid) ended with `exit` without being stopped
    /// or migrated away: keep its record as failed, log it, count it.
    fn record_failure(&self, name: &str, pid: u32, e: Entry, exit: String) {
        let log_path = self.cfg.dir.join(format!("{name}.log"));
        let text = std::fs::read_to_string(&log_path).unwrap_or_default();
        let tail: Vec<&str> = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        let reason = if tail.is_empty() {
            format!("the runner ended ({exit}) without a word")
        } else {
            tail[tail.len().saturating_sub(REASON_LINES)..].join(" | ")
        };
        let mut rec = e.last.unwrap_or_else(|| {
            GuestStatus::placeholder(name, GuestState::Failed, e.budget_pages, pid)
        });
        rec.state = GuestState::Failed;
        rec.pid = pid;
        rec.migration = None;
        rec.failure = Some(GuestFailure {
            reason: reason.chars().take(2000).collect(),
            exit: exit.clone(),
            at_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            log: log_path.display().to_string(),
        });
        tracing::error!(
            "guest {name} failed: runner {pid} ended ({exit}): {reason} (log {}; `pagefleet guest rm {name}` clears the record)",
            log_path.display()
        );
        self.failures.fetch_add(1, Relaxed);
        lock(&self.failed).insert(name.to_string(), rec);
    }

    /// `guest rm`: clear a failed guest's record.
    pub fn remove_record(&self, name: &str) -> Result<(), Refusal> {
        if lock(&self.failed).remove(name).is_some() {
            info!("guest {name}: failed record removed");
            return Ok(());
        }
        if lock(&self.map).contains_key(name) {
            return Err(Refusal::new(
                409,
                format!("guest {name:?} is running here: stop it (`pagefleet guest stop {name}`), there is no record to remove"),
            ));
        }
        Err(Refusal::new(404, format!("no guest {name:?} here")))
    }

    /// One guest: as its runner reports it, or its failed record.
    pub fn status(&self, name: &str) -> Result<GuestStatus, Refusal> {
        if let Some(f) = lock(&self.failed).get(name) {
            return Ok(f.clone());
        }
        self.control::<GuestStatus>(name, &ControlRequest::Status)
    }

    /// Every guest here, as its runner reports it, then failed records.
    pub fn list(&self) -> Vec<GuestStatus> {
        let entries: Vec<(String, PathBuf, u64, bool, u32)> = lock(&self.map)
            .iter()
            .map(|(n, e)| {
                (
                    n.clone(),
                    e.control.clone(),
                    e.budget_pages,
                    e.incoming,
                    e.pid,
                )
            })
            .collect();
        let mut v: Vec<GuestStatus> = entries
            .into_iter()
            .map(|(n, c, b, inc, pid)| {
                match control::call::<GuestStatus>(
                    &c,
                    &ControlRequest::Status,
                    Duration::from_secs(5),
                ) {
                    Ok(g) => {
                        if let Some(e) = lock(&self.map).get_mut(&n).filter(|e| e.pid == pid) {
                            e.last = Some(g.clone());
                        }
                        g
                    }
                    Err(_) => {
                        let st = if inc {
                            GuestState::Incoming
                        } else {
                            GuestState::Starting
                        };
                        GuestStatus::placeholder(&n, st, b, pid)
                    }
                }
            })
            .collect();
        v.extend(lock(&self.failed).values().cloned());
        v
    }

    fn control_path(&self, name: &str) -> Result<PathBuf, Refusal> {
        if let Some(e) = lock(&self.map).get(name) {
            return Ok(e.control.clone());
        }
        if let Some(f) = lock(&self.failed).get(name) {
            let why = f
                .failure
                .as_ref()
                .map(|x| format!("{} ({})", x.reason, x.exit));
            return Err(Refusal::new(
                409,
                format!(
                    "guest {name:?} failed: {}; `pagefleet guest rm {name}` clears its record",
                    why.unwrap_or_default()
                ),
            ));
        }
        Err(Refusal::new(404, format!("no guest {name:?} here")))
    }

    /// One control request to guest `name`'s runner, its typed reply.
    pub fn control<T: DeserializeOwned>(
        &self,
        name: &str,
        req: &ControlRequest,
    ) -> Result<T, Refusal> {
        let c = self.control_path(name)?;
        if matches!(req, ControlRequest::Stop) {
            if let Some(e) = lock(&self.map).get_mut(name) {
                e.stopping = true;
                info!("guest {name} (runner {}): stop asked", e.pid);
            }
        }
        // Moving a sub-host's pages or sorting takes as long as it takes.
        let t = match req {
            ControlRequest::Evacuate { .. } | ControlRequest::Sort => Duration::from_secs(3600),
            _ => Duration::from_secs(5),
        };
        Ok(control::call::<T>(&c, req, t)?)
    }

    /// Start a migration of guest `name`: the runner's stream of progress lines.
    pub fn migrate_stream(&self, name: &str, req: &ControlRequest) -> Result<UnixStream, Refusal> {
        let c = self.control_path(name)?;
        Ok(control::send(&c, req, None)?)
    }

    /// Runners here: (pid, waiting for an incoming migration).
    pub fn runners(&self) -> Vec<(u32, bool)> {
        lock(&self.map)
            .values()
            .filter(|e| e.pid != 0)
            .map(|e| (e.pid, e.incoming))
            .collect()
    }

    /// The guest left this host (its runner exits next): its memory is free at once.
    pub fn forget(&self, name: &str) {
        lock(&self.map).remove(name);
        self.save_runners();
    }

    /// Write `runners.json`: the running guests' runners, for the daemon
    /// that comes after this one (written whole, then renamed into place).
    fn save_runners(&self) {
        let list: Vec<Listed> = lock(&self.map)
            .iter()
            .filter(|(_, e)| e.pid != 0)
            .map(|(n, e)| Listed {
                name: n.clone(),
                pid: e.pid,
                control: e.control.clone(),
                budget_pages: e.budget_pages,
                incoming: e.incoming,
            })
            .collect();
        let path = self.cfg.dir.join("runners.json");
        let tmp = self.cfg.dir.join("runners.json.tmp");
        let r = std::fs::write(&tmp, serde_json::to_vec(&list).unwrap_or_default())
            .and_then(|()| std::fs::rename(&tmp, &path));
        if let Err(e) = r {
            tracing::warn!(
                "cannot write {}: {e} (a restart would not find its guests)",
                path.display()
            );
        }
    }

    /// Adopt the runners a previous daemon of this guest directory left
    /// running: each that still runs as its guest and answers its control
    /// socket. Returns the names adopted.
    pub fn adopt(self: &Arc<Guests>) -> Vec<String> {
        let path = self.cfg.dir.join("runners.json");
        let Ok(text) = std::fs::read(&path) else {
            return Vec::new();
        };
        let listed: Vec<Listed> = serde_json::from_slice(&text).unwrap_or_default();
        let mut adopted = Vec::new();
        for l in listed {
            if !pagefleet_api::guest::valid_name(&l.name) {
                continue;
            }
            // After an in-place restart a runner that ended meanwhile is
            // this process's unreaped child: reap it, its status is known.
            let reaped = pagefleet_common::sys::process::reap_if_ended(l.pid);
            // The pid is still this guest's runner (not a reused pid).
            let cmdline = std::fs::read(format!("/proc/{}/cmdline", l.pid)).unwrap_or_default();
            let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
            let sub: &[u8] = if l.incoming {
                b"runner-incoming"
            } else {
                b"runner-guest"
            };
            let ours = args.contains(&sub)
                && args
                    .iter()
                    .any(|a| *a == format!("--name={}", l.name).as_bytes());
            if reaped.is_some() || !ours {
                // It ended while no daemon watched: a guest that failed
                // (a runner waiting for a migration is the source's affair).
                if !l.incoming {
                    use std::os::unix::process::ExitStatusExt;
                    let exit = if let Some(st) = reaped {
                        describe_exit(std::process::ExitStatus::from_raw(st))
                    } else {
                        "ended while pagefleetd was not running; exit status unknown".into()
                    };
                    let e = Entry {
                        pid: l.pid,
                        control: l.control.clone(),
                        budget_pages: l.budget_pages,
                        incoming: false,
                        last: None,
                        stopping: false,
                    };
                    self.record_failure(&l.name, l.pid, e, exit);
                }
                continue;
            }
            // A runner that came by migration is adopted once it runs the
            // guest; one still waiting for its migration ends by itself.
            let status = match control::call::<GuestStatus>(
                &l.control,
                &ControlRequest::Status,
                Duration::from_secs(5),
            ) {
                Ok(s) if s.pid == l.pid && s.state.is_live() => s,
                _ => {
                    tracing::warn!(
                        "guest {} (runner {}) does not answer on {}: not adopted",
                        l.name,
                        l.pid,
                        l.control.display()
                    );
                    continue;
                }
            };
            let Ok(pidfd) = pagefleet_common::sys::process::pidfd_open(l.pid) else {
                continue;
            };
            lock(&self.map).insert(
                l.name.clone(),
                Entry {
                    pid: l.pid,
                    control: l.control.clone(),
                    budget_pages: l.budget_pages,
                    incoming: false,
                    last: Some(status),
                    stopping: false,
                },
            );
            let (me, n, pid) = (self.clone(), l.name.clone(), l.pid);
            std::thread::spawn(move || me.watch_adopted(&n, pid, pidfd));
            info!(
                "guest {} (runner {}) adopted: it kept running through the daemon's restart",
                l.name, l.pid
            );
            adopted.push(l.name);
        }
        self.save_runners();
        adopted
    }

    /// Wait for an adopted runner (not our child) to end, then do what the
    /// reaper does for our own.
    fn watch_adopted(&self, name: &str, pid: u32, pidfd: std::os::fd::OwnedFd) {
        // After an in-place restart (exec) the runner is still this
        // process's child: reaped here, and its exit status is known.
        let status = pagefleet_common::sys::process::wait_pidfd(std::os::fd::AsFd::as_fd(&pidfd));
        let _ = std::fs::remove_dir_all(self.cfg.dir.join(format!("{name}.{pid}.vm")));
        let ended = {
            let mut m = lock(&self.map);
            match m.get(name) {
                Some(e) if e.pid == pid => m.remove(name),
                _ => None,
            }
        };
        let _ = std::fs::remove_file(self.cfg.dir.join(format!("{name}.qmp")));
        self.save_runners();
        match ended {
            Some(e) if !e.stopping => {
                use std::os::unix::process::ExitStatusExt;
                let exit = match status {
                    // As wait(2) would have encoded them.
                    Some((libc::CLD_EXITED, c)) => {
                        describe_exit(std::process::ExitStatus::from_raw((c & 0xff) << 8))
                    }
                    Some((_, sig)) => describe_exit(std::process::ExitStatus::from_raw(sig & 0x7f)),
                    None => {
                        "ended; exit status unknown (runner adopted after a daemon restart)".into()
                    }
                };
                self.record_failure(name, pid, e, exit)
            }
            _ => info!("guest {name} (adopted runner {pid}) ended"),
        }
    }
}

/// `NAME.log` → `NAME.log.1` → … → `NAME.log.{LOGS_KEPT-1}` (the oldest
/// goes), so no runner's log is truncated by the next one.
fn rotate_logs(log: &std::path::Path) -> std::io::Result<()> {
    let nth = |i: usize| PathBuf::from(format!("{}.{i}", log.display()));
    for i in (1..LOGS_KEPT - 1).rev() {
        match std::fs::rename(nth(i), nth(i + 1)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    match std::fs::rename(log, nth(1)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// An exit status as an operator reads it.
fn describe_exit(s: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (s.code(), s.signal()) {
        (Some(c), _) => format!("exit status {c}"),
        (None, Some(sig)) => {
            let name = match sig {
                libc::SIGKILL => " (SIGKILL)",
                libc::SIGTERM => " (SIGTERM)",
                libc::SIGSEGV => " (SIGSEGV)",
                libc::SIGABRT => " (SIGABRT)",
                libc::SIGBUS => " (SIGBUS)",
                libc::SIGINT => " (SIGINT)",
                _ => "",
            };
            format!("killed by signal {sig}{name}")
        }
        _ => "ended".into(),
    }
}

/// A VM guest's files must lie under a directory the operator allowed
/// (`--vm-images`): QEMU reads them as root, so a request must not make it
/// read anything else on this host. Symlinks are resolved first. Each
/// disk's format is then read from its header where the request does not
/// give it, and recorded in the spec: the guest's disks are never probed
/// again, here or on the hosts it migrates to (see
/// `pagefleet_common::disk_image`, which also refuses images that would
/// make QEMU open other files).
fn check_vm_files(w: &mut pagefleet_api::Workload, allowed: &[PathBuf]) -> Result<(), Refusal> {
    let all_disks = w.vm_disks();
    let pagefleet_api::Workload::Vm {
        kernel,
        initrd,
        disks,
        firmware,
        ..
    } = w
    else {
        return Ok(());
    };
    if allowed.is_empty() {
        return Err(Refusal::new(
            403,
            "this host runs no VM guests: its pagefleetd has no --vm-images",
        ));
    }
    let roots: Vec<PathBuf> = allowed
        .iter()
        .filter_map(|d| std::fs::canonicalize(d).ok())
        .collect();
    let files = [kernel.as_ref(), initrd.as_ref()]
        .into_iter()
        .flatten()
        .chain(all_disks.iter().map(|d| &d.path));
    for f in files {
        let real =
            std::fs::canonicalize(f).map_err(|e| Refusal::new(400, format!("VM file {f}: {e}")))?;
        if !real.is_file() || !roots.iter().any(|r| real.starts_with(r)) {
            return Err(Refusal::new(
                403,
                format!("VM file {f} is not a file under this host's --vm-images"),
            ));
        }
    }
    // An overlay (the file a VM writes over a read-only base) and a UEFI
    // variable store lie under --vm-images too; a missing one is made
    // there when the VM starts.
    let nvram = match firmware {
        pagefleet_api::VmFirmware::Uefi { nvram } => Some(("UEFI variable store", &*nvram)),
        pagefleet_api::VmFirmware::Bios => None,
    };
    let made_here = all_disks
        .iter()
        .filter_map(|d| d.overlay.as_ref().map(|o| ("overlay", o)))
        .chain(nvram);
    for (what, o) in made_here {
        let p = std::path::Path::new(o);
        let real = if p.exists() {
            std::fs::canonicalize(p).ok().filter(|r| r.is_file())
        } else {
            p.parent()
                .and_then(|d| std::fs::canonicalize(d).ok())
                .zip(p.file_name())
                .map(|(d, n)| d.join(n))
        };
        if !real.is_some_and(|r| roots.iter().any(|root| r.starts_with(root))) {
            return Err(Refusal::new(
                403,
                format!("VM {what} {o} is not a file (or a new one in a directory) under this host's --vm-images"),
            ));
        }
    }
    for d in disks.iter_mut() {
        let f = pagefleet_common::disk_image::check(std::path::Path::new(&d.path), d.format)
            .map_err(|e| Refusal::new(400, e))?;
        d.format = Some(f);
        if let Some(o) = d
            .overlay
            .as_ref()
            .map(std::path::Path::new)
            .filter(|o| o.exists())
        {
            pagefleet_common::disk_image::check_overlay(o, std::path::Path::new(&d.path))
                .map_err(|e| Refusal::new(400, e))?;
        }
    }
    Ok(())
}
