//! The destination side: a runner in incoming mode receives the region
//! straight into the memory the resumed guest will use (received pages are
//! already mapped when it starts), learns where the rest lives, and builds
//! its region at COMMIT.

use crate::fill::{Filler, Target};
use crate::landing::{Shared, HERE, PULLED};
use crate::sys;
use crate::wire::Filled;
use crate::wire::{
    Kind, Stream, WireError, HASH_ENTRY, MAX_HASHES, MAX_PAGES, NO_MIRROR, ZERO_SERVER,
};
use crate::Spec;
use pagefleet_client::{Conn, ConnectOptions, GetMode, Pages};
use pagefleet_dedup::lookup::LookupClient;
use pagefleet_dedup::PageHash;
use pagefleet_proto::auth::Secret;
use pagefleet_region::{Adopt, Config, Region, RemoteRun, PAGE};
use std::os::fd::AsFd;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Live counters of an incoming migration.
#[derive(Default, Debug)]
pub struct Progress {
    /// Pages received.
    pub pages: AtomicU64,
    /// Pages located on memory servers.
    pub located: AtomicU64,
    /// Pre-copy round.
    pub round: AtomicU64,
}

/// Whether this process's memory is capped by a (v1 or v2) memory cgroup.
fn memcg_limited() -> bool {
    let cg = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    for line in cg.lines() {
        let mut f = line.splitn(3, ':');
        let (_, ctrl, path) = (f.next(), f.next().unwrap_or(""), f.next().unwrap_or(""));
        let limit = if ctrl.split(',').any(|c| c == "memory") {
            std::fs::read_to_string(format!("/sys/fs/cgroup/memory{path}/memory.limit_in_bytes"))
        } else if ctrl.is_empty() {
            std::fs::read_to_string(format!("/sys/fs/cgroup{path}/memory.max"))
        } else {
            continue;
        };
        if let Ok(l) = limit {
            let l = l.trim();
            if l != "max" && l.parse::<u64>().is_ok_and(|v| v < 1 << 60) {
                return true;
            }
        }
    }
    false
}

/// Largest VM device state accepted (QEMU's is ~1 MB without RAM).
pub const MAX_DEVICE_STATE: u64 = 256 << 20;

/// A migration received up to its COMMIT.
pub struct Received {
    // Declared first, so dropped first: the filler and the pullers stop
    // writing into the guest memory before it is unmapped.
    filler: Option<Filler>,
    pullers: Pullers,
    /// What the source sent about the guest.
    pub spec: Spec,
    stream: Stream,
    adopt: Adopt,
    shared: Arc<Shared>,
    secret: Secret,
    /// A VM's device state, as its QEMU wrote it on the source.
    device_state: Vec<u8>,
    /// Pages filled from this host's own content.
    filled: Filled,
    /// The filler answers on the same socket: every write takes this.
    write_lock: Arc<Mutex<()>>,
    /// Servers of the guest that could not be reached (tolerated with two
    /// replicas: their pages are read from their mirrors).
    unreachable: Vec<usize>,
}

/// Leave servers that could not be reached out of `cfg`: pages located on
/// one are read from their mirror, a mirror there is forgotten (the
/// region re-replicates those pages). A page with no copy left is an error.
fn drop_unreachable(cfg: &mut Config, dead: &[usize]) -> Result<(), String> {
    let keep: Vec<usize> = (0..cfg.servers.len())
        .filter(|i| !dead.contains(i))
        .collect();
    let index = |i: usize| keep.iter().position(|k| *k == i);
    for r in &mut cfg.initial_remote {
        let (s, m) = (index(r.server), r.mirror.and_then(index));
        *r = match (s, m) {
            (Some(s), m) => RemoteRun {
                server: s,
                mirror: m,
                ..*r
            },
            (None, Some(m)) => RemoteRun {
                server: m,
                mirror: None,
                ..*r
            },
            (None, None) => {
                return Err(format!(
                    "pages {}+{} were on {} only, which cannot be reached",
                    r.first, r.count, cfg.servers[r.server]
                ))
            }
        };
    }
    cfg.servers = keep.iter().map(|i| cfg.servers[*i].clone()).collect();
    cfg.replicas = cfg.replicas.min(cfg.servers.len()).max(1);
    Ok(())
}

