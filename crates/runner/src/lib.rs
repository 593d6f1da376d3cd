//! The guest runner as a library: a guest's region, its workload, its
//! control socket and its migrations. pagefleetd starts a runner (the
//! `pagefleet-runner` binary, `src/main.rs`, which links this crate and the
//! data path only and calls [`launch`]) and writes one [`Launch`] message to
//! its stdin; the runner then either runs a new guest ([`run_guest`]) or
//! waits for a migration and runs the guest it brings ([`run_incoming`]).
//!
//! Errors come back as [`RunnerError`]; nothing here exits the process.
//! The runner ends when the guest is stopped or has migrated away
//! ([`Exit`]).

#![warn(missing_docs)]

pub mod control;
pub mod local;
pub mod service;
mod sys;
pub mod vm;
pub mod workload;

use pagefleet_api::launch::{from_hex, Job, Launch};
use pagefleet_api::GuestSpec;
use pagefleet_guests::Gate;
use pagefleet_migrate::dest;
use pagefleet_region::{Config, Region, Secret};
pub use service::Service;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Why a runner failed.
#[derive(Debug, thiserror::Error)]
pub enum RunnerError {
    /// An operating-system call failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// Why it failed.
        source: std::io::Error,
    },
    /// A request or launch message the runner cannot carry out.
    #[error("{0}")]
    Invalid(String),
    /// The guest's region.
    #[error("the guest's region: {0}")]
    Region(#[from] pagefleet_region::RegionError),
    /// The service address.
    #[error(transparent)]
    Service(#[from] service::ServiceError),
    /// The incoming migration failed.
    #[error("incoming migration: {0}")]
    Incoming(#[from] pagefleet_migrate::wire::WireError),
    /// No migration came.
    #[error("no migration arrived within {0} s")]
    NoMigration(u64),
}

impl RunnerError {
    /// An I/O error with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> RunnerError {
        RunnerError::Io {
            context: context.into(),
            source,
        }
    }
}

/// How a runner ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// Stopped: its pages on memory servers were deleted.
    Stopped,
    /// The guest runs on another host now, which owns its pages.
    MigratedAway,
}

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Exit::Stopped => "stopped; its pages on memory servers deleted",
            Exit::MigratedAway => "migrated away; the destination owns its pages",
        })
    }
}

/// Read the [`Launch`] message from `input` and run it.
pub fn launch(input: impl std::io::Read, expect: &str) -> Result<Exit, RunnerError> {
    // Before any thread starts (they inherit the mask): SIGINT and SIGTERM
    // end the guest through the control loop, which frees its pages.
    let _ = pagefleet_common::signal::TermSignals::block();
    control::watch_signals();
    let mut text = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(input.take(1 << 20)), &mut text)
        .map_err(|e| RunnerError::io("reading the launch message", e))?;
    let l: Launch = serde_json::from_str(&text)
        .map_err(|e| RunnerError::Invalid(format!("bad launch message on stdin: {e}")))?;
    let secret = from_hex(&l.secret_hex)
        .ok_or_else(|| RunnerError::Invalid("launch: the secret is not hex".into()))
        .and_then(|b| {
            Secret::from_bytes(&b, "the launch message")
                .map_err(|e| RunnerError::Invalid(e.to_string()))
        })?;
    pagefleet_tls::init_process_identity(l.tls_dir.as_deref())
        .map_err(|e| RunnerError::Invalid(format!("launch: TLS identity: {e}")))?;
    let net = HostNet::of(&l);
    match l.job {
        Job::Guest {
            name,
            size,
            budget_pages,
            spec,
        } if expect == "guest" => {
            run_guest(&name, size, budget_pages, *spec, &net, &l.control, secret)
        }
        Job::Incoming {
            name: _,
            listen,
            budget_pages,
            timeout_secs,
        } if expect == "incoming" => run_incoming(
            &listen,
            &l.control,
            Some(budget_pages),
            &net,
            secret,
            Duration::from_secs(timeout_secs),
            l.dedup_socket.as_deref(),
        ),
        _ => Err(RunnerError::Invalid(format!(
            "launch message is not for a {expect} runner"
        ))),
    }
}

/// The host's network settings a guest uses (from its daemon's
/// configuration, in the launch message).
#[derive(Clone, Debug, Default)]
pub struct HostNet {
    /// The device service addresses go on.
    pub service_dev: String,
    /// The bridge VMs' own NICs join (None: none here).
    pub vm_bridge: Option<String>,
}

