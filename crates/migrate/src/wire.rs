//! The migration stream between a source runner and a destination runner.
//!
//! Every message is a 16-byte header — magic `PM`, version 1, kind, body
//! length (u32 LE), argument (u64 LE) — and a body. The destination speaks
//! first (WELCOME: nonce + TLS flags, arg = id). A source with a TLS
//! identity dialling a destination not on loopback answers STARTTLS; the
//! destination says STARTTLS_OK, both run the TLS handshake (each presents
//! a certificate the cluster CA signed) and the destination sends a fresh
//! WELCOME inside TLS. A destination with an identity refuses a plaintext
//! HELLO from a peer not on loopback. Then the source proves the cluster
//! secret (HELLO); the destination proves it back (PROOF). Then:
//!
//! ```text
//! source → dest   SPEC  (JSON: region shape, servers, workload)
//! dest → source   READY (JSON: whether it can fill pages from its host)
//! source → dest   HASHES arg=batch, body = count × (page u64 LE, history u8, 16-byte hash)
//! dest → source   HAVE arg=batch, body = bitmap: the pages it filled itself
//! source → dest   PAGES arg=first page, body = count history bytes + count pages
//!                 LOCATED arg=first page, body = count u32 + server u16 (0xFFFF: zero page)
//!                         [+ mirror u16: the server with the pages' second copy]
//!                 ROUND arg=round number
//! dest → source   ROUND_DONE arg=round number (all of it arrived; pre-copy rounds only)
//!                 COMMIT (JSON options)           — the guest is paused now
//! dest → source   PREPARED (region built) | ERROR text
//! source → dest   GO                              — the point of no return
//! dest → source   STARTED (JSON: checksum, timings) | ERROR text
//! either way      ABORT text                      — drop everything received
//! ```
//!
//! See docs/migration.md.

use pagefleet_common::sys::splice;
use pagefleet_proto::auth::{random_u64, Secret};
use pagefleet_proto::framing::{Framing, HeaderError, RawHeader, HEADER_LEN};
use pagefleet_tls::handshake::{
    self, Challenge, ClientStep, ClientWire, HelloProof, OpeningError, ServerWire, TlsMismatch,
    TlsOffer,
};
use pagefleet_tls::Stream as Socket;
use pagefleet_units::PAGE_SIZE as PAGE;
use std::io::{self, IoSlice, Read};
use std::os::fd::BorrowedFd;
use std::time::Duration;

/// Every message starts with these bytes.
pub const MAGIC: [u8; 2] = *b"PM";
/// The stream protocol version.
pub const VERSION: u8 = 1;
/// Header bytes.
pub const HEADER: usize = HEADER_LEN;
/// Pages per PAGES message (256 KiB).
pub const MAX_PAGES: usize = 64;
/// Largest body: a JSON message or a PAGES message.
pub const MAX_BODY: usize = 1 << 20;
/// LOCATED server value for "never touched: reads as zeros".
pub const ZERO_SERVER: u16 = 0xFFFF;
/// LOCATED mirror value for "no second copy" (the 6-byte form says the same).
pub const NO_MIRROR: u16 = 0xFFFF;

/// Message kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Destination: greeting with its nonce.
    Welcome = 1,
    /// Source: its nonce and HMAC proof.
    Hello = 2,
    /// Destination: its HMAC proof.
    Proof = 3,
    /// Source: the guest's shape, servers and workload (JSON).
    Spec = 4,
    /// Destination: ready for pages.
    Ready = 5,
    /// Source: pages with their history.
    Pages = 6,
    /// Source: pages that stay on memory servers, and where.
    Located = 7,
    /// Source: a pre-copy round ends.
    Round = 8,
    /// Source: the last round is sent; build the region.
    Commit = 9,
    /// Destination: the region is built (JSON).
    Prepared = 10,
    /// Source: the guest is paused here; start it.
    Go = 11,
    /// Destination: the guest runs (JSON).
    Started = 12,
    /// Either side: drop the migration.
    Abort = 13,
    /// Either side: a failure, with its message.
    Error = 14,
    /// Destination: everything of the round has arrived.
    RoundDone = 15,
    /// Source: a piece of a VM's device state (QEMU's own migration stream
    /// without RAM), sent while the VM is stopped; `arg` is the total length.
    DeviceState = 16,
    /// Source: the keyed hashes of a batch of pages (sharing-aware
    /// migration); their data follows only for pages the destination lacks.
    Hashes = 17,
    /// Destination: which pages of a HASHES batch it filled from its host.
    Have = 18,
    /// Source, before HELLO: switch the stream to TLS.
    StartTls = 19,
    /// Destination: the TLS handshake follows.
    StartTlsOk = 20,
}

