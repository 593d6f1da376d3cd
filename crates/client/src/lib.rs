//! Blocking, pipelined client for pagefleet memory servers.
//!
//! [`Conn`] is one authenticated connection. Bulk calls (`put`, `get`,
//! `delete`) split their pages into frames of up to `batch` pages and keep up
//! to `window` frames in flight, so one connection streams at close to the
//! socket's speed. Page data is written from, and read into, the caller's
//! buffers directly. The `send_*` / `recv_*` calls expose the pipeline for
//! callers that interleave their own work (the paging runtime installs the
//! faulting page before the rest of its chunk has arrived).
//!
//! [`Cluster`] holds connections to several servers.
//!
//! With a TLS identity ([`ConnectOptions::tls`], by default the process's)
//! a connection to a server not on loopback switches to TLS (STARTTLS)
//! before it authenticates, and a server that does not offer TLS there is
//! refused rather than spoken to in plaintext.

use pagefleet_proto::auth::{Secret, SecretError};
use pagefleet_proto::io::RecvBuf;
use pagefleet_proto::*;
use pagefleet_tls::handshake::{
    self, Challenge, ClientWire, HelloProof, OpeningError, TlsMismatch, TlsOffer,
};
use pagefleet_tls::{Identity, Stream};
use std::collections::VecDeque;
use std::io::{self, IoSliceMut, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What went wrong talking to a memory server; every variant names it.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No connection could be made.
    #[error("memory server {addr}: cannot connect: {source}")]
    Connect {
        /// The server.
        addr: String,
        /// Why.
        source: io::Error,
    },
    /// The server said nothing for the I/O timeout.
    #[error("memory server {addr}: no answer: timed out after {secs} s")]
    TimedOut {
        /// The server.
        addr: String,
        /// The timeout that passed.
        secs: u64,
    },
    /// The server left a request unanswered past a deadline the caller
    /// derived from its usual replies (a hung or stopped server; the
    /// connection itself is open).
    #[error("memory server {addr}: no answer within {waited_ms} ms (its replies usually take {usual_us} us): hung or stopped")]
    Unresponsive {
        /// The server.
        addr: String,
        /// How long the oldest request waited.
        waited_ms: u64,
        /// Its usual reply time, µs.
        usual_us: u64,
    },
    /// The connection failed midway.
    #[error("memory server {addr}: connection lost: {source}")]
    Io {
        /// The server.
        addr: String,
        /// Why.
        source: io::Error,
    },
    /// The server refused the request.
    #[error("memory server {addr}: {err}")]
    Server {
        /// The server.
        addr: String,
        /// Its error code and message.
        err: WireError,
    },
    /// The server broke the protocol.
    #[error("memory server {addr} sent an invalid frame: {msg}")]
    Protocol {
        /// The server.
        addr: String,
        /// What was wrong.
        msg: String,
    },
    /// The server did not prove it holds the cluster secret.
    #[error("memory server {addr} could not prove it holds the cluster secret: wrong secret on one side, or not a pagefleet server")]
    ServerAuth {
        /// The server.
        addr: String,
    },
    /// TLS could not be set up, or the server would not use it where this
    /// client must.
    #[error("memory server {addr}: TLS: {msg}")]
    Tls {
        /// The server.
        addr: String,
        /// What went wrong.
        msg: String,
    },
    /// The cluster secret could not be read.
    #[error(transparent)]
    Secret(#[from] SecretError),
    /// A call the client cannot make (e.g. buffers of the wrong size).
    #[error("{0}")]
    Usage(String),
}

impl ClientError {
    /// Whether trying again later may succeed: the server is busy, or the
    /// connection could not be made or was lost (not: refused credentials,
    /// a protocol violation, a request the server rejects).
    pub fn is_transient(&self) -> bool {
        match self {
            ClientError::Connect { .. }
            | ClientError::Io { .. }
            | ClientError::TimedOut { .. }
            | ClientError::Unresponsive { .. } => true,
            ClientError::Server { err, .. } => err.code == ErrorCode::Busy,
            _ => false,
        }
    }

    /// The server's error code, when the server refused the request.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Server { err, .. } => Some(err.code),
            _ => None,
        }
    }
}

/// A client call's result.
pub type Result<T> = std::result::Result<T, ClientError>;

/// What the server said about itself at HELLO.
#[derive(Clone, Debug)]
pub struct ServerInfo {
    /// Random per server process: a new id means it restarted (and lost its pages).
    pub server_id: u64,
    /// Pages it lends in all.
    pub capacity_pages: u64,
    /// Pages it holds now.
    pub used_pages: u64,
    /// Most pages one request may carry.
    pub max_batch_pages: u32,
}

/// The request ids of a PUSH sent and not yet answered ([`Conn::send_push`]).
#[derive(Debug)]
#[must_use = "read the replies with recv_push"]
pub struct PushIds(Vec<u64>);

/// How to connect.
#[derive(Clone, Debug)]
pub struct ConnectOptions {
    /// Shown in the server's logs.
    pub name: String,
    /// Give up connecting after this long.
    pub connect_timeout: Duration,
    /// A server silent this long while a reply is due is declared dead.
    pub io_timeout: Duration,
    /// Frames kept in flight by bulk calls.
    pub window: usize,
    /// The certificate this client presents; with one, servers not on
    /// loopback are spoken to over TLS only. Default: the process's.
    pub tls: Option<Arc<Identity>>,
    /// Use TLS (with `tls`) to a loopback server too (measuring its cost).
    pub tls_on_loopback: bool,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            name: format!("pagefleet-client/{}", std::process::id()),
            connect_timeout: Duration::from_secs(5),
            io_timeout: Duration::from_secs(30),
            window: 16,
            tls: pagefleet_tls::process_identity(),
            tls_on_loopback: false,
        }
    }
}

