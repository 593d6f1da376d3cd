//! Stopping a host's pagefleetd never silently kills guests here or on
//! other hosts: a stop while it lends pages to a running guest is refused
//! (logged, naming the guest) until the host is drained, a second request
//! within a minute stops anyway, and with `--stop-drain` the daemon drains
//! itself first. A kv guest under a value-checking load on another host
//! sees every value right through all of it.

use pagefleet_lab::kvload;
use pagefleet_systest::*;
use pagefleet_testbed::Link;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

const MIB: u64 = 1 << 20;

/// The process runs (not gone, not a zombie: the lab's daemons are this
/// test's children and nobody reaps them before the lab goes down).
fn alive(pid: u32) -> bool {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let state = s
        .rsplit_once(')')
        .and_then(|(_, r)| r.split_whitespace().next());
    matches!(state, Some(st) if st != "Z" && st != "X")
}

fn term(pid: u32) {
    let _ = pagefleet_common::sys::process::signal(pid as i32, libc::SIGTERM);
}

fn log_of(l: &LabRun, h: usize) -> String {
    std::fs::read_to_string(l.lab.dir.join(format!("{}.log", l.lab.hosts[h].netns)))
        .unwrap_or_default()
}

fn remote_on(l: &LabRun, name: &str, addr: &str) -> u64 {
    l.guest(name)
        .and_then(|(_, g)| g.pages.and_then(|p| p.remote.get(addr).copied()))
        .unwrap_or(0)
}

/// A 64 MiB kv guest on h1 with a quarter resident, paging to `server`,
/// filled and under a value-checking load from h3.
fn kv_paging_to(l: &LabRun, name: &str, server: &str) -> kvload::Load {
    kv_on(l, name, "h1", 1, server)
}

/// A 64 MiB kv guest on host `on` (service address number `ip`) with a
/// quarter resident, paging to `server`, filled and under a
/// value-checking load from h3.
fn kv_on(l: &LabRun, name: &str, on: &str, ip: u8, server: &str) -> kvload::Load {
    let ip = l.lab.service_ip(ip);
    let svc = format!("{ip}:11211");
    let (ok, _, err) = l.pf(
        0,
        &[
            "guest",
            "start",
            name,
            "--on",
            on,
            "--size",
            "64MiB",
            "--budget",
            "25%",
            "--",
            "kv",
            "--listen",
            &svc,
            "--service-ip",
            &ip,
            "--servers",
            server,
        ],
    );
    assert!(ok, "guest start {name}: {err}");
    let spec = kvload::Spec {
        addr: svc,
        keys: 16_000,
        value_len: 2000,
        conns: 2,
        get_frac: 0.9,
        theta: 0.99,
        netns: Some(l.lab.hosts[2].netns.clone()),
        reconnect: true,
        pace: None,
    };
    kvload::prefill(&spec).expect("prefill");
    let load = kvload::Load::start(&spec);
    wait_for(&format!("{name}'s pages on {server}"), 60, || {
        remote_on(l, name, server) > 4000
    });
    load
}

fn still_serving(load: &kvload::Load) {
    let before = load.counters.ops.load(Relaxed);
    std::thread::sleep(Duration::from_secs(1));
    assert!(load.counters.ops.load(Relaxed) > before, "the load stalled");
    assert_eq!(load.counters.bad_values.load(Relaxed), 0, "wrong values");
    assert_eq!(load.counters.misses.load(Relaxed), 0, "keys lost");
    assert!(load.error().is_none(), "{:?}", load.error());
}

