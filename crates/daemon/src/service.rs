//! pagefleetd's services, started from its settings: the KSM and I/O
//! controllers, the memory server, the guest host service and the HTTP API
//! that serves them; they run until SIGINT or SIGTERM.

use crate::api;
use crate::app::App;
use crate::config::Settings;
use crate::error::{Context, Result};
use crate::guests::{GuestConfig, Guests};
use crate::http::{self, Gate};
use crate::MemServer;
use pagefleet_common::http::Client;
use pagefleet_common::httpauth::Verifier;
use pagefleet_common::units;
use pagefleet_memserver::ServerConfig;
use pagefleet_proto::auth::Secret;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// A host whose heartbeat stops is dead to the registry after this long.
const HEARTBEAT_TTL: std::time::Duration = std::time::Duration::from_secs(10);

/// What placement and gc read of a host: when none of it changed, a
/// heartbeat only renews the lease (no write to etcd).
fn placement_digest(me: &pagefleet_api::ClusterHost) -> String {
    let r = me.host.clone().unwrap_or_default();
    let guests: Vec<_> = me
        .guests
        .iter()
        .map(|g| {
            (
                &g.name,
                format!("{:?}", g.state),
                &g.region_id,
                g.size,
                g.remote_pages / 256,
            )
        })
        .collect();
    serde_json::to_string(&(
        &me.http,
        r.guest_memory,
        r.guest_free,
        r.lend_capacity,
        r.lend_used >> 20,
        &r.memserver,
        guests,
    ))
    .unwrap_or_default()
}

/// Keep this host in etcd: its report and guests are written when what
/// placement reads changed (or every 30 s), the lease renewed every 2 s;
/// say so when the registry becomes unreachable and again when it is back.
fn heartbeat_loop(app: &App, stop: &AtomicBool) {
    let Some(etcd) = &app.etcd else { return };
    let mut failing = false;
    let mut last: Option<(String, std::time::Instant)> = None;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let me = app.me();
        let name = me
            .host
            .as_ref()
            .map(|r| r.hostname.replace('/', "_"))
            .unwrap_or_default();
        let report = me.host.clone().unwrap_or_default();
        let digest = placement_digest(&me);
        let fresh = last
            .as_ref()
            .is_some_and(|(d, t)| *d == digest && t.elapsed() < std::time::Duration::from_secs(30));
        // Not before the HTTP API has its address (peers reach us there).
        let r = if me.http.is_empty() {
            Ok(())
        } else if fresh {
            etcd.keep_alive()
        } else {
            etcd.publish(&name, &me.http, &report, &me.guests)
                .map(|_| last = Some((digest, std::time::Instant::now())))
        };
        if r.is_err() {
            // Write everything again once the registry answers.
            last = None;
        }
        match r {
            Ok(()) if failing => {
                tracing::info!("registry reachable again");
                failing = false;
            }
            Ok(()) => {}
            Err(e) if !failing => {
                tracing::warn!("registry heartbeat failed (retrying every 2 s): {e}");
                failing = true;
            }
            Err(_) => {}
        }
        sleep_unless_stopped(stop, std::time::Duration::from_secs(2));
    }
}

