//! The protocol-v1 connection loop.
//!
//! One thread per connection, blocking I/O; the store lock is only taken for
//! index updates, so a slow or dead client stalls nobody but itself. Replies
//! are queued and flushed when the next read would block (or when the last
//! read came back short: the client had sent nothing more), so a pipelined
//! stream of requests gets its small replies in few syscalls; GET replies are
//! written with one vectored write straight from the store's slots.

use crate::content::LocalContent;
use crate::metrics::Metrics;
use crate::store::{PutTarget, Store, StoreError};
use pagefleet_proto::auth::{self, Secret};
use pagefleet_proto::io::{write_all_vectored, ReadAll, RecvBuf};
use pagefleet_proto::*;
use pagefleet_tls::handshake::{Challenge, HelloProof, TlsOffer};
use pagefleet_tls::Stream;
use std::collections::HashMap;
use std::io::{self, IoSlice, IoSliceMut, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tracing::{debug, info, warn};

/// How the server treats its clients.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Most simultaneous authenticated sessions; more are refused with BUSY
    /// (only after they authenticated: strangers learn nothing).
    pub max_conns: u32,
    /// A frame (request or reply) not completed within this long drops the
    /// connection.
    pub io_timeout: Duration,
    /// Most connections waiting to authenticate; a new one beyond this
    /// drops the oldest waiting one.
    pub max_handshakes: u32,
    /// A connection that has not authenticated within this long is dropped.
    pub handshake_timeout: Duration,
    /// This server's TLS identity: clients may STARTTLS, and those not on
    /// loopback must (none: plaintext only).
    pub tls: Option<Arc<pagefleet_tls::Identity>>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            max_conns: 512,
            io_timeout: Duration::from_secs(30),
            max_handshakes: 1024,
            handshake_timeout: Duration::from_secs(5),
            tls: None,
        }
    }
}

/// Everything the server's connections share.
pub struct ServerState {
    /// The pages.
    pub store: Store,
    /// The cluster secret clients must prove.
    pub secret: Secret,
    /// Random per process: a client seeing a new id knows the server restarted
    /// and lost whatever it held.
    pub server_id: u64,
    /// Its counters.
    pub metrics: Metrics,
    /// Its settings.
    pub cfg: ServerConfig,
    conns: AtomicU32,
    /// Handing over to the next process: the gate takes no connection and
    /// drops those waiting; sessions are being ended.
    quiet: AtomicBool,
    /// A second handle on each session's socket, to end it from outside
    /// (`quiesce`); keyed by a number the session removes itself by.
    sockets: Mutex<HashMap<u64, TcpStream>>,
    next_socket: AtomicU64,
    /// Where PUT_HASHED finds pages (none: PUT_HASHED is refused, and the
    /// client sends the data).
    content: std::sync::OnceLock<Arc<dyn LocalContent>>,
}

impl ServerState {
    /// Prometheus text for this server (`GET /metrics`).
    pub fn render_metrics(&self) -> String {
        crate::metrics::render(&self.metrics, &self.store.stats(1000), self.connections())
    }

    /// A server over `store`, accepting clients that hold `secret`.
    pub fn new(store: Store, secret: Secret, cfg: ServerConfig) -> ServerState {
        Self::with_id(store, secret, cfg, auth::random_u64())
    }

    /// A server that goes on as `server_id`: a store handed over by the
    /// previous process of an in-place restart, whose clients reconnect
    /// and find the same server with the same pages.
    pub fn with_id(store: Store, secret: Secret, cfg: ServerConfig, server_id: u64) -> ServerState {
        ServerState {
            store,
            secret,
            server_id,
            metrics: Metrics::default(),
            cfg,
            conns: AtomicU32::new(0),
            quiet: AtomicBool::new(false),
            sockets: Mutex::new(HashMap::new()),
            next_socket: AtomicU64::new(0),
            content: std::sync::OnceLock::new(),
        }
    }

