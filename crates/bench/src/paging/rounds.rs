//! Interleaved rounds: the configurations of a group are set up at once and
//! measured in turn, one short slice each per round, every other guest
//! stopped (`SIGSTOP`) meanwhile, the order reversed every round.
//!
//! Why: this machine's speed drifts by ±30% from one second to the next
//! (all-local's per-second figures within one 6 s window spanned 38 k–54 k
//! ops/s). Configurations measured one after another for 6 s each compare
//! different phases of that drift; slices a second apart share a phase, so
//! the ratio of two configurations' slices within a round compares like
//! with like, and the median over rounds discards the rounds a burst hit.

use super::*;

/// Each slice starts with this much unmeasured load (connections opened,
/// the resumed guest's threads back in their stride).
const LEAD: Duration = Duration::from_millis(300);
/// The measured part of a slice.
const SLICE: Duration = Duration::from_secs(1);
/// What a swap baseline's cgroup allows beyond the data budget: the rest
/// of the guest process (see `Member::start`).
const BASELINE_OVERHEAD: u64 = 6 << 20;
/// Toggled sampling: the wait after each switch, and the measured window.
const TOGGLE_SETTLE: Duration = Duration::from_millis(150);
const TOGGLE_WINDOW: Duration = Duration::from_millis(250);

/// One configuration of a group, alive for the whole group: its memory
/// servers, swap, cgroup, page store and guest. Fields drop in order: the
/// guest before what it pages to.
struct Member {
    cfg: Cfg,
    guest: Guest,
    store: Option<RawServer>,
    cg: Option<MemCgroup>,
    swap: Option<SwapKind>,
    _strangers: Vec<TcpStream>,
    servers: Vec<util::ChildDaemon>,
    _topology: Topology,
    spec: kvload::Spec,
    acc: Acc,
}

/// What a member's measured slices add up to.
#[derive(Default)]
struct Acc {
    ops: u64,
    secs: f64,
    rounds: Vec<f64>,
    swapins: u64,
    /// Page faults the guest process took (the kernel's count, every kind).
    minflt: u64,
    deltas: std::collections::BTreeMap<String, u64>,
    /// The kv stats after the last slice (percentile gauges).
    last: std::collections::HashMap<String, u64>,
    busy: Vec<Vec<f64>>,
    /// (sampling on, off) ops/s of each toggled pair.
    toggled: Vec<(f64, f64)>,
}

impl Member {
    /// Set up the configuration, fill the guest, warm it up, stop it.
    fn start(o: &Opts, c: &Cfg, keys: u64, secret_path: &Path) -> Result<Member> {
        let budget = (o.size as f64 * c.budget_pct / 100.0) as u64;
        let servers: Vec<util::ChildDaemon> = (0..c.servers)
            .map(|_| util::ChildDaemon::start(o.size + (64 << 20), secret_path))
            .collect::<Result<_>>()?;
        let addrs: Vec<String> = servers.iter().map(|s| s.addr.clone()).collect();
        let strangers = strangers(c, &addrs)?;
        let swap = match c.kind {
            Kind::SwapFile => Some(SwapKind::File(Swap::file(o.size + (64 << 20))?)),
            Kind::SwapSsd => Some(SwapKind::Ssd(SsdSwap::new(o.size + (64 << 20))?)),
            Kind::Zram => Some(SwapKind::File(Swap::zram(o.size + (64 << 20))?)),
            _ => None,
        };
        // The budget is for the guest's data, as a region's is; the
        // baseline's cgroup also holds the rest of its process: measured on
        // the plain kv guest under load, 1.7 MB of anonymous memory outside
        // the data, ~1 MiB of page tables, 20 kernel stacks. 6 MiB covers
        // it (16 MiB, as before, gave the swap baselines ~12 MiB, 5% of a
        // 50% budget, more data cache than pagefleet's guest).
        let cg = match swap {
            Some(_) => Some(MemCgroup::new(budget + BASELINE_OVERHEAD)?),
            None => None,
        };
        // The floor's page store: a raw TCP server on CPU 0, as the memory
        // servers are.
        let store = match c.kind {
            Kind::Floor => {
                let raw = RawServer::start()?;
                if util::ncpus() >= 2 {
                    util::set_process_affinity(raw.child.id(), &[0]);
                }
                Some(raw)
            }
            _ => None,
        };
        let addrs = match &store {
            Some(raw) => vec![raw.addr.clone()],
            None => addrs,
        };
        let guest = start_guest(
            o,
            c,
            &addrs,
            secret_path,
            cg.as_ref().map(|g| g.path.as_path()),
        )?;
        let topology = Topology::pin(guest.child.id(), &servers);
        let spec = kv_spec(&guest.addr, keys, o);
        kvload::prefill(&spec)?;
        // The prefill leaves the resident part dirty; the warm-up lets
        // paging (pagefleet and swap alike) reach its steady state, where
        // evicted pages were mostly paged in before.
        kvload::run_for(&spec, o.warmup_secs)?;
        let m = Member {
            cfg: c.clone(),
            guest,
            store,
            cg,
            swap,
            _strangers: strangers,
            servers,
            _topology: topology,
            spec,
            acc: Acc::default(),
        };
        m.signal(libc::SIGSTOP)?;
        Ok(m)
    }

