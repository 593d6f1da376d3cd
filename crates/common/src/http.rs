//! The HTTP client every pagefleet process uses to talk to a pagefleetd:
//! each request is signed with the cluster secret ([`crate::httpauth`]),
//! bodies and replies are typed (serde), a reply is bounded in size, and
//! errors say which daemon failed and how ("timed out after 5 s", not an
//! errno). With a TLS identity (the process's by default) requests to a
//! daemon not on loopback go over HTTPS, presenting it.

use crate::httpauth;
use pagefleet_proto::auth::Secret;
use pagefleet_tls::{Identity, Stream};
use serde::{de::DeserializeOwned, Serialize};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

/// Largest reply body read whole (a streamed reply is read line by line).
pub const MAX_REPLY: usize = 64 << 20;
/// Longest line of a streamed reply.
pub const MAX_LINE: usize = 1 << 20;

/// What went wrong talking to a pagefleetd.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// The address does not resolve.
    #[error("pagefleetd at {addr}: the address does not resolve")]
    Resolve {
        /// The daemon's address as given.
        addr: String,
    },
    /// No connection could be made.
    #[error("pagefleetd at {addr}: cannot connect: {source}")]
    Connect {
        /// The daemon's address.
        addr: String,
        /// Why.
        source: std::io::Error,
    },
    /// The daemon said nothing for too long.
    #[error("pagefleetd at {addr}: timed out after {secs} s")]
    TimedOut {
        /// The daemon's address.
        addr: String,
        /// The timeout that passed.
        secs: u64,
    },
    /// The connection failed midway.
    #[error("pagefleetd at {addr}: {source}")]
    Io {
        /// The daemon's address.
        addr: String,
        /// Why.
        source: std::io::Error,
    },
    /// The daemon answered with an error status.
    #[error("pagefleetd at {addr}: {message} (HTTP {status})")]
    Status {
        /// The daemon's address.
        addr: String,
        /// The HTTP status.
        status: u16,
        /// The daemon's error message.
        message: String,
    },
    /// HTTPS could not be set up (a certificate refused on either side).
    #[error("pagefleetd at {addr}: TLS: {msg}")]
    Tls {
        /// The daemon's address.
        addr: String,
        /// What went wrong.
        msg: String,
    },
    /// The reply is not HTTP or not the JSON expected.
    #[error("pagefleetd at {addr}: malformed reply: {what}")]
    Malformed {
        /// The daemon's address.
        addr: String,
        /// What was wrong.
        what: String,
    },
}

/// A signed-request client for pagefleetd's HTTP API.
#[derive(Clone, Debug)]
pub struct Client {
    secret: Secret,
    timeout: Duration,
    tls: Option<Arc<Identity>>,
}

/// The error body every pagefleetd route sends on failure.
#[derive(serde::Deserialize)]
struct ErrorBody {
    error: String,
}

impl Client {
    /// A client signing with `secret`; replies are awaited 5 s by default.
    pub fn new(secret: Secret) -> Client {
        Client {
            secret,
            timeout: Duration::from_secs(5),
            tls: pagefleet_tls::process_identity(),
        }
    }

    /// The same client waiting `t` for a reply.
    pub fn timeout(&self, t: Duration) -> Client {
        Client {
            timeout: t,
            ..self.clone()
        }
    }

    /// The same client presenting `tls` (None: plaintext only).
    pub fn with_tls(&self, tls: Option<Arc<Identity>>) -> Client {
        Client {
            tls,
            ..self.clone()
        }
    }

    /// `GET path`, the reply as JSON.
    pub fn get<T: DeserializeOwned>(&self, addr: &str, path: &str) -> Result<T, HttpError> {
        let body = self.request(addr, "GET", path, &[])?;
        json(addr, &body)
    }

    /// `GET path`, the reply as text (e.g. `/metrics`).
    pub fn get_text(&self, addr: &str, path: &str) -> Result<String, HttpError> {
        let body = self.request(addr, "GET", path, &[])?;
        String::from_utf8(body).map_err(|_| HttpError::Malformed {
            addr: addr.into(),
            what: "reply is not UTF-8".into(),
        })
    }

