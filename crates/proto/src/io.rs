//! Blocking I/O helpers shared by server and client: a small receive buffer
//! for headers and short bodies, with page data read straight from the socket
//! into its final place (no intermediate copy), and vectored writes.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::TcpStream;

/// A byte source that can fill a whole vectored buffer in one call when it
/// knows how. For TCP sockets this is `recvmsg(MSG_WAITALL)`: one syscall per
/// 128 KiB frame instead of one per arriving segment batch.
pub trait ReadAll: Read {
    /// Fill `bufs` in order, waiting for all of it (recvmsg MSG_WAITALL); bytes read.
    fn read_vectored_all(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        self.read_vectored(bufs)
    }
}

impl ReadAll for TcpStream {
    fn read_vectored_all(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        crate::sys::recv_all_vectored(self, bufs)
    }
}

impl ReadAll for &[u8] {}

/// Receive buffer. Headers and small bodies are read through it so that one
/// `read` can pick up many pipelined small frames; bulk page data bypasses it.
pub struct RecvBuf {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    read_max: usize,
    /// The last read returned less than it asked for: the stream had
    /// nothing more at that moment.
    drained: bool,
}

impl RecvBuf {
    /// A buffer of `cap` bytes.
    pub fn new(cap: usize) -> RecvBuf {
        RecvBuf {
            buf: vec![0u8; cap].into_boxed_slice(),
            start: 0,
            end: 0,
            read_max: cap,
            drained: false,
        }
    }
    /// Read at most this many bytes ahead of what is needed. A small value
    /// (1 KiB) still batches many small pipelined frames per syscall, while
    /// bulk page data following a header is left in the socket to be read
    /// straight into its destination instead of being copied out of here.
    pub fn set_read_max(&mut self, n: usize) {
        self.read_max = n.clamp(1, self.buf.len());
    }
    /// Whether the last read from the stream came back short (it had no
    /// more bytes then). Whoever learns that bytes arrived since (an edge
    /// from epoll) clears it with `forget_drained`.
    pub fn drained(&self) -> bool {
        self.drained
    }
    /// Bytes may have arrived since the last read.
    pub fn forget_drained(&mut self) {
        self.drained = false;
    }
    /// Its size.
    pub fn capacity(&self) -> usize {
        self.buf.len()
    }
    /// Bytes received and not yet consumed.
    pub fn available(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }
    /// How many (pages, bytes).
    pub fn len(&self) -> usize {
        self.end - self.start
    }
    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }
    /// Drop `n` bytes from the front.
    pub fn consume(&mut self, n: usize) {
        assert!(n <= self.len());
        self.start += n;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
    }
    fn make_room(&mut self, n: usize) {
        if self.start + n > self.buf.len() {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
    }
    /// The free tail of the buffer, for a caller doing its own (e.g.
    /// non-blocking) read; follow with `commit`.
    pub fn spare(&mut self) -> &mut [u8] {
        self.make_room(self.read_max);
        let hi = (self.end + self.read_max).min(self.buf.len());
        &mut self.buf[self.end..hi]
    }
    /// Count `n` bytes written into the free space as received.
    pub fn commit(&mut self, n: usize) {
        assert!(self.end + n <= self.buf.len());
        self.end += n;
    }
    /// Read until at least `n` bytes are buffered. Returns `Ok(false)` if the
    /// peer closed the stream cleanly before any byte of a new frame arrived;
    /// EOF in the middle of a frame is `UnexpectedEof`.
    pub fn fill_to<R: Read + ?Sized>(&mut self, r: &mut R, n: usize) -> io::Result<bool> {
        assert!(n <= self.buf.len());
        self.make_room(n);
        while self.len() < n {
            let want = (n - self.len()).max(self.read_max);
            let hi = (self.end + want).min(self.buf.len());
            let got = match r.read(&mut self.buf[self.end..hi]) {
                Ok(g) => g,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            self.drained = got < hi - self.end;
            if got == 0 {
                if self.is_empty() {
                    return Ok(false);
                }
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "peer closed the connection mid-frame",
                ));
            }
            self.end += got;
        }
        Ok(true)
    }
    /// Fill `dst` exactly: buffered bytes first, then straight from `r`.
    pub fn read_exact_into<R: Read + ?Sized>(
        &mut self,
        r: &mut R,
        dst: &mut [u8],
    ) -> io::Result<()> {
        let n = self.len().min(dst.len());
        dst[..n].copy_from_slice(&self.buf[self.start..self.start + n]);
        self.consume(n);
        if n < dst.len() {
            self.drained = false;
            r.read_exact(&mut dst[n..])?;
        }
        Ok(())
    }
    /// Fill every slice exactly, in order: buffered bytes first, then with
    /// vectored reads straight from `r`.
    pub fn read_exact_vectored<R: ReadAll + ?Sized>(
        &mut self,
        r: &mut R,
        mut bufs: &mut [IoSliceMut<'_>],
    ) -> io::Result<()> {
        // Drain what is buffered into the leading slices.
        while !self.is_empty() && !bufs.is_empty() {
            let first = &mut bufs[0];
            let n = self.len().min(first.len());
            first[..n].copy_from_slice(&self.buf[self.start..self.start + n]);
            self.consume(n);
            IoSliceMut::advance_slices(&mut bufs, n);
        }
        while !bufs.is_empty() {
            if bufs[0].is_empty() {
                IoSliceMut::advance_slices(&mut bufs, 0);
                continue;
            }
            self.drained = false;
            match r.read_vectored_all(bufs) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "peer closed the connection mid-frame",
                    ))
                }
                Ok(n) => IoSliceMut::advance_slices(&mut bufs, n),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
    /// Read and discard `n` bytes.
    pub fn skip<R: Read + ?Sized>(&mut self, r: &mut R, mut n: usize) -> io::Result<()> {
        while n > 0 {
            if self.is_empty() && !self.fill_to(r, 1)? {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "peer closed the connection mid-frame",
                ));
            }
            let k = self.len().min(n);
            self.consume(k);
            n -= k;
        }
        Ok(())
    }
}

