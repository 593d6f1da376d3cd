//! Bringing the tenants' swapped-out mergeable pages back in, so that ksmd
//! can merge them.
//!
//! ksmd looks only at pages mapped in page tables: an anonymous page in swap
//! is skipped. Under a memory limit the tenants' cold pages sit in swap,
//! duplicates among them, and nothing brings them back: no client touches
//! them, and ksmd cannot see them (`pagefleet bench ksm` saw a run end with
//! 45 MiB of duplicates in swap and its memory cgroup 100 MiB short of its
//! limit). Once merging has made room, the adaptive controller sweeps: it
//! reads the swapped pages of every mergeable area (`VmFlags: mg` in
//! `/proc/PID/smaps`) with `process_vm_readv`, which faults them in, in the
//! tenant's own page tables and charged to its own memory cgroup, as the
//! tenant's own touch would; then ksmd can merge them.
//!
//! Merging what a sweep brought costs ksmd two passes over all the
//! mergeable memory (a page it has not seen is only checksummed on its
//! first), so a sweep also says how much of what it read could merge: it
//! hashes every page it reads, and a page whose content it already read
//! in this sweep is a duplicate (`pagefleet bench ksm` saw a sweep bring
//! 25 MiB of unique pages back and ksmd spend 1.2 CPU-seconds, a fifth of
//! its whole run, finding nothing in them). Duplicates of pages that stayed
//! resident are not counted: the estimate is low, never high, but for
//! hash collisions (xxh3, 64 bits).
//!
//! A sweep takes no more than the room there is: before every batch of
//! [`BATCH_PAGES`] it reads the tenant's memory cgroup (limit less usage,
//! less a margin of 1/16 of the limit and at least [`MARGIN_MIN`]) and the
//! host's MemAvailable (less [`HOST_RESERVE`] of MemTotal), and a tenant
//! whose cgroup is full is left there (a swap-in past the limit would only
//! push another page out). It works in slices the caller times (the
//! controller gives it part of each tick) and is not resumed once the
//! controller has moved on.
//!
//! Ownership: the controller's thread owns a [`Sweep`] and everything in
//! it; nothing crosses threads. Costs: finding the areas reads
//! `/proc/PID/status` of every process and `smaps` of the few with pages in
//! swap; per batch, one `PAGEMAP_SCAN` of the area (page tables only), two
//! or three small cgroup files, and the swap-in itself, whose I/O dominates.

use crate::sysfs::{Memory, PAGE};
use std::collections::{HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Pages read per `process_vm_readv`, and between two looks at the room
/// (1 MiB: the room can be off by at most this much).
pub const BATCH_PAGES: u64 = 256;
/// The least room a tenant's memory cgroup keeps (its own allocations
/// must not meet a limit the sweep filled).
pub const MARGIN_MIN: u64 = 8 << 20;
/// Share of MemTotal the host keeps available.
pub const HOST_RESERVE: f64 = 0.05;
/// Bytes of an area one `PAGEMAP_SCAN` looks at for swapped pages (64 MiB:
/// a scan with nothing to report costs little, and one that stops at its
/// first run never walks a whole large area for one batch).
const WINDOW: u64 = 64 << 20;

/// A mergeable area of a process with pages in swap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Area {
    /// The process.
    pub pid: u32,
    /// First byte (page-aligned).
    pub start: u64,
    /// End (exclusive, page-aligned).
    pub end: u64,
    /// Its pages in swap when found.
    pub swap_pages: u64,
}

/// The mergeable areas with pages in swap, from the text of
/// `/proc/PID/smaps`.
pub fn parse_smaps(pid: u32, smaps: &str) -> Vec<Area> {
    let mut out = Vec::new();
    let mut cur: Option<(u64, u64)> = None;
    let mut swap_kb = 0u64;
    let close = |cur: Option<(u64, u64)>, swap_kb: u64, mergeable: bool, out: &mut Vec<Area>| {
        if let (Some((start, end)), true) = (cur, mergeable && swap_kb > 0) {
            out.push(Area {
                pid,
                start,
                end,
                swap_pages: swap_kb * 1024 / PAGE,
            });
        }
    };
    for l in smaps.lines() {
        // An area's header: "START-END PERMS OFFSET DEV INODE [NAME]".
        if let Some((range, _)) = l.split_once(' ') {
            if let Some((a, b)) = range.split_once('-') {
                if let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) {
                    cur = Some((a, b));
                    swap_kb = 0;
                    continue;
                }
            }
        }
        if let Some(v) = l.strip_prefix("Swap:") {
            swap_kb = v.trim().trim_end_matches("kB").trim().parse().unwrap_or(0);
        } else if let Some(flags) = l.strip_prefix("VmFlags:") {
            // VmFlags is an area's last line.
            close(
                cur.take(),
                swap_kb,
                flags.split_whitespace().any(|f| f == "mg"),
                &mut out,
            );
        }
    }
    out
}

