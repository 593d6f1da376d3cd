//! One socket type for every pagefleet stream: plain TCP, or TLS over it.
//!
//! Plain streams are the `TcpStream` itself (writev, `recvmsg(MSG_WAITALL)`,
//! nothing in between). TLS streams keep the rustls connection behind a
//! mutex that is never held while waiting for the network: socket reads and
//! writes under it never block (`MSG_DONTWAIT`), and waits (`recv(MSG_PEEK)`,
//! `poll`) happen outside it. So one thread may read while another writes
//! (the migration destination's filler answers while the main thread reads
//! pages) without a writer stuck on a full socket holding up the reader that
//! would drain the peer. Socket timeouts (`SO_RCVTIMEO`/`SO_SNDTIMEO`) apply
//! to the waits as they do to plain reads and writes.

use crate::identity::Identity;
use crate::sys;
use crate::TlsError;
use rustls::{ClientConnection, Connection, ServerConnection};
use rustls_pki_types::ServerName;
use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::{Arc, Mutex, MutexGuard};

/// A connection: plain TCP or TLS over TCP. Cloning (`try_clone`) shares
/// the TLS state, so clones are the same conversation.
pub struct Stream {
    sock: TcpStream,
    tls: Option<Arc<Mutex<Tls>>>,
}

struct Tls {
    conn: Connection,
    /// Ciphertext read from the socket that rustls has not taken yet: one
    /// large `recv` feeds many of rustls's 4 KiB reads (it asks for no more
    /// per call; a system call each cost half the throughput).
    inbuf: Box<[u8]>,
    start: usize,
    end: usize,
}

/// Most ciphertext taken from the socket per `recv`.
const INBUF: usize = 256 * 1024;

/// rustls's reads: served from `inbuf`, refilled by one non-blocking `recv`.
struct Feed<'a> {
    sock: &'a TcpStream,
    buf: &'a mut [u8],
    start: &'a mut usize,
    end: &'a mut usize,
}

