//! Drills for replicated remote memory: memory servers killed (`kill -9`)
//! or restarted empty while a guest pages with two replicas. The guest
//! keeps running with every byte right and re-replication restores two
//! copies; when every copy of a page is gone the guest fails loudly.

use pagefleet_region::{Config, Region};
use pagefleet_systest::*;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const P: usize = 4096;

/// A region of `pages` over the cluster's servers with two replicas, a
/// quarter of it resident, re-replication unlimited (the drill waits for it).
fn replicated(c: &Cluster, pages: u64) -> Region {
    let mut cfg = Config::new(pages * P as u64, pages / 4);
    cfg.servers = c.addrs();
    cfg.secret = Some(c.secret.clone());
    cfg.replicas = 2;
    cfg.rereplicate_rate = 0;
    Region::new(cfg).expect("region")
}

/// Write round `round`'s pattern to every page, from four threads.
fn write_all(r: &Region, pages: u64, round: u64) {
    let base = r.as_ptr() as usize;
    std::thread::scope(|s| {
        for t in 0..4u64 {
            s.spawn(move || {
                let per = pages / 4;
                for i in 0..per {
                    let p = t * per + (i * 4099 + round) % per;
                    // SAFETY: inside the region's mapping; each thread owns its quarter.
                    let page = unsafe {
                        std::slice::from_raw_parts_mut((base + p as usize * P) as *mut u8, P)
                    };
                    fill(p, round, page);
                }
            });
        }
    });
}

/// Check every byte of every page against round `round`'s pattern.
fn verify_all(r: &Region, pages: u64, round: u64) {
    let base = r.as_ptr() as usize;
    let mut want = vec![0u8; P];
    for i in 0..pages {
        let p = (i * 7919) % pages;
        // SAFETY: inside the region's mapping, which outlives this use.
        let page = unsafe { std::slice::from_raw_parts((base + p as usize * P) as *const u8, P) };
        fill(p, round, &mut want);
        assert!(page == &want[..], "round {round}: page {p} is wrong");
    }
}

/// Pages the server at `addr` holds.
fn used(c: &Cluster, addr: &str) -> u64 {
    let mut conn = pagefleet_client::Conn::connect(addr, &c.secret, &Default::default()).unwrap();
    conn.stat(false).unwrap().used_pages
}

/// Wait until re-replication left no page with a single copy.
fn wait_restored(r: &Region) {
    wait_for("re-replication to restore two copies", 60, || {
        let st = r.stats();
        st.degraded_pages == 0 && st.rereplicated_pages > 0
    });
}

/// kill -9 of one of three servers while four threads page through a
/// budget a quarter of the region: nothing is lost, the dead server's
/// pages are read from their mirrors, and every remote page has two
/// copies again on the two servers left.
#[test]
fn a_memory_server_killed_while_paging_loses_nothing() {
    let mut c = Cluster::start(3, "64MiB");
    let pages = 8192u64; // 32 MiB, 8 MiB resident
    let r = replicated(&c, pages);
    write_all(&r, pages, 1);
    verify_all(&r, pages, 1);
    let st = r.stats();
    assert!(st.remote_pages > pages / 2, "{st:?}");
    let total: u64 = c.addrs().iter().map(|a| used(&c, a)).sum();
    assert!(
        total >= 2 * st.remote_pages,
        "every remote page on two servers: {total} slots for {} remote pages",
        st.remote_pages
    );
    c.servers[0].kill();
    // Reads of pages it served come from their mirrors; writes go on.
    verify_all(&r, pages, 1);
    write_all(&r, pages, 2);
    verify_all(&r, pages, 2);
    wait_restored(&r);
    let st = r.stats();
    assert_eq!(st.servers_down, 1, "{st:?}");
    let left: u64 = c.addrs()[1..].iter().map(|a| used(&c, a)).sum();
    assert!(
        left >= 2 * st.remote_pages,
        "two copies again on the servers left: {left} slots for {} remote pages",
        st.remote_pages
    );
    verify_all(&r, pages, 2);
    assert!(r.fatal_error().is_none());
    r.close().unwrap();
}

/// A server that comes back empty at the same address (a new server id)
/// is a dead server, not one holding zeros.
#[test]
fn a_memory_server_restarted_empty_is_treated_as_dead() {
    let mut c = Cluster::start(3, "64MiB");
    let pages = 4096u64;
    let r = replicated(&c, pages);
    write_all(&r, pages, 1);
    let addr = c.servers[1].addr.clone();
    c.servers[1].kill();
    let again = Server::start_bin_at(&bin("pagefleetd"), 64 << 20, &c.secret_file, &addr, &[])
        .expect("restart the memory server at its address");
    verify_all(&r, pages, 1);
    write_all(&r, pages, 2);
    verify_all(&r, pages, 2);
    wait_restored(&r);
    assert_eq!(r.stats().servers_down, 1, "{:?}", r.stats());
    verify_all(&r, pages, 2);
    r.close().unwrap();
    drop(again);
}

/// Both copies of a page gone: the guest exits 75 naming the servers; it
/// never reads zeros.
#[test]
fn both_replicas_killed_the_guest_fails_loudly() {
    let mut c = Cluster::start(2, "256MiB");
    let dir = tempdir("both-replicas");
    let stderr_path = dir.path().join("guest.err");
    let mut g = Command::new(bin("pagefleet"))
        .arg("--secret-file")
        .arg(&c.secret_file)
        .args([
            "run",
            "synthetic",
            "--size",
            "64MiB",
            "--budget",
            "25%",
            "--dist",
            "uniform",
            "--prefill",
            "--duration",
            "60",
            "--replicas",
            "2",
            "--servers",
        ])
        .arg(c.addrs().join(","))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr_path).unwrap())
        .spawn()
        .expect("spawn pagefleet run");
    // Let it page out before anything happens to the servers.
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        g.try_wait().unwrap().is_none(),
        "guest exited early: {}",
        std::fs::read_to_string(&stderr_path).unwrap()
    );
    let addrs = c.addrs();
    c.servers[0].kill();
    c.servers[1].kill();
    let t = Instant::now();
    let status = loop {
        if let Some(s) = g.try_wait().unwrap() {
            break s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(40),
            "the guest kept running with both copies of its pages gone"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let err = std::fs::read_to_string(&stderr_path).unwrap();
    assert_eq!(status.code(), Some(75), "exit status; stderr: {err}");
    for a in &addrs {
        assert!(err.contains(a.as_str()), "the error must name {a}: {err}");
    }
}