/// Sleep `d`, in 100 ms steps, returning early once `stop` is set.
fn sleep_unless_stopped(stop: &AtomicBool, d: std::time::Duration) {
    let t = std::time::Instant::now();
    while t.elapsed() < d && !stop.load(std::sync::atomic::Ordering::Relaxed) {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// Announce this host to the join host every [`JOIN_INTERVAL`] and learn
/// every host it knows; say so when the join host stops answering and
/// again when it is back (the registry keeps whom it knows meanwhile).
///
/// [`JOIN_INTERVAL`]: crate::registry::JOIN_INTERVAL
/// The join host is read each time (a reload may set or change it).
fn join_loop(app: &App, me: &std::sync::OnceLock<String>, stop: &AtomicBool) {
    let Some(me) = me.get().cloned() else { return };
    let client = app.client.timeout(std::time::Duration::from_secs(2));
    let mut failing = false;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let Some(seed) = app.live.join() else {
            std::thread::sleep(std::time::Duration::from_millis(500));
            continue;
        };
        let seed = seed.as_str();
        let r: std::result::Result<pagefleet_api::JoinReply, _> = client.post(
            seed,
            "/registry/join",
            &pagefleet_api::JoinRequest { http: me.clone() },
        );
        match r {
            Ok(r) => {
                if failing {
                    tracing::info!("the join host {seed} answers again");
                    failing = false;
                }
                for p in std::iter::once(&r.me).chain(&r.peers) {
                    if *p == me || p.is_empty() {
                        continue;
                    }
                    match app.peers.learn(p) {
                        Ok(true) => {
                            tracing::info!("registry: learned host {p} from the join host {seed}")
                        }
                        Ok(false) => {}
                        Err(e) => tracing::warn!("registry: not adding {p}: {e}"),
                    }
                }
            }
            Err(e) if !failing => {
                tracing::warn!(
                    "cannot announce this host to the join host {seed} (the registry keeps the hosts it knows; retrying every {} s): {e}",
                    crate::registry::JOIN_INTERVAL.as_secs()
                );
                failing = true;
            }
            Err(_) => {}
        }
        sleep_unless_stopped(stop, crate::registry::JOIN_INTERVAL);
    }
}

/// The longest the periodic collection waits between looks.
const GC_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

/// Collect this host's orphaned regions every minute, or every grace
/// period when that is shorter (`--gc-grace`).
/// The grace is read each time (a reload may change it; none: wait).
fn collect_loop(app: &App, stop: &AtomicBool) {
    let mut last = std::time::Instant::now();
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        std::thread::sleep(std::time::Duration::from_millis(500));
        let Some(grace) = app.live.gc_grace() else {
            continue;
        };
        if last.elapsed() < grace.clamp(std::time::Duration::from_secs(1), GC_EVERY) {
            continue;
        }
        last = std::time::Instant::now();
        let req = pagefleet_api::GcRequest {
            grace_secs: grace.as_secs_f64(),
            dry_run: false,
            unreachable_gone: false,
        };
        let Some((st, addr)) = &app.memserver else {
            return;
        };
        // Nothing stored: no need to ask the registry.
        if st.store.stored_pages() == 0 {
            continue;
        }
        match crate::gc::collect(st, addr, &app.view(), &req) {
            Ok(r) if !r.freed.is_empty() => tracing::info!(
                "gc: freed {} pages of {} orphaned regions",
                r.pages_freed,
                r.freed.len()
            ),
            Ok(_) => {}
            Err(e) => tracing::debug!("gc skipped: {e}"),
        }
    }
}

/// SIGHUP: read the configuration again and apply what can change now
/// (`crate::reload`); systemd hears RELOADING=1, then READY=1.
fn reload(
    current: &mut Settings,
    r: &crate::reload::Reloader,
    live: &crate::reload::Live,
    app: Option<&Arc<App>>,
) {
    let _ = pagefleet_common::sdnotify::notify(&format!(
        "RELOADING=1\nSTATUS=reloading the configuration\nMONOTONIC_USEC={}",
        pagefleet_common::sdnotify::monotonic_usec()
    ));
    match (r.reread)() {
        // One log line (a TOML error spans several: its line, a caret).
        Err(e) => tracing::error!(
            "reload: {}; the running settings stay",
            e.lines()
                .map(str::trim_end)
                .filter(|l| !l.trim().is_empty())
                .collect::<Vec<_>>()
                .join(" | ")
        ),
        Ok(new) => {
            let o = crate::reload::apply(current, &new, live, app.map(|a| &a.peers), &*r.set_log);
            if o.applied.is_empty() && o.at_restart.is_empty() {
                tracing::info!("reloaded: nothing changed");
            } else if !o.applied.is_empty() {
                tracing::info!("reloaded: {}", o.applied.join(", "));
            }
            if !o.at_restart.is_empty() {
                tracing::warn!(
                    "reload: {} changed in the configuration and take effect at the next restart (`pagefleet host restart`, in place: guests and pages stay)",
                    o.at_restart.join(", ")
                );
            }
            *current = new;
        }
    }
    let _ = pagefleet_common::sdnotify::notify("READY=1\nSTATUS=serving");
}

/// What every service thread watches: set once the daemon really stops.
static SHUTDOWN: AtomicBool = AtomicBool::new(false);

/// A second stop request within this long of a refused one stops anyway.
const FORCE_WITHIN: std::time::Duration = std::time::Duration::from_secs(60);

