//! A hosted runner: a guest that a pagefleetd started (or that arrived by
//! migration). It serves a control socket — status, migrate, set-budget,
//! stop — one JSON request line, JSON reply lines.
//!
//! `migrate` streams `{"progress":…}` lines and ends with `{"report":…}`
//! (after which this process exits: the guest runs on the main host now)
//! or `{"error":…}` (the guest runs here again).

use anyhow::{bail, Context, Result};
use pagefleet_guests::{kv, synthetic, Gate, Mem};
use pagefleet_migrate::{dest, source};
use pagefleet_region::{Location, Region, Secret};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The service address that moves with the guest (secondary IP on a device).
#[derive(Clone, Debug)]
pub struct Service {
    pub ip: String,
    pub dev: String,
}

impl Service {
    pub fn claim(&self) -> Result<()> {
        addr_change(&self.dev, &self.ip, true)
            .with_context(|| format!("cannot add service address {} on {}", self.ip, self.dev))?;
        // Tell the neighbours (gratuitous ARP) so clients need not wait for
        // their caches to time out; off the critical path of a migration.
        let (dev, ip) = (self.dev.clone(), self.ip.clone());
        std::thread::spawn(move || {
            if let Err(e) = gratuitous_arp(&dev, &ip) {
                eprintln!("warning: gratuitous ARP for {ip} on {dev}: {e}");
            }
        });
        Ok(())
    }
    pub fn release(&self) {
        if let Err(e) = addr_change(&self.dev, &self.ip, false) {
            eprintln!("warning: removing service address {}: {e:#}", self.ip);
        }
    }
}

/// Add or remove `ip`/32 on `dev` over rtnetlink (no `ip` process: this
/// runs inside a migration's downtime). Adding an address that is there,
/// or removing one that is not, is not an error.
fn addr_change(dev: &str, ip: &str, add: bool) -> Result<()> {
    let ip: std::net::Ipv4Addr = ip.parse().context("service address must be IPv4")?;
    let name = std::ffi::CString::new(dev)?;
    // SAFETY: plain syscalls on buffers we own; the fd is closed below.
    unsafe {
        let index = libc::if_nametoindex(name.as_ptr());
        if index == 0 {
            bail!("no device {dev}");
        }
        let fd = libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        );
        if fd < 0 {
            bail!("netlink socket: {}", std::io::Error::last_os_error());
        }
        // nlmsghdr (16) + ifaddrmsg (8) + IFA_LOCAL (8) + IFA_ADDRESS (8)
        let mut m = Vec::with_capacity(40);
        let flags = (libc::NLM_F_REQUEST | libc::NLM_F_ACK) as u16
            | if add {
                (libc::NLM_F_CREATE | libc::NLM_F_EXCL) as u16
            } else {
                0
            };
        m.extend_from_slice(&40u32.to_ne_bytes());
        m.extend_from_slice(
            &(if add {
                libc::RTM_NEWADDR
            } else {
                libc::RTM_DELADDR
            })
            .to_ne_bytes(),
        );
        m.extend_from_slice(&flags.to_ne_bytes());
        m.extend_from_slice(&1u32.to_ne_bytes());
        m.extend_from_slice(&0u32.to_ne_bytes());
        m.extend_from_slice(&[libc::AF_INET as u8, 32, 0, 0]);
        m.extend_from_slice(&index.to_ne_bytes());
        for ty in [libc::IFA_LOCAL, libc::IFA_ADDRESS] {
            m.extend_from_slice(&8u16.to_ne_bytes());
            m.extend_from_slice(&ty.to_ne_bytes());
            m.extend_from_slice(&ip.octets());
        }
        let mut sa: libc::sockaddr_nl = std::mem::zeroed();
        sa.nl_family = libc::AF_NETLINK as u16;
        let sent = libc::sendto(
            fd,
            m.as_ptr().cast(),
            m.len(),
            0,
            (&sa as *const libc::sockaddr_nl).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as u32,
        );
        if sent < 0 {
            let e = std::io::Error::last_os_error();
            libc::close(fd);
            bail!("netlink send: {e}");
        }
        let mut buf = [0u8; 512];
        let n = libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0);
        libc::close(fd);
        if n < 36 {
            bail!("netlink: short reply");
        }
        // NLMSG_ERROR carries an errno (0: the ack).
        let ty = u16::from_ne_bytes([buf[4], buf[5]]);
        if ty == libc::NLMSG_ERROR as u16 {
            let errno = -i32::from_ne_bytes([buf[16], buf[17], buf[18], buf[19]]);
            let benign = if add {
                libc::EEXIST
            } else {
                libc::EADDRNOTAVAIL
            };
            if errno != 0 && errno != benign {
                bail!("{}", std::io::Error::from_raw_os_error(errno));
            }
        }
    }
    Ok(())
}

