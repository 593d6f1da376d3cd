//! The routes of pagefleetd's HTTP API. Every one of them sits behind the
//! signature check in [`crate::http`]; bodies and replies are the typed
//! messages of `pagefleet_api`.
//!
//! | route | body | reply |
//! |---|---|---|
//! | `GET /metrics` | | Prometheus text |
//! | `GET /healthz`, `GET /readyz` | | `ok`; `ready` or 503 `not ready: starting / restarting in place / stopping` |
//! | `GET /host` | | `HostReport` |
//! | `POST /host/cordon` | `Cordon` | `Cordon` |
//! | `POST /host/restart` | none | `Restarting` (then the daemon execs itself: in-place restart) |
//! | `GET /cluster` | | `ClusterView` (this host and its peers) |
//! | `GET /guests`, `GET /guests/NAME` | | `[GuestStatus]`, `GuestStatus` |
//! | `POST /guests` | `StartGuest` | `{ok}` |
//! | `POST /incoming` | `IncomingRequest` | `IncomingReply` |
//! | `POST /guests/NAME/stop`, `cancel`, `sort` | none | `{ok}`, `{ok}`, `SortResult` |
//! | `POST /guests/NAME/rm` | none | `{ok}` (a failed guest's record cleared) |
//! | `POST /guests/NAME/set_budget` | `{pages}` | `{budget_pages}` |
//! | `POST /guests/NAME/evacuate` | `{from, to}` | `{moved}` |
//! | `POST /guests/NAME/migrate` | `MigrateRequest` | `ProgressEvent` lines |
//! | `POST /migrations` | `MigrationOrder` | `ProgressEvent` lines (placement first) |
//! | `POST /evacuations` | `EvacuationOrder` | `EvacuationEvent` lines |
//! | `POST /registry/remove` | `RemoveHost` | `HostRemoved` |
//! | `GET /ui/login?t=&n=&m=` | | 303 to `/ui/` with a session cookie ([`crate::ui`]) |
//! | `GET /ui/`, `/ui/app.js`, `/ui/app.css` | | the dashboard page |
//! | `GET /ui/api/snapshot`, `/ui/api/events` | | the cluster as JSON; as server-sent events, one per second |

use crate::guests::{Guests, Refusal};
use crate::http::error;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use pagefleet_api::control::{Budget, Moved};
use pagefleet_api::{
    ClusterHost, ClusterView, ControlRequest, EvacuationEvent, EvacuationOrder, GuestStatus,
    HostReport, IncomingRequest, MigrateRequest, MigrationOrder, ProgressEvent, SortResult,
    StartGuest,
};
use pagefleet_common::http::Client;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// What the routes serve.
pub struct App {
    /// The guest host service, if this host runs guests.
    pub guests: Option<Arc<Guests>>,
    /// This host's report, fresh on each call.
    pub report: Box<dyn Fn() -> HostReport + Send + Sync>,
    /// The Prometheus text, fresh on each call.
    pub metrics: Box<dyn Fn() -> String + Send + Sync>,
    /// The other hosts (the embedded registry): `--peers` less the removed.
    pub peers: crate::registry::Peers,
    /// Signed client for asking the peers.
    pub client: Client,
    /// This host's memory server and its address, if it lends memory.
    pub memserver: Option<(Arc<pagefleet_memserver::ServerState>, String)>,
    /// etcd as the registry (None: the peers list).
    pub etcd: Option<Arc<pagefleet_registry::Etcd>>,
    /// Cordoned: placement puts nothing new here (in `HostReport`). Held
    /// by this daemon until uncordoned; handed over by an in-place restart.
    pub cordoned: Arc<std::sync::atomic::AtomicBool>,
    /// In-place restarts: what to exec, and who asked.
    pub restart: Restart,
    /// Whether this daemon takes work (`GET /readyz`).
    pub ready: Readiness,
    /// The web dashboard's sessions and viewers.
    pub ui: Arc<crate::ui::Ui>,
    /// What a reload may change.
    pub live: Arc<crate::reload::Live>,
    /// The last view [`App::view_recent`] took, and when.
    pub recent_view: std::sync::Mutex<Option<(std::time::Instant, ClusterView)>>,
}

