//! `pagefleet bench soak`: hours of cluster life in minutes, checked.
//!
//! A testbed of four hosts, plus two memory servers the soak kills and
//! restarts (empty, a new server id) on h3 and h4. Three kv guests with
//! two replicas page over all six servers under value-checking clients.
//! Every few seconds something happens, in turn: a guest's budget
//! changes, a guest migrates (split when the destination lacks room), a
//! host's memory server is evacuated, a soak server is killed -9 (and
//! started again a little later). Every 10 s the RSS, open fds and threads
//! of every process in the lab are sampled. At the end: the bytes lost
//! (values wrong or missing, × value size; must be 0) and each process's
//! growth (flat: ≤ 5%) from the samples in 20-40% of the run to those of
//! the last 20%: RSS median to median, open fds and threads fewest to
//! fewest (a sample taken while a migration's thread or connection is open
//! says nothing about a leak; a leak raises the floor). A pagefleetd is
//! compared between samples with the same number of guests on its host
//! and, where the samples allow, the same number of memory-server sessions
//! (a session is a thread and its buffers, and sessions follow where the
//! guests' pages are placed, which the soak keeps moving). A memory
//! server's lending pool is memory it holds for guests, bounded by
//! `--lend` and reported beside (the resident part of its `--lend`-sized
//! mapping): it grows with its guests' data, so a pagefleetd's RSS is
//! judged without it, and without its content index (sharing-aware
//! migration's hashes of its guests' memory and its store: data-sized too).

use crate::util::{self, Goal};
use anyhow::{bail, Context, Result};
use pagefleet_lab::kvload;
use pagefleet_lab::LabRun;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
const VALUE: usize = 2000;
/// What each lab host's memory server lends.
const LEND: u64 = 384 * MIB;

/// `pagefleet bench soak`.
#[derive(clap::Args, Clone, Debug)]
pub struct Args {
    /// How long the cluster runs (the figure: 30).
    #[arg(long, default_value_t = 30.0)]
    pub minutes: f64,
}

#[derive(Clone, Debug)]
pub struct Opts {
    pub secs: f64,
    /// Seconds between events.
    pub every: f64,
    pub guests: usize,
    pub keys: u64,
    pub out_dir: PathBuf,
}

impl Opts {
    pub fn full(out_dir: PathBuf) -> Opts {
        Opts {
            secs: 1800.0,
            every: 8.0,
            guests: 3,
            keys: 20_000,
            out_dir,
        }
    }
    pub fn quick(out_dir: PathBuf) -> Opts {
        Opts {
            secs: 90.0,
            every: 6.0,
            guests: 2,
            keys: 8_000,
            out_dir,
        }
    }
}

impl crate::Benchmark for Args {
    type Report = Report;
    fn run(&self, c: &crate::Common, log: &mut dyn FnMut(&str)) -> Result<Report> {
        let mut o = c.opts(Opts::quick, Opts::full);
        if !c.quick {
            o.secs = self.minutes * 60.0;
        }
        if o.secs < 30.0 {
            bail!("--minutes must be at least 0.5");
        }
        run(&o, log)
    }
    fn print(r: &Report, out: &mut dyn std::io::Write) -> std::io::Result<()> {
        print_table(r, out)
    }
}

