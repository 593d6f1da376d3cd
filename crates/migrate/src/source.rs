//! The source side of a split migration: live pre-copy of a running
//! guest's region to a main host (a destination runner, over the migration
//! stream) and sub-hosts (memory servers, as plain page-outs), then
//! stop-and-copy at a safepoint.

pub use crate::outcome::{MigrateError, Progress};
use crate::plan::{self, Plan, MAIN, SUB0};
use crate::sub_dedup::SubPut;
use crate::wire::{Kind, Stream, WireError, NO_MIRROR};
use crate::{checksum, Report, Spec};
use pagefleet_client::{Conn, ConnectOptions, Pages};
use pagefleet_proto::auth::Secret;
use pagefleet_region::{Location, Region, Snapshot, PAGE};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::{Duration, Instant};
use tracing::{info, warn};

/// A sub-host: its memory server and how many pages it may take.
#[derive(Clone, Debug)]
pub struct SubHost {
    /// Its memory server.
    pub addr: String,
    /// Pages it may take.
    pub pages: u64,
}

/// How to migrate.
#[derive(Clone, Debug)]
pub struct Options {
    /// The destination runner's migration address (main host).
    pub to: String,
    /// Sub-hosts for the pages the main host does not keep.
    pub subs: Vec<SubHost>,
    /// Pages the main host keeps resident (its budget for the guest).
    pub main_pages: u64,
    /// The cluster secret.
    pub secret: Secret,
    /// Everything the destination needs to resume the workload.
    pub workload: pagefleet_api::GuestSpec,
    /// The guest's name.
    pub name: String,
    /// Paging policy on the destination.
    pub policy: pagefleet_api::Policy,
    /// Pages per chunk on the destination (default: as here).
    pub dest_chunk: Option<usize>,
    /// Integrated migration: the destination pulls the pages on memory
    /// servers too (needs `main_pages` ≥ every page with data).
    pub gather: bool,
    /// Compare region checksums at stop time (source) and at resume (destination).
    pub verify: bool,
    /// Sharing-aware: send hashes first and data only for pages the main
    /// host does not hold (when it can fill pages from its host).
    pub dedup: bool,
    /// Sharing-aware asks about every page, even where sending every page
    /// measures faster (crate::choice).
    pub dedup_always: bool,
    /// Most pre-copy rounds before stop-and-copy.
    pub max_rounds: usize,
    /// Stop and copy once a round leaves at most this many changed pages.
    pub stop_pages: u64,
    /// Stop and copy once the changed pages would take at most this long
    /// to send at the last round's rate (QEMU's `downtime-limit` idea;
    /// its default is 300 ms).
    pub max_downtime: Duration,
    /// Give up reaching a safepoint after this long.
    pub pause_timeout: Duration,
    /// Give up the stream after this long without progress.
    pub io_timeout: Duration,
}

impl Options {
    /// Migrate a guest running `workload` to `to` (and `subs`), keeping
    /// `main_pages` resident there; the rest are defaults.
    pub fn new(
        to: String,
        subs: Vec<SubHost>,
        main_pages: u64,
        secret: Secret,
        workload: pagefleet_api::GuestSpec,
    ) -> Options {
        Options {
            to,
            subs,
            main_pages,
            secret,
            workload,
            name: "guest".into(),
            policy: Default::default(),
            dest_chunk: None,
            gather: false,
            verify: false,
            dedup: true,
            dedup_always: false,
            max_rounds: 30,
            stop_pages: 1024,
            max_downtime: Duration::from_millis(50),
            pause_timeout: Duration::from_secs(10),
            io_timeout: Duration::from_secs(30),
        }
    }
}

/// The running guest, as the migration sees it.
pub trait Guest: Sync {
    /// Reach a safepoint: no guest work in flight (false on timeout).
    fn pause(&self, timeout: Duration) -> bool;
    /// Let it run again.
    fn resume(&self);
    /// Give up the guest's service address (the destination takes it over).
    fn release_address(&self) {}
    /// Take it back (the migration was aborted after releasing it).
    fn reclaim_address(&self) {}
    /// State besides memory that must move while the guest is paused (a
    /// VM's device state from QEMU's own migration, RAM excluded); None for
    /// a native guest, whose state is all in its memory.
    fn device_state(&self) -> Result<Option<Vec<u8>>, String> {
        Ok(None)
    }
}

