//! The web dashboard (`/ui/`): one page, its assets compiled into the
//! binary, fed live by server-sent events.
//!
//! Who gets in: nobody without a session, which only a login link opens.
//! `pagefleet dashboard` makes the link on a host holding the cluster
//! secret: `/ui/login?t=..&n=..&m=..` carries the signature of a `GET
//! /ui/login` ([`httpauth::ui_login_query`]), checked like any signed
//! request — MAC over method, path, time and nonce; time within 60 s of
//! this host's clock; nonce never seen — so a link works once, within a
//! minute, and only for its cluster. The gate ([`check`], called by
//! [`crate::http`] before any route) trades it for a session: 32 random
//! bytes in an `HttpOnly`, `SameSite=Strict` cookie scoped to `/ui/`,
//! living [`SESSION_TTL`]. Every other `/ui/` request needs that cookie (or
//! a signed head, as every route takes); a stranger gets 401 before any
//! route runs. The dashboard only reads: `/ui/` takes `GET` alone, so
//! there is nothing for a cross-site request to forge.
//!
//! What a session holder can hold: one of [`MAX_VIEWERS`] event streams
//! (each a connection slot of the HTTP endpoint's 256), and what it
//! costs the daemon does not grow with viewers: one producer thread asks
//! the registry for the cluster once per [`TICK`] while anyone watches and
//! every stream is sent the same serialized snapshot. Sessions are at
//! most [`MAX_SESSIONS`]; a new one beyond that ends the one closest to
//! expiry.

pub mod state;

use crate::app::App;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, request::Parts, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use pagefleet_common::httpauth::{Verifier, UI_LOGIN_PATH};
use serde::Serialize;
pub use state::{Ui, MAX_SESSIONS, MAX_VIEWERS, SESSION_TTL, TICK};
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The session cookie.
const COOKIE: &str = "pagefleet_session";

const INDEX_HTML: &str = include_str!("../../ui/index.html");
const APP_JS: &str = include_str!("../../ui/app.js");
const APP_CSS: &str = include_str!("../../ui/app.css");

/// The page may load only its own assets and talk only to its own host.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
                   connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// A session's id, for the routes behind the gate.
#[derive(Clone)]
pub struct Session(pub String);

/// What the gate does with a request.
pub enum Verdict {
    /// Not a dashboard request, or one with a signed head: the signature
    /// check decides.
    NotMine,
    /// A session's request: serve it.
    Pass(Session),
    /// Answer this, run no route.
    Reply(Response),
}

/// The session cookie's value in `parts`, if any.
fn cookie(parts: &Parts) -> Option<&str> {
    parts
        .headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|kv| kv.trim().strip_prefix(COOKIE)?.strip_prefix('='))
}

fn is_ui(path: &str) -> bool {
    path == "/ui" || path.starts_with("/ui/")
}

/// The dashboard's part of the gate: a login link opens a session, a
/// session cookie opens the dashboard's routes, a stranger is refused.
pub fn check(ui: &Ui, verifier: &Verifier, parts: &Parts) -> Verdict {
    let path = parts.uri.path();
    if !is_ui(path) {
        return Verdict::NotMine;
    }
    let now = Instant::now();
    if path == UI_LOGIN_PATH {
        if parts.method != Method::GET {
            return Verdict::Reply(refuse(
                StatusCode::METHOD_NOT_ALLOWED,
                "the dashboard only reads",
            ));
        }
        return Verdict::Reply(match verifier.verify_ui_login(parts.uri.query()) {
            Ok(()) => {
                let id = ui.open_session(now);
                tracing::info!("dashboard: a login link opened a session");
                let c = format!(
                    "{COOKIE}={id}; Path=/ui/; HttpOnly; SameSite=Strict; Max-Age={}",
                    SESSION_TTL.as_secs()
                );
                let mut r = (StatusCode::SEE_OTHER, "").into_response();
                let h = r.headers_mut();
                h.insert(header::LOCATION, HeaderValue::from_static("/ui/"));
                if let Ok(v) = HeaderValue::from_str(&c) {
                    h.insert(header::SET_COOKIE, v);
                }
                h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
                h.insert(
                    header::REFERRER_POLICY,
                    HeaderValue::from_static("no-referrer"),
                );
                r
            }
            Err(e) => {
                tracing::debug!("dashboard login refused: {e}");
                refuse(
                    StatusCode::UNAUTHORIZED,
                    &format!("this login link is expired, used or not this cluster's ({e}): run `pagefleet dashboard` again"),
                )
            }
        });
    }
    if let Some(id) = cookie(parts).filter(|id| ui.session_valid(id, now)) {
        if parts.method != Method::GET {
            return Verdict::Reply(refuse(
                StatusCode::METHOD_NOT_ALLOWED,
                "the dashboard only reads",
            ));
        }
        return Verdict::Pass(Session(id.to_string()));
    }
    if parts.headers.contains_key(header::AUTHORIZATION) {
        return Verdict::NotMine;
    }
    Verdict::Reply(refuse(
        StatusCode::UNAUTHORIZED,
        "no dashboard session: open the link `pagefleet dashboard` prints (it works once, within a minute)",
    ))
}