#[test]
fn a_stop_that_would_lose_a_guests_pages_is_refused_until_the_host_is_drained() {
    if !is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    let l = lab("stp", 3, Link::Unshaped, 128 * MIB, &[256 * MIB, 0]);
    let (h2, h3) = (l.lab.hosts[1].clone(), l.lab.hosts[2].clone());
    let load = kv_paging_to(&l, "st1", &h2.addr);
    // systemctl stop: refused, named, logged; the guest keeps its pages.
    term(h2.pid);
    wait_for("h2's refusal in its log", 20, || {
        log_of(&l, 1).contains("refusing to stop")
    });
    let log = log_of(&l, 1);
    assert!(log.contains("guest st1 (running on h1)"), "{log}");
    assert!(log.contains("pagefleet host drain h2"), "{log}");
    std::thread::sleep(Duration::from_secs(1));
    assert!(alive(h2.pid), "h2's pagefleetd stopped with st1's pages");
    still_serving(&load);
    // Drained, it stops at once.
    let (ok, out, err) = l.pf(0, &["host", "drain", "h2"]);
    assert!(ok, "host drain h2: {out}{err}");
    assert_eq!(remote_on(&l, "st1", &h2.addr), 0);
    assert!(remote_on(&l, "st1", &h3.addr) > 0);
    term(h2.pid);
    wait_for("h2's pagefleetd to stop once drained", 20, || {
        !alive(h2.pid)
    });
    still_serving(&load);
    let c = load.counters.clone();
    load.stop().expect("load");
    assert_eq!(c.bad_values.load(Relaxed), 0);
    // h3 now holds st1's pages: refused, then a second stop within a
    // minute stops anyway — and st1, its pages gone, shows as failed.
    term(h3.pid);
    wait_for("h3's refusal", 20, || {
        log_of(&l, 2).contains("refusing to stop")
    });
    assert!(alive(h3.pid));
    term(h3.pid);
    wait_for("h3's pagefleetd to stop on the second request", 20, || {
        !alive(h3.pid)
    });
    assert!(log_of(&l, 2).contains("stopping anyway"));
}

#[test]
fn with_stop_drain_a_stop_drains_the_host_first() {
    if !is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    let l = lab_with("std", 3, Link::Unshaped, 128 * MIB, &[256 * MIB, 0], |o| {
        o.daemon_args = vec!["--stop-drain".into(), "60".into()];
    });
    let (h2, h3) = (l.lab.hosts[1].clone(), l.lab.hosts[2].clone());
    let load = kv_paging_to(&l, "sd1", &h2.addr);
    term(h2.pid);
    wait_for("h2's pagefleetd to drain and stop", 60, || !alive(h2.pid));
    let log = log_of(&l, 1);
    assert!(
        log.contains("draining before stopping") && log.contains("sd1"),
        "{log}"
    );
    assert_eq!(remote_on(&l, "sd1", &h2.addr), 0);
    assert!(remote_on(&l, "sd1", &h3.addr) > 0);
    still_serving(&load);
    let c = load.counters.clone();
    load.stop().expect("load");
    assert_eq!((c.bad_values.load(Relaxed), c.misses.load(Relaxed)), (0, 0));
}

/// The hosts' names as `pagefleet status --json` from h1 lists them (a host
/// that does not answer by its address), and how many do not answer.
fn listed(l: &LabRun) -> (Vec<String>, usize) {
    let s = l.status(0);
    let names = s
        .iter()
        .map(|h| {
            h.report
                .as_ref()
                .map_or(h.host.clone(), |r| r.hostname.clone())
        })
        .collect();
    (names, s.iter().filter(|h| h.report.is_none()).count())
}

fn removing_a_dead_host_unsticks_the_cluster(l: &LabRun, h3_is_etcd_member: bool) {
    let h3 = l.lab.hosts[2].clone();
    wait_for("3 hosts in the registry", 30, || {
        listed(l) == (vec!["h1".into(), "h2".into(), "h3".into()], 0)
    });
    // A live host is not removed.
    let (ok, _, err) = l.pf(0, &["host", "remove", "h3"]);
    assert!(!ok && err.contains("answers"), "{err}");
    // h3 dies (its daemon and, if it has one, its etcd member).
    let _ = pagefleet_common::sys::process::signal(h3.pid as i32, libc::SIGKILL);
    if h3_is_etcd_member {
        assert!(kill_in(l, 2, "--initial-cluster-state"), "no etcd on h3");
    }
    wait_for("h3 to be seen dead", 60, || listed(l).1 == 1);
    let (ok, out, err) = l.pf(0, &["gc", "--grace", "0"]);
    assert!(
        !ok && err.contains("host remove"),
        "gc waits for h3 and says how to go on: {out}{err}"
    );
    if !h3_is_etcd_member {
        let (_, out, _) = l.pf(0, &["status"]);
        assert!(out.contains("has not answered since"), "{out}");
    }
    let (ok, _, err) = l.pf(0, &["gc", "--grace", "0", "--unreachable-gone"]);
    assert!(ok, "gc for what the live hosts vouch for: {err}");
    // Removed: gone from every view; gc runs; commands naming it say so.
    let key = if h3_is_etcd_member {
        "h3".to_string()
    } else {
        h3.http()
    };
    let (ok, out, err) = l.pf(0, &["host", "remove", &key]);
    assert!(ok, "host remove: {out}{err}");
    if h3_is_etcd_member {
        assert!(out.contains("etcd member"), "{out}");
    }
    wait_for("h3 out of the registry", 30, || {
        listed(l) == (vec!["h1".into(), "h2".into()], 0)
    });
    let (ok, _, err) = l.pf(0, &["gc", "--grace", "0"]);
    assert!(ok, "gc after the removal: {err}");
    let (ok, _, err) = l.pf(0, &["evacuate", &key]);
    assert!(!ok, "evacuating a removed host");
    assert!(err.contains("removed") || err.contains("no host"), "{err}");
}