/// How old a view the series and the dashboard may show: each asks every
/// peer (or etcd), and a scrape, a dashboard's tick and another scraper
/// coming within this share one asking.
pub const RECENT_VIEW: std::time::Duration = std::time::Duration::from_secs(1);

/// Where the daemon is in its life, as `GET /readyz` and systemd see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    /// Its services are still starting.
    Starting = 0,
    /// Every listener serves.
    Serving = 1,
    /// Execing itself (an in-place restart): back in well under a second.
    Restarting = 2,
    /// Stopping.
    Stopping = 3,
}

/// The daemon's [`Phase`], shared by the main loop and the API.
#[derive(Default)]
pub struct Readiness(std::sync::atomic::AtomicU8);

impl Readiness {
    /// Now in `p`.
    pub fn set(&self, p: Phase) {
        self.0.store(p as u8, std::sync::atomic::Ordering::SeqCst);
    }

    /// The phase now.
    pub fn get(&self) -> Phase {
        match self.0.load(std::sync::atomic::Ordering::SeqCst) {
            1 => Phase::Serving,
            2 => Phase::Restarting,
            3 => Phase::Stopping,
            _ => Phase::Starting,
        }
    }
}

/// What an in-place restart (`POST /host/restart`, SIGUSR2) needs.
pub struct Restart {
    /// The binary at the path this daemon was started from.
    pub exe: std::path::PathBuf,
    /// Set to ask the main loop to restart.
    pub requested: &'static std::sync::atomic::AtomicBool,
    /// Migrations and evacuations this daemon orchestrates now (a restart
    /// would cut them off).
    busy: std::sync::atomic::AtomicUsize,
}

impl Restart {
    /// Restarts exec `exe` when `requested` is set.
    pub fn new(
        exe: std::path::PathBuf,
        requested: &'static std::sync::atomic::AtomicBool,
    ) -> Restart {
        Restart {
            exe,
            requested,
            busy: Default::default(),
        }
    }

    /// Orchestrations running now.
    pub fn busy(&self) -> usize {
        self.busy.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Count an orchestration while the guard lives.
    fn orchestrating(&self) -> impl Drop + '_ {
        struct Busy<'a>(&'a std::sync::atomic::AtomicUsize);
        impl Drop for Busy<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
        self.busy.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Busy(&self.busy)
    }
}

type Shared = State<Arc<App>>;

fn refusal(r: Refusal) -> Response {
    error(
        StatusCode::from_u16(r.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        r.message,
    )
}

fn guests(app: &App) -> Result<Arc<Guests>, Refusal> {
    app.guests.clone().ok_or_else(|| {
        Refusal::new(
            404,
            "this host runs no guests (start pagefleetd with --guest-memory)",
        )
    })
}

/// A typed body, or a 400 that says what is wrong with it.
fn body<T: DeserializeOwned>(b: &Bytes) -> Result<T, Refusal> {
    serde_json::from_slice(b).map_err(|e| Refusal::new(400, format!("bad request body: {e}")))
}

/// No body, or an empty JSON object.
fn no_body(b: &Bytes) -> Result<(), Refusal> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Empty {}
    if b.iter().all(u8::is_ascii_whitespace) {
        return Ok(());
    }
    body::<Empty>(b).map(|_| ())
}

/// Run blocking work (runner sockets, spawning) off the async workers.
async fn blocking<T: Serialize + Send + 'static>(
    f: impl FnOnce() -> Result<T, Refusal> + Send + 'static,
) -> Response {
    match tokio::task::spawn_blocking(f).await {
        Ok(Ok(v)) => Json(v).into_response(),
        Ok(Err(r)) => refusal(r),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e),
    }
}

async fn index() -> &'static str {
    "pagefleetd: GET /metrics /healthz /readyz /host /cluster /ui/ /guests /guests/NAME; POST /host/cordon /host/restart /guests /incoming \
     /guests/NAME/{stop,rm,cancel,sort,set_budget,evacuate,migrate} /migrations /evacuations; GET /memserver/regions, POST /memserver/drop /gc (signed requests; see docs/architecture.md)\n"
}

/// `GET /healthz`: the daemon answers (liveness).
async fn healthz() -> &'static str {
    "ok\n"
}

