//! Drills for replicated remote memory: memory servers killed (`kill -9`)
//! or restarted empty while a guest pages with two replicas. The guest
//! keeps running with every byte right and re-replication restores two
//! copies; when every copy of a page is gone the guest fails loudly.

use pagefleet_region::{Config, Region};
use pagefleet_systest::*;
use std::process::Command;
use std::time::Duration;

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

/// Two replicas over two servers, one killed -9: no second server is left
/// for new copies, and the region keeps its budget all the same — pages
/// leave with one copy (degraded, counted) instead of piling up resident.
/// Sampled every 5 ms while every page is rewritten twice and checked.
#[test]
fn the_budget_holds_when_no_second_copy_can_be_placed() {
    let mut c = Cluster::start(2, "64MiB");
    let pages = 8192u64; // 32 MiB, 8 MiB resident
    let r = replicated(&c, pages);
    let budget = r.stats().budget_pages;
    write_all(&r, pages, 1);
    verify_all(&r, pages, 1);
    c.servers[1].kill();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (peak, samples) = std::thread::scope(|s| {
        let sampler = s.spawn(|| {
            let (mut peak, mut n) = (0u64, 0u64);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(r.stats().resident_pages);
                n += 1;
                std::thread::sleep(Duration::from_millis(5));
            }
            (peak, n)
        });
        verify_all(&r, pages, 1);
        write_all(&r, pages, 2);
        verify_all(&r, pages, 2);
        write_all(&r, pages, 3);
        verify_all(&r, pages, 3);
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        sampler.join().unwrap()
    });
    let st = r.stats();
    assert!(samples > 20, "{samples} samples");
    assert!(
        peak * 100 <= budget * 105,
        "resident peaked at {peak} pages for a budget of {budget} ({st:?})"
    );
    assert_eq!(st.servers_down, 1, "{st:?}");
    // The count is taken at most every 250 ms and refreshed each second:
    // wait for it to reflect the pages as they are now.
    wait_for("the degraded count to settle", 10, || {
        let st = r.stats();
        st.degraded_pages > 0 && st.degraded_pages <= st.remote_pages
    });
    assert!(r.stats().remote_pages > pages / 2, "{:?}", r.stats());
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
    assert_eq!(r.stats().server_failures, 1, "{:?}", r.stats());
    verify_all(&r, pages, 2);
    // Answering again (its new id: restarted empty), it is used again.
    wait_for("the restarted server to be used again", 30, || {
        r.stats().servers_revived == 1 && r.stats().servers_down == 0
    });
    r.close().unwrap();
    drop(again);
}

/// One of three servers killed, then another stopped (SIGSTOP: its
/// connections stay open, nothing answers) while four threads rewrite and
/// check every page: the stopped server is called down once its replies
/// are late (its reads hedged to the mirrors, its page-outs cut), the
/// budget holds at every 5 ms sample, and nothing is wrong. Resumed, it is
/// probed, revived (its stale copies deleted) and takes second copies
/// again; after the guest ends no server holds any of its pages.
#[test]
fn a_memory_server_stopped_is_hedged_around_then_revived_and_the_budget_holds() {
    let mut c = Cluster::start(3, "64MiB");
    let pages = 8192u64; // 32 MiB, 8 MiB resident
    let r = replicated(&c, pages);
    let budget = r.stats().budget_pages;
    write_all(&r, pages, 1);
    verify_all(&r, pages, 1);
    c.servers[0].kill();
    verify_all(&r, pages, 1);
    write_all(&r, pages, 2);
    wait_restored(&r);
    let addrs = c.addrs();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (peak, samples) = std::thread::scope(|s| {
        let sampler = s.spawn(|| {
            let (mut peak, mut n) = (0u64, 0u64);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(r.stats().resident_pages);
                n += 1;
                std::thread::sleep(Duration::from_millis(5));
            }
            (peak, n)
        });
        let stopped = pagefleet_lab::proc::Stopped::stop(c.servers[1].child.id());
        let t = std::time::Instant::now();
        let mut round = 2;
        while t.elapsed() < Duration::from_secs(4) {
            verify_all(&r, pages, round);
            round += 1;
            write_all(&r, pages, round);
        }
        let st = r.stats();
        assert_eq!(st.server_failures, 2, "the kill and the stop: {st:?}");
        assert_eq!(st.servers_down, 2, "the stopped server is down: {st:?}");
        drop(stopped);
        wait_for("the resumed server to be used again", 30, || {
            r.stats().servers_revived == 1
        });
        verify_all(&r, pages, round);
        round += 1;
        write_all(&r, pages, round);
        verify_all(&r, pages, round);
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        (sampler.join().unwrap(), round)
    })
    .0;
    let _ = samples;
    let st = r.stats();
    assert!(
        peak * 100 <= budget * 105,
        "resident peaked at {peak} pages for a budget of {budget} ({st:?})"
    );
    wait_for("two copies of every page again", 60, || {
        let st = r.stats();
        st.degraded_pages == 0 && st.servers_down == 1
    });
    assert!(
        used(&c, &addrs[1]) > 0,
        "the revived server holds copies again"
    );
    assert!(r.fatal_error().is_none());
    r.close().unwrap();
    for a in &addrs[1..] {
        assert_eq!(used(&c, a), 0, "{a} still holds pages of the closed region");
    }
}

