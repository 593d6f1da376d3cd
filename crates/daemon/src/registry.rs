//! The embedded registry: this host's report and guests, and every peer's,
//! asked in parallel over the signed API (`GET /cluster`). The peers are
//! `--peers` and the hosts learned through the join host (`--join`: every
//! host announces itself there every [`JOIN_INTERVAL`] and takes its list
//! back), less the hosts removed since (`pagefleet host remove`); the
//! registry remembers since when each unreachable peer has not answered.

use pagefleet_api::{ClusterHost, ClusterView, GuestStatus, HostReport};
use pagefleet_common::http::Client;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

/// How often a host announces itself to the join host and takes its list
/// back: a new host is known everywhere within this (plus a scrape).
pub const JOIN_INTERVAL: Duration = Duration::from_secs(5);

/// How long a host removed here is not learned back from the join host.
pub const REMOVAL_HOLD: Duration = Duration::from_secs(6 * JOIN_INTERVAL.as_secs());

/// Most peers a registry keeps. Only signed requests add one, but a bound
/// keeps a mistaken script from growing the list (and every `GET /cluster`,
/// which asks each) without end; far above any cluster this serves.
pub const MAX_PEERS: usize = 1024;

/// A host removed from this registry.
#[derive(Clone, Debug)]
pub struct Removed {
    /// Its HTTP address.
    pub http: String,
    /// Its name, if it ever answered.
    pub name: Option<String>,
    /// When.
    pub at: SystemTime,
}

