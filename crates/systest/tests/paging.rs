//! The paging runtime against real memory servers: real userfaultfd, real
//! sockets, real pagefleetd processes.

use pagefleet_region::{Config, Policy, Region};
use pagefleet_systest::*;
use std::time::{Duration, Instant};

const P: usize = 4096;

/// Wait (bounded) for the pager's counters to catch up with what the guest did.
fn settle(cond: impl Fn() -> bool) {
    let t = Instant::now();
    while !cond() && t.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn region(c: &Cluster, size: u64, budget_pages: u64, policy: Policy, chunk: usize) -> Region {
    let mut cfg = Config::new(size, budget_pages);
    cfg.servers = c.addrs();
    cfg.secret = Some(c.secret.clone());
    cfg.policy = policy;
    cfg.chunk_pages = chunk;
    Region::new(cfg).expect("region")
}

/// A region 4x its budget over two servers; four threads write and verify
/// their quarters in random order for several rounds, under constant page-out
/// and page-in. Every byte is checked.
fn pattern_test(policy: Policy, chunk: usize) {
    pattern_test_with(policy, chunk, false)
}

/// `storm`: the sampler may spend a whole core and sweep every 10 ms, so
/// pages are unmapped under the threads all the time (reads map them back
/// in the kernel, writes to clean or leaving pages must still fault WP).
fn pattern_test_with(policy: Policy, chunk: usize, storm: bool) {
    let c = Cluster::start(2, "64MiB");
    let pages = 8192u64; // 32 MiB
    let mut cfg = Config::new(pages * P as u64, pages / 4);
    cfg.servers = c.addrs();
    cfg.secret = Some(c.secret.clone());
    cfg.policy = policy;
    cfg.chunk_pages = chunk;
    if storm {
        cfg.sample_cpu_budget = 1.0;
        cfg.sample_period = std::time::Duration::from_millis(10);
    }
    let r = Region::new(cfg).expect("region");
    let base = r.as_ptr() as usize;
    const THREADS: u64 = 4;
    std::thread::scope(|s| {
        for t in 0..THREADS {
            s.spawn(move || {
                let per = pages / THREADS;
                let lo = t * per;
                let mut want = vec![0u8; P];
                let seed = 0x1234_5678 + t;
                for round in 1..=3u64 {
                    // Write every page of the quarter in a random order
                    // (with a sampling storm, read each first: the page is
                    // then mapped clean and write-protected before the write).
                    for i in 0..per {
                        let p = lo + (i * 4099 + round * 17 + (seed % 2)) % per;
                        // SAFETY: each thread owns its quarter.
                        let page = unsafe {
                            std::slice::from_raw_parts_mut((base + p as usize * P) as *mut u8, P)
                        };
                        if storm {
                            // SAFETY: as above.
                            unsafe { std::ptr::read_volatile(page.as_ptr()) };
                            std::thread::yield_now();
                        }
                        fill(p, round, page);
                    }
                    // Verify in a scrambled order.
                    for i in 0..per {
                        let p = lo + (i * 7919) % per;
                        // SAFETY: inside the region's mapping, which outlives this use.
                        let page = unsafe {
                            std::slice::from_raw_parts((base + p as usize * P) as *const u8, P)
                        };
                        fill(p, round, &mut want);
                        assert!(
                            page == &want[..],
                            "thread {t} round {round}: page {p} corrupted"
                        );
                    }
                }
            });
        }
    });
    settle(|| r.stats().resident_pages <= r.stats().budget_pages);
    let st = r.stats();
    if storm {
        assert!(
            st.minor_faults > 0 && st.sampled_chunks > 0,
            "the sampler unmapped pages and saw them touched again: {st:?}"
        );
    }
    assert!(
        st.page_outs > pages,
        "expected constant page-out, got {} page-outs",
        st.page_outs
    );
    assert!(
        st.page_ins > pages / 2,
        "expected constant page-in, got {} page-ins: {st:?}",
        st.page_ins
    );
    assert!(
        st.resident_pages <= st.budget_pages,
        "resident {} over budget {}",
        st.resident_pages,
        st.budget_pages
    );
    // Both servers were used.
    for s in c.addrs() {
        let mut conn = pagefleet_client::Conn::connect(&s, &c.secret, &Default::default()).unwrap();
        assert!(
            conn.stat(false).unwrap().used_pages > 0,
            "server {s} never received pages"
        );
    }
    r.close().unwrap();
    for s in c.addrs() {
        let mut conn = pagefleet_client::Conn::connect(&s, &c.secret, &Default::default()).unwrap();
        assert_eq!(
            conn.stat(false).unwrap().used_pages,
            0,
            "close must drop the region on {s}"
        );
    }
}

#[test]
fn pattern_4x_budget_two_servers_clock() {
    pattern_test(Policy::Clock, 16);
}

#[test]
fn no_write_is_lost_while_the_sampler_unmaps_pages_all_the_time() {
    pattern_test_with(Policy::Aging, 16, true);
}

#[test]
fn pattern_4x_budget_two_servers_aging_chunk4() {
    pattern_test(Policy::Aging, 4);
}

#[test]
fn pattern_chunk1_and_chunk64() {
    pattern_test(Policy::Clock, 1);
    pattern_test(Policy::Aging, 64);
}

#[test]
fn budget_shrinks_and_grows_while_running() {
    let c = Cluster::start(1, "64MiB");
    let pages = 4096u64;
    let r = region(&c, pages * P as u64, pages, Policy::Clock, 16);
    let base = r.as_ptr() as usize;
    for p in 0..pages {
        // SAFETY: inside the region's mapping, which outlives this use.
        let page = unsafe { std::slice::from_raw_parts_mut((base + p as usize * P) as *mut u8, P) };
        fill(p, 1, page);
    }
    // The pager wakes the faulting thread before it updates its counters.
    settle(|| r.stats().resident_pages == pages);
    assert_eq!(r.stats().resident_pages, pages);
    assert_eq!(r.stats().page_outs, 0);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let stop = &stop;
    std::thread::scope(|s| {
        // A reader keeps touching the first eighth while the budget shrinks.
        s.spawn(move || {
            let mut want = vec![0u8; P];
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) && n < 200_000 {
                let p = (n * 13) % (pages / 8);
                let page =
                    // SAFETY: inside the region's mapping, which outlives this use.
                    unsafe { std::slice::from_raw_parts((base + p as usize * P) as *const u8, P) };
                fill(p, 1, &mut want);
                assert!(page == &want[..], "page {p} corrupted while shrinking");
                n += 1;
            }
        });
        r.set_budget(pages / 4);
        let t = Instant::now();
        while r.stats().resident_pages > pages / 4 {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "budget shrink not enforced: {:?}",
                r.stats()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    assert!(r.stats().page_outs >= pages / 2);
    // Grow: touching everything may now keep it all resident.
    r.set_budget(pages);
    let mut want = vec![0u8; P];
    for p in 0..pages {
        // SAFETY: inside the region's mapping, which outlives this use.
        let page = unsafe { std::slice::from_raw_parts((base + p as usize * P) as *const u8, P) };
        fill(p, 1, &mut want);
        assert!(page == &want[..], "page {p} corrupted after shrink");
    }
    let outs = r.stats().page_outs;
    for p in 0..pages {
        // SAFETY: inside the region's mapping, which outlives this use.
        let v = unsafe { std::ptr::read_volatile((base + p as usize * P) as *const u8) };
        std::hint::black_box(v);
    }
    settle(|| r.stats().resident_pages == pages);
    assert_eq!(
        r.stats().page_outs,
        outs,
        "a grown budget must not page out"
    );
    assert_eq!(r.stats().resident_pages, pages);
}

#[test]
fn never_touched_pages_read_zero_without_server_trips() {
    let c = Cluster::start(1, "16MiB");
    let r = region(&c, 4 << 20, 256, Policy::Clock, 16);
    // SAFETY: the test's only view of the region.
    let s = unsafe { r.slice_mut() };
    assert!(s.iter().step_by(513).all(|b| *b == 0));
    let st = r.stats();
    assert_eq!(st.page_ins, 0);
    assert!(st.zero_filled_pages > 0);
}

/// Change tracking (the pre-copy primitive): after arming, exactly the pages
/// written (or moved) are reported, round after round; reads are not.
#[test]
fn change_tracking_reports_exactly_the_written_pages() {
    let mut cfg = Config::new(4 << 20, 1024);
    cfg.sample_period = Duration::from_millis(50);
    cfg.sample_cpu_budget = 0.5; // zap eagerly: tracking must survive re-mapped pages
    let r = Region::new(cfg).unwrap();
    let base = r.as_ptr() as usize;
    // SAFETY: inside the region's mapping, which outlives this use.
    let w = |p: u64, v: u64| unsafe {
        std::ptr::write_volatile((base + p as usize * P) as *mut u64, v)
    };
    // SAFETY: inside the region's mapping, which outlives this use.
    let rd = |p: u64| unsafe { std::ptr::read_volatile((base + p as usize * P) as *const u64) };
    for p in 0..1024 {
        w(p, p);
    }
    std::thread::sleep(Duration::from_millis(200)); // let the sampler zap some pages
    assert!(r.track_changes(true));
    assert_eq!(r.take_changed(), Vec::<u64>::new());
    for p in [3u64, 100, 101, 900] {
        w(p, p + 1);
    }
    for p in 0..1024 {
        std::hint::black_box(rd(p));
    }
    assert_eq!(r.take_changed(), vec![3, 100, 101, 900]);
    std::thread::sleep(Duration::from_millis(200));
    w(100, 5);
    w(7, 5);
    w(7, 6);
    assert_eq!(r.take_changed(), vec![7, 100]);
    assert_eq!(r.take_changed(), Vec::<u64>::new());
    assert!(r.track_changes(false));
    w(8, 1);
    let snap = r.snapshot().unwrap();
    assert_eq!(snap.location.len(), 1024);
    assert!(snap
        .location
        .iter()
        .all(|l| *l == pagefleet_region::Location::Local));
    assert_eq!(rd(7), 6);
    assert_eq!(rd(100), 5);
}

/// A region can start with its pages on a memory server (a guest resumed
/// elsewhere): they page in on demand with their contents.
#[test]
fn region_starts_with_pages_on_a_server() {
    use pagefleet_client::{Conn, Pages};
    let c = Cluster::start(1, "16MiB");
    let region_id = 0xfeed_0001;
    let mut conn = Conn::connect(&c.servers[0].addr, &c.secret, &Default::default()).unwrap();
    let mut data = vec![0u8; 512 * P];
    for (i, pg) in data.chunks_mut(P).enumerate() {
        fill(i as u64, 9, pg);
    }
    conn.put(
        region_id,
        Pages::Run {
            first: 0,
            count: 512,
        },
        &data,
        32,
    )
    .unwrap();
    let mut cfg = Config::new(1024 * P as u64, 256);
    cfg.servers = c.addrs();
    cfg.secret = Some(c.secret.clone());
    cfg.region_id = region_id;
    cfg.initial_remote = vec![pagefleet_region::RemoteRun {
        first: 0,
        count: 512,
        server: 0,
        mirror: None,
    }];
    let r = Region::new(cfg).unwrap();
    let snap = r.snapshot().unwrap();
    assert_eq!(
        snap.location[0],
        pagefleet_region::Location::Remote(0, None)
    );
    assert_eq!(snap.location[700], pagefleet_region::Location::Zero);
    let base = r.as_ptr() as usize;
    let mut want = vec![0u8; P];
    for p in 0..1024u64 {
        // SAFETY: inside the region's mapping, which outlives this use.
        let page = unsafe { std::slice::from_raw_parts((base + p as usize * P) as *const u8, P) };
        if p < 512 {
            fill(p, 9, &mut want);
            assert!(page == &want[..], "page {p} wrong after resume");
        } else {
            assert!(page.iter().all(|b| *b == 0), "page {p} should be zero");
        }
    }
    assert!(r.stats().page_ins >= 512 - 256);
    // Bad initial layout is refused.
    let mut bad = Config::new(16 * P as u64, 16);
    bad.initial_remote = vec![pagefleet_region::RemoteRun {
        first: 0,
        count: 4,
        server: 3,
        mirror: None,
    }];
    assert!(Region::new(bad).is_err());
}

fn used_on(c: &Cluster, i: usize) -> u64 {
    let mut conn =
        pagefleet_client::Conn::connect(&c.servers[i].addr, &c.secret, &Default::default())
            .unwrap();
    conn.stat(false).unwrap().used_pages
}

/// Pages brought in by reads keep their server copy: evicting them again is
/// a local drop (nothing sent), and the first write after a page-in makes
/// the copy stale, so that page is sent again. The server is smaller than
/// the region, so kept copies must give their room back to pages that
/// leave. Every byte is checked in every phase; nothing leaks.
#[test]
fn clean_pages_are_dropped_not_resent_and_no_write_is_lost() {
    let c = Cluster::start(1, "28MiB"); // 7168 pages for a region of 8192
    let pages = 8192u64;
    let mut cfg = Config::new(pages * P as u64, 2048);
    cfg.servers = c.addrs();
    cfg.secret = Some(c.secret.clone());
    cfg.chunk_pages = 4;
    let r = Region::new(cfg).unwrap();
    let base = r.as_ptr() as usize;
    let page = |p: u64| {
        // SAFETY: inside the region's mapping, which outlives this use.
        unsafe { std::slice::from_raw_parts((base + p as usize * P) as *const u8, P) }
    };
    let page_mut = |p: u64| {
        // SAFETY: as above; one thread, no other view of this page is alive.
        unsafe { std::slice::from_raw_parts_mut((base + p as usize * P) as *mut u8, P) }
    };
    // Version 0 is a page never written (zeros). Every sixth page starts
    // unwritten: such a page leaves no write hint, so each read page-in
    // installs it clean (write-protected) — the pages whose first write the
    // pager must catch. (Pages written before are installed writable for
    // their next few page-ins, and read-ahead installs clean whichever
    // pages it brings: counting on either made the count depend on timing.)
    let mut want = vec![0u8; P];
    let mut version: Vec<u64> = (0..pages).map(|p| u64::from(p % 6 != 0)).collect();
    let expect = |p: u64, v: u64, want: &mut [u8]| {
        if v == 0 {
            want.fill(0);
        } else {
            fill(p, v, want);
        }
    };
    for p in 0..pages {
        if version[p as usize] > 0 {
            fill(p, 1, page_mut(p));
        }
    }
    // Two read passes in scrambled orders: the second evicts pages the
    // first brought in unchanged.
    for pass in 0..2u64 {
        for i in 0..pages {
            let p = (i * 7919 + pass * 31) % pages;
            expect(p, version[p as usize], &mut want);
            assert!(page(p) == &want[..], "read pass {pass}: page {p} corrupted");
        }
    }
    // Only ~1024 copies fit beside the 6144 remote pages, so at most that
    // many of the second pass's evictions can be drops.
    let st = r.stats();
    assert!(st.clean_drops > 300, "clean pages were re-sent: {st:?}");
    // Writes to a third of the pages, mixed with reads. The never-written
    // ones are read first, then written: the read installs them clean, so
    // the write is a first write to a clean page (its kept copy is stale
    // from then on). The others are written without a read, resident or
    // remote. Then everything is verified twice.
    let before = r.stats().first_writes;
    for i in 0..pages {
        let p = (i * 4099) % pages;
        let v = version[p as usize];
        if p.is_multiple_of(3) {
            if v == 0 {
                expect(p, 0, &mut want);
                assert!(page(p) == &want[..], "mixed pass: page {p} corrupted");
            }
            version[p as usize] += 1;
            fill(p, version[p as usize], page_mut(p));
        } else {
            expect(p, v, &mut want);
            assert!(page(p) == &want[..], "mixed pass: page {p} corrupted");
        }
    }
    for pass in 0..2u64 {
        for i in 0..pages {
            let p = (i * 6007 + pass) % pages;
            expect(p, version[p as usize], &mut want);
            assert!(
                page(p) == &want[..],
                "after writes, pass {pass}: page {p} corrupted"
            );
        }
    }
    // A read page-in then a write of the same page, with no page-in
    // between: the clock hand takes only pages unreferenced since its last
    // look, so all but a few of the 1366 read-then-written pages were
    // still resident and clean when written.
    let st = r.stats();
    assert!(
        st.first_writes - before > 1000,
        "first writes to clean pages not caught: {} of 1366 ({st:?})",
        st.first_writes - before
    );
    // The server never holds more than it lends and more than the region.
    let used = used_on(&c, 0);
    assert!(used <= 7168 && used <= pages, "server holds {used} pages");
    assert!(
        used >= st.remote_pages,
        "{used} stored < {} remote",
        st.remote_pages
    );
    // A migration's change tracking gives every kept copy back: the server
    // then holds exactly the remote pages.
    assert!(r.track_changes(true));
    settle(|| used_on(&c, 0) == r.stats().remote_pages);
    assert_eq!(used_on(&c, 0), r.stats().remote_pages);
    assert!(r.track_changes(false));
    r.close().unwrap();
    assert_eq!(used_on(&c, 0), 0, "close must drop everything, copies too");
}

/// Eight threads hammer one chunk (each its own counter on its own page of
/// it, written and read back) while a ninth streams through the rest of the
/// region, so the chunk is evicted and paged back in again and again. No
/// write is lost between the copy and the punch of a page-out.
#[test]
fn one_chunk_hammered_while_evicted() {
    let c = Cluster::start(1, "64MiB");
    let pages = 4096u64;
    let mut cfg = Config::new(pages * P as u64, 64);
    cfg.servers = c.addrs();
    cfg.secret = Some(c.secret.clone());
    cfg.chunk_pages = 16;
    let r = Region::new(cfg).unwrap();
    let base = r.as_ptr() as usize;
    let stop = std::sync::atomic::AtomicBool::new(false);
    let deadline = Instant::now() + Duration::from_secs(3);
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let stop = &stop;
            s.spawn(move || {
                // SAFETY: page t of chunk 0 belongs to this thread.
                let slot = (base + t as usize * 2 * P + 64) as *mut u64;
                let mut n = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) && n < 2_000_000 {
                    n += 1;
                    // SAFETY: as above.
                    unsafe { std::ptr::write_volatile(slot, n * 8 + t) };
                    if n.is_multiple_of(64) {
                        std::thread::yield_now();
                    }
                    // SAFETY: as above.
                    let v = unsafe { std::ptr::read_volatile(slot) };
                    assert_eq!(v, n * 8 + t, "thread {t}: write {n} lost");
                }
            });
        }
        let stop = &stop;
        s.spawn(move || {
            let mut round = 0u64;
            while Instant::now() < deadline {
                round += 1;
                for p in 16..pages {
                    // SAFETY: pages past chunk 0 belong to this thread.
                    unsafe { std::ptr::write_volatile((base + p as usize * P) as *mut u64, round) };
                }
            }
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
        });
    });
    assert!(r.stats().page_outs > pages, "{:?}", r.stats());
}