/// Gather's pullers, one per memory server; dropping them waits for them.
struct Pullers(Vec<Option<Puller>>);

impl Drop for Pullers {
    fn drop(&mut self) {
        for p in self.0.iter_mut().filter_map(|p| p.take()) {
            drop(p.queue);
            let _ = p.thread.join();
        }
    }
}

/// Gather: a thread pulling pages from one memory server.
struct Puller {
    queue: std::sync::mpsc::Sender<Vec<u64>>,
    thread: std::thread::JoinHandle<Result<(), String>>,
}

fn start_puller(
    server: usize,
    addrs: Vec<String>,
    region: u64,
    secret: Secret,
    sh: Arc<Shared>,
) -> Puller {
    let (tx, rx) = std::sync::mpsc::channel::<Vec<u64>>();
    let thread = std::thread::spawn(move || -> Result<(), String> {
        let mut from = Sources {
            addrs,
            region,
            secret,
            conns: std::collections::HashMap::new(),
        };
        // With two replicas a dead server's pages come from their mirrors.
        let mut primary_gone: Option<String> = None;
        let mut buf = Vec::new();
        for list in rx {
            for part in list.chunks(1024) {
                buf.resize(part.len() * PAGE, 0);
                let present = match &primary_gone {
                    None => match from.pull(server, part, &mut buf) {
                        Ok(p) => p,
                        Err(e) => {
                            let why = format!("{}: {e}", from.addrs[server]);
                            tracing::warn!("gather: {why}; pulling its pages from their mirrors");
                            primary_gone = Some(why);
                            from.pull_mirrors(part, &mut buf, &sh, primary_gone.as_deref())?
                        }
                    },
                    Some(_) => from.pull_mirrors(part, &mut buf, &sh, primary_gone.as_deref())?,
                };
                let mut loc = sh.loc.lock().unwrap();
                for (k, &p) in part.iter().enumerate() {
                    let p = p as usize;
                    // Only while it is still expected there: newer data from
                    // the main host wins whichever arrived first.
                    if present[k] && loc[p] == server as u16 {
                        // SAFETY: in bounds; the guest does not run yet.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                buf.as_ptr().add(k * PAGE),
                                (sh.base as *mut u8).add(p * PAGE),
                                PAGE,
                            )
                        };
                        loc[p] = PULLED;
                        sh.pulled.fetch_add(1, Relaxed);
                    }
                }
            }
        }
        Ok(())
    });
    Puller { queue: tx, thread }
}

/// A gather's connections to the servers it pulls from.
struct Sources {
    addrs: Vec<String>,
    region: u64,
    secret: Secret,
    conns: std::collections::HashMap<usize, Conn>,
}

impl Sources {
    /// Pull `part` from server `s` into `buf` (keep: the main host may
    /// still page them in); per page, whether it was there (a page the
    /// main host paged in meanwhile is sent by it instead).
    fn pull(
        &mut self,
        s: usize,
        part: &[u64],
        buf: &mut [u8],
    ) -> Result<Vec<bool>, pagefleet_client::ClientError> {
        if !self.conns.contains_key(&s) {
            let opts = ConnectOptions {
                name: "pagefleet-gather".into(),
                window: 32,
                ..Default::default()
            };
            let c = Conn::connect(&self.addrs[s], &self.secret, &opts)?;
            self.conns.insert(s, c);
        }
        let c = self.conns.get_mut(&s).expect("connected");
        let mut present = vec![true; part.len()];
        let r = c.get(
            self.region,
            Pages::List(part),
            buf,
            GetMode::Keep,
            false,
            32,
        );
        match r {
            Ok(_) => {}
            // Some page is not there: find which, one by one.
            Err(e) if e.code() == Some(pagefleet_proto::ErrorCode::NotFound) => {
                for (k, &p) in part.iter().enumerate() {
                    let missing = c.get(
                        self.region,
                        Pages::List(&[p]),
                        &mut buf[k * PAGE..(k + 1) * PAGE],
                        GetMode::Keep,
                        true,
                        1,
                    )?;
                    present[k] = missing == 0;
                }
            }
            Err(e) => {
                self.conns.remove(&s);
                return Err(e);
            }
        }
        Ok(present)
    }

