//! Split migration (S-memV) on the testbed: real pagefleetd per host, real
//! runners, real links. Every test checks data, not just exit codes: region
//! checksums at stop time and at resume, or every kv value read back.

use pagefleet_api::{GuestState, GuestStatus, IncomingReply, ProgressEvent};
use pagefleet_lab::kvload;
use pagefleet_systest::*;
use pagefleet_testbed::Link;
use serde_json::{json, Value};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Mutex;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

/// The drills time their faults to migration phases: one lab at a time, so
/// a busy neighbour test does not stretch a phase out of reach.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// `pagefleet CMD --json ARGS` in h1: the report, or the error text.
fn report(l: &LabRun, cmd: &str, args: &[&str]) -> Result<Value, String> {
    let mut a = vec![cmd, "--json"];
    a.extend_from_slice(args);
    let (ok, out, err) = l.pf(0, &a);
    if ok {
        Ok(serde_json::from_str(&out).unwrap_or_else(|e| panic!("report: {e}: {out}")))
    } else {
        Err(err)
    }
}

fn migrate(l: &LabRun, args: &[&str]) -> Result<Value, String> {
    report(l, "migrate", args)
}

fn migrate_gather(l: &LabRun, args: &[&str]) -> Result<Value, String> {
    report(l, "gather", args)
}

/// A 192 MiB kv guest on h1 serving at `ip`, filled with `keys` items and
/// under a reconnecting, value-checking client load from host `client`.
fn kv_guest_under_load(l: &LabRun, name: &str, ip: &str, keys: u64, client: usize) -> kvload::Load {
    let svc = format!("{ip}:11211");
    let (ok, _, err) = l.pf(
        0,
        &[
            "guest",
            "start",
            name,
            "--on",
            "h1",
            "--size",
            "192MiB",
            "--",
            "kv",
            "--listen",
            &svc,
            "--service-ip",
            ip,
        ],
    );
    assert!(ok, "{err}");
    let spec = kvload::Spec {
        addr: svc,
        keys,
        value_len: 2000,
        conns: 4,
        get_frac: 0.9,
        theta: 0.99,
        netns: Some(l.lab.hosts[client].netns.clone()),
        reconnect: true,
        pace: None,
    };
    kvload::prefill(&spec).expect("prefill");
    kvload::Load::start(&spec)
}

/// Pages of guest `g` on the memory server at `addr`.
fn remote_on(g: &GuestStatus, addr: &str) -> u64 {
    g.pages
        .as_ref()
        .and_then(|p| p.remote.get(addr).copied())
        .unwrap_or(0)
}

fn ops(l: &LabRun, name: &str) -> u64 {
    l.guest(name).map(|g| g.1.ops).unwrap_or(0)
}

/// The guest keeps running: its operation count grows.
fn assert_runs(l: &LabRun, name: &str, on: usize) {
    let (h, g) = l.guest(name).unwrap_or_else(|| panic!("{name} is gone"));
    assert_eq!(h, on, "{name} should run on h{}: {g:?}", on + 1);
    assert_eq!(g.state, GuestState::Running, "{g:?}");
    let a = ops(l, name);
    let t = Instant::now();
    let mut b = a;
    // The runner counts operations once a second.
    while b <= a && t.elapsed() < Duration::from_secs(8) {
        std::thread::sleep(Duration::from_millis(200));
        b = ops(l, name);
    }
    assert!(b > a, "{name} does not make progress ({a} -> {b})");
}

fn start_writer(l: &LabRun, name: &str, size: &str) {
    // Half of the operations write, over a zipf spread of pages, at a bounded rate.
    let (ok, _, err) = l.pf(
        0,
        &[
            "guest",
            "start",
            name,
            "--on",
            "h1",
            "--size",
            size,
            "--",
            "synthetic",
            "--prefill",
            "--write-frac",
            "0.5",
            "--dist",
            "zipf:0.9",
            "--rate",
            "2000000",
        ],
    );
    assert!(ok, "guest start: {err}");
    // Let the prefill finish and the access history fill in.
    let t = Instant::now();
    while ops(l, name) == 0 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "guest never started working"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(1500));
}

