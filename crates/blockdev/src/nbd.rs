//! The NBD protocol (newstyle fixed handshake, simple and structured
//! replies, STARTTLS), as in the protocol document of the NBD project
//! (github.com/NetworkBlockDevice/nbd, doc/proto.md).
//!
//! TLS: NBD_OPT_STARTTLS switches the connection to TLS (the client must
//! present a certificate the cluster CA signed; QEMU's tls-creds-x509 and
//! libnbd's tls-certificates read the directory `pagefleet cert issue`
//! writes). A client that must use TLS (not on loopback, the export has an
//! identity) gets NBD_REP_ERR_TLS_REQD for every other option and is hung
//! up on if it asks for the export the old way (EXPORT_NAME).

use crate::backend::{IoError, BLOCK};
use crate::engine::{Engine, Piece};
use pagefleet_common::sys::net::send_now;
use std::io::{IoSlice, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::AcqRel, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tracing::warn;

pub(crate) const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
pub(crate) const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
pub(crate) const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub(crate) const REQUEST_MAGIC: u32 = 0x2560_9513;
pub(crate) const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub(crate) const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

pub(crate) const FLAG_FIXED_NEWSTYLE: u16 = 1;
pub(crate) const FLAG_NO_ZEROES: u16 = 2;
pub(crate) const FLAG_C_FIXED_NEWSTYLE: u32 = 1;
pub(crate) const FLAG_C_NO_ZEROES: u32 = 2;

pub(crate) const OPT_EXPORT_NAME: u32 = 1;
pub(crate) const OPT_ABORT: u32 = 2;
pub(crate) const OPT_LIST: u32 = 3;
pub(crate) const OPT_STARTTLS: u32 = 5;
pub(crate) const OPT_INFO: u32 = 6;
pub(crate) const OPT_GO: u32 = 7;
pub(crate) const OPT_STRUCTURED_REPLY: u32 = 8;
pub(crate) const OPT_LIST_META_CONTEXT: u32 = 9;
pub(crate) const OPT_SET_META_CONTEXT: u32 = 10;

pub(crate) const REP_ACK: u32 = 1;
pub(crate) const REP_SERVER: u32 = 2;
pub(crate) const REP_INFO: u32 = 3;
pub(crate) const REP_META_CONTEXT: u32 = 4;
pub(crate) const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
pub(crate) const REP_ERR_POLICY: u32 = (1 << 31) + 2;
pub(crate) const REP_ERR_INVALID: u32 = (1 << 31) + 3;
pub(crate) const REP_ERR_TLS_REQD: u32 = (1 << 31) + 5;
pub(crate) const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;
pub(crate) const REP_ERR_BLOCK_SIZE_REQD: u32 = (1 << 31) + 8;

pub(crate) const INFO_EXPORT: u16 = 0;
pub(crate) const INFO_NAME: u16 = 1;
pub(crate) const INFO_DESCRIPTION: u16 = 2;
pub(crate) const INFO_BLOCK_SIZE: u16 = 3;

pub(crate) const TF_HAS_FLAGS: u16 = 1;
pub(crate) const TF_SEND_FLUSH: u16 = 1 << 2;
pub(crate) const TF_SEND_FUA: u16 = 1 << 3;
pub(crate) const TF_SEND_TRIM: u16 = 1 << 5;
pub(crate) const TF_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub(crate) const TF_CAN_MULTI_CONN: u16 = 1 << 8;

pub(crate) const CMD_READ: u16 = 0;
pub(crate) const CMD_WRITE: u16 = 1;
pub(crate) const CMD_DISC: u16 = 2;
pub(crate) const CMD_FLUSH: u16 = 3;
pub(crate) const CMD_TRIM: u16 = 4;
pub(crate) const CMD_WRITE_ZEROES: u16 = 6;
pub(crate) const CMD_BLOCK_STATUS: u16 = 7;
pub(crate) const CMD_FLAG_REQ_ONE: u16 = 8;
pub(crate) const CMD_FLAG_NO_HOLE: u16 = 2;
pub(crate) const CMD_FLAG_DF: u16 = 4;

pub(crate) const REPLY_FLAG_DONE: u16 = 1;
pub(crate) const REPLY_TYPE_NONE: u16 = 0;
pub(crate) const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub(crate) const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub(crate) const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub(crate) const STATE_HOLE: u32 = 1;
pub(crate) const STATE_ZERO: u32 = 2;
pub(crate) const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;

pub(crate) const EIO: u32 = 5;
pub(crate) const EINVAL: u32 = 22;
pub(crate) const ENOSPC: u32 = 28;
pub(crate) const EOVERFLOW: u32 = 75;

/// Largest request payload accepted (and advertised).
pub const MAX_PAYLOAD: u32 = 32 << 20;
/// Largest option body accepted during the handshake.
const MAX_OPTION: u32 = 64 << 10;

/// What NBD clients are told about the export.
#[derive(Clone, Debug)]
pub struct Export {
    /// Its name.
    pub name: String,
    /// Its description.
    pub description: String,
    /// Its size, bytes.
    pub size: u64,
}

/// An export as the server serves it: what clients are told, and its I/O.
#[derive(Clone)]
pub struct Served {
    /// Its name, size and description.
    pub export: Export,
    /// Its device's engine.
    pub engine: Arc<Engine>,
}

/// What the handshake settled.
struct Negotiated {
    /// Which export (index into the served list).
    export: usize,
    /// Structured replies.
    structured: bool,
    /// `base:allocation` block status was selected for this export.
    allocation: bool,
}

/// The one metadata context: which blocks hold data (NBD_STATE_HOLE |
/// NBD_STATE_ZERO for those never written).
const BASE_ALLOCATION: &str = "base:allocation";
/// Its id on every connection.
const ALLOCATION_ID: u32 = 1;

/// What a connection may and must do about TLS.
#[derive(Clone, Default)]
pub struct Tls {
    /// The export's identity (None: STARTTLS is refused).
    pub identity: Option<Arc<pagefleet_tls::Identity>>,
    /// Nothing but STARTTLS (or ABORT) before TLS is up.
    pub required: bool,
}

/// A client connection: TCP (plain or TLS) or Unix.
pub trait Io: Read + Write + Send + 'static {
    /// Another handle on the connection (for the reply writer).
    fn try_clone_box(&self) -> std::io::Result<Box<dyn Io>>;
    /// Shut the connection down.
    fn close(&self);
    /// Switch to TLS (server side) and finish its handshake.
    fn start_tls(&mut self, _id: &pagefleet_tls::Identity) -> std::io::Result<()> {
        Err(std::io::Error::other(
            "TLS is not offered on this kind of connection",
        ))
    }
    /// Whether TLS is up.
    fn is_tls(&self) -> bool {
        false
    }
    /// Send what the connection takes now, without waiting: bytes sent
    /// (0: it would block). None: this connection cannot (TLS writes its
    /// records whole), so replies are written blocking, within the write
    /// timeout.
    fn send_now(&self, _bufs: &[IoSlice<'_>]) -> Option<std::io::Result<usize>> {
        None
    }
    /// Give up a blocking write that makes no progress for `d`.
    fn set_write_timeout(&self, d: Option<Duration>) -> std::io::Result<()>;
}

impl Io for pagefleet_tls::Stream {
    fn try_clone_box(&self) -> std::io::Result<Box<dyn Io>> {
        Ok(Box::new(self.try_clone()?))
    }
    fn close(&self) {
        let _ = self.socket().shutdown(Shutdown::Both);
    }
    fn start_tls(&mut self, id: &pagefleet_tls::Identity) -> std::io::Result<()> {
        self.start_tls_server(id).map_err(std::io::Error::other)?;
        self.handshake()
    }
    fn is_tls(&self) -> bool {
        pagefleet_tls::Stream::is_tls(self)
    }
    fn send_now(&self, bufs: &[IoSlice<'_>]) -> Option<std::io::Result<usize>> {
        (!pagefleet_tls::Stream::is_tls(self)).then(|| send_now(self.socket(), bufs))
    }
    fn set_write_timeout(&self, d: Option<Duration>) -> std::io::Result<()> {
        self.socket().set_write_timeout(d)
    }
}

impl Io for UnixStream {
    fn try_clone_box(&self) -> std::io::Result<Box<dyn Io>> {
        Ok(Box::new(self.try_clone()?))
    }
    fn close(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
    fn send_now(&self, bufs: &[IoSlice<'_>]) -> Option<std::io::Result<usize>> {
        Some(send_now(self, bufs))
    }
    fn set_write_timeout(&self, d: Option<Duration>) -> std::io::Result<()> {
        UnixStream::set_write_timeout(self, d)
    }
}

fn rd<const N: usize>(r: &mut dyn Read) -> std::io::Result<[u8; N]> {
    let mut b = [0u8; N];
    r.read_exact(&mut b)?;
    Ok(b)
}

fn opt_reply(w: &mut dyn Write, opt: u32, ty: u32, data: &[u8]) -> std::io::Result<()> {
    let mut b = Vec::with_capacity(20 + data.len());
    b.extend_from_slice(&REPLY_MAGIC.to_be_bytes());
    b.extend_from_slice(&opt.to_be_bytes());
    b.extend_from_slice(&ty.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    w.write_all(&b)
}

fn transmission_flags() -> u16 {
    // Memory servers store a write before acknowledging it, so every
    // connection sees every completed write: FLUSH and FUA are no-ops and
    // several connections are safe.
    TF_HAS_FLAGS
        | TF_SEND_FLUSH
        | TF_SEND_FUA
        | TF_SEND_TRIM
        | TF_SEND_WRITE_ZEROES
        | TF_CAN_MULTI_CONN
}

/// The export a client names: "" is the first.
fn find(exports: &[Served], name: &[u8]) -> Option<usize> {
    if name.is_empty() {
        return (!exports.is_empty()).then_some(0);
    }
    exports
        .iter()
        .position(|e| e.export.name.as_bytes() == name)
}

/// A meta-context option's body: export name and queries.
fn meta_queries(data: &[u8]) -> Option<(Vec<u8>, Vec<String>)> {
    let nl = u32::from_be_bytes(data.get(0..4)?.try_into().ok()?) as usize;
    let name = data.get(4..4 + nl)?.to_vec();
    let nq = u32::from_be_bytes(data.get(4 + nl..8 + nl)?.try_into().ok()?) as usize;
    let mut at = 8 + nl;
    let mut qs = Vec::new();
    for _ in 0..nq {
        let ql = u32::from_be_bytes(data.get(at..at + 4)?.try_into().ok()?) as usize;
        let q = data.get(at + 4..at + 4 + ql)?;
        qs.push(String::from_utf8(q.to_vec()).ok()?);
        at += 4 + ql;
    }
    (at == data.len()).then_some((name, qs))
}

/// The handshake. Ok(Some(_)) enters transmission; Ok(None): the client
/// left (ABORT) or listed exports only.
fn handshake(c: &mut dyn Io, exports: &[Served], tls: &Tls) -> std::io::Result<Option<Negotiated>> {
    let mut hello = Vec::new();
    hello.extend_from_slice(&NBDMAGIC.to_be_bytes());
    hello.extend_from_slice(&IHAVEOPT.to_be_bytes());
    hello.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    c.write_all(&hello)?;
    let cflags = u32::from_be_bytes(rd::<4>(c)?);
    if cflags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
        return Err(std::io::Error::other(format!(
            "unknown client flags {cflags:#x}"
        )));
    }
    let no_zeroes = cflags & FLAG_C_NO_ZEROES != 0;
    let mut structured = false;
    // The export base:allocation was selected for (SET_META_CONTEXT).
    let mut allocation_for: Option<Vec<u8>> = None;
    loop {
        let magic = u64::from_be_bytes(rd::<8>(c)?);
        if magic != IHAVEOPT {
            return Err(std::io::Error::other(format!(
                "bad option magic {magic:#x}"
            )));
        }
        let opt = u32::from_be_bytes(rd::<4>(c)?);
        let len = u32::from_be_bytes(rd::<4>(c)?);
        if len > MAX_OPTION {
            return Err(std::io::Error::other(format!(
                "option {opt} of {len} bytes"
            )));
        }
        let mut data = vec![0u8; len as usize];
        c.read_exact(&mut data)?;
        if tls.required && !c.is_tls() && !matches!(opt, OPT_STARTTLS | OPT_ABORT) {
            if opt == OPT_EXPORT_NAME {
                // No error reply exists for it: hang up, as the spec says.
                return Err(std::io::Error::other(
                    "EXPORT_NAME before STARTTLS from a client that must use TLS",
                ));
            }
            opt_reply(
                c,
                opt,
                REP_ERR_TLS_REQD,
                b"this export takes only TLS from clients not on loopback: STARTTLS first",
            )?;
            continue;
        }
        match opt {
            OPT_STARTTLS => {
                let Some(id) = &tls.identity else {
                    opt_reply(c, opt, REP_ERR_POLICY, b"this export has no TLS identity")?;
                    continue;
                };
                if !data.is_empty() {
                    opt_reply(c, opt, REP_ERR_INVALID, b"STARTTLS takes no data")?;
                    continue;
                }
                if c.is_tls() {
                    opt_reply(c, opt, REP_ERR_INVALID, b"TLS is up already")?;
                    continue;
                }
                opt_reply(c, opt, REP_ACK, &[])?;
                // Options negotiated before TLS do not carry over.
                structured = false;
                allocation_for = None;
                c.start_tls(id)?;
            }
            OPT_EXPORT_NAME => {
                // Old-style: no way to refuse but to hang up.
                let Some(i) = find(exports, &data) else {
                    return Err(std::io::Error::other("unknown export"));
                };
                let mut b = Vec::new();
                b.extend_from_slice(&exports[i].export.size.to_be_bytes());
                b.extend_from_slice(&transmission_flags().to_be_bytes());
                if !no_zeroes {
                    b.extend_from_slice(&[0u8; 124]);
                }
                c.write_all(&b)?;
                return Ok(Some(Negotiated {
                    export: i,
                    structured: false,
                    allocation: false,
                }));
            }
            OPT_ABORT => {
                let _ = opt_reply(c, opt, REP_ACK, &[]);
                return Ok(None);
            }
            OPT_LIST => {
                if !data.is_empty() {
                    opt_reply(c, opt, REP_ERR_INVALID, b"LIST takes no data")?;
                    continue;
                }
                for e in exports {
                    let mut d = (e.export.name.len() as u32).to_be_bytes().to_vec();
                    d.extend_from_slice(e.export.name.as_bytes());
                    d.extend_from_slice(e.export.description.as_bytes());
                    opt_reply(c, opt, REP_SERVER, &d)?;
                }
                opt_reply(c, opt, REP_ACK, &[])?;
            }
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    opt_reply(c, opt, REP_ERR_INVALID, b"STRUCTURED_REPLY takes no data")?;
                    continue;
                }
                structured = true;
                opt_reply(c, opt, REP_ACK, &[])?;
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                let Some((name, queries)) = meta_queries(&data) else {
                    opt_reply(c, opt, REP_ERR_INVALID, b"malformed meta context request")?;
                    continue;
                };
                if opt == OPT_SET_META_CONTEXT && !structured {
                    opt_reply(
                        c,
                        opt,
                        REP_ERR_INVALID,
                        b"SET_META_CONTEXT needs structured replies first",
                    )?;
                    continue;
                }
                if find(exports, &name).is_none() {
                    opt_reply(c, opt, REP_ERR_UNKNOWN, b"no such export")?;
                    continue;
                }
                // LIST: no query or the namespace lists every context;
                // SET selects only what it names.
                let wanted = queries.iter().any(|q| {
                    q == BASE_ALLOCATION || (opt == OPT_LIST_META_CONTEXT && q == "base:")
                }) || (opt == OPT_LIST_META_CONTEXT && queries.is_empty());
                if opt == OPT_SET_META_CONTEXT {
                    allocation_for = wanted.then(|| name.clone());
                }
                if wanted {
                    let id = if opt == OPT_SET_META_CONTEXT {
                        ALLOCATION_ID
                    } else {
                        0
                    };
                    let mut d = id.to_be_bytes().to_vec();
                    d.extend_from_slice(BASE_ALLOCATION.as_bytes());
                    opt_reply(c, opt, REP_META_CONTEXT, &d)?;
                }
                opt_reply(c, opt, REP_ACK, &[])?;
            }
            OPT_INFO | OPT_GO => {
                // name length, name, number of info requests, requests
                let parsed = (|| {
                    if data.len() < 6 {
                        return None;
                    }
                    let nl = u32::from_be_bytes(data[0..4].try_into().ok()?) as usize;
                    let name = data.get(4..4 + nl)?;
                    let nr =
                        u16::from_be_bytes(data.get(4 + nl..6 + nl)?.try_into().ok()?) as usize;
                    let reqs = data.get(6 + nl..6 + nl + 2 * nr)?;
                    if data.len() != 6 + nl + 2 * nr {
                        return None;
                    }
                    Some((
                        name.to_vec(),
                        reqs.chunks(2)
                            .map(|x| u16::from_be_bytes([x[0], x[1]]))
                            .collect::<Vec<_>>(),
                    ))
                })();
                let Some((name, reqs)) = parsed else {
                    opt_reply(c, opt, REP_ERR_INVALID, b"malformed INFO/GO request")?;
                    continue;
                };
                let Some(i) = find(exports, &name) else {
                    let names: Vec<&str> = exports.iter().map(|e| e.export.name.as_str()).collect();
                    opt_reply(
                        c,
                        opt,
                        REP_ERR_UNKNOWN,
                        format!(
                            "no export {:?}; this server has {names:?}",
                            String::from_utf8_lossy(&name),
                        )
                        .as_bytes(),
                    )?;
                    continue;
                };
                let ex = &exports[i].export;
                if !reqs.contains(&INFO_BLOCK_SIZE) && opt == OPT_GO {
                    // Every request must be 4 KiB-aligned: the client has to know.
                    opt_reply(c, opt, REP_ERR_BLOCK_SIZE_REQD, b"this export needs 4096-byte aligned requests: ask for NBD_INFO_BLOCK_SIZE")?;
                    continue;
                }
                let mut info = INFO_EXPORT.to_be_bytes().to_vec();
                info.extend_from_slice(&ex.size.to_be_bytes());
                info.extend_from_slice(&transmission_flags().to_be_bytes());
                opt_reply(c, opt, REP_INFO, &info)?;
                let mut bs = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
                bs.extend_from_slice(&(BLOCK as u32).to_be_bytes());
                bs.extend_from_slice(&(128u32 << 10).to_be_bytes());
                bs.extend_from_slice(&MAX_PAYLOAD.to_be_bytes());
                opt_reply(c, opt, REP_INFO, &bs)?;
                if reqs.contains(&INFO_NAME) {
                    let mut d = INFO_NAME.to_be_bytes().to_vec();
                    d.extend_from_slice(ex.name.as_bytes());
                    opt_reply(c, opt, REP_INFO, &d)?;
                }
                if reqs.contains(&INFO_DESCRIPTION) {
                    let mut d = INFO_DESCRIPTION.to_be_bytes().to_vec();
                    d.extend_from_slice(ex.description.as_bytes());
                    opt_reply(c, opt, REP_INFO, &d)?;
                }
                opt_reply(c, opt, REP_ACK, &[])?;
                if opt == OPT_GO {
                    // A context selected for this export (by its name or "").
                    let allocation = allocation_for
                        .as_deref()
                        .is_some_and(|n| find(exports, n) == Some(i));
                    return Ok(Some(Negotiated {
                        export: i,
                        structured,
                        allocation,
                    }));
                }
            }
            _ => opt_reply(
                c,
                opt,
                REP_ERR_UNSUP,
                format!("option {opt} is not supported").as_bytes(),
            )?,
        }
    }
}

/// One request's header.
#[derive(Clone, Copy)]
struct Req {
    flags: u16,
    ty: u16,
    handle: u64,
    offset: u64,
    len: u32,
}

/// Replies go out whole, in the order they were written, and a client
/// that reads nothing holds up nobody but itself: a reply is sent without
/// waiting ([`Io::send_now`]); what the client's socket does not take waits
/// in the connection's backlog, which a writer thread of the connection's
/// own drains (later replies join the backlog meanwhile). Lanes' receivers
/// complete requests for every client of a server: none of them ever waits
/// on one client.
struct Replier {
    out: Mutex<Out>,
    /// Small replies a lane's receiver completed in a burst, written
    /// together when it next waits (see `engine::defer`).
    pending: Mutex<Vec<u8>>,
    /// `Out::backlog`'s length and `Out::gone`, published after each
    /// change under the lock: the reader checks them per request without
    /// taking the lock a receiver holds while it writes to the client (a
    /// contended lock put the reader to sleep about once per 100 requests).
    backlog_len: AtomicUsize,
    gone: AtomicBool,
    structured: bool,
    /// base:allocation was negotiated: BLOCK_STATUS is answered.
    allocation: bool,
}

/// The writing side of a client connection.
struct Out {
    w: Box<dyn Io>,
    /// Reply bytes the client has not taken yet, in order.
    backlog: Vec<u8>,
    /// The connection's writer thread is draining the backlog: nothing
    /// else writes to the client meanwhile.
    draining: bool,
    /// The client took nothing for [`REPLY_TIMEOUT`]: hung up on.
    gone: bool,
}

/// A structured reply chunk's header.
fn chunk(b: &mut Vec<u8>, flags: u16, ty: u16, handle: u64, len: usize) {
    b.extend_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    b.extend_from_slice(&flags.to_be_bytes());
    b.extend_from_slice(&ty.to_be_bytes());
    b.extend_from_slice(&handle.to_be_bytes());
    b.extend_from_slice(&(len as u32).to_be_bytes());
}

impl Replier {
    fn send(self: &Arc<Self>, parts: &[&[u8]]) -> std::io::Result<()> {
        // A small reply goes out in one write (one syscall, one segment),
        // or, completed in a receiver's burst, with the burst's others.
        let total: usize = parts.iter().map(|p| p.len()).sum();
        if total <= COALESCE && crate::engine::in_burst() {
            let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            let first = p.is_empty();
            for part in parts {
                p.extend_from_slice(part);
            }
            drop(p);
            if first {
                let me = self.clone();
                crate::engine::defer(Box::new(move || {
                    let _ = me.flush_pending();
                }));
            }
            return Ok(());
        }
        self.write(parts, total)
    }

    /// Publish the backlog's state for [`Replier::backlog`] (the caller
    /// holds the lock and has just changed it).
    fn publish(&self, o: &Out) {
        self.backlog_len.store(o.backlog.len(), Relaxed);
        self.gone.store(o.gone, Relaxed);
    }

    /// Write a reply's parts (`total` bytes) in order after everything
    /// written before (see the type's docs).
    fn write(self: &Arc<Self>, parts: &[&[u8]], total: usize) -> std::io::Result<()> {
        let mut o = self.out.lock().unwrap_or_else(|e| e.into_inner());
        if o.gone {
            return Err(std::io::ErrorKind::BrokenPipe.into());
        }
        if o.draining {
            for p in parts {
                o.backlog.extend_from_slice(p);
            }
            self.publish(&o);
            return Ok(());
        }
        let mut iov: Vec<IoSlice<'_>> = parts
            .iter()
            .filter(|p| !p.is_empty())
            .map(|p| IoSlice::new(p))
            .collect();
        let sent = match o.w.send_now(&iov) {
            // TLS: written blocking, within the connection's write timeout.
            None => return pagefleet_proto::io::write_all_vectored(&mut *o.w, &mut iov),
            Some(r) => r?,
        };
        if sent == total {
            return Ok(());
        }
        // The client's socket is full: the rest waits for the writer.
        let mut skip = sent;
        for p in parts {
            let k = skip.min(p.len());
            o.backlog.extend_from_slice(&p[k..]);
            skip -= k;
        }
        o.draining = true;
        let me = self.clone();
        let started = o.w.try_clone_box().and_then(|w| {
            std::thread::Builder::new()
                .name("nbd-reply".into())
                .spawn(move || me.drain(w))
        });
        if let Err(e) = started {
            // No writer: nothing would ever drain the backlog.
            o.gone = true;
            o.backlog = Vec::new();
            o.w.close();
            self.publish(&o);
            return Err(e);
        }
        self.publish(&o);
        Ok(())
    }

    /// The connection's writer: write the backlog out until it is empty.
    fn drain(&self, mut w: Box<dyn Io>) {
        loop {
            let chunk = {
                let mut o = self.out.lock().unwrap_or_else(|e| e.into_inner());
                if o.backlog.is_empty() {
                    o.draining = false;
                    return;
                }
                let chunk = std::mem::take(&mut o.backlog);
                self.publish(&o);
                chunk
            };
            if let Err(e) = w.write_all(&chunk) {
                warn!(
                    "nbd client: took no reply for {REPLY_TIMEOUT:?} or hung up ({e}); closing it"
                );
                let mut o = self.out.lock().unwrap_or_else(|e| e.into_inner());
                o.gone = true;
                o.backlog = Vec::new();
                w.close();
                self.publish(&o);
                return;
            }
        }
    }

    /// Reply bytes waiting for the client, and whether it is gone.
    fn backlog(&self) -> (usize, bool) {
        (self.backlog_len.load(Relaxed), self.gone.load(Relaxed))
    }

    /// Write the replies a burst left. The buffer goes back for the next
    /// burst (its capacity kept: a burst of 4 KiB replies would otherwise
    /// grow a new one by doubling every time).
    fn flush_pending(self: &Arc<Self>) -> std::io::Result<()> {
        let mut b = std::mem::take(&mut *self.pending.lock().unwrap_or_else(|e| e.into_inner()));
        let r = self.write(&[&b], b.len());
        b.clear();
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if p.is_empty() && p.capacity() < b.capacity() {
            *p = b;
        }
        r
    }

    fn ok(self: &Arc<Self>, r: &Req) -> std::io::Result<()> {
        let mut b = Vec::with_capacity(20);
        if self.structured {
            chunk(&mut b, REPLY_FLAG_DONE, REPLY_TYPE_NONE, r.handle, 0);
        } else {
            b.extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
            b.extend_from_slice(&0u32.to_be_bytes());
            b.extend_from_slice(&r.handle.to_be_bytes());
        }
        self.send(&[&b])
    }

    /// A read's data. Structured: holes as OFFSET_HOLE chunks (unless the
    /// client asked for one chunk, DF), runs of data as OFFSET_DATA chunks;
    /// simple: the bytes, holes as zeros.
    fn data(self: &Arc<Self>, r: &Req, pieces: &[Piece]) -> std::io::Result<()> {
        let zeros = &ZEROS[..];
        // Every chunk header goes into one buffer (built first: `parts`
        // borrows it); each is followed by its chunk's pieces.
        let mut hdrs = Vec::with_capacity(32);
        let mut parts: Vec<&[u8]> = Vec::with_capacity(2 * pieces.len() + 1);
        let whole = !self.structured || r.flags & CMD_FLAG_DF != 0;
        if whole {
            if self.structured {
                chunk(
                    &mut hdrs,
                    REPLY_FLAG_DONE,
                    REPLY_TYPE_OFFSET_DATA,
                    r.handle,
                    8 + r.len as usize,
                );
                hdrs.extend_from_slice(&r.offset.to_be_bytes());
            } else {
                hdrs.extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
                hdrs.extend_from_slice(&0u32.to_be_bytes());
                hdrs.extend_from_slice(&r.handle.to_be_bytes());
            }
            parts.push(&hdrs);
            for p in pieces {
                match p {
                    Piece::Data(d) => parts.push(d),
                    Piece::Hole(n) => {
                        let mut left = *n as usize * BLOCK;
                        while left > 0 {
                            let k = left.min(zeros.len());
                            parts.push(&zeros[..k]);
                            left -= k;
                        }
                    }
                }
            }
            return self.send(&parts);
        }
        // Consecutive pieces of one kind make one chunk: a hole chunk's
        // header is HOLE_CHUNK bytes, a data chunk's DATA_CHUNK.
        let groups = |f: &mut dyn FnMut(bool, usize, usize, usize)| {
            let mut i = 0;
            while i < pieces.len() {
                let hole = matches!(pieces[i], Piece::Hole(_));
                let mut j = i;
                let mut len = 0usize;
                while j < pieces.len() && matches!(pieces[j], Piece::Hole(_)) == hole {
                    len += piece_len(&pieces[j]);
                    j += 1;
                }
                f(hole, i, j, len);
                i = j;
            }
        };
        let mut at = r.offset;
        groups(&mut |hole, _, j, len| {
            let flags = if j == pieces.len() {
                REPLY_FLAG_DONE
            } else {
                0
            };
            if hole {
                chunk(&mut hdrs, flags, REPLY_TYPE_OFFSET_HOLE, r.handle, 12);
                hdrs.extend_from_slice(&at.to_be_bytes());
                hdrs.extend_from_slice(&(len as u32).to_be_bytes());
            } else {
                chunk(&mut hdrs, flags, REPLY_TYPE_OFFSET_DATA, r.handle, 8 + len);
                hdrs.extend_from_slice(&at.to_be_bytes());
            }
            at += len as u64;
        });
        let mut h = &hdrs[..];
        groups(&mut |hole, i, j, _| {
            let (this, rest) = h.split_at(if hole { HOLE_CHUNK } else { DATA_CHUNK });
            parts.push(this);
            h = rest;
            for p in &pieces[i..j] {
                if let Piece::Data(d) = p {
                    parts.push(d);
                }
            }
        });
        self.send(&parts)
    }

    fn err(self: &Arc<Self>, r: &Req, errno: u32, msg: &str) -> std::io::Result<()> {
        let mut b = Vec::new();
        if self.structured {
            let m = &msg.as_bytes()[..msg.len().min(4096)];
            chunk(
                &mut b,
                REPLY_FLAG_DONE,
                REPLY_TYPE_ERROR,
                r.handle,
                6 + m.len(),
            );
            b.extend_from_slice(&errno.to_be_bytes());
            b.extend_from_slice(&(m.len() as u16).to_be_bytes());
            b.extend_from_slice(m);
        } else {
            // A simple error reply has no payload, even for a read.
            b.extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
            b.extend_from_slice(&errno.to_be_bytes());
            b.extend_from_slice(&r.handle.to_be_bytes());
        }
        self.send(&[&b])
    }

    /// The reply to a write, trim or zeroing.
    fn changed(self: &Arc<Self>, r: &Req, res: Result<(), IoError>) -> std::io::Result<()> {
        match res {
            Ok(()) => self.ok(r),
            Err(IoError::NoSpace(m)) => self.err(r, ENOSPC, &m),
            Err(e) => self.err(r, EIO, &e.to_string()),
        }
    }
}

fn piece_len(p: &Piece) -> usize {
    match p {
        Piece::Data(d) => d.len(),
        Piece::Hole(n) => *n as usize * BLOCK,
    }
}

/// A structured reply chunk's header: magic, flags, type, handle, length.
const CHUNK_HEADER: usize = 4 + 2 + 2 + 8 + 4;
/// An OFFSET_HOLE chunk before its (no) data: header, offset, hole size.
const HOLE_CHUNK: usize = CHUNK_HEADER + 8 + 4;
/// An OFFSET_DATA chunk before its data: header, offset.
const DATA_CHUNK: usize = CHUNK_HEADER + 8;

/// Replies up to this size that a receiver completes in a burst are copied
/// into the burst's buffer and written together.
const COALESCE: usize = 16 << 10;

/// Zeros a simple reply's holes are sent from.
static ZEROS: [u8; 128 << 10] = [0; 128 << 10];

/// Zeros written at most at once for WRITE_ZEROES with NO_HOLE (the
/// writes of a larger request share one buffer of this size).
const MAX_HOLE_WRITE: usize = 1 << 20;

/// Several jobs that answer one request together.
struct Join {
    left: AtomicUsize,
    result: Mutex<Result<(), IoError>>,
    reply: Arc<Replier>,
    req: Req,
}

impl Join {
    fn one_done(&self, r: Result<(), IoError>) {
        if let Err(e) = r {
            let mut res = self.result.lock().unwrap_or_else(|e| e.into_inner());
            if res.is_ok() || matches!(e, IoError::NoSpace(_)) {
                *res = Err(e);
            }
        }
        if self.left.fetch_sub(1, AcqRel) == 1 {
            let res = std::mem::replace(
                &mut *self.result.lock().unwrap_or_else(|e| e.into_inner()),
                Ok(()),
            );
            let _ = self.reply.changed(&self.req, res);
        }
    }
}

/// Start one request; its reply is sent when it completes.
fn dispatch(
    eng: &Arc<Engine>,
    rep: &Arc<Replier>,
    ex: &Export,
    r: Req,
    data: Vec<u8>,
) -> std::io::Result<()> {
    let aligned = r.offset.is_multiple_of(BLOCK as u64) && (r.len as usize).is_multiple_of(BLOCK);
    let end = r.offset.checked_add(r.len as u64);
    let inside = end.is_some_and(|e| e <= ex.size);
    let first = r.offset / BLOCK as u64;
    let count = r.len as u64 / BLOCK as u64;
    match r.ty {
        CMD_READ | CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES if !inside => {
            let e = if r.ty == CMD_READ { EINVAL } else { ENOSPC };
            rep.err(
                &r,
                e,
                &format!(
                    "{} bytes at {} are beyond the end of the export ({} bytes)",
                    r.len, r.offset, ex.size
                ),
            )
        }
        CMD_READ | CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES if !aligned => rep.err(
            &r,
            EINVAL,
            &format!(
                "{} bytes at {}: requests must be 4096-byte aligned",
                r.len, r.offset
            ),
        ),
        CMD_READ | CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES if count == 0 => rep.ok(&r),
        CMD_READ => {
            let rep = rep.clone();
            eng.read(first, count, move |res| {
                let _ = match res {
                    Ok(pieces) => rep.data(&r, &pieces),
                    Err(e) => rep.err(&r, EIO, &e.to_string()),
                };
            });
            Ok(())
        }
        CMD_WRITE => {
            let rep = rep.clone();
            eng.write(first, Arc::new(data), 0, count, move |res| {
                let _ = rep.changed(&r, res);
            });
            Ok(())
        }
        CMD_TRIM => {
            let rep = rep.clone();
            eng.trim(first, count, move |res| {
                let _ = rep.changed(&r, res);
            });
            Ok(())
        }
        CMD_WRITE_ZEROES if r.flags & CMD_FLAG_NO_HOLE == 0 => {
            // Absent blocks read as zeros: freeing them is writing zeros.
            let rep = rep.clone();
            eng.trim(first, count, move |res| {
                let _ = rep.changed(&r, res);
            });
            Ok(())
        }
        CMD_WRITE_ZEROES => {
            // The client wants them allocated: zeros written, in pieces
            // that share one buffer.
            let per = (MAX_HOLE_WRITE / BLOCK) as u64;
            let zeros = Arc::new(vec![0u8; (count.min(per) as usize) * BLOCK]);
            let join = Arc::new(Join {
                left: AtomicUsize::new(count.div_ceil(per) as usize),
                result: Mutex::new(Ok(())),
                reply: rep.clone(),
                req: r,
            });
            let mut at = 0;
            while at < count {
                let n = (count - at).min(per);
                let j = join.clone();
                eng.write(first + at, zeros.clone(), 0, n, move |res| j.one_done(res));
                at += n;
            }
            Ok(())
        }
        // Acknowledged writes are stored on every copy that is up:
        // nothing to flush.
        CMD_FLUSH => rep.ok(&r),
        CMD_BLOCK_STATUS if !rep.allocation => rep.err(
            &r,
            EINVAL,
            "BLOCK_STATUS needs the base:allocation context (SET_META_CONTEXT)",
        ),
        CMD_BLOCK_STATUS if !inside || r.len == 0 => rep.err(
            &r,
            EINVAL,
            &format!(
                "block status of {} bytes at {}: not inside the export",
                r.len, r.offset
            ),
        ),
        CMD_BLOCK_STATUS => {
            // Whole blocks around the range; extents of written and
            // never-written blocks from the device's bitmap.
            let lo = r.offset / BLOCK as u64;
            let hi = (r.offset + r.len as u64).div_ceil(BLOCK as u64);
            let w = &eng.shared().written;
            let mut d = ALLOCATION_ID.to_be_bytes().to_vec();
            let (mut b, mut at, mut extents) = (lo, r.offset, 0);
            while b < hi && extents < MAX_EXTENTS {
                let set = w.is_set(b);
                let mut e = b + 1;
                while e < hi && w.is_set(e) == set {
                    e += 1;
                }
                let end = (e * BLOCK as u64).min(r.offset + r.len as u64);
                d.extend_from_slice(&((end - at) as u32).to_be_bytes());
                let flags = if set { 0 } else { STATE_HOLE | STATE_ZERO };
                d.extend_from_slice(&flags.to_be_bytes());
                extents += 1;
                (b, at) = (e, end);
                if r.flags & CMD_FLAG_REQ_ONE != 0 {
                    break;
                }
            }
            let mut h = Vec::with_capacity(20);
            chunk(
                &mut h,
                REPLY_FLAG_DONE,
                REPLY_TYPE_BLOCK_STATUS,
                r.handle,
                d.len(),
            );
            rep.send(&[&h, &d])
        }
        t => rep.err(&r, EINVAL, &format!("command {t} is not supported")),
    }
}

/// Serve one client of `exports` (the first is the default) until it
/// disconnects.
pub fn serve_client(mut c: Box<dyn Io>, exports: &[Served], tls: &Tls) -> std::io::Result<()> {
    let Some(n) = handshake(&mut *c, exports, tls)? else {
        return Ok(());
    };
    let (ex, eng) = (&exports[n.export].export, exports[n.export].engine.clone());
    c.set_write_timeout(Some(REPLY_TIMEOUT))?;
    let rep = Arc::new(Replier {
        out: Mutex::new(Out {
            w: c.try_clone_box()?,
            backlog: Vec::new(),
            draining: false,
            gone: false,
        }),
        pending: Mutex::new(Vec::new()),
        backlog_len: AtomicUsize::new(0),
        gone: AtomicBool::new(false),
        structured: n.structured,
        allocation: n.allocation,
    });
    // Requests are read through a buffer: a burst of them (a queue depth's
    // worth) comes in with one system call, and their frames go to each
    // memory server together (the engine is corked on this thread, flushed
    // whenever the buffer runs dry and before any wait).
    let mut rd_buf = std::io::BufReader::with_capacity(READ_BUF, ReadHalf(&mut *c));
    eng.cork();
    let result = (|| -> std::io::Result<()> {
        loop {
            if rd_buf.buffer().len() < 28 {
                eng.flush();
            }
            // Bounded work in flight per connection: wait while too many
            // of its requests are running (each holds the replier), or
            // while the client leaves too many reply bytes untaken.
            while Arc::strong_count(&rep) > MAX_IN_FLIGHT {
                eng.flush();
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
            loop {
                match rep.backlog() {
                    (_, true) => return Err(std::io::Error::other("the client took no replies")),
                    (n, false) if n > MAX_BACKLOG => {
                        eng.flush();
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                    _ => break,
                }
            }
            let h = rd::<28>(&mut rd_buf)?;
            let magic = u32::from_be_bytes(h[0..4].try_into().unwrap());
            if magic != REQUEST_MAGIC {
                return Err(std::io::Error::other(format!(
                    "bad request magic {magic:#x}"
                )));
            }
            let r = Req {
                flags: u16::from_be_bytes(h[4..6].try_into().unwrap()),
                ty: u16::from_be_bytes(h[6..8].try_into().unwrap()),
                handle: u64::from_be_bytes(h[8..16].try_into().unwrap()),
                offset: u64::from_be_bytes(h[16..24].try_into().unwrap()),
                len: u32::from_be_bytes(h[24..28].try_into().unwrap()),
            };
            match r.ty {
                CMD_DISC => return Ok(()),
                CMD_WRITE if r.len > MAX_PAYLOAD => {
                    // Its payload cannot be skipped safely: refuse and hang up.
                    let _ = rep.err(&r, EOVERFLOW, "write larger than the advertised maximum");
                    return Err(std::io::Error::other("oversized write"));
                }
                CMD_READ if r.len > MAX_PAYLOAD => {
                    rep.err(&r, EOVERFLOW, "read larger than the advertised maximum")?;
                }
                CMD_WRITE => {
                    let mut data = vec![0u8; r.len as usize];
                    rd_buf.read_exact(&mut data)?;
                    dispatch(&eng, &rep, ex, r, data)?;
                }
                _ => dispatch(&eng, &rep, ex, r, Vec::new())?,
            }
        }
    })();
    eng.flush();
    drop(rd_buf);
    // Finish what is in flight before closing (DISC semantics).
    while Arc::strong_count(&rep) > 1 {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    c.close();
    match result {
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(()),
        r => {
            if let Err(e) = &r {
                warn!("nbd client: {e}");
            }
            r
        }
    }
}

/// Bytes of requests read at once (a queue depth of 16 requests is 448
/// bytes; a write's payload past the buffer is read straight into place).
const READ_BUF: usize = 64 << 10;

/// The reading side of a client connection, as a `Read` for the buffer.
struct ReadHalf<'a>(&'a mut dyn Io);

impl Read for ReadHalf<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.0.read(buf)
    }
}

/// A client that takes no reply bytes for this long is hung up on (its
/// writer gives up; its requests in flight are dropped with it).
const REPLY_TIMEOUT: Duration = Duration::from_secs(30);

/// Reply bytes a connection may leave untaken before its requests stop
/// being read: two of the largest replies.
const MAX_BACKLOG: usize = 2 * MAX_PAYLOAD as usize;

/// Extents in one BLOCK_STATUS reply at most (the client asks again for
/// the rest).
const MAX_EXTENTS: usize = 4096;

/// Requests of one connection in flight at most (the client's queue depth
/// is usually far lower; a client that pipelines more waits for room).
/// Each holds at most a MAX_PAYLOAD buffer: 64 bounds a connection's
/// request memory at 2 GiB, as the 64-deep queue before the engine did.
const MAX_IN_FLIGHT: usize = 64;