    /// `POST path` with a JSON body, the reply as JSON.
    pub fn post<B: Serialize, T: DeserializeOwned>(
        &self,
        addr: &str,
        path: &str,
        body: &B,
    ) -> Result<T, HttpError> {
        let b = serde_json::to_vec(body).map_err(|e| HttpError::Malformed {
            addr: addr.into(),
            what: format!("cannot encode the request: {e}"),
        })?;
        let reply = self.request(addr, "POST", path, &b)?;
        json(addr, &reply)
    }

    /// `POST path` whose reply is a stream of JSON lines: `each` sees every
    /// line until it returns false. `idle`: the longest silence allowed.
    pub fn post_stream<B: Serialize, T: DeserializeOwned>(
        &self,
        addr: &str,
        path: &str,
        body: &B,
        idle: Duration,
        mut each: impl FnMut(T) -> bool,
    ) -> Result<(), HttpError> {
        let b = serde_json::to_vec(body).map_err(|e| HttpError::Malformed {
            addr: addr.into(),
            what: format!("cannot encode the request: {e}"),
        })?;
        let s = self.send(addr, "POST", path, &b, idle)?;
        let mut r = BufReader::new(s);
        let head = read_head(addr, &mut r, idle)?;
        let mut body = Body::new(r, &head);
        if head.status != 200 {
            return Err(status_error(
                addr,
                head.status,
                &read_all(addr, &mut body, idle)?,
            ));
        }
        let mut lines = BufReader::new(body);
        loop {
            let mut line = Vec::new();
            let n = (&mut lines)
                .take(MAX_LINE as u64)
                .read_until(b'\n', &mut line)
                .map_err(|e| io_error(addr, e, idle))?;
            if n == 0 {
                return Ok(());
            }
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            if !each(json(addr, &line)?) {
                return Ok(());
            }
        }
    }

    fn request(
        &self,
        addr: &str,
        method: &str,
        path: &str,
        body: &[u8],
    ) -> Result<Vec<u8>, HttpError> {
        let s = self.send(addr, method, path, body, self.timeout)?;
        let mut r = BufReader::new(s);
        let head = read_head(addr, &mut r, self.timeout)?;
        let mut b = Body::new(r, &head);
        let reply = read_all(addr, &mut b, self.timeout)?;
        if head.status != 200 {
            return Err(status_error(addr, head.status, &reply));
        }
        Ok(reply)
    }

    fn send(
        &self,
        addr: &str,
        method: &str,
        path: &str,
        body: &[u8],
        timeout: Duration,
    ) -> Result<Stream, HttpError> {
        let sa: SocketAddr = addr
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| HttpError::Resolve { addr: addr.into() })?;
        let s = TcpStream::connect_timeout(&sa, timeout).map_err(|e| match e.kind() {
            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => HttpError::TimedOut {
                addr: addr.into(),
                secs: timeout.as_secs(),
            },
            _ => HttpError::Connect {
                addr: addr.into(),
                source: e,
            },
        })?;
        let _ = s.set_read_timeout(Some(timeout));
        let _ = s.set_write_timeout(Some(timeout));
        let tls_err = |msg: String| HttpError::Tls {
            addr: addr.into(),
            msg,
        };
        let mut s = match pagefleet_tls::for_peer(self.tls.as_deref(), sa) {
            Some(id) => {
                let s = Stream::tls_client(s, id, &sa.ip().to_string())
                    .map_err(|e| tls_err(e.to_string()))?;
                s.handshake().map_err(|e| tls_err(e.to_string()))?;
                s
            }
            _ => Stream::plain(s),
        };
        let auth = httpauth::sign(&self.secret, method, path, body);
        let mut req = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: {auth}\r\nConnection: close\r\n"
        );
        if method == "POST" {
            req.push_str(&format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                body.len()
            ));
        }
        req.push_str("\r\n");
        s.write_all(req.as_bytes())
            .and_then(|_| s.write_all(body))
            .map_err(|e| io_error(addr, e, timeout))?;
        Ok(s)
    }
}

fn io_error(addr: &str, e: std::io::Error, t: Duration) -> HttpError {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => HttpError::TimedOut {
            addr: addr.into(),
            secs: t.as_secs(),
        },
        _ => HttpError::Io {
            addr: addr.into(),
            source: e,
        },
    }
}

