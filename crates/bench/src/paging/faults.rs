//! One fault, one page: single 4 KiB fault latency, CPU per page-in and
//! the sequential scan's page-in rate, each beside the floor program that
//! does only the unavoidable work (raw userfaultfd + a raw TCP page store).

use super::*;

/// Bytes in a page.
const PAGE: usize = pagefleet_region::PAGE;

fn percentiles(mut v: Vec<f64>, what: &str) -> FaultLat {
    let n = v.len();
    let p50 = util::percentile(&mut v, 50.0);
    let p99 = util::percentile(&mut v, 99.0);
    FaultLat {
        what: what.into(),
        p50_us: p50,
        p99_us: p99,
        samples: n,
    }
}

/// Single 4 KiB fault latency: raw uffd round trips, raw TCP round trips
/// and pagefleet page-ins, measured in interleaved batches (this machine's
/// speed drifts between seconds; the goal compares their p50s).
pub(super) fn fault_latencies(
    o: &Opts,
    secret_path: &Path,
    secret: &Secret,
) -> Result<Vec<FaultLat>> {
    const BATCHES: usize = 8;
    let two = util::ncpus() >= 2;
    let per = o.fault_iters.div_ceil(BATCHES);
    let raw = RawServer::start()?;
    // pagefleet: a page-in of one remote page (chunk 1), nothing else going on.
    let d = util::ChildDaemon::start(256 << 20, secret_path)?;
    let pages = 16384u64;
    let r = all_remote_region(&d, pages, secret)?;
    let base = r.as_ptr();
    // The floor of the whole fault: raw uffd and raw TCP in one handler.
    let floor = FloorHandler::start(o.fault_iters as u64 + 16)?;
    let (mut uffd, mut tcp, mut pf, mut fl) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut next, mut next_floor) = (0u64, 0usize);
    for b in 0..BATCHES {
        let mut order = [0, 1, 2, 3];
        if b % 2 == 1 {
            order.reverse();
        }
        for k in order {
            match k {
                // Raw uffd: MISSING fault resolved by a handler thread with UFFDIO_COPY.
                0 => uffd.extend(raw_uffd(per, two)?),
                // Raw TCP: 40-byte request, 4121-byte reply (our GET's sizes).
                1 => {
                    let pin = util::Pinning::split(&[raw.child.id()]);
                    tcp.extend(raw.rtt(b'G', per)?);
                    drop(pin);
                }
                // The floor program: faulting thread and page store on CPU
                // 0, its handler on CPU 1 (as pagefleet's below).
                2 => {
                    if two {
                        util::set_affinity(0, &[0]);
                    }
                    for _ in 0..per {
                        let p = next_floor;
                        next_floor += 1;
                        let t = Instant::now();
                        // SAFETY: inside the floor's mapping (fault_iters + 16 pages).
                        let x = unsafe {
                            std::ptr::read_volatile((floor.base() + p * PAGE) as *const u8)
                        };
                        fl.push(t.elapsed().as_secs_f64() * 1e6);
                        // (The raw store's replies are all 2s.)
                        if x != 2 {
                            bail!("the floor's page {p} came back as {x}");
                        }
                    }
                    if two {
                        let all: Vec<usize> = (0..util::ncpus()).collect();
                        util::set_affinity(0, &all);
                    }
                }
                _ => {
                    if two {
                        util::set_affinity(0, &[0]);
                        util::set_affinity(r.pager_tid(), &[1]);
                        util::set_process_affinity(d.child.id(), &[0]);
                    }
                    let before = r.stats().page_ins;
                    let mut v = Vec::with_capacity(per);
                    for _ in 0..per {
                        if next >= pages - 128 {
                            break;
                        }
                        let p = (next * 7919 + 64) % pages;
                        next += 1;
                        let t = Instant::now();
                        // SAFETY: inside the region.
                        let x = unsafe {
                            std::ptr::read_volatile(base.add(p as usize * PAGE) as *const u64)
                        };
                        v.push(t.elapsed().as_secs_f64() * 1e6);
                        if x != p {
                            bail!("page {p} came back as {x}");
                        }
                    }
                    let ins = r.stats().page_ins - before;
                    if two {
                        let all: Vec<usize> = (0..util::ncpus()).collect();
                        util::set_affinity(0, &all);
                    }
                    // Only page-ins count (a page that happened to stay
                    // resident is not a fault).
                    v.sort_by(|a, b| a.total_cmp(b));
                    pf.extend(v.split_off(v.len().saturating_sub(ins as usize)));
                }
            }
        }
    }
    drop(r);
    drop(raw);
    drop(floor);
    Ok(vec![
        percentiles(uffd, "raw uffd round trip"),
        percentiles(tcp, "raw TCP 4 KiB round trip"),
        percentiles(fl, FLOOR_FAULT),
        percentiles(pf, "pagefleet page-in"),
    ])
}