/// A refusal: a short page for a person.
fn refuse(status: StatusCode, why: &str) -> Response {
    let body = format!(
        "<!doctype html><meta charset=utf-8><title>pagefleet</title><p>{}</p>\n",
        why.replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;")
    );
    let mut r = (status, body).into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static("default-src 'none'"),
    );
    r
}

/// The dashboard's routes (behind the gate).
pub fn routes() -> Router<Arc<App>> {
    Router::new()
        .route("/ui", get(|| async { redirect() }))
        .route(
            "/ui/",
            get(|| async { asset("text/html; charset=utf-8", INDEX_HTML) }),
        )
        .route(
            "/ui/app.js",
            get(|| async { asset("text/javascript; charset=utf-8", APP_JS) }),
        )
        .route(
            "/ui/app.css",
            get(|| async { asset("text/css; charset=utf-8", APP_CSS) }),
        )
        .route("/ui/api/snapshot", get(snapshot))
        .route("/ui/api/events", get(events))
}

fn redirect() -> Response {
    let mut r = (StatusCode::MOVED_PERMANENTLY, "").into_response();
    r.headers_mut()
        .insert(header::LOCATION, HeaderValue::from_static("/ui/"));
    r
}

fn secured(mut r: Response, content_type: &'static str) -> Response {
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    r
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    secured(body.into_response(), content_type)
}

/// What the page shows: the cluster as this host's registry sees it.
#[derive(Serialize)]
struct Snapshot {
    /// When it was taken, ms since the Unix epoch.
    at_unix_ms: u64,
    /// The host serving the page.
    serving: String,
    /// Every host and its guests (migrations in progress on them, the
    /// last finished ones in their reports).
    view: pagefleet_api::ClusterView,
}

fn take_snapshot(app: &App) -> String {
    let view = app.view_recent();
    let s = Snapshot {
        at_unix_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0),
        serving: view
            .hosts
            .first()
            .map(|h| h.name().to_string())
            .unwrap_or_default(),
        view,
    };
    serde_json::to_string(&s).unwrap_or_else(|_| "{}".into())
}

/// Start the producer once: a snapshot per [`TICK`] while anyone watches,
/// a check every quarter second otherwise.
fn start_producer(app: &Arc<App>) {
    if app.ui.producing.swap(true, SeqCst) {
        return;
    }
    let a = app.clone();
    let r = std::thread::Builder::new()
        .name("ui snapshots".into())
        .spawn(move || loop {
            let app = &a;
            if app.ui.viewers.load(SeqCst) == 0 {
                std::thread::sleep(Duration::from_millis(250));
                continue;
            }
            let t = Instant::now();
            let s = take_snapshot(app);
            app.ui.snapshot.send_replace(Arc::from(s));
            std::thread::sleep(TICK.saturating_sub(t.elapsed()));
        });
    if let Err(e) = r {
        tracing::warn!("dashboard: cannot start its snapshot thread: {e}");
        app.ui.producing.store(false, SeqCst);
    }
}

/// `GET /ui/api/snapshot`: the cluster now, as the page's first paint.
async fn snapshot(State(app): State<Arc<App>>) -> Response {
    let s = tokio::task::spawn_blocking(move || take_snapshot(&app))
        .await
        .unwrap_or_else(|_| "{}".into());
    secured(s.into_response(), "application/json")
}

/// One viewer while it lives.
struct Viewer(Arc<App>);

impl Drop for Viewer {
    fn drop(&mut self) {
        self.0.ui.viewers.fetch_sub(1, SeqCst);
    }
}

