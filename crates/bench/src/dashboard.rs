//! What the web dashboard's live updates cost (issue 51: under 1% of a core
//! with 10 viewers). A 3-host testbed: h1 runs two guests, one paging to
//! h2's memory server; viewers in h3's namespace hold h1's
//! `/ui/api/events` open, each with its own session (opened by a login
//! link, as a browser's), and count the snapshots they get. Per phase — no
//! viewer, one, ten — every pagefleetd's CPU share over the phase
//! (`/proc/PID/stat`). The goal is what the updates add: h1's share with
//! ten viewers less its share with none (its memory server and guests keep
//! it busy meanwhile). Also the page's first load (the page and its assets).
//!
//! The CPU figure counts only if the streams flowed: the goal is not met
//! unless every viewer got at least 0.8 snapshots a second.

use crate::util::{self, Goal, PlotOutcome};
use crate::LabRun;
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
/// The bounds.
const CPU_TARGET_PCT: f64 = 1.0;
const FIRST_LOAD_MAX: f64 = 300.0 * 1024.0;
/// Fewer snapshots than this per viewer per second: the streams did not flow.
const MIN_EVENTS_PER_S: f64 = 0.8;

#[derive(Clone, Debug, Serialize)]
pub struct Opts {
    /// Seconds per phase.
    pub secs: u64,
    /// Viewers in the last phase.
    pub viewers: usize,
    #[serde(skip)]
    pub out_dir: PathBuf,
}

impl Opts {
    pub fn full(out_dir: PathBuf) -> Opts {
        Opts {
            secs: 60,
            viewers: 10,
            out_dir,
        }
    }
    pub fn quick(out_dir: PathBuf) -> Opts {
        Opts {
            secs: 10,
            viewers: 10,
            out_dir,
        }
    }
}

/// One phase.
#[derive(Clone, Debug, Serialize)]
pub struct Phase {
    pub viewers: usize,
    pub secs: f64,
    /// Each pagefleetd's CPU share over the phase, % of one core (h1 serves
    /// the page; h2 and h3 answer its registry).
    pub cpu_pct: Vec<f64>,
    /// Snapshots each viewer got per second (the slowest viewer).
    pub min_events_per_s: f64,
    /// Bytes the viewers got per second, all together.
    pub bytes_per_s: f64,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub opts: Opts,
    pub phases: Vec<Phase>,
    /// The page, its script and its style sheet, bytes.
    pub first_load_bytes: usize,
    pub goals: Vec<Goal>,
    pub plot: PlotOutcome,
}

/// GET `path` of `addr` from inside `netns` (a viewer: with a session
/// `cookie`), its body handed to `each` as it comes, until the server
/// closes or `stop` is set (without `stop`: at most 30 s): (status, head).
fn get_in(
    netns: &str,
    addr: &str,
    path: &str,
    cookie: Option<&str>,
    stop: Option<Arc<AtomicBool>>,
    each: impl FnMut(&[u8]) + Send + 'static,
) -> std::thread::JoinHandle<Result<(u16, String)>> {
    let (netns, addr, path) = (netns.to_string(), addr.to_string(), path.to_string());
    let cookie = cookie.map(str::to_string);
    std::thread::spawn(move || -> Result<(u16, String)> {
        pagefleet_testbed::enter_netns(&netns)?;
        let headers: Vec<(&str, &str)> = cookie.iter().map(|c| ("Cookie", c.as_str())).collect();
        let req = pagefleet_lab::rawhttp::Request {
            headers: &headers,
            ..pagefleet_lab::rawhttp::Request::get(&path)
        };
        pagefleet_lab::rawhttp::stream(&addr, &req, stop.as_deref(), Duration::from_secs(30), each)
            .map_err(|e| anyhow::anyhow!("GET {path} from {addr}: {e}"))
    })
}

/// A session: a login link of the cluster's secret traded for its cookie.
fn login(l: &LabRun, secret: &pagefleet_proto::auth::Secret, addr: &str) -> Result<String> {
    let path = format!(
        "{}?{}",
        pagefleet_common::httpauth::UI_LOGIN_PATH,
        pagefleet_common::httpauth::ui_login_query(secret)
    );
    let (status, head) = get_in(&l.lab.hosts[2].netns, addr, &path, None, None, |_| {})
        .join()
        .map_err(|_| anyhow::anyhow!("login thread panicked"))??;
    if status != 303 {
        bail!("the login link got {status}: {head}");
    }
    head.lines()
        .find_map(|h| {
            let (k, v) = h.split_once(':')?;
            k.eq_ignore_ascii_case("set-cookie")
                .then(|| v.trim().split(';').next().unwrap_or("").to_string())
        })
        .context("no session cookie")
}