#[test]
fn a_dead_host_is_removed_from_the_peers_registry() {
    if !is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    let l = lab("rmp", 3, Link::Unshaped, 64 * MIB, &[128 * MIB, 0]);
    removing_a_dead_host_unsticks_the_cluster(&l, false);
}

#[test]
fn a_dead_host_and_its_etcd_member_are_removed_from_the_etcd_registry() {
    if !is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    let l = lab_with("rme", 3, Link::Unshaped, 64 * MIB, &[128 * MIB, 0], |o| {
        o.etcd = 3
    });
    removing_a_dead_host_unsticks_the_cluster(&l, true);
    // etcd itself has two members left.
    let out = l
        .lab
        .exec(0, "etcdctl")
        .args([
            "--endpoints",
            &format!("{}:2379", l.lab.hosts[0].ip),
            "member",
            "list",
        ])
        .env("ETCDCTL_API", "3")
        .output()
        .expect("etcdctl");
    let list = String::from_utf8_lossy(&out.stdout);
    assert_eq!(list.lines().count(), 2, "{list}");
    assert!(!list.contains("h3"), "{list}");
}

/// Longest run of 100 ms intervals without an operation, seconds.
fn longest_gap(t: &kvload::Timeline) -> f64 {
    let (mut run, mut most) = (0usize, 0usize);
    for v in &t.ops_per_sec {
        run = if *v == 0.0 { run + 1 } else { 0 };
        most = most.max(run);
    }
    most as f64 * t.interval
}

/// An upgrade: h1's pagefleetd stops (SIGTERM) and starts again while its
/// kv guest serves a value-checking load. The runner outlives the daemon
/// (the guest never stops serving) and the new daemon adopts it: listed,
/// controllable, stoppable. Its pages on h2 are untouched.
#[test]
fn a_restarted_daemon_adopts_its_running_guests() {
    if !is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    let mut l = lab("rst", 3, Link::Unshaped, 128 * MIB, &[256 * MIB, 0]);
    let h1 = l.lab.hosts[0].clone();
    let load = kv_paging_to(&l, "up1", &l.lab.hosts[1].addr.clone());
    let (_, before) = l.guest("up1").expect("up1 runs");
    start_synthetic(&l, "dies", 16, 100);
    let (_, dies) = l.guest("dies").expect("dies runs");
    // Nothing of anyone else's is lost by stopping h1's daemon: it stops.
    term(h1.pid);
    wait_for("h1's pagefleetd to stop", 20, || !alive(h1.pid));
    assert!(alive(before.pid), "the runner ended with its daemon");
    still_serving(&load);
    // A guest that dies while no daemon watches is not forgotten.
    let _ = pagefleet_common::sys::process::signal(dies.pid as i32, libc::SIGKILL);
    wait_for("dies's runner to end", 20, || !alive(dies.pid));
    l.restart_daemon(0).expect("start h1's pagefleetd again");
    let failed = l
        .status(0)
        .into_iter()
        .flat_map(|h| h.guests.into_iter().flatten())
        .find(|g| g.name == "dies")
        .expect("the dead guest is listed");
    assert_eq!(failed.state, pagefleet_api::GuestState::Failed);
    let why = failed.failure.expect("with its failure");
    assert!(
        why.exit.contains("while pagefleetd was not running"),
        "{why:?}"
    );
    let (ok, _, err) = l.pf(0, &["guest", "rm", "dies"]);
    assert!(ok, "guest rm: {err}");
    let mut found = None;
    wait_for("the restarted daemon to list up1", 20, || {
        found = l.guest("up1");
        found.is_some()
    });
    let (at, g) = found.unwrap();
    assert_eq!(
        (at, g.pid, g.state),
        (0, before.pid, pagefleet_api::GuestState::Running)
    );
    assert!(
        log_of(&l, 0).contains("adopted 1 running guest"),
        "{}",
        log_of(&l, 0)
    );
    still_serving(&load);
    // It is the daemon's again: budget changes and a clean stop work.
    let c = load.counters.clone();
    let t = load.stop().expect("load");
    assert_eq!((c.bad_values.load(Relaxed), c.misses.load(Relaxed)), (0, 0));
    // (A figure, not a check: times belong in benchmarks.)
    eprintln!(
        "longest service gap through the daemon's restart: {:.1} s",
        longest_gap(&t)
    );
    let (ok, _, err) = l.pf(0, &["guest", "stop", "up1"]);
    assert!(ok, "guest stop after adoption: {err}");
    wait_for("up1's runner to end", 30, || !alive(before.pid));
    std::thread::sleep(Duration::from_millis(500));
    let names: Vec<String> = l
        .status(0)
        .into_iter()
        .flat_map(|h| h.guests.into_iter().flatten())
        .map(|g| g.name)
        .collect();
    assert!(
        names.is_empty(),
        "a stopped adopted guest leaves no record: {names:?}"
    );
}