/// Broadcast a gratuitous ARP (a request for our own address) on `dev`, a
/// few times, so every neighbour maps `ip` to this host's MAC now.
fn gratuitous_arp(dev: &str, ip: &str) -> Result<()> {
    let ip: std::net::Ipv4Addr = ip.parse().context("service address must be IPv4")?;
    let name = std::ffi::CString::new(dev)?;
    // SAFETY: plain syscalls with valid arguments; every fd is closed below.
    unsafe {
        let ifindex = libc::if_nametoindex(name.as_ptr());
        if ifindex == 0 {
            bail!("no device {dev}");
        }
        let fd = libc::socket(
            libc::AF_PACKET,
            libc::SOCK_DGRAM,
            (libc::ETH_P_ARP as u16).to_be() as i32,
        );
        if fd < 0 {
            bail!("packet socket: {}", std::io::Error::last_os_error());
        }
        let mut ifr: libc::ifreq = std::mem::zeroed();
        for (i, b) in dev.bytes().take(15).enumerate() {
            ifr.ifr_name[i] = b as libc::c_char;
        }
        if libc::ioctl(fd, libc::SIOCGIFHWADDR, &mut ifr) != 0 {
            let e = std::io::Error::last_os_error();
            libc::close(fd);
            bail!("hardware address of {dev}: {e}");
        }
        let mac: [u8; 6] = std::array::from_fn(|i| ifr.ifr_ifru.ifru_hwaddr.sa_data[i] as u8);
        // ARP request: who-has ip tell ip, from our MAC.
        let mut pkt = Vec::with_capacity(28);
        pkt.extend_from_slice(&[0, 1, 8, 0, 6, 4, 0, 1]);
        pkt.extend_from_slice(&mac);
        pkt.extend_from_slice(&ip.octets());
        pkt.extend_from_slice(&[0; 6]);
        pkt.extend_from_slice(&ip.octets());
        let mut sll: libc::sockaddr_ll = std::mem::zeroed();
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = (libc::ETH_P_ARP as u16).to_be();
        sll.sll_ifindex = ifindex as i32;
        sll.sll_halen = 6;
        sll.sll_addr[..6].copy_from_slice(&[0xff; 6]);
        let mut err = None;
        for _ in 0..3 {
            let n = libc::sendto(
                fd,
                pkt.as_ptr().cast(),
                pkt.len(),
                0,
                (&sll as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            );
            if n < 0 {
                err = Some(std::io::Error::last_os_error());
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        libc::close(fd);
        if let Some(e) = err {
            bail!("sending: {e}");
        }
    }
    Ok(())
}

/// A guest workload running on a region, reachable through its gate.
struct Running {
    name: String,
    spec: Value,
    region: Arc<Region>,
    gate: Arc<Gate>,
    ops: Arc<AtomicU64>,
    sort: Option<Arc<SortJob>>,
    service: Option<Service>,
    started: Instant,
    migrating: AtomicBool,
    cancel: AtomicBool,
    progress: source::Progress,
    secret: Secret,
}

/// The S-memV sort experiment as a hosted guest: 100-byte records fill the
/// last part of the memory, other data the rest. Before a migration it
/// keeps scanning its records (building the access history the split
/// uses), unless told not to; `sort` (a control op) sorts them and times it.
pub struct SortJob {
    records: Mem,
    stop_warm: AtomicBool,
    warm: Mutex<Option<std::thread::JoinHandle<()>>>,
    ready: AtomicBool,
}

impl SortJob {
    fn start(mem: Mem, spec: &Value, incoming: bool) -> Arc<SortJob> {
        let frac = spec["sort_frac"].as_f64().unwrap_or(0.5).clamp(0.01, 1.0);
        let rec_bytes = ((mem.len as f64 * frac) as usize) / 4096 * 4096;
        // The records sit at the end: a placement by address alone (no
        // history) keeps the other data and sends the records away.
        let other = mem.len - rec_bytes;
        // SAFETY: a sub-range of the region.
        let records = unsafe { Mem::new(mem.base.add(other), rec_bytes) };
        let job = Arc::new(SortJob {
            records,
            stop_warm: AtomicBool::new(false),
            warm: Mutex::new(None),
            ready: AtomicBool::new(incoming),
        });
        if incoming {
            return job;
        }
        let seed = spec["seed"].as_u64().unwrap_or(42);
        let warm = spec["warm"].as_bool().unwrap_or(true);
        let j = job.clone();
        let h = std::thread::spawn(move || {
            let fill_other = || {
                for off in (0..other).step_by(4096) {
                    mem.write_u64(off, off as u64 | 1);
                }
            };
            // Without warming, the other data is what was touched last:
            // the history then says nothing about the records.
            if warm {
                fill_other();
                pagefleet_guests::sort::generate(j.records, seed);
            } else {
                pagefleet_guests::sort::generate(j.records, seed);
                fill_other();
            }
            j.ready.store(true, Relaxed);
            while warm && !j.stop_warm.load(Relaxed) {
                // Read every record page, as the running sort would.
                let mut sum = 0u64;
                for off in (0..j.records.len).step_by(4096) {
                    sum = sum.wrapping_add(j.records.read_u64(off));
                }
                std::hint::black_box(sum);
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        *job.warm.lock().unwrap() = Some(h);
        job
    }

    /// Sort the records now (stopping the warm-up scans first).
    fn sort(&self, region: &Region) -> Value {
        self.stop_warm.store(true, Relaxed);
        if let Some(h) = self.warm.lock().unwrap().take() {
            let _ = h.join();
        }
        let before = region.stats();
        let t = Instant::now();
        let sorted = pagefleet_guests::sort::sort(self.records);
        let secs = t.elapsed().as_secs_f64();
        let after = region.stats();
        json!({"sort_secs": secs, "sorted": sorted, "records": self.records.len / pagefleet_guests::sort::RECORD,
               "page_ins": after.page_ins - before.page_ins, "page_outs": after.page_outs - before.page_outs})
    }
}

/// A started workload: its operation counter and, for the sort job, its handle.
struct Workload {
    ops: Arc<AtomicU64>,
    sort: Option<Arc<SortJob>>,
}

/// Start `spec`'s workload on the region in background threads.
fn start_workload(
    spec: &Value,
    region: &Arc<Region>,
    gate: &Arc<Gate>,
    incoming: bool,
) -> Result<Workload> {
    // SAFETY: the region outlives the process's use of it (the runner never drops it while workloads run).
    let mem = unsafe { Mem::new(region.as_ptr(), region.len()) };
    let kind = spec["kind"].as_str().unwrap_or("");
    let threads = spec["threads"].as_u64().unwrap_or(2) as usize;
    match kind {
        "synthetic" => {
            let dist: synthetic::Dist = spec["dist"]
                .as_str()
                .unwrap_or("zipf:0.99")
                .parse()
                .map_err(anyhow::Error::msg)?;
            let o = synthetic::Opts {
                dist,
                write_frac: spec["write_frac"].as_f64().unwrap_or(0.3),
                threads,
                duration: Duration::from_secs(10 * 365 * 86400),
                max_ops: None,
                // A migrated guest keeps its memory: never prefill again.
                prefill: spec["prefill"].as_bool().unwrap_or(false) && !incoming,
                gate: Some(gate.clone()),
                rate: spec["rate"].as_f64(),
                span: spec["span"].as_f64().unwrap_or(1.0),
            };
            let ops = Arc::new(AtomicU64::new(0));
            let o2 = ops.clone();
            std::thread::Builder::new()
                .name("synthetic".into())
                .spawn(move || {
                    let mut total = 0u64;
                    synthetic::run(mem, &o, |_, rate| {
                        total += rate as u64;
                        o2.store(total, Relaxed);
                    });
                })?;
            Ok(Workload { ops, sort: None })
        }
        "kv" => {
            let listen = spec["listen"]
                .as_str()
                .unwrap_or("127.0.0.1:11211")
                .to_string();
            let mut k = kv::Kv::open(mem);
            let r = region.clone();
            k.extra_stats = Some(Box::new(move || {
                let s = r.stats();
                vec![
                    ("pf_resident_pages".into(), s.resident_pages),
                    ("pf_remote_pages".into(), s.remote_pages),
                    ("pf_page_ins".into(), s.page_ins),
                    ("pf_page_outs".into(), s.page_outs),
                ]
            }));
            // Requests pass the runner's safepoint gate.
            k.gate = gate.clone();
            let kvs = Arc::new(k);
            let l = bind_retry(&listen)?;
            let stop = Arc::new(AtomicBool::new(false));
            let ops = Arc::new(AtomicU64::new(0));
            let (k2, o2) = (kvs.clone(), ops.clone());
            std::thread::spawn(move || kv::serve(k2, l, stop));
            std::thread::spawn(move || loop {
                std::thread::sleep(Duration::from_millis(100));
                o2.store(kvs.ops.load(Relaxed), Relaxed);
            });
            Ok(Workload { ops, sort: None })
        }
        "sortjob" => Ok(Workload {
            ops: Arc::new(AtomicU64::new(0)),
            sort: Some(SortJob::start(mem, spec, incoming)),
        }),
        k => bail!("workload {k:?} cannot run hosted (use synthetic, kv or sortjob)"),
    }
}

/// A service address just added may take a moment to become bindable (DAD is off for /32, but be patient).
fn bind_retry(listen: &str) -> Result<std::net::TcpListener> {
    let mut last = None;
    for _ in 0..50 {
        match std::net::TcpListener::bind(listen) {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(last.unwrap()).with_context(|| format!("kv cannot listen on {listen}"))
}

impl source::Guest for Running {
    fn pause(&self, timeout: Duration) -> bool {
        self.gate.pause(timeout)
    }
    fn resume(&self) {
        self.gate.resume()
    }
    fn release_address(&self) {
        if let Some(s) = &self.service {
            s.release();
        }
    }
    fn reclaim_address(&self) {
        if let Some(s) = &self.service {
            let _ = s.claim();
        }
    }
}

fn locations(region: &Region) -> Value {
    let Some(s) = region.snapshot() else {
        return Value::Null;
    };
    let (mut local, mut zero) = (0u64, 0u64);
    let mut remote = vec![0u64; s.servers.len()];
    for l in &s.location {
        match l {
            Location::Local => local += 1,
            Location::Zero => zero += 1,
            Location::Remote(i) => remote[*i] += 1,
        }
    }
    let per: serde_json::Map<String, Value> = s
        .servers
        .iter()
        .zip(&remote)
        .filter(|(_, n)| **n > 0)
        .map(|(a, n)| (a.clone(), json!(n)))
        .collect();
    json!({"local": local, "zero": zero, "remote": per})
}

impl Running {
    fn new(
        name: String,
        spec: Value,
        region: Arc<Region>,
        gate: Arc<Gate>,
        w: Workload,
        service: Option<Service>,
        secret: Secret,
    ) -> Running {
        Running {
            name,
            spec,
            region,
            gate,
            ops: w.ops,
            sort: w.sort,
            service,
            started: Instant::now(),
            migrating: AtomicBool::new(false),
            cancel: AtomicBool::new(false),
            progress: source::Progress::default(),
            secret,
        }
    }

    fn status(&self) -> Value {
        let s = self.region.stats();
        json!({
            "name": self.name, "state": if self.migrating.load(Relaxed) { "migrating" } else { "running" },
            "pid": std::process::id(), "workload": self.spec, "size": self.region.len(),
            "budget_pages": s.budget_pages, "resident_pages": s.resident_pages, "remote_pages": s.remote_pages,
            "page_ins": s.page_ins, "page_outs": s.page_outs, "ops": self.ops.load(Relaxed),
            "ready": self.sort.as_ref().is_none_or(|j| j.ready.load(Relaxed)),
            "uptime_secs": self.started.elapsed().as_secs_f64(), "region_id": format!("{:#x}", self.region.region_id),
            "pages": locations(&self.region),
            "migration": if self.migrating.load(Relaxed) { self.progress.json() } else { Value::Null },
        })
    }

    fn migrate(&self, req: &Value, out: &mut UnixStream) -> Result<()> {
        if self.migrating.swap(true, Relaxed) {
            bail!("a migration of {} is already running", self.name);
        }
        self.cancel.store(false, Relaxed);
        let to = req["to"]
            .as_str()
            .context("migrate needs \"to\"")?
            .to_string();
        let subs: Vec<source::SubHost> = req["subs"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|s| source::SubHost {
                        addr: s["addr"].as_str().unwrap_or("").into(),
                        pages: s["pages"].as_u64().unwrap_or(0),
                    })
                    .collect()
            })
            .unwrap_or_default();
        let main_pages = req["main_pages"].as_u64().unwrap_or(self.region.pages());
        let mut o = source::Options::new(to, subs, main_pages, self.secret.clone());
        o.name = self.name.clone();
        o.workload = self.spec.clone();
        o.verify = req["verify"].as_bool().unwrap_or(false);
        o.policy = req["policy"]
            .as_str()
            .unwrap_or(self.spec["policy"].as_str().unwrap_or("clock"))
            .to_string();
        o.dest_chunk = req["chunk"].as_u64().map(|c| c as usize);
        o.gather = req["gather"].as_bool().unwrap_or(false);
        if let Some(n) = req["max_rounds"].as_u64() {
            o.max_rounds = n.max(1) as usize;
        }
        if let Some(n) = req["stop_pages"].as_u64() {
            o.stop_pages = n;
        }
        let done = AtomicBool::new(false);
        let w = Mutex::new(out.try_clone()?);
        let result = std::thread::scope(|sc| {
            sc.spawn(|| {
                while !done.load(Relaxed) {
                    let line = json!({"progress": self.progress.json()});
                    // The caller went away (its write fails, or it hung up
                    // between writes): that is a Ctrl-C — cancel at once,
                    // before the migration passes its point of no return.
                    if writeln!(w.lock().unwrap(), "{line}").is_err()
                        || pagefleet_proto::io::peer_hung_up(&*out, 200)
                    {
                        self.cancel.store(true, Relaxed);
                        break;
                    }
                }
            });
            let r = source::migrate(&self.region, self, &o, &self.progress, &self.cancel);
            done.store(true, Relaxed);
            r
        });
        let mut w = w.into_inner().unwrap();
        match result {
            Ok(rep) => {
                let _ = writeln!(w, "{}", json!({ "report": rep }));
                let _ = w.flush();
                eprintln!("migrated out: {}", serde_json::to_string(&rep)?);
                // The guest runs on the main host now and owns the pages on
                // the servers: leave without deleting them.
                std::process::exit(0);
            }
            Err(e) => {
                self.migrating.store(false, Relaxed);
                let _ = writeln!(
                    w,
                    "{}",
                    json!({ "error": e.to_string(), "in_doubt": matches!(e, source::MigrateError::InDoubt(_)) })
                );
                Ok(())
            }
        }
    }
}

fn serve_control(path: &Path, r: Arc<Running>) -> Result<()> {
    let _ = std::fs::remove_file(path);
    let l = UnixListener::bind(path)
        .with_context(|| format!("cannot create control socket {}", path.display()))?;
    for c in l.incoming() {
        let Ok(mut c) = c else { continue };
        let r = r.clone();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = c.set_read_timeout(Some(Duration::from_secs(10)));
            if BufReader::new(&c).read_line(&mut line).is_err() {
                return;
            }
            let _ = c.set_read_timeout(None);
            let reply = match serde_json::from_str::<Value>(&line) {
                Err(e) => json!({"error": format!("bad request: {e}")}),
                Ok(req) => match req["op"].as_str().unwrap_or("") {
                    "status" => r.status(),
                    "migrate" => match r.migrate(&req, &mut c) {
                        Ok(()) => return,
                        Err(e) => json!({"error": e.to_string()}),
                    },
                    "evacuate" => match (req["from"].as_str(), req["to"].as_str()) {
                        (Some(f), Some(t)) if !r.migrating.load(Relaxed) => {
                            match r.region.evacuate(f, t) {
                                Ok(n) => json!({"ok": true, "moved": n}),
                                Err(e) => json!({"error": e}),
                            }
                        }
                        (Some(_), Some(_)) => json!({"error": "the guest is migrating"}),
                        _ => {
                            json!({"error": "evacuate needs \"from\" and \"to\" (memory-server addresses)"})
                        }
                    },
                    "sort" => match &r.sort {
                        Some(j) if !r.migrating.load(Relaxed) => j.sort(&r.region),
                        Some(_) => json!({"error": "the guest is migrating"}),
                        None => json!({"error": "only a sortjob guest sorts"}),
                    },
                    "cancel" => {
                        r.cancel.store(true, Relaxed);
                        json!({"ok": true})
                    }
                    "set_budget" => match req["pages"].as_u64() {
                        Some(p) => {
                            r.region.set_budget(p);
                            json!({"ok": true, "budget_pages": r.region.budget()})
                        }
                        None => json!({"error": "set_budget needs \"pages\""}),
                    },
                    "stop" => {
                        source::Guest::release_address(&*r);
                        // The guest ends: its pages on the servers go too
                        // (before the reply, so the caller sees them gone).
                        r.gate.pause(Duration::from_secs(5));
                        let deleted = r.region.delete_remote();
                        let _ = writeln!(
                            c,
                            "{}",
                            json!({"ok": deleted.is_ok(), "error": deleted.err().map(|e| e.to_string())})
                        );
                        std::process::exit(0);
                    }
                    op => {
                        json!({"error": format!("unknown op {op:?}: use status, migrate, evacuate, cancel, set_budget, stop")})
                    }
                },
            };
            let _ = writeln!(c, "{reply}");
        });
    }
    Ok(())
}

/// Serve a guest that runs here until stopped or migrated away.
fn host(r: Running, control: &Path) -> Result<()> {
    let r = Arc::new(r);
    println!("guest {} running, control {}", r.name, control.display());
    std::io::stdout().flush()?;
    serve_control(control, r)
}

/// `pagefleet run ... --control`: a new guest started here.
pub fn run_hosted(
    name: String,
    spec: Value,
    region: Arc<Region>,
    service: Option<Service>,
    control: PathBuf,
    secret: Secret,
) -> Result<()> {
    if let Some(s) = &service {
        s.claim()?;
    }
    let gate = Arc::new(Gate::default());
    let w = start_workload(&spec, &region, &gate, false)?;
    host(
        Running::new(name, spec, region, gate, w, service, secret),
        &control,
    )
}

/// `pagefleet runner-incoming`: wait for one migration, then run the guest.
pub fn run_incoming(
    listen: &str,
    control: PathBuf,
    budget_pages: Option<u64>,
    service_dev: String,
    secret: Secret,
    timeout: Duration,
) -> Result<()> {
    let l = std::net::TcpListener::bind(listen)
        .with_context(|| format!("cannot listen for the migration on {listen}"))?;
    println!("migrate listening {}", l.local_addr()?);
    std::io::stdout().flush()?;
    l.set_nonblocking(true)?;
    let t = Instant::now();
    // The first connection that proves the cluster secret is the migration;
    // anything else (a port scan, a wrong secret, garbage, a connection that
    // says nothing) is turned away, each in its own thread so none delays it.
    let (tx, rx) = std::sync::mpsc::channel();
    let stream = loop {
        if let Ok(st) = rx.try_recv() {
            break st;
        }
        match l.accept() {
            Ok((s, peer)) => {
                s.set_nonblocking(false)?;
                let (tx, secret) = (tx.clone(), secret.clone());
                std::thread::spawn(move || {
                    match dest::authenticate(s, &secret, Duration::from_secs(10)) {
                        Ok(st) => {
                            let _ = tx.send(st);
                        }
                        Err(e) => eprintln!("ignored a connection from {peer}: {e}"),
                    }
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && t.elapsed() < timeout => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                bail!("no migration arrived within {timeout:?}")
            }
            Err(e) => return Err(e.into()),
        }
    };
    drop(l);
    stream.set_timeout(Some(Duration::from_secs(60)));
    let progress = dest::Progress::default();
    let received = dest::receive(stream, &secret, &progress).context("incoming migration")?;
    let (here, remote) = received.counts();
    eprintln!(
        "received {} pages, {} located on servers; building the region",
        here, remote
    );
    let mut committed = received.commit(&secret, |c| {
        if let Some(b) = budget_pages {
            c.budget_pages = c.budget_pages.min(b);
        }
    })?;
    let region = Arc::new(committed.take_region());
    let spec = committed.spec.clone();
    let (sum, secs) = if spec.verify {
        let t = Instant::now();
        region.hold_paging(true);
        let s = pagefleet_migrate::checksum(&region, &secret).map_err(anyhow::Error::msg)?;
        region.hold_paging(false);
        (Some(s), t.elapsed().as_secs_f64())
    } else {
        (None, 0.0)
    };
    let service = spec.workload["service_ip"].as_str().map(|ip| Service {
        ip: ip.to_string(),
        dev: service_dev,
    });
    if let Some(s) = &service {
        s.claim()?;
    }
    let gate = Arc::new(Gate::default());
    let w = start_workload(&spec.workload, &region, &gate, true)?;
    committed.started(sum, secs);
    host(
        Running::new(
            spec.name.clone(),
            spec.workload.clone(),
            region,
            gate,
            w,
            service,
            secret,
        ),
        &control,
    )
}