/// `GET /readyz`: 200 while the daemon serves; 503 with the reason while
/// it starts, restarts in place or stops (a load balancer sends nothing
/// new meanwhile). Nothing else is told.
async fn readyz(State(app): Shared) -> Response {
    let why = match app.ready.get() {
        Phase::Serving => return (StatusCode::OK, "ready\n").into_response(),
        Phase::Starting => "not ready: starting\n",
        Phase::Restarting => "not ready: restarting in place\n",
        Phase::Stopping => "not ready: stopping\n",
    };
    (StatusCode::SERVICE_UNAVAILABLE, why).into_response()
}

async fn metrics(State(app): Shared) -> Response {
    // Guests' figures come from their runners' control sockets, the
    // registry's from the peers or etcd: blocking.
    let text = tokio::task::spawn_blocking(move || {
        let mut t = (app.metrics)();
        t.push_str(&registry_metrics(&app.view_recent()));
        t
    })
    .await
    .unwrap_or_default();
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// The registry's view as series: every host it knows, alive (it answered,
/// or its etcd record is fresh) or dead.
fn registry_metrics(v: &ClusterView) -> String {
    use pagefleet_common::metrics::{Exposition, Kind::Gauge};
    let mut e = Exposition::new();
    let alive = v.hosts.iter().filter(|h| h.host.is_some()).count();
    let mut f = e.family(
        "pagefleet_registry_hosts",
        Gauge,
        "Hosts this daemon's registry knows, by state (dead: it did not answer, or its record is stale).",
    );
    f.sample(&[("state", "alive")], alive);
    f.sample(&[("state", "dead")], v.hosts.len() - alive);
    let mut f = e.family(
        "pagefleet_registry_host_up",
        Gauge,
        "1 while the registry sees the host alive, 0 while it sees it dead.",
    );
    for h in &v.hosts {
        f.sample(&[("host", h.name())], h.host.is_some());
    }
    // Claims are etcd's: with the embedded registry there are none to show.
    if v.hosts.iter().any(|h| h.claimed.is_some()) {
        let mut f = e.family(
            "pagefleet_registry_claimed_bytes",
            Gauge,
            "Memory promised on a host to migrations on their way, by pool (guest: its guest memory; lend: its memory server's).",
        );
        for h in &v.hosts {
            if let Some(c) = h.claimed {
                f.sample(&[("host", h.name()), ("pool", "guest")], c.guest_bytes);
                f.sample(&[("host", h.name()), ("pool", "lend")], c.lend_bytes);
            }
        }
    }
    e.finish()
}

async fn host(State(app): Shared) -> Json<HostReport> {
    Json((app.report)())
}

/// `POST /host/cordon`: placement keeps off this host (or comes back).
async fn cordon(State(app): Shared, b: Bytes) -> Response {
    let c = match body::<pagefleet_api::Cordon>(&b) {
        Ok(c) => c,
        Err(r) => return refusal(r),
    };
    let was = app
        .cordoned
        .swap(c.cordoned, std::sync::atomic::Ordering::SeqCst);
    if was != c.cordoned {
        tracing::info!(
            "{}",
            if c.cordoned {
                "cordoned: placement puts no new guest or page on this host"
            } else {
                "uncordoned: placement may use this host again"
            }
        );
    }
    Json(c).into_response()
}

/// `POST /host/restart`: check that nothing would be cut off and that the
/// binary runs, then have the main loop exec it (after this reply).
async fn restart(State(app): Shared, b: Bytes) -> Response {
    if let Err(r) = no_body(&b) {
        return refusal(r);
    }
    blocking(move || {
        if let Some(why) = crate::service::restart_refusal(&app) {
            return Err(Refusal::new(409, why));
        }
        let to = crate::handover::preflight(&app.restart.exe)
            .map_err(|e| Refusal::new(500, format!("not restarting: {e}")))?;
        app.restart
            .requested
            .store(true, std::sync::atomic::Ordering::SeqCst);
        Ok(pagefleet_api::Restarting {
            pid: std::process::id(),
            binary: app.restart.exe.display().to_string(),
            from_version: env!("CARGO_PKG_VERSION").to_string(),
            to_version: to,
            started_unix: crate::service::started_unix(),
        })
    })
    .await
}

impl App {
    /// This host as the registry shows it.
    pub fn me(&self) -> ClusterHost {
        let guests = self.guests.as_ref().map(|g| g.list()).unwrap_or_default();
        let r = (self.report)();
        ClusterHost {
            http: r.http.clone().unwrap_or_default(),
            host: Some(r),
            guests,
            error: None,
            claimed: None,
        }
    }

    /// What placement reads: with etcd, every host's report but only this
    /// host's guests (the guest to place is here); else the full view.
    pub fn placement_view(&self) -> ClusterView {
        match &self.etcd {
            Some(etcd) => self.me_first(etcd.hosts_view()),
            None => self.view(),
        }
    }

    /// The registry's view, taken at most [`RECENT_VIEW`] ago: for what
    /// only shows it (the series, the dashboard), never for decisions.
    pub fn view_recent(&self) -> ClusterView {
        let mut last = self.recent_view.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((at, v)) = last.as_ref() {
            if at.elapsed() < RECENT_VIEW {
                return v.clone();
            }
        }
        // Held while asking: a second caller meanwhile waits and shares it.
        let v = self.view();
        *last = Some((std::time::Instant::now(), v.clone()));
        v
    }

    /// The registry's view: from etcd (this host first), or this host and
    /// every peer. An unreachable etcd is an entry with its error (so
    /// nothing that needs the whole cluster, like gc, goes ahead).
    pub fn view(&self) -> ClusterView {
        match &self.etcd {
            Some(etcd) => self.me_first(etcd.view()),
            None => self.peers.cluster(self.me(), &self.client),
        }
    }

    /// A view read from etcd with this host's own entry first and fresh
    /// (not its last heartbeat), or this host and the registry's error.
    fn me_first(
        &self,
        read: Result<ClusterView, pagefleet_registry::RegistryError>,
    ) -> ClusterView {
        let mut me = self.me();
        match read {
            Ok(mut v) => {
                let (http, name) = (me.http.clone(), me.name().to_string());
                let mine = |h: &ClusterHost| h.http == http || h.name() == name;
                // Its claims are etcd's to say.
                let claimed = v.hosts.iter().find(|h| mine(h)).and_then(|h| h.claimed);
                me.claimed = claimed;
                v.hosts.retain(|h| !mine(h));
                v.hosts.insert(0, me);
                v
            }
            Err(e) => ClusterView {
                hosts: vec![
                    me,
                    ClusterHost {
                        http: "etcd".into(),
                        host: None,
                        guests: vec![],
                        error: Some(format!("the registry cannot be read: {e}")),
                        claimed: None,
                    },
                ],
            },
        }
    }
}

async fn cluster(State(app): Shared) -> Response {
    tokio::task::spawn_blocking(move || Json(app.view()).into_response())
        .await
        .unwrap_or_else(|e| error(StatusCode::INTERNAL_SERVER_ERROR, e))
}

async fn list(State(app): Shared) -> Response {
    let Some(g) = app.guests.clone() else {
        return Json(Vec::<GuestStatus>::new()).into_response();
    };
    blocking(move || Ok(g.list())).await
}

async fn status(State(app): Shared, Path(name): Path<String>) -> Response {
    match guests(&app) {
        Ok(g) => blocking(move || g.status(&name)).await,
        Err(r) => refusal(r),
    }
}

async fn start(State(app): Shared, b: Bytes) -> Response {
    let (g, req) = match (guests(&app), body::<StartGuest>(&b)) {
        (Ok(g), Ok(r)) => (g, r),
        (Err(r), _) | (_, Err(r)) => return refusal(r),
    };
    blocking(move || g.start(req).map(|_| pagefleet_api::Ok::default())).await
}

async fn incoming(State(app): Shared, b: Bytes) -> Response {
    let (g, req) = match (guests(&app), body::<IncomingRequest>(&b)) {
        (Ok(g), Ok(r)) => (g, r),
        (Err(r), _) | (_, Err(r)) => return refusal(r),
    };
    blocking(move || g.incoming(req)).await
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SetBudget {
    pages: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Evacuate {
    from: String,
    to: String,
}

async fn guest_op(
    State(app): Shared,
    Path((name, op)): Path<(String, String)>,
    b: Bytes,
) -> Response {
    let g = match guests(&app) {
        Ok(g) => g,
        Err(r) => return refusal(r),
    };
    if op == "rm" {
        return match no_body(&b) {
            Ok(()) => {
                blocking(move || g.remove_record(&name).map(|_| pagefleet_api::Ok::default())).await
            }
            Err(r) => refusal(r),
        };
    }
    let parsed = match op.as_str() {
        "stop" => no_body(&b).map(|_| ControlRequest::Stop),
        "cancel" => no_body(&b).map(|_| ControlRequest::Cancel),
        "sort" => no_body(&b).map(|_| ControlRequest::Sort),
        "set_budget" => body::<SetBudget>(&b).map(|s| ControlRequest::SetBudget { pages: s.pages }),
        "evacuate" => body::<Evacuate>(&b).map(|e| ControlRequest::Evacuate {
            from: e.from,
            to: e.to,
        }),
        "migrate" => body::<MigrateRequest>(&b).map(ControlRequest::Migrate),
        _ => Err(Refusal::new(
            404,
            format!(
                "no operation {op:?}: use stop, rm, cancel, sort, set_budget, evacuate or migrate"
            ),
        )),
    };
    let req = match parsed {
        Ok(r) => r,
        Err(r) => return refusal(r),
    };
    match req {
        ControlRequest::Migrate(_) => migrate(g, name, req).await,
        ControlRequest::Sort => blocking(move || g.control::<SortResult>(&name, &req)).await,
        ControlRequest::SetBudget { .. } => {
            blocking(move || g.control::<Budget>(&name, &req)).await
        }
        ControlRequest::Evacuate { .. } => blocking(move || g.control::<Moved>(&name, &req)).await,
        _ => blocking(move || g.control::<pagefleet_api::Ok>(&name, &req)).await,
    }
}

/// A reply streaming the events `f` emits as JSON lines. `f` runs on its
/// own thread; its `emit` returns false once the caller has gone.
fn events<E: Serialize + 'static>(
    f: impl FnOnce(&mut dyn FnMut(&E) -> bool) + Send + 'static,
) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::convert::Infallible>>(16);
    std::thread::spawn(move || {
        let mut emit = |ev: &E| {
            let mut line = serde_json::to_vec(ev).unwrap_or_default();
            line.push(b'\n');
            tx.blocking_send(Ok(Bytes::from(line))).is_ok()
        };
        f(&mut emit);
    });
    (
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx)),
    )
        .into_response()
}