/// Pages in swap of process `pid` (`VmSwap` in its status).
fn swapped_pages(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmSwap:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024 / PAGE)
}

/// Every process's mergeable areas with pages in swap.
pub fn find_areas() -> Vec<Area> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in dir.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if pid == std::process::id() || swapped_pages(pid) == 0 {
            continue;
        }
        if let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/smaps")) {
            out.extend(parse_smaps(pid, &s));
        }
    }
    out
}

/// Where a process's memory cgroup keeps its limit and usage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cgroup {
    /// cgroup v1: the memory controller's directory.
    V1(PathBuf),
    /// cgroup v2: the unified hierarchy's directory.
    V2(PathBuf),
}

impl Cgroup {
    /// From the text of `/proc/PID/cgroup`, the hierarchies mounted at
    /// `root` (`/sys/fs/cgroup`). None: in no memory cgroup.
    pub fn parse(proc_cgroup: &str, root: &Path) -> Option<Cgroup> {
        let mut v2 = None;
        for l in proc_cgroup.lines() {
            let mut f = l.splitn(3, ':');
            let (_, ctrl, path) = (f.next()?, f.next()?, f.next()?);
            let rel = path.trim_start_matches('/');
            if ctrl.split(',').any(|c| c == "memory") {
                return Some(Cgroup::V1(root.join("memory").join(rel)));
            }
            if ctrl.is_empty() {
                v2 = Some(Cgroup::V2(root.join(rel)));
            }
        }
        v2
    }

    /// Process `pid`'s memory cgroup.
    pub fn of(pid: u32) -> Option<Cgroup> {
        let s = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
        Cgroup::parse(&s, Path::new("/sys/fs/cgroup"))
    }

    /// Bytes it may still be charged: its limit less its usage (v1: the
    /// hierarchical limit; v2: the tightest of it and its ancestors). None:
    /// no limit (or unreadable).
    pub fn room(&self) -> Option<u64> {
        let num = |p: PathBuf| -> Option<u64> {
            let s = std::fs::read_to_string(p).ok()?;
            let s = s.trim();
            if s == "max" {
                return None;
            }
            s.parse::<u64>().ok().filter(|&v| v < 1 << 60)
        };
        match self {
            Cgroup::V1(d) => {
                let own = num(d.join("memory.limit_in_bytes"));
                let hier = std::fs::read_to_string(d.join("memory.stat"))
                    .ok()
                    .and_then(|s| {
                        s.lines()
                            .find_map(|l| l.strip_prefix("hierarchical_memory_limit "))
                            .and_then(|v| v.trim().parse::<u64>().ok())
                    })
                    .filter(|&v| v < 1 << 60);
                let limit = match (own, hier) {
                    (Some(a), Some(b)) => a.min(b),
                    (a, b) => a.or(b)?,
                };
                let usage = num(d.join("memory.usage_in_bytes"))?;
                Some(room_after_margin(limit, usage))
            }
            Cgroup::V2(d) => {
                let mut best: Option<u64> = None;
                let mut dir = d.as_path();
                loop {
                    if let (Some(l), Some(u)) =
                        (num(dir.join("memory.max")), num(dir.join("memory.current")))
                    {
                        let r = room_after_margin(l, u);
                        best = Some(best.map_or(r, |b| b.min(r)));
                    }
                    match dir.parent() {
                        Some(p) if p.starts_with("/sys/fs/cgroup") && p != dir => dir = p,
                        _ => break,
                    }
                }
                best
            }
        }
    }
}

/// What a cgroup of `limit` bytes using `usage` may take in, keeping its
/// margin.
pub fn room_after_margin(limit: u64, usage: u64) -> u64 {
    let margin = (limit / 16).max(MARGIN_MIN);
    limit.saturating_sub(usage).saturating_sub(margin)
}