impl Kind {
    /// The kind of a byte, if known.
    pub fn from_u8(v: u8) -> Option<Kind> {
        use Kind::*;
        Some(match v {
            1 => Welcome,
            2 => Hello,
            3 => Proof,
            4 => Spec,
            5 => Ready,
            6 => Pages,
            7 => Located,
            8 => Round,
            9 => Commit,
            10 => Prepared,
            11 => Go,
            12 => Started,
            13 => Abort,
            14 => Error,
            15 => RoundDone,
            16 => DeviceState,
            17 => Hashes,
            18 => Have,
            19 => StartTls,
            20 => StartTlsOk,
            _ => return None,
        })
    }
}

/// A message header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// What it is.
    pub kind: Kind,
    /// Body bytes.
    pub len: u32,
    /// A kind-specific number.
    pub arg: u64,
}

/// What went wrong on the migration stream.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// A socket error.
    #[error("migration stream: {0}")]
    Io(#[from] io::Error),
    /// The other end closed the connection (its process died, or it gave up).
    #[error("the migration peer {peer} closed the connection (did its runner die?)")]
    Closed {
        /// The other end's address.
        peer: String,
    },
    /// The other end sent or took nothing for the stream's timeout.
    #[error("the migration peer {peer} did not answer: timed out after {secs} s")]
    TimedOut {
        /// The other end's address.
        peer: String,
        /// The timeout that passed.
        secs: u64,
    },
    /// A message that cannot be parsed.
    #[error("migration stream: malformed message: {0}")]
    Malformed(String),
    /// The other end does not hold the cluster secret.
    #[error("migration peer refused the cluster secret (both hosts need the same secret file)")]
    Auth,
    /// TLS could not be set up, or one side requires it and the other
    /// cannot speak it.
    #[error("migration stream TLS: {0}")]
    Tls(String),
    /// The other end reported an error.
    #[error("migration peer reported: {0}")]
    Peer(String),
    /// The other end aborted.
    #[error("migration peer aborted: {0}")]
    Aborted(String),
}

/// The migration stream's framing (`pagefleet_proto::framing`: the same
/// 16-byte header as the memory-server protocol, its own magic).
pub const FRAMING: Framing = Framing {
    magic: MAGIC,
    version: VERSION,
    max_body: MAX_BODY + MAX_PAGES * 4097,
};

impl Header {
    /// The wire form.
    pub fn encode(&self) -> [u8; HEADER] {
        FRAMING.encode(RawHeader {
            kind: self.kind as u8,
            body_len: self.len,
            word: self.arg,
        })
    }
    /// Parse a header.
    pub fn decode(b: &[u8; HEADER]) -> Result<Header, WireError> {
        let r = FRAMING.decode(b).map_err(|e| {
            WireError::Malformed(match e {
                HeaderError::Short => "short header".into(),
                HeaderError::BadMagic(m) => format!(
                    "bad magic {:02x}{:02x} (not a pagefleet migration stream)",
                    m[0], m[1]
                ),
                HeaderError::Version { got, .. } => {
                    format!("version {got} (this side speaks {VERSION})")
                }
                HeaderError::TooLarge { len, .. } => format!("a body of {len} bytes is too large"),
            })
        })?;
        let kind = Kind::from_u8(r.kind)
            .ok_or_else(|| WireError::Malformed(format!("unknown message kind {}", r.kind)))?;
        Ok(Header {
            kind,
            len: r.body_len,
            arg: r.word,
        })
    }
}

