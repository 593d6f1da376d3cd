//! pagefleetd's HTTP endpoint: hyper (through axum's router) on a small
//! tokio runtime of its own. Every request is checked before any handler
//! runs: it must be signed with the cluster secret
//! ([`pagefleet_common::httpauth`]), except `GET /metrics`, `/healthz` and
//! `/readyz` when the operator opened them (`public_metrics`,
//! `public_health`), and the dashboard's `GET /ui/…` with a session a
//! login link opened ([`crate::ui`]). The signature is checked from the head
//! alone (it states the body's hash): a stranger's body is never read.
//!
//! What a stranger can hold: a connection slot until its head is in (5 s at
//! most, TLS handshake included), and not even that once the slots run
//! out — a connection that needs a slot takes the one of the oldest
//! connection not yet past the gate (the lobby), so strangers cannot keep
//! signed clients out however many they open. Limits: request head 16 KiB
//! (hyper refuses longer lines), body 1 MiB read within 10 s, 256
//! connections.
//!
//! With a TLS identity the same port takes HTTPS: a connection whose first
//! byte starts a TLS handshake gets one (the client must present a
//! certificate the cluster CA signed); a plaintext request from a peer not
//! on loopback is answered 403 "use HTTPS" and closed, unread.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use pagefleet_common::httpauth::{AuthError, Verifier};
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;
use tracing::{debug, warn};

/// Largest request body.
pub const MAX_BODY: usize = 1 << 20;
/// Largest request head (request line and headers).
pub const MAX_HEAD: usize = 16 << 10;
/// Most connections served at once; more wait in the listen queue.
pub const MAX_CONNS: usize = 256;
/// Time a client has to send its request head (and finish a TLS handshake).
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// Time a signed client has to send the body its head announced: 1 MiB
/// takes milliseconds between hosts; a peer that trickles it is stalled.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(10);

tokio::task_local! {
    /// The connection a request came on (set for each connection's task).
    static TICKET: Arc<Ticket>;
}

/// One connection's place in the lobby.
#[derive(Default)]
struct Ticket {
    /// Past the gate: a signed request (or the public metrics route).
    admitted: std::sync::atomic::AtomicBool,
    /// Told to leave: its slot is wanted.
    evict: tokio::sync::Notify,
}

/// Connections not yet past the gate, oldest first.
#[derive(Default)]
struct Lobby {
    waiting: std::sync::Mutex<std::collections::VecDeque<std::sync::Weak<Ticket>>>,
}

impl Lobby {
    fn enter(&self, t: &Arc<Ticket>) {
        let mut w = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        if w.len() >= 2 * MAX_CONNS {
            w.retain(|x| {
                x.upgrade()
                    .is_some_and(|t| !t.admitted.load(std::sync::atomic::Ordering::Relaxed))
            });
        }
        w.push_back(Arc::downgrade(t));
    }

    /// Tell the oldest connection still outside the gate to leave; false
    /// when every connection is past it.
    fn evict_oldest(&self) -> bool {
        let mut w = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        while let Some(x) = w.pop_front() {
            if let Some(t) = x.upgrade() {
                if !t.admitted.load(std::sync::atomic::Ordering::Relaxed) {
                    t.evict.notify_one();
                    return true;
                }
            }
        }
        false
    }
}

/// The request's connection is past the gate: it keeps its slot.
fn admit() {
    let _ = TICKET.try_with(|t| t.admitted.store(true, std::sync::atomic::Ordering::Relaxed));
}

/// A JSON error reply `{"error": ...}` with its status.
pub fn error(status: StatusCode, msg: impl std::fmt::Display) -> Response {
    (
        status,
        axum::Json(pagefleet_api::ErrorReply {
            error: msg.to_string(),
        }),
    )
        .into_response()
}

/// Who may do what on this endpoint.
pub struct Gate {
    /// Checks the signature of every request.
    pub verifier: Verifier,
    /// What a reload may change, among it whether `GET /metrics` (for a
    /// Prometheus scraper) and `GET /healthz`, `/readyz` (a load
    /// balancer's probes) answer without a signature.
    pub live: Arc<crate::reload::Live>,
    /// This host's TLS identity (HTTPS; required from non-loopback peers).
    pub tls: Option<Arc<pagefleet_tls::Identity>>,
    /// The dashboard's sessions ([`crate::ui`]).
    pub ui: Arc<crate::ui::state::Ui>,
}

