//! etcd as the cluster's registry on the testbed (issue 20): a 3-member
//! etcd in the hosts' namespaces, daemons keeping lease-bound heartbeats,
//! a host killed with SIGKILL shown dead and avoided by placement, the
//! etcd leader killed during a migration.

use pagefleet_systest::*;
use pagefleet_testbed::Link;
use serde_json::Value;
use std::time::Duration;

const MIB: u64 = 1 << 20;

fn have_etcd() -> bool {
    std::process::Command::new("etcd")
        .arg("--version")
        .output()
        .is_ok()
}

/// The lab host running the etcd leader (asked from inside h1).
fn etcd_leader(l: &LabRun) -> Option<usize> {
    let eps: Vec<String> = l.lab.hosts[..3]
        .iter()
        .map(|h| format!("{}:2379", h.ip))
        .collect();
    let eps: Vec<&str> = eps.iter().map(String::as_str).collect();
    let ep = pagefleet_lab::etcd::ask_leader(l.lab.exec(0, "etcdctl"), &eps)?;
    l.lab.hosts.iter().position(|h| ep.contains(&h.ip))
}

#[test]
fn a_killed_host_is_shown_dead_and_placement_avoids_it() {
    if !is_root() || !have_etcd() {
        eprintln!("skipped: needs root and etcd (make deps installs etcd-server)");
        return;
    }
    let l = lab_with(
        "reg",
        4,
        Link::Gbit10,
        128 * MIB,
        &[256 * MIB, 96 * MIB, 192 * MIB, 96 * MIB],
        |o| o.etcd = 3,
    );
    wait_for("4 live hosts in the registry", 30, || {
        let s = l.status(0);
        s.len() == 4 && s.iter().all(|h| h.report.is_some())
    });
    // The registry's view as series: every host up, its claims (none now).
    let text = l.get_text(0, "/metrics").unwrap();
    assert_eq!(promtool_check_metrics(&text), "", "{text}");
    for h in &l.lab.hosts {
        for pool in ["guest", "lend"] {
            let s = format!(
                "pagefleet_registry_claimed_bytes{{host=\"{}\",pool=\"{pool}\"}} 0",
                h.name
            );
            assert!(text.contains(&s), "{s} in:\n{text}");
        }
        assert!(
            text.contains(&format!(
                "pagefleet_registry_host_up{{host=\"{}\"}} 1",
                h.name
            )),
            "{text}"
        );
    }
    // h3 has the most free guest memory: placement would pick it. Kill it.
    assert!(kill_in(&l, 2, "pagefleetd"), "no pagefleetd in h3");
    wait_for("h3 shown dead", 40, || {
        l.status(0).iter().any(|h| {
            h.report.is_none()
                && h.error
                    .as_deref()
                    .is_some_and(|e| e.contains("lease expired"))
        })
    });
    let (_, out, _) = l.pf(0, &["status"]);
    eprintln!("{out}");
    start_synthetic(&l, "g1", 64, 2000);
    let (ok, out, err) = l.pf(0, &["migrate", "g1", "--verify", "--json"]);
    assert!(ok, "placed migration: {err}");
    let r: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(r["checksum_source"], r["checksum_dest"], "{r}");
    let main = r["main_host"].as_str().unwrap();
    assert!(
        !main.contains(&l.lab.hosts[2].ip),
        "placement chose the dead host h3: {r}"
    );
}

#[test]
fn the_etcd_leader_killed_during_a_migration_leaves_the_guest_whole() {
    if !is_root() || !have_etcd() {
        eprintln!("skipped: needs root and etcd (make deps installs etcd-server)");
        return;
    }
    let l = lab_with(
        "regl",
        3,
        Link::Gbit1,
        128 * MIB,
        &[256 * MIB, 256 * MIB, 0],
        |o| o.etcd = 3,
    );
    wait_for("3 live hosts in the registry", 30, || {
        let s = l.status(0);
        s.len() == 3 && s.iter().all(|h| h.report.is_some())
    });
    start_synthetic(&l, "g1", 64, 2000);
    let leader = etcd_leader(&l).expect("an etcd leader");
    // 64 MiB at 1 Gbit: the migration runs for about half a second and more.
    let mut m = l.lab.exec(0, bin("pagefleet"));
    m.args(["migrate", "g1", "--to", "h2", "--verify", "--json"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let m = m.spawn().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        signal_in(&l, leader, "--initial-cluster-state", libc::SIGKILL),
        "no etcd leader process"
    );
    let out = m.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!(
        "migration with the etcd leader killed: {}\n{stderr}",
        out.status
    );
    // The registry is unreadable while etcd elects a new leader.
    let mut found = None;
    wait_for("g1 in the registry again", 30, || {
        found = l.guest("g1");
        found.is_some()
    });
    let (on, g) = found.expect("g1 runs somewhere");
    if out.status.success() {
        let r: Value = serde_json::from_str(&stdout).unwrap();
        assert_eq!(r["checksum_source"], r["checksum_dest"], "{r}");
        assert_eq!(on, 1, "a finished migration leaves g1 on h2: {g:?}");
    } else {
        assert_eq!(on, 0, "an aborted migration leaves g1 on h1: {g:?}");
    }
    // Whatever happened, the registry goes on with two members: the guest
    // still answers and the cluster view has every host.
    wait_for("the registry with two etcd members", 30, || {
        let s = l.status(0);
        s.len() == 3 && s.iter().filter(|h| h.report.is_some()).count() >= 2
    });
}