/// PREPARED: the destination built its region.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct Prepared {
    /// Milliseconds the runtime took to build the region.
    pub build_ms: f64,
    /// Gather: pages pulled from memory servers.
    pub pulled: u64,
    /// Of those, pages newer data from the main host replaced.
    pub pulled_then_replaced: u64,
    /// Sharing-aware migration: what the destination filled itself.
    #[serde(default)]
    pub dedup: Filled,
}

/// STARTED: the guest runs at the destination.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct Started {
    /// The region's checksum at resume (with verify).
    pub checksum: Option<String>,
    /// Seconds the checksum took (not downtime).
    pub checksum_secs: f64,
}

/// READY: what the destination can do.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct Ready {
    /// It can fill pages from content its host holds (HASHES are welcome).
    #[serde(default)]
    pub dedup: bool,
}

/// Bytes of one HASHES entry: page number, its access history, hash.
pub const HASH_ENTRY: usize = 25;
/// Most pages in one HASHES message.
pub const MAX_HASHES: usize = 1024;

/// COMMIT carries nothing.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct Commit {}

/// One end of a migration stream.
pub struct Stream {
    /// The connection (plain: pages are spliced straight from its socket).
    pub s: Socket,
    peer: String,
    timeout: std::cell::Cell<Option<Duration>>,
}

impl Stream {
    /// A stream over `s` (no delay; plaintext until a STARTTLS exchange).
    pub fn new(s: std::net::TcpStream) -> Stream {
        let _ = s.set_nodelay(true);
        let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        Stream {
            s: Socket::plain(s),
            peer,
            timeout: std::cell::Cell::new(None),
        }
    }

    /// An I/O error on the stream, said the way a person can act on it.
    pub fn io_error(&self, e: io::Error) -> WireError {
        match e.kind() {
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::BrokenPipe => WireError::Closed {
                peer: self.peer.clone(),
            },
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => WireError::TimedOut {
                peer: self.peer.clone(),
                secs: self.timeout.get().map_or(0, |t| t.as_secs()),
            },
            _ => WireError::Io(e),
        }
    }