/// A guest keeps paging, every byte verified, while 2 000 connections that
/// never authenticate sit on its memory server: they hold no session slot
/// and no thread there.
#[test]
fn guest_pages_through_a_flood_of_idle_strangers() {
    pagefleet_lab::system::allow_fds(8192);
    let c = Cluster::start(1, "64MiB");
    let pid = c.servers[0].child.id();
    let threads = || {
        let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        s.lines()
            .find(|l| l.starts_with("Threads:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .unwrap()
            .parse::<u64>()
            .unwrap()
    };
    let before = threads();
    let strangers: Vec<std::net::TcpStream> = (0..2000)
        .map(|_| std::net::TcpStream::connect(&c.servers[0].addr).unwrap())
        .collect();
    let pages = 4096u64;
    let r = region(&c, pages * P as u64, pages / 4, Policy::Clock, 16);
    write_then_verify(&r, pages, 2);
    assert!(r.stats().page_ins > pages / 2, "{:?}", r.stats());
    // One session (the pager's), no thread per stranger.
    assert!(
        threads() <= before + 3,
        "{} threads (was {before})",
        threads()
    );
    drop(strangers);
}

/// A TCP relay to `upstream` that cuts its first connection (both ways)
/// once `cut_after` bytes went through it towards the server; later
/// connections are relayed untouched. Returns its address and a count of
/// the connections it accepted.
fn cutting_relay(
    upstream: String,
    cut_after: u64,
) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = accepted.clone();
    use std::io::{Read, Write};
    use std::net::{Shutdown, TcpListener, TcpStream};
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for (n, c) in l.incoming().enumerate() {
            let Ok(c) = c else { return };
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let Ok(s) = TcpStream::connect(&upstream) else {
                return;
            };
            let _ = c.set_nodelay(true);
            let _ = s.set_nodelay(true);
            let (mut c2, mut s2) = (c.try_clone().unwrap(), s.try_clone().unwrap());
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut s2, &mut c2);
                let _ = c2.shutdown(Shutdown::Both);
            });
            let (mut c, mut s) = (c, s);
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 64 * 1024];
                let mut sent = 0u64;
                loop {
                    let k = match c.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(k) => k,
                    };
                    if s.write_all(&buf[..k]).is_err() {
                        break;
                    }
                    sent += k as u64;
                    if n == 0 && sent > cut_after {
                        break; // the cut
                    }
                }
                let _ = s.shutdown(Shutdown::Both);
                let _ = c.shutdown(Shutdown::Both);
            });
        }
    });
    (addr, accepted)
}

