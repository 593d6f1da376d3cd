//! The gate: every new connection waits here, in one thread, until it proves
//! the cluster secret. Only an authenticated connection gets a session
//! thread, so clients that connect and never authenticate cost a file
//! descriptor and a few hundred bytes each, never a thread, and they can
//! never use up `max_conns` (which counts authenticated sessions only).
//!
//! Unauthenticated connections have their own cap (`max_handshakes`): when it
//! is full, the oldest waiting connection that has sent nothing is dropped
//! to admit the new one — one whose bytes are waiting (a real client's
//! HELLO, sitting in its socket while the gate accepts a flood) is served
//! first — so a flood of idle connections delays a real client by at most
//! the time it takes to send its HELLO (microseconds), and each waits at
//! most `handshake_timeout`. The gate accepts at most [`ACCEPT_BATCH`]
//! connections between two polls of the waiting ones: a flood cannot keep
//! it from reading the HELLOs that came in meanwhile.
//!
//! TLS runs here too: a client sends STARTTLS before its HELLO, the gate
//! answers STARTTLS_OK, runs the TLS handshake without blocking (the client
//! must present a certificate the cluster CA signed) and sends a fresh
//! WELCOME inside TLS. With an identity configured, a peer not on loopback
//! that sends HELLO in plaintext is refused (TLS_REQUIRED) before its proof
//! is even read.

use crate::server::{check_hello, welcome, ServerState, MAX_HELLO_BODY};
use pagefleet_proto::*;
use pagefleet_tls::handshake::{Challenge, TlsOffer};
use pagefleet_tls::Stream;
use std::collections::VecDeque;
use std::io;
use std::net::TcpListener;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{debug, info, warn};

/// Most connections accepted in a row before the waiting ones are served
/// again (a flood of connects otherwise keeps the gate in `accept` while
/// the HELLOs of real clients wait unread until their connection is evicted).
pub const ACCEPT_BATCH: usize = 64;
/// When the waiting queue is full, how many of the oldest are looked at
/// for one that has sent nothing (to drop) before the oldest of all goes.
const EVICT_SCAN: usize = 64;

/// A connection that has not authenticated yet.
struct Waiting {
    stream: Stream,
    peer: String,
    /// Only TLS is taken from this peer (identity configured, not loopback).
    tls_required: bool,
    /// Between STARTTLS_OK and the end of the TLS handshake.
    handshaking: bool,
    ch: Challenge,
    buf: Vec<u8>,
    since: Instant,
}

enum Step {
    /// Still waiting for the rest of the HELLO.
    More,
    /// Answered (an error) or gone: close it.
    Close,
    /// Authenticated: hand to a session thread with the bytes read past HELLO.
    Authed {
        client: String,
        /// The HELLO_OK to send if a session slot is free.
        ok: Vec<u8>,
        /// The HELLO's id, for a BUSY answer.
        id: u64,
        extra: Vec<u8>,
    },
}

/// Accept connections forever: handshakes here, sessions on their own threads.
pub fn serve(listener: TcpListener, state: Arc<ServerState>) -> io::Result<()> {
    listener.set_nonblocking(true)?;
    let mut waiting: VecDeque<Waiting> = VecDeque::new();
    let mut fds: Vec<libc::pollfd> = Vec::new();
    loop {
        if state.quiet() {
            // Handing over: connections wait in the listener's backlog for
            // the next process; those half-way through their handshake
            // start again there.
            waiting.clear();
            std::thread::sleep(Duration::from_millis(5));
            continue;
        }
        fds.clear();
        fds.push(pollfd(listener.as_raw_fd()));
        fds.extend(
            waiting
                .iter()
                .map(|w| pollfd(w.stream.socket().as_raw_fd())),
        );
        // Wake at least every 100 ms to expire handshakes.
        if let Err(e) = pagefleet_proto::sys::poll(&mut fds, 100) {
            warn!("poll in the connection gate: {e}");
            std::thread::sleep(Duration::from_millis(10));
            continue;
        }
        // Serve the waiting connections that have bytes (indices shift as we remove).
        let ready: Vec<bool> = fds[1..].iter().map(|f| f.revents != 0).collect();
        let mut i = 0;
        let mut k = 0;
        while i < waiting.len() {
            let r = ready.get(k).copied().unwrap_or(false);
            k += 1;
            if !r || !advance(&state, &mut waiting, i) {
                i += 1;
            }
        }
        let deadline = state.cfg.handshake_timeout;
        while waiting
            .front()
            .is_some_and(|w| w.since.elapsed() >= deadline)
        {
            let w = waiting.pop_front().expect("front exists");
            state.metrics.handshake_timeouts.fetch_add(1, Relaxed);
            debug!(peer = w.peer, "no HELLO within {deadline:?}: closed");
        }
        if fds[0].revents != 0 {
            accept_all(&listener, &state, &mut waiting);
        }
    }
}