/// One process's samples.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ProcSeries {
    pub host: String,
    pub pid: u32,
    /// What it is: pagefleetd, runner GUEST, soak memory server.
    pub what: String,
    /// Seconds since the start, per sample.
    pub t: Vec<f64>,
    pub rss_mib: Vec<f64>,
    /// A pagefleetd's lending pool touched so far, MiB (0 for others).
    pub pool_mib: Vec<f64>,
    /// A pagefleetd's content index (sharing-aware migration), MiB: sized
    /// by the data it hashes, like the pool.
    pub index_mib: Vec<f64>,
    pub fds: Vec<u64>,
    pub threads: Vec<u64>,
    /// Guests (runner and incoming processes) on its host at each sample.
    pub guests: Vec<u64>,
    /// A pagefleetd's memory-server sessions at each sample (its `conn …`
    /// threads: one per connected pager, writer or peer, wherever the
    /// guests' pages are placed at the moment; each has a thread and
    /// buffers).
    pub sessions: Vec<u64>,
    /// A pagefleetd's growth is compared between samples taken with the
    /// same number of guests on its host (a runner has its reaper thread and
    /// pipes there, a migration its stream): this many, the count most
    /// often seen in both windows (None: all samples).
    pub compared_at_guests: Option<u64>,
    /// ... and the same number of memory-server sessions, when at least 3
    /// samples in each window share both counts (None: guests only).
    pub compared_at_sessions: Option<u64>,
    /// Growth from the 20-40% window to the last 20%, % (None: it did not
    /// live through both): RSS without the lending pool and content index,
    /// median to median; fds and threads, fewest to fewest.
    pub rss_growth_pct: Option<f64>,
    pub fds_growth_pct: Option<f64>,
    pub threads_growth_pct: Option<f64>,
    /// A pagefleetd's threads by name (`conn PEER` counted as `conn`)
    /// whose fewest differ between the two windows: name, fewest early,
    /// fewest late. What moved the thread floor, if anything did.
    pub threads_moved: Vec<(String, u64, u64)>,
    /// Its threads by name, per sample (pagefleetd only).
    #[serde(skip)]
    pub thread_names: Vec<BTreeMap<String, u64>>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Event {
    pub t: f64,
    pub what: String,
    pub ok: bool,
    pub detail: String,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub bench: &'static str,
    pub secs: f64,
    pub guests: usize,
    pub keys_per_guest: u64,
    pub value_bytes: usize,
    pub events: Vec<Event>,
    /// Per event kind: (done, failed).
    pub event_counts: BTreeMap<String, (u64, u64)>,
    pub ops: u64,
    pub bad_values: u64,
    pub misses: u64,
    pub bytes_lost: u64,
    pub client_errors: Vec<String>,
    pub procs: Vec<ProcSeries>,
    pub goals: Vec<Goal>,
    #[serde(flatten)]
    pub plot: util::PlotOutcome,
}

/// A memory server the soak runs (and kills) inside a lab host.
struct SoakServer {
    host: usize,
    addr: String,
    child: Option<Child>,
}

impl SoakServer {
    fn start(l: &LabRun, bins: &Path, host: usize) -> Result<SoakServer> {
        let addr = format!("{}:7171", l.lab.hosts[host].ip);
        let mut s = SoakServer {
            host,
            addr,
            child: None,
        };
        s.restart(l, bins)?;
        Ok(s)
    }
    fn restart(&mut self, l: &LabRun, bins: &Path) -> Result<()> {
        // Its stderr is kept (one file per server, the last start's) so a
        // start that fails says why.
        let log = l.lab.dir.join(format!("soak-server-{}.log", self.host));
        let child = Command::new("ip")
            .args(["netns", "exec", &l.lab.hosts[self.host].netns])
            .arg(bins.join("pagefleetd"))
            .args(["--lend", &(256 * MIB).to_string(), "--listen", &self.addr])
            .args(["--metrics", "off", "--log", "error", "--secret-file"])
            .arg(&l.lab.secret_file)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).context("create the soak server's log")?)
            .spawn()
            .context("start a soak memory server")?;
        self.child = Some(child);
        // Listening within a few seconds (a loaded host takes longer).
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(20) {
            if let Some(st) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                bail!(
                    "soak memory server {} exited ({st}): {}",
                    self.addr,
                    log_tail(&log)
                );
            }
            let ok = l
                .lab
                .exec(self.host, "bash")
                .args([
                    "-c",
                    &format!("exec 3<>/dev/tcp/{}", self.addr.replace(':', "/")),
                ])
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if ok {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        bail!(
            "soak memory server {} did not listen within 20 s: {}",
            self.addr,
            log_tail(&log)
        )
    }
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            // `ip netns exec` execs pagefleetd: the pid is the server's.
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for SoakServer {
    fn drop(&mut self) {
        self.kill();
    }
}

