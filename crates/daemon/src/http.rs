//! pagefleetd's HTTP endpoint: hyper (through axum's router) on a small
//! tokio runtime of its own. Every request is checked before any handler
//! runs: it must be signed with the cluster secret
//! ([`pagefleet_common::httpauth`]), except `GET /metrics` when the operator
//! opened it (`public_metrics`). Limits: request head 16 KiB (hyper refuses
//! longer lines), body 1 MiB, 5 s to send the head, 256 connections.
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
use std::sync::Arc;
use std::time::Duration;
use tracing::{debug, warn};

/// Largest request body.
pub const MAX_BODY: usize = 1 << 20;
/// Largest request head (request line and headers).
pub const MAX_HEAD: usize = 16 << 10;
/// Most connections served at once; more wait in the listen queue.
pub const MAX_CONNS: usize = 256;
/// Time a client has to send its request head.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(5);

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
    /// `GET /metrics` without a signature (for a Prometheus scraper).
    pub public_metrics: bool,
    /// This host's TLS identity (HTTPS; required from non-loopback peers).
    pub tls: Option<Arc<pagefleet_tls::Identity>>,
}

/// Refuse a request that is not signed with the cluster secret, before any
/// route sees it. The body is read (at most [`MAX_BODY`]) because the
/// signature covers it.
async fn authenticate(State(gate): State<Arc<Gate>>, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    if gate.public_metrics && parts.method == Method::GET && parts.uri.path() == "/metrics" {
        return next.run(Request::from_parts(parts, body)).await;
    }
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| parts.uri.path().to_string());
    let bytes = match axum::body::to_bytes(body, MAX_BODY).await {
        Ok(b) => b,
        Err(_) => {
            return error(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("request body larger than {MAX_BODY} bytes, or cut short"),
            )
        }
    };
    let auth = parts
        .headers
        .get(header::AUTHORIZATION)
        .and_then(|h| h.to_str().ok());
    if let Err(e) = gate
        .verifier
        .verify(auth, parts.method.as_str(), &path, &bytes)
    {
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
        return r;
    }
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

/// The API's socket on `listen`.
pub fn bind(listen: &str) -> crate::error::Result<std::net::TcpListener> {
    std::net::TcpListener::bind(listen).map_err(|e| {
        crate::Error::Invalid(format!(
            "cannot listen for HTTP on {listen}: {e} (use --metrics ADDR or --metrics off)"
        ))
    })
}

/// Serve `router` behind the gate on `l` (bound by [`bind`], or handed
/// over by the previous process of an in-place restart); returns its
/// address. The endpoint runs on its own threads until the process ends.
pub fn serve(l: std::net::TcpListener, router: Router, gate: Gate) -> crate::error::Result<SocketAddr> {
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
    use hyper_util::rt::{TokioIo, TokioTimer};
    let l = match tokio::net::TcpListener::from_std(l) {
        Ok(l) => l,
        Err(e) => {
            warn!("http listener: {e}");
            return;
        }
    };
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNS));
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let (s, peer) = match l.accept().await {
            Ok(c) => c,
            Err(e) => {
                warn!("http accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let svc = hyper_util::service::TowerToHyperService::new(app.clone());
        let acceptor = acceptor.clone();
        let required = pagefleet_tls::required(tls.as_deref(), peer);
        tokio::spawn(async move {
            let mut b = hyper::server::conn::http1::Builder::new();
            b.timer(TokioTimer::new())
                .header_read_timeout(HEAD_TIMEOUT)
                .max_buf_size(MAX_HEAD.max(8192))
                .keep_alive(false);
            // The first byte says which: 0x16 opens a TLS handshake record.
            let mut first = [0u8; 1];
            let is_tls = match tokio::time::timeout(HEAD_TIMEOUT, s.peek(&mut first)).await {
                Ok(Ok(1)) => first[0] == 0x16,
                _ => return drop(permit),
            };
            let r = match (is_tls, &acceptor) {
                (true, Some(a)) => match tokio::time::timeout(HEAD_TIMEOUT, a.accept(s)).await {
                    Ok(Ok(t)) => b.serve_connection(TokioIo::new(t), svc).await,
                    Ok(Err(e)) => {
                        debug!(%peer, "TLS handshake refused: {e}");
                        return drop(permit);
                    }
                    Err(_) => return drop(permit),
                },
                (true, None) => {
                    debug!(%peer, "TLS from a client, but this host has no identity");
                    return drop(permit);
                }
                (false, _) if required => {
                    refuse_plaintext(s, peer).await;
                    return drop(permit);
                }
                (false, _) => b.serve_connection(TokioIo::new(s), svc).await,
            };
            if let Err(e) = r {
                debug!("http connection: {e}");
            }
            drop(permit);
        });
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