/// What stopping this daemon now would lose: pages on its memory server
/// that a running guest owns or a connected client uses (the memory
/// server's pool ends with the daemon). Guests running here do not count:
/// their runners outlive the daemon and the next one adopts them; a
/// migration into this host (an incoming runner) does.
fn held(app: &App) -> Vec<String> {
    let mut v = Vec::new();
    if let Some(g) = &app.guests {
        for s in g.list() {
            if s.state == pagefleet_api::GuestState::Incoming {
                v.push(format!("a migration of guest {} into this host", s.name));
            }
        }
    }
    if let Some((st, _)) = &app.memserver {
        let regions = st.store.regions_info();
        if !regions.is_empty() {
            let view = app.view();
            let owners: std::collections::HashMap<u64, (String, String)> = view
                .hosts
                .iter()
                .flat_map(|h| h.guests.iter().map(move |g| (h, g)))
                .filter(|(_, g)| g.state != pagefleet_api::GuestState::Failed)
                .filter_map(|(h, g)| {
                    crate::gc::parse_region(&g.region_id)
                        .ok()
                        .map(|r| (r, (g.name.clone(), h.name().to_string())))
                })
                .collect();
            for r in regions {
                match owners.get(&r.region) {
                    Some((g, h)) => {
                        v.push(format!("{} pages of guest {g} (running on {h})", r.pages))
                    }
                    None if r.sessions > 0 => v.push(format!(
                        "{} pages of connected client {:?}",
                        r.pages, r.owner
                    )),
                    None => {}
                }
            }
        }
    }
    v
}

