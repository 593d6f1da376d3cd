//! A bare HTTP/1.1 client for what the lab must see as an outsider does:
//! an unsigned request (a stranger, a browser before its session, a
//! Prometheus with a token), a WebDriver command to chromedriver, a viewer
//! holding an event stream open. One request per connection
//! (`Connection: close`); a reply is read by its `Content-Length`, or to
//! the end (chromedriver keeps the connection open after a reply, so the
//! length is what ends it; an event stream ends when the caller stops).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// A request.
#[derive(Clone, Copy, Debug)]
pub struct Request<'a> {
    /// GET, POST, ...
    pub method: &'a str,
    /// The path and query.
    pub path: &'a str,
    /// More header lines (name, value).
    pub headers: &'a [(&'a str, &'a str)],
    /// The body (`Content-Length` says its size).
    pub body: &'a [u8],
}

impl<'a> Request<'a> {
    /// A GET of `path` with no header of its own.
    pub fn get(path: &'a str) -> Request<'a> {
        Request {
            method: "GET",
            path,
            headers: &[],
            body: &[],
        }
    }
}

/// A reply: status, head (the status line and headers), body.
#[derive(Clone, Debug)]
pub struct Reply {
    /// The status code.
    pub status: u16,
    /// The status line and header lines.
    pub head: String,
    /// The body (lossy UTF-8).
    pub body: String,
}

impl Reply {
    /// A header's value (the first, name case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }
}

/// Connect to `addr` and send `req`.
fn send(addr: &str, req: &Request, timeout: Duration) -> Result<TcpStream, String> {
    let a: SocketAddr = addr.parse().map_err(|e| format!("{addr}: {e}"))?;
    let mut s = TcpStream::connect_timeout(&a, timeout).map_err(|e| format!("{addr}: {e}"))?;
    let mut head = format!(
        "{} {} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n",
        req.method, req.path
    );
    for (k, v) in req.headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str(&format!("Content-Length: {}\r\n\r\n", req.body.len()));
    s.write_all(head.as_bytes())
        .and_then(|_| s.write_all(req.body))
        .map_err(|e| format!("{addr}: sending: {e}"))?;
    Ok(s)
}

/// Read until the end of the head: (status, head, the body's bytes read with it).
fn read_head(s: &mut TcpStream, until: Instant) -> Result<(u16, String, Vec<u8>), String> {
    let mut got = Vec::new();
    let mut buf = [0u8; 16 << 10];
    loop {
        if let Some(i) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&got[..i]).into_owned();
            let status = head
                .split_whitespace()
                .nth(1)
                .and_then(|c| c.parse().ok())
                .ok_or_else(|| format!("bad status line: {head}"))?;
            return Ok((status, head, got[i + 4..].to_vec()));
        }
        if Instant::now() >= until {
            return Err(format!(
                "no HTTP head within the timeout: {:?}",
                String::from_utf8_lossy(&got)
            ));
        }
        match s.read(&mut buf) {
            Ok(0) => {
                return Err(format!(
                    "closed before the head ended: {:?}",
                    String::from_utf8_lossy(&got)
                ))
            }
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if would_block(&e) => {}
            Err(e) => return Err(e.to_string()),
        }
    }
}