/// The peers and what is known of them.
#[derive(Default)]
pub struct Peers {
    /// HTTP addresses asked.
    list: Mutex<Vec<String>>,
    /// Per peer: its name when it last answered.
    names: Mutex<HashMap<String, String>>,
    /// Per unreachable peer: since when.
    down_since: Mutex<HashMap<String, SystemTime>>,
    removed: Mutex<Vec<Removed>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A time as an operator reads it in a log or an error: UTC, to the second.
pub fn utc(t: SystemTime) -> String {
    let s = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (days, rem) = (s / 86400, s % 86400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

impl Peers {
    /// The peers given at start-up.
    pub fn new(list: Vec<String>) -> Peers {
        Peers {
            list: Mutex::new(list),
            ..Default::default()
        }
    }

    /// Add `http` unless it is known: whether it was new. Refused past
    /// [`MAX_PEERS`].
    pub fn add(&self, http: &str) -> Result<bool, String> {
        let mut list = lock(&self.list);
        if list.iter().any(|p| p == http) {
            return Ok(false);
        }
        if list.len() >= MAX_PEERS {
            return Err(format!(
                "this registry already knows {MAX_PEERS} hosts (its bound): remove dead ones first (pagefleet host remove)"
            ));
        }
        list.push(http.to_string());
        Ok(true)
    }

    /// Add `http`, learned from the join host, unless it is known or was
    /// removed here in the last [`REMOVAL_HOLD`] (the join host may not
    /// have heard of the removal yet; a host it lists after that has
    /// announced itself again, so it is alive).
    pub fn learn(&self, http: &str) -> Result<bool, String> {
        let held = lock(&self.removed)
            .iter()
            .any(|r| r.http == http && r.at.elapsed().is_ok_and(|d| d < REMOVAL_HOLD));
        if held {
            return Ok(false);
        }
        self.add(http)
    }

    /// The configured peers changed from `old` to `new` (a reload): those
    /// no longer listed are asked no more, new ones are added; hosts learned
    /// from the join host stay.
    pub fn reconfigure(&self, old: &[String], new: &[String]) {
        lock(&self.list).retain(|p| !old.contains(p) || new.contains(p));
        for p in new {
            let _ = self.add(p);
        }
    }

    /// The peers asked now.
    pub fn list(&self) -> Vec<String> {
        lock(&self.list).clone()
    }

    /// Remove the peer whose address or last-known name is `key`; the
    /// removed entry, or None if no peer is known by that key.
    pub fn remove(&self, key: &str) -> Option<Removed> {
        let names = lock(&self.names).clone();
        let mut list = lock(&self.list);
        let i = list
            .iter()
            .position(|p| p == key || names.get(p).is_some_and(|n| n == key))?;
        let http = list.remove(i);
        let r = Removed {
            name: names.get(&http).cloned(),
            http: http.clone(),
            at: SystemTime::now(),
        };
        lock(&self.down_since).remove(&http);
        lock(&self.removed).push(r.clone());
        Some(r)
    }

    /// The removal of a host known by `key` (address or name), if any.
    pub fn removed(&self, key: &str) -> Option<Removed> {
        lock(&self.removed)
            .iter()
            .rev()
            .find(|r| r.http == key || r.name.as_deref() == Some(key))
            .cloned()
    }

    /// This host and every peer; a peer that does not answer is listed
    /// with its error and since when it has not answered.
    pub fn cluster(&self, me: ClusterHost, client: &Client) -> ClusterView {
        let peers = lock(&self.list).clone();
        let mut view = cluster(me, &peers, client);
        let now = SystemTime::now();
        let mut down = lock(&self.down_since);
        let mut names = lock(&self.names);
        for h in view.hosts.iter_mut().skip(1) {
            match (&h.host, &mut h.error) {
                (Some(r), _) => {
                    down.remove(&h.http);
                    names.insert(h.http.clone(), r.hostname.clone());
                }
                (None, Some(e)) => {
                    let since = *down.entry(h.http.clone()).or_insert(now);
                    let who = names
                        .get(&h.http)
                        .map(|n| format!("{n} ({})", h.http))
                        .unwrap_or_else(|| h.http.clone());
                    *e = format!(
                        "{who} has not answered since {} ({} s): {e}",
                        utc(since),
                        now.duration_since(since).map(|d| d.as_secs()).unwrap_or(0)
                    );
                }
                (None, None) => {}
            }
        }
        view
    }
}

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
                        claimed: None,
                    },
                    Err(e) => ClusterHost {
                        http: p.clone(),
                        host: None,
                        guests: vec![],
                        error: Some(e.to_string()),
                        claimed: None,
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
                    claimed: None,
                })
            })
            .collect()
    });
    let mut hosts = vec![me];
    hosts.extend(others);
    ClusterView { hosts }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_formats_civil_dates() {
        let t = |s: u64| utc(SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(s));
        assert_eq!(t(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(t(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(t(1_795_932_622), "2026-11-29 06:10:22 UTC");
    }

    #[test]
    fn peers_are_added_once_and_bounded() {
        let p = Peers::new(vec!["10.0.0.2:7071".into()]);
        assert_eq!(p.add("10.0.0.2:7071"), Ok(false));
        assert_eq!(p.add("10.0.0.3:7071"), Ok(true));
        assert_eq!(p.list(), ["10.0.0.2:7071", "10.0.0.3:7071"]);
        for i in p.list().len()..MAX_PEERS {
            p.add(&format!("10.1.{}.{}:7071", i / 256, i % 256))
                .unwrap();
        }
        assert!(p
            .add("10.9.9.9:7071")
            .unwrap_err()
            .contains("remove dead ones"));
    }

    #[test]
    fn a_removed_peer_is_asked_no_more_and_remembered() {
        let p = Peers::new(vec!["a:1".into(), "b:1".into()]);
        lock(&p.names).insert("b:1".into(), "h2".into());
        assert!(p.remove("nope").is_none());
        let r = p.remove("h2").expect("by name");
        assert_eq!((r.http.as_str(), r.name.as_deref()), ("b:1", Some("h2")));
        assert_eq!(*lock(&p.list), vec!["a:1".to_string()]);
        assert!(p.removed("b:1").is_some() && p.removed("h2").is_some());
        assert!(p.remove("b:1").is_none(), "removed once");
    }
}