    /// Pull `part` from each page's mirror (its first copy's server is gone).
    fn pull_mirrors(
        &mut self,
        part: &[u64],
        buf: &mut [u8],
        sh: &Shared,
        why: Option<&str>,
    ) -> Result<Vec<bool>, String> {
        let mirrors: Vec<u16> = {
            let m = sh.mirror.lock().unwrap();
            part.iter().map(|&p| m[p as usize]).collect()
        };
        let mut present = vec![false; part.len()];
        let mut servers: Vec<u16> = mirrors.clone();
        servers.sort_unstable();
        servers.dedup();
        for m in servers {
            let idx: Vec<usize> = (0..part.len()).filter(|k| mirrors[*k] == m).collect();
            let pages: Vec<u64> = idx.iter().map(|k| part[*k]).collect();
            if m == NO_MIRROR {
                return Err(format!(
                    "page {} has no other copy: {}",
                    pages[0],
                    why.unwrap_or("its server is gone")
                ));
            }
            let mut tmp = vec![0u8; pages.len() * PAGE];
            let got = self.pull(m as usize, &pages, &mut tmp).map_err(|e| {
                format!(
                    "{} and its mirror {}: {e}",
                    why.unwrap_or("-"),
                    self.addrs[m as usize]
                )
            })?;
            for (j, k) in idx.iter().enumerate() {
                present[*k] = got[j];
                buf[k * PAGE..(k + 1) * PAGE].copy_from_slice(&tmp[j * PAGE..(j + 1) * PAGE]);
            }
        }
        Ok(present)
    }
}

/// Accept one migration on `s`: authenticate, receive until COMMIT. The
/// guest's memory exists only in this process until then; dropping the
/// result (or an error) discards it.
/// The first step of an incoming migration: a connection that proves the
/// cluster secret (a stranger's connection fails here and can be ignored).
pub fn authenticate(
    s: std::net::TcpStream,
    secret: &Secret,
    io_timeout: Duration,
) -> Result<Stream, WireError> {
    let mut stream = Stream::new(s);
    stream.set_timeout(Some(io_timeout));
    stream.accept_auth(secret)?;
    Ok(stream)
}

/// Receive an authenticated migration until COMMIT.
pub fn receive(
    stream: Stream,
    secret: &Secret,
    progress: &Progress,
) -> Result<Received, WireError> {
    receive_with(stream, secret, progress, None, &mut |_, _| {})
}

