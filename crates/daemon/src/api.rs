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

pub use crate::app::{App, Phase, Readiness, Restart, RECENT_VIEW};
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
    ClusterView, ControlRequest, EvacuationEvent, EvacuationOrder, GuestStatus, HostReport,
    IncomingRequest, MigrateRequest, MigrationOrder, ProgressEvent, SortResult, StartGuest,
};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

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
        if let Some(why) = app.restart_refusal() {
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
            started_unix: crate::app::started_unix(),
        })
    })
    .await
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