impl HostNet {
    fn of(l: &Launch) -> HostNet {
        HostNet {
            service_dev: l.service_dev.clone(),
            vm_bridge: l.vm_bridge.clone(),
        }
    }
}

/// Tell the host daemon the runner is ready (its one line on stdout), then
/// point stdout at /dev/null: the daemon may restart (it adopts its
/// runners), and a write to the pipe of a daemon gone would fail.
fn ready(line: &str) -> Result<(), RunnerError> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")
        .and_then(|_| out.flush())
        .map_err(|e| RunnerError::io("telling the host daemon", e))?;
    let null = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/null")
        .map_err(|e| RunnerError::io("opening /dev/null", e))?;
    // stdout's lock is held, so no other thread writes meanwhile.
    sys::replace_stdout(&null).map_err(|e| RunnerError::io("pointing stdout at /dev/null", e))?;
    Ok(())
}

/// End the runner: on a migration away, the region's pages belong to the
/// destination now, so its handle is left undropped (the process ends
/// next; dropping it would delete the pages on the memory servers).
fn finish(exit: Exit, r: Arc<control::Running>) -> Exit {
    if exit == Exit::MigratedAway {
        std::mem::forget(r);
    }
    exit
}

/// Run a new guest here until it is stopped or migrated away.
pub fn run_guest(
    name: &str,
    size: u64,
    budget_pages: u64,
    spec: GuestSpec,
    net: &HostNet,
    control: &Path,
    secret: Secret,
) -> Result<Exit, RunnerError> {
    spec.validate()
        .map_err(|e| RunnerError::Invalid(e.to_string()))?;
    let mut cfg = Config::new(size, budget_pages);
    cfg.servers = spec.servers.clone();
    cfg.replicas = spec.replicas;
    cfg.policy = spec.policy;
    cfg.chunk_pages = spec.chunk;
    cfg.prefetch = spec.prefetch;
    cfg.sample_cpu_budget = spec.sample_budget;
    if let Some(us) = spec.reply_spin_us {
        cfg.reply_spin = std::time::Duration::from_micros(us);
    }
    cfg.name = format!("pagefleet-runner {name}");
    if !cfg.servers.is_empty() {
        cfg.secret = Some(secret.clone());
    }
    let service = spec.service_ip.clone().map(|ip| Service {
        ip,
        dev: net.service_dev.clone(),
    });
    let gate = Arc::new(Gate::default());
    let vm_spec = vm::spec_of(
        &spec.workload,
        size,
        name,
        Some(control),
        net.vm_bridge.as_deref(),
    )
    .map_err(|e| RunnerError::Invalid(e.to_string()))?;
    let (region, w) = match vm_spec {
        Some(v) => {
            // The address first: QEMU's forward binds it at boot.
            if let Some(s) = &service {
                s.claim()?;
            }
            let (region, g) = vm::boot(cfg, &v, &vm::socket_dir(Some(control), name))?;
            (Arc::new(region), workload::Started::vm(&g))
        }
        None => {
            let region = Arc::new(Region::new(cfg)?);
            if let Some(s) = &service {
                s.claim()?;
            }
            let w = workload::start(&spec, &region, &gate, false)?;
            (region, w)
        }
    };
    let r = Arc::new(control::Running::new(
        name.to_string(),
        spec,
        region,
        gate,
        w,
        service,
        secret,
    ));
    ready(&format!(
        "guest {name} running, control {}",
        control.display()
    ))?;
    let exit = control::serve(control, r.clone())?;
    Ok(finish(exit, r))
}

