//! The embedded registry: this host's report and guests, and every peer's,
//! asked in parallel over the signed API (`GET /cluster`).

use pagefleet_api::{ClusterHost, ClusterView, GuestStatus, HostReport};
use pagefleet_common::http::Client;

/// This host and every peer; a peer that does not answer is listed with its error.
pub fn cluster(me: ClusterHost, peers: &[String], client: &Client) -> ClusterView {
    let c = client.timeout(std::time::Duration::from_secs(2));
    let others: Vec<ClusterHost> = std::thread::scope(|s| {
        let hs: Vec<_> = peers
            .iter()
            .map(|p| {
                let c = &c;
                s.spawn(move || match c.get::<HostReport>(p, "/host") {
                    Ok(host) => ClusterHost {
                        http: p.clone(),
                        host: Some(host),
                        guests: c.get::<Vec<GuestStatus>>(p, "/guests").unwrap_or_default(),
                        error: None,
                    },
                    Err(e) => ClusterHost {
                        http: p.clone(),
                        host: None,
                        guests: vec![],
                        error: Some(e.to_string()),
                    },
                })
            })
            .collect();
        hs.into_iter()
            .zip(peers)
            .map(|(h, p)| {
                h.join().unwrap_or_else(|_| ClusterHost {
                    http: p.clone(),
                    host: None,
                    guests: vec![],
                    error: Some("asking it panicked".into()),
                })
            })
            .collect()
    });
    let mut hosts = vec![me];
    hosts.extend(others);
    ClusterView { hosts }
}