/// An upgrade in place: `pagefleet host restart h1` while h1 runs two kv
/// guests and lends pages to a third on h2, all three under value-checking
/// loads. The daemon execs itself in the same process, handing over its
/// memory server (pages, server id, socket): h1's guests are adopted, the
/// guest on h2 reconnects to the same pages. Nothing is lost, no value is
/// wrong; the longest gap in service is printed (the goal, 1 s, is checked
/// by `pagefleet bench restart`).
#[test]
fn an_in_place_restart_keeps_the_guests_here_and_the_pages_lent_to_others() {
    if !is_root() {
        eprintln!("skipped: the testbed needs root (CI runs as root)");
        return;
    }
    let l = lab("inp", 3, Link::Unshaped, 128 * MIB, &[256 * MIB, 128 * MIB]);
    let (h1, h2) = (l.lab.hosts[0].clone(), l.lab.hosts[1].clone());
    let a = kv_on(&l, "ip1", "h1", 1, &h2.addr);
    let b = kv_on(&l, "ip2", "h1", 2, &h2.addr);
    let c = kv_on(&l, "ip3", "h2", 3, &h1.addr);
    let pids: Vec<u32> = ["ip1", "ip2", "ip3"]
        .iter()
        .map(|n| l.guest(n).expect("runs").1.pid)
        .collect();
    let lent = remote_on(&l, "ip3", &h1.addr);
    let (ok, out, err) = l.pf(0, &["host", "restart", "h1"]);
    assert!(ok, "host restart: {out}{err}");
    assert!(out.contains("h1 restarted in place"), "{out}{err}");
    assert!(alive(h1.pid), "the same process goes on");
    let log = log_of(&l, 0);
    assert!(log.contains("restarted in place from pagefleetd"), "{log}");
    assert!(log.contains("adopted 2 running guest"), "{log}");
    for load in [&a, &b, &c] {
        still_serving(load);
    }
    for (n, pid) in ["ip1", "ip2", "ip3"].iter().zip(&pids) {
        let (_, g) = l.guest(n).expect("listed");
        assert_eq!(
            (g.pid, g.state),
            (*pid, pagefleet_api::GuestState::Running),
            "{n}"
        );
    }
    // ip3's pages are still on h1's memory server, and it goes on using them.
    assert!(
        remote_on(&l, "ip3", &h1.addr) > lent / 2,
        "ip3's pages left h1"
    );
    let mut gaps = Vec::new();
    for (n, load) in [("ip1", a), ("ip2", b), ("ip3", c)] {
        let k = load.counters.clone();
        let t = load.stop().expect("load");
        assert_eq!(
            (k.bad_values.load(Relaxed), k.misses.load(Relaxed)),
            (0, 0),
            "{n}: wrong values or lost keys"
        );
        gaps.push(format!("{n} {:.1} s", longest_gap(&t)));
    }
    // (A figure, not a check: times belong in benchmarks.)
    eprintln!(
        "longest service gaps through the in-place restart: {}",
        gaps.join(", ")
    );
    // The restarted daemon is the guests' keeper: a clean stop works.
    let (ok, _, err) = l.pf(0, &["guest", "stop", "ip1"]);
    assert!(ok, "guest stop after the restart: {err}");
    wait_for("ip1's runner to end", 30, || !alive(pids[0]));
}
