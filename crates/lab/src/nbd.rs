//! A raw NBD client for drills and protocol tests: fixed newstyle, GO for
//! a named export with block sizes, simple replies. Its protocol numbers
//! are written here from the NBD protocol document, not taken from the
//! server, so a test that uses it checks the server against the document.
//!
//! And the mirror's drill that the system test and `bench blockdev` share:
//! writes in flight while a memory server is killed, then every
//! acknowledged write read back.

use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// NBD_CMD_READ.
pub const CMD_READ: u16 = 0;
/// NBD_CMD_WRITE.
pub const CMD_WRITE: u16 = 1;
/// NBD_CMD_TRIM.
pub const CMD_TRIM: u16 = 4;
/// The request magic.
const REQUEST_MAGIC: u32 = 0x2560_9513;
/// The simple reply magic.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// NBD_OPT_GO.
pub const OPT_GO: u32 = 7;
/// NBD_REP_ACK.
pub const REP_ACK: u32 = 1;
/// NBD_REP_INFO.
pub const REP_INFO: u32 = 3;
/// NBD_INFO_BLOCK_SIZE.
const INFO_BLOCK_SIZE: u16 = 3;
/// Client flags: fixed newstyle, no zeroes.
const CLIENT_FLAGS: u32 = 3;

/// An option haggling connection: the server's greeting read, the client
/// flags sent.
pub fn greet(addr: &str, timeout: Duration) -> Result<TcpStream> {
    let mut s = TcpStream::connect(addr).with_context(|| format!("connect to {addr}"))?;
    s.set_read_timeout(Some(timeout))?;
    let mut hello = [0u8; 18];
    s.read_exact(&mut hello).context("the server's greeting")?;
    if &hello[..8] != b"NBDMAGIC" || &hello[8..16] != b"IHAVEOPT" {
        bail!("{addr} is not a newstyle NBD server");
    }
    s.write_all(&CLIENT_FLAGS.to_be_bytes())?;
    Ok(s)
}

/// Send option `opt` with `data`.
pub fn option(s: &mut TcpStream, opt: u32, data: &[u8]) -> Result<()> {
    let mut b = b"IHAVEOPT".to_vec();
    b.extend_from_slice(&opt.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    Ok(s.write_all(&b)?)
}

/// One option reply: its type and data.
pub fn option_reply(s: &mut TcpStream) -> Result<(u32, Vec<u8>)> {
    let mut h = [0u8; 20];
    s.read_exact(&mut h).context("an option reply")?;
    let ty = u32::from_be_bytes(h[12..16].try_into().unwrap());
    let len = u32::from_be_bytes(h[16..20].try_into().unwrap());
    if len > 64 << 10 {
        bail!("an option reply of {len} bytes");
    }
    let mut d = vec![0u8; len as usize];
    s.read_exact(&mut d)?;
    Ok((ty, d))
}

/// The body of GO for `name`, asking for block sizes.
pub fn go_body(name: &str) -> Vec<u8> {
    let mut go = (name.len() as u32).to_be_bytes().to_vec();
    go.extend_from_slice(name.as_bytes());
    go.extend_from_slice(&1u16.to_be_bytes());
    go.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    go
}

/// A connection in transmission on export `name` ("" is the default).
pub fn connect(addr: &str, name: &str, timeout: Duration) -> Result<TcpStream> {
    let mut s = greet(addr, timeout)?;
    option(&mut s, OPT_GO, &go_body(name))?;
    loop {
        match option_reply(&mut s)? {
            (REP_ACK, _) => return Ok(s),
            (REP_INFO, _) => {}
            (t, d) => bail!(
                "the export refused GO ({t:#x}): {}",
                String::from_utf8_lossy(&d)
            ),
        }
    }
}

/// A request header.
pub fn request(ty: u16, handle: u64, off: u64, len: u32) -> Vec<u8> {
    let mut b = REQUEST_MAGIC.to_be_bytes().to_vec();
    b.extend_from_slice(&0u16.to_be_bytes());
    b.extend_from_slice(&ty.to_be_bytes());
    b.extend_from_slice(&handle.to_be_bytes());
    b.extend_from_slice(&off.to_be_bytes());
    b.extend_from_slice(&len.to_be_bytes());
    b
}

/// A simple reply's header: (error, handle).
pub fn simple_reply(r: &mut impl Read) -> Result<(u32, u64)> {
    let mut h = [0u8; 16];
    r.read_exact(&mut h).context("a simple reply")?;
    let magic = u32::from_be_bytes(h[0..4].try_into().unwrap());
    if magic != SIMPLE_REPLY_MAGIC {
        bail!("a reply with magic {magic:#x}, not a simple reply");
    }
    Ok((
        u32::from_be_bytes(h[4..8].try_into().unwrap()),
        u64::from_be_bytes(h[8..16].try_into().unwrap()),
    ))
}

/// Bytes per write in the drill.
pub const DRILL_SLOT: u32 = 64 << 10;
/// Writes the drill keeps in flight.
pub const DRILL_IN_FLIGHT: u64 = 32;

/// What the mirror drill saw.
#[derive(Clone, Debug, Serialize)]
pub struct Drill {
    /// Writes sent.
    pub writes: u64,
    /// Of them, acknowledged.
    pub acknowledged: u64,
    /// Acknowledged writes that did not read back (should be none).
    pub lost: u64,
    /// Acknowledged writes whose read-back failed outright.
    pub read_errors: u64,
}

/// A slot's content: its own pseudo-random bytes.
pub fn drill_content(slot: u64) -> Vec<u8> {
    let mut x = slot.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..DRILL_SLOT / 8)
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()
        })
        .collect()
}

