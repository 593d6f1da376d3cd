//! Memory claims by etcd transaction: migrations racing for one host's
//! memory cannot both get it (a real etcd on loopback).

use pagefleet_api::HostReport;
use pagefleet_lab::etcd::EtcdCluster;
use pagefleet_registry::{parse_endpoints, Etcd, Pool};
use std::sync::Arc;
use std::time::Duration;

const MIB: u64 = 1 << 20;

#[test]
fn racing_claims_never_promise_more_than_is_free() {
    let Some(etcd) = EtcdCluster::start(1) else {
        eprintln!("skipped: no etcd here (make deps installs etcd-server)");
        return;
    };
    let eps = parse_endpoints(&etcd.url()).unwrap();
    let reg = Arc::new(Etcd::new(eps.clone(), Duration::from_secs(10)).unwrap());
    let report = HostReport {
        hostname: "h".into(),
        guest_free: 100 * MIB,
        lend_capacity: 64 * MIB,
        lend_used: 4 * MIB,
        ..Default::default()
    };
    reg.publish("h", "127.0.0.1:1", &report, &[]).unwrap();
    // Eight migrations (each its own client) want 30 MiB of h at once.
    let won: usize = (0..8)
        .map(|_| {
            let eps = eps.clone();
            std::thread::spawn(move || {
                let r = Etcd::new(eps, Duration::from_secs(10)).unwrap();
                r.claim("h", 30 * MIB).unwrap()
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().unwrap() as usize)
        .sum();
    assert_eq!(won, 3, "100 MiB free holds three 30 MiB claims");
    assert!(!reg.claim("h", 11 * MIB).unwrap(), "10 MiB are left");
    reg.release("h", 30 * MIB).unwrap();
    assert!(
        reg.claim("h", 11 * MIB).unwrap(),
        "a released claim frees its memory"
    );
    // A host without a heartbeat has nothing to claim.
    assert!(!reg.claim("nobody", MIB).unwrap());
    let v = reg.view().unwrap();
    assert_eq!(v.hosts.len(), 1);
    assert_eq!(v.hosts[0].name(), "h");

    // Lending is claimed on its own: 60 MiB free to lend, guest memory aside.
    assert!(reg.claim_pool("h", Pool::Lend, 40 * MIB).unwrap());
    assert!(
        !reg.claim_pool("h", Pool::Lend, 21 * MIB).unwrap(),
        "20 MiB are left to lend"
    );
    assert!(reg.claim_pool("h", Pool::Lend, 20 * MIB).unwrap());
    let r = reg.view().unwrap().hosts[0].host.clone().unwrap();
    assert_eq!(
        r.lend_used,
        64 * MIB,
        "the view counts promised lending as used"
    );
    assert_eq!(
        r.guest_free,
        100 * MIB - 71 * MIB,
        "guest claims stay apart"
    );
    reg.release_pool("h", Pool::Lend, 60 * MIB).unwrap();
    let r = reg.view().unwrap().hosts[0].host.clone().unwrap();
    assert_eq!(r.lend_used, 4 * MIB);
}