/// [`receive`], filling pages whose content this host holds through
/// `lookup` (sharing-aware migration; None: every page comes as data), and
/// calling `prepare` with the guest's spec and the memfd its memory is
/// being received into, once, before the first page (a VM's QEMU is
/// started on it then, off the downtime).
pub fn receive_with(
    mut stream: Stream,
    secret: &Secret,
    progress: &Progress,
    mut lookup: Option<LookupClient>,
    prepare: &mut dyn FnMut(&Spec, &Arc<OwnedFd>),
) -> Result<Received, WireError> {
    let spec: Spec = stream.expect_json(Kind::Spec)?;
    if spec.size == 0 || !spec.size.is_multiple_of(PAGE as u64) || spec.size > (1u64 << 46) {
        let _ = stream.send(Kind::Error, 0, &[b"bad region size"]);
        return Err(WireError::Malformed(format!(
            "SPEC: region size {}",
            spec.size
        )));
    }
    let adopt = match Adopt::create(&format!("pagefleet-{}", spec.name), spec.size) {
        Ok(a) => a,
        Err(e) => {
            let msg = format!("cannot create {} bytes of guest memory: {e}", spec.size);
            let _ = stream.send(Kind::Error, 0, &[msg.as_bytes()]);
            return Err(WireError::Peer(msg));
        }
    };
    prepare(&spec, &adopt.memfd);
    // A native guest's received pages are mapped in its guest mapping so
    // it takes no fault on them; a VM's guest mapping is QEMU's.
    let populate = spec.workload.workload.kind() != "vm";
    let pages = (spec.size / PAGE as u64) as usize;
    let mut unreachable = Vec::new();
    if !spec.gather {
        // Connect to the guest's memory servers now, not in the downtime.
        for (i, a) in spec.servers.iter().enumerate() {
            let opts = ConnectOptions {
                name: format!("pagefleet-{}-pager", spec.name),
                window: 4,
                ..Default::default()
            };
            match Conn::connect(a, secret, &opts) {
                Ok(c) => adopt.conns.lock().unwrap().push((a.clone(), c)),
                Err(e) if spec.workload.replicas > 1 => {
                    tracing::warn!(
                        "memory server {a} is unreachable ({e}): the guest's pages there are read from their mirrors"
                    );
                    unreachable.push(i);
                }
                Err(e) => {
                    let msg = format!("cannot reach memory server {a}: {e}");
                    let _ = stream.send(Kind::Error, 0, &[msg.as_bytes()]);
                    return Err(WireError::Peer(msg));
                }
            }
        }
    }
    stream.send_json(
        Kind::Ready,
        &crate::wire::Ready {
            dedup: lookup.is_some(),
        },
    )?;
    let shared = Arc::new(Shared {
        loc: Mutex::new(vec![ZERO_SERVER; pages]),
        mirror: Mutex::new(vec![NO_MIRROR; pages]),
        base: adopt.guest.addr() as usize,
        pulled: AtomicU64::new(0),
        replaced: AtomicU64::new(0),
    });
    let nservers = spec.servers.len();
    let mut r = Received {
        filler: None,
        pullers: Pullers((0..nservers).map(|_| None).collect()),
        spec,
        stream,
        adopt,
        shared,
        secret: secret.clone(),
        device_state: Vec::new(),
        filled: Filled::default(),
        write_lock: Arc::new(Mutex::new(())),
        unreachable,
    };
    let gather = r.spec.gather;
    let mut tmp = vec![0u8; MAX_PAGES * PAGE];
    let mut pipe = pagefleet_common::sys::splice::Splicer::new().map_err(WireError::Io)?;
    let limited = memcg_limited();
    if let Some(c) = lookup.take() {
        let target = Target {
            fd: r.adopt.memfd.clone(),
            shared: r.shared.clone(),
            direct: !(gather || limited),
        };
        // Without a filler (no thread, no second handle on the socket)
        // every page comes as data: HASHES are answered "not here".
        match r
            .stream
            .s
            .try_clone()
            .and_then(|w| Filler::start(c, target, w, r.write_lock.clone()))
        {
            Ok(f) => r.filler = Some(f),
            Err(e) => tracing::warn!("no filler ({e}); receiving every page as data"),
        }
    }
    loop {
        let h = r.stream.header()?;
        match h.kind {
            Kind::Pages => {
                let len = h.len as usize;
                let count = len / (PAGE + 1);
                if count == 0
                    || count > MAX_PAGES
                    || len != count * (PAGE + 1)
                    || usize::try_from(h.arg)
                        .ok()
                        .and_then(|a| a.checked_add(count))
                        .is_none_or(|end| end > pages)
                {
                    return Err(r.fail(format!("PAGES at {} with {} bytes", h.arg, h.len)));
                }
                let first = h.arg as usize;
                let mut hist = [0u8; MAX_PAGES];
                r.stream.read_exact(&mut hist[..count])?;
                r.adopt.history[first..first + count].copy_from_slice(&hist[..count]);
                // SAFETY: in bounds (checked above); only this thread and
                // the pullers (under `loc`'s lock) write the guest memory
                // before the region is built.
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(
                        r.adopt.guest.addr().add(first * PAGE),
                        count * PAGE,
                    )
                };
                if gather {
                    // Pullers write this memory too: copy under the lock.
                    r.stream.read_exact(&mut tmp[..count * PAGE])?;
                    let mut loc = r.shared.loc.lock().unwrap();
                    for q in first..first + count {
                        if loc[q] == PULLED {
                            r.shared.replaced.fetch_add(1, Relaxed);
                        }
                        loc[q] = HERE;
                    }
                    dst.copy_from_slice(&tmp[..count * PAGE]);
                } else {
                    // Socket -> pipe -> memfd: one copy, and shmem does not
                    // zero pages it allocates for whole-page writes (a fault
                    // on the mapping would). Then map them in the guest
                    // mapping so the resumed guest takes no fault on them.
                    if limited || r.stream.s.is_tls() {
                        // In a memory cgroup at its limit a write() into
                        // shmem that cannot reclaim fast enough gets the
                        // process OOM-killed; a page fault waits for reclaim.
                        // TLS: the bytes come decrypted from this process.
                        r.stream.read_exact(dst)?;
                    } else {
                        pipe.into_file(
                            &r.stream.s.socket().as_fd(),
                            &r.adopt.memfd.as_fd(),
                            (first * PAGE) as u64,
                            count * PAGE,
                        )
                        .map_err(|e| r.stream.io_error(e))?;
                        if populate {
                            sys::map_resident(dst);
                        }
                    }
                    r.shared.loc.lock().unwrap()[first..first + count].fill(HERE);
                }
                progress.pages.fetch_add(count as u64, Relaxed);
            }
            Kind::Hashes => {
                let b = r.stream.body(&h)?;
                let n = b.len() / HASH_ENTRY;
                if b.len() != n * HASH_ENTRY || n > MAX_HASHES {
                    return Err(r.fail(format!("HASHES of {} bytes", b.len())));
                }
                let mut list = Vec::with_capacity(n);
                let mut hashes = Vec::with_capacity(n);
                for e in b.chunks_exact(HASH_ENTRY) {
                    let p = u64::from_le_bytes(e[..8].try_into().unwrap());
                    if p >= pages as u64 {
                        return Err(r.fail(format!("HASHES for page {p} of {pages}")));
                    }
                    list.push((p as usize, e[8]));
                    hashes.push(PageHash(e[9..25].try_into().unwrap()));
                }
                let queued = r
                    .filler
                    .as_ref()
                    .is_some_and(|f| f.push(h.arg, list, hashes));
                if !queued {
                    // Nothing to fill from here: every page comes as data.
                    let have = crate::dedup::bitmap(&vec![false; n]);
                    r.send(Kind::Have, h.arg, &have)?;
                }
            }
            Kind::Located => {
                let b = r.stream.body(&h)?;
                if b.len() != 6 && b.len() != 8 {
                    return Err(r.fail("LOCATED must be 6 or 8 bytes".into()));
                }
                let count = u32::from_le_bytes(b[0..4].try_into().unwrap()) as usize;
                let server = u16::from_le_bytes(b[4..6].try_into().unwrap());
                let mirror = match b.get(6..8) {
                    Some(m) => u16::from_le_bytes(m.try_into().unwrap()),
                    None => NO_MIRROR,
                };
                let first = h.arg as usize;
                if first.checked_add(count).is_none_or(|e| e > pages)
                    || (server != ZERO_SERVER && server as usize >= nservers)
                    || (mirror != NO_MIRROR
                        && (server == ZERO_SERVER
                            || mirror == server
                            || mirror as usize >= nservers))
                {
                    return Err(r.fail(format!(
                        "LOCATED {first}+{count} on server {server} mirror {mirror}"
                    )));
                }
                r.shared.mirror.lock().unwrap()[first..first + count].fill(mirror);
                {
                    // Any copy here goes: the location list wins.
                    let mut loc = r.shared.loc.lock().unwrap();
                    let mut q = first;
                    while q < first + count {
                        if loc[q] == HERE || loc[q] == PULLED {
                            let s = q;
                            while q < first + count && (loc[q] == HERE || loc[q] == PULLED) {
                                q += 1;
                            }
                            let _ = pagefleet_uffd::punch_hole(
                                &r.adopt.memfd,
                                (s * PAGE) as u64,
                                ((q - s) * PAGE) as u64,
                            );
                        } else {
                            q += 1;
                        }
                    }
                    loc[first..first + count].fill(server);
                }
                if gather && server != ZERO_SERVER {
                    let s = server as usize;
                    if r.pullers.0[s].is_none() {
                        r.pullers.0[s] = Some(start_puller(
                            s,
                            r.spec.servers.clone(),
                            r.spec.region_id,
                            r.secret.clone(),
                            r.shared.clone(),
                        ));
                    }
                    let list = (first as u64..(first + count) as u64).collect();
                    if r.pullers.0[s].as_ref().unwrap().queue.send(list).is_err() {
                        return Err(r.fail(format!("pulling from {} failed", r.spec.servers[s])));
                    }
                }
                progress.located.fetch_add(count as u64, Relaxed);
            }
            Kind::Round => {
                r.stream.body(&h)?;
                progress.round.store(h.arg, Relaxed);
                r.send(Kind::RoundDone, h.arg, &[])?;
            }
            Kind::DeviceState => {
                let b = r.stream.body(&h)?;
                if h.arg > MAX_DEVICE_STATE || (r.device_state.len() + b.len()) as u64 > h.arg {
                    return Err(r.fail(format!("DEVICE_STATE of {} bytes", h.arg)));
                }
                r.device_state.extend_from_slice(&b);
            }
            Kind::Commit => {
                r.stream.body(&h)?;
                return Ok(r);
            }
            Kind::Abort => {
                let b = r.stream.body(&h)?;
                return Err(WireError::Aborted(String::from_utf8_lossy(&b).into_owned()));
            }
            k => return Err(r.fail(format!("unexpected {k:?} during pre-copy"))),
        }
    }
}