/// What the host may take in: MemAvailable less its reserve, bytes.
pub fn host_room(m: &Memory) -> u64 {
    let reserve = (m.total_kb as f64 * HOST_RESERVE) as u64;
    m.available_kb.saturating_sub(reserve) * 1024
}

/// Where a sweep stands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    /// Pages in swap in the areas found.
    pub found_pages: u64,
    /// Pages brought back in.
    pub brought_pages: u64,
    /// Pages brought back in whose content an earlier page of this sweep
    /// had: what merging them would free at least.
    pub duplicate_pages: u64,
    /// Areas left where their cgroup (or the host) had no room.
    pub full_areas: u64,
}

/// One sweep over the areas found when it began.
pub struct Sweep {
    areas: VecDeque<Area>,
    /// Where the first area's next batch starts.
    next: u64,
    /// The first area's process's page tables.
    pagemap: Option<(u32, pagefleet_uffd::Pagemap)>,
    buf: Vec<u8>,
    /// The content hashes of the pages read so far (8 bytes a page: at
    /// most 2 MiB per GiB brought in).
    seen: HashSet<u64>,
    progress: Progress,
}

impl Sweep {
    /// A sweep over `areas`.
    pub fn new(areas: Vec<Area>) -> Sweep {
        let found_pages = areas.iter().map(|a| a.swap_pages).sum();
        Sweep {
            next: areas.first().map_or(0, |a| a.start),
            areas: areas.into(),
            pagemap: None,
            buf: vec![0u8; (BATCH_PAGES * PAGE) as usize],
            seen: HashSet::new(),
            progress: Progress {
                found_pages,
                ..Progress::default()
            },
        }
    }

    /// Nothing left to do.
    pub fn is_done(&self) -> bool {
        self.areas.is_empty()
    }

    /// Where it stands.
    pub fn progress(&self) -> Progress {
        self.progress
    }

    fn next_area(&mut self) {
        self.areas.pop_front();
        self.next = self.areas.front().map_or(0, |a| a.start);
    }

    /// Work until `until` (or until done).
    pub fn step(&mut self, until: Instant) {
        while let Some(a) = self.areas.front().cloned() {
            if Instant::now() >= until {
                return;
            }
            if self.next >= a.end {
                self.next_area();
                continue;
            }
            if self.pagemap.as_ref().is_none_or(|(p, _)| *p != a.pid) {
                match pagefleet_uffd::Pagemap::open_pid(a.pid as i32) {
                    Ok(pm) => self.pagemap = Some((a.pid, pm)),
                    Err(_) => {
                        self.next_area();
                        continue;
                    }
                }
            }
            let pm = &mut self.pagemap.as_mut().expect("opened above").1;
            // The first run of swapped pages in the next window of the area.
            let (from, to) = (self.next, (self.next + WINDOW).min(a.end));
            let mut run: Option<(u64, u64)> = None;
            let scanned = pm.swapped(from, to - from, &mut |s, e| {
                if run.is_none() {
                    run = Some((from + s as u64 * PAGE, from + e as u64 * PAGE));
                }
            });
            if scanned.is_err() {
                self.next_area();
                continue;
            }
            let Some((rs, re)) = run else {
                self.next = to;
                continue;
            };
            let n = ((re - rs) / PAGE).min(BATCH_PAGES);
            let room = Cgroup::of(a.pid)
                .and_then(|c| c.room())
                .map_or(u64::MAX, |r| r)
                .min(host_room(&Memory::read().unwrap_or_default()));
            if room < n * PAGE {
                self.progress.full_areas += 1;
                self.next_area();
                continue;
            }
            let len = (n * PAGE) as usize;
            let got = match pagefleet_common::sys::process::read_process_memory(
                a.pid,
                rs,
                &mut self.buf[..len],
            ) {
                Ok(n) => n,
                Err(_) => {
                    // Gone, or the area changed under us: leave it.
                    self.next_area();
                    continue;
                }
            };
            let read = got / PAGE as usize * PAGE as usize;
            self.progress.brought_pages += read as u64 / PAGE;
            self.progress.duplicate_pages += count_duplicates(&mut self.seen, &self.buf[..read]);
            self.next = rs + (got as u64).max(PAGE).next_multiple_of(PAGE);
        }
    }
}

