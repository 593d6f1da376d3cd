//! The floor under TLS throughput: one loopback TCP stream of 16 KiB
//! AES-128-GCM records (ring: the sender copies each record's plaintext
//! into its send buffer once and seals it there; the receiver opens it in
//! place and copies it into a 16 MiB ring, the least a TLS receiver does)
//! beside the same stream unencrypted and read straight into the ring. No
//! protocol, no TLS library: only the work encryption cannot avoid.

use serde::Serialize;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

const MIB: usize = 1 << 20;
const REC: usize = 16 * 1024;
const TAG: usize = 16;

/// One side-by-side pair.
#[derive(Clone, Debug, Serialize)]
pub struct FloorRun {
    /// Plain stream into the ring, GB/s.
    pub plain_gbps: f64,
    /// Sealed records, opened into the ring, GB/s.
    pub aes_gbps: f64,
    /// Receiver CPU per MiB, plain, µs.
    pub plain_rx_cpu_us_per_mib: f64,
    /// Receiver CPU per MiB, sealed, µs.
    pub aes_rx_cpu_us_per_mib: f64,
}

/// CPU seconds of the calling thread.
pub fn thread_cpu() -> f64 {
    pagefleet_common::clock::thread_cpu_secs()
}

fn key() -> ring::aead::LessSafeKey {
    let k =
        ring::aead::UnboundKey::new(&ring::aead::AES_128_GCM, &[3u8; 16]).expect("a 16-byte key");
    ring::aead::LessSafeKey::new(k)
}

fn nonce(i: u64) -> ring::aead::Nonce {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&i.to_be_bytes());
    ring::aead::Nonce::assume_unique_for_key(n)
}

/// Plain then sealed, `total` bytes each.
pub fn pair(total: usize) -> std::io::Result<FloorRun> {
    let (plain_gbps, plain_rx) = stream(total, false)?;
    let (aes_gbps, aes_rx) = stream(total, true)?;
    Ok(FloorRun {
        plain_gbps,
        aes_gbps,
        plain_rx_cpu_us_per_mib: plain_rx,
        aes_rx_cpu_us_per_mib: aes_rx,
    })
}

/// AES-128-GCM seal + open of 16 KiB records in memory on one core, GB/s.
pub fn cipher_gbps(total: usize) -> f64 {
    let k = key();
    let mut rec = vec![5u8; REC + TAG];
    let t0 = Instant::now();
    let mut i = 0u64;
    while (i as usize) * REC < total {
        let Ok(tag) =
            k.seal_in_place_separate_tag(nonce(i), ring::aead::Aad::empty(), &mut rec[..REC])
        else {
            return 0.0;
        };
        rec[REC..].copy_from_slice(tag.as_ref());
        if k.open_in_place(nonce(i), ring::aead::Aad::empty(), &mut rec)
            .is_err()
        {
            return 0.0;
        }
        i += 1;
    }
    total as f64 / t0.elapsed().as_secs_f64() / 1e9
}

/// One stream of `total` bytes: the receiver's GB/s and CPU µs per MiB.
fn stream(total: usize, enc: bool) -> std::io::Result<(f64, f64)> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let a = l.local_addr()?;
    let rx = std::thread::spawn(move || -> std::io::Result<(f64, f64)> {
        let (mut s, _) = l.accept()?;
        let mut ring_buf = vec![1u8; 16 * MIB];
        let k = key();
        let mut rec = vec![0u8; REC + TAG];
        let (t0, c0) = (Instant::now(), thread_cpu());
        let (mut got, mut i) = (0usize, 0u64);
        while got < total {
            let off = got % ring_buf.len();
            if enc {
                s.read_exact(&mut rec)?;
                let p = k
                    .open_in_place(nonce(i), ring::aead::Aad::empty(), &mut rec)
                    .map_err(|_| std::io::Error::other("a record did not open"))?;
                ring_buf[off..off + REC].copy_from_slice(p);
                i += 1;
            } else {
                s.read_exact(&mut ring_buf[off..off + REC])?;
            }
            got += REC;
        }
        let secs = t0.elapsed().as_secs_f64();
        Ok((
            total as f64 / secs / 1e9,
            (thread_cpu() - c0) * 1e6 / (total / MIB) as f64,
        ))
    });
    let mut s = TcpStream::connect(a)?;
    s.set_nodelay(true)?;
    let k = key();
    let data = vec![9u8; 128 * 1024];
    let mut out = vec![0u8; 8 * (REC + TAG)];
    let (mut sent, mut i) = (0usize, 0u64);
    while sent < total {
        let mut n = 0;
        for chunk in data.chunks(REC) {
            out[n..n + REC].copy_from_slice(chunk);
            if enc {
                let tag = k
                    .seal_in_place_separate_tag(
                        nonce(i),
                        ring::aead::Aad::empty(),
                        &mut out[n..n + REC],
                    )
                    .map_err(|_| std::io::Error::other("sealing failed"))?;
                out[n + REC..n + REC + TAG].copy_from_slice(tag.as_ref());
                i += 1;
                n += REC + TAG;
            } else {
                n += REC;
            }
        }
        s.write_all(&out[..n])?;
        sent += data.len();
    }
    rx.join()
        .map_err(|_| std::io::Error::other("receiver panicked"))?
}