impl Received {
    fn fail(&mut self, msg: String) -> WireError {
        let _ = self.send(Kind::Error, 0, msg.as_bytes());
        WireError::Malformed(msg)
    }

    /// Send on the stream while the filler may be answering on it too.
    fn send(&mut self, kind: Kind, arg: u64, body: &[u8]) -> Result<(), WireError> {
        crate::fill::send_locked(&self.stream.s, &self.write_lock, kind, arg, body)
            .map_err(|e| self.stream.io_error(e))
    }

    /// The region configuration that resumes this guest here.
    pub fn config(&self, secret: &Secret) -> Result<Config, String> {
        let s = &self.spec;
        let mut cfg = Config::new(s.size, s.budget_pages);
        cfg.chunk_pages = s.chunk_pages;
        cfg.policy = s.policy;
        cfg.servers = s.servers.clone();
        // (Pages placed with one copy get their second after the start.)
        cfg.replicas = s.workload.replicas.clamp(1, s.servers.len().max(1));
        cfg.secret = Some(secret.clone());
        cfg.region_id = s.region_id;
        cfg.name = format!("pagefleet-{}", s.name);
        let loc = self.shared.loc.lock().unwrap();
        if s.gather {
            // Everything is here now; the old copies are deleted after the start.
            cfg.servers.clear();
            cfg.replicas = 1;
            if let Some(p) = loc.iter().position(|v| *v < PULLED) {
                return Err(format!(
                    "page {p} is on neither the main host nor {}: not gathered",
                    s.servers[loc[p] as usize]
                ));
            }
        }
        let mirror = self.shared.mirror.lock().unwrap();
        let at = |i: usize| (loc[i], mirror[i]);
        let mut i = 0;
        while i < loc.len() {
            let (v, m) = at(i);
            let mut j = i + 1;
            while j < loc.len() && at(j) == (v, m) {
                j += 1;
            }
            if v < PULLED {
                cfg.initial_remote.push(RemoteRun {
                    first: i as u64,
                    count: (j - i) as u64,
                    server: v as usize,
                    mirror: (m != NO_MIRROR).then_some(m as usize),
                });
            }
            i = j;
        }
        if !self.unreachable.is_empty() {
            drop_unreachable(&mut cfg, &self.unreachable)?;
        }
        Ok(cfg)
    }