impl Read for Feed<'_> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if *self.start == *self.end {
            let n = sys::recv(&self.sock, self.buf, libc::MSG_DONTWAIT)?;
            *self.start = 0;
            *self.end = n;
            if n == 0 {
                return Ok(0);
            }
        }
        let n = out.len().min(*self.end - *self.start);
        out[..n].copy_from_slice(&self.buf[*self.start..*self.start + n]);
        *self.start += n;
        Ok(n)
    }
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream")
            .field("fd", &self.sock.as_raw_fd())
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl Stream {
    /// A plain TCP stream.
    pub fn plain(sock: TcpStream) -> Stream {
        Stream { sock, tls: None }
    }

    /// The server side of TLS on `sock`. The handshake runs on the first
    /// read or in [`Stream::handshake`] (blocking) / [`Stream::handshake_step`]
    /// (non-blocking); the client must present a certificate the cluster CA
    /// signed.
    pub fn tls_server(sock: TcpStream, id: &Identity) -> Result<Stream, TlsError> {
        let mut s = Stream::plain(sock);
        s.start_tls_server(id)?;
        Ok(s)
    }

    /// The client side of TLS on `sock`, expecting a server certificate for
    /// `server_name` (the host or address dialled). Call [`Stream::handshake`].
    pub fn tls_client(
        sock: TcpStream,
        id: &Identity,
        server_name: &str,
    ) -> Result<Stream, TlsError> {
        let mut s = Stream::plain(sock);
        s.start_tls_client(id, server_name)?;
        Ok(s)
    }

    /// Switch a plain stream to TLS, server side (after a STARTTLS exchange).
    pub fn start_tls_server(&mut self, id: &Identity) -> Result<(), TlsError> {
        let mut conn = ServerConnection::new(id.server.clone())?;
        // Every write is flushed at once; rustls need not cap what it holds.
        conn.set_buffer_limit(None);
        self.set_tls(conn.into())
    }

    /// Switch a plain stream to TLS, client side, expecting a server
    /// certificate for `server_name`. Call [`Stream::handshake`] next.
    pub fn start_tls_client(&mut self, id: &Identity, server_name: &str) -> Result<(), TlsError> {
        let name = ServerName::try_from(server_name.to_string())
            .map_err(|_| TlsError::BadName(format!("{server_name:?} is not a host name")))?;
        let mut conn = ClientConnection::new(id.client.clone(), name)?;
        conn.set_buffer_limit(None);
        self.set_tls(conn.into())
    }

    fn set_tls(&mut self, conn: Connection) -> Result<(), TlsError> {
        if self.tls.is_some() {
            return Err(TlsError::Config("the stream is TLS already".into()));
        }
        self.tls = Some(Arc::new(Mutex::new(Tls {
            conn,
            inbuf: vec![0u8; INBUF].into_boxed_slice(),
            start: 0,
            end: 0,
        })));
        Ok(())
    }

    /// Whether this stream is TLS.
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// The TCP socket underneath (addresses, options, polling).
    pub fn socket(&self) -> &TcpStream {
        &self.sock
    }

    /// Another handle on the same connection (and TLS state).
    pub fn try_clone(&self) -> io::Result<Stream> {
        Ok(Stream {
            sock: self.sock.try_clone()?,
            tls: self.tls.clone(),
        })
    }

    /// The common name of the certificate the peer presented (TLS only).
    pub fn peer_name(&self) -> Option<String> {
        let t = self.tls.as_ref()?;
        let g = lock(t).ok()?;
        let c = g.conn.peer_certificates()?.first()?.clone();
        crate::identity::common_name(&c)
    }

    /// Decrypted bytes are waiting in this process (a poll of the socket
    /// does not see them). No system call.
    pub fn buffered(&self) -> bool {
        match &self.tls {
            None => false,
            Some(t) => lock(t).is_ok_and(|mut g| {
                use std::io::BufRead;
                g.start < g.end || g.conn.reader().fill_buf().is_ok_and(|b| !b.is_empty())
            }),
        }
    }

    /// Finish the TLS handshake, waiting as the socket's timeouts allow.
    /// Plain streams: nothing to do.
    pub fn handshake(&self) -> io::Result<()> {
        let Some(t) = &self.tls else { return Ok(()) };
        loop {
            self.flush_tls(t, true)?;
            let mut g = lock(t)?;
            if !g.conn.is_handshaking() {
                break;
            }
            if !self.pull(&mut g)? {
                drop(g);
                wait_readable(&self.sock)?;
            }
        }
        self.flush_tls(t, true)
    }

    /// Move the handshake on without waiting: `Ok(true)` once it is done.
    /// For a non-blocking socket watched by poll.
    pub fn handshake_step(&self) -> io::Result<bool> {
        let Some(t) = &self.tls else { return Ok(true) };
        self.flush_tls(t, false)?;
        let mut g = lock(t)?;
        while g.conn.is_handshaking() {
            if !self.pull(&mut g)? {
                return Ok(false);
            }
        }
        drop(g);
        self.flush_tls(t, false)?;
        Ok(true)
    }

    /// Read what is here now: `Ok(None)` when nothing is.
    pub fn read_nonblocking(&self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        let r = match &self.tls {
            None => sys::recv(&self.sock, buf, libc::MSG_DONTWAIT),
            Some(t) => self.tls_read(t, buf, false),
        };
        match r {
            Ok(n) => Ok(Some(n)),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) =>
            {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Queue `buf` and send what the socket takes now, never waiting (a
    /// reply from a thread that serves many sockets). What is left goes
    /// out with the next write on this stream.
    pub fn send_now(&self, buf: &[u8]) -> io::Result<()> {
        match &self.tls {
            None => {
                let mut s = &self.sock;
                s.write_all(buf)
            }
            Some(t) => {
                lock(t)?.conn.writer().write_all(buf)?;
                self.flush_tls(t, false)
            }
        }
    }

    /// Write every byte the iovecs describe.
    ///
    /// # Safety
    /// Each iovec must describe memory valid for reads for the whole call.
    pub unsafe fn writev_all(&self, iov: &mut [libc::iovec]) -> io::Result<()> {
        match &self.tls {
            // SAFETY: the caller's contract.
            None => unsafe { sys::writev_all(self.sock.as_fd(), iov) },
            Some(t) => {
                let bufs: Vec<IoSlice<'_>> = iov
                    .iter()
                    .map(|v| {
                        // SAFETY: the caller promises each iovec is readable
                        // for the whole call.
                        IoSlice::new(unsafe {
                            std::slice::from_raw_parts(v.iov_base as *const u8, v.iov_len)
                        })
                    })
                    .collect();
                write_plaintext(&mut lock(t)?, &bufs)?;
                self.flush_tls(t, true)
            }
        }
    }

    fn tls_read(&self, t: &Mutex<Tls>, buf: &mut [u8], block: bool) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            {
                let mut g = lock(t)?;
                match g.conn.reader().read(buf) {
                    Ok(n) => return Ok(n),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e),
                }
                if self.pull(&mut g)? {
                    continue;
                }
            }
            if !block {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            wait_readable(&self.sock)?;
        }
    }

    /// Take in what ciphertext the socket holds, without waiting. `true`:
    /// something changed (bytes, or the peer closed), look again.
    fn pull(&self, g: &mut MutexGuard<'_, Tls>) -> io::Result<bool> {
        let t = &mut **g;
        let mut feed = Feed {
            sock: &self.sock,
            buf: &mut t.inbuf,
            start: &mut t.start,
            end: &mut t.end,
        };
        match t.conn.read_tls(&mut feed) {
            Ok(n) => {
                let r = g.conn.process_new_packets();
                // Handshake replies, or the alert that says why we give up.
                let _ = push(g, &self.sock);
                r.map_err(|e| io::Error::new(io::ErrorKind::InvalidData, TlsError::from(e)))?;
                if n == 0 && g.conn.is_handshaking() {
                    return Err(io::Error::new(
                        io::ErrorKind::ConnectionAborted,
                        "the peer closed the connection during the TLS handshake \
                         (did it refuse our certificate?)",
                    ));
                }
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(false),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(true),
            Err(e) => Err(e),
        }
    }

    /// Send the ciphertext rustls holds; with `block`, wait until all of it
    /// went (as the socket's send timeout allows).
    fn flush_tls(&self, t: &Mutex<Tls>, block: bool) -> io::Result<()> {
        loop {
            if !push(&mut lock(t)?, &self.sock)? || !block {
                return Ok(());
            }
            sys::wait_writable(&self.sock)?;
        }
    }
}

/// Hand all of `bufs` to rustls as one payload: it cuts full 16 KiB
/// records across the slices (one write per slice made a record of every
/// 4 KiB page: four times the records to seal, frame and open).
fn write_plaintext(g: &mut MutexGuard<'_, Tls>, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
    let total: usize = bufs.iter().map(|b| b.len()).sum();
    let mut done = 0;
    while done < total {
        // Skip what went already (rustls takes it all at once unless its
        // buffer limit says otherwise; there is none).
        let mut skip = done;
        let rest: Vec<IoSlice<'_>> = bufs
            .iter()
            .filter_map(|b| {
                if skip >= b.len() {
                    skip -= b.len();
                    return None;
                }
                let s = IoSlice::new(&b[skip..]);
                skip = 0;
                Some(s)
            })
            .collect();
        let n = g.conn.writer().write_vectored(&rest)?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        done += n;
    }
    Ok(total)
}

/// Write what rustls holds without waiting; `true` if some is left.
fn push(g: &mut MutexGuard<'_, Tls>, sock: &TcpStream) -> io::Result<bool> {
    while g.conn.wants_write() {
        match g.conn.write_tls(&mut DontWait(sock)) {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(true),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(false)
}

fn lock(t: &Mutex<Tls>) -> io::Result<MutexGuard<'_, Tls>> {
    t.lock()
        .map_err(|_| io::Error::other("TLS state poisoned by a panicking thread"))
}

impl Read for &Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match &self.tls {
            None => (&self.sock).read(buf),
            Some(t) => self.tls_read(t, buf, true),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        (&*self).read(buf)
    }
}

impl Write for &Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match &self.tls {
            None => (&self.sock).write(buf),
            Some(t) => {
                lock(t)?.conn.writer().write_all(buf)?;
                self.flush_tls(t, true)?;
                Ok(buf.len())
            }
        }
    }
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match &self.tls {
            None => (&self.sock).write_vectored(bufs),
            Some(t) => {
                let n = write_plaintext(&mut lock(t)?, bufs)?;
                self.flush_tls(t, true)?;
                Ok(n)
            }
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match &self.tls {
            None => Ok(()),
            Some(t) => self.flush_tls(t, true),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        (&*self).write(buf)
    }
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        (&*self).write_vectored(bufs)
    }
    fn flush(&mut self) -> io::Result<()> {
        (&*self).flush()
    }
}