struct Run<'a> {
    region: &'a Region,
    o: &'a Options,
    progress: &'a Progress,
    cancel: &'a AtomicBool,
    stream: Stream,
    subs: Vec<Conn>,
    /// Pages PUT to each sub-host by this migration (deleted on abort).
    put: Vec<Vec<u64>>,
    plan: Plan,
    /// Destination server list: the source's servers, then new sub-hosts.
    servers: Vec<String>,
    sub_index: Vec<u16>,
    sent: Vec<bool>,
    pages_twice: u64,
    bytes_main: u64,
    bytes_subs: Vec<u64>,
    /// Sharing-aware migration to the main host (when both ends do it).
    dedup: Option<crate::dedup::Sender>,
    /// ... and to each sub-host (empty when off).
    sub_dedup: Vec<crate::dedup::Sender>,
}

/// Migrate `region` (whose guest is `guest`) as planned by `o`. On success
/// the destination runs the guest and owns its pages: the caller must
/// [`Region::detach`] the region and stop. On error the guest runs here
/// again with all its data, and what the destination and sub-hosts received
/// is dropped.
pub fn migrate(
    region: &Region,
    guest: &dyn Guest,
    o: &Options,
    progress: &Progress,
    cancel: &AtomicBool,
) -> Result<Report, MigrateError> {
    let t0 = Instant::now();
    progress.set_phase("connecting");
    let sa = std::net::ToSocketAddrs::to_socket_addrs(&o.to.as_str())
        .map_err(|e| MigrateError::Connect(o.to.clone(), e))?
        .next()
        .ok_or_else(|| MigrateError::Other(format!("{} resolves to nothing", o.to)))?;
    let s = std::net::TcpStream::connect_timeout(&sa, Duration::from_secs(5))
        .map_err(|e| MigrateError::Connect(o.to.clone(), e))?;
    let mut stream = Stream::new(s);
    stream.set_timeout(Some(o.io_timeout));
    stream.connect_auth(&o.secret)?;
    let copts = ConnectOptions {
        name: format!("{}-migrate", o.name),
        window: 32,
        io_timeout: o.io_timeout,
        ..Default::default()
    };
    let mut subs = Vec::new();
    for sh in &o.subs {
        subs.push(
            Conn::connect(&sh.addr, &o.secret, &copts).map_err(|source| MigrateError::Sub {
                addr: sh.addr.clone(),
                source,
            })?,
        );
    }
    // Freeze the location DB (no page-outs while pages are being copied) and
    // start tracking changes, then plan from one consistent snapshot.
    region.hold_paging(true);
    region.track_changes(true);
    let snap = region
        .snapshot()
        .ok_or_else(|| MigrateError::Other("the region's pager did not answer".into()))?;
    if let Some(c) = o.dest_chunk {
        if !c.is_power_of_two() || c > 64 || !region.len().is_multiple_of(c * PAGE) {
            region.track_changes(false);
            region.hold_paging(false);
            return Err(MigrateError::Other(format!(
                "chunk of {c} pages: use a power of two up to 64 that divides the region"
            )));
        }
    }
    let caps: Vec<u64> = o.subs.iter().map(|s| s.pages).collect();
    // A main host that cannot hold the whole guest is filled only to its
    // pager's low watermark: it resumes without having to evict at once.
    let pages = region.pages();
    let main_cap = if o.main_pages >= pages {
        o.main_pages
    } else {
        o.main_pages
            - pagefleet_region::paging_slack(
                o.main_pages,
                o.dest_chunk.unwrap_or(region.chunk_pages),
            )
            .min(o.main_pages)
    };
    let planned = plan::plan(&snap, main_cap, &caps, o.workload.replicas);
    let plan = match planned {
        Ok(p) => p,
        Err(e) => {
            region.track_changes(false);
            region.hold_paging(false);
            let _ = stream.send(Kind::Abort, 0, &[e.to_string().as_bytes()]);
            progress.undid("told the destination to drop the migration".into());
            return Err(e.into());
        }
    };
    let mut servers = snap.servers.clone();
    let mut sub_index = Vec::new();
    for sh in &o.subs {
        let i = servers
            .iter()
            .position(|s| *s == sh.addr)
            .unwrap_or_else(|| {
                servers.push(sh.addr.clone());
                servers.len() - 1
            });
        sub_index.push(i as u16);
    }
    let n = o.subs.len();
    let mut run = Run {
        region,
        o,
        progress,
        cancel,
        stream,
        subs,
        put: vec![Vec::new(); n],
        plan,
        servers,
        sub_index,
        sent: vec![false; snap.location.len()],
        pages_twice: 0,
        bytes_main: 0,
        bytes_subs: vec![0; n],
        dedup: None,
        sub_dedup: if o.dedup {
            (0..n)
                .map(|_| {
                    crate::dedup::Sender::new(pagefleet_dedup::ContentKey::from_secret(&o.secret))
                })
                .collect()
        } else {
            Vec::new()
        },
    };
    let mut paused = false;
    let mut released = false;
    let r = run.go(snap, t0, guest, &mut paused, &mut released);
    match r {
        Ok(rep) => Ok(rep),
        Err(MigrateError::InDoubt(m)) => Err(MigrateError::InDoubt(m)),
        Err(e) => {
            warn!("migration of {} failed: {e}; aborting", o.name);
            run.abort(&e.to_string());
            if released {
                guest.reclaim_address();
                progress.undid("took the guest's service address back".into());
            }
            if paused {
                guest.resume();
                progress.undid("resumed the guest here".into());
            }
            progress.undid(format!("{} runs on this host as before", o.name));
            Err(e)
        }
    }
}

