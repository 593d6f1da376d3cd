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

pub mod mirror;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, PutOptions, Txn, TxnOp,
    WatchOptions,
};
use mirror::{Change, Mirror};
use pagefleet_api::{ClusterHost, ClusterView, GuestStatus, HostReport};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Every key of the registry starts with this.
pub const PREFIX: &str = "/pagefleet/";

/// Keys per page of a range read. etcd counts the whole rest of the range
/// for every page, so many small pages are quadratic (1 024-key pages
/// read a 50 000-host full view, 150 000 keys, in 4.7 s against 0.25 s at
/// 10 000 hosts); 8 192 keys of 0.3–0.5 KB records (hosts, guests) are
/// ~4 MB.
const PAGE_KEYS: i64 = 8192;

/// The largest page reply taken: gRPC's default 4 MiB refused a
/// 10 000-host view in one reply (11.7 MB); a page of [`PAGE_KEYS`]
/// records of up to 8 KiB each fits.
const MAX_REPLY: usize = 64 << 20;

/// How long a placement waits for the mirror to catch up with etcd's
/// revision before reading etcd itself: a watch event arrives within a
/// few ms of its write; past this the watch is broken or etcd is far
/// behind, and the direct read is the answer.
const MIRROR_WAIT: Duration = Duration::from_millis(500);

/// Pause before the mirror lists again after its watch broke (a member
/// down, a compaction): the next try goes to the next member.
const MIRROR_RETRY: Duration = Duration::from_millis(500);

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
    /// What placement reads, followed by a watch once asked for.
    mirror: Arc<Mirror>,
    following: AtomicBool,
}

fn connect_options() -> ConnectOptions {
    ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(2))
        .with_timeout(Duration::from_secs(5))
        .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2))
}

/// The first key after every key starting with `prefix`.
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    // The registry's prefixes end in '/', never 0xff.
    if let Some(last) = end.last_mut() {
        *last += 1;
    }
    end
}

/// Every key under each of `prefixes` (below [`PREFIX`]) at one revision
/// (`revision`, or etcd's current one if 0), read in pages of
/// [`PAGE_KEYS`]; with the revision read.
async fn list(
    c: &mut Client,
    prefixes: &[&str],
    mut revision: i64,
) -> Result<(Vec<(String, Vec<u8>)>, i64), etcd_client::Error> {
    let mut out = Vec::new();
    let mut kv = c.kv_client().max_decoding_message_size(MAX_REPLY);
    for p in prefixes {
        let start = format!("{PREFIX}{p}");
        let end = prefix_end(&start);
        let mut from = start.into_bytes();
        loop {
            let r = kv
                .get(
                    from.clone(),
                    Some(
                        GetOptions::new()
                            .with_range(end.clone())
                            .with_limit(PAGE_KEYS)
                            .with_revision(revision),
                    ),
                )
                .await?;
            if revision == 0 {
                revision = r.header().map_or(0, |h| h.revision());
            }
            out.extend(r.kvs().iter().map(|kv| {
                (
                    String::from_utf8_lossy(kv.key()).into_owned(),
                    kv.value().to_vec(),
                )
            }));
            match r.kvs().last() {
                Some(kv) if r.more() => {
                    from = kv.key().to_vec();
                    from.push(0);
                }
                _ => break,
            }
        }
    }
    Ok((out, revision))
}

/// The mirror's follower: list, then apply the watch from the next
/// revision; on any failure mark the mirror unusable and start over on
/// the next member. Runs until the registry's runtime is dropped.
async fn follow(endpoints: Vec<String>, mirror: Arc<Mirror>) {
    let mut i = 0;
    loop {
        let ep = &endpoints[i % endpoints.len()];
        if let Err(e) = follow_once(ep, &mirror).await {
            tracing::debug!("the registry mirror's watch on {ep}: {e}: listing again");
        }
        mirror.update(|s| s.lost());
        i += 1;
        tokio::time::sleep(MIRROR_RETRY).await;
    }
}

