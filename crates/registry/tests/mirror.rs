//! Placement's mirror of the registry (a real etcd on loopback): a
//! placement sees every write that finished before it began, claims made
//! by other clients included, and pages of a view beyond one gRPC message.

use pagefleet_api::HostReport;
use pagefleet_lab::etcd::EtcdCluster;
use pagefleet_registry::{parse_endpoints, Etcd};
use std::time::Duration;

const MIB: u64 = 1 << 20;

fn report(name: &str, free: u64) -> HostReport {
    HostReport {
        hostname: name.into(),
        guest_free: free,
        ..Default::default()
    }
}

#[test]
fn a_placement_sees_every_write_before_it() {
    let Some(etcd) = EtcdCluster::start(1) else {
        eprintln!("skipped: no etcd here (make deps installs etcd-server)");
        return;
    };
    let eps = parse_endpoints(&etcd.url()).unwrap();
    let reg = Etcd::new(eps.clone(), Duration::from_secs(10)).unwrap();
    let other = Etcd::new(eps, Duration::from_secs(10)).unwrap();
    reg.publish("a", "127.0.0.1:1", &report("a", 100 * MIB), &[])
        .unwrap();
    let v = reg.placement_view().unwrap();
    assert_eq!(v.hosts.len(), 1);
    // Written through another client, read through the mirror at once.
    for i in 0..20u64 {
        other
            .publish("b", "127.0.0.1:2", &report("b", i * MIB), &[])
            .unwrap();
        assert!(other.claim("a", MIB).unwrap());
        let v = reg.placement_view().unwrap();
        let free = |n: &str| {
            v.hosts
                .iter()
                .find(|h| h.name() == n)
                .and_then(|h| h.host.as_ref())
                .map(|r| r.guest_free)
        };
        assert_eq!(free("b"), Some(i * MIB), "round {i}: b's last report");
        assert_eq!(
            free("a"),
            Some((99 - i) * MIB),
            "round {i}: a net of claims"
        );
    }
    assert!(
        reg.mirror_size().0 >= 5,
        "members, hosts and a's claims are mirrored"
    );
    // A host whose lease is revoked is dead in the next placement's view.
    other.withdraw();
    let v = reg.placement_view().unwrap();
    let b = v.hosts.iter().find(|h| h.http == "127.0.0.1:2").unwrap();
    assert!(b.host.is_none() && b.error.is_some(), "{b:?}");
}

#[test]
fn a_view_larger_than_one_grpc_message_is_read_in_pages() {
    let Some(etcd) = EtcdCluster::start(1) else {
        eprintln!("skipped: no etcd here (make deps installs etcd-server)");
        return;
    };
    let eps = parse_endpoints(&etcd.url()).unwrap();
    let reg = Etcd::new(eps, Duration::from_secs(10)).unwrap();
    // 1 200 hosts with 4 KiB reports: 4.7 MiB, past gRPC's 4 MiB.
    let pad = "x".repeat(4096);
    for i in 0..1200 {
        let mut r = report(&format!("h{i}"), MIB);
        r.memserver = Some(pad.clone());
        reg.publish(&format!("h{i}"), "127.0.0.1:1", &r, &[])
            .unwrap();
    }
    assert_eq!(reg.view().unwrap().hosts.len(), 1200);
    assert_eq!(reg.hosts_view().unwrap().hosts.len(), 1200);
    let v = reg.placement_view().unwrap();
    assert_eq!(v.hosts.len(), 1200);
    assert!(v.hosts.iter().all(|h| h.host.is_some()));
}
