//! Loopback TCP throughput with plain reads and writes: the floor the
//! memory-server benchmark compares against (`cargo run --release --example tcpmem`).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;
fn main() {
    let total: usize = 512 << 20;
    for big in [false, true, false, true] {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = l.local_addr().unwrap();
        let mut dst = if big {
            vec![1u8; total]
        } else {
            vec![1u8; 128 << 10]
        };
        let h = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut left = total;
            while left > 0 {
                let at = if dst.len() > 128 << 10 {
                    total - left
                } else {
                    0
                };
                let n = s.read(&mut dst[at..at + left.min(128 << 10)]).unwrap();
                left -= n;
            }
            s.write_all(&[1]).unwrap();
        });
        let mut c = TcpStream::connect(a).unwrap();
        let src = vec![3u8; 16 << 20];
        let t = Instant::now();
        let mut sent = 0;
        while sent < total {
            let at = sent % src.len();
            c.write_all(&src[at..at + (128 << 10)]).unwrap();
            sent += 128 << 10;
        }
        let mut b = [0u8; 1];
        c.read_exact(&mut b).unwrap();
        println!(
            "big={big} {:.2} GB/s",
            total as f64 / t.elapsed().as_secs_f64() / 1e9
        );
        h.join().unwrap();
    }
    let t = Instant::now();
    let a = vec![1u8; total];
    let mut b = vec![2u8; total];
    let t2 = Instant::now();
    b.copy_from_slice(&a);
    println!(
        "memcpy 512MiB: {:.2} GB/s (alloc {:?})",
        total as f64 / t2.elapsed().as_secs_f64() / 1e9,
        t2 - t
    );
}