/// `POST /guests/NAME/migrate`: the runner's migration to an explicit
/// destination, relayed; the caller going away (its Ctrl-C) cancels it.
async fn migrate(g: Arc<Guests>, name: String, req: ControlRequest) -> Response {
    let ControlRequest::Migrate(m) = req else {
        return error(StatusCode::BAD_REQUEST, "not a migration");
    };
    events::<ProgressEvent>(move |emit| crate::orchestrate::relay(&g, &name, m, true, emit))
}

/// `POST /migrations`: placement and the whole migration, on this (the
/// source) host; it goes on if the caller leaves.
async fn migrations(State(app): Shared, b: Bytes) -> Response {
    let order = match body::<MigrationOrder>(&b) {
        Ok(o) => o,
        Err(r) => return refusal(r),
    };
    if let Err(r) = guests(&app) {
        return refusal(r);
    }
    events::<ProgressEvent>(move |emit| {
        let _busy = app.restart.orchestrating();
        crate::orchestrate::migrate(&app, order, emit)
    })
}

/// `POST /evacuations`: empty a host; goes on if the caller leaves.
async fn evacuations(State(app): Shared, b: Bytes) -> Response {
    let order = match body::<EvacuationOrder>(&b) {
        Ok(o) => o,
        Err(r) => return refusal(r),
    };
    events::<EvacuationEvent>(move |emit| {
        let _busy = app.restart.orchestrating();
        crate::orchestrate::evacuate(&app, order, emit)
    })
}