/// Refuse a request that is not signed with the cluster secret, before any
/// route sees it: the head's signature first (it states the body's hash),
/// then the body (at most [`MAX_BODY`], within [`BODY_TIMEOUT`]) against it.
async fn authenticate(State(gate): State<Arc<Gate>>, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    let auth = parts
        .headers
        .get(header::AUTHORIZATION)
        .and_then(|h| h.to_str().ok());
    let open = parts.method == Method::GET
        && match parts.uri.path() {
            // A Prometheus with the cluster's scrape token (or any scraper
            // when the operator opened the metrics).
            "/metrics" => {
                gate.live.public_metrics.load(Relaxed) || gate.verifier.is_scrape_token(auth)
            }
            "/healthz" | "/readyz" => gate.live.public_health.load(Relaxed),
            _ => false,
        };
    if open {
        admit();
        return next.run(Request::from_parts(parts, body)).await;
    }
    // The dashboard: a login link or a session cookie (or a signed head,
    // checked below); a stranger is answered here.
    match crate::ui::check(&gate.ui, &gate.verifier, &parts) {
        crate::ui::Verdict::NotMine => {}
        crate::ui::Verdict::Reply(r) => return r,
        crate::ui::Verdict::Pass(session) => {
            admit();
            let mut parts = parts;
            parts.extensions.insert(session);
            // A GET: its body is not read.
            drop(body);
            return next.run(Request::from_parts(parts, Body::empty())).await;
        }
    }
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| parts.uri.path().to_string());
    let refused = |e: AuthError| {
        debug!("refused {} {path}: {e}", parts.method);
        let status = match e {
            AuthError::Busy => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::UNAUTHORIZED,
        };
        let mut r = error(status, e);
        r.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static(pagefleet_common::httpauth::SCHEME),
        );
        r
    };
    let admitted = match gate
        .verifier
        .verify_head(auth, parts.method.as_str(), &path)
    {
        Ok(a) => a,
        Err(e) => return refused(e),
    };
    admit();
    let bytes = match tokio::time::timeout(BODY_TIMEOUT, axum::body::to_bytes(body, MAX_BODY)).await
    {
        Ok(Ok(b)) => b,
        Ok(Err(_)) => {
            return error(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("request body larger than {MAX_BODY} bytes, or cut short"),
            )
        }
        Err(_) => {
            return error(
                StatusCode::REQUEST_TIMEOUT,
                format!("request body not sent within {} s", BODY_TIMEOUT.as_secs()),
            )
        }
    };
    if let Err(e) = admitted.check_body(&bytes) {
        return refused(e);
    }
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

/// The API's socket on `listen`.
pub fn bind(listen: &str) -> crate::error::Result<std::net::TcpListener> {
    pagefleet_common::listen::listen(listen).map_err(|e| {
        crate::Error::Invalid(format!(
            "cannot listen for HTTP on {listen}: {e} (use --metrics ADDR or --metrics off)"
        ))
    })
}

/// Serve `router` behind the gate on `l` (bound by [`bind`], or handed
/// over by the previous process of an in-place restart); returns its
/// address. The endpoint runs on its own threads until the process ends.
pub fn serve(
    l: std::net::TcpListener,
    router: Router,
    gate: Gate,
) -> crate::error::Result<SocketAddr> {
    l.set_nonblocking(true)?;
    let addr = l.local_addr()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(64)
        // Handlers run on blocking threads. An idle one leaves after 2 s
        // (tokio's default is 10 s): with requests every few seconds, idle
        // threads woken in turn otherwise all stay, and the pool keeps the
        // size of its busiest moment for good. Making a thread costs tens
        // of µs; requests come seconds apart.
        .thread_keep_alive(std::time::Duration::from_secs(2))
        .thread_name("http")
        .enable_all()
        .build()?;
    let tls = gate.tls.clone();
    let gate = Arc::new(gate);
    let app = router
        .fallback(|| async { error(StatusCode::NOT_FOUND, "no such route; GET / lists them") })
        .layer(axum::middleware::from_fn_with_state(gate, authenticate));
    std::thread::Builder::new()
        .name("http accept".into())
        .spawn(move || rt.block_on(accept_loop(l, app, tls)))?;
    Ok(addr)
}