fn phase(l: &LabRun, addr: &str, cookies: &[String], secs: u64) -> Result<Phase> {
    let stop = Arc::new(AtomicBool::new(false));
    let counts: Vec<Arc<std::sync::Mutex<(u64, u64)>>> =
        cookies.iter().map(|_| Arc::default()).collect();
    let viewers: Vec<_> = cookies
        .iter()
        .zip(&counts)
        .map(|(c, n)| {
            let n = n.clone();
            get_in(
                &l.lab.hosts[2].netns,
                addr,
                "/ui/api/events",
                Some(c),
                Some(stop.clone()),
                move |b| {
                    let mut n = n.lock().unwrap();
                    n.1 += b.len() as u64;
                    n.0 += b.windows(15).filter(|w| w == b"event: snapshot").count() as u64;
                },
            )
        })
        .collect();
    // Let the streams start, then measure.
    std::thread::sleep(Duration::from_secs(2));
    let start: Vec<(u64, u64)> = counts.iter().map(|c| *c.lock().unwrap()).collect();
    let cpu0: Vec<f64> = l.lab.hosts.iter().map(|h| util::cpu_secs(h.pid)).collect();
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs(secs));
    let dt = t0.elapsed().as_secs_f64();
    let cpu: Vec<f64> = l
        .lab
        .hosts
        .iter()
        .zip(&cpu0)
        .map(|(h, c0)| 100.0 * (util::cpu_secs(h.pid) - c0) / dt)
        .collect();
    let end: Vec<(u64, u64)> = counts.iter().map(|c| *c.lock().unwrap()).collect();
    stop.store(true, Relaxed);
    for v in viewers {
        let (status, head) = v.join().map_err(|_| anyhow::anyhow!("viewer panicked"))??;
        if status != 200 {
            bail!("a viewer's stream got {status}: {head}");
        }
    }
    let min_events = start
        .iter()
        .zip(&end)
        .map(|(a, b)| (b.0 - a.0) as f64 / dt)
        .fold(f64::INFINITY, f64::min);
    Ok(Phase {
        viewers: cookies.len(),
        secs: dt,
        cpu_pct: cpu,
        min_events_per_s: if cookies.is_empty() { 0.0 } else { min_events },
        bytes_per_s: start
            .iter()
            .zip(&end)
            .map(|(a, b)| (b.1 - a.1) as f64)
            .fold(0.0, |x, y| x + y)
            / dt,
    })
}