    fn signal(&self, sig: libc::c_int) -> Result<()> {
        // The pid is our child's, not yet reaped (Guest waits for it only on drop).
        if let Err(e) = pagefleet_common::sys::process::signal(self.guest.child.id() as i32, sig) {
            bail!("signal {sig} to the guest: {e}");
        }
        Ok(())
    }

    /// Resume the guest, measure one slice of load, stop it again: the
    /// slice's ops/s.
    fn slice(&mut self, round: usize) -> Result<f64> {
        self.signal(libc::SIGCONT)?;
        let l = kvload::Load::start_seeded(&self.spec, 1 + round as u64);
        std::thread::sleep(LEAD);
        let before = pagefleet_lab::kvload::stats(&self.guest.addr)?;
        let pid = self.guest.child.id();
        let flt0 = pagefleet_lab::proc::minor_faults(pid);
        let (swap0, cpu0, n0, t0) = (
            vmstat("pswpin"),
            util::cpu_times(),
            l.counters.ops.load(Relaxed),
            Instant::now(),
        );
        std::thread::sleep(SLICE);
        let (n1, secs) = (l.counters.ops.load(Relaxed), t0.elapsed().as_secs_f64());
        let busy = util::cpu_busy(&cpu0, &util::cpu_times());
        let swapins = vmstat("pswpin").saturating_sub(swap0);
        let faults = pagefleet_lab::proc::minor_faults(pid).saturating_sub(flt0);
        let after = pagefleet_lab::kvload::stats(&self.guest.addr)?;
        let counters = l.counters.clone();
        let error = l.error();
        l.stop()?;
        self.signal(libc::SIGSTOP)?;
        if let Some(e) = error {
            bail!("the kv load failed: {e}");
        }
        let bad = counters.bad_values.load(Relaxed);
        if bad > 0 {
            bail!("{bad} gets returned a wrong value");
        }
        let a = &mut self.acc;
        a.ops += n1 - n0;
        a.secs += secs;
        a.rounds.push((n1 - n0) as f64 / secs);
        a.swapins += swapins;
        a.minflt += faults;
        a.busy.push(busy);
        // Counters, not gauges (budget, resident, remote) or percentiles.
        for (k, v) in &after {
            if k.starts_with("pf_")
                && !k.contains("_us")
                && !["pf_budget_pages", "pf_resident_pages", "pf_remote_pages"]
                    .contains(&k.as_str())
            {
                *a.deltas.entry(k.clone()).or_default() +=
                    v.saturating_sub(before.get(k).copied().unwrap_or(0));
            }
        }
        a.last = after;
        Ok((n1 - n0) as f64 / secs)
    }

    /// The sampling hand's cost on this guest itself: under one load, its
    /// hand is switched on (SIGUSR2) and off (SIGUSR1) between adjacent
    /// short windows, `pairs` times, on-off and off-on in turn so that a
    /// drift across a pair cancels out. Slices of two guest processes
    /// differ by a few percent whatever they run (memory placement,
    /// connections); one process toggled leaves only the hand between
    /// its windows.
    fn toggle_sampling(&mut self, pairs: usize) -> Result<()> {
        self.signal(libc::SIGCONT)?;
        let l = kvload::Load::start_seeded(&self.spec, 7_777);
        std::thread::sleep(LEAD);
        let mut out = Vec::with_capacity(pairs);
        let mut failed = None;
        'pairs: for i in 0..pairs {
            let mut rate = [0.0f64; 2];
            let order = if i % 2 == 0 { [1, 0] } else { [0, 1] };
            for on in order {
                if let Err(e) = self.signal(if on == 1 {
                    libc::SIGUSR2
                } else {
                    libc::SIGUSR1
                }) {
                    failed = Some(e);
                    break 'pairs;
                }
                // What the last window's state left behind (pages unmapped
                // just before the hand stopped) settles first.
                std::thread::sleep(TOGGLE_SETTLE);
                let (n0, t0) = (l.counters.ops.load(Relaxed), Instant::now());
                std::thread::sleep(TOGGLE_WINDOW);
                rate[on] = (l.counters.ops.load(Relaxed) - n0) as f64 / t0.elapsed().as_secs_f64();
            }
            out.push((rate[1], rate[0]));
        }
        let error = l.error();
        let bad = l.counters.bad_values.load(Relaxed);
        l.stop()?;
        let _ = self.signal(libc::SIGUSR2);
        self.signal(libc::SIGSTOP)?;
        if let Some(e) = failed {
            return Err(e);
        }
        if let Some(e) = error {
            bail!("the kv load failed: {e}");
        }
        if bad > 0 {
            bail!("{bad} gets returned a wrong value");
        }
        self.acc.toggled = out;
        Ok(())
    }

    fn finish(self, group: &str) -> Row {
        let a = &self.acc;
        let secs = a.secs.max(1e-9);
        let d = |k: &str| a.deltas.get(k).copied().unwrap_or(0) as f64 / secs;
        let paged = matches!(self.cfg.kind, Kind::Region | Kind::Floor)
            && a.deltas.get("pf_page_ins").is_some_and(|&n| n > 0);
        let n = a.busy.len().max(1) as f64;
        let cpu_busy = (0..a.busy.first().map_or(0, Vec::len))
            .map(|i| {
                a.busy
                    .iter()
                    .map(|b| b.get(i).copied().unwrap_or(0.0))
                    .sum::<f64>()
                    / n
            })
            .collect();
        let row = Row {
            group: group.into(),
            cfg: self.cfg.clone(),
            ops_per_sec: a.ops as f64 / secs,
            rounds: a.rounds.clone(),
            ratio_to_local: 0.0,
            page_ins_per_sec: if matches!(self.cfg.kind, Kind::Region | Kind::Floor) {
                d("pf_page_ins")
            } else {
                a.swapins as f64 / secs
            },
            page_outs_per_sec: d("pf_page_outs"),
            clean_drops_per_sec: d("pf_clean_drops"),
            sampling_faults_per_sec: d("pf_minor_faults"),
            guest_faults_per_sec: a.minflt as f64 / secs,
            fault_p50_us: paged.then(|| a.last["pf_page_in_p50_us"] as f64),
            fault_p99_us: paged.then(|| a.last["pf_page_in_p99_us"] as f64),
            region_deltas: a.deltas.clone(),
            zram_compression: (self.cfg.kind == Kind::Zram).then(zram_ratio).flatten(),
            seq_page_in_gbps: None,
            cpu_busy,
            toggled: a.toggled.clone(),
            error: None,
        };
        // Explicit teardown order: the guest first, then what it paged to.
        let Member {
            guest,
            store,
            cg,
            swap,
            servers,
            ..
        } = self;
        drop(guest);
        drop(store);
        drop(cg);
        drop(swap);
        drop(servers);
        row
    }
}

