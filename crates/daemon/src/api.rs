//! The routes of pagefleetd's HTTP API. Every one of them sits behind the
//! signature check in [`crate::http`]; bodies and replies are the typed
//! messages of `pagefleet_api`.
//!
//! | route | body | reply |
//! |---|---|---|
//! | `GET /metrics` | | Prometheus text |
//! | `GET /host` | | `HostReport` |
//! | `GET /cluster` | | `ClusterView` (this host and its peers) |
//! | `GET /guests`, `GET /guests/NAME` | | `[GuestStatus]`, `GuestStatus` |
//! | `POST /guests` | `StartGuest` | `{ok}` |
//! | `POST /incoming` | `IncomingRequest` | `IncomingReply` |
//! | `POST /guests/NAME/stop`, `cancel`, `sort` | none | `{ok}`, `{ok}`, `SortResult` |
//! | `POST /guests/NAME/set_budget` | `{pages}` | `{budget_pages}` |
//! | `POST /guests/NAME/evacuate` | `{from, to}` | `{moved}` |
//! | `POST /guests/NAME/migrate` | `MigrateRequest` | `ProgressEvent` lines |

use crate::guests::{Guests, Refusal};
use crate::http::error;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use pagefleet_api::control::{Budget, Moved};
use pagefleet_api::migration::Failure;
use pagefleet_api::{
    ClusterHost, ControlRequest, GuestStatus, HostReport, IncomingRequest, MigrateRequest,
    ProgressEvent, SortResult, StartGuest,
};
use pagefleet_common::http::Client;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::sync::Arc;

/// What the routes serve.
pub struct App {
    /// The guest host service, if this host runs guests.
    pub guests: Option<Arc<Guests>>,
    /// This host's report, fresh on each call.
    pub report: Box<dyn Fn() -> HostReport + Send + Sync>,
    /// The Prometheus text, fresh on each call.
    pub metrics: Box<dyn Fn() -> String + Send + Sync>,
    /// The other hosts' HTTP addresses (the registry).
    pub peers: Vec<String>,
    /// Signed client for asking the peers.
    pub client: Client,
}

type Shared = State<Arc<App>>;

fn refusal(r: Refusal) -> Response {
    error(
        StatusCode::from_u16(r.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        r.message,
    )
}

fn guests(app: &App) -> Result<Arc<Guests>, Response> {
    app.guests.clone().ok_or_else(|| {
        error(
            StatusCode::NOT_FOUND,
            "this host runs no guests (start pagefleetd with --guest-memory)",
        )
    })
}

/// A typed body, or a 400 that says what is wrong with it.
fn body<T: DeserializeOwned>(b: &Bytes) -> Result<T, Response> {
    serde_json::from_slice(b)
        .map_err(|e| error(StatusCode::BAD_REQUEST, format!("bad request body: {e}")))
}

/// No body, or an empty JSON object.
fn no_body(b: &Bytes) -> Result<(), Response> {
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
    "pagefleetd: GET /metrics /host /cluster /guests /guests/NAME; POST /guests /incoming \
     /guests/NAME/{stop,cancel,sort,set_budget,evacuate,migrate} (signed requests; see docs/architecture.md)\n"
}

async fn metrics(State(app): Shared) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        (app.metrics)(),
    )
        .into_response()
}

async fn host(State(app): Shared) -> Json<HostReport> {
    Json((app.report)())
}

async fn cluster(State(app): Shared) -> Response {
    tokio::task::spawn_blocking(move || {
        let guests = app.guests.as_ref().map(|g| g.list()).unwrap_or_default();
        let r = (app.report)();
        let me = ClusterHost {
            http: r.http.clone().unwrap_or_default(),
            host: Some(r),
            guests,
            error: None,
        };
        Json(crate::registry::cluster(me, &app.peers, &app.client)).into_response()
    })
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
        Ok(g) => {
            blocking(move || g.control::<GuestStatus>(&name, &ControlRequest::Status)).await
        }
        Err(r) => r,
    }
}

async fn start(State(app): Shared, b: Bytes) -> Response {
    let (g, req) = match (guests(&app), body::<StartGuest>(&b)) {
        (Ok(g), Ok(r)) => (g, r),
        (Err(r), _) | (_, Err(r)) => return r,
    };
    blocking(move || g.start(req).map(|_| pagefleet_api::Ok::default())).await
}

async fn incoming(State(app): Shared, b: Bytes) -> Response {
    let (g, req) = match (guests(&app), body::<IncomingRequest>(&b)) {
        (Ok(g), Ok(r)) => (g, r),
        (Err(r), _) | (_, Err(r)) => return r,
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

async fn guest_op(State(app): Shared, Path((name, op)): Path<(String, String)>, b: Bytes) -> Response {
    let g = match guests(&app) {
        Ok(g) => g,
        Err(r) => return r,
    };
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
        _ => Err(error(
            StatusCode::NOT_FOUND,
            format!("no operation {op:?}: use stop, cancel, sort, set_budget, evacuate or migrate"),
        )),
    };
    let req = match parsed {
        Ok(r) => r,
        Err(r) => return r,
    };
    match req {
        ControlRequest::Migrate(_) => migrate(g, name, req).await,
        ControlRequest::Sort => blocking(move || g.control::<SortResult>(&name, &req)).await,
        ControlRequest::SetBudget { .. } => blocking(move || g.control::<Budget>(&name, &req)).await,
        ControlRequest::Evacuate { .. } => blocking(move || g.control::<Moved>(&name, &req)).await,
        _ => blocking(move || g.control::<pagefleet_api::Ok>(&name, &req)).await,
    }
}

/// Relay the runner's migration stream as JSON lines. When the caller goes
/// away (its Ctrl-C), the relay ends and shuts the runner's socket, which
/// the runner takes as a cancel.
async fn migrate(g: Arc<Guests>, name: String, req: ControlRequest) -> Response {
    let g2 = g.clone();
    let n2 = name.clone();
    let stream = match tokio::task::spawn_blocking(move || g2.migrate_stream(&n2, &req)).await {
        Ok(Ok(s)) => s,
        Ok(Err(r)) => return refusal(r),
        Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e),
    };
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::convert::Infallible>>(16);
    tokio::task::spawn_blocking(move || {
        let path = std::path::PathBuf::from(format!("guest {name}"));
        let shut = stream.try_clone();
        let r = pagefleet_common::control::read_lines::<ProgressEvent>(&path, stream, |ev| {
            if matches!(ev, ProgressEvent::Report(_)) {
                // The guest runs elsewhere now: its memory here is free at
                // once (the runner exits right after).
                g.forget(&name);
            }
            let mut line = serde_json::to_vec(&ev).unwrap_or_default();
            line.push(b'\n');
            tx.blocking_send(Ok(Bytes::from(line))).is_ok()
        });
        if let Err(e) = r {
            let ev = ProgressEvent::Failed(Failure {
                message: e.to_string(),
                in_doubt: false,
            });
            let mut line = Vec::new();
            let _ = serde_json::to_writer(&mut line, &ev);
            let _ = line.write_all(b"\n");
            let _ = tx.blocking_send(Ok(Bytes::from(line)));
        }
        if let Ok(s) = shut {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    });
    (
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx)),
    )
        .into_response()
}

/// Every route.
pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/", get(index))
        .route("/metrics", get(metrics))
        .route("/host", get(host))
        .route("/cluster", get(cluster))
        .route("/guests", get(list).post(start))
        .route("/guests/{name}", get(status))
        .route("/guests/{name}/{op}", post(guest_op))
        .route("/incoming", post(incoming))
        .with_state(app)
}
