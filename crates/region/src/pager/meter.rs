//! The pager's CPU per page-in and per page-out, without a system call per
//! page: reading the thread's CPU clock (`CLOCK_THREAD_CPUTIME_ID`, which
//! the vDSO does not serve) costs ~0.4 µs here, and timing each page-in
//! path with it took four reads per page-in, ~10% of the pager's CPU for
//! it. Instead each path adds its wall time (vDSO, ~20 ns) to its
//! category, and the thread's CPU is read at most every 16 busy loop turns
//! or 50 ms and shared out between the categories in proportion to their
//! wall times. The pager rarely waits inside these paths (the fault loop
//! sleeps in epoll), so the shares are CPU shares; its CPU between two
//! readings that did no paging work at all (idle loop turns, sampling) is
//! counted with the next paging work, a few µs per 5 ms tick.

use super::thread_cpu_ns;
use crate::Shared;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

/// Busy loop turns between two readings of the CPU clock.
const TURNS: u32 = 16;
/// Longest time between two readings while there is paging work.
const MAX_NS: u64 = 50_000_000;

pub(super) struct CpuMeter {
    cpu_mark: u64,
    wall_mark: Instant,
    wall_in: u64,
    wall_out: u64,
    turns: u32,
}

impl CpuMeter {
    pub(super) fn new() -> CpuMeter {
        CpuMeter {
            cpu_mark: thread_cpu_ns(),
            wall_mark: Instant::now(),
            wall_in: 0,
            wall_out: 0,
            turns: 0,
        }
    }

    /// `since` to now was spent paging in.
    pub(super) fn page_in(&mut self, since: Instant) {
        self.wall_in += since.elapsed().as_nanos() as u64;
    }

    /// `since` to now was spent paging out.
    pub(super) fn page_out(&mut self, since: Instant) {
        self.wall_out += since.elapsed().as_nanos() as u64;
    }

    /// End of a loop turn: now and then, read the CPU clock and share what
    /// the thread used since the last reading out to the stats.
    pub(super) fn turn(&mut self, shared: &Shared) {
        let work = self.wall_in + self.wall_out;
        if work == 0 {
            return;
        }
        self.turns += 1;
        if self.turns < TURNS && (self.wall_mark.elapsed().as_nanos() as u64) < MAX_NS {
            return;
        }
        let cpu = thread_cpu_ns();
        let used = cpu.saturating_sub(self.cpu_mark);
        let to_in = (used as u128 * self.wall_in as u128 / work as u128) as u64;
        shared.stats.page_in_cpu_ns.fetch_add(to_in, Relaxed);
        shared
            .stats
            .page_out_cpu_ns
            .fetch_add(used - to_in, Relaxed);
        *self = CpuMeter {
            cpu_mark: cpu,
            wall_mark: Instant::now(),
            wall_in: 0,
            wall_out: 0,
            turns: 0,
        };
    }
}