/// Which pages a bulk call names: a run starting at a page, or a list.
#[derive(Clone, Copy, Debug)]
pub enum Pages<'a> {
    /// `count` pages from `first` on.
    Run {
        /// The first page.
        first: u64,
        /// How many.
        count: u64,
    },
    /// These pages, in this order.
    List(&'a [u64]),
}

impl Pages<'_> {
    /// How many pages.
    pub fn len(&self) -> usize {
        match self {
            Pages::Run { count, .. } => *count as usize,
            Pages::List(v) => v.len(),
        }
    }
    /// Whether it names no page.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Frame `k` of `batch` pages.
    fn frame(&self, k: usize, batch: usize) -> PageSel {
        let lo = k * batch;
        let hi = (lo + batch).min(self.len());
        match self {
            Pages::Run { first, .. } => PageSel::Run {
                first: first + lo as u64,
                count: (hi - lo) as u32,
            },
            Pages::List(v) => PageSel::List(v[lo..hi].to_vec()),
        }
    }
}

/// Whether a GET leaves the pages on the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GetMode {
    /// Leave the pages on the server.
    Keep,
    /// Remove the pages once sent (S-memV page-in).
    Take,
}

/// A GET reply's presence information.
#[derive(Clone, Debug)]
pub struct GetReply {
    /// Pages asked for.
    pub count: u32,
    /// Pages the server held.
    pub present: u32,
    /// Indexes (within the request) of pages the server did not hold.
    pub missing: Vec<u32>,
}

/// One authenticated connection to a memory server, with pipelined
/// bulk calls.
pub struct Conn {
    stream: Stream,
    rb: RecvBuf,
    next_id: u64,
    sendbuf: Vec<u8>,
    /// The server's address.
    pub addr: String,
    /// What it said about itself at HELLO.
    pub info: ServerInfo,
    window: usize,
    io_timeout: Duration,
}

/// The sending half of a [`Conn::split`] connection.
pub struct SendHalf(Conn);

impl SendHalf {
    /// Send one PUT frame of scattered pages ([`Conn::send_put_pages`]).
    pub fn send_put_pages(&mut self, region: u64, sel: &PageSel, pages: &[&[u8]]) -> Result<u64> {
        self.0.send_put_pages(region, sel, pages)
    }
    /// Queue one PUT frame, pages copied ([`Conn::queue_put_pages`]).
    pub fn queue_put_pages(&mut self, region: u64, sel: &PageSel, pages: &[&[u8]]) -> Result<u64> {
        self.0.queue_put_pages(region, sel, pages)
    }
    /// Queue one GET frame ([`Conn::queue_get`]).
    pub fn queue_get(
        &mut self,
        region: u64,
        sel: &PageSel,
        mode: GetMode,
        allow_missing: bool,
    ) -> Result<u64> {
        self.0.queue_get(region, sel, mode, allow_missing)
    }
    /// Queue one DELETE frame ([`Conn::queue_delete`]).
    pub fn queue_delete(&mut self, region: u64, sel: &PageSel) -> Result<u64> {
        self.0.queue_delete(region, sel)
    }
    /// Send what is queued.
    pub fn flush(&mut self) -> Result<()> {
        self.0.flush()
    }
    /// Shut the connection down both ways: the receiving half's wait ends.
    pub fn shutdown(&self) {
        let _ = self.0.stream.socket().shutdown(std::net::Shutdown::Both);
    }
    /// The server's address.
    pub fn addr(&self) -> &str {
        &self.0.addr
    }
}

/// The receiving half of a [`Conn::split`] connection.
pub struct RecvHalf(Conn);

impl RecvHalf {
    /// Receive a PUT's reply ([`Conn::recv_put`]).
    pub fn recv_put(&mut self, id: u64) -> Result<PutOk> {
        self.0.recv_put(id)
    }
    /// Receive a GET's reply into `dst` ([`Conn::recv_get`]).
    pub fn recv_get(&mut self, id: u64, dst: &mut [u8]) -> Result<GetReply> {
        let h = self.0.read_header()?;
        self.0.finish_get(h, id, dst)
    }
    /// Read up to `bytes` ahead of what a reply needs: small pipelined
    /// replies come in with one system call (bulk data beyond it is still
    /// read straight into the caller's buffer).
    pub fn set_read_ahead(&mut self, bytes: usize) {
        if self.0.rb.is_empty() && self.0.rb.capacity() < bytes {
            self.0.rb = RecvBuf::new(bytes);
        }
        self.0.rb.set_read_max(bytes);
    }
    /// Whether a reply is here already (read without waiting): see
    /// [`Conn::reply_ready`].
    pub fn reply_ready(&mut self) -> bool {
        self.0.reply_ready()
    }
    /// Wait until the next reply's header is here (reading ahead as far
    /// as [`RecvHalf::set_read_ahead`] allows), without knowing yet which
    /// request it answers: a receiver that waits on its server this way,
    /// not on whoever sends the requests, is woken once per burst of
    /// replies. `Ok(false)`: the server closed the connection; an error
    /// after the I/O timeout is [`ClientError::TimedOut`].
    pub fn wait_reply(&mut self) -> Result<bool> {
        let c = &mut self.0;
        match c.rb.fill_to(&mut c.stream, HEADER_LEN) {
            Ok(more) => Ok(more),
            Err(e) => Err(c.io(e)),
        }
    }
    /// Receive a DELETE's reply ([`Conn::recv_delete`]).
    pub fn recv_delete(&mut self, id: u64) -> Result<u64> {
        let body = self.0.expect_reply(id, Opcode::DeleteOk)?;
        Ok(DeleteOk::decode(&body)
            .map_err(|e| self.0.proto(e.message))?
            .deleted)
    }
}

