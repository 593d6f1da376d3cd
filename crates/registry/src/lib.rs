//! The cluster registry in etcd (docs/cluster.md).
//!
//! Keys, under `/pagefleet/`:
//!
//! | key | value | lifetime |
//! |---|---|---|
//! | `members/NAME` | [`Member`]: the host's HTTP address | permanent: a host that joined |
//! | `hosts/NAME` | its `HostReport` | bound to the host's lease |
//! | `guests/NAME/GUEST` | the guest's `GuestStatus` (where its pages are) | bound to the lease of the host running it |
//! | `claims/NAME` | [`Claims`]: guest memory promised to migrations on their way | updated by transaction |
//!
//! A host that stops renewing its lease (killed, cut off) loses its
//! `hosts/` and `guests/` keys when the lease expires; the view shows it
//! as a member without a heartbeat, dead, and placement gets no memory
//! there. The etcd client is async; this crate owns a small runtime and
//! offers blocking calls (the daemon calls them from its worker threads).

#![warn(missing_docs)]

use etcd_client::{Client, Compare, CompareOp, ConnectOptions, GetOptions, PutOptions, Txn, TxnOp};
use pagefleet_api::{ClusterHost, ClusterView, GuestStatus, HostReport};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// Every key of the registry starts with this.
pub const PREFIX: &str = "/pagefleet/";

/// Why a registry call failed.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// etcd said no, or could not be reached.
    #[error("etcd at {endpoints}: {source}")]
    Etcd {
        /// The member asked.
        endpoints: String,
        /// What the client said.
        source: etcd_client::Error,
    },
    /// A bad `etcd://` address list.
    #[error("{0}")]
    Address(String),
    /// The runtime could not start.
    #[error("cannot start the etcd client's runtime: {0}")]
    Runtime(std::io::Error),
}

/// A host that joined the cluster (`members/NAME`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Member {
    /// Its pagefleetd HTTP address.
    pub http: String,
}

/// Memory promised on a host to migrations on their way (`claims/NAME`),
/// so two cannot take the same memory: its guest memory (as a main host)
/// and its memory server's lending (as a sub-host).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Claims {
    /// Guest memory promised, bytes.
    pub bytes: u64,
    /// Lent memory promised, bytes.
    #[serde(default)]
    pub lend_bytes: u64,
}

impl Claims {
    /// The claim record as etcd holds it: an unreadable one counts as no
    /// claim (the next transaction rewrites it whole).
    pub fn decode(value: &[u8]) -> Claims {
        serde_json::from_slice(value).unwrap_or_default()
    }

    /// Bytes held in `pool`.
    pub fn held(&self, pool: Pool) -> u64 {
        match pool {
            Pool::Guest => self.bytes,
            Pool::Lend => self.lend_bytes,
        }
    }

    /// These claims with `delta` bytes more (or fewer) in `pool`, never
    /// below zero and never wrapping past `u64::MAX`, whatever the record
    /// held.
    pub fn adjusted(&self, pool: Pool, delta: i64) -> Claims {
        let mut next = self.clone();
        let held = match pool {
            Pool::Guest => &mut next.bytes,
            Pool::Lend => &mut next.lend_bytes,
        };
        *held = if delta >= 0 {
            held.saturating_add(delta.unsigned_abs())
        } else {
            held.saturating_sub(delta.unsigned_abs())
        };
        next
    }
}

/// Which of a host's memory a claim takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pool {
    /// Memory it gives guests (a main host's).
    Guest,
    /// Memory its memory server lends (a sub-host's).
    Lend,
}

/// `etcd://h1:2379,h2:2379` (or plain `h1:2379,...`) as endpoint URLs.
pub fn parse_endpoints(s: &str) -> Result<Vec<String>, RegistryError> {
    let list = s.strip_prefix("etcd://").unwrap_or(s);
    let eps: Vec<String> = list
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(|e| format!("http://{e}"))
        .collect();
    if eps.is_empty() || eps.iter().any(|e| !e[7..].contains(':')) {
        return Err(RegistryError::Address(format!(
            "--registry {s}: give etcd://HOST:PORT[,HOST:PORT...]"
        )));
    }
    Ok(eps)
}