impl Run<'_> {
    fn check_cancel(&self) -> Result<(), MigrateError> {
        if self.cancel.load(Relaxed) {
            return Err(MigrateError::Cancelled);
        }
        Ok(())
    }

    fn go(
        &mut self,
        snap: Snapshot,
        t0: Instant,
        guest: &dyn Guest,
        paused: &mut bool,
        released: &mut bool,
    ) -> Result<Report, MigrateError> {
        let region = self.region;
        let spec = Spec {
            name: self.o.name.clone(),
            size: region.len() as u64,
            chunk_pages: self.o.dest_chunk.unwrap_or(region.chunk_pages),
            policy: self.o.policy,
            region_id: region.region_id,
            servers: self.servers.clone(),
            budget_pages: self.o.main_pages,
            workload: self.o.workload.clone(),
            verify: self.o.verify,
            gather: self.o.gather,
        };
        self.stream.send_json(Kind::Spec, &spec)?;
        let (_, ready) = self.stream.expect(Kind::Ready)?;
        let ready: crate::wire::Ready = if ready.is_empty() {
            crate::wire::Ready::default()
        } else {
            serde_json::from_slice(&ready)
                .map_err(|e| WireError::Malformed(format!("READY: {e}")))?
        };
        if self.o.dedup && ready.dedup {
            let mut s =
                crate::dedup::Sender::new(pagefleet_dedup::ContentKey::from_secret(&self.o.secret));
            if self.o.dedup_always {
                s.choice = crate::choice::Choice::always_ask();
            }
            self.dedup = Some(s);
        }
        info!(
            "migrating {}: {} pages to the main host, {:?} to sub-hosts",
            self.o.name, self.plan.main_pages, self.plan.sub_pages
        );
        // Round 1: every page with data, straight to where it is planned.
        let all: Vec<u64> = (0..snap.location.len() as u64)
            .filter(|p| snap.location[*p as usize] != Location::Zero)
            .collect();
        let info: Vec<(Location, u8)> = all
            .iter()
            .map(|&p| (snap.location[p as usize], snap.history[p as usize]))
            .collect();
        let servers = snap.servers.clone();
        drop(snap);
        let t1 = Instant::now();
        self.progress.set_phase("round 1");
        self.round(1, &all, &info, &servers)?;
        drop((all, info));
        let round1_secs = t1.elapsed().as_secs_f64();
        let round1_bytes = self.bytes_main + self.bytes_subs.iter().sum::<u64>();
        // Later rounds: what changed meanwhile, until it is small or stops shrinking.
        let mut rounds = 1;
        let mut prev = u64::MAX;
        let mut changed = region.take_changed();
        // Bytes per second the last round achieved (main host and
        // sub-hosts together): what the final copy can expect.
        let mut rate = round1_bytes as f64 / round1_secs.max(1e-3);
        // What the guest dirtied during a round, per second: against
        // `rate`, whether pre-copy converges (published for the progress
        // series; the loop below judges by the page counts).
        let dirty_rate = |pages: usize, secs: f64| (pages * PAGE) as f64 / secs.max(1e-3);
        self.progress.transfer_rate.store(rate as u64, Relaxed);
        self.progress
            .dirty_rate
            .store(dirty_rate(changed.len(), round1_secs) as u64, Relaxed);
        let fits = |n: usize, rate: f64| {
            (n * PAGE) as f64 / rate.max(1.0) <= self.o.max_downtime.as_secs_f64()
        };
        while (changed.len() as u64) > self.o.stop_pages
            && !fits(changed.len(), rate)
            && rounds < self.o.max_rounds
            && (changed.len() as u64) < prev
        {
            rounds += 1;
            prev = changed.len() as u64;
            self.progress.set_phase(&format!("round {rounds}"));
            let info = region
                .page_info(changed.clone())
                .ok_or_else(|| MigrateError::Other("the region's pager did not answer".into()))?;
            let (t, b) = (
                Instant::now(),
                self.bytes_main + self.bytes_subs.iter().sum::<u64>(),
            );
            self.round(rounds, &changed, &info, &servers)?;
            let sent = self.bytes_main + self.bytes_subs.iter().sum::<u64>() - b;
            // A small round's rate says little (latency, not bandwidth).
            let secs = t.elapsed().as_secs_f64();
            if sent >= 4 << 20 {
                rate = sent as f64 / secs.max(1e-3);
                self.progress.transfer_rate.store(rate as u64, Relaxed);
            }
            changed = region.take_changed();
            self.progress
                .dirty_rate
                .store(dirty_rate(changed.len(), secs) as u64, Relaxed);
        }
        // A cancel (the caller's Ctrl-C) is honoured up to GO, however
        // quickly the rounds went; the page loops check it too.
        self.check_cancel()?;
        // Stop and copy.
        self.progress.set_phase("stop-and-copy");
        let td = Instant::now();
        if !guest.pause(self.o.pause_timeout) {
            return Err(MigrateError::PauseTimeout(self.o.pause_timeout));
        }
        *paused = true;
        let pause_ms = td.elapsed().as_secs_f64() * 1e3;
        let checksum_source = if self.o.verify {
            Some(checksum(region, &self.o.secret).map_err(|e| MigrateError::Other(e.to_string()))?)
        } else {
            None
        };
        let t_sum = td.elapsed();
        let mut last = changed;
        last.extend(region.take_changed());
        last.sort_unstable();
        last.dedup();
        rounds += 1;
        let info = region
            .page_info(last.clone())
            .ok_or_else(|| MigrateError::Other("the region's pager did not answer".into()))?;
        let last_pages = last.len();
        self.round(rounds, &last, &info, &servers)?;
        if let Some(state) = guest.device_state().map_err(MigrateError::Other)? {
            let total = state.len() as u64;
            for piece in state.chunks(crate::wire::MAX_BODY) {
                self.stream.send(Kind::DeviceState, total, &[piece])?;
            }
            self.bytes_main += total;
        }
        let t_copy = Instant::now();
        let final_copy_ms = (t_copy - td - t_sum).as_secs_f64() * 1e3 - pause_ms;
        self.stream
            .send_json(Kind::Commit, &crate::wire::Commit {})?;
        self.progress.set_phase("commit");
        let prepared: crate::wire::Prepared = self.stream.expect_json(Kind::Prepared)?;
        let commit_ms = t_copy.elapsed().as_secs_f64() * 1e3;
        self.check_cancel()?;
        let t_go = Instant::now();
        guest.release_address();
        *released = true;
        self.stream.send(Kind::Go, 0, &[])?;
        // Past GO the destination may be running the guest: never resume here.
        let started: crate::wire::Started = self
            .stream
            .expect_json(Kind::Started)
            .map_err(|e| MigrateError::InDoubt(e.to_string()))?;
        let dest_checksum_secs = started.checksum_secs;
        let start_ms = t_go.elapsed().as_secs_f64() * 1e3 - dest_checksum_secs * 1e3;
        let downtime = td.elapsed().as_secs_f64() - t_sum.as_secs_f64() - dest_checksum_secs;
        self.progress.set_phase("done");
        let pages_main = self.sent_to(MAIN);
        Ok(Report {
            guest: self.o.name.clone(),
            main_host: self.o.to.clone(),
            sub_hosts: self.o.subs.iter().map(|s| s.addr.clone()).collect(),
            total_secs: t0.elapsed().as_secs_f64() - t_sum.as_secs_f64() - dest_checksum_secs,
            downtime_ms: downtime * 1000.0,
            rounds,
            last_round_pages: last_pages as u64,
            pages_main,
            pages_subs: (0..self.o.subs.len())
                .map(|j| self.sent_to(SUB0 + j as u8))
                .collect(),
            bytes_main: self.bytes_main,
            bytes_subs: self.bytes_subs.clone(),
            pages_sent_twice: self.pages_twice + prepared.pulled_then_replaced,
            round1_secs,
            round1_bytes,
            region_build_ms: prepared.build_ms,
            pages_pulled: prepared.pulled,
            pulled_then_replaced: prepared.pulled_then_replaced,
            pause_ms,
            final_copy_ms,
            commit_ms,
            start_ms,
            checksum_source,
            checksum_dest: started.checksum,
            dedup_subs: self
                .sub_dedup
                .iter()
                .map(|d| pagefleet_api::DedupReport {
                    pages_hashed: d.hashed_data,
                    pages_not_sent: d.found,
                    hash_bytes: d.hash_bytes,
                    bytes_saved: (d.found * PAGE as u64) as i64 - d.hash_bytes as i64,
                    probe_batches: d.probes,
                    source_hash_secs: d.hash_secs,
                    ..Default::default()
                })
                .collect(),
            dedup_main: self.dedup.as_ref().map(|d| {
                Box::new(pagefleet_api::DedupReport {
                    pages_hashed: d.hashed_data,
                    pages_not_sent: prepared.dedup.pages + prepared.dedup.zero,
                    zero_pages: prepared.dedup.zero,
                    stale_hints: prepared.dedup.stale,
                    hash_bytes: d.hash_bytes,
                    bytes_saved: ((prepared.dedup.pages + prepared.dedup.zero) * PAGE as u64)
                        as i64
                        - d.hash_bytes as i64,
                    probe_batches: d.probes,
                    source_hash_secs: d.hash_secs,
                    dest_fill_secs: prepared.dedup.secs,
                    dest_fill_cpu_secs: prepared.dedup.cpu_secs,
                    dest_ask_secs: prepared.dedup.ask_secs,
                    dest_check_secs: prepared.dedup.check_secs,
                    pages_sent_unasked: d.choice.pages[1],
                    ask_us_per_page: d.choice.costs_us().0,
                    send_us_per_page: d.choice.costs_us().1,
                })
            }),
        })
    }

    /// Pages of the final placement per target (for the report).
    fn sent_to(&self, t: u8) -> u64 {
        let cp = self.plan.chunk_pages;
        self.sent
            .iter()
            .enumerate()
            .filter(|(p, s)| **s && self.plan.target[p / cp] == t)
            .count() as u64
    }

    /// Send `pages` (sorted) where they belong: data for the main host on
    /// the stream, data for sub-hosts as PUTs to their memory servers (in
    /// parallel), locations on the stream once the PUTs are acknowledged.
    /// `info[i]`: location and history of `pages[i]`; server indexes refer to `servers`.
    fn round(
        &mut self,
        n: usize,
        pages: &[u64],
        info: &[(Location, u8)],
        servers: &[String],
    ) -> Result<(), MigrateError> {
        let cp = self.plan.chunk_pages;
        let mut main = Vec::new();
        // (page, server, mirror or NO_MIRROR)
        let mut located: Vec<(u64, u16, u16)> = Vec::new();
        let mut sub: Vec<Vec<u64>> = vec![Vec::new(); self.subs.len()];
        // Pages bound for sub-hosts: (page, sub-host, mirror sub-host).
        let mut sub_placed: Vec<(u64, usize, Option<usize>)> = Vec::new();
        let mut main_hist = Vec::new();
        for (&p, &(loc, h)) in pages.iter().zip(info) {
            match loc {
                // Never touched: the destination starts with zeros.
                Location::Zero => continue,
                Location::Remote(s, m) => {
                    let index = |s: usize| {
                        self.servers
                            .iter()
                            .position(|x| *x == servers[s])
                            .unwrap_or(s) as u16
                    };
                    located.push((p, index(s), m.map_or(NO_MIRROR, index)));
                    continue;
                }
                Location::Local => {}
            }
            if self.sent[p as usize] {
                self.pages_twice += 1;
            }
            self.sent[p as usize] = true;
            match self.plan.target[p as usize / cp] {
                MAIN => {
                    main.push(p);
                    main_hist.push(h);
                }
                t => {
                    let (j, k) = ((t - SUB0) as usize, self.plan.mirror_of(p as usize / cp));
                    sub[j].push(p);
                    if let Some(k) = k {
                        sub[k].push(p);
                    }
                    sub_placed.push((p, j, k));
                }
            }
        }
        for list in &mut sub {
            list.sort_unstable();
        }
        // Recorded before sending: an abort half-way must delete these too.
        for (j, list) in sub.iter().enumerate() {
            self.put[j].extend_from_slice(list);
        }
        self.progress.round.store(n as u64, Relaxed);
        self.progress.round_pages.store(pages.len() as u64, Relaxed);
        self.progress.round_sent.store(0, Relaxed);
        // Pages staying on memory servers first: in a gather the
        // destination pulls them while the main host's data streams.
        self.send_located(&mut located)?;
        let fd = self.region.memfd().as_fd();
        let rid = self.region.region_id;
        let (progress, cancel) = (self.progress, self.cancel);
        let hist = &main_hist;
        let stream = &mut self.stream;
        let dedup = &mut self.dedup;
        let subs_addr: Vec<String> = self.o.subs.iter().map(|s| s.addr.clone()).collect();
        let mut sub_dedup: Vec<Option<&mut crate::dedup::Sender>> =
            self.sub_dedup.iter_mut().map(Some).collect();
        sub_dedup.resize_with(self.subs.len(), || None);
        let results: Vec<Result<u64, MigrateError>> = std::thread::scope(|sc| {
            let hs: Vec<_> = self
                .subs
                .iter_mut()
                .zip(sub.iter())
                .zip(subs_addr.iter())
                .zip(sub_dedup)
                .map(|(((c, list), addr), d)| {
                    sc.spawn(move || {
                        let sp = SubPut::new(c, addr, rid, d, progress);
                        crate::sub_dedup::put_pages(sp, fd, list, cancel)
                    })
                })
                .collect();
            let m = match dedup {
                Some(d) => crate::dedup::send(stream, fd, &main, hist, d, progress, cancel),
                None => send_main(stream, fd, &main, hist, progress, cancel),
            };
            let mut out = vec![m];
            out.extend(hs.into_iter().map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(MigrateError::Other("sender thread panicked".into())))
            }));
            out
        });
        for (k, r) in results.into_iter().enumerate() {
            let bytes = r?;
            if k == 0 {
                self.bytes_main += bytes;
            } else {
                self.bytes_subs[k - 1] += bytes;
            }
        }
        for &(p, j, k) in &sub_placed {
            let mirror = k.map_or(NO_MIRROR, |k| self.sub_index[k]);
            located.push((p, self.sub_index[j], mirror));
        }
        self.send_located(&mut located)?;
        self.stream.send(Kind::Round, n as u64, &[])?;
        // Wait until the round has arrived (not just left this host): the
        // next round's dirty set and the downtime must not include data
        // still queued on the link.
        let (h, _) = self.stream.expect(Kind::RoundDone)?;
        if h.arg != n as u64 {
            return Err(WireError::Malformed(format!("ROUND_DONE {} for round {n}", h.arg)).into());
        }
        Ok(())
    }

    /// LOCATED messages for (page, server, mirror) triples, in runs.
    fn send_located(&mut self, located: &mut Vec<(u64, u16, u16)>) -> Result<(), MigrateError> {
        located.sort_unstable();
        let mut i = 0;
        while i < located.len() {
            let (first, s, m) = located[i];
            let mut j = i + 1;
            while j < located.len()
                && (located[j].1, located[j].2) == (s, m)
                && located[j].0 == located[j - 1].0 + 1
            {
                j += 1;
            }
            let count = (j - i) as u32;
            let (c, s, m) = (count.to_le_bytes(), s.to_le_bytes(), m.to_le_bytes());
            // (The 6-byte form when there is no mirror.)
            let body: &[&[u8]] = if located[i].2 == NO_MIRROR {
                &[&c, &s]
            } else {
                &[&c, &s, &m]
            };
            self.stream.send(Kind::Located, first, body)?;
            self.bytes_main += 16 + body.iter().map(|b| b.len() as u64).sum::<u64>();
            i = j;
        }
        located.clear();
        Ok(())
    }

    /// Tell the destination to drop everything and delete what the sub-hosts got.
    fn abort(&mut self, why: &str) {
        self.progress.set_phase("aborting");
        // A frozen or dead destination must not hold the rollback up for
        // another full timeout: the abort is a courtesy, the destination
        // drops everything on its own when the stream ends.
        self.stream.set_timeout(Some(Duration::from_secs(1)));
        let _ = self.stream.send(Kind::Abort, 0, &[why.as_bytes()]);
        self.progress.undid(format!(
            "told the destination {} to drop what it received",
            self.o.to
        ));
        let rid = self.region.region_id;
        for (j, list) in self.put.iter_mut().enumerate() {
            if list.is_empty() {
                continue;
            }
            list.sort_unstable();
            list.dedup();
            let addr = &self.o.subs[j].addr;
            let opts = ConnectOptions {
                name: format!("{}-migrate-abort", self.o.name),
                ..Default::default()
            };
            let r = match self.subs[j].delete(rid, Pages::List(list)) {
                Ok(n) => Ok(n),
                // The old connection may be broken mid-frame: try a fresh one.
                Err(_) => Conn::connect(addr, &self.o.secret, &opts)
                    .and_then(|mut c| c.delete(rid, Pages::List(list))),
            };
            match r {
                Ok(_) => self.progress.undid(format!(
                    "deleted the {} pages sent to sub-host {addr}",
                    list.len()
                )),
                Err(e) => {
                    warn!("could not delete this migration's pages on sub-host {addr}: {e}");
                    self.progress.undid(format!(
                        "could NOT delete the {} pages sent to sub-host {addr}: {e}",
                        list.len()
                    ));
                }
            }
        }
        self.region.track_changes(false);
        self.region.hold_paging(false);
        self.progress.set_phase("aborted");
    }
}

/// `hist[i]` is the history of `pages[i]`: every page as data.
fn send_main(
    stream: &mut Stream,
    fd: std::os::fd::BorrowedFd<'_>,
    pages: &[u64],
    hist: &[u8],
    progress: &Progress,
    cancel: &AtomicBool,
) -> Result<u64, MigrateError> {
    let mut buf = Vec::new();
    let mut bytes = 0u64;
    let batch = crate::dedup::BATCH;
    for (chunk, h) in pages.chunks(batch).zip(hist.chunks(batch)) {
        if cancel.load(Relaxed) {
            return Err(MigrateError::Cancelled);
        }
        bytes += crate::dedup::send_unasked(stream, fd, chunk, h, &mut buf, progress)?;
    }
    Ok(bytes)
}