pub fn run(o: &Opts, log: &mut dyn FnMut(&str)) -> Result<Report> {
    if !crate::is_root() {
        bail!("the soak runs a testbed: run it as root");
    }
    std::fs::create_dir_all(&o.out_dir)?;
    let bins = util::sibling_binary("pagefleetd")?
        .parent()
        .unwrap()
        .to_path_buf();
    log("testbed: 4 hosts, two more memory servers on h3 and h4");
    let l = LabRun::up(
        "soak",
        &bins,
        4,
        pagefleet_testbed::Link::Unshaped,
        LEND,
        &[384 * MIB, 384 * MIB, 128 * MIB, 0],
    )?;
    let extra = vec![
        SoakServer::start(&l, &bins, 2)?,
        SoakServer::start(&l, &bins, 3)?,
    ];
    let loads = start_guests(o, &l, &extra)?;
    log(&format!(
        "{} kv guests with 2 replicas under checking clients; events every {:.0} s for {:.0} s",
        o.guests, o.every, o.secs
    ));
    let mut drill = Drill {
        l: &l,
        bins: &bins,
        extra,
        guests: loads.iter().map(|(n, _)| n.clone()).collect(),
        every: o.every,
        k: 0,
        restart_at: Vec::new(),
        rng: 0x5eed_u64,
    };
    let t0 = Instant::now();
    let mut procs: BTreeMap<(String, u32), ProcSeries> = BTreeMap::new();
    let mut events = Vec::new();
    let mut next_event = o.every;
    let mut next_sample = 0.0;
    while t0.elapsed().as_secs_f64() < o.secs {
        let now = t0.elapsed().as_secs_f64();
        if now >= next_sample {
            sample(&l, &drill.extra, now, &mut procs);
            next_sample += 10.0;
        }
        events.extend(drill.restarts_due(now));
        if now >= next_event {
            next_event += o.every;
            let e = drill.next(now);
            log(&format!(
                "{:6.0} s  {}{}",
                e.t,
                e.what,
                if e.ok {
                    String::new()
                } else {
                    format!(": FAILED {}", e.detail)
                }
            ));
            events.push(e);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    sample(&l, &drill.extra, t0.elapsed().as_secs_f64(), &mut procs);
    let (mut ops, mut bad, mut misses, mut client_errors) = (0, 0, 0, Vec::new());
    for (name, load) in loads {
        let c = load.counters.clone();
        if let Some(e) = load.error() {
            client_errors.push(format!("{name}: {e}"));
        }
        let _ = load.stop();
        ops += c.ops.load(Relaxed);
        bad += c.bad_values.load(Relaxed);
        misses += c.misses.load(Relaxed);
    }
    drop(drill);
    drop(l);
    let mut procs: Vec<ProcSeries> = procs.into_values().collect();
    for p in &mut procs {
        growth(p, o.secs);
    }
    let bytes_lost = (bad + misses) * VALUE as u64;
    let goals = judge(bytes_lost, &procs);
    let event_counts = count_events(&events);
    let mut report = Report {
        bench: "soak",
        secs: o.secs,
        guests: o.guests,
        keys_per_guest: o.keys,
        value_bytes: VALUE,
        events,
        event_counts,
        ops,
        bad_values: bad,
        misses,
        bytes_lost,
        client_errors,
        procs,
        goals,
        plot: util::PlotOutcome::default(),
    };
    util::save_with_plot(
        &mut report,
        |r| &mut r.plot,
        &o.out_dir,
        "soak",
        include_str!("../../../bench/plot_soak.py"),
    )?;
    Ok(report)
}
/// Start the kv guests (2 replicas each, over every memory server) and
/// their checking clients.
fn start_guests(o: &Opts, l: &LabRun, extra: &[SoakServer]) -> Result<Vec<(String, kvload::Load)>> {
    let mut servers: Vec<String> = l.lab.hosts.iter().map(|h| h.addr.clone()).collect();
    servers.extend(extra.iter().map(|s| s.addr.clone()));
    let mut loads = Vec::new();
    for g in 0..o.guests {
        let name = format!("kv{}", g + 1);
        let ip = l.lab.service_ip(10 + g as u8);
        let svc = format!("{ip}:11211");
        let (ok, _, err) = l.pf(
            0,
            &[
                "guest",
                "start",
                &name,
                "--on",
                &format!("h{}", 1 + g % 2),
                "--size",
                "96MiB",
                "--budget",
                "48MiB",
                "--",
                "kv",
                "--listen",
                &svc,
                "--service-ip",
                &ip,
                "--replicas",
                "2",
                "--servers",
                &servers.join(","),
            ],
        );
        if !ok {
            bail!("guest start {name}: {err}");
        }
        let spec = kvload::Spec {
            addr: svc,
            keys: o.keys,
            value_len: VALUE,
            conns: 2,
            get_frac: 0.9,
            theta: 0.99,
            netns: Some(l.lab.hosts[3].netns.clone()),
            reconnect: true,
            pace: None,
        };
        kvload::prefill(&spec).with_context(|| format!("prefill {name}"))?;
        loads.push((name, kvload::Load::start(&spec)));
    }
    Ok(loads)
}

/// The soak's operator: every `every` seconds the next of four events in
/// turn (a budget change, a migration, an evacuation, a memory server
/// killed with SIGKILL, which comes back 1.5 periods later).
struct Drill<'a> {
    l: &'a LabRun,
    bins: &'a Path,
    extra: Vec<SoakServer>,
    guests: Vec<String>,
    every: f64,
    k: usize,
    /// A killed soak server comes back after this long: (server, when).
    restart_at: Vec<(usize, f64)>,
    rng: u64,
}

impl Drill<'_> {
    /// Bring back the killed servers whose time has come.
    fn restarts_due(&mut self, now: f64) -> Vec<Event> {
        let mut out = Vec::new();
        for i in (0..self.restart_at.len()).rev() {
            if now >= self.restart_at[i].1 {
                let s = self.restart_at.remove(i).0;
                let r = self.extra[s].restart(self.l, self.bins);
                out.push(event(
                    now,
                    "restart soak server",
                    &r.map(|_| self.extra[s].addr.clone()),
                ));
            }
        }
        out
    }

    /// The next event, done.
    fn next(&mut self, now: f64) -> Event {
        let (l, k) = (self.l, self.k);
        self.k += 1;
        let g = &self.guests[k % self.guests.len()];
        // Where the guest runs, from the registry (asked again if a busy
        // host did not answer); a budget change or migration of a guest
        // no host reports is skipped, not aimed at a guessed host.
        let locate = || {
            (0..3).find_map(|i| {
                if i > 0 {
                    std::thread::sleep(Duration::from_secs(1));
                }
                l.guest(g).map(|x| x.0)
            })
        };
        // Counted as `skipped`, not as the kind it would have been.
        let unknown = |now, kind: &str| {
            event(
                now,
                &format!("skipped {kind} {g} (no host reports it)"),
                &Ok(String::new()),
            )
        };
        let at = if k % 4 < 2 { locate() } else { None };
        let e = match (k % 4, at) {
            (0, None) => unknown(now, "budget"),
            (1, None) => unknown(now, "migrate"),
            (0, Some(host)) => {
                // Budget 25-100% of the guest.
                self.rng = self
                    .rng
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let pct = 25 + (self.rng >> 33) % 76;
                let pages = 96 * MIB / 4096 * pct / 100;
                let r: Result<serde_json::Value> = l.post(
                    host,
                    &format!("/guests/{g}/set_budget"),
                    &serde_json::json!({ "pages": pages }),
                    Duration::from_secs(30),
                );
                event(
                    now,
                    &format!("budget {g} {pct}%"),
                    &r.map(|_| String::new()),
                )
            }
            (1, Some(host)) => {
                let to = format!("h{}", 1 + (host + 1) % 3);
                let (ok, out, err) = l.pf(0, &["migrate", g, "--to", &to, "--json"]);
                event(now, &format!("migrate {g} to {to}"), &ok_or(ok, out, err))
            }
            (2, _) => {
                let h = format!("h{}", 2 + (k / 4) % 3);
                let (ok, out, err) = l.pf(0, &["evacuate", &h]);
                event(now, &format!("evacuate {h}"), &ok_or(ok, out, err))
            }
            _ => {
                let s = (k / 4) % self.extra.len();
                if self.extra[s].child.is_some() {
                    self.extra[s].kill();
                    self.restart_at.push((s, now + self.every * 1.5));
                    event(
                        now,
                        &format!("kill -9 soak server {}", self.extra[s].addr),
                        &Ok(String::new()),
                    )
                } else {
                    event(
                        now,
                        &format!(
                            "skipped kill -9 soak server {} (still down)",
                            self.extra[s].addr
                        ),
                        &Ok(String::new()),
                    )
                }
            }
        };
        e
    }
}

