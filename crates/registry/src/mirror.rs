//! The registry's placement records kept in memory by a watch: what
//! placement reads.
//!
//! Reading every host's record from etcd per placement costs bytes and
//! decoding in proportion to the cluster (0.46 MB at 1 000 hosts, 23 MB
//! at 50 000: past gRPC's 4 MiB message limit, and 64 ms to read at
//! 2 500 hosts in `pagefleet bench registry`). A [`Mirror`] lists
//! `members/`, `hosts/` and `claims/` once (in pages, at one revision),
//! then follows a watch on the registry from the next revision, so a
//! placement reads memory.
//!
//! Who owns what: the follower task on the registry's runtime is the only
//! writer of [`State`]; readers (the daemon's worker threads) lock it to
//! build a view, and wait on the condvar until the mirror has seen a
//! revision. The mirror is never what makes a decision exact: claims are
//! transactions checked against etcd's own records, so a mirror behind
//! etcd can only cost a claim that fails ("try again"), never memory
//! promised twice. And a placement first asks etcd its current revision
//! (one count-only read) and uses the mirror only once it has caught up to
//! it, so a placement sees every write that finished before it began.
//! `status` and gc read etcd itself.

use pagefleet_api::{ClusterHost, ClusterView};
use std::collections::BTreeMap;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// The key prefixes placement reads (under [`crate::PREFIX`]); guests'
/// records are not mirrored.
pub const MIRRORED: [&str; 3] = ["members/", "hosts/", "claims/"];

/// One change the watch reported.
#[derive(Debug, Clone, PartialEq)]
pub enum Change {
    /// A key written.
    Put(String, Vec<u8>),
    /// A key deleted (or its lease expired).
    Delete(String),
}

/// The mirrored keys at a revision, and each host decoded from them.
#[derive(Debug, Default)]
pub struct State {
    kvs: BTreeMap<String, Vec<u8>>,
    /// Each member as the view shows it, decoded when one of its records
    /// changes: a view is then a copy, not a decode of every report (at
    /// 10 000 hosts decoding them all was 15 ms per placement).
    hosts: BTreeMap<String, ClusterHost>,
    /// The heartbeat TTL, for a dead host's error.
    ttl: i64,
    /// Every write up to this etcd revision is applied.
    revision: i64,
    /// Listed and following: false before the first list and from a
    /// broken watch until the next list.
    synced: bool,
    /// Bytes of keys and values held.
    bytes: usize,
}

/// The host a mirrored key belongs to.
fn host_of_key(key: &str) -> Option<&str> {
    let k = key.strip_prefix(crate::PREFIX)?;
    MIRRORED.iter().find_map(|p| k.strip_prefix(p))
}

impl State {
    /// Nothing yet, for hosts whose heartbeats expire after `ttl` seconds.
    pub fn new(ttl: i64) -> State {
        State {
            ttl,
            ..State::default()
        }
    }

    /// Start over from a full list taken at `revision`.
    pub fn reset(&mut self, kvs: Vec<(String, Vec<u8>)>, revision: i64) {
        self.kvs = kvs
            .into_iter()
            .filter(|(k, _)| host_of_key(k).is_some())
            .collect();
        self.bytes = self.kvs.iter().map(|(k, v)| k.len() + v.len()).sum();
        let names: Vec<String> = self
            .kvs
            .keys()
            .filter_map(|k| host_of_key(k).map(str::to_string))
            .collect();
        self.hosts.clear();
        for n in names {
            self.decode(&n);
        }
        self.revision = revision;
        self.synced = true;
    }

    /// Decode host `name` again from its records.
    fn decode(&mut self, name: &str) {
        let get = |p: &str| self.kvs.get(&format!("{}{p}{name}", crate::PREFIX));
        let host = get("members/").and_then(|m| {
            crate::host_of(
                name,
                m,
                get("hosts/").map(Vec::as_slice),
                get("claims/").map(Vec::as_slice),
                Vec::new(),
                self.ttl,
            )
        });
        match host {
            Some(h) => {
                self.hosts.insert(name.to_string(), h);
            }
            None => {
                self.hosts.remove(name);
            }
        }
    }

    /// Every member with its report (free memory net of claims), in name
    /// order.
    pub fn view(&self) -> ClusterView {
        ClusterView {
            hosts: self.hosts.values().cloned().collect(),
        }
    }

    /// Apply what the watch reported up to `revision` (a response's
    /// header: etcd's revision when it was sent). Keys placement does not
    /// read are skipped.
    pub fn apply(&mut self, changes: impl IntoIterator<Item = Change>, revision: i64) {
        for c in changes {
            let (Change::Put(k, _) | Change::Delete(k)) = &c;
            let Some(name) = host_of_key(k).map(str::to_string) else {
                continue;
            };
            match c {
                Change::Put(k, v) => {
                    self.bytes += k.len() + v.len();
                    if let Some(old) = self.kvs.insert(k.clone(), v) {
                        self.bytes -= k.len() + old.len();
                    }
                }
                Change::Delete(k) => {
                    if let Some(old) = self.kvs.remove(&k) {
                        self.bytes -= k.len() + old.len();
                    }
                }
            }
            self.decode(&name);
        }
        self.revision = self.revision.max(revision);
    }