/// `GET /ui/api/events`: the snapshot as a server-sent event each time
/// it changes (every [`TICK`]), until the page closes or its session ends.
async fn events(
    State(app): State<Arc<App>>,
    session: Option<axum::Extension<Session>>,
) -> Response {
    if app.ui.viewers.fetch_add(1, SeqCst) >= MAX_VIEWERS {
        app.ui.viewers.fetch_sub(1, SeqCst);
        return refuse(
            StatusCode::SERVICE_UNAVAILABLE,
            &format!("{MAX_VIEWERS} dashboards are open on this host already"),
        );
    }
    let viewer = Viewer(app.clone());
    start_producer(&app);
    let mut rx = app.ui.snapshot.subscribe();
    let session = session.map(|s| s.0 .0);
    let (tx, out) = tokio::sync::mpsc::channel::<Result<Bytes, std::convert::Infallible>>(2);
    tokio::spawn(async move {
        let _viewer = viewer;
        // The current snapshot at once, if there is one; then each new one.
        rx.mark_changed();
        while rx.changed().await.is_ok() {
            if let Some(id) = &session {
                if !app.ui.session_valid(id, Instant::now()) {
                    break;
                }
            }
            let s = rx.borrow_and_update().clone();
            if s.is_empty() {
                continue;
            }
            let ev = format!("event: snapshot\ndata: {s}\n\n");
            if tx.send(Ok(Bytes::from(ev))).await.is_err() {
                break;
            }
        }
    });
    let r = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(out)).into_response();
    secured(r, "text/event-stream")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_end_and_the_oldest_make_room() {
        let ui = Ui::default();
        let now = Instant::now();
        let a = ui.open_session(now);
        assert!(ui.session_valid(&a, now));
        assert!(!ui.session_valid(&a, now + SESSION_TTL));
        assert!(!ui.session_valid("00", now));
        let later: Vec<String> = (1..MAX_SESSIONS)
            .map(|i| ui.open_session(now + Duration::from_secs(i as u64)))
            .collect();
        assert!(ui.session_valid(&a, now), "{MAX_SESSIONS} fit");
        let b = ui.open_session(now + Duration::from_secs(100));
        assert!(
            !ui.session_valid(&a, now),
            "the one closest to its end made room"
        );
        assert!(ui.session_valid(&b, now) && later.iter().all(|s| ui.session_valid(s, now)));
    }

    fn parts(method: &str, uri: &str, headers: &[(&str, &str)]) -> Parts {
        let mut b = axum::http::Request::builder().method(method).uri(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn the_gate_trades_a_login_link_for_a_session_once_and_refuses_strangers() {
        let secret =
            pagefleet_proto::auth::Secret::from_bytes(b"0123456789abcdef0123", "t").unwrap();
        let v = Verifier::new(secret.clone());
        let ui = Ui::default();
        let status = |verdict: Verdict| match verdict {
            Verdict::Reply(r) => Some(r.status()),
            _ => None,
        };
        // Not the dashboard's: the signature check decides.
        assert!(matches!(
            check(&ui, &v, &parts("GET", "/host", &[])),
            Verdict::NotMine
        ));
        // Strangers, forged and replayed links, a made-up cookie.
        for p in [
            "/ui/",
            "/ui/api/events",
            "/ui/api/snapshot",
            "/ui/app.js",
            "/ui",
        ] {
            assert_eq!(
                status(check(&ui, &v, &parts("GET", p, &[]))),
                Some(StatusCode::UNAUTHORIZED),
                "{p}"
            );
        }
        let forged = format!(
            "/ui/login?t={}&n={}&m={}",
            pagefleet_common::httpauth::unix_now(),
            "0".repeat(32),
            "0".repeat(64)
        );
        assert_eq!(
            status(check(&ui, &v, &parts("GET", &forged, &[]))),
            Some(StatusCode::UNAUTHORIZED)
        );
        let fake = format!("{COOKIE}={}", "ab".repeat(32));
        assert_eq!(
            status(check(&ui, &v, &parts("GET", "/ui/", &[("cookie", &fake)]))),
            Some(StatusCode::UNAUTHORIZED)
        );
        // A link opens a session, once.
        let link = format!(
            "/ui/login?{}",
            pagefleet_common::httpauth::ui_login_query(&secret)
        );
        let Verdict::Reply(r) = check(&ui, &v, &parts("GET", &link, &[])) else {
            panic!("a reply")
        };
        assert_eq!(r.status(), StatusCode::SEE_OTHER);
        let c = r.headers()[header::SET_COOKIE]
            .to_str()
            .unwrap()
            .to_string();
        assert!(
            c.contains("HttpOnly") && c.contains("SameSite=Strict") && c.contains("Path=/ui/"),
            "{c}"
        );
        let pair = c.split(';').next().unwrap().to_string();
        assert_eq!(
            status(check(&ui, &v, &parts("GET", &link, &[]))),
            Some(StatusCode::UNAUTHORIZED),
            "used"
        );
        // The cookie opens reads, not writes.
        let cookie = format!("theme=dark; {pair}");
        assert!(matches!(
            check(
                &ui,
                &v,
                &parts("GET", "/ui/api/events", &[("cookie", &cookie)])
            ),
            Verdict::Pass(_)
        ));
        assert_eq!(
            status(check(
                &ui,
                &v,
                &parts("POST", "/ui/api/events", &[("cookie", &cookie)])
            )),
            Some(StatusCode::METHOD_NOT_ALLOWED)
        );
        // A signed head goes to the signature check.
        assert!(matches!(
            check(
                &ui,
                &v,
                &parts(
                    "GET",
                    "/ui/api/snapshot",
                    &[("authorization", "PF1 t=1,n=2,m=3")]
                )
            ),
            Verdict::NotMine
        ));
    }
}