fn would_block(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

/// Undoes `Transfer-Encoding: chunked` as the bytes come (a reply of
/// unknown length over HTTP/1.1: an event stream, a generated page).
#[derive(Default)]
struct Dechunk {
    /// Bytes of the current chunk still to pass on.
    left: usize,
    /// A size line (or the CRLF after a chunk) read so far.
    line: Vec<u8>,
    /// The CRLF after a chunk's data is next.
    crlf: bool,
    done: bool,
}

impl Dechunk {
    fn feed(&mut self, mut b: &[u8], out: &mut impl FnMut(&[u8])) {
        while !b.is_empty() && !self.done {
            if self.left > 0 {
                let n = self.left.min(b.len());
                out(&b[..n]);
                self.left -= n;
                b = &b[n..];
                self.crlf = self.left == 0;
                continue;
            }
            let (c, rest) = (b[0], &b[1..]);
            b = rest;
            if c != b'\n' {
                self.line.push(c);
                continue;
            }
            let line = String::from_utf8_lossy(&self.line).trim().to_string();
            self.line.clear();
            if std::mem::take(&mut self.crlf) && line.is_empty() {
                continue;
            }
            let size = line.split(';').next().unwrap_or("");
            match usize::from_str_radix(size, 16) {
                Ok(0) => self.done = true,
                Ok(n) => self.left = n,
                Err(_) => self.done = true,
            }
        }
    }
}

/// The body's bytes as they come, unframed if the head says chunked.
struct Body {
    chunked: Option<Dechunk>,
}

impl Body {
    fn of(head: &str) -> Body {
        let chunked = head.lines().skip(1).any(|l| {
            l.split_once(':').is_some_and(|(k, v)| {
                k.trim().eq_ignore_ascii_case("transfer-encoding")
                    && v.to_ascii_lowercase().contains("chunked")
            })
        });
        Body {
            chunked: chunked.then(Dechunk::default),
        }
    }

    fn feed(&mut self, b: &[u8], out: &mut impl FnMut(&[u8])) {
        match &mut self.chunked {
            Some(d) => d.feed(b, out),
            None => out(b),
        }
    }

    fn ended(&self) -> bool {
        self.chunked.as_ref().is_some_and(|d| d.done)
    }
}

fn content_length(head: &str) -> Option<usize> {
    head.lines().skip(1).find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim()
            .eq_ignore_ascii_case("content-length")
            .then(|| v.trim().parse().ok())?
    })
}

/// One exchange with `addr` (IP:PORT): the whole reply, its body read by
/// its length, else until the server closes or `timeout` has passed
/// (what a stream sent by then).
pub fn exchange(addr: &str, req: &Request, timeout: Duration) -> Result<Reply, String> {
    let until = Instant::now() + timeout;
    let mut s = send(addr, req, timeout)?;
    s.set_read_timeout(Some(Duration::from_millis(200)))
        .map_err(|e| e.to_string())?;
    let (status, head, first) = read_head(&mut s, until)?;
    let want = content_length(&head);
    let mut framing = Body::of(&head);
    let mut body = Vec::new();
    framing.feed(&first, &mut |b| body.extend_from_slice(b));
    let mut buf = [0u8; 64 << 10];
    while want.is_none_or(|n| body.len() < n) && !framing.ended() && Instant::now() < until {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => framing.feed(&buf[..n], &mut |b| body.extend_from_slice(b)),
            Err(e) if would_block(&e) => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    if let Some(n) = want {
        if body.len() < n {
            return Err(format!(
                "{addr}: {} of {n} body bytes within the timeout",
                body.len()
            ));
        }
        body.truncate(n);
    }
    Ok(Reply {
        status,
        head,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

/// `req` to `addr`, its body handed to `each` as it comes until the server
/// closes or `stop` is set: (status, head). Without `stop`, a reply that
/// has not ended within `limit` is an error.
pub fn stream(
    addr: &str,
    req: &Request,
    stop: Option<&AtomicBool>,
    limit: Duration,
    mut each: impl FnMut(&[u8]),
) -> Result<(u16, String), String> {
    let t0 = Instant::now();
    let mut s = send(addr, req, limit)?;
    s.set_read_timeout(Some(Duration::from_millis(500)))
        .map_err(|e| e.to_string())?;
    let (status, head, first) = read_head(&mut s, t0 + limit)?;
    let mut framing = Body::of(&head);
    framing.feed(&first, &mut each);
    let mut buf = vec![0u8; 64 << 10];
    loop {
        if stop.is_some_and(|s| s.load(Relaxed)) || framing.ended() {
            break;
        }
        if stop.is_none() && t0.elapsed() > limit {
            return Err(format!(
                "{} {}: no end within {} s",
                req.method,
                req.path,
                limit.as_secs()
            ));
        }
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => framing.feed(&buf[..n], &mut each),
            Err(e) if would_block(&e) => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok((status, head))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunked_bodies_come_out_whole_however_they_are_cut() {
        let wire = b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\n\r\n";
        for cut in 1..wire.len() {
            let mut d = Dechunk::default();
            let mut out = Vec::new();
            d.feed(&wire[..cut], &mut |b| out.extend_from_slice(b));
            d.feed(&wire[cut..], &mut |b| out.extend_from_slice(b));
            assert_eq!(out, b"hello, world", "cut at {cut}");
            assert!(d.done);
        }
    }
}