    /// Pages received with data / located on servers.
    pub fn counts(&self) -> (u64, u64) {
        let loc = self.shared.loc.lock().unwrap();
        let here = loc.iter().filter(|v| **v == HERE || **v == PULLED).count() as u64;
        let remote = loc.iter().filter(|v| **v < PULLED).count() as u64;
        (here, remote)
    }

    /// Gather: wait for every pull (they ran alongside the pre-copy).
    fn finish_pulls(&mut self) -> Result<(), String> {
        for p in self.pullers.0.iter_mut().filter_map(|p| p.take()) {
            drop(p.queue);
            p.thread
                .join()
                .map_err(|_| "puller panicked".to_string())??;
        }
        Ok(())
    }

    /// Build the region (with `tweak` applied to its configuration), report
    /// PREPARED, and wait for GO. On ABORT or a lost source the region is
    /// dropped without touching the servers: their pages still belong to
    /// the source.
    pub fn commit(
        self,
        secret: &Secret,
        tweak: impl FnOnce(&mut Config),
    ) -> Result<Committed, WireError> {
        self.commit_with(secret, tweak, |cfg| {
            Region::new(cfg).map_err(|e| e.to_string())
        })
    }

    /// A VM's device state that came with the migration (empty for a
    /// native guest).
    pub fn device_state(&self) -> &[u8] {
        &self.device_state
    }