/// An I/O error on a connection, said as a person would want it: a timeout
/// says how long, anything else is a lost connection.
fn io_error(addr: &str, timeout: Duration, source: io::Error) -> ClientError {
    match source.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ClientError::TimedOut {
            addr: addr.to_string(),
            secs: timeout.as_secs(),
        },
        _ => ClientError::Io {
            addr: addr.to_string(),
            source,
        },
    }
}

fn resolve(addr: &str) -> io::Result<SocketAddr> {
    addr.to_socket_addrs()?
        .next()
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "address resolves to nothing"))
}

/// The memory-server protocol's client side of the opening
/// (`pagefleet_tls::handshake`): WELCOME and HELLO frames, the versions and
/// the page size checked, what the server says about itself kept.
struct Opening<'a> {
    c: &'a mut Conn,
    /// The name HELLO carries (in the server's logs).
    name: String,
}

impl ClientWire for Opening<'_> {
    type Error = ClientError;
    fn stream(&mut self) -> &mut Stream {
        &mut self.c.stream
    }
    fn welcome(&mut self) -> Result<(Challenge, TlsOffer)> {
        let c = &mut *self.c;
        let (h, body) = c.read_frame()?;
        if h.opcode != Opcode::Welcome as u8 {
            return Err(c.unexpected(h, "WELCOME", &body));
        }
        let w = Welcome::decode(&body).map_err(|e| c.proto(e.message))?;
        if w.min_version > VERSION as u16 || w.max_version < VERSION as u16 {
            return Err(c.proto(format!(
                "server speaks versions {}..={}, this client {}",
                w.min_version, w.max_version, VERSION
            )));
        }
        c.info.server_id = w.server_id;
        let ch = Challenge {
            server_nonce: w.server_nonce,
            id: w.server_id,
        };
        Ok((ch, TlsOffer::from_bits(w.flags as u8)))
    }
    fn start_tls(&mut self) -> Result<()> {
        let c = &mut *self.c;
        let sid = c.id();
        frame(Opcode::StartTls, sid, &mut c.sendbuf, |_| {});
        c.send_buffered()?;
        let (h, body) = c.read_frame()?;
        if h.opcode != Opcode::StartTlsOk as u8 {
            return Err(c.unexpected(h, "STARTTLS_OK", &body));
        }
        if !c.rb.is_empty() {
            return Err(c.proto("bytes after STARTTLS_OK before the TLS handshake"));
        }
        Ok(())
    }
    fn hello(&mut self, p: &HelloProof) -> Result<[u8; 32]> {
        let c = &mut *self.c;
        let hello = Hello {
            version: VERSION as u16,
            flags: 0,
            client_nonce: p.client_nonce,
            mac: p.mac,
            name: std::mem::take(&mut self.name),
        };
        let id = c.id();
        frame(Opcode::Hello, id, &mut c.sendbuf, |b| hello.encode(b));
        c.send_buffered()?;
        let (h, body) = c.read_frame()?;
        if h.opcode != Opcode::HelloOk as u8 {
            return Err(c.unexpected(h, "HELLO_OK", &body));
        }
        let ok = HelloOk::decode(&body).map_err(|e| c.proto(e.message))?;
        if ok.server_id != c.info.server_id {
            return Err(ClientError::ServerAuth {
                addr: c.addr.clone(),
            });
        }
        if ok.page_size as usize != PAGE_SIZE {
            return Err(c.proto(format!(
                "server page size {} is not {PAGE_SIZE}",
                ok.page_size
            )));
        }
        c.info = ServerInfo {
            server_id: ok.server_id,
            capacity_pages: ok.capacity_pages,
            used_pages: ok.used_pages,
            max_batch_pages: ok.max_batch_pages,
        };
        Ok(ok.mac)
    }
}

impl Conn {
    /// Connect and authenticate (mutually) with the cluster secret.
    pub fn connect(addr: &str, secret: &Secret, opts: &ConnectOptions) -> Result<Conn> {
        let cerr = |source| ClientError::Connect {
            addr: addr.to_string(),
            source,
        };
        let sa = resolve(addr).map_err(cerr)?;
        let sock = TcpStream::connect_timeout(&sa, opts.connect_timeout).map_err(cerr)?;
        let stream = Stream::plain(sock);
        let sock = stream.socket();
        sock.set_nodelay(true).map_err(cerr)?;
        sock.set_read_timeout(Some(opts.io_timeout)).map_err(cerr)?;
        sock.set_write_timeout(Some(opts.io_timeout))
            .map_err(cerr)?;
        let mut rb = RecvBuf::new(16 * 1024);
        // Read little ahead, so page data goes straight into the caller's buffer.
        rb.set_read_max(pagefleet_proto::PAGE_SIZE + 64);
        let mut c = Conn {
            stream,
            rb,
            next_id: 1,
            sendbuf: Vec::with_capacity(8192),
            addr: addr.to_string(),
            info: ServerInfo {
                server_id: 0,
                capacity_pages: 0,
                used_pages: 0,
                max_batch_pages: 0,
            },
            window: opts.window.max(1),
            io_timeout: opts.io_timeout,
        };
        let tls = match opts.tls_on_loopback {
            true => opts.tls.as_deref(),
            false => pagefleet_tls::for_peer(opts.tls.as_deref(), sa),
        };
        let host = addr
            .rsplit_once(':')
            .map_or(addr, |(h, _)| h)
            .trim_matches(|c| c == '[' || c == ']');
        let hello_name = opts.name.clone();
        let mut opening = Opening {
            c: &mut c,
            name: hello_name,
        };
        handshake::open_client(&mut opening, secret, tls, host).map_err(|e| match e {
            OpeningError::Wire(e) => e,
            OpeningError::Auth => ClientError::ServerAuth {
                addr: c.addr.clone(),
            },
            OpeningError::Mismatch(TlsMismatch::NotOffered) => c.tls_error(
                "the server does not offer TLS, and this client speaks only TLS \
                 to servers not on loopback (give the server --tls-dir)",
            ),
            OpeningError::Mismatch(TlsMismatch::Required) => c.tls_error(
                "the server takes only TLS from this address: give this client the \
                 cluster's certificates (--tls-dir or $PAGEFLEET_TLS_DIR)",
            ),
            e => c.tls_error(&e.to_string()),
        })?;
        Ok(c)
    }

