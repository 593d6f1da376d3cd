//! Moving bytes from one socket to another without copying them through
//! user space: splice(2) from the source into a pipe, then from the pipe
//! into the destination. A forwarder (an NBD export in front of memory
//! servers) passes large payloads on this way: the kernel hands the
//! received buffers' pages on instead of a copy out and a copy back in.

use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};

/// The pipe a [`Splicer`] moves bytes through.
pub struct Splicer {
    rd: OwnedFd,
    wr: OwnedFd,
    /// Its capacity, bytes (what one round moves at most).
    cap: usize,
}

/// The capacity asked for: a 128 KiB payload in one round, with room.
const PIPE_BYTES: i32 = 1 << 20;

impl Splicer {
    /// A pipe of up to 1 MiB (less if the system's pipe-max-size is lower).
    pub fn new() -> io::Result<Splicer> {
        let mut fds = [0i32; 2];
        // SAFETY: fds is a valid array of two ints for pipe2 to fill.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: pipe2 succeeded: both are open descriptors this process
        // owns and nothing else holds.
        let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // SAFETY: F_SETPIPE_SZ on our pipe's descriptor; failure leaves the
        // default size, which the capacity query below reports.
        unsafe { libc::fcntl(wr.as_raw_fd(), libc::F_SETPIPE_SZ, PIPE_BYTES) };
        // SAFETY: F_GETPIPE_SZ on our pipe's descriptor.
        let cap = unsafe { libc::fcntl(wr.as_raw_fd(), libc::F_GETPIPE_SZ) };
        if cap <= 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Splicer {
            rd,
            wr,
            cap: cap as usize,
        })
    }

    /// Move exactly `len` bytes from `src` to `dst` (both stream sockets,
    /// blocking, their own timeouts apply). An early end of `src` is
    /// `UnexpectedEof`; on any error the connection pair is unusable (bytes
    /// may be left in the pipe: the next call would send them), so the
    /// caller drops both connections — and this splicer.
    pub fn forward(&mut self, src: &impl AsFd, dst: &impl AsFd, mut len: usize) -> io::Result<()> {
        let (s, d) = (src.as_fd().as_raw_fd(), dst.as_fd().as_raw_fd());
        while len > 0 {
            let want = len.min(self.cap);
            let mut inpipe = 0;
            while inpipe < want {
                let n = splice(s, self.wr.as_raw_fd(), want - inpipe, true)?;
                if n == 0 {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                inpipe += n;
            }
            let mut out = 0;
            while out < inpipe {
                let n = splice(self.rd.as_raw_fd(), d, inpipe - out, len > inpipe)?;
                if n == 0 {
                    return Err(io::ErrorKind::WriteZero.into());
                }
                out += n;
            }
            len -= inpipe;
        }
        Ok(())
    }
}

impl Splicer {
    /// Move exactly `len` bytes from the stream socket `src` into `file`
    /// at byte `off` (a memfd or regular file): the kernel copies them out
    /// of the socket's buffers into the file's pages once, and shmem does
    /// not zero a page it allocates for a whole-page write. An early end of
    /// `src` is `UnexpectedEof`; on error the pipe may hold bytes: drop
    /// this splicer with the connection.
    pub fn into_file(
        &mut self,
        src: &impl AsFd,
        file: &impl AsFd,
        off: u64,
        len: usize,
    ) -> io::Result<()> {
        let (s, f) = (src.as_fd().as_raw_fd(), file.as_fd().as_raw_fd());
        let mut done = 0usize;
        while done < len {
            let n = splice(s, self.wr.as_raw_fd(), (len - done).min(self.cap), true)?;
            if n == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            let mut m = 0usize;
            while m < n {
                let at = off
                    .checked_add((done + m) as u64)
                    .and_then(|o| i64::try_from(o).ok())
                    .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
                let k = splice_at(self.rd.as_raw_fd(), f, at, n - m)?;
                if k == 0 {
                    return Err(io::ErrorKind::WriteZero.into());
                }
                m += k;
            }
            done += n;
        }
        Ok(())
    }
}