pub fn run(o: &Opts, log: &mut dyn FnMut(&str)) -> Result<Report> {
    if !crate::is_root() {
        bail!("the dashboard benchmark runs a testbed: run it as root");
    }
    std::fs::create_dir_all(&o.out_dir)?;
    let bins = util::sibling_binary("pagefleetd")?
        .parent()
        .unwrap()
        .to_path_buf();
    log("testbed: 3 hosts; h1 runs two guests (one paging to h2), h3 runs the viewers");
    let l = LabRun::up(
        "bdash",
        &bins,
        3,
        pagefleet_testbed::Link::Unshaped,
        256 * MIB,
        &[512 * MIB, 0, 0],
    )?;
    let h2 = l.lab.hosts[1].addr.clone();
    for (name, extra) in [("g1", vec!["--budget", "32MiB"]), ("g2", vec![])] {
        let mut a = vec!["guest", "start", name, "--on", "h1", "--size", "128MiB"];
        a.extend(extra);
        a.extend(["--", "synthetic", "--prefill", "--rate", "1000"]);
        if name == "g1" {
            a.extend(["--servers", h2.as_str()]);
        }
        let (ok, _, err) = l.pf(0, &a);
        if !ok {
            bail!("guest start {name}: {err}");
        }
    }
    let secret = pagefleet_proto::auth::Secret::load(&l.lab.secret_file)?;
    let addr = l.lab.hosts[0].http();
    let cookies: Vec<String> = (0..o.viewers)
        .map(|_| login(&l, &secret, &addr))
        .collect::<Result<_>>()?;
    let mut first_load_bytes = 0;
    for p in ["/ui/", "/ui/app.js", "/ui/app.css"] {
        let n = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let m = n.clone();
        let (status, _) = get_in(
            &l.lab.hosts[2].netns,
            &addr,
            p,
            Some(&cookies[0]),
            None,
            move |b| {
                m.fetch_add(b.len(), Relaxed);
            },
        )
        .join()
        .map_err(|_| anyhow::anyhow!("GET {p} panicked"))??;
        if status != 200 {
            bail!("GET {p} with a session: {status}");
        }
        first_load_bytes += n.load(Relaxed);
    }
    let mut phases = vec![];
    for n in [0, 1, o.viewers] {
        log(&format!("{n} viewers for {} s", o.secs));
        let p = phase(&l, &addr, &cookies[..n], o.secs)?;
        log(&format!(
            "  pagefleetd CPU h1/h2/h3: {:.2}% / {:.2}% / {:.2}%, {:.2} snapshots/s per viewer",
            p.cpu_pct[0], p.cpu_pct[1], p.cpu_pct[2], p.min_events_per_s
        ));
        phases.push(p);
    }
    for g in ["g1", "g2"] {
        let _ = l.pf(0, &["guest", "stop", g]);
    }
    drop(l);
    let last = phases.last().unwrap();
    let flowed = last.min_events_per_s >= MIN_EVENTS_PER_S;
    // What the live updates cost: h1's CPU with the viewers over its CPU
    // without (the daemon's other work: its memory server, its guests).
    let added = last.cpu_pct[0] - phases[0].cpu_pct[0];
    let mut cpu = Goal::at_most(
        &format!(
            "pagefleetd CPU the updates add, {} dashboards open",
            o.viewers
        ),
        added,
        CPU_TARGET_PCT,
        "% of a core",
    );
    // Cheap because nothing flowed is not cheap.
    cpu.met &= flowed;
    let mut r = Report {
        opts: o.clone(),
        first_load_bytes,
        goals: vec![
            cpu,
            Goal::at_least(
                &format!("snapshots per viewer per second ({} viewers)", o.viewers),
                last.min_events_per_s,
                MIN_EVENTS_PER_S,
                "/s",
            ),
            Goal::at_most(
                "first load (page and assets)",
                first_load_bytes as f64,
                FIRST_LOAD_MAX,
                "bytes",
            ),
        ],
        phases,
        plot: PlotOutcome::default(),
    };
    util::save_with_plot(
        &mut r,
        |r| &mut r.plot,
        &o.out_dir,
        "dashboard",
        include_str!("../../../bench/plot_dashboard.py"),
    )?;
    Ok(r)
}

pub fn print_table(r: &Report, out: &mut dyn std::io::Write) -> std::io::Result<()> {
    writeln!(
        out,
        "the web dashboard's live updates: viewers on h3 of h1's /ui/api/events, {} s per phase",
        r.opts.secs
    )?;
    writeln!(
        out,
        "  {:>7} {:>10} {:>10} {:>10} {:>16} {:>12}",
        "viewers", "h1 CPU %", "h2 CPU %", "h3 CPU %", "snapshots/s each", "KiB/s sent"
    )?;
    for p in &r.phases {
        writeln!(
            out,
            "  {:>7} {:>10.2} {:>10.2} {:>10.2} {:>16.2} {:>12.1}",
            p.viewers,
            p.cpu_pct[0],
            p.cpu_pct[1],
            p.cpu_pct[2],
            p.min_events_per_s,
            p.bytes_per_s / 1024.0
        )?;
    }
    writeln!(out, "  first load: {} bytes", r.first_load_bytes)?;
    util::print_goals(&r.goals, out)?;
    r.plot.print(out)
}

/// `pagefleet bench dashboard`: what the dashboard's live updates cost.
#[derive(clap::Args, Clone, Debug)]
pub struct Args {
    /// Seconds per phase (default 60; --quick 10).
    #[arg(long)]
    pub secs: Option<u64>,
    /// Viewers in the last phase (default 10, at most 32: the daemon's limit).
    #[arg(long)]
    pub viewers: Option<usize>,
}

impl crate::Benchmark for Args {
    type Report = Report;
    fn run(&self, c: &crate::Common, log: &mut dyn FnMut(&str)) -> Result<Report> {
        let mut o = c.opts(Opts::quick, Opts::full);
        if let Some(s) = self.secs {
            o.secs = s.clamp(5, 3600);
        }
        if let Some(v) = self.viewers {
            o.viewers = v.clamp(1, 32);
        }
        run(&o, log)
    }
    fn print(r: &Report, out: &mut dyn std::io::Write) -> std::io::Result<()> {
        print_table(r, out)
    }
}