    fn tls_error(&self, msg: &str) -> ClientError {
        ClientError::Tls {
            addr: self.addr.clone(),
            msg: msg.to_string(),
        }
    }

    /// Whether this connection runs over TLS.
    pub fn is_tls(&self) -> bool {
        self.stream.is_tls()
    }

    /// Connect like [`Conn::connect`], but retry for up to `patience` while
    /// the server answers BUSY, refuses or drops the connection (a restart,
    /// a full session table, a flood of strangers): a pager should ride out a
    /// moment's trouble, not kill its guest. Errors that retrying cannot fix
    /// (wrong secret, protocol) return at once.
    pub fn connect_patiently(
        addr: &str,
        secret: &Secret,
        opts: &ConnectOptions,
        patience: Duration,
    ) -> Result<Conn> {
        let start = Instant::now();
        let mut pause = Duration::from_millis(10);
        loop {
            match Conn::connect(addr, secret, opts) {
                Ok(c) => return Ok(c),
                Err(e) if e.is_transient() && start.elapsed() + pause < patience => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(500));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Frames bulk calls keep in flight (at least 1).
    pub fn set_window(&mut self, window: usize) {
        self.window = window.max(1);
    }

    /// The connection's socket (for polling it beside other fds).
    pub fn raw_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.stream.socket().as_raw_fd()
    }

    /// The socket, borrowed (to register with an epoll set).
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.stream.socket().as_fd()
    }

    /// Bytes arrived on the socket since the last read (an epoll edge):
    /// [`Conn::reply_ready`] must look again.
    pub fn note_readable(&mut self) {
        self.rb.forget_drained();
    }

