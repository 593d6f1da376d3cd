//! A member of the etcd cluster killed: every host's calls go on through
//! the members left (a real three-member etcd on loopback).

use pagefleet_api::HostReport;
use pagefleet_lab::etcd::EtcdCluster;
use pagefleet_registry::{parse_endpoints, Etcd};
use std::time::Duration;

#[test]
fn a_killed_member_costs_at_most_one_failed_call() {
    let Some(mut etcd) = EtcdCluster::start(3) else {
        eprintln!("skipped: no etcd here (make deps installs etcd-server)");
        return;
    };
    // A follower (no election to wait for), listed first: every new
    // client meets it first.
    let leader = etcd.leader().expect("a leader");
    let victim = (leader + 1) % 3;
    let mut eps = parse_endpoints(&etcd.url()).unwrap();
    eps.rotate_left(victim);
    let report = HostReport {
        hostname: "h".into(),
        ..Default::default()
    };
    let before = Etcd::new(eps.clone(), Duration::from_secs(10)).unwrap();
    before.publish("h", "127.0.0.1:1", &report, &[]).unwrap();
    etcd.kill(victim);
    // A client that was connected, and one connecting after the kill.
    let after = Etcd::new(eps, Duration::from_secs(10)).unwrap();
    for (who, reg) in [("connected before", &before), ("connected after", &after)] {
        let mut failed = 0;
        for _ in 0..30 {
            if reg.publish("h", "127.0.0.1:1", &report, &[]).is_err() {
                failed += 1;
            }
        }
        eprintln!("{who}: {failed} of 30 heartbeats failed");
        assert!(failed <= 1, "{who}: {failed} of 30 heartbeats failed");
        assert_eq!(reg.view().unwrap().hosts.len(), 1);
    }
}