/// Both copies of a page gone: the guest exits 75 naming the servers; it
/// never reads zeros.
#[test]
fn both_replicas_killed_the_guest_fails_loudly() {
    let mut c = Cluster::start(2, "256MiB");
    let dir = tempdir("both-replicas");
    let mut g = GuestProc::start(
        &c,
        &[
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
        ],
        dir.path(),
    );
    // Let it page out before anything happens to the servers.
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        g.child.try_wait().unwrap().is_none(),
        "guest exited early: {}",
        g.stderr()
    );
    let addrs = c.addrs();
    c.servers[0].kill();
    c.servers[1].kill();
    let status = g
        .wait_exit(Duration::from_secs(40))
        .expect("the guest kept running with both copies of its pages gone");
    let err = g.stderr();
    assert_eq!(status.code(), Some(75), "exit status; stderr: {err}");
    for a in &addrs {
        assert!(err.contains(a.as_str()), "the error must name {a}: {err}");
    }
}

/// A memory server's daemon on lab host `h` killed (SIGKILL).
fn kill_server(l: &LabRun, h: usize) {
    assert!(kill_in(l, h, "pagefleetd"), "no pagefleetd on h{}", h + 1);
}

/// Run `pagefleet ARGS` in h1 while `meanwhile` runs; its stdout or stderr.
fn during(l: &LabRun, args: &[&str], meanwhile: impl FnOnce()) -> Result<String, String> {
    std::thread::scope(|sc| {
        let h = sc.spawn(|| l.pf(0, args));
        meanwhile();
        let (ok, out, err) = h.join().unwrap();
        if ok {
            Ok(out)
        } else {
            Err(err)
        }
    })
}

