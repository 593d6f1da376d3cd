//! A minimal HTTP/1.1 endpoint for Prometheus scrapes (`GET /metrics`).
//! Requests are tiny and rare; one thread serves them in turn, with short
//! timeouts so a stuck scraper cannot wedge it.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::Duration;
use tracing::warn;

pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

pub fn start(listen: &str, render: Render) -> anyhow::Result<SocketAddr> {
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
                ("GET", "/") => ("200 OK", "text/plain", "pagefleetd: metrics at /metrics\n".to_string()),
                ("GET", _) => ("404 Not Found", "text/plain", "not found; try /metrics\n".to_string()),
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