/// A connection to the etcd cluster, with this host's lease.
pub struct Etcd {
    rt: tokio::runtime::Runtime,
    endpoints: Vec<String>,
    /// The member calls go to (an index into `endpoints`) and its client.
    client: Mutex<Option<(usize, Client)>>,
    /// The member the next connection tries.
    next: AtomicUsize,
    /// This host's lease (0: none yet).
    lease: Mutex<i64>,
    ttl: i64,
}

impl Etcd {
    /// A registry at `endpoints` whose host keys expire `ttl` after the
    /// host's last heartbeat. Connects lazily: etcd may start later.
    pub fn new(endpoints: Vec<String>, ttl: Duration) -> Result<Etcd, RegistryError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("etcd")
            .enable_all()
            .build()
            .map_err(RegistryError::Runtime)?;
        Ok(Etcd {
            rt,
            endpoints,
            client: Mutex::new(None),
            next: AtomicUsize::new(0),
            lease: Mutex::new(0),
            ttl: ttl.as_secs().max(2) as i64,
        })
    }

    fn err(&self, member: usize, source: etcd_client::Error) -> RegistryError {
        RegistryError::Etcd {
            endpoints: self.endpoints[member].clone(),
            source,
        }
    }

    /// The client, connecting if needed to one member: calls stay with it
    /// while it answers. One client over every member (etcd-client's
    /// balanced channel) keeps sending a share of the calls to a member
    /// that is down (a killed member failed 17 of 30 heartbeats), so a
    /// failed call instead moves this host to the next member.
    fn client(&self) -> Result<(usize, Client), RegistryError> {
        let mut g = self.client.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = g.as_ref() {
            return Ok(c.clone());
        }
        let i = self.next.load(Ordering::Relaxed) % self.endpoints.len();
        let opts = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            .with_timeout(Duration::from_secs(5))
            .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2));
        let c = match self
            .rt
            .block_on(Client::connect([&self.endpoints[i]], Some(opts)))
        {
            Ok(c) => c,
            Err(e) => {
                self.skip(i);
                return Err(self.err(i, e));
            }
        };
        *g = Some((i, c.clone()));
        Ok((i, c))
    }

    /// Member `i` failed a call: the next connection goes to the member
    /// after it.
    fn skip(&self, i: usize) {
        self.next
            .store((i + 1) % self.endpoints.len(), Ordering::Relaxed);
    }

    fn forget_client(&self, i: usize) {
        let mut g = self.client.lock().unwrap_or_else(|e| e.into_inner());
        if g.as_ref().is_some_and(|(at, _)| *at == i) {
            *g = None;
            self.skip(i);
        }
    }

    /// Run `f` with a client; a failure drops the connection.
    fn call<T>(
        &self,
        f: impl AsyncFnOnce(&mut Client) -> Result<T, etcd_client::Error>,
    ) -> Result<T, RegistryError> {
        let (i, mut c) = self.client()?;
        match self.rt.block_on(f(&mut c)) {
            Ok(v) => Ok(v),
            Err(e) => {
                self.forget_client(i);
                Err(self.err(i, e))
            }
        }
    }

    /// This host's lease, renewed (granted anew if it expired).
    fn renew_lease(&self) -> Result<i64, RegistryError> {
        let mut lease = self.lease.lock().unwrap_or_else(|e| e.into_inner());
        if *lease != 0 {
            let id = *lease;
            let alive = self.call(async |c| {
                let (mut keeper, mut stream) = c.lease_keep_alive(id).await?;
                keeper.keep_alive().await?;
                Ok(stream.message().await?.is_some_and(|r| r.ttl() > 0))
            })?;
            if alive {
                return Ok(id);
            }
            tracing::warn!("the registry lease {id:x} had expired: this host re-registers");
        }
        let ttl = self.ttl;
        let id = self.call(async move |c| Ok(c.lease_grant(ttl, None).await?.id()))?;
        *lease = id;
        Ok(id)
    }

    /// This host's heartbeat: its membership, report and guests, the
    /// latter two bound to its lease (renewed here). Guests no longer
    /// running here are removed.
    pub fn publish(
        &self,
        name: &str,
        http: &str,
        report: &HostReport,
        guests: &[GuestStatus],
    ) -> Result<(), RegistryError> {
        let lease = self.renew_lease()?;
        let member = serde_json::to_vec(&Member {
            http: http.to_string(),
        })
        .unwrap_or_default();
        let host = serde_json::to_vec(report).unwrap_or_default();
        let mut ops = vec![
            TxnOp::put(format!("{PREFIX}members/{name}"), member, None),
            TxnOp::put(
                format!("{PREFIX}hosts/{name}"),
                host,
                Some(PutOptions::new().with_lease(lease)),
            ),
        ];
        for g in guests {
            ops.push(TxnOp::put(
                format!("{PREFIX}guests/{name}/{}", g.name),
                serde_json::to_vec(g).unwrap_or_default(),
                Some(PutOptions::new().with_lease(lease)),
            ));
        }
        let gone_prefix = format!("{PREFIX}guests/{name}/");
        let keep: Vec<String> = guests
            .iter()
            .map(|g| format!("{gone_prefix}{}", g.name))
            .collect();
        self.call(async move |c| {
            let old = c
                .get(
                    gone_prefix.as_str(),
                    Some(GetOptions::new().with_prefix().with_keys_only()),
                )
                .await?;
            for kv in old.kvs() {
                let k = String::from_utf8_lossy(kv.key()).into_owned();
                if !keep.contains(&k) {
                    ops.push(TxnOp::delete(k, None));
                }
            }
            c.txn(Txn::new().and_then(ops)).await?;
            Ok(())
        })
    }

    /// Renew this host's lease without writing anything (a heartbeat when
    /// nothing placement reads has changed). Err if the lease had expired
    /// (its keys are gone: the caller publishes again).
    pub fn keep_alive(&self) -> Result<(), RegistryError> {
        let before = *self.lease.lock().unwrap_or_else(|e| e.into_inner());
        let after = self.renew_lease()?;
        if before != after {
            return Err(RegistryError::Address(
                "the registry lease had expired: publish again".into(),
            ));
        }
        Ok(())
    }

    /// etcd's current revision: it grows by one per write (a put, a
    /// delete, a transaction), so the difference counts writes.
    pub fn revision(&self) -> Result<i64, RegistryError> {
        self.call(async |c| {
            let r = c
                .get(PREFIX, Some(GetOptions::new().with_count_only()))
                .await?;
            Ok(r.header().map_or(0, |h| h.revision()))
        })
    }

    /// Remove host `name` from the cluster for good (it is dead and will
    /// not come back as it was): its membership, report, guests' records
    /// and claims, and the etcd cluster member of that name if there is
    /// one. Returns whether the host was known here and whether an etcd
    /// member went with it. A host that comes back joins anew.
    pub fn remove_host(&self, name: &str) -> Result<(bool, bool), RegistryError> {
        let keys = [
            format!("{PREFIX}members/{name}"),
            format!("{PREFIX}hosts/{name}"),
            format!("{PREFIX}claims/{name}"),
        ];
        let guests = format!("{PREFIX}guests/{name}/");
        let known = self.call(async move |c| {
            let had = c
                .get(keys[0].as_str(), Some(GetOptions::new().with_count_only()))
                .await?
                .count()
                > 0;
            let mut ops: Vec<TxnOp> = keys
                .iter()
                .map(|k| TxnOp::delete(k.as_str(), None))
                .collect();
            ops.push(TxnOp::delete(
                guests.as_str(),
                Some(etcd_client::DeleteOptions::new().with_prefix()),
            ));
            c.txn(Txn::new().and_then(ops)).await?;
            Ok(had)
        })?;
        let name = name.to_string();
        let member = self.call(async move |c| {
            let list = c.member_list().await?;
            let Some(id) = list
                .members()
                .iter()
                .find(|m| m.name() == name)
                .map(|m| m.id())
            else {
                return Ok(false);
            };
            c.member_remove(id).await?;
            Ok(true)
        })?;
        Ok((known, member))
    }

    /// Leave the cluster's live view at once (pagefleetd stopping): the
    /// lease is revoked, so this host's report and guests go now.
    pub fn withdraw(&self) {
        let id = std::mem::take(&mut *self.lease.lock().unwrap_or_else(|e| e.into_inner()));
        if id != 0 {
            let _ = self.call(async move |c| c.lease_revoke(id).await.map(|_| ()));
        }
    }

    /// A read, tried again on another connection after a failure (a
    /// member down, a leader election): reads are safe to repeat.
    fn read<T>(&self, f: impl Fn() -> Result<T, RegistryError>) -> Result<T, RegistryError> {
        let mut last = None;
        for wait in [0, 200, 500] {
            std::thread::sleep(Duration::from_millis(wait));
            match f() {
                Ok(v) => return Ok(v),
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("tried"))
    }

    /// Every member: with its report and guests if its heartbeat is alive,
    /// with an error if its lease expired.
    pub fn view(&self) -> Result<ClusterView, RegistryError> {
        self.read(|| self.view_once())
    }

    fn view_once(&self) -> Result<ClusterView, RegistryError> {
        let kvs = self.call(async |c| {
            let r = c.get(PREFIX, Some(GetOptions::new().with_prefix())).await?;
            Ok(r.kvs()
                .iter()
                .map(|kv| {
                    (
                        String::from_utf8_lossy(kv.key()).into_owned(),
                        kv.value().to_vec(),
                    )
                })
                .collect::<Vec<_>>())
        })?;
        Ok(view_of(&kvs, self.ttl))
    }

    /// Every member with its report (free memory net of claims) but
    /// without guests: what placement reads. One round trip; a tenth of a
    /// full view's bytes at 10 guests a host.
    pub fn hosts_view(&self) -> Result<ClusterView, RegistryError> {
        self.read(|| self.hosts_view_once())
    }

    fn hosts_view_once(&self) -> Result<ClusterView, RegistryError> {
        let kvs = self.call(async |c| {
            let ops: Vec<TxnOp> = ["members/", "hosts/", "claims/"]
                .iter()
                .map(|p| {
                    TxnOp::get(
                        format!("{PREFIX}{p}"),
                        Some(GetOptions::new().with_prefix()),
                    )
                })
                .collect();
            let r = c.txn(Txn::new().and_then(ops)).await?;
            let mut out = Vec::new();
            for op in r.op_responses() {
                if let etcd_client::TxnOpResponse::Get(g) = op {
                    out.extend(g.kvs().iter().map(|kv| {
                        (
                            String::from_utf8_lossy(kv.key()).into_owned(),
                            kv.value().to_vec(),
                        )
                    }));
                }
            }
            Ok(out)
        })?;
        Ok(view_of(&kvs, self.ttl))
    }

    /// Promise `bytes` of host `name`'s guest memory to a migration, if
    /// the host reports at least that much free beyond what is already
    /// promised: one transaction, so two migrations racing for the same
    /// memory cannot both get it. Ok(false): not enough.
    pub fn claim(&self, name: &str, bytes: u64) -> Result<bool, RegistryError> {
        self.adjust_claim(name, Pool::Guest, bytes as i64, true)
    }

    /// Give back a claim (the migration finished or failed: the host's
    /// report counts the guest from now on, or never will).
    pub fn release(&self, name: &str, bytes: u64) -> Result<(), RegistryError> {
        self.adjust_claim(name, Pool::Guest, -(bytes as i64), false)
            .map(|_| ())
    }

    /// [`Etcd::claim`] of `pool`: a sub-host's lending is promised the same
    /// way as a main host's guest memory.
    pub fn claim_pool(&self, name: &str, pool: Pool, bytes: u64) -> Result<bool, RegistryError> {
        self.adjust_claim(name, pool, bytes as i64, true)
    }

    /// [`Etcd::release`] of `pool`.
    pub fn release_pool(&self, name: &str, pool: Pool, bytes: u64) -> Result<(), RegistryError> {
        self.adjust_claim(name, pool, -(bytes as i64), false)
            .map(|_| ())
    }

    fn adjust_claim(
        &self,
        name: &str,
        pool: Pool,
        delta: i64,
        check: bool,
    ) -> Result<bool, RegistryError> {
        let key = format!("{PREFIX}claims/{name}");
        let host_key = format!("{PREFIX}hosts/{name}");
        for _ in 0..20 {
            let (k, hk) = (key.clone(), host_key.clone());
            let (claims, rev, free) = self.call(async move |c| {
                let r = c.get(k.as_str(), None).await?;
                let (claims, rev) = match r.kvs().first() {
                    Some(kv) => (Claims::decode(kv.value()), kv.mod_revision()),
                    None => (Claims::default(), 0),
                };
                let h = c.get(hk.as_str(), None).await?;
                let free = h
                    .kvs()
                    .first()
                    .and_then(|kv| serde_json::from_slice::<HostReport>(kv.value()).ok())
                    .map(|r| match pool {
                        Pool::Guest => r.guest_free,
                        Pool::Lend => r.lend_capacity.saturating_sub(r.lend_used),
                    });
                Ok((claims, rev, free))
            })?;
            let next = claims.adjusted(pool, delta);
            if check && free.is_none_or(|f| next.held(pool) > f) {
                return Ok(false);
            }
            let value = serde_json::to_vec(&next).unwrap_or_default();
            let k = key.clone();
            let ok = self.call(async move |c| {
                // Unchanged since read (mod revision 0: still absent).
                let cmp = Compare::mod_revision(k.as_str(), CompareOp::Equal, rev);
                let t = Txn::new()
                    .when(vec![cmp])
                    .and_then(vec![TxnOp::put(k, value, None)]);
                Ok(c.txn(t).await?.succeeded())
            })?;
            if ok {
                return Ok(true);
            }
        }
        Err(RegistryError::Address(format!(
            "the claims on {name} kept changing: gave up after 20 tries"
        )))
    }
}