/// A process's growth between the early (20-40 %) and late (80-100 %)
/// windows of a run of `secs`: RSS by median, descriptors and threads by
/// their floor (a request in flight raises them for a moment; a leak
/// raises the floor). Processes not there through both windows are left.
fn growth(p: &mut ProcSeries, secs: f64) {
    let window = |lo: f64, hi: f64| -> Vec<usize> {
        (0..p.t.len())
            .filter(|&i| p.t[i] >= lo * secs && p.t[i] <= hi * secs)
            .collect()
    };
    let (mut early, mut late) = (window(0.2, 0.4), window(0.8, 1.01));
    // Only processes there through both windows.
    if early.len() < 2 || late.len() < 2 || p.t[0] > 0.2 * secs + 10.0 {
        return;
    }
    if p.what == "pagefleetd" {
        if let Some(k) = narrow(&mut early, &mut late, &p.guests, 8) {
            p.compared_at_guests = Some(k);
            // Then the session count most seen in both, if it is seen
            // often enough: sessions follow where pages are placed, not
            // how long the daemon has run.
            p.compared_at_sessions = narrow(&mut early, &mut late, &p.sessions, 64);
        }
    }
    let med = |idx: &[usize], f: &dyn Fn(usize) -> f64| {
        let mut v: Vec<f64> = idx.iter().map(|&i| f(i)).collect();
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    let g = |f: &dyn Fn(usize) -> f64| {
        let (a, b) = (med(&early, f), med(&late, f));
        (b - a) / a.max(1e-9) * 100.0
    };
    p.rss_growth_pct = Some(g(&|i| p.rss_mib[i] - p.pool_mib[i] - p.index_mib[i]));
    // Open fds and threads are small counts that a request or a
    // migration in flight raises by one for a moment; a leak raises the
    // floor. Their growth compares the fewest seen in each window.
    let floor = |idx: &[usize], f: &dyn Fn(usize) -> f64| {
        idx.iter().map(|&i| f(i)).fold(f64::INFINITY, f64::min)
    };
    let gf = |f: &dyn Fn(usize) -> f64| {
        let (a, b) = (floor(&early, f), floor(&late, f));
        (b - a) / a.max(1e-9) * 100.0
    };
    p.fds_growth_pct = Some(gf(&|i| p.fds[i] as f64));
    p.threads_growth_pct = Some(gf(&|i| p.threads[i] as f64));
    if !p.thread_names.is_empty() {
        let names: std::collections::BTreeSet<&String> =
            p.thread_names.iter().flat_map(|m| m.keys()).collect();
        let fewest = |idx: &[usize], n: &str| {
            idx.iter()
                .map(|&i| p.thread_names[i].get(n).copied().unwrap_or(0))
                .min()
                .unwrap_or(0)
        };
        p.threads_moved = names
            .into_iter()
            .map(|n| (n.clone(), fewest(&early, n), fewest(&late, n)))
            .filter(|(_, a, b)| a != b)
            .collect();
    }
}

/// The soak's goals: nothing lost, and no process growing. A growth goal
/// with no process measured through both windows is reported unmet.
fn judge(bytes_lost: u64, procs: &[ProcSeries]) -> Vec<Goal> {
    let max = |f: fn(&ProcSeries) -> Option<f64>| {
        procs.iter().filter_map(f).fold(f64::NEG_INFINITY, f64::max)
    };
    let mut goals = vec![Goal::at_most(
        "bytes lost (values wrong or missing)",
        bytes_lost as f64,
        0.0,
        "bytes",
    )];
    for (what, f) in [
        (
            "RSS (a pagefleetd's without its lending pool)",
            (|p: &ProcSeries| p.rss_growth_pct) as fn(&ProcSeries) -> Option<f64>,
        ),
        ("open fds", |p: &ProcSeries| p.fds_growth_pct),
        ("threads", |p: &ProcSeries| p.threads_growth_pct),
    ] {
        let name = format!("largest {what} growth of a process, after the warm-up");
        let m = max(f);
        if m.is_finite() {
            goals.push(Goal::at_most(&name, m, 5.0, "%"));
        } else {
            // No process was there through both windows.
            goals.push(Goal::not_measured(&name, 5.0, "%"));
        }
    }
    goals
}

/// Events by kind: (succeeded, failed).
fn count_events(events: &[Event]) -> BTreeMap<String, (u64, u64)> {
    let mut event_counts: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for e in events {
        let kind = e.what.split_whitespace().next().unwrap_or("").to_string();
        let c = event_counts.entry(kind).or_default();
        if e.ok {
            c.0 += 1;
        } else {
            c.1 += 1;
        }
    }
    event_counts
}

fn ok_or(ok: bool, out: String, err: String) -> Result<String> {
    if ok {
        Ok(out)
    } else {
        Err(anyhow::anyhow!("{}", err.trim()))
    }
}

fn event(t: f64, what: &str, r: &Result<String>) -> Event {
    Event {
        t,
        what: what.to_string(),
        ok: r.is_ok(),
        detail: match r {
            Ok(_) => String::new(),
            Err(e) => format!("{e:#}").chars().take(300).collect(),
        },
    }
}

/// Resident MiB of process `pid`'s lending pool: its mapping of exactly
/// `lend` bytes (the memory server maps its whole pool at once).
fn pool_rss_mib(pid: u32, lend: u64) -> f64 {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap_or_default();
    let want = format!("{}", lend / 1024);
    let mut in_pool = false;
    for l in smaps.lines() {
        let mut f = l.split_whitespace();
        match (f.next(), f.next()) {
            (Some("Size:"), Some(kb)) => in_pool = kb == want,
            (Some("Rss:"), Some(kb)) if in_pool => {
                return kb.parse::<f64>().unwrap_or(0.0) / 1024.0;
            }
            _ => {}
        }
    }
    0.0
}

/// One sample of every process in the lab's namespaces.
fn sample(
    l: &LabRun,
    extra: &[SoakServer],
    t: f64,
    procs: &mut BTreeMap<(String, u32), ProcSeries>,
) {
    let soak_pids: Vec<u32> = extra
        .iter()
        .filter_map(|s| s.child.as_ref().map(|c| c.id()))
        .collect();
    let mut daemons = Vec::new();
    for (hi, h) in l.lab.hosts.iter().enumerate() {
        let Ok(out) = Command::new("ip")
            .args(["netns", "pids", &h.netns])
            .output()
        else {
            continue;
        };
        let pids: Vec<u32> = String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect();
        let guests_here = pids
            .iter()
            .filter(|pid| {
                std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|c| c.split('\0').any(|a| a.starts_with("runner")))
            })
            .count() as u64;
        for pid in pids {
            let cmd = std::fs::read_to_string(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let args: Vec<&str> = cmd.split('\0').collect();
            let bin = args
                .first()
                .and_then(|a| a.rsplit('/').next())
                .unwrap_or("");
            let what = if soak_pids.contains(&pid) {
                "soak memory server".to_string()
            } else if bin == "pagefleetd" {
                "pagefleetd".to_string()
            } else if (bin == "pagefleet-runner" || bin == "pagefleet")
                && args.iter().any(|a| a.starts_with("runner"))
            {
                let name = args
                    .iter()
                    .find_map(|a| a.strip_prefix("--name="))
                    .unwrap_or("?");
                let kind = if args.contains(&"runner-incoming") {
                    "incoming"
                } else {
                    "runner"
                };
                format!("{kind} {name}")
            } else {
                continue;
            };
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
            let field = |k: &str| {
                status
                    .lines()
                    .find(|l| l.starts_with(k))
                    .and_then(|l| l.split_whitespace().nth(1))
                    .and_then(|v| v.parse::<u64>().ok())
            };
            let (Some(rss_kb), Some(threads)) = (field("VmRSS:"), field("Threads:")) else {
                continue;
            };
            let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64);
            let p = procs
                .entry((h.name.clone(), pid))
                .or_insert_with(|| ProcSeries {
                    host: h.name.clone(),
                    pid,
                    what,
                    ..Default::default()
                });
            p.t.push(t);
            p.rss_mib.push(rss_kb as f64 / 1024.0);
            p.pool_mib.push(if p.what == "pagefleetd" {
                pool_rss_mib(pid, LEND)
            } else {
                0.0
            });
            p.index_mib.push(0.0);
            if p.what == "pagefleetd" {
                daemons.push((hi, (h.name.clone(), pid)));
            }
            p.fds.push(fds);
            p.threads.push(threads);
            p.guests.push(guests_here);
            let names = if p.what == "pagefleetd" {
                thread_names(pid)
            } else {
                BTreeMap::new()
            };
            p.sessions.push(names.get("conn").copied().unwrap_or(0));
            p.thread_names.push(names);
        }
    }
    // Each host's content index (its pagefleetd's metrics), asked after
    // the processes were read: the request holds a socket and, for 2 s, a
    // thread of the daemon's blocking pool, which the fd and thread counts
    // must not see.
    let index: Vec<f64> = (0..l.lab.hosts.len())
        .map(|h| {
            l.get_text(h, "/metrics")
                .ok()
                .and_then(|m| {
                    m.lines()
                        .find(|x| x.starts_with("pagefleet_dedup_index_bytes "))
                        .and_then(|x| x.split_whitespace().last())
                        .and_then(|v| v.parse::<f64>().ok())
                })
                .unwrap_or(0.0)
                / MIB as f64
        })
        .collect();
    for (hi, key) in daemons {
        if let Some(x) = procs.get_mut(&key).and_then(|p| p.index_mib.last_mut()) {
            *x = index[hi];
        }
    }
}