/// Adds the hash of every page of `pages` (whole pages) to `seen`; returns
/// how many were there already.
pub fn count_duplicates(seen: &mut HashSet<u64>, pages: &[u8]) -> u64 {
    pages
        .chunks_exact(PAGE as usize)
        .filter(|p| !seen.insert(xxhash_rust::xxh3::xxh3_64(p)))
        .count() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMAPS: &str = "\
55d0c0a00000-55d0c0b00000 rw-p 00000000 00:00 0                          [heap]
Size:               1024 kB
Rss:                 512 kB
Swap:                512 kB
VmFlags: rd wr mr mw me ac mg
7f0000000000-7f0000100000 rw-p 00000000 00:00 0
Size:               1024 kB
Swap:                256 kB
VmFlags: rd wr mr mw me ac
7f0000200000-7f0000300000 rw-p 00000000 00:00 0
Size:               1024 kB
Swap:                  0 kB
VmFlags: rd wr mr mw me ac mg
7f0000400000-7f0000500000 r--p 00000000 08:01 1234                       /usr/lib/libc.so.6
Swap:                  8 kB
VmFlags: rd mr mw me mg
";

    #[test]
    fn only_mergeable_areas_with_pages_in_swap_are_swept() {
        let a = parse_smaps(7, SMAPS);
        assert_eq!(
            a,
            vec![
                Area {
                    pid: 7,
                    start: 0x55d0c0a00000,
                    end: 0x55d0c0b00000,
                    swap_pages: 128
                },
                Area {
                    pid: 7,
                    start: 0x7f0000400000,
                    end: 0x7f0000500000,
                    swap_pages: 2
                },
            ]
        );
        assert!(parse_smaps(7, "").is_empty());
    }

    #[test]
    fn the_memory_cgroup_is_found_in_either_hierarchy() {
        let root = Path::new("/sys/fs/cgroup");
        let v1 = "12:pids:/x\n5:memory:/pagefleet-bench-1\n1:name=systemd:/user\n";
        assert_eq!(
            Cgroup::parse(v1, root),
            Some(Cgroup::V1(PathBuf::from(
                "/sys/fs/cgroup/memory/pagefleet-bench-1"
            )))
        );
        assert_eq!(
            Cgroup::parse("0::/system.slice/t.service\n", root),
            Some(Cgroup::V2(PathBuf::from(
                "/sys/fs/cgroup/system.slice/t.service"
            )))
        );
        assert_eq!(Cgroup::parse("3:cpu:/a\n", root), None);
    }

    #[test]
    fn room_keeps_a_margin_and_the_host_a_reserve() {
        const MIB: u64 = 1 << 20;
        // 1 GiB limit: a 64 MiB margin.
        assert_eq!(room_after_margin(1024 * MIB, 900 * MIB), 60 * MIB);
        assert_eq!(room_after_margin(1024 * MIB, 1000 * MIB), 0);
        // Small limits keep at least MARGIN_MIN.
        assert_eq!(room_after_margin(32 * MIB, 16 * MIB), 8 * MIB);
        let m = Memory {
            total_kb: 1 << 20,
            available_kb: 100 << 10,
            ..Memory::default()
        };
        // 5% of 1 GiB (52 428 kB) reserved.
        assert_eq!(host_room(&m), (102_400 - 52_428) * 1024);
    }

    #[test]
    fn a_page_read_before_in_the_sweep_is_a_duplicate() {
        let page = PAGE as usize;
        let mut pages = vec![0u8; 5 * page];
        // Pages: A, B, A, zero, zero.
        pages[..page].fill(1);
        pages[page..2 * page].fill(2);
        pages[2 * page..3 * page].fill(1);
        let mut seen = HashSet::new();
        assert_eq!(count_duplicates(&mut seen, &pages), 2);
        // A later batch: B again is a duplicate, a new page is not.
        let mut later = vec![3u8; 2 * page];
        later[page..].fill(2);
        assert_eq!(count_duplicates(&mut seen, &later), 1);
        // One byte apart is another page.
        let mut near = vec![3u8; page];
        near[page - 1] = 4;
        assert_eq!(count_duplicates(&mut seen, &near), 0);
    }
}