    /// Send one message whose body is `parts` in order.
    pub fn send(&mut self, kind: Kind, arg: u64, parts: &[&[u8]]) -> Result<(), WireError> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let h = Header {
            kind,
            len: len as u32,
            arg,
        }
        .encode();
        let mut iov: Vec<IoSlice<'_>> = Vec::with_capacity(parts.len() + 1);
        iov.push(IoSlice::new(&h));
        iov.extend(
            parts
                .iter()
                .filter(|p| !p.is_empty())
                .map(|p| IoSlice::new(p)),
        );
        pagefleet_proto::io::write_all_vectored(&mut &self.s, &mut iov)
            .map_err(|e| self.io_error(e))
    }

    /// Send one message (argument `first`) whose body is `prefix` then
    /// pages `first..first + count` of the memfd `file`. On a plain
    /// connection the pages go out with sendfile(2): no copy through this
    /// process, and their bytes are the memfd's when they reach the wire,
    /// so the caller must track later changes (a migration round does).
    /// Over TLS they are read into `buf` (at least `count` pages) and sealed.
    pub fn send_pages(
        &mut self,
        kind: Kind,
        first: u64,
        prefix: &[u8],
        file: BorrowedFd<'_>,
        count: usize,
        buf: &mut [u8],
    ) -> Result<(), WireError> {
        let len = count * PAGE;
        if self.s.is_tls() {
            let data = &mut buf[..len];
            crate::pread_pages(file, first, data).map_err(WireError::Io)?;
            return self.send(kind, first, &[prefix, data]);
        }
        let total = prefix.len() + len;
        let h = Header {
            kind,
            len: u32::try_from(total)
                .map_err(|_| WireError::Malformed(format!("a body of {total} bytes")))?,
            arg: first,
        }
        .encode();
        let mut head = Vec::with_capacity(h.len() + prefix.len());
        head.extend_from_slice(&h);
        head.extend_from_slice(prefix);
        let sock = self.s.socket();
        splice::send_more(sock, &head).map_err(|e| self.io_error(e))?;
        let off = first
            .checked_mul(PAGE as u64)
            .ok_or_else(|| WireError::Malformed(format!("page {first}")))?;
        splice::send_file(&file, off, len, sock).map_err(|e| self.io_error(e))
    }

    /// Send one message with a JSON body.
    pub fn send_json<T: serde::Serialize>(&mut self, kind: Kind, v: &T) -> Result<(), WireError> {
        let b = serde_json::to_vec(v).map_err(|e| WireError::Malformed(e.to_string()))?;
        self.send(kind, 0, &[&b])
    }

    /// Read the next header.
    pub fn header(&mut self) -> Result<Header, WireError> {
        let mut b = [0u8; HEADER];
        (&self.s).read_exact(&mut b).map_err(|e| self.io_error(e))?;
        Header::decode(&b)
    }

    /// A whole body (for small messages).
    pub fn body(&mut self, h: &Header) -> Result<Vec<u8>, WireError> {
        if h.len as usize > MAX_BODY {
            return Err(WireError::Malformed(format!(
                "{:?} body of {} bytes",
                h.kind, h.len
            )));
        }
        let mut v = vec![0u8; h.len as usize];
        (&self.s).read_exact(&mut v).map_err(|e| self.io_error(e))?;
        Ok(v)
    }

    /// Read exactly `dst.len()` bytes.
    pub fn read_exact(&mut self, dst: &mut [u8]) -> Result<(), WireError> {
        (&self.s).read_exact(dst).map_err(|e| self.io_error(e))
    }

    /// The next message, which must be `want` (ERROR and ABORT become errors).
    pub fn expect(&mut self, want: Kind) -> Result<(Header, Vec<u8>), WireError> {
        let h = self.header()?;
        let body = self.body(&h)?;
        match h.kind {
            k if k == want => Ok((h, body)),
            Kind::Error => Err(WireError::Peer(String::from_utf8_lossy(&body).into_owned())),
            Kind::Abort => Err(WireError::Aborted(
                String::from_utf8_lossy(&body).into_owned(),
            )),
            k => Err(WireError::Malformed(format!(
                "expected {want:?}, got {k:?}"
            ))),
        }
    }

    /// The next message, which must be `want`, its JSON body parsed.
    pub fn expect_json<T: serde::de::DeserializeOwned>(
        &mut self,
        want: Kind,
    ) -> Result<T, WireError> {
        let (_, b) = self.expect(want)?;
        serde_json::from_slice(&b).map_err(|e| WireError::Malformed(format!("{want:?}: {e}")))
    }

    /// Give up reads and writes after `t`.
    pub fn set_timeout(&self, t: Option<Duration>) {
        let _ = self.s.socket().set_read_timeout(t);
        let _ = self.s.socket().set_write_timeout(t);
        self.timeout.set(t);
    }

    /// Destination side of the opening (`pagefleet_tls::handshake`): the
    /// mutual proof of the cluster secret, inside TLS when the source asks
    /// or this host requires it of the source.
    pub fn accept_auth(&mut self, secret: &Secret) -> Result<(), WireError> {
        let tls = pagefleet_tls::process_identity();
        let peer = self.s.socket().peer_addr()?;
        handshake::open_server(self, secret, tls.as_deref(), peer, random_u64())
            .map(drop)
            .map_err(|e| self.opening_error(e))
    }

    /// Source side of the opening.
    pub fn connect_auth(&mut self, secret: &Secret) -> Result<(), WireError> {
        let peer = self.s.socket().peer_addr()?;
        let tls = pagefleet_tls::for_peer(pagefleet_tls::process_identity(), peer);
        let host = peer.ip().to_string();
        handshake::open_client(self, secret, tls.as_deref(), &host)
            .map(drop)
            .map_err(|e| self.opening_error(e))
    }

    fn opening_error(&self, e: OpeningError<WireError>) -> WireError {
        match e {
            OpeningError::Wire(WireError::Peer(_)) | OpeningError::Auth => WireError::Auth,
            OpeningError::Wire(e) => e,
            OpeningError::Mismatch(TlsMismatch::NotOffered) => WireError::Tls(format!(
                "{} does not offer TLS, and this host sends migrations to other hosts \
                 only over TLS (give it --tls-dir)",
                self.peer
            )),
            OpeningError::Mismatch(TlsMismatch::Required) => WireError::Tls(format!(
                "{} takes migrations only over TLS: give this host --tls-dir",
                self.peer
            )),
            OpeningError::Tls(m) => WireError::Tls(format!("{}: {m}", self.peer)),
            e @ (OpeningError::PlaintextRefused { .. } | OpeningError::NoIdentity) => {
                WireError::Tls(e.to_string())
            }
        }
    }

    /// A WELCOME body: the nonce and the TLS bits.
    fn parse_welcome(h: &Header, b: &[u8]) -> Result<(Challenge, TlsOffer), WireError> {
        let (nonce, flags) = match b {
            [n @ .., f] if n.len() == 32 => (n, *f),
            _ => return Err(WireError::Malformed("WELCOME must be 33 bytes".into())),
        };
        let ch = Challenge {
            server_nonce: nonce.try_into().expect("32 bytes"),
            id: h.arg,
        };
        Ok((ch, TlsOffer::from_bits(flags)))
    }
}

