//! Where TLS page-in time goes, and its floor (`cargo run --release
//! --example tls_pagein`): in one run,
//! - pagefleet page-in (GET, 128 KiB frames, window 8) of 256 MiB over one
//!   connection, plaintext and TLS alternating, with the client thread's
//!   and the server process's CPU per MiB;
//! - the floor (`pagefleet_bench::tls_floor`, also in `pagefleet bench
//!   memserver`): one TCP stream of AES-128-GCM records against the same
//!   stream unencrypted, and the cipher alone in memory.

use pagefleet_client::{Conn, ConnectOptions, GetMode, Pages};
use pagefleet_proto::auth::Secret;
use std::time::Instant;

const MIB: usize = 1 << 20;
const TOTAL: usize = 256 * MIB;

use pagefleet_bench::tls_floor::thread_cpu;

fn main() -> anyhow::Result<()> {
    let tmp = pagefleet_lab::proc::temp_dir("tls-pagein")?;
    let secret_path = tmp.join("secret");
    std::fs::write(&secret_path, Secret::generate_hex())?;
    let secret = Secret::load(&secret_path)?;
    let ids = pagefleet_tls::certs::cluster(&tmp, &["s", "c"])?;
    let client = std::sync::Arc::new(pagefleet_tls::Identity::load(&ids[1])?);
    let d = pagefleet_lab::proc::ChildDaemon::start_args(
        (TOTAL + 64 * MIB) as u64,
        &secret_path,
        &["--tls-dir".as_ref(), ids[0].as_os_str()],
    )?;
    let pages = TOTAL / 4096;
    let src = vec![7u8; TOTAL];
    let mut dst = vec![0u8; 16 * MIB];
    let mut c = Conn::connect(&d.addr, &secret, &ConnectOptions::default())?;
    c.set_window(16);
    c.put(
        1,
        Pages::Run {
            first: 0,
            count: pages as u64,
        },
        &src,
        32,
    )?;
    drop(c);
    println!("pagefleet page-in of 256 MiB, one connection, 128 KiB frames (GET keep)");
    for round in 0..3 {
        for tls in [false, true] {
            let o = ConnectOptions {
                tls: tls.then(|| client.clone()),
                tls_on_loopback: tls,
                ..Default::default()
            };
            let mut c = Conn::connect(&d.addr, &secret, &o)?;
            c.set_window(8);
            let (t0, c0, s0) = (
                Instant::now(),
                thread_cpu(),
                pagefleet_lab::proc::cpu_secs(d.child.id()),
            );
            for base in (0..pages).step_by(4096) {
                c.get(
                    1,
                    Pages::Run {
                        first: base as u64,
                        count: 4096,
                    },
                    &mut dst,
                    GetMode::Keep,
                    false,
                    32,
                )?;
            }
            let secs = t0.elapsed().as_secs_f64();
            let (cc, sc) = (
                thread_cpu() - c0,
                pagefleet_lab::proc::cpu_secs(d.child.id()) - s0,
            );
            let mib = (TOTAL / MIB) as f64;
            println!(
                "  round {round} {:9} {:5.2} GB/s   client CPU {:5.1} us/MiB  server CPU {:5.1} us/MiB",
                if tls { "TLS" } else { "plaintext" },
                TOTAL as f64 / secs / 1e9,
                cc * 1e6 / mib,
                sc * 1e6 / mib
            );
        }
    }
    println!(
        "floor (pagefleet_bench::tls_floor): one TCP stream, plain vs AES-128-GCM 16 KiB records"
    );
    for round in 0..3 {
        let f = pagefleet_bench::tls_floor::pair(TOTAL)?;
        println!(
            "  round {round} plain {:5.2} GB/s ({:5.1} us/MiB receiving)   AES-GCM {:5.2} GB/s ({:5.1} us/MiB)",
            f.plain_gbps, f.plain_rx_cpu_us_per_mib, f.aes_gbps, f.aes_rx_cpu_us_per_mib
        );
    }
    println!(
        "AES-128-GCM seal + open in memory, one core: {:.2} GB/s",
        pagefleet_bench::tls_floor::cipher_gbps(TOTAL)
    );
    let _ = std::fs::remove_dir_all(&tmp);
    Ok(())
}