/// Write every slice completely, with as few syscalls as the kernel allows.
pub fn write_all_vectored<W: Write + ?Sized>(
    w: &mut W,
    mut bufs: &mut [IoSlice<'_>],
) -> io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        match w.write_vectored(bufs) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "connection accepted no more bytes",
                ))
            }
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Waits up to `timeout_ms` for the peer of a connected socket to hang up
/// (close or shut down its side); true when it has. A long-running request
/// (a migration) uses it to notice its caller's Ctrl-C at once rather than
/// at its next write.
pub fn peer_hung_up(fd: &impl std::os::fd::AsFd, timeout_ms: i32) -> bool {
    crate::sys::peer_hung_up(fd, timeout_ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reader that returns at most `step` bytes per call, to exercise the
    /// partial-read paths.
    struct Trickle<'a> {
        data: &'a [u8],
        step: usize,
    }
    impl ReadAll for Trickle<'_> {}
    impl Read for Trickle<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = self.step.min(buf.len()).min(self.data.len());
            buf[..n].copy_from_slice(&self.data[..n]);
            self.data = &self.data[n..];
            Ok(n)
        }
    }

    #[test]
    fn vectored_read_through_buffer() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        for step in [1, 7, 100, 4096, 20000] {
            let mut r = Trickle { data: &data, step };
            let mut rb = RecvBuf::new(64);
            assert!(rb.fill_to(&mut r, 10).unwrap());
            assert_eq!(rb.available()[..10], data[..10]);
            rb.consume(10);
            let (mut a, mut b) = (vec![0u8; 3000], vec![0u8; 6990]);
            {
                let mut v = [IoSliceMut::new(&mut a), IoSliceMut::new(&mut b)];
                rb.read_exact_vectored(&mut r, &mut v).unwrap();
            }
            assert_eq!(a[..], data[10..3010]);
            assert_eq!(b[..], data[3010..]);
            assert!(!rb.fill_to(&mut r, 1).unwrap());
        }
    }
}