/// The connection to the memory server drops while the guest pages: the
/// pager reconnects (same server, its pages still there) and repeats the
/// page-in or page-out it was doing; every byte is still right.
#[test]
fn pager_rides_out_a_dropped_connection() {
    let c = Cluster::start(1, "64MiB");
    let (relay, accepted) = cutting_relay(c.servers[0].addr.clone(), 4 << 20);
    let pages = 4096u64;
    let mut cfg = Config::new(pages * P as u64, pages / 4);
    cfg.servers = vec![relay];
    cfg.secret = Some(c.secret.clone());
    let r = Region::new(cfg).unwrap();
    write_then_verify(&r, pages, 3);
    // The cut happened (more than 4 MiB went out) and the pager reconnected.
    assert!(r.stats().bytes_out > 16 << 20, "{:?}", r.stats());
    assert!(
        accepted.load(std::sync::atomic::Ordering::SeqCst) >= 2,
        "the pager never reconnected"
    );
}

/// Write every page of `r` (pages `0..pages`) with a round's pattern, then
/// read them back in a scattered order and check every byte; `rounds` times.
fn write_then_verify(r: &Region, pages: u64, rounds: u64) {
    let base = r.as_ptr() as usize;
    let mut want = vec![0u8; P];
    for round in 1..=rounds {
        for p in 0..pages {
            // SAFETY: inside the region's mapping; this thread is its only user.
            let page =
                unsafe { std::slice::from_raw_parts_mut((base + p as usize * P) as *mut u8, P) };
            fill(p, round, page);
        }
        for i in 0..pages {
            let p = (i * 7919) % pages;
            // SAFETY: as above.
            let page =
                unsafe { std::slice::from_raw_parts((base + p as usize * P) as *const u8, P) };
            fill(p, round, &mut want);
            assert!(page == &want[..], "round {round}: page {p} corrupted");
        }
    }
}