    /// Stop taking connections and end every session (each client sees
    /// its connection close and reconnects, to the next process once it
    /// listens on the inherited socket). True once no session is left,
    /// within `wait`; false: some still run (`resume` to serve again).
    /// A session ended mid-request loses nothing: a PUT not committed is
    /// not stored, a take not delivered is put back.
    pub fn quiesce(&self, wait: Duration) -> bool {
        self.quiet.store(true, Relaxed);
        let until = Instant::now() + wait;
        loop {
            for s in lock(&self.sockets).values() {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
            if lock(&self.sockets).is_empty() && self.connections() == 0 {
                return true;
            }
            if Instant::now() >= until {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Take connections again (a handover given up).
    pub fn resume(&self) {
        self.quiet.store(false, Relaxed);
    }

    /// Handing over: take no connection now.
    pub(crate) fn quiet(&self) -> bool {
        self.quiet.load(Relaxed)
    }

    /// Keep a handle on a session's socket until the session ends.
    pub(crate) fn track(&self, sock: &TcpStream) -> Option<u64> {
        let dup = sock.try_clone().ok()?;
        let k = self.next_socket.fetch_add(1, Relaxed);
        lock(&self.sockets).insert(k, dup);
        Some(k)
    }

    pub(crate) fn untrack(&self, k: Option<u64>) {
        if let Some(k) = k {
            lock(&self.sockets).remove(&k);
        }
    }

    /// Serve PUT_HASHED from `content` from now on (once; later calls are ignored).
    pub fn set_content(&self, content: Arc<dyn LocalContent>) {
        let _ = self.content.set(content);
    }
    /// Authenticated sessions open now.
    pub fn connections(&self) -> u32 {
        self.conns.load(Relaxed)
    }

    /// Count one more session if there is room for it.
    pub(crate) fn try_admit(&self) -> bool {
        self.conns
            .fetch_update(Relaxed, Relaxed, |n| {
                (n < self.cfg.max_conns).then_some(n + 1)
            })
            .is_ok()
    }

    /// A session ended.
    pub(crate) fn release(&self) {
        self.conns.fetch_sub(1, Relaxed);
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A byte stream the server can run a session on.
pub trait Transport: ReadAll + Write {
    /// Read without blocking: `Ok(None)` when nothing is available now.
    fn read_nonblocking(&mut self, buf: &mut [u8]) -> io::Result<Option<usize>>;
    /// Reads and writes from now on fail with `TimedOut` after `deadline`
    /// (`None`: no deadline). Transports without timeouts ignore it.
    fn set_deadline(&mut self, _deadline: Option<Instant>) {}
}

impl Transport for TcpStream {
    fn read_nonblocking(&mut self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        let e = match pagefleet_proto::sys::recv(self, buf, libc::MSG_DONTWAIT) {
            Ok(n) => return Ok(Some(n)),
            Err(e) => e,
        };
        match e.kind() {
            io::ErrorKind::WouldBlock => Ok(None),
            io::ErrorKind::Interrupted => Ok(None),
            _ => Err(e),
        }
    }
}

/// Run one authenticated connection to completion (the gate has admitted it
/// and counted it in `connections`; released here).
pub(crate) fn serve_authenticated(
    st: &ServerState,
    stream: Stream,
    peer: &str,
    client: String,
    extra: &[u8],
) {
    struct Release<'a>(&'a ServerState, Option<u64>);
    impl Drop for Release<'_> {
        fn drop(&mut self) {
            self.0.untrack(self.1);
            self.0.release();
        }
    }
    let _release = Release(st, st.track(stream.socket()));
    if st.quiet() {
        return;
    }
    if stream.socket().set_nonblocking(false).is_err() {
        return;
    }
    // The gate's last reply (HELLO_OK) may still sit in the TLS buffer.
    if (&stream).flush().is_err() {
        return;
    }
    let ka = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(30))
        .with_interval(Duration::from_secs(10));
    let _ = socket2::SockRef::from(stream.socket()).set_tcp_keepalive(&ka);
    let mut t = FrameStream::new(stream, st.cfg.io_timeout);
    debug!(peer, client, "session started");
    let mut s = Session::new(st, &mut t, peer);
    s.authenticated(client);
    s.preload(extra);
    match s.run() {
        Ok(()) => debug!(peer, "closed"),
        Err(e) => info!(peer, "connection ended: {e}"),
    }
}

/// A connection (plain or TLS) whose reads and writes give up at a deadline
/// that holds for a whole frame, not per system call: a client that sends
/// one byte every few seconds is dropped when the frame's time is up.
/// Between frames (no deadline) an idle client may wait forever.
pub struct FrameStream {
    s: Stream,
    deadline: Option<Instant>,
    /// The socket timeout set now (both directions).
    set: Option<Duration>,
    idle: Duration,
}

impl FrameStream {
    /// `idle` is the socket timeout between frames (the session just loops on it).
    pub fn new(s: Stream, idle: Duration) -> FrameStream {
        FrameStream {
            s,
            deadline: None,
            set: None,
            idle,
        }
    }

    /// Arm the socket timeout for the next system call.
    fn arm(&mut self) -> io::Result<()> {
        let want = match self.deadline {
            None => self.idle,
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "frame not completed within the I/O timeout",
                    ));
                }
                left
            }
        };
        // One setsockopt per change of more than 50 ms: fast frames keep the
        // timeout they have; a slow one tightens it as its deadline nears.
        let stale = self
            .set
            .is_none_or(|s| s.abs_diff(want) > Duration::from_millis(50));
        if stale {
            self.s.socket().set_read_timeout(Some(want))?;
            self.s.socket().set_write_timeout(Some(want))?;
            self.set = Some(want);
        }
        Ok(())
    }
}