/// Read what waiting connection `i` sent and act on it; true when it left
/// the queue (answered, gone, or authenticated and handed to a session).
fn advance(st: &Arc<ServerState>, waiting: &mut VecDeque<Waiting>, i: usize) -> bool {
    match step(st, &mut waiting[i]) {
        Step::More => false,
        Step::Close => {
            waiting.remove(i);
            true
        }
        Step::Authed {
            client,
            ok,
            id,
            extra,
        } => {
            let w = waiting.remove(i).expect("index in range");
            start_session(st, w, client, &ok, id, extra);
            true
        }
    }
}

/// The socket has bytes to read (a HELLO or a TLS record), without reading.
fn has_bytes(w: &Waiting) -> bool {
    let mut b = [0u8; 1];
    let peek = pagefleet_proto::sys::recv(
        w.stream.socket(),
        &mut b,
        libc::MSG_PEEK | libc::MSG_DONTWAIT,
    );
    matches!(peek, Ok(1..))
}

/// Room for one more waiting connection: serve the oldest ones that have
/// bytes waiting, and drop the oldest that has sent nothing (or, when each
/// of the oldest [`EVICT_SCAN`] is half-way through a handshake, the oldest).
fn make_room(st: &Arc<ServerState>, waiting: &mut VecDeque<Waiting>) {
    let max = st.cfg.max_handshakes.max(1) as usize;
    let mut i = 0;
    let mut scanned = 0;
    while waiting.len() >= max && i < waiting.len() && scanned < EVICT_SCAN {
        scanned += 1;
        let w = &waiting[i];
        if w.handshaking || !w.buf.is_empty() {
            i += 1;
        } else if has_bytes(w) {
            if !advance(st, waiting, i) {
                i += 1;
            }
        } else {
            waiting.remove(i);
            st.metrics.handshake_evictions.fetch_add(1, Relaxed);
        }
    }
    if waiting.len() >= max {
        waiting.pop_front();
        st.metrics.handshake_evictions.fetch_add(1, Relaxed);
    }
}

fn pollfd(fd: i32) -> libc::pollfd {
    libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    }
}

fn accept_all(listener: &TcpListener, st: &Arc<ServerState>, waiting: &mut VecDeque<Waiting>) {
    for _ in 0..ACCEPT_BATCH {
        let (sock, peer) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                warn!("accept failed: {e}");
                std::thread::sleep(Duration::from_millis(20));
                return;
            }
        };
        st.metrics.connections_total.fetch_add(1, Relaxed);
        if waiting.len() >= st.cfg.max_handshakes.max(1) as usize {
            make_room(st, waiting);
        }
        let ch = Challenge::fresh(st.server_id);
        let offer = TlsOffer::for_peer(st.cfg.tls.as_deref(), peer);
        let mut out = Vec::with_capacity(64);
        welcome(&ch, offer, &mut out);
        let _ = sock.set_nodelay(true);
        let stream = Stream::plain(sock);
        // A fresh socket's send buffer always takes the 64-byte WELCOME.
        if stream.socket().set_nonblocking(true).is_err() || stream.send_now(&out).is_err() {
            continue;
        }
        st.metrics.bytes_out.fetch_add(out.len() as u64, Relaxed);
        waiting.push_back(Waiting {
            stream,
            peer: peer.to_string(),
            tls_required: offer.required,
            handshaking: false,
            ch,
            buf: Vec::with_capacity(HEADER_LEN + MAX_HELLO_BODY),
            since: Instant::now(),
        });
    }
}