/// A kv guest with two replicas split over three sub-hosts: one sub-host
/// dies during the split migration, re-replication restores the copies,
/// another dies during the gather back. Clients check every value
/// throughout; the guest never stops serving right ones.
#[test]
fn replicated_guest_survives_sub_host_deaths_during_migration_and_gather() {
    if !is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    const MIB: u64 = 1 << 20;
    // h1 runs the guest, h2 has room for a third of it, h3-h5 lend.
    let l = lab(
        "rep",
        5,
        // 1 Gbit/s: the migration and the gather take seconds, so the
        // kills land while they run.
        pagefleet_testbed::Link::Gbit1,
        256 * MIB,
        &[512 * MIB, 64 * MIB, 0, 0, 0],
    );
    let ip = l.lab.service_ip(1);
    let svc = format!("{ip}:11211");
    let servers: Vec<String> = (2..5).map(|h| l.lab.hosts[h].addr.clone()).collect();
    let (ok, _, err) = l.pf(
        0,
        &[
            "guest",
            "start",
            "kv1",
            "--on",
            "h1",
            "--size",
            "192MiB",
            "--",
            "kv",
            "--listen",
            &svc,
            "--service-ip",
            &ip,
            "--replicas",
            "2",
            "--servers",
            &servers.join(","),
        ],
    );
    assert!(ok, "guest start: {err}");
    let spec = pagefleet_lab::kvload::Spec {
        addr: svc,
        keys: 40_000,
        value_len: 2000,
        conns: 4,
        get_frac: 0.9,
        theta: 0.99,
        netns: Some(l.lab.hosts[0].netns.clone()),
        reconnect: true,
        pace: None,
    };
    pagefleet_lab::kvload::prefill(&spec).expect("prefill");
    let load = pagefleet_lab::kvload::Load::start(&spec);
    // 1. Split migration to h2 with sub-hosts h3, h4, h5; h4 dies during it.
    let outcome = during(
        &l,
        &[
            "migrate", "kv1", "--to", "h2", "--sub", "h3", "--sub", "h4", "--sub", "h5", "--json",
        ],
        || {
            std::thread::sleep(Duration::from_millis(500));
            kill_server(&l, 3);
        },
    );
    let (h, g) = l.guest("kv1").expect("kv1 is gone");
    assert_eq!(
        g.state,
        pagefleet_api::GuestState::Running,
        "{g:?} ({outcome:?})"
    );
    eprintln!(
        "migration with h4 killed: {} (kv1 on h{})",
        if outcome.is_ok() { "done" } else { "aborted" },
        h + 1
    );
    if outcome.is_ok() {
        assert_eq!(h, 1);
        // 2. On h2: its pages whose copy was on h4 get a new one on h3/h5
        // (h4 is found dead when the pager's connection to it ends).
        wait_for("h4 found dead and the copies restored on h2", 60, || {
            l.guest("kv1")
                .and_then(|(_, g)| g.paging)
                .is_some_and(|p| p.servers_down == 1 && p.degraded_pages == 0)
        });
    } else {
        // 2. The source kept the guest; the migration goes through with
        // the sub-hosts left.
        assert_eq!(h, 0);
        let r = l.pf(
            0,
            &[
                "migrate", "kv1", "--to", "h2", "--sub", "h3", "--sub", "h5", "--json",
            ],
        );
        assert!(r.0, "second migration: {}", r.2);
    }
    let p = l.guest("kv1").unwrap().1.paging.unwrap();
    eprintln!("on h2: {p:?}");
    assert_eq!(p.replicas, 2, "{p:?}");
    assert_eq!(p.degraded_pages, 0, "{p:?}");
    // 3. Gather it back onto h1; h3 dies during the gather: its pages
    // come from their mirrors on h5 (or, if the gather gives up, the
    // guest keeps running on h2 from the mirrors).
    let r = during(
        &l,
        &["gather", "kv1", "--to", "h1", "--verify", "--json"],
        || {
            std::thread::sleep(Duration::from_millis(500));
            kill_server(&l, 2);
        },
    );
    let (h, g) = l.guest("kv1").expect("kv1 is gone after the gather");
    assert_eq!(g.state, pagefleet_api::GuestState::Running, "{g:?} ({r:?})");
    if let Ok(out) = &r {
        let v: serde_json::Value = serde_json::from_str(out).unwrap();
        assert_eq!(v["checksum_source"], v["checksum_dest"], "{v}");
        assert_eq!(h, 0, "{v}");
    }
    eprintln!(
        "gather with h3 killed: {} (kv1 on h{})",
        if r.is_ok() { "done" } else { "aborted" },
        h + 1
    );
    std::thread::sleep(Duration::from_secs(2));
    let c = load.counters.clone();
    let e = load.error();
    load.stop().expect("load");
    assert!(e.is_none(), "{e:?}");
    assert!(c.ops.load(std::sync::atomic::Ordering::Relaxed) > 1000);
    assert_eq!(
        c.bad_values.load(std::sync::atomic::Ordering::Relaxed),
        0,
        "wrong values served"
    );
    assert_eq!(
        c.misses.load(std::sync::atomic::Ordering::Relaxed),
        0,
        "keys lost"
    );
}

/// `pagefleet bench soak --quick` from a clean checkout: the testbed comes
/// up, every kind of event runs (budget, migration, evacuation, kill -9 and
/// restart of a memory server), clients check every value and none is lost;
/// the report has its goals and a series per process.
#[test]
fn soak_quick_loses_nothing() {
    if !is_root() {
        eprintln!("skipped: the soak runs a testbed (root; CI runs as root)");
        return;
    }
    let dir = tempdir("soak-bench");
    let o = Command::new(bin("pagefleet"))
        .args(["bench", "soak", "--quick", "--json", "--out"])
        .arg(dir.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "bench soak failed: {err}");
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON object");
    assert_eq!(r["bytes_lost"], 0, "{err}");
    assert!(r["ops"].as_u64().unwrap() > 1000, "{err}");
    for kind in ["budget", "migrate", "evacuate", "kill", "restart"] {
        assert!(
            r["event_counts"][kind][0].as_u64().unwrap_or(0) > 0,
            "no {kind} event went through: {err}"
        );
    }
    assert!(r["procs"].as_array().unwrap().len() >= 6, "{err}");
    let goals = r["goals"].as_array().unwrap();
    assert!(goals
        .iter()
        .any(|g| g["name"].as_str().unwrap().starts_with("bytes lost")));
}