/// The source's messages of the opening.
impl ClientWire for Stream {
    type Error = WireError;
    fn stream(&mut self) -> &mut Socket {
        &mut self.s
    }
    fn welcome(&mut self) -> Result<(Challenge, TlsOffer), WireError> {
        let (h, b) = self.expect(Kind::Welcome)?;
        Stream::parse_welcome(&h, &b)
    }
    fn start_tls(&mut self) -> Result<(), WireError> {
        self.send(Kind::StartTls, 0, &[])?;
        self.expect(Kind::StartTlsOk).map(drop)
    }
    fn hello(&mut self, h: &HelloProof) -> Result<[u8; 32], WireError> {
        self.send(Kind::Hello, 0, &[&h.client_nonce, &h.mac])?;
        let (_, p) = self.expect(Kind::Proof)?;
        p.as_slice()
            .try_into()
            .map_err(|_| WireError::Malformed("PROOF must be 32 bytes".into()))
    }
}

/// The destination's messages of the opening.
impl ServerWire for Stream {
    type Error = WireError;
    fn stream(&mut self) -> &mut Socket {
        &mut self.s
    }
    fn welcome(&mut self, ch: &Challenge, offer: TlsOffer) -> Result<(), WireError> {
        self.send(Kind::Welcome, ch.id, &[&ch.server_nonce, &[offer.bits()]])
    }
    fn next(&mut self) -> Result<ClientStep, WireError> {
        let h = self.header()?;
        let b = self.body(&h)?;
        match h.kind {
            Kind::StartTls if b.is_empty() => Ok(ClientStep::StartTls),
            Kind::StartTls => Err(WireError::Malformed("STARTTLS carries no body".into())),
            Kind::Hello if b.len() == 64 => Ok(ClientStep::Hello(HelloProof {
                client_nonce: b[..32].try_into().expect("32 bytes"),
                mac: b[32..].try_into().expect("32 bytes"),
            })),
            Kind::Hello => Err(WireError::Malformed("HELLO must be 64 bytes".into())),
            k => Err(WireError::Malformed(format!("expected Hello, got {k:?}"))),
        }
    }
    fn start_tls_ok(&mut self) -> Result<(), WireError> {
        self.send(Kind::StartTlsOk, 0, &[])
    }
    fn proof(&mut self, _: &Challenge, proof: &[u8; 32]) -> Result<(), WireError> {
        self.send(Kind::Proof, 0, &[proof])
    }
    fn refuse(&mut self, why: &OpeningError<WireError>) {
        let msg: &[u8] = match why {
            OpeningError::Auth => b"authentication failed",
            OpeningError::NoIdentity => b"this host has no TLS identity",
            _ => {
                b"this host takes migrations from other hosts only over TLS \
                (give the source host --tls-dir)"
            }
        };
        let _ = self.send(Kind::Error, 0, &[msg]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn header_roundtrip(k in 1u8..=20, len in 0u32..(MAX_BODY as u32), arg: u64) {
            let h = Header { kind: Kind::from_u8(k).unwrap(), len, arg };
            prop_assert_eq!(Header::decode(&h.encode()).unwrap(), h);
        }

        #[test]
        fn garbage_never_panics(b in proptest::array::uniform16(any::<u8>())) {
            let _ = Header::decode(&b);
        }
    }

    #[test]
    fn rejects_bad_headers() {
        let mut b = Header {
            kind: Kind::Pages,
            len: 10,
            arg: 1,
        }
        .encode();
        b[0] = b'X';
        assert!(Header::decode(&b).is_err());
        let mut b = Header {
            kind: Kind::Pages,
            len: 10,
            arg: 1,
        }
        .encode();
        b[3] = 99;
        assert!(Header::decode(&b).is_err());
        let b = Header {
            kind: Kind::Pages,
            len: u32::MAX,
            arg: 1,
        }
        .encode();
        assert!(Header::decode(&b).is_err());
    }

    #[test]
    fn auth_over_a_socket() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = l.local_addr().unwrap();
        let good = Secret::from_bytes(b"0123456789abcdef0123", "test").unwrap();
        let bad = Secret::from_bytes(b"xxxxxxxxxxxxxxxxxxxx", "test").unwrap();
        let g2 = good.clone();
        let t = std::thread::spawn(move || {
            let mut r = Vec::new();
            for _ in 0..2 {
                let (s, _) = l.accept().unwrap();
                r.push(Stream::new(s).accept_auth(&g2).is_ok());
            }
            r
        });
        let ok = Stream::new(std::net::TcpStream::connect(a).unwrap()).connect_auth(&good);
        assert!(ok.is_ok(), "{ok:?}");
        let refused = Stream::new(std::net::TcpStream::connect(a).unwrap()).connect_auth(&bad);
        assert!(matches!(refused, Err(WireError::Auth)), "{refused:?}");
        assert_eq!(t.join().unwrap(), vec![true, false]);
    }
}