fn json<T: DeserializeOwned>(addr: &str, b: &[u8]) -> Result<T, HttpError> {
    serde_json::from_slice(b).map_err(|e| HttpError::Malformed {
        addr: addr.into(),
        what: e.to_string(),
    })
}

fn status_error(addr: &str, status: u16, body: &[u8]) -> HttpError {
    let message = serde_json::from_slice::<ErrorBody>(body)
        .map(|e| e.error)
        .unwrap_or_else(|_| String::from_utf8_lossy(body).trim().to_string());
    HttpError::Status {
        addr: addr.into(),
        status,
        message,
    }
}

struct Head {
    status: u16,
    length: Option<u64>,
    chunked: bool,
}

fn read_head(addr: &str, r: &mut impl BufRead, t: Duration) -> Result<Head, HttpError> {
    let bad = |what: &str| HttpError::Malformed {
        addr: addr.into(),
        what: what.into(),
    };
    let mut line = String::new();
    let mut head = Head {
        status: 0,
        length: None,
        chunked: false,
    };
    for i in 0..200 {
        line.clear();
        let n = r
            .take(64 << 10)
            .read_line(&mut line)
            .map_err(|e| io_error(addr, e, t))?;
        if n == 0 {
            return Err(bad(
                "the connection closed before the reply's headers ended",
            ));
        }
        if i == 0 {
            head.status = line
                .split_whitespace()
                .nth(1)
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| bad("no HTTP status line"))?;
            continue;
        }
        let l = line.trim_end();
        if l.is_empty() {
            return Ok(head);
        }
        if let Some((k, v)) = l.split_once(':') {
            let (k, v) = (k.trim(), v.trim());
            if k.eq_ignore_ascii_case("content-length") {
                head.length = Some(v.parse().map_err(|_| bad("bad Content-Length"))?);
            } else if k.eq_ignore_ascii_case("transfer-encoding")
                && v.eq_ignore_ascii_case("chunked")
            {
                head.chunked = true;
            }
        }
    }
    Err(bad("too many header lines"))
}

/// A reply body: by length, chunked, or up to the connection's close.
enum Body<R> {
    Length(std::io::Take<R>),
    Chunked { r: R, left: u64, done: bool },
    Eof(R),
}

impl<R: BufRead> Body<R> {
    fn new(r: R, h: &Head) -> Body<R> {
        if h.chunked {
            Body::Chunked {
                r,
                left: 0,
                done: false,
            }
        } else if let Some(n) = h.length {
            Body::Length(r.take(n))
        } else {
            Body::Eof(r)
        }
    }
}

impl<R: BufRead> Read for Body<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Body::Length(r) => r.read(buf),
            Body::Eof(r) => r.read(buf),
            Body::Chunked { r, left, done } => {
                let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "bad chunk");
                if *done {
                    return Ok(0);
                }
                if *left == 0 {
                    let mut size = String::new();
                    r.take(1024).read_line(&mut size)?;
                    let hexlen = size.trim().split(';').next().unwrap_or("");
                    *left = u64::from_str_radix(hexlen, 16).map_err(|_| bad())?;
                    if *left == 0 {
                        *done = true;
                        return Ok(0);
                    }
                }
                let want = buf.len().min(*left as usize);
                let n = r.read(&mut buf[..want])?;
                if n == 0 {
                    return Err(bad());
                }
                *left -= n as u64;
                if *left == 0 {
                    let mut crlf = [0u8; 2];
                    r.read_exact(&mut crlf)?;
                }
                Ok(n)
            }
        }
    }
}

fn read_all(addr: &str, b: &mut impl Read, t: Duration) -> Result<Vec<u8>, HttpError> {
    let mut out = Vec::new();
    b.take(MAX_REPLY as u64 + 1)
        .read_to_end(&mut out)
        .map_err(|e| io_error(addr, e, t))?;
    if out.len() > MAX_REPLY {
        return Err(HttpError::Malformed {
            addr: addr.into(),
            what: format!("reply larger than {MAX_REPLY} bytes"),
        });
    }
    Ok(out)
}
