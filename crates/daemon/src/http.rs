//! A minimal HTTP/1.1 endpoint: Prometheus scrapes (`GET /metrics`), the
//! host report (`GET /host`), the guest host service and the registry (see
//! `docs/migration.md` for the routes). One thread per request (bounded),
//! short timeouts on reading the request so a stuck client cannot wedge it;
//! a streamed reply (a migration's progress) has no length and ends at close.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tracing::warn;

pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

pub struct Request {
    pub method: String,
    pub path: String,
    pub body: Vec<u8>,
}

pub enum Response {
    Full {
        status: u16,
        ctype: &'static str,
        body: String,
    },
    /// Written straight to the connection after the headers (JSON lines).
    Stream(Box<dyn FnOnce(&mut TcpStream) + Send>),
}

impl Response {
    pub fn json(status: u16, v: &serde_json::Value) -> Response {
        Response::Full {
            status,
            ctype: "application/json",
            body: format!("{v}\n"),
        }
    }
    pub fn text(status: u16, body: impl Into<String>) -> Response {
        Response::Full {
            status,
            ctype: "text/plain",
            body: body.into(),
        }
    }
    pub fn error(status: u16, msg: impl std::fmt::Display) -> Response {
        Response::json(status, &serde_json::json!({ "error": msg.to_string() }))
    }
}

pub type Handler = Arc<dyn Fn(Request) -> Response + Send + Sync>;

const MAX_BODY: usize = 1 << 20;
const MAX_THREADS: usize = 64;

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        409 => "Conflict",
        413 => "Payload Too Large",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        _ => "Error",
    }
}

fn read_request(s: &TcpStream) -> Result<Request, Response> {
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line)
        .map_err(|_| Response::text(400, "bad request\n"))?;
    let mut parts = line.split_whitespace();
    let (method, path) = (
        parts.next().unwrap_or("").to_string(),
        parts.next().unwrap_or("").to_string(),
    );
    let mut len = 0usize;
    for _ in 0..100 {
        let mut h = String::new();
        match r.read_line(&mut h) {
            Ok(0) | Err(_) => break,
            Ok(_) if h == "\r\n" || h == "\n" => break,
            Ok(_) => {
                if let Some((k, v)) = h.split_once(':') {
                    if k.trim().eq_ignore_ascii_case("content-length") {
                        len = v
                            .trim()
                            .parse()
                            .map_err(|_| Response::text(400, "bad Content-Length\n"))?;
                    }
                }
            }
        }
    }
    if len > MAX_BODY {
        return Err(Response::text(413, "body too large\n"));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)
        .map_err(|_| Response::text(400, "short body\n"))?;
    Ok(Request { method, path, body })
}