pub fn print_table(r: &Report, out: &mut dyn std::io::Write) -> std::io::Result<()> {
    writeln!(
        out,
        "Soak: {:.0} s, {} kv guests (2 replicas, {} keys of {} B each), {} operations checked",
        r.secs, r.guests, r.keys_per_guest, r.value_bytes, r.ops
    )?;
    writeln!(out, "\nevents (done / failed):")?;
    for (k, (ok, bad)) in &r.event_counts {
        writeln!(out, "  {k:<10} {ok:>5} / {bad}")?;
    }
    for e in r.events.iter().filter(|e| !e.ok).take(10) {
        writeln!(out, "  failed at {:.0} s: {}: {}", e.t, e.what, e.detail)?;
    }
    writeln!(
        out,
        "\nvalues wrong: {}, missing: {} -> bytes lost {}",
        r.bad_values, r.misses, r.bytes_lost
    )?;
    for e in &r.client_errors {
        writeln!(out, "  client error: {e}")?;
    }
    writeln!(
        out,
        "\n{:<6} {:>7} {:<26} {:>8} {:>8} {:>7} {:>5} {:>7} {:>7} {:>6} {:>8}",
        "host",
        "pid",
        "process",
        "RSS MiB",
        "pool+idx",
        "RSS +%",
        "fds",
        "fds +%",
        "thr +%",
        "guests",
        "sessions"
    )?;
    let pct = |v: Option<f64>| v.map_or("-".to_string(), |x| format!("{x:+.1}"));
    let mut short: BTreeMap<&str, (usize, f64, u64)> = BTreeMap::new();
    for p in &r.procs {
        if p.rss_growth_pct.is_none() {
            // Short-lived (an incoming runner, a restarted server): summed up below.
            let kind = p.what.split_whitespace().next().unwrap_or("");
            let e = short.entry(kind).or_default();
            e.0 += 1;
            e.1 = e.1.max(p.rss_mib.iter().copied().fold(0.0, f64::max));
            e.2 = e.2.max(p.fds.iter().copied().max().unwrap_or(0));
            continue;
        }
        writeln!(
            out,
            "{:<6} {:>7} {:<26} {:>8.1} {:>8.1} {:>7} {:>5} {:>7} {:>7} {:>6} {:>8}",
            p.host,
            p.pid,
            p.what,
            p.rss_mib.last().copied().unwrap_or(0.0),
            p.pool_mib.last().copied().unwrap_or(0.0) + p.index_mib.last().copied().unwrap_or(0.0),
            pct(p.rss_growth_pct),
            p.fds.last().copied().unwrap_or(0),
            pct(p.fds_growth_pct),
            pct(p.threads_growth_pct),
            p.compared_at_guests
                .map_or("all".to_string(), |k| k.to_string()),
            p.compared_at_sessions
                .map_or("all".to_string(), |k| k.to_string()),
        )?;
    }
    for (kind, (n, rss, fds)) in short {
        writeln!(
            out,
            "  + {n} short-lived {kind} processes (largest RSS {rss:.1} MiB, most fds {fds})"
        )?;
    }
    for p in r.procs.iter().filter(|p| !p.threads_moved.is_empty()) {
        let moved: Vec<String> = p
            .threads_moved
            .iter()
            .map(|(n, a, b)| format!("{n:?} {a} -> {b}"))
            .collect();
        writeln!(
            out,
            "  {} {}: fewest threads by name moved: {}",
            p.host,
            p.what,
            moved.join(", ")
        )?;
    }
    writeln!(
        out,
        "(growth: RSS from the median of the samples in 20-40% of the run to the median of the last 20%, fds and threads from the fewest in each (a request in flight adds one for a moment; a leak raises the floor), for processes alive through both, a pagefleetd's taken with the same number of guests on its host and, where seen often enough, the same number of memory-server sessions (the counts most seen in both, `guests` and `sessions` below); RSS less a pagefleetd's lending pool and content index)"
    )?;
    util::print_goals(&r.goals, out)?;
    if let Some(p) = &r.plot.plot {
        writeln!(out, "\nPlot: {p}")?;
    }
    Ok(())
}

