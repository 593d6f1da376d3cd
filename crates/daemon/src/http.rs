//! A minimal HTTP/1.1 endpoint: Prometheus scrapes (`GET /metrics`) and the
//! host report (`GET /host`, JSON) that placement and `pagefleet status` read.
//! Requests are tiny and rare; one thread serves them in turn, with short
//! timeouts so a stuck scraper cannot wedge it.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::Duration;
use tracing::warn;

pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

pub fn start(listen: &str, render: Render, host: Render) -> anyhow::Result<SocketAddr> {
    let l = TcpListener::bind(listen).map_err(|e| anyhow::anyhow!("cannot listen for metrics on {listen}: {e} (use --metrics ADDR or --metrics off)"))?;
    let addr = l.local_addr()?;
    std::thread::Builder::new().name("metrics http".into()).spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { continue };
            let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
            let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
            let mut line = String::new();
            let mut r = BufReader::new(match s.try_clone() {
                Ok(c) => c,
                Err(_) => continue,
            });
            if r.read_line(&mut line).is_err() {
                continue;
            }
            // Drain headers (bounded).
            for _ in 0..100 {
                let mut h = String::new();
                match r.read_line(&mut h) {
                    Ok(0) | Err(_) => break,
                    Ok(_) if h == "\r\n" || h == "\n" => break,
                    Ok(_) => {}
                }
            }
            let mut parts = line.split_whitespace();
            let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
            let (status, ctype, body) = match (method, path) {
                ("GET", "/metrics") => ("200 OK", "text/plain; version=0.0.4", render()),
                ("GET", "/host") => ("200 OK", "application/json", host()),
                ("GET", "/") => ("200 OK", "text/plain", "pagefleetd: /metrics (Prometheus), /host (JSON)\n".to_string()),
                ("GET", _) => ("404 Not Found", "text/plain", "not found; try /metrics or /host\n".to_string()),
                _ => ("405 Method Not Allowed", "text/plain", "only GET\n".to_string()),
            };
            let resp = format!(
                "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            if let Err(e) = s.write_all(resp.as_bytes()) {
                warn!("metrics reply failed: {e}");
            }
        }
    })?;
    Ok(addr)
}

/// Fetch `path` from a pagefleetd HTTP endpoint (a tiny client for /host).
pub fn get(addr: &str, path: &str, timeout: Duration) -> anyhow::Result<String> {
    use std::io::Read;
    let sa: SocketAddr = std::net::ToSocketAddrs::to_socket_addrs(addr)?.next().ok_or_else(|| anyhow::anyhow!("{addr} resolves to nothing"))?;
    let mut s = std::net::TcpStream::connect_timeout(&sa, timeout).map_err(|e| anyhow::anyhow!("pagefleetd at {addr}: {e}"))?;
    s.set_read_timeout(Some(timeout))?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes())?;
    let mut r = String::new();
    s.read_to_string(&mut r)?;
    let (head, body) = r.split_once("\r\n\r\n").ok_or_else(|| anyhow::anyhow!("pagefleetd at {addr}: malformed HTTP reply"))?;
    if !head.starts_with("HTTP/1.1 200") {
        anyhow::bail!("pagefleetd at {addr}: {}", head.lines().next().unwrap_or(""));
    }
    Ok(body.to_string())
}