impl io::Read for FrameStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.arm()?;
        (&self.s).read(buf)
    }
}

impl ReadAll for FrameStream {
    fn read_vectored_all(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        self.arm()?;
        self.s.read_vectored_all(bufs)
    }
}

impl Write for FrameStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.arm()?;
        (&self.s).write(buf)
    }
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.arm()?;
        (&self.s).write_vectored(bufs)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Transport for FrameStream {
    fn read_nonblocking(&mut self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        self.s.read_nonblocking(buf)
    }
    fn set_deadline(&mut self, deadline: Option<Instant>) {
        self.deadline = deadline;
    }
}

/// Longest HELLO body: nonce, MAC, version and a name of at most MAX_NAME bytes.
pub(crate) const MAX_HELLO_BODY: usize = 72 + MAX_NAME + 1;

/// Check a HELLO body against the nonce this server sent: the reply to send
/// and the client's name, or the error to answer before closing.
pub(crate) fn check_hello(
    st: &ServerState,
    ch: &Challenge,
    body: &[u8],
    peer: &str,
) -> Result<(HelloOk, String), WireError> {
    let hello = Hello::decode(body)?;
    if hello.version != VERSION as u16 {
        return Err(WireError::new(
            ErrorCode::UnsupportedVersion,
            format!("client asks for version {}, server speaks 1", hello.version),
        ));
    }
    let proof = HelloProof {
        client_nonce: hello.client_nonce,
        mac: hello.mac,
    };
    let Some(mac) = ch.accept(&st.secret, &proof) else {
        st.metrics.auth_failures.fetch_add(1, Relaxed);
        info!(peer, client = %hello.name, "authentication failed");
        return Err(WireError::new(
            ErrorCode::AuthFailed,
            "authentication failed: the client does not hold this cluster's secret",
        ));
    };
    debug!(peer, client = %hello.name, "authenticated");
    let ok = HelloOk {
        mac,
        server_id: st.server_id,
        capacity_pages: st.store.capacity_pages(),
        used_pages: st.store.stored_pages(),
        page_size: PAGE_SIZE as u32,
        max_batch_pages: MAX_BATCH_PAGES as u32,
    };
    Ok((ok, hello.name))
}

/// The WELCOME frame that opens every connection: this connection's
/// challenge and what the server says about TLS
/// (`pagefleet_tls::handshake`, the opening both protocols run).
pub(crate) fn welcome(ch: &Challenge, offer: TlsOffer, out: &mut Vec<u8>) {
    let w = Welcome {
        min_version: 1,
        max_version: 1,
        flags: offer.bits() as u32,
        server_nonce: ch.server_nonce,
        server_id: ch.id,
    };
    frame(Opcode::Welcome, 0, out, |b| w.encode(b));
}

/// Bytes read past the current need: many pipelined small requests per
/// syscall, but at most this much PUT data copied out of the buffer per frame.
const READ_AHEAD: usize = PAGE_SIZE + 64;
/// Flush queued replies after this many request bytes even if more requests
/// are waiting (keeps a pipelining client's window moving).
const FLUSH_AFTER_BYTES: usize = 256 * 1024;

enum Flow {
    Continue,
    Close,
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// One client connection's state.
pub struct Session<'a, T: Transport> {
    st: &'a ServerState,
    t: &'a mut T,
    rb: RecvBuf,
    out: Vec<u8>,
    body: Vec<u8>,
    staging: Vec<u8>,
    authed: bool,
    ch: Challenge,
    peer: &'a str,
    client: String,
    since_flush: usize,
    /// When the frame being read must be complete.
    frame_deadline: Option<Instant>,
    /// This session counted as connected under its client's name (the
    /// regions that client created are in use, never orphans).
    connected: Option<u32>,
    /// Connections to other servers this session pushed pages to.
    peers: crate::push::Peers,
}

impl<T: Transport> Drop for Session<'_, T> {
    fn drop(&mut self) {
        if let Some(id) = self.connected.take() {
            self.st.store.disconnect(id);
        }
    }
}