/// The view from the registry's keys (each `(key, value)` as etcd
/// returned it; a record that does not decode is skipped: a member without
/// a readable report is shown dead, never guessed).
pub fn view_of(kvs: &[(String, Vec<u8>)], ttl: i64) -> ClusterView {
    let get = |k: &str| kvs.iter().find(|(key, _)| key == k).map(|(_, v)| v);
    let mut hosts = Vec::new();
    for (k, v) in kvs {
        let Some(name) = k.strip_prefix(&format!("{PREFIX}members/")) else {
            continue;
        };
        let Ok(m) = serde_json::from_slice::<Member>(v) else {
            continue;
        };
        let claimed = get(&format!("{PREFIX}claims/{name}"))
            .map(|v| Claims::decode(v.as_slice()))
            .unwrap_or_default();
        // Memory promised to migrations on their way is not free.
        let report = get(&format!("{PREFIX}hosts/{name}"))
            .and_then(|v| serde_json::from_slice::<HostReport>(v).ok())
            .map(|mut r| {
                r.guest_free = r.guest_free.saturating_sub(claimed.bytes);
                r.lend_used = r
                    .lend_used
                    .saturating_add(claimed.lend_bytes)
                    .min(r.lend_capacity);
                r
            });
        let gp = format!("{PREFIX}guests/{name}/");
        let guests: Vec<GuestStatus> = kvs
            .iter()
            .filter(|(k, _)| k.starts_with(&gp))
            .filter_map(|(_, v)| serde_json::from_slice(v).ok())
            .collect();
        let error = report.is_none().then(|| {
            format!("{name}: no heartbeat in the registry for over {ttl} s (lease expired): dead or cut off")
        });
        hosts.push(ClusterHost {
            http: m.http,
            host: report,
            guests,
            error,
            claimed: Some(pagefleet_api::Claimed {
                guest_bytes: claimed.bytes,
                lend_bytes: claimed.lend_bytes,
            }),
        });
    }
    ClusterView { hosts }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse_and_bad_ones_are_errors() {
        assert_eq!(
            parse_endpoints("etcd://10.0.0.1:2379,10.0.0.2:2379").unwrap(),
            ["http://10.0.0.1:2379", "http://10.0.0.2:2379"]
        );
        assert!(parse_endpoints("etcd://").is_err());
        assert!(parse_endpoints("etcd://h1").is_err());
    }

    #[test]
    fn a_member_without_a_heartbeat_is_dead_and_has_no_memory() {
        let m = |n: &str| {
            (
                format!("{PREFIX}members/{n}"),
                serde_json::to_vec(&Member {
                    http: format!("{n}:7071"),
                })
                .unwrap(),
            )
        };
        let report = HostReport {
            hostname: "h1".into(),
            guest_free: 5,
            ..Default::default()
        };
        let kvs = vec![
            m("h1"),
            m("h2"),
            (
                format!("{PREFIX}hosts/h1"),
                serde_json::to_vec(&report).unwrap(),
            ),
        ];
        let v = view_of(&kvs, 10);
        assert_eq!(v.hosts.len(), 2);
        assert!(v.hosts[0].error.is_none() && v.hosts[0].host.is_some());
        assert!(v.hosts[1].host.is_none());
        assert!(v.hosts[1]
            .error
            .as_deref()
            .unwrap()
            .contains("lease expired"));
    }
}
