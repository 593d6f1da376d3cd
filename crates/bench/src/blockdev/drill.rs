//! The mirror's promise, tried: a client keeps 32 writes of 64 KiB in
//! flight over a mirrored export on 3 memory servers while one server is
//! killed with SIGKILL a third of the way in; then every write that was
//! acknowledged is read back on a fresh connection. A write acknowledged
//! before both copies were stored would read back wrong (or fail) here.

use crate::util::ChildDaemon;
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

const SLOT: u32 = 64 << 10;
const IN_FLIGHT: u64 = 32;

/// What the drill saw.
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

/// A raw NBD client (fixed newstyle, GO with block sizes, simple replies).
fn connect(addr: &str) -> Result<TcpStream> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    let mut hello = [0u8; 18];
    s.read_exact(&mut hello)?;
    s.write_all(&3u32.to_be_bytes())?;
    let mut go = 0u32.to_be_bytes().to_vec();
    go.extend_from_slice(&1u16.to_be_bytes());
    go.extend_from_slice(&3u16.to_be_bytes());
    let mut b = b"IHAVEOPT".to_vec();
    b.extend_from_slice(&7u32.to_be_bytes());
    b.extend_from_slice(&(go.len() as u32).to_be_bytes());
    b.extend_from_slice(&go);
    s.write_all(&b)?;
    loop {
        let mut h = [0u8; 20];
        s.read_exact(&mut h)?;
        let ty = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let mut d = vec![0u8; u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize];
        s.read_exact(&mut d)?;
        match ty {
            1 => return Ok(s),
            3 => {}
            t => bail!(
                "the export refused GO ({t:#x}): {}",
                String::from_utf8_lossy(&d)
            ),
        }
    }
}

fn request(ty: u16, handle: u64, off: u64, len: u32) -> Vec<u8> {
    let mut b = 0x2560_9513u32.to_be_bytes().to_vec();
    b.extend_from_slice(&0u16.to_be_bytes());
    b.extend_from_slice(&ty.to_be_bytes());
    b.extend_from_slice(&handle.to_be_bytes());
    b.extend_from_slice(&off.to_be_bytes());
    b.extend_from_slice(&len.to_be_bytes());
    b
}

fn content(slot: u64) -> Vec<u8> {
    let mut x = slot.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..SLOT / 8)
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()
        })
        .collect()
}

/// Run the drill over an export at `addr` of `slots` × 64 KiB, killing
/// `victim` a third of the way in.
pub fn run(addr: &str, slots: u64, victim: &mut ChildDaemon) -> Result<Drill> {
    let s = connect(addr).context("the drill's writer")?;
    let mut r = s.try_clone()?;
    let (tx, rx) = std::sync::mpsc::channel::<(u64, u32)>();
    let reader = std::thread::spawn(move || {
        for _ in 0..slots {
            let mut h = [0u8; 16];
            if r.read_exact(&mut h).is_err() {
                return;
            }
            let err = u32::from_be_bytes(h[4..8].try_into().unwrap());
            let handle = u64::from_be_bytes(h[8..16].try_into().unwrap());
            if tx.send((handle, err)).is_err() {
                return;
            }
        }
    });
    let mut w = s.try_clone()?;
    let (mut acked, mut sent, mut answered) = (Vec::new(), 0u64, 0u64);
    while answered < slots {
        while sent < slots && sent - answered < IN_FLIGHT {
            let mut b = request(1, sent, sent * SLOT as u64, SLOT);
            b.extend_from_slice(&content(sent));
            w.write_all(&b)?;
            sent += 1;
        }
        let (h, err) = rx
            .recv_timeout(Duration::from_secs(60))
            .context("a write's reply")?;
        answered += 1;
        if err == 0 {
            acked.push(h);
        }
        if answered == slots / 3 {
            victim.kill();
        }
    }
    let _ = reader.join();
    let mut s2 = connect(addr).context("the drill's reader")?;
    let (mut lost, mut read_errors) = (0, 0);
    for &slot in &acked {
        s2.write_all(&request(0, slot, slot * SLOT as u64, SLOT))?;
        let mut h = [0u8; 16];
        s2.read_exact(&mut h)?;
        if u32::from_be_bytes(h[4..8].try_into().unwrap()) != 0 {
            read_errors += 1;
            lost += 1;
            continue;
        }
        let mut d = vec![0u8; SLOT as usize];
        s2.read_exact(&mut d)?;
        if d != content(slot) {
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