/// The last lines of a log, for an error message ("(empty)" if none).
fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().rev().take(3).collect();
    if lines.is_empty() {
        "(its log is empty)".into()
    } else {
        lines.into_iter().rev().collect::<Vec<_>>().join(" | ")
    }
}

/// A process's threads by name; memory-server sessions (`conn PEER`) all
/// count as `conn`.
fn thread_names(pid: u32) -> BTreeMap<String, u64> {
    let mut m = BTreeMap::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let Ok(c) = std::fs::read_to_string(t.path().join("comm")) else {
            continue;
        };
        let c = c.trim_end();
        let name = if c.starts_with("conn ") { "conn" } else { c };
        *m.entry(name.to_string()).or_insert(0) += 1;
    }
    m
}

/// Keep only the samples of both windows whose `count` is the value (up to
/// `max`) seen most in both, if at least 3 times in each; that value.
fn narrow(early: &mut Vec<usize>, late: &mut Vec<usize>, count: &[u64], max: u64) -> Option<u64> {
    let at = |idx: &[usize], k: u64| -> Vec<usize> {
        idx.iter().copied().filter(|&i| count[i] == k).collect()
    };
    let (n, k) = (0..=max)
        .map(|k| (at(early, k).len().min(at(late, k).len()), k))
        .max()?;
    if n < 3 {
        return None;
    }
    (*early, *late) = (at(early, k), at(late, k));
    Some(k)
}
