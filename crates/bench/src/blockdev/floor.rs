//! The floor for the DMPS export: the least an NBD server whose blocks are
//! on another process must do. Two processes, as DMPS has:
//!
//! - a page store: one thread serving one loopback connection, requests
//!   `{op, len, offset}` (16 bytes) answered in order from a plain buffer
//!   (reads: the bytes; writes: a 1-byte ack after the bytes are stored);
//! - a forwarder: an NBD server (the smallest handshake fio's libnbd
//!   accepts, simple replies) whose reader thread reads requests through a
//!   buffer and forwards each to the store (flushed when its input runs
//!   dry), and whose receiver thread reads the store's replies and writes
//!   the NBD replies (flushed when no store reply is at hand).
//!
//! No layout, no authentication, no bitmap, no TLS, no second copy: the two
//! TCP hops and their copies are what is left. `pagefleet bench nbd-floor`
//! runs it (internal).

use pagefleet_common::sys::splice::Splicer;
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;

/// Transfers this large skip the buffers and pass through the forwarder
/// spliced, socket to socket (no copy out and back in).
const DIRECT: usize = 32 << 10;

const OP_READ: u8 = 0;
const OP_WRITE: u8 = 1;

/// The page store: serve one connection from `mem`.
fn store(s: TcpStream, mem: &std::sync::Mutex<Vec<u8>>) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    let mut r = BufReader::with_capacity(256 << 10, s.try_clone()?);
    let mut w = BufWriter::with_capacity(256 << 10, s);
    loop {
        let mut h = [0u8; 16];
        if r.buffer().len() < 16 {
            w.flush()?;
        }
        if r.read_exact(&mut h).is_err() {
            return Ok(());
        }
        let len = u32::from_le_bytes(h[4..8].try_into().unwrap()) as usize;
        let off = u64::from_le_bytes(h[8..16].try_into().unwrap()) as usize;
        let range = off..off + len;
        let mut mem = mem.lock().unwrap_or_else(|e| e.into_inner());
        if range.end > mem.len() {
            return Err(std::io::Error::other("beyond the store"));
        }
        match h[0] {
            // Large replies straight from the store's memory to the socket.
            OP_READ if len >= DIRECT => {
                w.flush()?;
                w.get_mut().write_all(&mem[range])?
            }
            OP_READ => w.write_all(&mem[range])?,
            OP_WRITE if len >= DIRECT => {
                // Large payloads straight from the socket into the memory.
                w.flush()?;
                r.read_exact(&mut mem[range])?;
                w.write_all(&[0])?;
            }
            OP_WRITE => {
                let dst = &mut mem[range];
                let mut at = 0;
                while at < dst.len() {
                    let b = fill(&mut r, &mut w)?;
                    let n = b.len().min(dst.len() - at);
                    dst[at..at + n].copy_from_slice(&b[..n]);
                    r.consume_n(n);
                    at += n;
                }
                w.write_all(&[0])?;
            }
            _ => return Err(std::io::Error::other("bad op")),
        }
    }
}

fn rd<const N: usize>(r: &mut impl Read) -> std::io::Result<[u8; N]> {
    let mut b = [0u8; N];
    r.read_exact(&mut b)?;
    Ok(b)
}