/// Connections that never authenticate, held on the configuration's first
/// memory server while its guest pages (they must cost it nothing).
pub(super) fn strangers(c: &Cfg, addrs: &[String]) -> Result<Vec<TcpStream>> {
    match (c.strangers, addrs.first()) {
        (0, _) | (_, None) => Ok(Vec::new()),
        (n, Some(a)) => {
            util::allow_fds(n as u64 + 1024);
            Ok((0..n)
                .map(|_| TcpStream::connect(a))
                .collect::<std::io::Result<_>>()?)
        }
    }
}

/// Run one group of kv configurations interleaved: `o.measure_secs` (times
/// the group's `rounds_per_sec`) rounds of one slice each. A configuration that fails is reported in its row and
/// left out of the rounds after.
pub(super) fn run_group(
    o: &Opts,
    g: &Group,
    keys: u64,
    secret_path: &Path,
    log: Log<'_>,
) -> Vec<Row> {
    let mut members: Vec<std::result::Result<Member, (Cfg, String)>> = Vec::new();
    for c in &g.cfgs {
        log(&format!("{}: {} (set up, fill, warm up)", g.name, c.name));
        members.push(
            Member::start(o, c, keys, secret_path).map_err(|e| (c.clone(), format!("{e:#}"))),
        );
    }
    let rounds = o.measure_secs.max(1) as usize * g.rounds_per_sec;
    log(&format!("{}: {rounds} interleaved rounds", g.name));
    for r in 0..rounds {
        let order: Vec<usize> = if r % 2 == 0 {
            (0..members.len()).collect()
        } else {
            (0..members.len()).rev().collect()
        };
        for i in order {
            if let Ok(m) = &mut members[i] {
                if let Err(e) = m.slice(r) {
                    let cfg = m.cfg.clone();
                    // Dropping the member kills its guest and servers.
                    members[i] = Err((cfg, format!("{e:#}")));
                }
            }
        }
    }
    // The sampling group: the hand toggled on its own guest, 15 pairs per
    // measured second asked for (0.8 s a pair).
    if let Some(Ok(m)) = members
        .iter_mut()
        .find(|m| m.as_ref().is_ok_and(|m| m.cfg.name == SAMPLING_ONLY))
    {
        let pairs = o.measure_secs.max(1) as usize * 15;
        log(&format!(
            "{}: sampling toggled on one guest, {pairs} pairs",
            g.name
        ));
        if let Err(e) = m.toggle_sampling(pairs) {
            log(&format!("toggling the sampling hand failed: {e:#}"));
        }
    }
    let mut rows: Vec<Row> = members
        .into_iter()
        .map(|m| match m {
            Ok(m) => m.finish(g.name),
            Err((cfg, e)) => Row::failed(g.name, cfg, e),
        })
        .collect();
    let local = rows
        .iter()
        .find(|r| r.cfg.kind == Kind::Local && r.error.is_none())
        .map(|r| r.ops_per_sec);
    if let Some(local) = local {
        for r in &mut rows {
            r.ratio_to_local = r.ops_per_sec / local.max(1e-9);
        }
    }
    rows
}