async fn accept_loop(
    l: std::net::TcpListener,
    app: Router,
    tls: Option<Arc<pagefleet_tls::Identity>>,
) {
    let acceptor = tls
        .as_ref()
        .map(|id| tokio_rustls::TlsAcceptor::from(id.server_config()));
    let l = match tokio::net::TcpListener::from_std(l) {
        Ok(l) => l,
        Err(e) => {
            warn!("http listener: {e}");
            return;
        }
    };
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNS));
    let lobby = Arc::new(Lobby::default());
    loop {
        let (s, peer) = match l.accept().await {
            Ok(c) => c,
            Err(e) => {
                warn!("http accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let permit = match slots.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                // Every slot is taken: the oldest connection still outside
                // the gate gives its slot up (a signed client's head takes
                // milliseconds; a stranger's may take the whole deadline).
                if lobby.evict_oldest() {
                    debug!(%peer, "connection slots full: the oldest unauthenticated connection leaves");
                }
                let Ok(p) = slots.clone().acquire_owned().await else {
                    return;
                };
                p
            }
        };
        let ticket = Arc::new(Ticket::default());
        lobby.enter(&ticket);
        let conn = serve_one(s, peer, app.clone(), acceptor.clone(), tls.clone());
        tokio::spawn(async move {
            let conn = TICKET.scope(ticket.clone(), conn);
            tokio::pin!(conn);
            loop {
                tokio::select! {
                    () = &mut conn => break,
                    () = ticket.evict.notified() => {
                        if !ticket.admitted.load(std::sync::atomic::Ordering::Relaxed) {
                            debug!(%peer, "evicted before authenticating");
                            break;
                        }
                    }
                }
            }
            drop(permit);
        });
    }
}

/// One connection: TLS or plain by its first byte, then HTTP/1.1 with one
/// request (no keep-alive).
async fn serve_one(
    s: tokio::net::TcpStream,
    peer: SocketAddr,
    app: Router,
    acceptor: Option<tokio_rustls::TlsAcceptor>,
    tls: Option<Arc<pagefleet_tls::Identity>>,
) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    let svc = hyper_util::service::TowerToHyperService::new(app);
    let required = pagefleet_tls::required(tls.as_deref(), peer);
    let mut b = hyper::server::conn::http1::Builder::new();
    b.timer(TokioTimer::new())
        .header_read_timeout(HEAD_TIMEOUT)
        .max_buf_size(MAX_HEAD.max(8192))
        .keep_alive(false);
    // The first byte says which: 0x16 opens a TLS handshake record.
    let mut first = [0u8; 1];
    let is_tls = match tokio::time::timeout(HEAD_TIMEOUT, s.peek(&mut first)).await {
        Ok(Ok(1)) => first[0] == 0x16,
        _ => return,
    };
    let r = match (is_tls, &acceptor) {
        (true, Some(a)) => match tokio::time::timeout(HEAD_TIMEOUT, a.accept(s)).await {
            Ok(Ok(t)) => b.serve_connection(TokioIo::new(t), svc).await,
            Ok(Err(e)) => {
                debug!(%peer, "TLS handshake refused: {e}");
                return;
            }
            Err(_) => return,
        },
        (true, None) => {
            debug!(%peer, "TLS from a client, but this host has no identity");
            return;
        }
        (false, _) if required => {
            refuse_plaintext(s, peer).await;
            return;
        }
        (false, _) => b.serve_connection(TokioIo::new(s), svc).await,
    };
    if let Err(e) = r {
        debug!("http connection: {e}");
    }
}

/// Answer a plaintext request from a peer that must use HTTPS, without
/// reading it (nothing it sent is looked at), and close.
async fn refuse_plaintext(mut s: tokio::net::TcpStream, peer: SocketAddr) {
    use tokio::io::AsyncWriteExt;
    debug!(%peer, "plaintext HTTP from a non-loopback peer refused");
    let body = format!(
        "{{\"error\":\"this host takes only HTTPS from {peer}: give the client the cluster's \
         certificates (pagefleet --tls-dir)\"}}"
    );
    let reply = format!(
        "HTTP/1.1 403 Forbidden\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(HEAD_TIMEOUT, s.write_all(reply.as_bytes())).await;
    let _ = s.shutdown().await;
}