/// What the destination filled itself (PREPARED).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Filled {
    /// Hashes it was asked about.
    pub asked: u64,
    /// Pages filled with data its host held (each checked against its hash).
    pub pages: u64,
    /// Pages that were the zero page.
    pub zero: u64,
    /// Index hints that pointed at a page changed since (sent after all).
    pub stale: u64,
    /// Seconds spent looking up, reading and checking.
    pub secs: f64,
    /// CPU seconds of the filler thread.
    #[serde(default)]
    pub cpu_secs: f64,
    /// Of which waiting for the host's lookup service.
    #[serde(default)]
    pub ask_secs: f64,
    /// Of which reading and checking pages.
    #[serde(default)]
    pub check_secs: f64,
}

/// Contiguous runs of at most `max` pages of a sorted page list.
pub fn runs(pages: &[u64], max: usize) -> impl Iterator<Item = (u64, usize)> + '_ {
    let mut i = 0;
    std::iter::from_fn(move || {
        if i >= pages.len() {
            return None;
        }
        let first = pages[i];
        let mut n = 1;
        while i + n < pages.len() && n < max && pages[i + n] == first + n as u64 {
            n += 1;
        }
        i += n;
        Some((first, n))
    })
}

#[cfg(test)]
mod runs_tests {
    use super::runs;

    #[test]
    fn runs_split_at_gaps_and_max() {
        let v = [1, 2, 3, 5, 6, 7, 8, 9, 20];
        let r: Vec<_> = runs(&v, 4).collect();
        assert_eq!(r, vec![(1, 3), (5, 4), (9, 1), (20, 1)]);
        assert_eq!(runs(&[], 4).count(), 0);
    }
}