fn respond(s: &mut TcpStream, resp: Response) {
    let r = match resp {
        Response::Full { status, ctype, body } => s.write_all(
            format!(
                "HTTP/1.1 {status} {}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                reason(status),
                body.len()
            )
            .as_bytes(),
        ),
        Response::Stream(f) => {
            let r = s.write_all(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nConnection: close\r\n\r\n");
            if r.is_ok() {
                let _ = s.set_write_timeout(None);
                f(s);
            }
            r
        }
    };
    if let Err(e) = r {
        warn!("http reply failed: {e}");
    }
}

/// Serve `handler` on `listen`; returns the bound address.
pub fn serve(listen: &str, handler: Handler) -> anyhow::Result<SocketAddr> {
    let l = TcpListener::bind(listen).map_err(|e| {
        anyhow::anyhow!(
            "cannot listen for HTTP on {listen}: {e} (use --metrics ADDR or --metrics off)"
        )
    })?;
    let addr = l.local_addr()?;
    let busy = Arc::new(AtomicUsize::new(0));
    std::thread::Builder::new()
        .name("http".into())
        .spawn(move || {
            for s in l.incoming() {
                let Ok(mut s) = s else { continue };
                let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
                let _ = s.set_write_timeout(Some(Duration::from_secs(5)));
                if busy.load(Ordering::Relaxed) >= MAX_THREADS {
                    respond(&mut s, Response::text(503, "busy\n"));
                    continue;
                }
                busy.fetch_add(1, Ordering::Relaxed);
                let (h, b) = (handler.clone(), busy.clone());
                let spawned =
                    std::thread::Builder::new()
                        .name("http req".into())
                        .spawn(move || {
                            let resp = match read_request(&s) {
                                Ok(req) => h(req),
                                Err(r) => r,
                            };
                            respond(&mut s, resp);
                            b.fetch_sub(1, Ordering::Relaxed);
                        });
                if spawned.is_err() {
                    busy.fetch_sub(1, Ordering::Relaxed);
                }
            }
        })?;
    Ok(addr)
}

/// The metrics and host report routes alone (what every pagefleetd serves).
pub fn start(listen: &str, render: Render, host: Render) -> anyhow::Result<SocketAddr> {
    serve(
        listen,
        Arc::new(
            move |r: Request| match (r.method.as_str(), r.path.as_str()) {
                ("GET", "/metrics") => Response::Full {
                    status: 200,
                    ctype: "text/plain; version=0.0.4",
                    body: render(),
                },
                ("GET", "/host") => Response::Full {
                    status: 200,
                    ctype: "application/json",
                    body: host(),
                },
                ("GET", "/") => {
                    Response::text(200, "pagefleetd: /metrics (Prometheus), /host (JSON)\n")
                }
                ("GET", _) => Response::text(404, "not found; try /metrics or /host\n"),
                _ => Response::text(405, "only GET\n"),
            },
        ),
    )
}

fn connect(addr: &str, timeout: Duration) -> anyhow::Result<TcpStream> {
    let sa: SocketAddr = std::net::ToSocketAddrs::to_socket_addrs(addr)?
        .next()
        .ok_or_else(|| anyhow::anyhow!("{addr} resolves to nothing"))?;
    let s = TcpStream::connect_timeout(&sa, timeout)
        .map_err(|e| anyhow::anyhow!("pagefleetd at {addr}: {e}"))?;
    s.set_read_timeout(Some(timeout))?;
    Ok(s)
}

fn split_reply(addr: &str, r: &str) -> anyhow::Result<(u16, String)> {
    let (head, body) = r
        .split_once("\r\n\r\n")
        .ok_or_else(|| anyhow::anyhow!("pagefleetd at {addr}: malformed HTTP reply"))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    Ok((status, body.to_string()))
}

fn fail(addr: &str, status: u16, body: &str) -> anyhow::Error {
    let msg = serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["error"].as_str().map(String::from))
        .unwrap_or_else(|| body.trim().to_string());
    anyhow::anyhow!("pagefleetd at {addr}: {msg} (HTTP {status})")
}

/// `GET path` from a pagefleetd.
pub fn get(addr: &str, path: &str, timeout: Duration) -> anyhow::Result<String> {
    let mut s = connect(addr, timeout)?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
    )?;
    let mut r = String::new();
    s.read_to_string(&mut r)?;
    let (status, body) = split_reply(addr, &r)?;
    if status != 200 {
        return Err(fail(addr, status, &body));
    }
    Ok(body)
}

/// `POST path` with a JSON body; the JSON reply.
pub fn post(
    addr: &str,
    path: &str,
    body: &serde_json::Value,
    timeout: Duration,
) -> anyhow::Result<serde_json::Value> {
    let mut s = post_open(addr, path, body, timeout)?;
    let mut r = String::new();
    s.read_to_string(&mut r)?;
    let (status, body) = split_reply(addr, &r)?;
    if status != 200 {
        return Err(fail(addr, status, &body));
    }
    Ok(serde_json::from_str(&body)?)
}

fn post_open(
    addr: &str,
    path: &str,
    body: &serde_json::Value,
    timeout: Duration,
) -> anyhow::Result<TcpStream> {
    let mut s = connect(addr, timeout)?;
    let b = body.to_string();
    s.write_all(format!("POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{b}", b.len()).as_bytes())?;
    Ok(s)
}

/// `POST path` whose reply is a stream of JSON lines: `each` sees every line.
pub fn post_stream(
    addr: &str,
    path: &str,
    body: &serde_json::Value,
    idle: Duration,
    mut each: impl FnMut(serde_json::Value),
) -> anyhow::Result<()> {
    let s = post_open(addr, path, body, idle)?;
    let mut r = BufReader::new(s);
    let mut head = String::new();
    loop {
        let mut l = String::new();
        if r.read_line(&mut l)? == 0 {
            break;
        }
        if l == "\r\n" || l == "\n" {
            break;
        }
        head.push_str(&l);
    }
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    if status != 200 {
        let mut b = String::new();
        r.read_to_string(&mut b)?;
        return Err(fail(addr, status, &b));
    }
    for line in r.lines() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        each(serde_json::from_str(&line)?);
    }
    Ok(())
}