/// A stop was requested: whether to stop now. Stopping would lose nothing:
/// yes. Otherwise, with `drain`, drain this host within it first (cordon,
/// evacuate) and stop if that left nothing; without, refuse — unless a
/// stop was refused less than FORCE_WITHIN ago (a second request stops).
fn may_stop(
    app: Option<&Arc<App>>,
    drain: Option<std::time::Duration>,
    refused_at: &mut Option<std::time::Instant>,
) -> bool {
    let Some(app) = app else {
        return true;
    };
    let held = held(app);
    if held.is_empty() {
        return true;
    }
    if refused_at.is_some_and(|t| t.elapsed() < FORCE_WITHIN) {
        tracing::warn!(
            "stopping anyway (a second stop request): this loses {}",
            held.join("; ")
        );
        return true;
    }
    let me = (app.report)();
    let name = me.hostname.clone();
    let Some(limit) = drain else {
        tracing::error!(
            "refusing to stop: that would lose {}. Drain this host first (`pagefleet host drain {name}`), or ask again within {} s to stop anyway",
            held.join("; "),
            FORCE_WITHIN.as_secs()
        );
        *refused_at = Some(std::time::Instant::now());
        return false;
    };
    tracing::warn!(
        "draining before stopping (at most {} s): {}",
        limit.as_secs(),
        held.join("; ")
    );
    app.cordoned
        .store(true, std::sync::atomic::Ordering::SeqCst);
    // Only the lent pages move: the guests here keep running through the
    // restart (their runners outlive the daemon).
    let order = pagefleet_api::EvacuationOrder {
        host: me.http.clone().unwrap_or(name.clone()),
        to: None,
        pages_only: true,
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let a2 = app.clone();
    // Its own thread: past the limit the daemon answers again (the
    // evacuation may go on; the daemon stays up).
    let spawned = std::thread::Builder::new()
        .name("drain".into())
        .spawn(move || {
            let mut last = None;
            crate::orchestrate::evacuate(&a2, order, |ev| {
                if let pagefleet_api::EvacuationEvent::Failed { message } = ev {
                    last = Some(message.clone());
                }
                true
            });
            let _ = tx.send(last);
        });
    let outcome = match spawned {
        Ok(_) => rx.recv_timeout(limit),
        Err(e) => Ok(Some(format!("cannot start the drain: {e}"))),
    };
    let left = self::held(app);
    match outcome {
        Ok(None) if left.is_empty() => {
            tracing::info!("drained: stopping");
            true
        }
        r => {
            tracing::error!(
                "refusing to stop: the drain {} and this host still holds {} (it stays cordoned; ask again within {} s to stop anyway)",
                match r {
                    Ok(Some(m)) => format!("failed ({m})"),
                    Ok(None) => "ended".to_string(),
                    Err(_) => format!("took longer than {} s", limit.as_secs()),
                },
                left.join("; "),
                FORCE_WITHIN.as_secs()
            );
            *refused_at = Some(std::time::Instant::now());
            false
        }
    }
}

/// When this process image started, seconds since the Unix epoch.
/// The longest the memory server's sessions get to end before a restart.
const QUIESCE_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Restart in place: exec the binary this daemon was started from,
/// handing over the memory server, the sockets and the cordon (see
/// [`crate::handover`]). Returns only if it did not happen (logged why);
/// the daemon then serves on as before.
fn restart_in_place(
    app: Option<&Arc<App>>,
    exe: &std::path::Path,
    args: &[std::ffi::OsString],
    ms: Option<&MemServer>,
    http: Option<&std::net::TcpListener>,
) {
    if let Some(why) = app.and_then(|a| a.restart_refusal()) {
        tracing::error!("{why}");
        return;
    }
    match crate::handover::preflight(exe) {
        Ok(v) => tracing::info!("restarting in place into {v}"),
        Err(e) => {
            tracing::error!("not restarting: {e}");
            return;
        }
    }
    if let Some(m) = ms {
        if !m.state.quiesce(QUIESCE_WAIT) {
            m.state.resume();
            tracing::error!(
                "not restarting: {} memory-server sessions did not end within {} s",
                m.state.connections(),
                QUIESCE_WAIT.as_secs()
            );
            return;
        }
    }
    // systemd and /readyz: reloading until the new process serves.
    if let Some(a) = app {
        a.ready.set(crate::app::Phase::Restarting);
    }
    let _ = pagefleet_common::sdnotify::notify(&format!(
        "RELOADING=1\nSTATUS=restarting in place\nMONOTONIC_USEC={}",
        pagefleet_common::sdnotify::monotonic_usec()
    ));
    let e = crate::handover::exec(crate::handover::Outgoing {
        exe,
        args,
        memserver: ms.map(|m| (&*m.state, &m.listener)),
        http,
        cordoned: app.is_some_and(|a| a.cordoned.load(std::sync::atomic::Ordering::SeqCst)),
    });
    tracing::error!("in-place restart failed: {e}");
    if let Some(m) = ms {
        m.state.resume();
    }
    if let Some(a) = app {
        a.ready.set(crate::app::Phase::Serving);
    }
    let _ =
        pagefleet_common::sdnotify::notify("READY=1\nSTATUS=serving (the in-place restart failed)");
}

/// The device guests' service addresses go on when none is configured.
const DEFAULT_SERVICE_DEV: &str = "eth0";

/// This host's memory, bytes (MemTotal), if it can be read.
fn host_memory() -> Option<u64> {
    let m = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: u64 = m
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// Settings that name this host's resources are checked against the host
/// at start-up, not at the first request that needs them.
fn check_host(a: &Settings) -> Result<()> {
    if let Some(total) = host_memory() {
        let fmt = crate::fmt_size;
        for (flag, v) in [("--lend", a.lend), ("--guest-memory", a.guest_memory)] {
            if let Some(v) = v.filter(|v| *v > total) {
                return Err(crate::Error::Invalid(format!(
                    "{flag} {} is more than this host's memory ({}): the pages could not all be held",
                    fmt(v),
                    fmt(total)
                )));
            }
        }
        let both = a.lend.unwrap_or(0) + a.guest_memory.unwrap_or(0);
        if both > total {
            tracing::warn!(
                "--lend {} and --guest-memory {} together are more than this host's memory ({}): both cannot be used in full at once",
                fmt(a.lend.unwrap_or(0)),
                fmt(a.guest_memory.unwrap_or(0)),
                fmt(total)
            );
        }
    }
    if a.guest_memory.is_some() {
        let dev = a.service_dev.as_deref().unwrap_or(DEFAULT_SERVICE_DEV);
        if dev.contains('\0') {
            return Err(crate::Error::Invalid(format!(
                "--service-dev {dev:?}: not a device name"
            )));
        }
        // (It asks this process's network namespace.)
        let found = pagefleet_common::sys::net::interface_index(dev).is_some();
        match (found, &a.service_dev) {
            (true, _) => {}
            (false, Some(_)) => {
                return Err(crate::Error::Invalid(format!(
                    "--service-dev {dev}: no such network device on this host (`ip link` lists them); guests' service addresses go on it"
                )))
            }
            (false, None) => tracing::warn!(
                "no network device {dev} here: guests with a service address (--service-ip, kv/vm --listen on one) cannot start until --service-dev names one (`ip link` lists them)"
            ),
        }
        if let Some(br) = &a.vm_bridge {
            pagefleet_common::sys::net::check_bridge(br)
                .map_err(|e| crate::Error::Invalid(format!("--vm-bridge {br}: {e}")))?;
        }
    }
    Ok(())
}

/// Start every service `a` asks for and serve until SIGINT or SIGTERM.
pub fn run(a: Settings, reloader: crate::reload::Reloader) -> Result<()> {
    let reload_requested = pagefleet_common::signal::reload_flag();
    let live = Arc::new(crate::reload::Live::new(&a));
    crate::app::started_unix();
    // Taken first: the descriptors it names are owned from here on.
    let inherited = crate::handover::take()?;
    let exe = std::env::current_exe()?;
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let restart_requested = pagefleet_common::signal::restart_flag();
    let mut restarted_from: Option<(String, f64)> = None;
    if a.lend.is_none() && a.guest_memory.is_none() && a.ksm.is_none() && a.ioqos.is_none() {
        return Err(crate::Error::Invalid("nothing to do: lend memory with --lend SIZE (e.g. --lend 4GiB), run guests with --guest-memory SIZE, control KSM with --ksm adaptive and/or guarantee I/O with --ioqos-device DEV --ioqos-tenants SPEC; see --help".to_string()));
    }
    // SIGTERM/SIGINT ask the main loop to stop (`stop_requested`); it
    // decides, and `stop` (what every service thread watches) is set only
    // when the daemon really stops (the KSM controller then puts the host's
    // settings back).
    let stop_requested = pagefleet_common::signal::stop_flag();
    let stop: &'static AtomicBool = &SHUTDOWN;
    // The controllers' last states, for /metrics.
    let ksm_latest = crate::controllers::Latest::<pagefleet_ksm::control::State>::new();
    let ioqos_latest = crate::controllers::Latest::<pagefleet_ioqos::control::State>::new();
    let ksm = match &a.ksm {
        Some(spec) => {
            let opts = spec.options(
                Some(PathBuf::from(pagefleet_ksm::control::DEFAULT_STATE)),
                false,
                None,
            )?;
            pagefleet_ksm::sysfs::available()?;
            tracing::info!("KSM controller: {}", spec.mode);
            let latest = ksm_latest.clone();
            Some(std::thread::spawn(move || {
                if let Err(e) = pagefleet_ksm::control::run(&opts, stop, |s| latest.set(s)) {
                    tracing::error!("KSM controller stopped: {e:#}");
                }
            }))
        }
        None => None,
    };
    let ioqos = match &a.ioqos {
        Some(spec) => {
            let opts = spec.options(
                Some(PathBuf::from(pagefleet_ioqos::control::DEFAULT_STATE)),
                None,
            )?;
            tracing::info!(
                "I/O controller: {} on {} ({} tenants)",
                spec.policy,
                spec.device,
                opts.tenants.len()
            );
            let latest = ioqos_latest.clone();
            Some(std::thread::spawn(move || {
                if let Err(e) = pagefleet_ioqos::control::run(&opts, stop, |s| latest.set(s)) {
                    tracing::error!("I/O controller stopped: {e:#}");
                }
            }))
        }
        None => None,
    };
    if a.lend
        .is_some_and(|l| l < pagefleet_units::PAGE_SIZE as u64)
    {
        return Err(crate::Error::Invalid(
            "--lend is less than one 4 KiB page".to_string(),
        ));
    }
    check_host(&a)?;
    let tls = pagefleet_tls::init_process_identity(a.tls_dir.as_deref())
        .map_err(|e| crate::Error::Invalid(format!("TLS identity: {e}")))?;
    if let Some(id) = &tls {
        tracing::info!(
            "TLS identity {:?} from {}: peers not on loopback must use TLS",
            id.name,
            id.dir.display()
        );
    }
    let (secret, created) = Secret::load_or_create(a.secret_file.as_deref())?;
    if created {
        let p = a.secret_file.clone().unwrap_or_else(Secret::default_path);
        tracing::info!(
            "created a new cluster secret at {}; copy it to every host of the cluster",
            p.display()
        );
    }
    let cfg = ServerConfig {
        max_conns: a.max_conns,
        io_timeout: a.io_timeout,
        handshake_timeout: a.handshake_timeout,
        tls: tls.clone(),
        ..ServerConfig::default()
    };
    let (inherited_ms, inherited_http, inherited_cordon) = match inherited {
        Some(h) => {
            restarted_from = Some((h.from_version, h.at_unix));
            (h.memserver, h.http, h.cordoned)
        }
        None => (None, None, false),
    };
    if inherited_ms.is_some() && a.lend.is_none() {
        return Err(crate::Error::Invalid(
            "in-place restart: the previous daemon lent memory but this one has no --lend; its pages would be lost".into(),
        ));
    }
    let ms = match a.lend {
        Some(lend) => Some(MemServer::start(
            &a.listen,
            lend,
            secret.clone(),
            cfg,
            inherited_ms,
        )?),
        None => None,
    };
    let listen_addr: std::net::SocketAddr = match &ms {
        Some(m) => m.addr,
        None => a
            .listen
            .parse()
            .with_context(|| format!("--listen {} is not IP:PORT", a.listen))?,
    };
    // What other hosts reach this one at (listening on 0.0.0.0 says nothing).
    let toward: Vec<String> = a
        .join
        .iter()
        .chain(&a.peers)
        .chain(a.etcd.iter().flatten())
        .cloned()
        .collect();
    let public_ip = crate::advertise::public_ip(listen_addr.ip(), a.advertise, &toward);
    let ms_public = ms
        .as_ref()
        .map(|m| crate::advertise::public(m.addr, public_ip));
    let http_listen = match a.metrics.as_deref() {
        Some("off") => None,
        Some(m) => Some(m.to_string()),
        // Loopback unless configured: the API is for this host's CLI until
        // the operator opens it to the cluster's addresses.
        None if listen_addr.port() == 0 || a.listen.ends_with(":0") => {
            Some("127.0.0.1:0".to_string())
        }
        None => Some(format!("127.0.0.1:{}", listen_addr.port().wrapping_add(1))),
    };
    let mut dedup = None;
    let mut http_kept: Option<std::net::TcpListener> = None;
    let mut heartbeat_app: Option<Arc<App>> = None;
    let mut api_app: Option<Arc<App>> = None;
    let guests = match a.guest_memory {
        Some(mem) => {
            if http_listen.is_none() {
                return Err(crate::Error::Invalid(
                    "the guest host service needs the HTTP endpoint: drop --metrics off"
                        .to_string(),
                ));
            }
            let runner = match a.runner.clone() {
                Some(r) => r,
                None => std::env::current_exe()?.with_file_name("pagefleet-runner"),
            };
            let port = listen_addr.port();
            let dir = a
                .guest_dir
                .clone()
                .unwrap_or_else(|| PathBuf::from(format!("/run/pagefleet/guests-{port}")));
            let dedup_socket = a.dedup.then(|| crate::dedup::socket_path(&dir));
            let g = Guests::new(GuestConfig {
                memory: mem,
                runner,
                dir,
                service_dev: a
                    .service_dev
                    .clone()
                    .unwrap_or_else(|| DEFAULT_SERVICE_DEV.into()),
                ip: public_ip.to_string(),
                secret: secret.clone(),
                vm_images: a.vm_images.clone(),
                vm_bridge: a.vm_bridge.clone(),
                dedup_socket: dedup_socket.clone(),
                tls_dir: tls.as_ref().map(|t| t.dir.clone()),
            })?;
            // Guests a previous daemon of this directory left running (a
            // restart): adopted before anything can be placed here.
            let adopted = g.adopt();
            if !adopted.is_empty() {
                tracing::warn!(
                    "adopted {} running guest(s) from before the restart: {}",
                    adopted.len(),
                    adopted.join(", ")
                );
            }
            if let Some(sock) = &dedup_socket {
                // Sharing-aware migration is an optimization: without the
                // socket (a path too long for a unix socket, say) incoming
                // runners receive every page as data.
                match crate::dedup::Dedup::start(
                    Some(sock),
                    &secret,
                    Some(g.clone()),
                    ms.as_ref().map(|m| m.state.clone()),
                    crate::dedup::ScanConfig::default(),
                    stop,
                ) {
                    Ok(d) => dedup = Some(d),
                    Err(e) => tracing::warn!(
                        "no content index (sharing-aware migration into this host is off): cannot serve lookups on {}: {e}",
                        sock.display()
                    ),
                }
            }
            Some(g)
        }
        None => None,
    };
    // A host that only lends memory still has content to offer a
    // sub-host's share of a migration: what its store holds.
    if dedup.is_none() && guests.is_none() && a.dedup {
        if let Some(m) = &ms {
            dedup = Some(crate::dedup::Dedup::start(
                None,
                &secret,
                None,
                Some(m.state.clone()),
                crate::dedup::ScanConfig::default(),
                stop,
            )?);
        }
    }
    let haddr = match http_listen {
        Some(h) => {
            let self_http = Arc::new(std::sync::OnceLock::<String>::new());
            let st = ms
                .as_ref()
                .zip(ms_public)
                .map(|(m, a)| (m.state.clone(), a));
            let (g, me, name) = (guests.clone(), self_http.clone(), a.name.clone());
            let dd = dedup.clone();
            let tls_name = tls.as_ref().map(|t| t.name.clone());
            let cordoned = Arc::new(std::sync::atomic::AtomicBool::new(inherited_cordon));
            let cordon_flag = cordoned.clone();
            let (kl, ql) = (ksm_latest.clone(), ioqos_latest.clone());
            let report = move || {
                let mut r = crate::host_report(st.as_ref().map(|(s, a)| (&**s, *a)));
                r.http = me.get().cloned();
                if let Some(n) = &name {
                    r.hostname = n.clone();
                }
                if let Some(g) = &g {
                    r.guest_memory = g.cfg.memory;
                    r.guest_free = g.free_bytes();
                    r.guests = g.count() as u64;
                    r.migrations = g.recent_migrations();
                }
                r.dedup = dd.as_ref().map(|d| d.report());
                r.tls = tls_name.clone();
                r.cordoned = cordon_flag.load(std::sync::atomic::Ordering::SeqCst);
                r.version = env!("CARGO_PKG_VERSION").to_string();
                r.started_unix = crate::app::started_unix();
                r.ksm = kl.get().map(|s| crate::controllers::ksm_report(&s));
                r.ioqos = ql.get().map(|s| crate::controllers::ioqos_report(&s));
                r
            };
            let (st, g) = (ms.as_ref().map(|m| m.state.clone()), guests.clone());
            let dd = dedup.clone();
            let (kl, ql) = (ksm_latest.clone(), ioqos_latest.clone());
            let metrics_text = move || {
                let mut b = st.as_ref().map(|s| s.render_metrics()).unwrap_or_default();
                if let Some(g) = &g {
                    b.push_str(&g.metrics());
                }
                if let Some(d) = &dd {
                    b.push_str(&d.metrics());
                }
                let mut e = pagefleet_common::metrics::Exposition::new();
                if let Some(s) = kl.get() {
                    crate::controllers::ksm_metrics(&s, &mut e);
                }
                if let Some(s) = ql.get() {
                    crate::controllers::ioqos_metrics(&s, &mut e);
                }
                b.push_str(&e.finish());
                b
            };
            let app = Arc::new(App {
                guests: guests.clone(),
                report: Box::new(report),
                metrics: Box::new(metrics_text),
                peers: crate::registry::Peers::new(a.peers.clone()),
                client: Client::new(secret.clone()),
                memserver: ms
                    .as_ref()
                    .zip(ms_public)
                    .map(|(m, a)| (m.state.clone(), a.to_string())),
                etcd: match &a.etcd {
                    Some(eps) => Some(Arc::new(
                        pagefleet_registry::Etcd::new(eps.clone(), HEARTBEAT_TTL)
                            .map_err(|e| crate::Error::Invalid(e.to_string()))?,
                    )),
                    None => None,
                },
                cordoned,
                restart: crate::app::Restart::new(exe.clone(), restart_requested),
                ready: crate::app::Readiness::default(),
                ui: Arc::default(),
                live: live.clone(),
                recent_view: Default::default(),
            });
            api_app = Some(app.clone());
            if let Some(etcd) = &app.etcd {
                // Placement reads the registry's mirror: listed now, so the
                // first migration does not wait for it.
                etcd.follow();
                let hb = app.clone();
                std::thread::Builder::new()
                    .name("heartbeat".into())
                    .spawn(move || heartbeat_loop(&hb, stop))?;
                heartbeat_app = Some(app.clone());
            }
            if ms.is_some() {
                let app = app.clone();
                std::thread::Builder::new()
                    .name("gc".into())
                    .spawn(move || collect_loop(&app, stop))?;
            }
            let join_app = app.clone();
            let gate = Gate {
                tls: tls.clone(),
                verifier: Verifier::new(secret.clone()),
                live: live.clone(),
                ui: app.ui.clone(),
            };
            let l = match inherited_http {
                Some(l) => l,
                None => http::bind(&h)?,
            };
            http_kept = Some(l.try_clone()?);
            let addr = http::serve(l, api::router(app), gate)?;
            let _ = self_http.set(crate::advertise::public(addr, public_ip).to_string());
            if join_app.etcd.is_none() {
                let (app, me) = (join_app, self_http.clone());
                std::thread::Builder::new()
                    .name("join".into())
                    .spawn(move || join_loop(&app, &me, stop))?;
            }
            Some(addr)
        }
        None => None,
    };
    if let Some(m) = &ms {
        tracing::info!(
            "memory server lending {} on {}{}",
            units::fmt_size(pagefleet_units::bytes_of(
                m.state.store.stats(0).capacity_pages
            )),
            m.addr,
            haddr
                .map(|m| format!(", metrics on http://{m}/metrics"))
                .unwrap_or_default()
        );
    }
    if let Some(g) = a.guest_memory {
        tracing::info!("guest host service: {} for guests", units::fmt_size(g));
    }
    if let Some((from, at)) = restarted_from {
        tracing::warn!(
            "restarted in place from pagefleetd {from} ({:.3} s from its exec to serving again){}",
            crate::handover::since(at),
            ms.as_ref()
                .map(|m| format!(
                    ": memory server {:#x} goes on with {} pages",
                    m.state.server_id,
                    m.state.store.stored_pages()
                ))
                .unwrap_or_default()
        );
    }
    // Every listener serves: ready (before the lines a parent waits for).
    if let Some(app) = &api_app {
        app.ready.set(crate::app::Phase::Serving);
    }
    let mut out = std::io::stdout().lock();
    if let Some(m) = &ms {
        writeln!(out, "listening {}", m.addr)?;
    }
    if let Some(m) = haddr {
        writeln!(out, "metrics {m}")?;
    }
    out.flush()?;
    drop(out);
    // systemd (Type=notify): started now, every listener serving. After an
    // in-place restart this also ends the reload the old process announced.
    if let Err(e) = pagefleet_common::sdnotify::notify("READY=1\nSTATUS=serving") {
        tracing::warn!("cannot tell systemd this daemon is ready: {e}");
    }
    // The main thread keeps house: what the daemon's threads freed goes back
    // to the kernel, so its RSS follows what it holds (see common::heap).
    let mut ticks = 0u32;
    let mut refused_at: Option<std::time::Instant> = None;
    let mut current = a.clone();
    loop {
        std::thread::sleep(std::time::Duration::from_millis(100));
        ticks += 1;
        if ticks.is_multiple_of(50) {
            pagefleet_common::heap::give_back();
        }
        if stop_requested.swap(false, std::sync::atomic::Ordering::SeqCst)
            && may_stop(api_app.as_ref(), live.stop_drain(), &mut refused_at)
        {
            break;
        }
        if reload_requested.swap(false, std::sync::atomic::Ordering::SeqCst) {
            reload(&mut current, &reloader, &live, api_app.as_ref());
        }
        if restart_requested.swap(false, std::sync::atomic::Ordering::SeqCst) {
            // A request's reply (`POST /host/restart`) goes out first.
            std::thread::sleep(std::time::Duration::from_millis(100));
            restart_in_place(
                api_app.as_ref(),
                &exe,
                &args,
                ms.as_ref(),
                http_kept.as_ref(),
            );
        }
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    if let Some(app) = &api_app {
        app.ready.set(crate::app::Phase::Stopping);
    }
    let _ = pagefleet_common::sdnotify::notify("STOPPING=1");
    tracing::info!("stopping");
    if let Some(etcd) = heartbeat_app.as_ref().and_then(|a| a.etcd.as_ref()) {
        // Gone from the registry now, not when the lease runs out.
        etcd.withdraw();
    }
    if let Some(k) = ksm {
        let _ = k.join();
    }
    if let Some(q) = ioqos {
        let _ = q.join();
    }
    Ok(())
}