    /// Whether the server closed this connection (or reset it): a peek at
    /// the socket that does not wait. Bytes waiting (a reply, a TLS record)
    /// count as open.
    pub fn peer_closed(&self) -> bool {
        let mut b = [0u8; 1];
        let peek = pagefleet_proto::sys::recv(
            self.stream.socket(),
            &mut b,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        );
        match peek {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => !matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
            ),
        }
    }

    /// Whether bytes of a reply were read ahead into this connection's
    /// buffer (a poll of the socket does not see them). No system call.
    pub fn buffered(&self) -> bool {
        !self.rb.is_empty() || self.stream.buffered()
    }

    /// Whether a reply (or its start) is here already: buffered, or
    /// readable on the socket — read into this connection's buffer at once,
    /// without waiting (one system call where a peek and then the read took
    /// two; a one-page reply fits whole). Receiving then does not wait for
    /// the server. No system call when the last read came back short and
    /// nobody said bytes arrived since ([`Conn::note_readable`]): the
    /// socket was empty.
    pub fn reply_ready(&mut self) -> bool {
        if self.buffered() {
            return true;
        }
        if self.rb.drained() {
            return false;
        }
        match self.stream.read_nonblocking(self.rb.spare()) {
            Ok(Some(n)) if n > 0 => {
                self.rb.commit(n);
                true
            }
            Ok(None) => false,
            // 0: the server closed; an error (a reset): receiving reports
            // either at once. (Saying "not ready" to a reset left a reply
            // awaited forever: an edge-triggered poll does not report the
            // dead socket again.)
            Ok(Some(_)) | Err(_) => true,
        }
    }

    fn id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    fn io(&self, source: io::Error) -> ClientError {
        io_error(&self.addr, self.io_timeout, source)
    }

    fn proto(&self, msg: impl Into<String>) -> ClientError {
        ClientError::Protocol {
            addr: self.addr.clone(),
            msg: msg.into(),
        }
    }

    /// Turn an unexpected frame into the right error (ERROR frames become Server errors).
    fn unexpected(&self, h: Header, wanted: &str, body: &[u8]) -> ClientError {
        if h.opcode == Opcode::Error as u8 {
            return match WireError::decode(body, h.id) {
                Ok(err) => ClientError::Server {
                    addr: self.addr.clone(),
                    err,
                },
                Err(e) => self.proto(format!("undecodable ERROR frame: {}", e.message)),
            };
        }
        self.proto(format!("expected {wanted}, got opcode {:#04x}", h.opcode))
    }

    fn send_buffered(&mut self) -> Result<()> {
        let r = (&self.stream).write_all(&self.sendbuf);
        self.sendbuf.clear();
        r.map_err(|e| self.io(e))
    }

    fn read_header(&mut self) -> Result<Header> {
        match self.rb.fill_to(&mut self.stream, HEADER_LEN) {
            Ok(true) => {}
            Ok(false) => {
                return Err(self.io(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "server closed the connection",
                )))
            }
            Err(e) => return Err(self.io(e)),
        }
        let h = Header::decode(&self.rb.available()[..HEADER_LEN])
            .map_err(|e| self.proto(e.message))?;
        self.rb.consume(HEADER_LEN);
        Ok(h)
    }

    fn read_body(&mut self, len: usize) -> Result<Vec<u8>> {
        let mut b = vec![0u8; len];
        self.rb
            .read_exact_into(&mut self.stream, &mut b)
            .map_err(|e| self.io(e))?;
        Ok(b)
    }

    fn read_frame(&mut self) -> Result<(Header, Vec<u8>)> {
        let h = self.read_header()?;
        let b = self.read_body(h.body_len as usize)?;
        Ok((h, b))
    }

    /// Read a reply that must answer `id` with opcode `op`; returns its body.
    fn expect_reply(&mut self, id: u64, op: Opcode) -> Result<Vec<u8>> {
        let (h, body) = self.read_frame()?;
        if h.opcode == op as u8 && h.id == id {
            return Ok(body);
        }
        if h.opcode == Opcode::Error as u8 && (h.id == id || h.id == 0) {
            return Err(self.unexpected(h, op.name(), &body));
        }
        Err(self.proto(format!(
            "expected {} for request {id}, got opcode {:#04x} for request {}",
            op.name(),
            h.opcode,
            h.id
        )))
    }

    /// Round trip a PING; returns the measured time.
    pub fn ping(&mut self) -> Result<Duration> {
        let t = Instant::now();
        let id = self.id();
        frame(Opcode::Ping, id, &mut self.sendbuf, |b| {
            b.extend_from_slice(b"pagefleet")
        });
        self.send_buffered()?;
        let body = self.expect_reply(id, Opcode::Pong)?;
        if body != b"pagefleet" {
            return Err(self.proto("PONG does not echo the PING payload"));
        }
        Ok(t.elapsed())
    }

    /// The server's capacity, use and connections (and its regions with `list_regions`).
    pub fn stat(&mut self, list_regions: bool) -> Result<StatOk> {
        let id = self.id();
        let req = StatReq {
            flags: if list_regions {
                StatReq::LIST_REGIONS
            } else {
                0
            },
            max_regions: StatReq::MAX_LISTED,
        };
        frame(Opcode::Stat, id, &mut self.sendbuf, |b| req.encode(b));
        self.send_buffered()?;
        let body = self.expect_reply(id, Opcode::StatOk)?;
        StatOk::decode(&body).map_err(|e| self.proto(e.message))
    }

    // ---- pipeline primitives -------------------------------------------

    /// Send one PUT frame (≤ 32 pages; `data` is pages × 4096 bytes).
    pub fn send_put(&mut self, region: u64, sel: &PageSel, data: &[u8]) -> Result<u64> {
        if sel.is_empty() || sel.len() > MAX_BATCH_PAGES || data.len() != sel.len() * PAGE_SIZE {
            return Err(ClientError::Usage(format!(
                "a PUT frame takes 1..={MAX_BATCH_PAGES} pages and pages x {PAGE_SIZE} bytes of data ({} pages, {} bytes given)",
                sel.len(),
                data.len()
            )));
        }
        let pages: Vec<&[u8]> = data.chunks(PAGE_SIZE).collect();
        self.send_put_pages(region, sel, &pages)
    }

    /// Send one PUT frame whose pages are scattered in memory: `pages[i]`
    /// (4096 bytes each) is the data of the selection's i-th page; written
    /// with one vectored write, no copy.
    pub fn send_put_pages(&mut self, region: u64, sel: &PageSel, pages: &[&[u8]]) -> Result<u64> {
        if pages.iter().any(|p| p.len() != PAGE_SIZE) {
            return Err(ClientError::Usage(format!(
                "a PUT frame takes pages of {PAGE_SIZE} bytes"
            )));
        }
        let ptrs: Vec<*const u8> = pages.iter().map(|p| p.as_ptr()).collect();
        // SAFETY: every pointer is a live 4096-byte slice borrowed for the call.
        unsafe { self.send_put_raw(region, sel, &ptrs) }
    }

    /// Queue one PUT frame, its pages copied into the send buffer (sent
    /// by the next `flush`): for small writes a burst of which goes out in
    /// one system call (a copy of a few pages costs less than a write).
    pub fn queue_put_pages(&mut self, region: u64, sel: &PageSel, pages: &[&[u8]]) -> Result<u64> {
        if sel.is_empty() || sel.len() > MAX_BATCH_PAGES || pages.len() != sel.len() {
            return Err(ClientError::Usage(format!(
                "a PUT frame takes 1..={MAX_BATCH_PAGES} pages, one per selected page ({} pages, {} given)",
                sel.len(),
                pages.len()
            )));
        }
        if pages.iter().any(|p| p.len() != PAGE_SIZE) {
            return Err(ClientError::Usage(format!(
                "a PUT frame takes pages of {PAGE_SIZE} bytes"
            )));
        }
        let id = self.id();
        frame(Opcode::Put, id, &mut self.sendbuf, |b| {
            encode_pages_req(region, sel, 0, b);
            for p in pages {
                b.extend_from_slice(p);
            }
        });
        Ok(id)
    }

    /// [`Conn::send_put_pages`] from raw page addresses: for memory another
    /// thread (a guest) may write while it is sent. The kernel copies the
    /// bytes into the socket during the call; a concurrent write makes that
    /// page's copy torn, which the caller must treat as stale.
    ///
    /// # Safety
    /// Each pointer must be valid for reads of 4096 bytes for the whole call
    /// (mapped, not unmapped or truncated by another thread meanwhile).
    pub unsafe fn send_put_raw(
        &mut self,
        region: u64,
        sel: &PageSel,
        pages: &[*const u8],
    ) -> Result<u64> {
        if sel.is_empty() || sel.len() > MAX_BATCH_PAGES || pages.len() != sel.len() {
            return Err(ClientError::Usage(format!(
                "a PUT frame takes 1..={MAX_BATCH_PAGES} pages, one per selected page ({} pages, {} given)",
                sel.len(),
                pages.len()
            )));
        }
        let id = self.id();
        let mut meta = Vec::with_capacity(HEADER_LEN + 16 + sel.len() * 8);
        meta.extend_from_slice(&[0u8; HEADER_LEN]);
        encode_pages_req(region, sel, 0, &mut meta);
        let body_len = meta.len() - HEADER_LEN + pages.len() * PAGE_SIZE;
        meta[..HEADER_LEN].copy_from_slice(&Header::new(Opcode::Put, body_len, id).encode());
        let mut iov = Vec::with_capacity(1 + pages.len());
        iov.push(libc::iovec {
            iov_base: meta.as_ptr() as *mut libc::c_void,
            iov_len: meta.len(),
        });
        iov.extend(pages.iter().map(|p| libc::iovec {
            iov_base: *p as *mut libc::c_void,
            iov_len: PAGE_SIZE,
        }));
        // SAFETY: `meta` lives to the end of this call; the pages are valid
        // for reads per this function's contract.
        unsafe { self.stream.writev_all(&mut iov) }.map_err(|e| self.io(e))?;
        Ok(id)
    }

    /// Receive the reply to a PUT sent with `send_put`.
    pub fn recv_put(&mut self, id: u64) -> Result<PutOk> {
        let body = self.expect_reply(id, Opcode::PutOk)?;
        PutOk::decode(&body).map_err(|e| self.proto(e.message))
    }

    /// Queue one DELETE frame (sent by the next `flush`).
    pub fn queue_delete(&mut self, region: u64, sel: &PageSel) -> Result<u64> {
        if sel.is_empty() {
            return Err(ClientError::Usage("a DELETE frame takes pages".into()));
        }
        let id = self.id();
        frame(Opcode::Delete, id, &mut self.sendbuf, |b| {
            encode_pages_req(region, sel, 0, b)
        });
        Ok(id)
    }

    /// Receive the reply to a DELETE: how many of its pages the server held.
    pub fn recv_delete(&mut self, id: u64) -> Result<u64> {
        self.flush()?;
        let body = self.expect_reply(id, Opcode::DeleteOk)?;
        Ok(DeleteOk::decode(&body)
            .map_err(|e| self.proto(e.message))?
            .deleted)
    }

    /// Split into a sending and a receiving half that two threads drive at
    /// once: one sends requests while the other reads the replies, in the
    /// order sent (a server answers a connection's requests in order). The
    /// sender numbers the requests; the receiver is given each one's id.
    /// Neither half can do the other's part, so a reply is never read
    /// twice or a request sent from two places.
    pub fn split(self) -> Result<(SendHalf, RecvHalf)> {
        let stream = self.stream.try_clone().map_err(|e| self.io(e))?;
        let sender = Conn {
            stream,
            rb: RecvBuf::new(0),
            next_id: self.next_id,
            sendbuf: Vec::with_capacity(8192),
            addr: self.addr.clone(),
            info: self.info.clone(),
            window: self.window,
            io_timeout: self.io_timeout,
        };
        Ok((SendHalf(sender), RecvHalf(self)))
    }

    /// Send one PUT_HASHED frame: (page, keyed content hash) for 1..=32
    /// pages; the server stores those its host holds (sharing-aware
    /// migration). Replies in order with the other requests.
    pub fn send_put_hashed(&mut self, region: u64, entries: &[(u64, [u8; 16])]) -> Result<u64> {
        if entries.is_empty() || entries.len() > MAX_BATCH_PAGES {
            return Err(ClientError::Usage(format!(
                "a PUT_HASHED frame takes 1..={MAX_BATCH_PAGES} pages ({} given)",
                entries.len()
            )));
        }
        let id = self.id();
        let req = PutHashedReq {
            region,
            entries: entries.to_vec(),
        };
        frame(Opcode::PutHashed, id, &mut self.sendbuf, |b| req.encode(b));
        self.send_buffered()?;
        Ok(id)
    }

    /// Receive the reply to a PUT_HASHED: which pages the server stored.
    /// A server without a content index answers UNKNOWN_OPCODE (a
    /// [`ClientError::Server`]; the connection stays usable).
    pub fn recv_put_hashed(&mut self, id: u64) -> Result<PutHashedOk> {
        let body = self.expect_reply(id, Opcode::PutHashedOk)?;
        PutHashedOk::decode(&body).map_err(|e| self.proto(e.message))
    }

    /// Queue one GET request (sent by the next `flush` or receive).
    pub fn queue_get(
        &mut self,
        region: u64,
        sel: &PageSel,
        mode: GetMode,
        allow_missing: bool,
    ) -> Result<u64> {
        if sel.is_empty() || sel.len() > MAX_BATCH_PAGES {
            return Err(ClientError::Usage(format!(
                "a GET frame takes 1..={MAX_BATCH_PAGES} pages"
            )));
        }
        let id = self.id();
        let mut f = if mode == GetMode::Take {
            flags::TAKE
        } else {
            0
        };
        if allow_missing {
            f |= flags::ALLOW_MISSING;
        }
        frame(Opcode::Get, id, &mut self.sendbuf, |b| {
            encode_pages_req(region, sel, f, b)
        });
        Ok(id)
    }

    /// Send queued small requests.
    pub fn flush(&mut self) -> Result<()> {
        if self.sendbuf.is_empty() {
            return Ok(());
        }
        self.send_buffered()
    }

    /// Receive a GET reply straight into `dst` (`count` pages); pages the
    /// server did not hold are zero-filled and listed in `missing`.
    pub fn recv_get(&mut self, id: u64, dst: &mut [u8]) -> Result<GetReply> {
        self.flush()?;
        let h = self.read_header()?;
        self.finish_get(h, id, dst)
    }

    /// The rest of a GET reply whose header `h` was read.
    fn finish_get(&mut self, h: Header, id: u64, dst: &mut [u8]) -> Result<GetReply> {
        if h.opcode != Opcode::GetOk as u8 || h.id != id {
            let body = self.read_body(h.body_len as usize)?;
            if h.opcode == Opcode::Error as u8 && h.id != id && h.id != 0 {
                return Err(
                    self.proto(format!("ERROR for request {} while waiting for {id}", h.id))
                );
            }
            return Err(self.unexpected(h, "GET_OK", &body));
        }
        let body_len = h.body_len as usize;
        if body_len < 8 {
            return Err(self.proto("GET_OK body too short"));
        }
        self.rb
            .fill_to(&mut self.stream, 8)
            .map_err(|e| self.io(e))?;
        let count = u32::from_le_bytes(self.rb.available()[..4].try_into().unwrap());
        if count as usize > MAX_BATCH_PAGES {
            return Err(self.proto(format!("GET_OK count {count} exceeds {MAX_BATCH_PAGES}")));
        }
        let hl = GetOkHead::head_len(count);
        self.rb
            .fill_to(&mut self.stream, hl)
            .map_err(|e| self.io(e))?;
        let head = GetOkHead::decode(&self.rb.available()[..hl], body_len)
            .map_err(|e| self.proto(e.message))?;
        self.rb.consume(hl);
        if dst.len() != count as usize * PAGE_SIZE {
            return Err(ClientError::Usage(format!(
                "GET reply has {count} pages but the destination holds {} bytes",
                dst.len()
            )));
        }
        let mut missing = Vec::new();
        {
            // Runs of present pages are contiguous in `dst`: one iovec each.
            let mut iov: Vec<IoSliceMut<'_>> = Vec::with_capacity(head.present as usize);
            let mut rest: &mut [u8] = dst;
            let mut i = 0usize;
            while i < count as usize {
                let mut j = i;
                while j < count as usize && head.is_present(j) == head.is_present(i) {
                    j += 1;
                }
                let (run, tail) = std::mem::take(&mut rest).split_at_mut((j - i) * PAGE_SIZE);
                rest = tail;
                if head.is_present(i) {
                    iov.push(IoSliceMut::new(run));
                } else {
                    run.fill(0);
                    missing.extend(i as u32..j as u32);
                }
                i = j;
            }
            self.rb
                .read_exact_vectored(&mut self.stream, &mut iov)
                .map_err(|e| io_error(&self.addr, self.io_timeout, e))?;
        }
        Ok(GetReply {
            count,
            present: head.present,
            missing,
        })
    }

    // ---- bulk calls ------------------------------------------------------

    /// Store pages (`data` = pages × 4096 bytes) in frames of `batch` pages,
    /// pipelined. Returns how many were new. On an error the frames already
    /// acknowledged stay stored; the first error is returned after every
    /// in-flight reply has been read, so the connection stays usable.
    pub fn put(&mut self, region: u64, pages: Pages<'_>, data: &[u8], batch: usize) -> Result<u64> {
        let n = pages.len();
        if data.len() != n * PAGE_SIZE {
            return Err(ClientError::Usage(format!(
                "{n} pages need {} bytes of data, got {}",
                n * PAGE_SIZE,
                data.len()
            )));
        }
        let batch = batch.clamp(1, MAX_BATCH_PAGES);
        let frames = n.div_ceil(batch);
        let mut inflight = VecDeque::new();
        let (mut sent, mut new_pages, mut first_err) = (0usize, 0u64, None);
        while sent < frames || !inflight.is_empty() {
            while first_err.is_none() && sent < frames && inflight.len() < self.window {
                let sel = pages.frame(sent, batch);
                let lo = sent * batch * PAGE_SIZE;
                let id = self.send_put(region, &sel, &data[lo..lo + sel.len() * PAGE_SIZE])?;
                inflight.push_back(id);
                sent += 1;
            }
            let Some(id) = inflight.pop_front() else {
                break;
            };
            match self.recv_put(id) {
                Ok(ok) => new_pages += ok.new_pages as u64,
                Err(e @ ClientError::Server { .. }) if !e.code().is_some_and(|c| c.is_fatal()) => {
                    first_err.get_or_insert(e);
                }
                Err(e) => return Err(e),
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(new_pages),
        }
    }

    /// Fetch pages into `dst` (pages × 4096 bytes), pipelined. With
    /// `allow_missing`, absent pages are zero-filled and counted; without it,
    /// any absent page fails its frame with NOT_FOUND (nothing of that frame
    /// is taken).
    pub fn get(
        &mut self,
        region: u64,
        pages: Pages<'_>,
        dst: &mut [u8],
        mode: GetMode,
        allow_missing: bool,
        batch: usize,
    ) -> Result<u64> {
        let n = pages.len();
        if dst.len() != n * PAGE_SIZE {
            return Err(ClientError::Usage(format!(
                "{n} pages need {} bytes of room, got {}",
                n * PAGE_SIZE,
                dst.len()
            )));
        }
        let batch = batch.clamp(1, MAX_BATCH_PAGES);
        let frames = n.div_ceil(batch);
        let mut inflight = VecDeque::new();
        let (mut sent, mut done, mut missing, mut first_err) = (0usize, 0usize, 0u64, None);
        while done < sent || sent < frames {
            // Refill the window in batches (half a window per write) rather
            // than one small request write per reply.
            let refill = inflight.len() <= self.window / 2;
            while refill && first_err.is_none() && sent < frames && inflight.len() < self.window {
                let sel = pages.frame(sent, batch);
                let id = self.queue_get(region, &sel, mode, allow_missing)?;
                inflight.push_back((id, sent, sel.len()));
                sent += 1;
            }
            let Some((id, k, len)) = inflight.pop_front() else {
                break;
            };
            let lo = k * batch * PAGE_SIZE;
            match self.recv_get(id, &mut dst[lo..lo + len * PAGE_SIZE]) {
                Ok(r) => missing += r.missing.len() as u64,
                Err(e @ ClientError::Server { .. }) if !e.code().is_some_and(|c| c.is_fatal()) => {
                    first_err.get_or_insert(e);
                }
                Err(e) => return Err(e),
            }
            done += 1;
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(missing),
        }
    }

    /// Delete pages; returns how many the server held.
    pub fn delete(&mut self, region: u64, pages: Pages<'_>) -> Result<u64> {
        let frames: Vec<PageSel> = match pages {
            Pages::Run { first, count } => {
                let mut v = Vec::new();
                let mut at = first;
                let end = first + count;
                while at < end {
                    let c = (end - at).min(u32::MAX as u64);
                    v.push(PageSel::Run {
                        first: at,
                        count: c as u32,
                    });
                    at += c;
                }
                v
            }
            Pages::List(l) => l
                .chunks(MAX_DELETE_LIST)
                .map(|c| PageSel::List(c.to_vec()))
                .collect(),
        };
        let mut total = 0;
        for sel in frames {
            let id = self.id();
            frame(Opcode::Delete, id, &mut self.sendbuf, |b| {
                encode_pages_req(region, &sel, 0, b)
            });
            self.send_buffered()?;
            let body = self.expect_reply(id, Opcode::DeleteOk)?;
            total += DeleteOk::decode(&body)
                .map_err(|e| self.proto(e.message))?
                .deleted;
        }
        Ok(total)
    }

    /// Have this server store `pages` of `region` (it holds them) on the
    /// server at `target`, whose id must be `target_id`; returns how many
    /// were stored there. A failure on the other server's side is a
    /// `PEER_FAILED` server error; this connection stays usable.
    ///
    /// Any number of pages: they go in PUSH frames of up to
    /// `MAX_PUSH_PAGES`, all sent before the first reply is read (the
    /// server works through them back to back). The first error is
    /// returned after every reply was read.
    pub fn push(
        &mut self,
        region: u64,
        target_id: u64,
        target: &str,
        pages: &[u64],
    ) -> Result<u64> {
        let ids = self.send_push(region, target_id, target, pages)?;
        self.recv_push(ids)
    }

    /// The sending half of [`Conn::push`]: every PUSH frame sent, no reply
    /// read, so pushes on several connections (several servers holding the
    /// pages) run at once. Finish with [`Conn::recv_push`].
    pub fn send_push(
        &mut self,
        region: u64,
        target_id: u64,
        target: &str,
        pages: &[u64],
    ) -> Result<PushIds> {
        if pages.is_empty() || target.is_empty() || target.len() > 255 {
            return Err(ClientError::Usage(format!(
                "a PUSH takes pages and a target of 1..=255 bytes ({} pages, {:?})",
                pages.len(),
                target
            )));
        }
        let mut ids = Vec::new();
        for part in pages.chunks(pagefleet_proto::MAX_PUSH_PAGES) {
            let id = self.id();
            let req = pagefleet_proto::PushReq {
                region,
                target_id,
                target: target.to_string(),
                pages: part.to_vec(),
            };
            frame(Opcode::Push, id, &mut self.sendbuf, |b| req.encode(b));
            ids.push(id);
        }
        self.send_buffered()?;
        Ok(PushIds(ids))
    }

    /// The replies to [`Conn::send_push`]'s frames: how many pages were
    /// stored, or the first error once every reply was read.
    pub fn recv_push(&mut self, ids: PushIds) -> Result<u64> {
        let (mut pushed, mut first) = (0, None);
        for id in ids.0 {
            match self.expect_reply(id, Opcode::PushOk) {
                Ok(body) => {
                    pushed += pagefleet_proto::PushOk::decode(&body)
                        .map_err(|e| self.proto(e.message))?
                        .pushed
                }
                Err(e @ ClientError::Server { .. }) if !e.code().is_some_and(|c| c.is_fatal()) => {
                    first.get_or_insert(e);
                }
                Err(e) => return Err(e),
            }
        }
        match first {
            Some(e) => Err(e),
            None => Ok(pushed),
        }
    }

    /// Drop a whole region; returns how many pages it had here.
    pub fn delete_region(&mut self, region: u64) -> Result<u64> {
        let id = self.id();
        frame(Opcode::Delete, id, &mut self.sendbuf, |b| {
            PagesPrefix {
                region,
                count: 0,
                flags: flags::WHOLE_REGION,
            }
            .encode(b)
        });
        self.send_buffered()?;
        let body = self.expect_reply(id, Opcode::DeleteOk)?;
        Ok(DeleteOk::decode(&body)
            .map_err(|e| self.proto(e.message))?
            .deleted)
    }
}

/// Connections to several memory servers.
pub struct Cluster {
    /// One connection per server, in the order given.
    pub conns: Vec<Conn>,
}

impl Cluster {
    /// Connect to every server in `addrs`.
    pub fn connect(addrs: &[String], secret: &Secret, opts: &ConnectOptions) -> Result<Cluster> {
        let conns = addrs
            .iter()
            .map(|a| Conn::connect(a, secret, opts))
            .collect::<Result<Vec<_>>>()?;
        Ok(Cluster { conns })
    }
    /// STAT every server (regions not listed).
    pub fn stats(&mut self) -> Vec<Result<StatOk>> {
        self.conns.iter_mut().map(|c| c.stat(false)).collect()
    }
    /// Index of the server with the most free pages.
    pub fn most_free(&mut self) -> Result<usize> {
        let mut best = None;
        for (i, c) in self.conns.iter_mut().enumerate() {
            let s = c.stat(false)?;
            let free = s.capacity_pages.saturating_sub(s.used_pages);
            if best.is_none_or(|(_, f)| free > f) {
                best = Some((i, free));
            }
        }
        best.map(|(i, _)| i)
            .ok_or_else(|| ClientError::Usage("no memory servers configured".into()))
    }
}