async fn follow_once(ep: &str, mirror: &Mirror) -> Result<(), etcd_client::Error> {
    let mut c = Client::connect([ep], Some(connect_options())).await?;
    let (kvs, revision) = list(&mut c, &mirror::MIRRORED, 0).await?;
    mirror.update(|s| s.reset(kvs, revision));
    let mut stream = c
        .watch(
            PREFIX,
            Some(
                WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(revision + 1)
                    .with_progress_notify(),
            ),
        )
        .await?;
    while let Some(r) = stream.message().await? {
        if r.canceled() {
            return Err(etcd_client::Error::WatchError(format!(
                "watch canceled (compacted at {}): {}",
                r.compact_revision(),
                r.cancel_reason()
            )));
        }
        let rev = r.header().map_or(0, |h| h.revision());
        let changes = r.events().iter().filter_map(|ev| {
            let kv = ev.kv()?;
            let key = String::from_utf8_lossy(kv.key()).into_owned();
            Some(match ev.event_type() {
                EventType::Put => Change::Put(key, kv.value().to_vec()),
                EventType::Delete => Change::Delete(key),
            })
        });
        let changes: Vec<Change> = changes.collect();
        mirror.update(|s| s.apply(changes, rev));
    }
    Err(etcd_client::Error::WatchError(
        "the watch stream ended".into(),
    ))
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
            mirror: Arc::new(Mirror::new(ttl.as_secs().max(2) as i64)),
            following: AtomicBool::new(false),
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
        let c = match self.rt.block_on(Client::connect(
            [&self.endpoints[i]],
            Some(connect_options()),
        )) {
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
        let (kvs, _) = self.call(async |c| list(c, &[""], 0).await)?;
        Ok(view_of(kv_refs(&kvs), self.ttl))
    }

    /// Every member with its report (free memory net of claims) but
    /// without guests, read from etcd at one revision: a tenth of a full
    /// view's bytes at 10 guests a host.
    pub fn hosts_view(&self) -> Result<ClusterView, RegistryError> {
        self.read(|| self.hosts_view_once())
    }

    fn hosts_view_once(&self) -> Result<ClusterView, RegistryError> {
        let (kvs, _) = self.call(async |c| list(c, &mirror::MIRRORED, 0).await)?;
        Ok(view_of(kv_refs(&kvs), self.ttl))
    }

    /// What placement reads: [`Etcd::hosts_view`] as of now, from the
    /// mirror (started by the first call, or [`Etcd::follow`]) once it has
    /// seen etcd's current revision, else from etcd itself. Costs one
    /// count-only read of etcd however large the cluster is.
    pub fn placement_view(&self) -> Result<ClusterView, RegistryError> {
        self.follow();
        // Tried again on the next member, as every read is.
        let now = self.read(|| self.revision())?;
        match self.mirror.read_at(now, MIRROR_WAIT, mirror::State::view) {
            Some(v) => Ok(v),
            None => self.hosts_view(),
        }
    }

    /// Start mirroring what placement reads (once; later calls do
    /// nothing): a task on this registry's runtime lists it and follows a
    /// watch, until the registry is dropped.
    pub fn follow(&self) {
        if !self.following.swap(true, Ordering::AcqRel) {
            self.rt
                .spawn(follow(self.endpoints.clone(), self.mirror.clone()));
        }
    }

    /// The mirror's keys and their bytes (keys and values): the memory
    /// this host's view of the cluster holds.
    pub fn mirror_size(&self) -> (usize, usize) {
        self.mirror.size()
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

fn kv_refs(kvs: &[(String, Vec<u8>)]) -> impl Iterator<Item = (&str, &[u8])> {
    kvs.iter().map(|(k, v)| (k.as_str(), v.as_slice()))
}

/// The view from the registry's keys (each `(key, value)` as etcd
/// returned it, members in the order given; a record that does not decode
/// is skipped: a member without a readable report is shown dead, never
/// guessed). One pass over the keys, then one per member: linear in the
/// registry (a lookup per member by scanning was quadratic: 64 ms at
/// 2 500 hosts against 16 ms at 1 000).
pub fn view_of<'a>(kvs: impl IntoIterator<Item = (&'a str, &'a [u8])>, ttl: i64) -> ClusterView {
    let mut members = Vec::new();
    let mut reports = HashMap::new();
    let mut claims = HashMap::new();
    let mut guests: HashMap<&str, Vec<GuestStatus>> = HashMap::new();
    for (k, v) in kvs {
        let Some(k) = k.strip_prefix(PREFIX) else {
            continue;
        };
        if let Some(name) = k.strip_prefix("members/") {
            members.push((name, v));
        } else if let Some(name) = k.strip_prefix("hosts/") {
            // etcd returns each key once; of repeated records the first counts.
            reports.entry(name).or_insert(v);
        } else if let Some(name) = k.strip_prefix("claims/") {
            claims.entry(name).or_insert(v);
        } else if let Some((name, _)) = k.strip_prefix("guests/").and_then(|g| g.split_once('/')) {
            if let Ok(g) = serde_json::from_slice(v) {
                guests.entry(name).or_default().push(g);
            }
        }
    }
    let hosts = members
        .into_iter()
        .filter_map(|(name, member)| {
            host_of(
                name,
                member,
                reports.get(name).copied(),
                claims.get(name).copied(),
                guests.remove(name).unwrap_or_default(),
                ttl,
            )
        })
        .collect();
    ClusterView { hosts }
}

/// Host `name` as the view shows it, from its records (`member`, and
/// its report and claims if it has them): None if its membership does
/// not decode.
fn host_of(
    name: &str,
    member: &[u8],
    report: Option<&[u8]>,
    claims: Option<&[u8]>,
    guests: Vec<GuestStatus>,
    ttl: i64,
) -> Option<ClusterHost> {
    let m = serde_json::from_slice::<Member>(member).ok()?;
    let claimed = claims.map(Claims::decode).unwrap_or_default();
    // Memory promised to migrations on their way is not free.
    let report = report
        .and_then(|v| serde_json::from_slice::<HostReport>(v).ok())
        .map(|mut r| {
            r.guest_free = r.guest_free.saturating_sub(claimed.bytes);
            r.lend_used = r
                .lend_used
                .saturating_add(claimed.lend_bytes)
                .min(r.lend_capacity);
            r
        });
    let error = report.is_none().then(|| {
        format!("{name}: no heartbeat in the registry for over {ttl} s (lease expired): dead or cut off")
    });
    Some(ClusterHost {
        http: m.http,
        host: report,
        guests,
        error,
        claimed: Some(pagefleet_api::Claimed {
            guest_bytes: claimed.bytes,
            lend_bytes: claimed.lend_bytes,
        }),
    })
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
        let v = view_of(kv_refs(&kvs), 10);
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