/// Read what the connection sent; answer once its HELLO is complete.
fn step(st: &ServerState, w: &mut Waiting) -> Step {
    if w.handshaking {
        match w.stream.handshake_step() {
            Ok(false) => return Step::More,
            Ok(true) => {
                w.handshaking = false;
                st.metrics.tls_handshakes.fetch_add(1, Relaxed);
                debug!(peer = w.peer, client = ?w.stream.peer_name(), "TLS established");
                // A fresh nonce: the HELLO is proven inside TLS.
                w.ch = w.ch.renewed();
                let mut out = Vec::with_capacity(64);
                welcome(&w.ch, TlsOffer::default(), &mut out);
                if w.stream.send_now(&out).is_err() {
                    return Step::Close;
                }
                st.metrics.bytes_out.fetch_add(out.len() as u64, Relaxed);
            }
            Err(e) => {
                st.metrics.tls_failures.fetch_add(1, Relaxed);
                info!(peer = w.peer, "TLS handshake refused: {e}");
                return Step::Close;
            }
        }
    }
    let mut tmp = [0u8; HEADER_LEN + MAX_HELLO_BODY + 256];
    // Read all there is: decrypted bytes left in the TLS buffer would not
    // wake the poll again.
    loop {
        match w.stream.read_nonblocking(&mut tmp) {
            Ok(Some(0)) => return Step::Close,
            Ok(Some(n)) => {
                w.buf.extend_from_slice(&tmp[..n]);
                st.metrics.bytes_in.fetch_add(n as u64, Relaxed);
            }
            Ok(None) => break,
            Err(_) => return Step::Close,
        }
        if w.buf.len() >= HEADER_LEN + MAX_HELLO_BODY {
            break;
        }
    }
    if w.buf.len() < HEADER_LEN {
        return Step::More;
    }
    let h = match Header::decode(&w.buf[..HEADER_LEN]) {
        Ok(h) => h,
        Err(e) => return refuse(st, w, e),
    };
    if Opcode::from_u8(h.opcode) == Some(Opcode::StartTls) {
        return start_tls(st, w, h);
    }
    if Opcode::from_u8(h.opcode) != Some(Opcode::Hello) {
        return refuse(
            st,
            w,
            WireError::new(
                ErrorCode::NotAuthenticated,
                "authenticate with HELLO before any other request",
            )
            .with_id(h.id),
        );
    }
    st.metrics.request(Opcode::Hello);
    if w.tls_required && !w.stream.is_tls() {
        return refuse(
            st,
            w,
            WireError::new(
                ErrorCode::TlsRequired,
                format!(
                    "this memory server takes only TLS from {}: give the client the \
                     cluster's certificates (pagefleet cert issue; --tls-dir)",
                    w.peer
                ),
            )
            .with_id(h.id),
        );
    }
    let len = h.body_len as usize;
    if len > MAX_HELLO_BODY {
        return refuse(
            st,
            w,
            WireError::malformed("HELLO body too long").with_id(h.id),
        );
    }
    if w.buf.len() < HEADER_LEN + len {
        return Step::More;
    }
    let body = &w.buf[HEADER_LEN..HEADER_LEN + len];
    match check_hello(st, &w.ch, body, &w.peer) {
        Ok((ok, client)) => {
            let mut out = Vec::with_capacity(96);
            frame(Opcode::HelloOk, h.id, &mut out, |b| ok.encode(b));
            Step::Authed {
                client,
                ok: out,
                id: h.id,
                extra: w.buf[HEADER_LEN + len..].to_vec(),
            }
        }
        Err(e) => refuse(st, w, e.with_id(h.id)),
    }
}

/// STARTTLS: answer STARTTLS_OK and start the TLS handshake (server side).
fn start_tls(st: &ServerState, w: &mut Waiting, h: Header) -> Step {
    st.metrics.request(Opcode::StartTls);
    let violation = |m: &str| WireError::new(ErrorCode::ProtocolViolation, m).with_id(h.id);
    if h.body_len != 0 || w.buf.len() != HEADER_LEN {
        return refuse(
            st,
            w,
            violation("STARTTLS has no body, and nothing may follow it before the handshake"),
        );
    }
    if w.stream.is_tls() {
        return refuse(st, w, violation("this connection is TLS already"));
    }
    let Some(id) = st.cfg.tls.clone() else {
        return refuse(
            st,
            w,
            WireError::new(
                ErrorCode::TlsRequired,
                "this memory server has no TLS identity (pagefleetd --tls-dir)",
            )
            .with_id(h.id),
        );
    };
    let mut out = Vec::with_capacity(HEADER_LEN);
    frame(Opcode::StartTlsOk, h.id, &mut out, |_| {});
    if w.stream.send_now(&out).is_err() || w.stream.start_tls_server(&id).is_err() {
        return Step::Close;
    }
    st.metrics.bytes_out.fetch_add(out.len() as u64, Relaxed);
    w.buf.clear();
    w.handshaking = true;
    Step::More
}

fn refuse(st: &ServerState, w: &mut Waiting, e: WireError) -> Step {
    st.metrics.error(e.code);
    debug!(peer = w.peer, "refused before authentication: {e}");
    let mut out = Vec::new();
    frame(Opcode::Error, e.id, &mut out, |b| e.encode(b));
    let _ = w.stream.send_now(&out);
    Step::Close
}

/// Admit an authenticated connection (HELLO_OK, a session thread) or, with
/// every session slot taken, answer its HELLO with BUSY.
fn start_session(
    st: &Arc<ServerState>,
    w: Waiting,
    client: String,
    ok: &[u8],
    id: u64,
    extra: Vec<u8>,
) {
    let Waiting { stream, peer, .. } = w;
    if !st.try_admit() {
        st.metrics.connections_refused.fetch_add(1, Relaxed);
        let e = WireError::new(
            ErrorCode::Busy,
            format!(
                "server at its limit of {} sessions; retry later",
                st.cfg.max_conns
            ),
        );
        st.metrics.error(e.code);
        let mut out = Vec::new();
        frame(Opcode::Error, id, &mut out, |b| e.encode(b));
        let _ = stream.send_now(&out);
        return;
    }
    // A fresh connection's send buffer always takes the 80-byte HELLO_OK
    // (the session flushes what TLS could not send at once).
    if stream.send_now(ok).is_err() {
        st.release();
        return;
    }
    st.metrics.bytes_out.fetch_add(ok.len() as u64, Relaxed);
    let st2 = st.clone();
    let spawned = std::thread::Builder::new()
        .name(format!("conn {peer}"))
        .spawn(move || {
            crate::server::serve_authenticated(&st2, stream, &peer, client, &extra);
        });
    if let Err(e) = spawned {
        st.release();
        warn!("cannot start a session thread: {e}");
    }
}