fn opt_reply(w: &mut impl Write, opt: u32, ty: u32, data: &[u8]) -> std::io::Result<()> {
    let mut b = 0x0003_e889_0455_65a9u64.to_be_bytes().to_vec();
    b.extend_from_slice(&opt.to_be_bytes());
    b.extend_from_slice(&ty.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    w.write_all(&b)
}

/// The NBD handshake: GO (or EXPORT_NAME) for the one export; every other
/// option is unsupported.
fn handshake(c: &mut TcpStream, size: u64) -> std::io::Result<()> {
    let mut hello = b"NBDMAGIC".to_vec();
    hello.extend_from_slice(b"IHAVEOPT");
    hello.extend_from_slice(&3u16.to_be_bytes());
    c.write_all(&hello)?;
    let flags = u32::from_be_bytes(rd::<4>(c)?);
    loop {
        let _magic = rd::<8>(c)?;
        let opt = u32::from_be_bytes(rd::<4>(c)?);
        let len = u32::from_be_bytes(rd::<4>(c)?);
        let mut data = vec![0u8; len as usize];
        c.read_exact(&mut data)?;
        // HAS_FLAGS | SEND_FLUSH
        let tflags: u16 = 1 | 4;
        match opt {
            1 => {
                let mut b = size.to_be_bytes().to_vec();
                b.extend_from_slice(&tflags.to_be_bytes());
                if flags & 2 == 0 {
                    b.extend_from_slice(&[0u8; 124]);
                }
                return c.write_all(&b);
            }
            7 => {
                let mut info = 0u16.to_be_bytes().to_vec();
                info.extend_from_slice(&size.to_be_bytes());
                info.extend_from_slice(&tflags.to_be_bytes());
                opt_reply(c, opt, 3, &info)?;
                opt_reply(c, opt, 1, &[])?;
                return Ok(());
            }
            _ => opt_reply(c, opt, (1 << 31) + 1, &[])?,
        }
    }
}

/// What the receiver needs to answer a forwarded request.
struct Pending {
    handle: u64,
    read_len: usize,
}

/// Forward one NBD client to the store at `store_addr`.
fn forward(mut c: TcpStream, store_addr: &str, size: u64) -> std::io::Result<()> {
    c.set_nodelay(true)?;
    handshake(&mut c, size)?;
    let st = TcpStream::connect(store_addr)?;
    st.set_nodelay(true)?;
    let (tx, rx) = mpsc::channel::<Pending>();
    let (st_r, c_w) = (st.try_clone()?, c.try_clone()?);
    let receiver = std::thread::spawn(move || -> std::io::Result<()> {
        let mut r = BufReader::with_capacity(256 << 10, st_r);
        let mut w = BufWriter::with_capacity(256 << 10, c_w);
        let mut splicer = Splicer::new()?;
        loop {
            // Replies written so far go out before this thread waits.
            let p = match rx.try_recv() {
                Ok(p) => p,
                Err(mpsc::TryRecvError::Empty) => {
                    w.flush()?;
                    match rx.recv() {
                        Ok(p) => p,
                        Err(_) => break,
                    }
                }
                Err(mpsc::TryRecvError::Disconnected) => break,
            };
            let mut h = 0x6744_6698u32.to_be_bytes().to_vec();
            h.extend_from_slice(&0u32.to_be_bytes());
            h.extend_from_slice(&p.handle.to_be_bytes());
            if p.read_len < DIRECT {
                w.write_all(&h)?;
            }
            if p.read_len >= DIRECT {
                w.write_all(&h)?;
                w.flush()?;
                pass_on(&mut r, w.get_mut(), &mut splicer, p.read_len)?;
                continue;
            }
            if p.read_len > 0 {
                relay(&mut r, &mut w, p.read_len)?;
            } else {
                fill(&mut r, &mut w)?;
                r.consume_n(1);
            }
        }
        w.flush()
    });
    let mut r = BufReader::with_capacity(64 << 10, c);
    let mut w = BufWriter::with_capacity(256 << 10, st);
    let mut splicer = Splicer::new()?;
    let result = (|| -> std::io::Result<()> {
        loop {
            if r.buffer().len() < 28 {
                w.flush()?;
            }
            let h = rd::<28>(&mut r)?;
            let ty = u16::from_be_bytes(h[6..8].try_into().unwrap());
            let handle = u64::from_be_bytes(h[8..16].try_into().unwrap());
            let off = u64::from_be_bytes(h[16..24].try_into().unwrap());
            let len = u32::from_be_bytes(h[24..28].try_into().unwrap());
            let mut sh = [0u8; 16];
            sh[4..8].copy_from_slice(&len.to_le_bytes());
            sh[8..16].copy_from_slice(&off.to_le_bytes());
            match ty {
                0 => {
                    sh[0] = OP_READ;
                    w.write_all(&sh)?;
                    let _ = tx.send(Pending {
                        handle,
                        read_len: len as usize,
                    });
                }
                1 => {
                    sh[0] = OP_WRITE;
                    w.write_all(&sh)?;
                    if len as usize >= DIRECT {
                        // Large: passed on after the header, not copied.
                        w.flush()?;
                        pass_on(&mut r, w.get_mut(), &mut splicer, len as usize)?;
                        let _ = tx.send(Pending {
                            handle,
                            read_len: 0,
                        });
                        continue;
                    }
                    // The payload goes through the buffers as it comes.
                    relay(&mut r, &mut w, len as usize)?;
                    let _ = tx.send(Pending {
                        handle,
                        read_len: 0,
                    });
                }
                2 => return Ok(()),
                _ => {
                    // FLUSH and the rest: an empty write to the store (its
                    // one-byte ack) keeps the reply in order.
                    sh[0] = OP_WRITE;
                    sh[4..8].copy_from_slice(&0u32.to_le_bytes());
                    w.write_all(&sh)?;
                    let _ = tx.send(Pending {
                        handle,
                        read_len: 0,
                    });
                }
            }
        }
    })();
    let _ = w.flush();
    drop(tx);
    let _ = receiver.join();
    match result {
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(()),
        r => r,
    }
}

/// Pass `len` bytes from `r` to `w` through both buffers, as they come.
fn relay<R: Read, W: Write>(r: &mut BufReader<R>, w: &mut W, len: usize) -> std::io::Result<()> {
    let mut left = len;
    while left > 0 {
        let buf = fill(r, w)?;
        let n = buf.len().min(left);
        w.write_all(&buf[..n])?;
        r.consume_n(n);
        left -= n;
    }
    Ok(())
}

/// Pass `len` bytes from `r` on to `w`: what `r` has buffered is written,
/// the rest spliced from socket to socket (no copy through this process).
fn pass_on(
    r: &mut BufReader<TcpStream>,
    w: &mut TcpStream,
    splicer: &mut Splicer,
    len: usize,
) -> std::io::Result<()> {
    let n = r.buffer().len().min(len);
    w.write_all(&r.buffer()[..n])?;
    r.consume_n(n);
    splicer.forward(r.get_ref(), w, len - n)
}

/// The next buffered bytes of `r`; what `w` holds goes out first when `r`
/// must wait (each side flushes before it blocks: nothing waits on bytes
/// sitting in a buffer).
fn fill<'a, R: Read, W: Write>(r: &'a mut BufReader<R>, w: &mut W) -> std::io::Result<&'a [u8]> {
    if r.buffer().is_empty() {
        w.flush()?;
    }
    let b = std::io::BufRead::fill_buf(r)?;
    if b.is_empty() {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok(b)
}