fn memserver(app: &App) -> Result<(Arc<pagefleet_memserver::ServerState>, String), Refusal> {
    app.memserver.clone().ok_or_else(|| {
        Refusal::new(
            404,
            "this host lends no memory (start pagefleetd with --lend)".to_string(),
        )
    })
}

/// `GET /memserver/regions`.
async fn mem_regions(State(app): Shared) -> Response {
    match memserver(&app) {
        Ok((st, _)) => blocking(move || Ok(crate::gc::regions(&st))).await,
        Err(r) => refusal(r),
    }
}

/// `POST /memserver/drop`.
async fn mem_drop(State(app): Shared, b: Bytes) -> Response {
    let (st, req) = match (memserver(&app), body::<pagefleet_api::DropRegion>(&b)) {
        (Ok((st, _)), Ok(r)) => (st, r),
        (Err(r), _) | (_, Err(r)) => return refusal(r),
    };
    blocking(move || crate::gc::drop_region(&st, &req.region).map_err(|e| Refusal::new(400, e)))
        .await
}

/// `POST /gc`: collect this host's orphaned regions against the registry.
async fn gc(State(app): Shared, b: Bytes) -> Response {
    let ((st, addr), req) = match (memserver(&app), body::<pagefleet_api::GcRequest>(&b)) {
        (Ok(m), Ok(r)) => (m, r),
        (Err(r), _) | (_, Err(r)) => return refusal(r),
    };
    blocking(move || {
        let view = app.view();
        crate::gc::collect(&st, &addr, &view, &req).map_err(|e| Refusal::new(409, e))
    })
    .await
}