#[test]
fn split_migration_under_writes_then_gather_then_partial_move_keep_every_byte() {
    if !is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    let _s = serial();
    // h1 runs the guest; h2 has memory for half of it; h3 only lends.
    let l = lab(
        "mig",
        3,
        Link::Gbit10,
        512 * MIB,
        &[512 * MIB, 128 * MIB, 0],
    );
    start_writer(&l, "w1", "256MiB");
    let r = migrate(&l, &["w1", "--verify"]).expect("split migration");
    assert_eq!(
        r["checksum_source"], r["checksum_dest"],
        "region differs after migration: {r}"
    );
    assert!(r["checksum_source"].is_string(), "{r}");
    // Placement: main host h2 (most free guest memory), sub-host h3.
    assert!(
        r["main_host"]
            .as_str()
            .unwrap()
            .starts_with(&l.lab.hosts[1].ip),
        "{r}"
    );
    assert_eq!(r["sub_hosts"], json!([l.lab.hosts[2].addr]), "{r}");
    let subs = r["pages_subs"][0].as_u64().unwrap();
    assert!(
        subs > 16000,
        "cold pages should go straight to the sub-host: {r}"
    );
    assert!(
        r["pages_main"].as_u64().unwrap() <= 32768,
        "main host got more than its memory: {r}"
    );
    // It runs on h2 now, paging with h3; the registry shows where its pages are.
    assert_runs(&l, "w1", 1);
    let (_, g) = l.guest("w1").unwrap();
    let on_h3 = remote_on(&g, &l.lab.hosts[2].addr);
    assert!(on_h3 > 0, "no pages on h3: {g:?}");
    assert!(g.resident_pages <= 32768, "{g:?}");
    assert!(l.host_report(2).unwrap().lend_used > 0);
    // `guest status` shows what paging costs it there.
    let t = Instant::now();
    loop {
        let (ok, out, err) = l.pf(0, &["guest", "status", "w1", "--json"]);
        assert!(ok, "guest status: {err}");
        let s: serde_json::Value = serde_json::from_str(&out).expect("guest status JSON");
        let p = &s["paging"];
        assert!(p.is_object(), "no paging costs: {s}");
        if s["page_ins"].as_u64().unwrap_or(0) > 0 {
            assert!(p["cpu_per_page_in_us"].as_f64().unwrap() > 0.0, "{s}");
            assert!(p["fault_p50_us"].as_f64().unwrap() > 0.0, "{s}");
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "no page-ins on h2: {s}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let (ok, out, _) = l.pf(0, &["guest", "status", "w1"]);
    assert!(ok && out.contains("paging costs"), "{out}");
    // The source's memory is free again.
    assert_eq!(l.host_report(0).unwrap().guest_free, 512 * MIB);
    // Gather it back onto h1 while it writes and pages (it is over its
    // budget on h2): the main host streams, h1 pulls from h3 in parallel.
    let g = migrate_gather(&l, &["w1", "--to", "h1", "--verify"]).expect("gather");
    assert_eq!(
        g["checksum_source"], g["checksum_dest"],
        "gathered guest differs: {g}"
    );
    assert_eq!(g["sub_hosts"], json!([]), "{g}");
    assert!(
        g["pages_pulled"].as_u64().unwrap() > 0,
        "nothing was pulled from the sub-host: {g}"
    );
    assert_runs(&l, "w1", 0);
    let (_, gs) = l.guest("w1").unwrap();
    assert_eq!(gs.remote_pages, 0, "{gs:?}");
    let t = Instant::now();
    while l.host_report(2).unwrap().lend_used > 0 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the sub-host still holds the gathered guest's pages"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Split again, for the partial move below.
    let r = migrate(&l, &["w1", "--to", "h2", "--sub", "h3", "--verify"])
        .expect("second split migration");
    assert_eq!(r["checksum_source"], r["checksum_dest"], "{r}");
    // Move the main part back to h1 while it writes: pages on h3 stay there.
    let r2 = migrate(&l, &["w1", "--to", "h1", "--verify"]).expect("migration back");
    assert_eq!(r2["checksum_source"], r2["checksum_dest"], "{r2}");
    assert_eq!(r2["sub_hosts"], json!([]), "{r2}");
    assert_runs(&l, "w1", 0);
    let (ok, _, err) = l.pf(0, &["guest", "stop", "w1"]);
    assert!(ok, "{err}");
    // A stopped guest leaves nothing on the servers.
    assert_eq!(l.host_report(2).unwrap().lend_used, 0);
}

/// A kv guest serving clients through its service address: every value
/// stays right across the migration and clients find it on the new host.
#[test]
fn kv_guest_migrates_under_client_load() {
    if !is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    let _s = serial();
    let l = lab("kvm", 3, Link::Gbit10, 512 * MIB, &[512 * MIB, 96 * MIB, 0]);
    let ip = l.lab.service_ip(1);
    let load = kv_guest_under_load(&l, "kv1", &ip, 30_000, 2);
    std::thread::sleep(Duration::from_secs(2));
    let before = load.counters.ops.load(Relaxed);
    let r = migrate(&l, &["kv1", "--to", "h2", "--sub", "h3", "--verify"]).expect("kv migration");
    assert_eq!(r["checksum_source"], r["checksum_dest"], "{r}");
    std::thread::sleep(Duration::from_secs(3));
    let after = load.counters.ops.load(Relaxed);
    let c = load.counters.clone();
    let err = load.error();
    load.stop().expect("load");
    assert!(err.is_none(), "{err:?}");
    assert_eq!(c.bad_values.load(Relaxed), 0, "wrong values served");
    assert_eq!(c.misses.load(Relaxed), 0, "keys lost");
    assert!(
        after > before + 1000,
        "clients made no progress after the migration ({before} -> {after})"
    );
    assert!(
        c.reconnects.load(Relaxed) > 0,
        "clients should have reconnected to the moved address"
    );
    assert_eq!(
        l.lab.service_ip_host(&ip),
        Some(1),
        "service address did not move to h2"
    );
    let (h, g) = l.guest("kv1").unwrap();
    assert_eq!((h, g.state), (1, GuestState::Running), "{g:?}");
}

/// Abort drills: the destination dies in pre-copy, at stop-and-copy, a
/// sub-host dies, the user presses Ctrl-C. Each time the source keeps
/// running with all its data (a later migration's checksums agree), and
/// nothing is left behind on the sub-hosts or the destination.
#[test]
fn aborted_migrations_leave_the_source_running_and_nothing_behind() {
    if !is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    let _s = serial();
    // 1 Gbit links: one pre-copy round of 128 MiB takes about a second.
    let l = lab("abt", 4, Link::Gbit1, 256 * MIB, &[256 * MIB, 64 * MIB, 0]);
    start_writer(&l, "a1", "128MiB");
    let src_ctl = l.control(0, "a1");
    let phase = || {
        guest_status(&src_ctl)
            .and_then(|g| g.migration)
            .map(|m| m.phase)
            .unwrap_or_default()
    };
    let wait_phase = |p: &str| {
        let t = Instant::now();
        while !phase().starts_with(p) {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "never reached phase {p}"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    };
    let signal_in = |h: usize, pattern: &str, sig: i32| {
        pagefleet_systest::signal_in(&l, h, pattern, sig);
    };
    let kill_in = |h: usize, pattern: &str| signal_in(h, pattern, libc::SIGKILL);
    let check_clean = |what: &str| {
        assert_runs(&l, "a1", 0);
        for h in [2, 3] {
            if let Some(rep) = l.host_report(h) {
                assert_eq!(rep.lend_used, 0, "{what}: pages left on h{}", h + 1);
            }
        }
        let t = Instant::now();
        // The destination's reserved memory comes back when its runner goes.
        while l.host_report(1).unwrap().guest_free != 64 * MIB {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "{what}: destination memory still reserved"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    let run_bg = |args: Vec<String>| {
        let mut c = l.lab.exec(0, bin("pagefleet"));
        c.arg("migrate")
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped());
        c.spawn().unwrap()
    };

    // 1. The destination runner dies during round 1.
    let mut m = run_bg(vec![
        "a1".into(),
        "--to".into(),
        "h2".into(),
        "--sub".into(),
        "h3".into(),
    ]);
    wait_phase("round 1");
    kill_in(1, "runner-incoming");
    let st = m.wait().unwrap();
    assert!(!st.success(), "migration to a dead destination succeeded");
    check_clean("destination killed in round 1");

    // 2. Ctrl-C on the command during round 1.
    let m = run_bg(vec![
        "a1".into(),
        "--to".into(),
        "h2".into(),
        "--sub".into(),
        "h3".into(),
    ]);
    wait_phase("round 1");
    let t_int = Instant::now();
    let _ = pagefleet_common::sys::process::signal(m.id() as i32, libc::SIGINT);
    // What the source runner reported right after the Ctrl-C: if the drill
    // ever finds the guest on the destination, this says how far it was.
    eprintln!("Ctrl-C drill: phase {:?} right after SIGINT", phase());
    let out = m.wait_with_output().unwrap();
    eprintln!(
        "Ctrl-C drill: command gone after {:?}, phase {:?}",
        t_int.elapsed(),
        phase()
    );
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "Ctrl-C: {said}");
    assert!(
        said.contains("cancel") && said.contains("rolled back:"),
        "Ctrl-C must say what was undone: {said}"
    );
    let t = Instant::now();
    while !phase().is_empty() && t.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(50));
    }
    check_clean("Ctrl-C");

    // 3. The destination dies at stop-and-copy (the stop-time checksum
    // holds that phase open long enough to hit it).
    let mut m = run_bg(vec![
        "a1".into(),
        "--to".into(),
        "h2".into(),
        "--sub".into(),
        "h3".into(),
        "--verify".into(),
        "--max-rounds".into(),
        "2".into(),
    ]);
    wait_phase("stop-and-copy");
    kill_in(1, "runner-incoming");
    assert!(!m.wait().unwrap().success());
    check_clean("destination killed at stop-and-copy");

    // 4. The destination freezes (SIGSTOP) during round 1: the migration
    // is given up within its timeout, not after minutes.
    let m = run_bg(vec![
        "a1".into(),
        "--to".into(),
        "h2".into(),
        "--sub".into(),
        "h3".into(),
        "--timeout".into(),
        "5".into(),
    ]);
    wait_phase("round 1");
    let t_stop = Instant::now();
    signal_in(1, "runner-incoming", libc::SIGSTOP);
    let out = m.wait_with_output().unwrap();
    let took = t_stop.elapsed();
    signal_in(1, "runner-incoming", libc::SIGKILL);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "frozen destination: {said}");
    assert!(said.contains("timed out after 5 s"), "{said}");
    assert!(
        took < Duration::from_secs(20),
        "gave up after {took:?}: {said}"
    );
    check_clean("destination frozen");

    // 5. The sub-host's daemon dies during pre-copy.
    let mut m = run_bg(vec![
        "a1".into(),
        "--to".into(),
        "h2".into(),
        "--sub".into(),
        "h3".into(),
    ]);
    wait_phase("round 1");
    kill_in(2, "pagefleetd");
    assert!(!m.wait().unwrap().success());
    check_clean("sub-host killed");

    // After all that, the data is intact: a migration (h4 as sub-host now)
    // checks the region at stop time against the resumed copy.
    let r = migrate(&l, &["a1", "--to", "h2", "--sub", "h4", "--verify"])
        .expect("migration after the drills");
    assert_eq!(r["checksum_source"], r["checksum_dest"], "{r}");
    assert_runs(&l, "a1", 1);

    // 6. The migration belongs to the source host's daemon: the command
    // killed outright (no Ctrl-C, no cancel) does not stop it.
    let mut m = run_bg(vec!["a1".into(), "--to".into(), "h1".into()]);
    let src_ctl = l.control(1, "a1");
    let t = Instant::now();
    while !guest_status(&src_ctl)
        .and_then(|g| g.migration)
        .is_some_and(|p| p.phase.starts_with("round"))
    {
        assert!(t.elapsed() < Duration::from_secs(60), "never started");
        std::thread::sleep(Duration::from_millis(5));
    }
    let _ = m.kill();
    let _ = m.wait();
    let t = Instant::now();
    while l.guest("a1").map(|g| g.0) != Some(0) {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the migration stopped with its command"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_runs(&l, "a1", 0);
}

/// Placement without hints: the main host is the one with the most free
/// guest memory, sub-hosts the fewest (largest) that fit; a guest too big
/// for the cluster is refused before anything moves.
#[test]
fn placement_picks_the_roomiest_main_host_and_fewest_sub_hosts() {
    if !is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    let _s = serial();
    let l = lab(
        "plc",
        5,
        Link::Unshaped,
        64 * MIB,
        &[256 * MIB, 32 * MIB, 96 * MIB, 0, 0],
    );
    // 150 MiB guest: main h3 (96 MiB free, filled to its pager's low
    // watermark), the rest fits one sub-host of 64 MiB.
    let (ok, _, err) = l.pf(
        0,
        &[
            "guest",
            "start",
            "p1",
            "--on",
            "h1",
            "--size",
            "150MiB",
            "--",
            "synthetic",
            "--prefill",
            "--rate",
            "0",
        ],
    );
    assert!(ok, "{err}");
    let t = Instant::now();
    while l
        .guest("p1")
        .map(|g| g.1.pages.map_or(0, |p| p.local))
        .unwrap_or(0)
        < 38400
    {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "prefill never finished"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let r = migrate(&l, &["p1", "--verify"]).expect("placed migration");
    assert_eq!(r["checksum_source"], r["checksum_dest"]);
    assert!(
        r["main_host"]
            .as_str()
            .unwrap()
            .starts_with(&format!("{}:", l.lab.hosts[2].ip)),
        "main should be h3: {r}"
    );
    assert_eq!(
        r["sub_hosts"].as_array().unwrap().len(),
        1,
        "one sub-host fits: {r}"
    );
    assert_ne!(
        r["sub_hosts"][0],
        json!(l.lab.hosts[0].addr),
        "the source is not a sub-host: {r}"
    );
    // Too big for what is left anywhere: refused, nothing changes.
    // 240 MiB: at most 32 MiB on a main host (h2) + 3 x 64 MiB lent elsewhere.
    let (ok, _, err) = l.pf(
        0,
        &[
            "guest",
            "start",
            "p2",
            "--on",
            "h1",
            "--size",
            "240MiB",
            "--",
            "synthetic",
            "--prefill",
            "--rate",
            "0",
        ],
    );
    assert!(ok, "{err}");
    std::thread::sleep(Duration::from_secs(2));
    let e = migrate(&l, &["p2"]).expect_err("a guest larger than the cluster's free memory");
    assert!(e.contains("not enough memory"), "{e}");
    let (h, g) = l.guest("p2").unwrap();
    assert_eq!((h, g.state), (0, GuestState::Running), "{g:?}");
}

/// Maintenance: empty a sub-host while its guest serves clients (its pages
/// move to another memory server), then empty the main host (the guest
/// migrates away, its sub-host pages stay). Every value stays right.
#[test]
fn evacuating_sub_host_and_main_host_under_load_keeps_every_value() {
    if !is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    let _s = serial();
    let l = lab("evc", 4, Link::Gbit10, 512 * MIB, &[512 * MIB, 96 * MIB, 0]);
    let ip = l.lab.service_ip(2);
    let load = kv_guest_under_load(&l, "kv2", &ip, 70_000, 3);
    migrate(&l, &["kv2", "--to", "h2", "--sub", "h3"]).expect("split migration");
    let on = |h: usize| remote_on(&l.guest("kv2").unwrap().1, &l.lab.hosts[h].addr);
    assert!(on(2) > 0, "nothing on h3 to evacuate: {:?}", l.guest("kv2"));
    // 1. Empty the sub-host h3.
    let (ok, out, err) = l.pf(0, &["evacuate", "h3"]);
    assert!(ok, "evacuate h3: {err}");
    assert!(out.contains("pages moved from h3"), "{out}");
    assert_eq!(on(2), 0, "pages left on h3");
    assert_eq!(l.host_report(2).map(|r| r.lend_used), Some(0));
    let moved_to: u64 = on(0) + on(3);
    assert!(moved_to > 0, "the pages went nowhere");
    // 2. Empty the main host h2: kv2 migrates away, its sub-host pages stay.
    let (ok, _, err) = l.pf(0, &["evacuate", "h2"]);
    assert!(ok, "evacuate h2: {err}");
    let (h, _) = l.guest("kv2").unwrap();
    assert_ne!(h, 1, "kv2 still runs on h2");
    assert_eq!(
        l.lab.service_ip_host(&ip),
        Some(h),
        "service address did not follow the guest"
    );
    let before = load.counters.ops.load(Relaxed);
    std::thread::sleep(Duration::from_secs(2));
    let after = load.counters.ops.load(Relaxed);
    let c = load.counters.clone();
    let e = load.error();
    load.stop().expect("load");
    assert!(e.is_none(), "{e:?}");
    assert!(after > before, "clients stalled after the evacuations");
    assert_eq!(c.bad_values.load(Relaxed), 0, "wrong values served");
    assert_eq!(c.misses.load(Relaxed), 0, "keys lost");
}

/// The destination's migration port is reachable by anyone in the cluster
/// network: garbage, a wrong secret and a half-open connection arriving
/// first are turned away, and the real migration still goes through.
#[test]
fn strangers_on_the_migration_port_do_not_stop_a_migration() {
    if !is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    let _s = serial();
    let l = lab("stg", 3, Link::Gbit10, 256 * MIB, &[256 * MIB, 64 * MIB, 0]);
    let (ok, _, err) = l.pf(
        0,
        &[
            "guest",
            "start",
            "s1",
            "--on",
            "h1",
            "--size",
            "96MiB",
            "--",
            "synthetic",
            "--prefill",
            "--write-frac",
            "0.5",
            "--rate",
            "200000",
        ],
    );
    assert!(ok, "{err}");
    std::thread::sleep(Duration::from_secs(2));
    let inc: IncomingReply = l
        .post(
            1,
            "/incoming",
            &json!({"name": "s1", "budget_pages": 16384}),
            Duration::from_secs(10),
        )
        .expect("incoming");
    let addr = inc.migrate_addr;
    // From h3: garbage, a wrong secret, and a connection that says nothing.
    let a2 = addr.clone();
    let idle = l
        .lab
        .spawn_in(2, move || {
            use std::io::Write;
            let mut g = std::net::TcpStream::connect(&a2).unwrap();
            let _ = g.write_all(
                b"GET / HTTP/1.1\r\n\r\nthis is not a migration stream at all...........",
            );
            drop(g);
            let wrong = pagefleet_proto::auth::Secret::from_bytes(
                b"definitely-not-the-cluster-secret",
                "test",
            )
            .unwrap();
            let s = std::net::TcpStream::connect(&a2).unwrap();
            let r = pagefleet_migrate::wire::Stream::new(s).connect_auth(&wrong);
            assert!(r.is_err(), "a wrong secret was accepted");
            std::net::TcpStream::connect(&a2).unwrap()
        })
        .join()
        .unwrap()
        .unwrap();
    // The real migration, through the source host's daemon.
    let body = json!({"to": addr, "subs": [{"addr": l.lab.hosts[2].addr, "pages": 65536}], "main_pages": 16384, "verify": true});
    let http = l.lab.hosts[0].http();
    let client = l.client().unwrap();
    let last = l
        .lab
        .spawn_in(0, move || {
            let mut last = None;
            client
                .post_stream(
                    &http,
                    "/guests/s1/migrate",
                    &body,
                    Duration::from_secs(60),
                    |ev: ProgressEvent| {
                        if !matches!(ev, ProgressEvent::Progress(_)) {
                            last = Some(ev);
                        }
                        true
                    },
                )
                .unwrap();
            last
        })
        .join()
        .unwrap()
        .unwrap()
        .expect("no report");
    drop(idle);
    let ProgressEvent::Report(r) = last else {
        panic!("migration failed: {last:?}");
    };
    assert_eq!(r.checksum_source, r.checksum_dest, "{r:?}");
    assert_runs(&l, "s1", 1);
}

/// `host drain h3` moves every guest page off h3 and keeps placement off it
/// until `host uncordon h3`: a placed migration leaves it out, one that
/// names it is refused; uncordoned, it is used again.
#[test]
fn a_drained_host_stays_out_of_placement_until_uncordoned() {
    if !is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    let _s = serial();
    let l = lab(
        "drn",
        4,
        Link::Unshaped,
        128 * MIB,
        &[256 * MIB, 64 * MIB, 0, 0],
    );
    let h3 = l.lab.hosts[2].addr.clone();
    let (ok, _, err) = l.pf(
        0,
        &[
            "guest",
            "start",
            "d1",
            "--on",
            "h1",
            "--size",
            "64MiB",
            "--budget",
            "25%",
            "--",
            "synthetic",
            "--servers",
            &h3,
            "--prefill",
            "--rate",
            "0",
        ],
    );
    assert!(ok, "guest start d1: {err}");
    wait_for("d1's pages on h3", 60, || {
        l.guest("d1")
            .is_some_and(|(_, g)| remote_on(&g, &h3) > 8000)
    });
    let (ok, out, err) = l.pf(0, &["host", "drain", "h3"]);
    assert!(ok, "host drain h3: {out}{err}");
    assert!(
        out.contains("pages moved from h3") && out.contains("drained"),
        "{out}"
    );
    let r3 = l.host_report(2).unwrap();
    assert!(r3.cordoned && r3.lend_used == 0, "{r3:?}");
    assert_eq!(remote_on(&l.guest("d1").unwrap().1, &h3), 0);
    let (_, out, _) = l.pf(0, &["status"]);
    assert!(out.contains("cordoned"), "status shows it: {out}");

    // A placed split migration: main host h2 (the only one with guest
    // memory to spare), sub-host h4, never h3.
    let (ok, _, err) = l.pf(
        0,
        &[
            "guest",
            "start",
            "d2",
            "--on",
            "h1",
            "--size",
            "112MiB",
            "--",
            "synthetic",
            "--prefill",
            "--rate",
            "0",
        ],
    );
    assert!(ok, "guest start d2: {err}");
    wait_for("d2's prefill", 60, || {
        l.guest("d2")
            .is_some_and(|(_, g)| g.pages.map_or(0, |p| p.local) >= 28000)
    });
    let r = migrate(&l, &["d2", "--verify"]).expect("placed migration");
    assert_eq!(r["checksum_source"], r["checksum_dest"]);
    let subs = r["sub_hosts"].as_array().unwrap();
    assert!(!subs.is_empty(), "{r}");
    assert!(
        subs.iter().all(|s| s != &json!(h3)),
        "placed on cordoned h3: {r}"
    );
    // Named, it is refused with the reason; nothing moves.
    let e = migrate(&l, &["d2", "--to", "h1", "--sub", "h3"]).expect_err("h3 is cordoned");
    assert!(e.contains("h3 is cordoned"), "{e}");
    let runs_on = |h: usize| {
        let (at, g) = l.guest("d2").expect("d2 runs");
        assert_eq!((at, g.state), (h, GuestState::Running), "{g:?}");
    };
    runs_on(1);
    // Uncordoned, placement may use it again.
    let (ok, _, err) = l.pf(0, &["host", "uncordon", "h3"]);
    assert!(ok, "{err}");
    assert!(!l.host_report(2).unwrap().cordoned);
    let r = migrate(&l, &["d2", "--to", "h1", "--sub", "h3", "--verify"]).expect("h3 usable again");
    assert_eq!(r["checksum_source"], r["checksum_dest"]);
    runs_on(0);
}