trait Consume {
    fn consume_n(&mut self, n: usize);
}

impl<R: Read> Consume for BufReader<R> {
    fn consume_n(&mut self, n: usize) {
        std::io::BufRead::consume(self, n)
    }
}

/// `pagefleet bench nbd-floor --port P --size S`: the forwarder, serving
/// NBD clients on 127.0.0.1:P until killed, and the store in a process of
/// its own (`--store`; as a memory server is: a forwarder and its store
/// in one process would switch between them more cheaply than DMPS can).
/// Prints `listening` once clients may connect.
pub fn main(port: u16, size: u64, store_only: bool) -> anyhow::Result<()> {
    if store_only {
        return serve_store(size);
    }
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    cmd.args(["bench", "nbd-floor", "--store", "--size", &size.to_string()])
        .stdout(std::process::Stdio::piped());
    pagefleet_common::sys::process::die_with_parent(&mut cmd);
    let mut child = cmd.spawn()?;
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut BufReader::new(child.stdout.take().expect("piped")),
        &mut line,
    )?;
    let store_addr = line
        .trim()
        .strip_prefix("store ")
        .ok_or_else(|| anyhow::anyhow!("the floor's store said {line:?}"))?
        .to_string();
    let l = TcpListener::bind(("127.0.0.1", port))?;
    println!("listening {}", l.local_addr()?);
    std::io::stdout().flush()?;
    // One store for every client (fio's fill and its jobs connect in turn).
    let shared = std::sync::Arc::new(store_addr);
    for c in l.incoming().flatten() {
        let a = shared.clone();
        std::thread::spawn(move || forward(c, &a, size));
    }
    Ok(())
}

/// The store's process: one memory, a thread per connection; prints
/// `store ADDR`.
fn serve_store(size: u64) -> anyhow::Result<()> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    // One memory for every connection, touched now (no page faults while
    // measured).
    let mem = std::sync::Arc::new(std::sync::Mutex::new(vec![1u8; size as usize]));
    println!("store {}", l.local_addr()?);
    std::io::stdout().flush()?;
    for s in l.incoming().flatten() {
        let mem = mem.clone();
        std::thread::spawn(move || store(s, &mem));
    }
    Ok(())
}
