//! etcd as the registry (issue 20): a real 3-member etcd cluster on
//! loopback, real daemons keeping lease-bound heartbeats there.

mod common;
use common::*;
use pagefleet_api::ClusterView;
use pagefleet_lab::etcd::EtcdCluster;
use std::time::{Duration, Instant};

fn view(d: &Daemon) -> ClusterView {
    let c = pagefleet_common::http::Client::new(d.secret.clone());
    c.get(d.metrics.as_ref().unwrap(), "/cluster")
        .expect("GET /cluster")
}

fn wait_for(what: &str, secs: u64, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(secs), "timed out: {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn hosts_register_in_etcd_and_a_killed_one_is_shown_dead() {
    let Some(mut etcd) = EtcdCluster::start(3) else {
        eprintln!("skipped: no etcd here (make deps installs etcd-server)");
        return;
    };
    let url = etcd.url();
    let a = Daemon::start("16MiB", &["--registry", &url, "--name", "a"]);
    let mut b = Daemon::start("16MiB", &["--registry", &url, "--name", "b"]);
    wait_for("both hosts in a's view", 20, || {
        let v = view(&a);
        v.hosts.len() == 2 && v.hosts.iter().all(|h| h.host.is_some())
    });
    // The view is etcd's: b's report there names it and its memory server.
    let v = view(&a);
    let hb = v
        .hosts
        .iter()
        .find(|h| h.name() == "b")
        .unwrap_or_else(|| panic!("b listed: {v:?}"));
    assert_eq!(hb.memserver(), Some(b.addr.as_str()));

    // An etcd member (the leader) dies: a majority remains, the registry works.
    let leader = etcd.leader().expect("a leader");
    etcd.kill(leader);
    std::thread::sleep(Duration::from_secs(3));
    wait_for("the view with two etcd members", 20, || {
        let v = view(&a);
        v.hosts.len() == 2 && v.hosts.iter().all(|h| h.error.is_none())
    });

    // kill -9 b: its lease expires (10 s), a shows it dead, with no memory.
    b.kill();
    wait_for("b shown dead", 30, || {
        let v = view(&a);
        v.hosts.iter().any(|h| {
            h.host.is_none()
                && h.error
                    .as_deref()
                    .is_some_and(|e| e.contains("lease expired"))
        })
    });
    let v = view(&a);
    assert_eq!(v.hosts.len(), 2, "a dead member stays listed: {v:?}");
    // A stopped daemon withdraws at once (no 10 s wait).
    drop(a);
}