    /// The watch broke: nothing is read from here until the next list.
    pub fn lost(&mut self) {
        self.synced = false;
    }

    /// Listed and following, and has seen every write up to `revision`.
    pub fn caught_up(&self, revision: i64) -> bool {
        self.synced && self.revision >= revision
    }

    /// Keys held and their bytes (keys and values).
    pub fn size(&self) -> (usize, usize) {
        (self.kvs.len(), self.bytes)
    }
}

/// [`State`] shared between the follower and readers.
pub struct Mirror {
    state: Mutex<State>,
    changed: Condvar,
}

impl Mirror {
    /// Nothing yet (see [`State::new`]).
    pub fn new(ttl: i64) -> Mirror {
        Mirror {
            state: Mutex::new(State::new(ttl)),
            changed: Condvar::new(),
        }
    }

    /// Change the state (the follower) and wake readers waiting for it.
    pub fn update(&self, f: impl FnOnce(&mut State)) {
        f(&mut self.state.lock().unwrap_or_else(|e| e.into_inner()));
        self.changed.notify_all();
    }

    /// Run `f` on the state once it has caught up to `revision`, waiting
    /// at most `wait`; None if it has not by then (the caller reads etcd).
    pub fn read_at<T>(
        &self,
        revision: i64,
        wait: Duration,
        f: impl FnOnce(&State) -> T,
    ) -> Option<T> {
        let deadline = Instant::now() + wait;
        let mut g = self.state.lock().unwrap_or_else(|e| e.into_inner());
        while !g.caught_up(revision) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            g = self
                .changed
                .wait_timeout(g, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Some(f(&g))
    }

    /// Keys held and their bytes.
    pub fn size(&self) -> (usize, usize) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).size()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PREFIX;

    fn k(s: &str) -> String {
        format!("{PREFIX}{s}")
    }

    #[test]
    fn follows_puts_and_deletes_of_placement_keys_only() {
        let mut s = State::new(10);
        assert!(!s.caught_up(0), "nothing is read before the first list");
        s.reset(
            vec![
                (k("members/a"), b"1".to_vec()),
                (k("guests/a/g"), b"big".to_vec()),
            ],
            10,
        );
        assert_eq!(s.size().0, 1, "guests are not mirrored");
        assert!(s.caught_up(10) && !s.caught_up(11));
        s.apply(
            [
                Change::Put(k("hosts/a"), b"22".to_vec()),
                Change::Put(k("hosts/a"), b"333".to_vec()),
                Change::Put(k("guests/a/h"), b"x".to_vec()),
                Change::Delete(k("members/a")),
            ],
            12,
        );
        assert_eq!(s.size(), (1, k("hosts/a").len() + 3));
        assert!(
            s.view().hosts.is_empty(),
            "a report without a membership is no host"
        );
        assert!(s.caught_up(12));
        s.lost();
        assert!(!s.caught_up(0), "a broken watch is not read from");
    }

    #[test]
    fn a_view_is_each_host_decoded_net_of_its_claims() {
        let member = serde_json::to_vec(&crate::Member {
            http: "a:7071".into(),
        })
        .unwrap();
        let report = serde_json::to_vec(&pagefleet_api::HostReport {
            hostname: "a".into(),
            guest_free: 100,
            ..Default::default()
        })
        .unwrap();
        let mut s = State::new(10);
        s.reset(vec![(k("hosts/a"), report), (k("members/a"), member)], 3);
        let free = |s: &State| s.view().hosts[0].host.as_ref().map(|r| r.guest_free);
        assert_eq!(free(&s), Some(100));
        let claims = serde_json::to_vec(&crate::Claims {
            bytes: 40,
            lend_bytes: 0,
        })
        .unwrap();
        s.apply([Change::Put(k("claims/a"), claims)], 4);
        assert_eq!(free(&s), Some(60), "promised memory is not free");
        s.apply([Change::Delete(k("hosts/a"))], 5);
        let v = s.view();
        assert_eq!(free(&s), None);
        assert!(v.hosts[0]
            .error
            .as_deref()
            .unwrap()
            .contains("lease expired"));
    }

    #[test]
    fn a_reader_waits_for_the_revision_or_gives_up() {
        let m = std::sync::Arc::new(Mirror::new(10));
        assert!(m.read_at(1, Duration::from_millis(20), |_| ()).is_none());
        let w = m.clone();
        let t = std::thread::spawn(move || w.read_at(5, Duration::from_secs(10), |s| s.size()));
        std::thread::sleep(Duration::from_millis(20));
        m.update(|s| s.reset(vec![(k("hosts/b"), vec![0; 4])], 4));
        m.update(|s| s.apply([], 5));
        assert_eq!(t.join().unwrap(), Some((1, k("hosts/b").len() + 4)));
    }
}