/// Every route.
pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/", get(index))
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/host", get(host))
        .route("/host/cordon", post(cordon))
        .route("/host/restart", post(restart))
        .route("/cluster", get(cluster))
        .route("/guests", get(list).post(start))
        .route("/guests/{name}", get(status))
        .route("/guests/{name}/{op}", post(guest_op))
        .route("/incoming", post(incoming))
        .route("/migrations", post(migrations))
        .route("/evacuations", post(evacuations))
        .route("/memserver/regions", get(mem_regions))
        .route("/memserver/drop", post(mem_drop))
        .route("/gc", post(gc))
        .route("/registry/remove", post(remove_host))
        .route("/registry/join", post(join))
        .merge(crate::ui::routes())
        .with_state(app)
}

/// `POST /registry/remove`: a dead host leaves this daemon's registry (its
/// peers; with etcd, its records and its etcd member). Refused for this
/// host itself.
/// `POST /registry/join`: a host announces itself (`--join`); the answer
/// is every host this registry knows.
async fn join(State(app): Shared, b: Bytes) -> Response {
    let req = match body::<pagefleet_api::JoinRequest>(&b) {
        Ok(r) => r,
        Err(r) => return refusal(r),
    };
    blocking(move || {
        if app.etcd.is_some() {
            return Err(Refusal::new(
                409,
                "this cluster's registry is etcd: hosts find each other there (drop [registry] join)",
            ));
        }
        crate::advertise::check_host_port(&req.http)
            .map_err(|e| Refusal::new(400, format!("join: {e}")))?;
        let me = (app.report)().http.unwrap_or_default();
        if req.http != me {
            match app.peers.add(&req.http) {
                Ok(true) => tracing::info!("registry: host {} joined", req.http),
                Ok(false) => {}
                Err(e) => return Err(Refusal::new(507, e)),
            }
        }
        Ok(pagefleet_api::JoinReply {
            me,
            peers: app.peers.list(),
        })
    })
    .await
}

async fn remove_host(State(app): Shared, b: Bytes) -> Response {
    let req = match body::<pagefleet_api::RemoveHost>(&b) {
        Ok(r) => r,
        Err(r) => return refusal(r),
    };
    blocking(move || {
        let me = (app.report)();
        if req.host == me.hostname || me.http.as_deref() == Some(req.host.as_str()) {
            return Err(Refusal::new(
                409,
                format!("{} is this host: a host cannot remove itself", req.host),
            ));
        }
        let mut out = pagefleet_api::HostRemoved::default();
        if let Some(r) = app.peers.remove(&req.host) {
            tracing::warn!(
                "host {} ({}) removed from this registry (pagefleet host remove)",
                r.name.as_deref().unwrap_or("?"),
                r.http
            );
            out.peer = Some(r.http);
        }
        if let Some(etcd) = &app.etcd {
            let (known, member) = etcd
                .remove_host(&req.host)
                .map_err(|e| Refusal::new(502, format!("the registry (etcd): {e}")))?;
            if known || member {
                tracing::warn!(
                    "host {} removed from the registry (etcd){}",
                    req.host,
                    if member { " with its etcd member" } else { "" }
                );
            }
            out.registry = known;
            out.etcd_member = member;
        }
        Ok(out)
    })
    .await
}