/// Send exactly `len` bytes of `file` from byte `off` on the stream socket
/// `dst` with sendfile(2): the socket takes references to the file's pages
/// instead of a copy through user space. The bytes are those of the pages
/// when they reach the wire: a caller whose file changes meanwhile must
/// track changes and send the page again (a migration round does).
pub fn send_file(file: &impl AsFd, off: u64, len: usize, dst: &impl AsFd) -> io::Result<()> {
    let (f, d) = (file.as_fd().as_raw_fd(), dst.as_fd().as_raw_fd());
    let mut at = i64::try_from(off).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let end = at
        .checked_add(i64::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?)
        .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
    while at < end {
        // SAFETY: both descriptors are borrowed open for the call; `at` is
        // a local the kernel advances; no user memory is passed.
        let n = retrying(|| unsafe { libc::sendfile(d, f, &mut at, (end - at) as usize) })?;
        if n == 0 {
            // The file ends before `off + len`.
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
    }
    Ok(())
}

/// Send all of `buf` on the stream socket `dst` with MSG_MORE: the kernel
/// holds it for the bytes that follow (a header before [`send_file`]'s
/// payload leaves in the same segment, not one of its own).
pub fn send_more(dst: &impl AsFd, mut buf: &[u8]) -> io::Result<()> {
    let d = dst.as_fd().as_raw_fd();
    while !buf.is_empty() {
        // SAFETY: reading `buf`, its length; the borrow keeps `dst` open.
        let n = retrying(|| unsafe {
            libc::send(
                d,
                buf.as_ptr().cast(),
                buf.len(),
                libc::MSG_MORE | libc::MSG_NOSIGNAL,
            )
        })?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        buf = &buf[n..];
    }
    Ok(())
}

/// A system call returning a byte count or -1 with errno, called again
/// while it is interrupted (EINTR).
fn retrying(mut call: impl FnMut() -> isize) -> io::Result<usize> {
    loop {
        let n = call();
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// splice(2) from the pipe `from` into `to` at file offset `at`, retried on EINTR.
fn splice_at(from: i32, to: i32, at: i64, len: usize) -> io::Result<usize> {
    retrying(|| {
        let mut o = at;
        // SAFETY: both are open descriptors borrowed for the call; `o` is a
        // local offset the kernel reads and advances; no memory is passed.
        unsafe {
            libc::splice(
                from,
                std::ptr::null_mut(),
                to,
                &mut o,
                len,
                libc::SPLICE_F_MOVE,
            )
        }
    })
}

/// One splice(2) call, retried on EINTR.
fn splice(from: i32, to: i32, len: usize, more: bool) -> io::Result<usize> {
    let mut flags = libc::SPLICE_F_MOVE;
    if more {
        flags |= libc::SPLICE_F_MORE;
    }
    // SAFETY: both are open descriptors borrowed for the call; null
    // offsets (sockets and pipes have none); no memory is passed.
    retrying(|| unsafe {
        libc::splice(
            from,
            std::ptr::null_mut(),
            to,
            std::ptr::null_mut(),
            len,
            flags,
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};

    #[test]
    fn a_file_range_goes_out_whole_and_lands_at_its_offset() {
        use std::io::{Seek, SeekFrom};
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = l.local_addr().unwrap();
        let w = TcpStream::connect(a).unwrap();
        let r = l.accept().unwrap().0;
        let data: Vec<u8> = (0..1_500_000u32).map(|i| (i * 13 % 251) as u8).collect();
        let file =
            |len: u64| std::fs::File::from(crate::sys::mapping::memfd(c"t", len, 0).unwrap());
        let mut src = file(0);
        src.write_all(&data).unwrap();
        let mut dst = file(0);
        let (off, len) = (4096u64, 1_200_000usize);
        let t = std::thread::spawn(move || send_file(&src, off, len, &w));
        let mut sp = Splicer::new().unwrap();
        sp.into_file(&r, &dst, 8192, len).unwrap();
        t.join().unwrap().unwrap();
        let mut got = vec![0u8; len];
        dst.seek(SeekFrom::Start(8192)).unwrap();
        dst.read_exact(&mut got).unwrap();
        assert!(got == data[off as usize..off as usize + len]);
        // Past the file's end: an error, not a short send.
        let (w2, _r2) = {
            let w2 = TcpStream::connect(a).unwrap();
            (w2, l.accept().unwrap().0)
        };
        let small = file(0);
        let e = send_file(&small, 0, 10, &w2).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn bytes_pass_whole_and_in_order_and_an_early_end_is_an_error() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = l.local_addr().unwrap();
        let mut src_w = TcpStream::connect(a).unwrap();
        let src_r = l.accept().unwrap().0;
        let dst_w = TcpStream::connect(a).unwrap();
        let mut dst_r = l.accept().unwrap().0;
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let d2 = data.clone();
        let t = std::thread::spawn(move || {
            src_w.write_all(&d2).unwrap();
            src_w
        });
        let mut sp = Splicer::new().unwrap();
        let r = std::thread::spawn(move || {
            let mut got = vec![0u8; 3_000_000];
            dst_r.read_exact(&mut got).unwrap();
            got
        });
        sp.forward(&src_r, &dst_w, data.len()).unwrap();
        assert!(r.join().unwrap() == data);
        let src_w = t.join().unwrap();
        drop(src_w);
        let e = sp.forward(&src_r, &dst_w, 10).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }
}