/// CPU time all threads of process `pid` have run, ns (schedstat).
fn process_cpu_ns(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

fn per_page(what: &str, pages: u64, guest_ns: u64, server_ns: u64) -> CpuPerPage {
    let g = guest_ns as f64 / 1e3 / pages.max(1) as f64;
    let s = server_ns as f64 / 1e3 / pages.max(1) as f64;
    CpuPerPage {
        what: what.into(),
        pages,
        guest_us: g,
        server_us: s,
        total_us: g + s,
    }
}

/// CPU per page-in, both ends: the floor program (a uffd handler thread
/// that asks a raw TCP server for the faulting pages, 40-byte requests,
/// 4121-byte replies, all requests of a batch before their replies, and
/// installs them) against a pagefleet region (chunk 1, no sampling) paging
/// from pagefleetd, the same pages touched in the same scattered order:
/// by one thread, then by 16 at once (as the kv guest's threads fault),
/// the faulting side on CPU 1 and the server on CPU 0 as in the kv runs.
pub(super) fn cpu_per_page_in(
    o: &Opts,
    secret_path: &Path,
    secret: &Secret,
) -> Result<Vec<CpuPerPage>> {
    let pages: u64 = if o.quick { 4096 } else { 32768 };
    let mut out = Vec::new();
    let think = Work::calibrate(SPACED_WORK);
    for (threads, think) in [(1usize, None), (16, None), (16, Some(think))] {
        let tag = match (threads, think) {
            (1, _) => String::new(),
            (t, None) => format!(", {t} threads"),
            (t, Some(_)) => format!(
                ", {t} threads, {} us of work between faults",
                SPACED_WORK.as_micros()
            ),
        };
        // Floor and pagefleet in alternating quarters (this machine's speed
        // drifts between seconds; the goal is their ratio).
        let (mut floor, mut pf) = (Vec::new(), Vec::new());
        for k in 0..CPU_BATCHES {
            let part = pages / CPU_BATCHES;
            let f = || floor_cpu(part, threads, think, &tag);
            let p = || pagefleet_cpu(part, threads, think, &tag, secret_path, secret);
            if k % 2 == 0 {
                floor.push(f()?);
                pf.push(p()?);
            } else {
                pf.push(p()?);
                floor.push(f()?);
            }
        }
        out.push(combine(floor));
        out.push(combine(pf));
    }
    Ok(out)
}

/// Batches of the CPU per page-in measurement, floor and pagefleet alternating.
const CPU_BATCHES: u64 = 4;

/// The single-fault row of the floor program (`FloorHandler`).
pub(super) const FLOOR_FAULT: &str = "floor: raw uffd + raw TCP in one handler";

/// Batches of one CPU per page-in measurement as one (per page over all).
fn combine(parts: Vec<CpuPerPage>) -> CpuPerPage {
    let pages: u64 = parts.iter().map(|c| c.pages).sum();
    let sum = |f: fn(&CpuPerPage) -> f64| {
        parts.iter().map(|c| f(c) * c.pages as f64).sum::<f64>() / pages.max(1) as f64
    };
    let (guest_us, server_us) = (sum(|c| c.guest_us), sum(|c| c.server_us));
    CpuPerPage {
        what: parts.first().map(|c| c.what.clone()).unwrap_or_default(),
        pages,
        guest_us,
        server_us,
        total_us: guest_us + server_us,
    }
}

/// CPU work each faulting thread does between two faults in the spaced
/// rows: the kv guest's CPU per operation all local (~9 µs here) over its
/// page-ins per operation at 25% (0.14, zram's and pagefleet's alike), so
/// faults come one at a time as they do under the kv load, not in the
/// bursts of 16 that the plain 16-thread rows measure.
const SPACED_WORK: Duration = Duration::from_micros(60);

/// A fixed amount of CPU work (a calibrated loop), the same whether or not
/// the thread is preempted meanwhile.
#[derive(Clone, Copy, Debug)]
struct Work {
    iters: u64,
}

impl Work {
    fn calibrate(d: Duration) -> Work {
        let probe = Work { iters: 1 << 22 };
        let t = Instant::now();
        probe.run();
        let per = t.elapsed().as_secs_f64() / probe.iters as f64;
        Work {
            iters: (d.as_secs_f64() / per.max(1e-12)) as u64,
        }
    }

    fn run(self) {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..self.iters {
            x = std::hint::black_box(x.rotate_left(7) ^ 0x5851_f42d_4c95_7f2d);
        }
        std::hint::black_box(x);
    }
}

/// Touch every page of `base..` once, `threads` threads taking every
/// `threads`-th page of the scattered order, pinned to CPU 1 when there are
/// 2 CPUs, doing `think` work after each touch; `check` sees each page's
/// first word.
fn touch_all(
    base: usize,
    pages: u64,
    threads: usize,
    think: Option<Work>,
    check: impl Fn(u64, u64) -> Result<()> + Sync,
) -> Result<()> {
    let order = |i: u64| (i * 7919) % pages;
    let two = util::ncpus() >= 2;
    std::thread::scope(|sc| {
        let hs: Vec<_> = (0..threads)
            .map(|t| {
                let check = &check;
                sc.spawn(move || -> Result<()> {
                    if two {
                        util::set_affinity(0, &[1]);
                    }
                    for i in (t as u64..pages).step_by(threads) {
                        let p = order(i);
                        // SAFETY: inside the caller's mapping of `pages` pages.
                        let x = unsafe {
                            std::ptr::read_volatile((base + p as usize * PAGE) as *const u64)
                        };
                        check(p, x)?;
                        if let Some(w) = think {
                            w.run();
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        hs.into_iter().try_for_each(|h| {
            h.join()
                .map_err(|_| anyhow::anyhow!("a toucher panicked"))?
        })
    })
}

/// The CPU of `touch` (guest side, server side), minus that of the same
/// touches again with every page resident when there is work between
/// them: what the faults cost.
fn fault_cpu(
    me: u32,
    server: u32,
    think: Option<Work>,
    touch: impl Fn() -> Result<()>,
) -> Result<(u64, u64)> {
    let (g0, s0) = (process_cpu_ns(me), process_cpu_ns(server));
    touch()?;
    let (g1, s1) = (process_cpu_ns(me), process_cpu_ns(server));
    let (mut g, s) = (g1 - g0, s1 - s0);
    if think.is_some() {
        let g2 = process_cpu_ns(me);
        touch()?;
        g = g.saturating_sub(process_cpu_ns(me) - g2);
    }
    Ok((g, s))
}

/// The sequential scan's floor: only the unavoidable work of paging a scan
/// in at a 25% budget. One thread reads one word per page of a memfd
/// mapping registered with userfaultfd (as `synthetic --dist seq` does); a
/// handler thread on the same CPU (the bench pins the guest process to
/// CPU 1) asks the raw TCP server (CPU 0) for the faulting page's window — as
/// many pages as pagefleet's read-ahead cap, one 8-byte request, the pages
/// back in one bulk reply with no header — and asks for the next window at
/// once (one window always in flight ahead of the scanner), installs the
/// window with one `UFFDIO_COPY`, and punches the oldest window out of the
/// memfd once over the budget. Returns GB/s paged in.
pub(super) fn seq_floor(o: &Opts) -> Result<f64> {
    use pagefleet_uffd as uffd;
    let pages = o.size / (PAGE as u64);
    let budget = pages / 4;
    let window = (budget / 16).clamp(1, 1024);
    let raw = RawServer::start()?;
    let two = util::ncpus() >= 2;
    if two {
        util::set_process_affinity(raw.child.id(), &[0]);
    }
    let (fd, m, u) = floor_mapping("seq-floor", pages)?;
    let (fd, u) = (Arc::new(fd), Arc::new(u));
    let mut conn = raw.connect(b'W', 0)?;
    let base = m.base();
    let stop = Arc::new(AtomicBool::new(false));
    let paged = Arc::new(AtomicU64::new(0));
    let (u2, s2, fd2, n2) = (u.clone(), stop.clone(), fd.clone(), paged.clone());
    let handler = std::thread::spawn(move || -> std::io::Result<()> {
        if two {
            util::set_affinity(0, &[1]);
        }
        let r = (|| -> std::io::Result<()> {
            let mut rep = vec![0u8; PAGE * window as usize];
            let mut here = vec![false; pages as usize];
            // The window asked for ahead, its reply next on the stream.
            let mut ahead: Option<(u64, u64)> = None;
            let len = |p: u64| window.min(pages - p);
            // One UFFDIO_COPY for the window; page by page if some page of it
            // is there already (a whole-range copy stops at the first).
            let install = |a: u64, data: &[u8]| {
                if u2.copy(base + a * (PAGE as u64), data, false).is_err() {
                    for (i, pg) in data.chunks(PAGE).enumerate() {
                        let _ = u2.copy(base + (a + i as u64) * (PAGE as u64), pg, false);
                    }
                }
            };
            let mut windows: std::collections::VecDeque<(u64, u64)> = Default::default();
            let mut resident = 0u64;
            let mut fs = Vec::new();
            while !s2.load(Relaxed) {
                if !u2.poll(5).unwrap_or(false) {
                    continue;
                }
                fs.clear();
                let _ = u2.read_faults(&mut fs, 16);
                for f in &fs {
                    let p = (f.addr - base) / (PAGE as u64);
                    if here[p as usize] {
                        let _ = u2.wake(f.addr & !(PAGE as u64 - 1), PAGE as u64);
                        continue;
                    }
                    // The reply in flight is for another window: take it in
                    // (its pages are good) before asking for this one.
                    let (p, k) = match ahead.take() {
                        Some((a, k)) if a == p => (a, k),
                        other => {
                            if let Some((a, k)) = other {
                                std::io::Read::read_exact(
                                    &mut conn,
                                    &mut rep[..PAGE * k as usize],
                                )?;
                                install(a, &rep[..PAGE * k as usize]);
                                here[a as usize..(a + k) as usize].fill(true);
                                windows.push_back((a, k));
                                resident += k;
                                n2.fetch_add(k, Relaxed);
                            }
                            if here[p as usize] {
                                let _ = u2.wake(f.addr & !(PAGE as u64 - 1), PAGE as u64);
                                continue;
                            }
                            conn.write_all(&len(p).to_le_bytes())?;
                            (p, len(p))
                        }
                    };
                    let next = (p + k) % pages;
                    conn.write_all(&len(next).to_le_bytes())?;
                    ahead = Some((next, len(next)));
                    std::io::Read::read_exact(&mut conn, &mut rep[..PAGE * k as usize])?;
                    install(p, &rep[..PAGE * k as usize]);
                    here[p as usize..(p + k) as usize].fill(true);
                    windows.push_back((p, k));
                    resident += k;
                    n2.fetch_add(k, Relaxed);
                    while resident > budget {
                        let Some((q, c)) = windows.pop_front() else {
                            break;
                        };
                        uffd::punch_hole(&fd2, q * (PAGE as u64), c * (PAGE as u64))?;
                        here[q as usize..(q + c) as usize].fill(false);
                        resident -= c;
                    }
                }
            }
            Ok(())
        })();
        // Failed: keep the scanner going (zero pages) until it stops, so
        // it never waits on a fault nobody serves.
        if r.is_err() {
            while !s2.load(Relaxed) {
                if u2.poll(5).unwrap_or(false) {
                    fs_drain(&u2, base);
                }
            }
        }
        r
    });
    let secs = o.measure_secs.clamp(1, 10);
    let scanned = std::thread::scope(|sc| {
        sc.spawn(|| {
            if two {
                util::set_affinity(0, &[1]);
            }
            let t = Instant::now();
            let p0 = paged.load(Relaxed);
            let mut p = 0u64;
            while t.elapsed() < Duration::from_secs(secs) {
                for _ in 0..256 {
                    // SAFETY: inside the mapping of `pages` pages.
                    std::hint::black_box(unsafe {
                        std::ptr::read_volatile((base + p * (PAGE as u64)) as *const u64)
                    });
                    p = (p + 1) % pages;
                }
            }
            (paged.load(Relaxed) - p0, t.elapsed())
        })
        .join()
    });
    stop.store(true, Relaxed);
    let handled = handler.join();
    let (n, el) = scanned.map_err(|_| anyhow::anyhow!("the floor's scanner panicked"))?;
    handled
        .map_err(|_| anyhow::anyhow!("the floor's fault handler panicked"))?
        .context("the floor's fault handler")?;
    Ok(util::gbps(n * (PAGE as u64), el))
}

/// Serve every queued fault with a zero page (a floor program that failed).
fn fs_drain(u: &pagefleet_uffd::Uffd, base: u64) {
    let mut fs = Vec::new();
    let _ = u.read_faults(&mut fs, 64);
    for f in &fs {
        let _ = u.zeropage((f.addr & !(PAGE as u64 - 1)).max(base), PAGE as u64);
    }
}

fn floor_cpu(pages: u64, threads: usize, think: Option<Work>, tag: &str) -> Result<CpuPerPage> {
    let me = std::process::id();
    let floor = FloorHandler::start(pages)?;
    let server = floor.raw.child.id();
    let touched = fault_cpu(me, server, think, || {
        touch_all(floor.base(), pages, threads, think, |_, _| Ok(()))
    });
    drop(floor);
    let (g, sv) = touched?;
    Ok(per_page(
        &format!("floor: raw uffd + raw TCP{tag}"),
        pages,
        g,
        sv,
    ))
}

/// The floor program of a page-in: a memfd mapping registered with
/// userfaultfd and one handler thread (CPU 1) that, for the faults it
/// reads, sends a 40-byte request each to the raw TCP page store (CPU 0),
/// reads the 4121-byte replies and installs their pages with
/// `UFFDIO_COPY` — what any userfaultfd pager must do for a remote page,
/// and nothing else.
struct FloorHandler {
    raw: RawServer,
    m: pagefleet_uffd::Mapping,
    stop: Arc<AtomicBool>,
    handler: Option<std::thread::JoinHandle<std::io::Result<()>>>,
}

impl FloorHandler {
    fn start(pages: u64) -> Result<FloorHandler> {
        let raw = RawServer::start()?;
        let two = util::ncpus() >= 2;
        if two {
            util::set_process_affinity(raw.child.id(), &[0]);
        }
        let (_fd, m, u) = floor_mapping("floor", pages)?;
        let mut conn = raw.connect(b'G', 0)?;
        let stop = Arc::new(AtomicBool::new(false));
        let s2 = stop.clone();
        let handler = std::thread::spawn(move || -> std::io::Result<()> {
            if two {
                util::set_affinity(0, &[1]);
            }
            let req = [1u8; crate::memserver::GET_REQ];
            let mut rep = vec![0u8; crate::memserver::GET_REP];
            let mut fs = Vec::new();
            while !s2.load(Relaxed) {
                if u.poll(5).unwrap_or(false) {
                    fs.clear();
                    let _ = u.read_faults(&mut fs, 16);
                    for _ in &fs {
                        conn.write_all(&req)?;
                    }
                    for f in &fs {
                        std::io::Read::read_exact(&mut conn, &mut rep)?;
                        let _ = u.copy(f.addr & !(PAGE as u64 - 1), &rep[..PAGE], false);
                    }
                }
            }
            Ok(())
        });
        Ok(FloorHandler {
            raw,
            m,
            stop,
            handler: Some(handler),
        })
    }

    fn base(&self) -> usize {
        self.m.base() as usize
    }
}

impl Drop for FloorHandler {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
        if let Some(h) = self.handler.take() {
            let _ = h.join();
        }
    }
}

fn pagefleet_cpu(
    pages: u64,
    threads: usize,
    think: Option<Work>,
    tag: &str,
    secret_path: &Path,
    secret: &Secret,
) -> Result<CpuPerPage> {
    let me = std::process::id();
    let d = util::ChildDaemon::start(pages * (PAGE as u64) + (64 << 20), secret_path)?;
    let r = all_remote_region(&d, pages, secret)?;
    if util::ncpus() >= 2 {
        util::set_process_affinity(d.child.id(), &[0]);
        util::set_affinity(r.pager_tid(), &[1]);
    }
    let ins0 = r.stats().page_ins;
    let (g, sv) = fault_cpu(me, d.child.id(), think, || {
        touch_all(r.as_ptr() as usize, pages, threads, think, |p, x| {
            if x != p {
                bail!("page {p} came back as {x}");
            }
            Ok(())
        })
    })?;
    let ins = r.stats().page_ins - ins0;
    drop(r);
    Ok(per_page(&format!("pagefleet page-in{tag}"), ins, g, sv))
}

/// A region of `pages` (chunk 1, no sampling) paging to `d`, each page
/// holding its number, with all but 64 pages sent out, and a budget that
/// lets every page come back: each first touch is one page-in.
fn all_remote_region(
    d: &util::ChildDaemon,
    pages: u64,
    secret: &Secret,
) -> Result<pagefleet_region::Region> {
    let mut cfg = pagefleet_region::Config::new(pages * (PAGE as u64), 64);
    cfg.servers = vec![d.addr.clone()];
    cfg.secret = Some(secret.clone());
    cfg.chunk_pages = 1;
    cfg.sample_cpu_budget = 0.0;
    let r = pagefleet_region::Region::new(cfg)?;
    let base = r.as_ptr();
    for p in 0..pages {
        // SAFETY: inside the region.
        unsafe { std::ptr::write_volatile(base.add(p as usize * PAGE) as *mut u64, p) };
    }
    let t = Instant::now();
    while r.stats().resident_pages > 64 && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(5));
    }
    r.set_budget(pages);
    Ok(r)
}

fn raw_uffd(iters: usize, two: bool) -> Result<Vec<f64>> {
    let pages = iters + 16;
    let (_fd, m, u) = floor_mapping("raw-uffd", pages as u64)?;
    let u = Arc::new(u);
    let stop = Arc::new(AtomicBool::new(false));
    let (u2, s2) = (u.clone(), stop.clone());
    let h = std::thread::spawn(move || {
        if two {
            util::set_affinity(0, &[1]);
        }
        let src = vec![7u8; PAGE];
        let mut fs = Vec::new();
        while !s2.load(Relaxed) {
            if u2.poll(5).unwrap_or(false) {
                fs.clear();
                let _ = u2.read_faults(&mut fs, 16);
                for f in &fs {
                    let _ = u2.copy(f.addr & !(PAGE as u64 - 1), &src, false);
                }
            }
        }
    });
    if two {
        util::set_affinity(0, &[0]);
    }
    std::thread::sleep(Duration::from_millis(20));
    let mut v = Vec::with_capacity(iters);
    for i in 0..iters {
        let t = Instant::now();
        // SAFETY: inside the mapping.
        let x = unsafe { std::ptr::read_volatile(m.addr().add(i * PAGE)) };
        v.push(t.elapsed().as_secs_f64() * 1e6);
        if x != 7 {
            bail!("raw uffd page has wrong contents");
        }
    }
    stop.store(true, Relaxed);
    let _ = h.join();
    if two {
        let all: Vec<usize> = (0..util::ncpus()).collect();
        util::set_affinity(0, &all);
    }
    Ok(v)
}

/// A floor program's memory: a memfd of `pages` mapped shared, THP off (as
/// a region's), registered for MISSING faults on a userfaultfd.
fn floor_mapping(
    name: &str,
    pages: u64,
) -> Result<(
    std::os::fd::OwnedFd,
    pagefleet_uffd::Mapping,
    pagefleet_uffd::Uffd,
)> {
    use pagefleet_uffd as uffd;
    let fd = uffd::memfd(name, pages * (PAGE as u64))?;
    let m = uffd::Mapping::shared(&fd, (pages * (PAGE as u64)) as usize)?;
    m.madvise(0, m.len(), libc::MADV_NOHUGEPAGE)?;
    let u = uffd::Uffd::open(uffd::FEATURE_MISSING_SHMEM)?;
    // SAFETY: a mapping made here for the measurement, reached only by raw pointers.
    unsafe { u.register(m.base(), m.len() as u64, uffd::MODE_MISSING) }?;
    Ok((fd, m, u))
}