impl<'a, T: Transport> Session<'a, T> {
    /// A session on transport `t` from `peer`.
    pub fn new(st: &'a ServerState, t: &'a mut T, peer: &'a str) -> Session<'a, T> {
        let mut rb = RecvBuf::new(16 * 1024);
        rb.set_read_max(READ_AHEAD);
        Session {
            st,
            t,
            rb,
            out: Vec::with_capacity(4096),
            body: Vec::new(),
            staging: Vec::new(),
            authed: false,
            ch: Challenge::fresh(st.server_id),
            peer,
            client: String::new(),
            since_flush: 0,
            frame_deadline: None,
            connected: None,
            peers: Default::default(),
        }
    }

    /// For the fuzzer: a session that skips the HMAC handshake, so fuzzing
    /// reaches the page operations. Not reachable from the network.
    pub fn new_preauthenticated(st: &'a ServerState, t: &'a mut T) -> Session<'a, T> {
        let mut s = Session::new(st, t, "fuzz");
        s.authed = true;
        s
    }

    /// Bytes the gate read past the HELLO: the start of the first requests.
    fn preload(&mut self, extra: &[u8]) {
        let n = extra.len().min(self.rb.spare().len());
        self.rb.spare()[..n].copy_from_slice(&extra[..n]);
        self.rb.commit(n);
    }

    /// Serve until the peer closes, a fatal error is answered, or I/O fails.
    pub fn run(mut self) -> io::Result<()> {
        if !self.authed {
            welcome(&self.ch, TlsOffer::default(), &mut self.out);
            self.flush()?;
        }
        loop {
            if !self.next_header()? {
                return self.flush();
            }
            let h = match Header::decode(&self.rb.available()[..HEADER_LEN]) {
                Ok(h) => h,
                Err(e) => {
                    self.fatal(e);
                    return Ok(());
                }
            };
            self.rb.consume(HEADER_LEN);
            self.st
                .metrics
                .bytes_in
                .fetch_add((HEADER_LEN + h.body_len as usize) as u64, Relaxed);
            self.since_flush += HEADER_LEN + h.body_len as usize;
            let flow = self.dispatch(h)?;
            self.frame_deadline = None;
            self.t.set_deadline(None);
            match flow {
                Flow::Continue => {}
                Flow::Close => return Ok(()),
            }
            // Replies wait for the next would-block, but not so long that a
            // client streaming big frames drains its whole window first.
            if self.since_flush >= FLUSH_AFTER_BYTES || self.out.len() >= 64 * 1024 {
                self.flush()?;
            }
        }
    }