/// Wait for one migration on `listen`, then run the guest it brings until
/// it is stopped or migrated away again.
pub fn run_incoming(
    listen: &str,
    control: &Path,
    budget_pages: Option<u64>,
    net: &HostNet,
    secret: Secret,
    timeout: Duration,
    dedup_socket: Option<&Path>,
) -> Result<Exit, RunnerError> {
    let l = pagefleet_common::listen::listen(listen)
        .map_err(|e| RunnerError::io(format!("cannot listen for the migration on {listen}"), e))?;
    let addr = l
        .local_addr()
        .map_err(|e| RunnerError::io("listener address", e))?;
    ready(&format!("migrate listening {addr}"))?;
    l.set_nonblocking(true)
        .map_err(|e| RunnerError::io("listener", e))?;
    let t = Instant::now();
    // The first connection that proves the cluster secret is the migration;
    // anything else (a port scan, a wrong secret, garbage, a connection that
    // says nothing) is turned away, each in its own thread so none delays it.
    let (tx, rx) = std::sync::mpsc::channel();
    let stream = loop {
        if let Ok(st) = rx.try_recv() {
            break st;
        }
        match l.accept() {
            Ok((s, peer)) => {
                let _ = s.set_nonblocking(false);
                let (tx, secret) = (tx.clone(), secret.clone());
                std::thread::spawn(move || {
                    match dest::authenticate(s, &secret, Duration::from_secs(10)) {
                        Ok(st) => {
                            let _ = tx.send(st);
                        }
                        Err(e) => tracing::warn!("ignored a connection from {peer}: {e}"),
                    }
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && t.elapsed() < timeout => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                return Err(RunnerError::NoMigration(timeout.as_secs()))
            }
            Err(e) => return Err(RunnerError::io("accepting the migration", e)),
        }
    };
    drop(l);
    stream.set_timeout(Some(Duration::from_secs(60)));
    let progress = dest::Progress::default();
    // A VM's QEMU starts while its memory arrives (off the downtime).
    type Early =
        std::thread::JoinHandle<Result<(Arc<vm::VmGuest>, pagefleet_region::Foreign), RunnerError>>;
    let mut early: Option<Early> = None;
    // Sharing-aware migration: pages this host already holds are filled
    // from here (the host daemon's content index says where they are).
    let lookup = dedup_socket.and_then(|p| {
        let key = pagefleet_dedup::ContentKey::from_secret(&secret);
        pagefleet_dedup::lookup::LookupClient::connect(p, key)
            .map_err(|e| {
                tracing::warn!(
                    "no content lookup at {} ({e}): every page comes as data",
                    p.display()
                )
            })
            .ok()
    });
    let mut vm_error = None;
    let received = dest::receive_with(stream, &secret, &progress, lookup, &mut |spec, memfd| {
        let v = vm::spec_of(
            &spec.workload.workload,
            spec.size,
            &spec.name,
            Some(control),
            net.vm_bridge.as_deref(),
        );
        let v = match v {
            Ok(v) => v,
            Err(e) => {
                vm_error = Some(format!("the incoming VM cannot start: {e}"));
                None
            }
        };
        if let Some(v) = v {
            let memfd = memfd.clone();
            let dir = vm::socket_dir(Some(control), &spec.name);
            early = Some(std::thread::spawn(move || {
                vm::start_incoming(&v, &memfd, &dir)
            }));
        }
    })?;
    let (here, remote) = received.counts();
    tracing::info!("received {here} pages, {remote} located on servers; building the region");
    let mut vm_guest = None;
    let mut committed = received.commit_with(
        &secret,
        |c| {
            if let Some(b) = budget_pages {
                c.budget_pages = c.budget_pages.min(b);
            }
        },
        |cfg| match early.take() {
            // QEMU runs on the received memory and waits for its device state.
            Some(h) => {
                let (g, f) = h
                    .join()
                    .map_err(|_| "starting QEMU panicked".to_string())?
                    .map_err(|e| e.to_string())?;
                let region = vm::attach(cfg, &g, f).map_err(|e| e.to_string())?;
                vm_guest = Some(g);
                Ok(region)
            }
            None => match vm_error.take() {
                Some(e) => Err(e),
                None => Region::new(cfg).map_err(|e| e.to_string()),
            },
        },
    )?;
    let region = Arc::new(committed.take_region());
    let spec = committed.spec.clone();
    let (sum, secs) = if spec.verify {
        let t = Instant::now();
        region.hold_paging(true);
        let s = pagefleet_migrate::checksum(&region, &secret)
            .map_err(|e| RunnerError::Invalid(format!("checksum at resume: {e}")))?;
        region.hold_paging(false);
        (Some(s), t.elapsed().as_secs_f64())
    } else {
        (None, 0.0)
    };
    let service = spec.workload.service_ip.clone().map(|ip| Service {
        ip,
        dev: net.service_dev.clone(),
    });
    if let Some(s) = &service {
        s.claim()?;
    }
    let gate = Arc::new(Gate::default());
    let w = match &vm_guest {
        Some(g) => {
            g.resume_from(&committed.device_state)?;
            workload::Started::vm(g)
        }
        None => workload::start(&spec.workload, &region, &gate, true)?,
    };
    committed.started(sum, secs);
    let r = Arc::new(control::Running::new(
        spec.name.clone(),
        spec.workload.clone(),
        region,
        gate,
        w,
        service,
        secret,
    ));
    let exit = control::serve(control, r.clone())?;
    Ok(finish(exit, r))
}