/// The mirror's promise, tried: keep 32 writes of 64 KiB in flight over
/// the export at `addr` (`slots` of them), call `kill` (a memory server
/// dies) a third of the way in, then read every acknowledged write back on
/// a fresh connection. A write acknowledged before every copy was stored
/// reads back wrong (or fails) here.
pub fn mirror_drill(addr: &str, slots: u64, kill: impl FnOnce()) -> Result<Drill> {
    let timeout = Duration::from_secs(60);
    let s = connect(addr, "", timeout).context("the drill's writer")?;
    let mut r = s.try_clone()?;
    let (tx, rx) = std::sync::mpsc::channel::<(u64, u32)>();
    let reader = std::thread::spawn(move || {
        for _ in 0..slots {
            let Ok((err, handle)) = simple_reply(&mut r) else {
                return;
            };
            if tx.send((handle, err)).is_err() {
                return;
            }
        }
    });
    let mut w = s.try_clone()?;
    let (mut acked, mut sent, mut answered) = (Vec::new(), 0u64, 0u64);
    let mut kill = Some(kill);
    while answered < slots {
        while sent < slots && sent - answered < DRILL_IN_FLIGHT {
            let mut b = request(CMD_WRITE, sent, sent * DRILL_SLOT as u64, DRILL_SLOT);
            b.extend_from_slice(&drill_content(sent));
            w.write_all(&b)?;
            sent += 1;
        }
        let (h, err) = rx.recv_timeout(timeout).context("a write's reply")?;
        answered += 1;
        if err == 0 {
            acked.push(h);
        }
        if answered >= slots / 3 {
            if let Some(k) = kill.take() {
                k()
            }
        }
    }
    let _ = reader.join();
    let mut s2 = connect(addr, "", timeout).context("the drill's reader")?;
    let (mut lost, mut read_errors) = (0, 0);
    for &slot in &acked {
        s2.write_all(&request(
            CMD_READ,
            slot,
            slot * DRILL_SLOT as u64,
            DRILL_SLOT,
        ))?;
        let (err, _) = simple_reply(&mut s2)?;
        if err != 0 {
            read_errors += 1;
            lost += 1;
            continue;
        }
        let mut d = vec![0u8; DRILL_SLOT as usize];
        s2.read_exact(&mut d)?;
        if d != drill_content(slot) {
            lost += 1;
        }
    }
    Ok(Drill {
        writes: sent,
        acknowledged: acked.len() as u64,
        lost,
        read_errors,
    })
}