impl pagefleet_proto::io::ReadAll for Stream {
    fn read_vectored_all(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        if self.tls.is_none() {
            return self.sock.read_vectored_all(bufs);
        }
        // Fill each buffer in turn; stop early only at the end of the stream.
        let mut total = 0;
        for b in bufs.iter_mut() {
            let mut off = 0;
            while off < b.len() {
                match (&*self).read(&mut b[off..]) {
                    Ok(0) => return Ok(total + off),
                    Ok(n) => off += n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) if total + off > 0 && e.kind() == io::ErrorKind::WouldBlock => {
                        return Ok(total + off)
                    }
                    Err(e) => return Err(e),
                }
            }
            total += off;
        }
        Ok(total)
    }
}

/// Socket reads and writes that never wait (whatever the socket's mode).
struct DontWait<'a>(&'a TcpStream);

impl Read for DontWait<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        sys::recv(self.0, buf, libc::MSG_DONTWAIT)
    }
}

impl Write for DontWait<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_vectored(&[IoSlice::new(buf)])
    }
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        sys::send_vectored_nowait(self.0, bufs)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Wait until the socket has bytes (or the peer closed), as its receive
/// timeout allows: a blocking one-byte peek, so `SO_RCVTIMEO` applies.
fn wait_readable(sock: &TcpStream) -> io::Result<()> {
    let mut b = [0u8; 1];
    loop {
        match sys::recv(sock, &mut b, libc::MSG_PEEK) {
            Ok(_) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}