    /// Make a whole header available. Pending replies are flushed only when
    /// the next read would block. Returns false on a clean close.
    fn next_header(&mut self) -> io::Result<bool> {
        while self.rb.len() < HEADER_LEN {
            if !self.rb.is_empty() {
                self.frame_started();
            }
            // The last read came back short: the client had sent nothing
            // more then, so a non-blocking read now would most likely
            // only say so (one wasted syscall per request when a pager
            // waits on each reply). Flush at once; anything that arrives
            // meanwhile is read next, its reply sent on its own.
            if !self.out.is_empty() && self.rb.drained() {
                self.flush()?;
            }
            if !self.out.is_empty() {
                match self.t.read_nonblocking(self.rb.spare()) {
                    Ok(Some(0)) => {
                        if self.rb.is_empty() {
                            return Ok(false);
                        }
                        return Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "peer closed mid-frame",
                        ));
                    }
                    Ok(Some(n)) => {
                        self.rb.commit(n);
                        continue;
                    }
                    Ok(None) => self.flush()?,
                    Err(e) => return Err(e),
                }
            }
            let want = self.rb.len() + 1;
            match self.rb.fill_to(self.t, want) {
                Ok(true) => {}
                Ok(false) => return Ok(false),
                // Idle between frames is fine; only a stall mid-frame is not.
                Err(e) if is_timeout(&e) && self.rb.is_empty() => {}
                Err(e) => return Err(e),
            }
        }
        self.frame_started();
        Ok(true)
    }

    /// The first bytes of a frame are here: the rest must follow within the I/O timeout.
    fn frame_started(&mut self) {
        if self.frame_deadline.is_none() {
            let d = Instant::now() + self.st.cfg.io_timeout;
            self.frame_deadline = Some(d);
            self.t.set_deadline(Some(d));
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        self.since_flush = 0;
        if !self.out.is_empty() {
            // Replies too must be taken within the I/O timeout, whole.
            if self.frame_deadline.is_none() {
                self.t
                    .set_deadline(Some(Instant::now() + self.st.cfg.io_timeout));
            }
            self.st
                .metrics
                .bytes_out
                .fetch_add(self.out.len() as u64, Relaxed);
            let r = self.t.write_all(&self.out).and_then(|_| self.t.flush());
            self.out.clear();
            self.t.set_deadline(self.frame_deadline);
            r?;
        }
        Ok(())
    }

    fn reply_error(&mut self, e: &WireError, id: u64) {
        self.st.metrics.error(e.code);
        frame(Opcode::Error, id, &mut self.out, |b| e.encode(b));
    }

    /// Answer a fatal error and close.
    fn fatal(&mut self, e: WireError) -> Flow {
        warn!(peer = self.peer, client = %self.client, "closing connection: {e}");
        let id = e.id;
        self.reply_error(&e, id);
        let _ = self.flush();
        Flow::Close
    }

    fn read_body(&mut self, len: usize) -> io::Result<()> {
        self.body.resize(len, 0);
        self.rb.read_exact_into(self.t, &mut self.body)
    }

    fn dispatch(&mut self, h: Header) -> io::Result<Flow> {
        let op = Opcode::from_u8(h.opcode);
        if let Some(op) = op {
            self.st.metrics.request(op);
        }
        let len = h.body_len as usize;
        match op {
            Some(Opcode::Hello) => self.hello(h),
            _ if !self.authed => Ok(self.fatal(
                WireError::new(
                    ErrorCode::NotAuthenticated,
                    "authenticate with HELLO before any other request",
                )
                .with_id(h.id),
            )),
            Some(Opcode::Put) => self.put(h),
            Some(Opcode::Get) => self.get(h),
            Some(Opcode::Delete) => self.delete(h),
            Some(Opcode::Stat) => self.stat(h),
            Some(Opcode::PutHashed) => self.put_hashed(h),
            Some(Opcode::Push) => self.push(h),
            Some(Opcode::Ping) => {
                if len > MAX_PING {
                    return Ok(self.fatal(
                        WireError::malformed(format!(
                            "PING body of {len} bytes exceeds {MAX_PING}"
                        ))
                        .with_id(h.id),
                    ));
                }
                self.read_body(len)?;
                let body = std::mem::take(&mut self.body);
                frame(Opcode::Pong, h.id, &mut self.out, |b| {
                    b.extend_from_slice(&body)
                });
                self.body = body;
                Ok(Flow::Continue)
            }
            _ => {
                self.rb.skip(self.t, len)?;
                let e = WireError::new(
                    ErrorCode::UnknownOpcode,
                    format!("opcode {:#04x} is not a request", h.opcode),
                );
                self.reply_error(&e, h.id);
                Ok(Flow::Continue)
            }
        }
    }

    fn hello(&mut self, h: Header) -> io::Result<Flow> {
        if self.authed {
            return Ok(self.fatal(
                WireError::new(ErrorCode::ProtocolViolation, "HELLO sent twice").with_id(h.id),
            ));
        }
        if h.body_len as usize > MAX_HELLO_BODY {
            return Ok(self.fatal(WireError::malformed("HELLO body too long").with_id(h.id)));
        }
        self.read_body(h.body_len as usize)?;
        match check_hello(self.st, &self.ch, &self.body, self.peer) {
            Ok((ok, name)) => {
                self.authenticated(name);
                frame(Opcode::HelloOk, h.id, &mut self.out, |b| ok.encode(b));
                Ok(Flow::Continue)
            }
            Err(e) => Ok(self.fatal(e.with_id(h.id))),
        }
    }

    /// Authenticated as `client`: counted as connected under its name.
    fn authenticated(&mut self, client: String) {
        self.authed = true;
        if self.connected.is_none() {
            self.connected = Some(self.st.store.connect(&client));
        }
        self.client = client;
    }

    fn store_error(&mut self, e: StoreError, id: u64) {
        let w = match e {
            StoreError::OutOfCapacity { free, .. } => {
                WireError::new(ErrorCode::OutOfCapacity, e.to_string()).with_detail(free)
            }
            StoreError::NotFound { page, .. } => {
                WireError::new(ErrorCode::NotFound, e.to_string()).with_detail(page)
            }
            StoreError::DuplicateTake { .. } => {
                WireError::new(ErrorCode::InvalidArgument, e.to_string())
            }
            _ => WireError::new(ErrorCode::Internal, e.to_string()),
        };
        self.reply_error(&w, id);
    }

    fn put(&mut self, h: Header) -> io::Result<Flow> {
        let len = h.body_len as usize;
        if len < PagesPrefix::LEN {
            return Ok(self.fatal(
                WireError::malformed("PUT body shorter than its 16-byte prefix").with_id(h.id),
            ));
        }
        if !self.rb.fill_to(self.t, PagesPrefix::LEN)? {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "peer closed mid-frame",
            ));
        }
        let prefix =
            match PagesPrefix::decode(Opcode::Put, &self.rb.available()[..PagesPrefix::LEN]) {
                Ok(p) => p,
                Err(e) => return Ok(self.fatal(e.with_id(h.id))),
            };
        self.rb.consume(PagesPrefix::LEN);
        let n = prefix.count as usize;
        let data_len = n * PAGE_SIZE;
        if len != PagesPrefix::LEN + prefix.desc_len() + data_len {
            return Ok(self.fatal(
                WireError::malformed(format!(
                    "PUT body is {len} bytes, but {n} pages need {}",
                    PagesPrefix::LEN + prefix.desc_len() + data_len
                ))
                .with_id(h.id),
            ));
        }
        self.read_body(prefix.desc_len())?;
        let sel = match prefix.decode_sel(&self.body) {
            Ok(s) => s,
            Err(e) => {
                self.rb.skip(self.t, data_len)?;
                if e.code.is_fatal() {
                    return Ok(self.fatal(e.with_id(h.id)));
                }
                self.reply_error(&e, h.id);
                return Ok(Flow::Continue);
            }
        };
        let store = &self.st.store;
        let plan = match store.begin_put(prefix.region, &sel) {
            Ok(p) => p,
            Err(e) => {
                self.rb.skip(self.t, data_len)?;
                self.store_error(e, h.id);
                return Ok(Flow::Continue);
            }
        };
        if plan.targets.contains(&PutTarget::Overwrite) && self.staging.len() < data_len {
            self.staging.resize(MAX_BATCH_PAGES * PAGE_SIZE, 0);
        }
        let read = {
            let mut staging = self.staging.chunks_mut(PAGE_SIZE);
            // Destination of each page: its fresh slot, or its staging page.
            let mut ptrs: Vec<*mut u8> = Vec::with_capacity(n);
            for t in &plan.targets {
                let st = staging.next().map(|c| c.as_mut_ptr());
                ptrs.push(match *t {
                    // SAFETY: fresh slots are reserved for this plan alone.
                    PutTarget::Fresh(s) => unsafe { store.fresh_slot_mut(s) }.as_mut_ptr(),
                    PutTarget::Overwrite => st.expect("staging sized for the frame"),
                });
            }
            // Adjacent destinations become one iovec (fewer, longer copies).
            let mut iov: Vec<IoSliceMut<'_>> = Vec::with_capacity(n);
            let mut i = 0;
            while i < n {
                let mut j = i + 1;
                while j < n && ptrs[j] == ptrs[j - 1].wrapping_add(PAGE_SIZE) {
                    j += 1;
                }
                // SAFETY: pages i..j are adjacent, each owned by this frame.
                iov.push(IoSliceMut::new(unsafe {
                    std::slice::from_raw_parts_mut(ptrs[i], (j - i) * PAGE_SIZE)
                }));
                i = j;
            }
            self.rb.read_exact_vectored(self.t, &mut iov)
        };
        if let Err(e) = read {
            store.abort_put(plan);
            return Err(e);
        }
        match store.commit_put(plan, &sel, &self.staging, &self.client) {
            Ok((stored, new_pages)) => {
                self.st.metrics.pages_put.fetch_add(stored as u64, Relaxed);
                let ok = PutOk { stored, new_pages };
                frame(Opcode::PutOk, h.id, &mut self.out, |b| ok.encode(b));
            }
            Err(e) => self.store_error(e, h.id),
        }
        Ok(Flow::Continue)
    }

    /// Read and decode a GET/DELETE body of bounded size.
    /// Read a request body of at most `max` bytes and decode it: a body
    /// over the limit or a fatal decode error ends the session, a
    /// non-fatal one is answered and the session goes on (`Err(flow)`).
    fn request<R>(
        &mut self,
        h: Header,
        what: &str,
        max: usize,
        decode: fn(&[u8]) -> Result<R, WireError>,
    ) -> io::Result<Result<R, Flow>> {
        let len = h.body_len as usize;
        if len > max {
            return Ok(Err(self.fatal(
                WireError::malformed(format!("{what} body of {len} bytes exceeds {max}"))
                    .with_id(h.id),
            )));
        }
        self.read_body(len)?;
        match decode(&self.body) {
            Ok(r) => Ok(Ok(r)),
            Err(e) if e.code.is_fatal() => Ok(Err(self.fatal(e.with_id(h.id)))),
            Err(e) => {
                self.reply_error(&e, h.id);
                Ok(Err(Flow::Continue))
            }
        }
    }

    fn pages_req(
        &mut self,
        op: Opcode,
        h: Header,
        max: usize,
    ) -> io::Result<Result<PagesReq, Flow>> {
        let len = h.body_len as usize;
        if len > max {
            return Ok(Err(self.fatal(
                WireError::malformed(format!("{} body of {len} bytes exceeds {max}", op.name()))
                    .with_id(h.id),
            )));
        }
        self.read_body(len)?;
        match PagesReq::decode(op, &self.body) {
            Ok(r) => Ok(Ok(r)),
            Err(e) if e.code.is_fatal() => Ok(Err(self.fatal(e.with_id(h.id)))),
            Err(e) => {
                self.reply_error(&e, h.id);
                Ok(Err(Flow::Continue))
            }
        }
    }

    /// PUSH: store pages held here on another server ([`crate::push`]).
    fn push(&mut self, h: Header) -> io::Result<Flow> {
        let req = match self.request(h, "PUSH", PushReq::MAX_LEN, PushReq::decode)? {
            Ok(r) => r,
            Err(flow) => return Ok(flow),
        };
        let sel = PageSel::List(req.pages.clone());
        let store = &self.st.store;
        let plan = match store.begin_get(req.region, &sel, false, false) {
            Ok(p) => p,
            Err(e) => {
                self.store_error(e, h.id);
                return Ok(Flow::Continue);
            }
        };
        let ptrs: Vec<*const u8> = plan
            .slots
            .iter()
            .flatten()
            // SAFETY: the slots are pinned by the plan until end_get.
            .map(|s| unsafe { store.slot(*s) }.as_ptr())
            .collect();
        // The replies queued so far go first: the push may take a while.
        self.flush()?;
        // SAFETY: as above; the plan ends after the push.
        let r = unsafe {
            self.peers
                .push(self.st.server_id, &self.st.secret, &req, &ptrs)
        };
        store.end_get(plan, &sel, true);
        match r {
            Ok(pushed) => {
                self.st.metrics.pages_pushed.fetch_add(pushed, Relaxed);
                frame(Opcode::PushOk, h.id, &mut self.out, |b| {
                    PushOk { pushed }.encode(b)
                });
            }
            Err(msg) => {
                debug!("push for {}: {msg}", self.client);
                self.reply_error(&WireError::new(ErrorCode::PeerFailed, msg), h.id);
            }
        }
        Ok(Flow::Continue)
    }

    /// GET replies up to this many page bytes are copied into the output
    /// buffer (a copy of 16 KiB costs less than the write it saves);
    /// larger ones go out at once, vectored from the store.
    const SMALL_GET: usize = 16 << 10;

    fn get(&mut self, h: Header) -> io::Result<Flow> {
        let req = match self.pages_req(Opcode::Get, h, PagesPrefix::LEN + MAX_BATCH_PAGES * 8)? {
            Ok(r) => r,
            Err(flow) => return Ok(flow),
        };
        let take = req.prefix.flags & flags::TAKE != 0;
        let allow_missing = req.prefix.flags & flags::ALLOW_MISSING != 0;
        let store = &self.st.store;
        let plan = match store.begin_get(req.prefix.region, &req.sel, take, allow_missing) {
            Ok(p) => p,
            Err(e) => {
                self.store_error(e, h.id);
                return Ok(Flow::Continue);
            }
        };
        let count = req.sel.len() as u32;
        let present = plan.present() as u32;
        let mut bitmap = vec![0u8; GetOkHead::bitmap_len(count)];
        for (i, s) in plan.slots.iter().enumerate() {
            if s.is_some() {
                bitmap[i / 8] |= 1 << (i % 8);
            }
        }
        let head = GetOkHead {
            count,
            present,
            bitmap,
        };
        let body_len = GetOkHead::head_len(count) + present as usize * PAGE_SIZE;
        let mut meta = Vec::with_capacity(HEADER_LEN + head.bitmap.len() + 8);
        meta.extend_from_slice(&Header::new(Opcode::GetOk, body_len, h.id).encode());
        head.encode(&mut meta);
        let total = self.out.len() + meta.len() + present as usize * PAGE_SIZE;
        if !take && present as usize * PAGE_SIZE <= Self::SMALL_GET {
            // A small reply joins the others in the output buffer (sent
            // when the next read would block): a burst of 4 KiB reads is
            // one write, not one each. Not for TAKE: its pages are gone
            // only once the reply is out.
            self.out.extend_from_slice(&meta);
            for s in plan.slots.iter().flatten() {
                // SAFETY: the slots are pinned by this plan (keep).
                self.out.extend_from_slice(unsafe { store.slot(*s) });
            }
            self.st.metrics.pages_got.fetch_add(present as u64, Relaxed);
            store.end_get(plan, &req.sel, true);
            return Ok(Flow::Continue);
        }
        let res = {
            let mut iov: Vec<IoSlice<'_>> = Vec::with_capacity(2 + present as usize);
            iov.push(IoSlice::new(&self.out));
            iov.push(IoSlice::new(&meta));
            // SAFETY: the slots are pinned (keep) or taken by this plan.
            let ptrs: Vec<*const u8> = plan
                .slots
                .iter()
                .flatten()
                .map(|s| unsafe { store.slot(*s) }.as_ptr())
                .collect();
            let mut i = 0;
            while i < ptrs.len() {
                let mut j = i + 1;
                while j < ptrs.len() && ptrs[j] == ptrs[j - 1].wrapping_add(PAGE_SIZE) {
                    j += 1;
                }
                // SAFETY: adjacent slots of this plan.
                iov.push(IoSlice::new(unsafe {
                    std::slice::from_raw_parts(ptrs[i], (j - i) * PAGE_SIZE)
                }));
                i = j;
            }
            write_all_vectored(self.t, &mut iov)
        };
        self.out.clear();
        self.st.metrics.bytes_out.fetch_add(total as u64, Relaxed);
        self.st.metrics.pages_got.fetch_add(present as u64, Relaxed);
        if take && res.is_ok() {
            self.st
                .metrics
                .pages_taken
                .fetch_add(present as u64, Relaxed);
        }
        store.end_get(plan, &req.sel, res.is_ok());
        res.map(|_| Flow::Continue)
    }

    fn delete(&mut self, h: Header) -> io::Result<Flow> {
        let req = match self.pages_req(Opcode::Delete, h, PagesPrefix::LEN + MAX_DELETE_LIST * 8)? {
            Ok(r) => r,
            Err(flow) => return Ok(flow),
        };
        let whole = req.prefix.flags & flags::WHOLE_REGION != 0;
        let deleted = self
            .st
            .store
            .delete(req.prefix.region, if whole { None } else { Some(&req.sel) });
        frame(Opcode::DeleteOk, h.id, &mut self.out, |b| {
            DeleteOk { deleted }.encode(b)
        });
        Ok(Flow::Continue)
    }

    /// Store the pages of a PUT_HASHED this host holds (found and checked by
    /// the content provider), and say which.
    fn put_hashed(&mut self, h: Header) -> io::Result<Flow> {
        let max = PutHashedReq::body_len(MAX_BATCH_PAGES);
        let req = match self.request(h, "PUT_HASHED", max, PutHashedReq::decode)? {
            Ok(r) => r,
            Err(flow) => return Ok(flow),
        };
        let Some(content) = self.st.content.get().cloned() else {
            let e = WireError::new(
                ErrorCode::UnknownOpcode,
                "this memory server has no content index: send the pages with PUT",
            );
            self.reply_error(&e, h.id);
            return Ok(Flow::Continue);
        };
        let n = req.entries.len();
        if self.staging.len() < n * PAGE_SIZE {
            self.staging.resize(MAX_BATCH_PAGES * PAGE_SIZE, 0);
        }
        let hashes: Vec<[u8; 16]> = req.entries.iter().map(|e| e.1).collect();
        let store = &self.st.store;
        let found = content.fill(store, &hashes, &mut self.staging[..n * PAGE_SIZE]);
        let mut pages = Vec::new();
        let mut data = Vec::with_capacity(n * PAGE_SIZE);
        for (i, f) in found.iter().enumerate() {
            if *f {
                pages.push(req.entries[i].0);
                data.extend_from_slice(&self.staging[i * PAGE_SIZE..(i + 1) * PAGE_SIZE]);
            }
        }
        self.st.metrics.pages_hashed.fetch_add(n as u64, Relaxed);
        if !pages.is_empty() {
            let stored = pages.len() as u64;
            if let Err(e) = store.put_copy(req.region, &PageSel::List(pages), &data, &self.client) {
                self.store_error(e, h.id);
                return Ok(Flow::Continue);
            }
            self.st
                .metrics
                .pages_hashed_stored
                .fetch_add(stored, Relaxed);
        }
        let ok = PutHashedOk::from_found(&found);
        frame(Opcode::PutHashedOk, h.id, &mut self.out, |b| ok.encode(b));
        Ok(Flow::Continue)
    }

    fn stat(&mut self, h: Header) -> io::Result<Flow> {
        if h.body_len != 8 {
            return Ok(self.fatal(WireError::malformed("STAT body must be 8 bytes").with_id(h.id)));
        }
        self.read_body(8)?;
        let req = match StatReq::decode(&self.body) {
            Ok(r) => r,
            Err(e) => return Ok(self.fatal(e.with_id(h.id))),
        };
        let s = self.st.store.stat_reply(
            req.flags & StatReq::LIST_REGIONS != 0,
            req.max_regions,
            self.st.server_id,
            self.st.connections(),
        );
        frame(Opcode::StatOk, h.id, &mut self.out, |b| s.encode(b));
        Ok(Flow::Continue)
    }
}