    /// [`Received::commit`], with the region made by `build` from its
    /// configuration (a VM's: QEMU started on the received memory first).
    pub fn commit_with(
        mut self,
        secret: &Secret,
        tweak: impl FnOnce(&mut Config),
        build: impl FnOnce(Config) -> Result<Region, String>,
    ) -> Result<Committed, WireError> {
        let t = Instant::now();
        if let Some(f) = self.filler.take() {
            let out = f.finish();
            for (p, h) in out.history {
                self.adopt.history[p] = h;
            }
            self.filled = out.filled;
        }
        if let Err(e) = self.finish_pulls() {
            return Err(self.fail(format!("gathering: {e}")));
        }
        let mut cfg = match self.config(secret) {
            Ok(c) => c,
            Err(e) => return Err(self.fail(e)),
        };
        tweak(&mut cfg);
        let (pulled, replaced) = (
            self.shared.pulled.load(Relaxed),
            self.shared.replaced.load(Relaxed),
        );
        let resident = {
            let loc = self.shared.loc.lock().unwrap();
            let mut runs = Vec::new();
            let mut i = 0;
            while i < loc.len() {
                if loc[i] == HERE || loc[i] == PULLED {
                    let j = (i..loc.len())
                        .find(|&k| loc[k] != HERE && loc[k] != PULLED)
                        .unwrap_or(loc.len());
                    runs.push((i as u64, (j - i) as u64));
                    i = j;
                } else {
                    i += 1;
                }
            }
            runs
        };
        let Received {
            spec,
            mut stream,
            mut adopt,
            device_state,
            filled,
            ..
        } = self;
        adopt.resident = Some(resident);
        cfg.adopt = Some(Arc::new(adopt));
        let region = match build(cfg) {
            Ok(r) => r,
            Err(e) => {
                let msg = format!("cannot build the region: {e}");
                let _ = stream.send(Kind::Error, 0, &[msg.as_bytes()]);
                return Err(WireError::Peer(msg));
            }
        };
        let build_ms = t.elapsed().as_secs_f64() * 1000.0;
        stream.send_json(
            Kind::Prepared,
            &crate::wire::Prepared {
                build_ms,
                pulled,
                pulled_then_replaced: replaced,
                dedup: filled,
            },
        )?;
        match stream.expect(Kind::Go) {
            Ok(_) => Ok(Committed {
                spec,
                stream,
                region: Some(region),
                secret: secret.clone(),
                device_state,
            }),
            Err(e) => {
                region.detach();
                Err(e)
            }
        }
    }
}

/// The guest is ours: start it, then confirm with [`Committed::started`].
pub struct Committed {
    /// What the source sent about the guest.
    pub spec: Spec,
    stream: Stream,
    region: Option<Region>,
    secret: Secret,
    /// A VM's device state (empty for a native guest).
    pub device_state: Vec<u8>,
}

impl Committed {
    /// The region (once).
    pub fn take_region(&mut self) -> Region {
        self.region.take().expect("region taken once")
    }
    /// Confirm the start to the source (with the resume-time checksum when asked).
    pub fn started(mut self, checksum: Option<String>, checksum_secs: f64) {
        let _ = self.stream.send_json(
            Kind::Started,
            &crate::wire::Started {
                checksum,
                checksum_secs,
            },
        );
        if self.spec.gather {
            // The guest is whole here: drop the copies left on the servers.
            let (servers, region, secret) = (
                self.spec.servers.clone(),
                self.spec.region_id,
                self.secret.clone(),
            );
            std::thread::spawn(move || {
                for s in servers {
                    let opts = ConnectOptions {
                        name: "pagefleet-gather-cleanup".into(),
                        ..Default::default()
                    };
                    if let Err(e) =
                        Conn::connect(&s, &secret, &opts).and_then(|mut c| c.delete_region(region))
                    {
                        tracing::warn!(
                            "could not delete the gathered guest's old pages on {s}: {e}"
                        );
                    }
                }
            });
        }
    }
}

impl Drop for Committed {
    fn drop(&mut self) {
        // Never delete the guest's pages on the servers from here.
        if let Some(r) = self.region.take() {
            r.detach();
        }
    }
}
