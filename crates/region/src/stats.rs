//! Runtime counters (lock-free, read by anyone) and a latency histogram.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Fault service time histogram (see [`Histogram::BUCKETS`]).
pub struct Histogram {
    buckets: [AtomicU64; Histogram::BUCKETS],
    /// The sum of what was counted, ns (Prometheus' `_sum`).
    sum_ns: AtomicU64,
}

impl Histogram {
    /// Quarter-octave buckets: bucket 0 is below 1 µs, then four per power
    /// of two up to 2^24 µs, so a percentile is known within 19% (a p99/p50
    /// ratio is not rounded to a power of two).
    pub const BUCKETS: usize = 1 + 4 * 24;

    /// Count one latency of `us` microseconds.
    pub fn record_us(&self, us: f64) {
        self.buckets[Self::bucket(us)].fetch_add(1, Relaxed);
        self.sum_ns.fetch_add((us.max(0.0) * 1e3) as u64, Relaxed);
    }

    /// The sum of what was counted, ns.
    pub fn sum_ns(&self) -> u64 {
        self.sum_ns.load(Relaxed)
    }

    fn bucket(us: f64) -> usize {
        if us < 1.0 {
            return 0;
        }
        let e = us.log2().floor();
        let sub = ((us / e.exp2() - 1.0) * 4.0) as usize;
        (1 + e as usize * 4 + sub.min(3)).min(Self::BUCKETS - 1)
    }

    /// The upper bound of bucket `i`, µs.
    pub fn upper_us(i: usize) -> f64 {
        if i == 0 {
            return 1.0;
        }
        let (e, sub) = ((i - 1) / 4, (i - 1) % 4);
        (e as f64).exp2() * (1.0 + (sub + 1) as f64 / 4.0)
    }

    /// The bucket counts.
    pub fn counts(&self) -> Vec<u64> {
        self.buckets.iter().map(|b| b.load(Relaxed)).collect()
    }

    /// Approximate percentile (upper bound of the bucket), µs.
    pub fn percentile(counts: &[u64], p: f64) -> f64 {
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return 0.0;
        }
        let want = (p / 100.0 * total as f64).ceil().max(1.0) as u64;
        let mut acc = 0;
        for (i, c) in counts.iter().enumerate() {
            acc += c;
            if acc >= want {
                return Self::upper_us(i);
            }
        }
        Self::upper_us(counts.len() - 1)
    }
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            sum_ns: AtomicU64::new(0),
        }
    }
}

#[derive(Default)]
pub struct Counters {
    pub missing_faults: AtomicU64,
    pub minor_faults: AtomicU64,
    pub unmaps: AtomicU64,
    pub wp_faults: AtomicU64,
    pub zero_filled_pages: AtomicU64,
    pub page_ins: AtomicU64,
    pub page_in_requests: AtomicU64,
    pub page_outs: AtomicU64,
    pub page_out_chunks: AtomicU64,
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
    pub sampled_chunks: AtomicU64,
    pub resident_pages: AtomicU64,
    pub remote_pages: AtomicU64,
    /// Pager time spent serving faults, ns.
    pub fault_ns: AtomicU64,
    /// Remote page-in service times (fault read to faulting page installed).
    pub page_in_latency: Histogram,
    /// Sweep rate of the sampling hand, chunks/s (current).
    pub sample_rate: AtomicU64,
    pub clean_drops: AtomicU64,
    pub first_writes: AtomicU64,
    pub prefetched_pages: AtomicU64,
    pub write_hinted_pages: AtomicU64,
    pub page_in_cpu_ns: AtomicU64,
    pub page_out_cpu_ns: AtomicU64,
    pub direct_reclaims: AtomicU64,
    pub direct_reclaim_ns: AtomicU64,
    pub degraded_pages: AtomicU64,
    pub rereplicated_pages: AtomicU64,
    pub servers_down: AtomicU64,
    pub server_failures: AtomicU64,
    pub servers_revived: AtomicU64,
    pub hedged_reads: AtomicU64,
    pub remote_faults: AtomicU64,
    pub zero_faults: AtomicU64,
    pub prefetch_hits: AtomicU64,
    pub prefetch_misses: AtomicU64,
}

/// A consistent-enough snapshot for reporting.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    /// Pages allowed resident.
    pub budget_pages: u64,
    /// Pages resident now.
    pub resident_pages: u64,
    /// Pages on memory servers.
    pub remote_pages: u64,
    /// MISSING faults served (first touch or page-in).
    pub missing_faults: u64,
    /// Pages the sampler found touched since it unmapped them (each a minor
    /// fault the kernel resolved).
    pub minor_faults: u64,
    /// `madvise` calls that unmapped resident pages so that their next
    /// touch shows (sampling, the victim hand's re-arms): each a TLB
    /// shootdown on the guest's CPUs.
    pub unmaps: u64,
    /// Write-protect faults (migration change tracking).
    pub wp_faults: u64,
    /// Never-touched pages filled with zeros.
    pub zero_filled_pages: u64,
    /// Pages brought in from memory servers.
    pub page_ins: u64,
    /// GET requests that brought them.
    pub page_in_requests: u64,
    /// Pages sent out to memory servers.
    pub page_outs: u64,
    /// Chunks evicted.
    pub page_out_chunks: u64,
    /// Bytes received from memory servers.
    pub bytes_in: u64,
    /// Bytes sent to them.
    pub bytes_out: u64,
    /// Chunks the sampling hand has swept.
    pub sampled_chunks: u64,
    /// Sweep rate of the sampling hand, chunks/s.
    pub sample_rate: u64,
    /// Total fault service time, ns.
    pub fault_ns: u64,
    /// Page-in latency histogram counts (bucket bounds: [`Histogram::upper_us`]).
    pub page_in_latency_buckets: Vec<u64>,
    /// The sum of those latencies, ns.
    pub page_in_latency_sum_ns: u64,
    /// Evicted pages whose kept server copy was current: dropped, not sent.
    pub clean_drops: u64,
    /// Paged-in pages written afterwards (their kept copy went stale).
    pub first_writes: u64,
    /// Of the page-ins, pages brought by read-ahead (not the faulting page).
    pub prefetched_pages: u64,
    /// Faulting pages installed writable, not clean, because they were
    /// written when resident before (no WP fault for their next write).
    pub write_hinted_pages: u64,
    /// Pager CPU time spent bringing pages in, ns.
    pub page_in_cpu_ns: u64,
    /// Pager CPU time spent evicting (sending and dropping), ns.
    pub page_out_cpu_ns: u64,
    /// Page-out batches run while over the budget itself (faults wait).
    pub direct_reclaims: u64,
    /// Wall time of those batches, ns.
    pub direct_reclaim_ns: u64,
    /// Remote pages with fewer copies than the region's replicas (after a
    /// server's death, until re-replication restores them).
    pub degraded_pages: u64,
    /// Pages re-replication copied to another server.
    pub rereplicated_pages: u64,
    /// Memory servers down now: found dead or hung (their pages served by
    /// mirrors), not answering since.
    pub servers_down: u64,
    /// Times a memory server was found dead or hung.
    pub server_failures: u64,
    /// Times a server called down answered again and was used again.
    pub servers_revived: u64,
    /// Faulting pages asked of a mirror because their server missed its
    /// deadline.
    pub hedged_reads: u64,
    /// Faults that waited for a memory server (the page was remote).
    pub remote_faults: u64,
    /// First touches: faults served by filling zeros.
    pub zero_faults: u64,
    /// Read-ahead pages used after they came.
    pub prefetch_hits: u64,
    /// Read-ahead pages evicted with no use seen (an upper bound: a read
    /// of a mapped page shows only once the sampler has unmapped it).
    pub prefetch_misses: u64,
}

impl Stats {
    /// Pager CPU per page brought in, µs (0 before any).
    pub fn cpu_per_page_in_us(&self) -> f64 {
        self.page_in_cpu_ns as f64 / 1e3 / self.page_ins.max(1) as f64
    }
    /// Pager CPU per page evicted (sent or dropped), µs (0 before any).
    pub fn cpu_per_page_out_us(&self) -> f64 {
        self.page_out_cpu_ns as f64 / 1e3 / (self.page_outs + self.clean_drops).max(1) as f64
    }

    /// Every counter by name (the kv guest's `stats` shows them as `pf_NAME`).
    pub fn named(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("budget_pages", self.budget_pages),
            ("resident_pages", self.resident_pages),
            ("remote_pages", self.remote_pages),
            ("missing_faults", self.missing_faults),
            ("minor_faults", self.minor_faults),
            ("unmaps", self.unmaps),
            ("wp_faults", self.wp_faults),
            ("zero_filled_pages", self.zero_filled_pages),
            ("page_ins", self.page_ins),
            ("page_in_requests", self.page_in_requests),
            ("prefetched_pages", self.prefetched_pages),
            ("write_hinted_pages", self.write_hinted_pages),
            ("page_outs", self.page_outs),
            ("page_out_chunks", self.page_out_chunks),
            ("clean_drops", self.clean_drops),
            ("first_writes", self.first_writes),
            ("bytes_in", self.bytes_in),
            ("bytes_out", self.bytes_out),
            ("sampled_chunks", self.sampled_chunks),
            ("sample_rate_chunks_per_s", self.sample_rate),
            ("fault_ns", self.fault_ns),
            ("page_in_cpu_ns", self.page_in_cpu_ns),
            ("page_out_cpu_ns", self.page_out_cpu_ns),
            ("direct_reclaims", self.direct_reclaims),
            ("direct_reclaim_ns", self.direct_reclaim_ns),
            ("degraded_pages", self.degraded_pages),
            ("rereplicated_pages", self.rereplicated_pages),
            ("servers_down", self.servers_down),
            ("server_failures", self.server_failures),
            ("servers_revived", self.servers_revived),
            ("hedged_reads", self.hedged_reads),
            ("remote_faults", self.remote_faults),
            ("zero_faults", self.zero_faults),
            ("prefetch_hits", self.prefetch_hits),
            ("prefetch_misses", self.prefetch_misses),
            ("page_in_p50_us", self.page_in_p50_us() as u64),
            ("page_in_p99_us", self.page_in_p99_us() as u64),
        ]
    }

    /// Median page-in latency, µs.
    pub fn page_in_p50_us(&self) -> f64 {
        Histogram::percentile(&self.page_in_latency_buckets, 50.0)
    }
    /// 99th-percentile page-in latency, µs.
    pub fn page_in_p99_us(&self) -> f64 {
        Histogram::percentile(&self.page_in_latency_buckets, 99.0)
    }
}

impl Counters {
    pub fn snapshot(&self, budget: u64) -> Stats {
        Stats {
            budget_pages: budget,
            resident_pages: self.resident_pages.load(Relaxed),
            remote_pages: self.remote_pages.load(Relaxed),
            missing_faults: self.missing_faults.load(Relaxed),
            minor_faults: self.minor_faults.load(Relaxed),
            unmaps: self.unmaps.load(Relaxed),
            wp_faults: self.wp_faults.load(Relaxed),
            zero_filled_pages: self.zero_filled_pages.load(Relaxed),
            page_ins: self.page_ins.load(Relaxed),
            page_in_requests: self.page_in_requests.load(Relaxed),
            page_outs: self.page_outs.load(Relaxed),
            page_out_chunks: self.page_out_chunks.load(Relaxed),
            bytes_in: self.bytes_in.load(Relaxed),
            bytes_out: self.bytes_out.load(Relaxed),
            sampled_chunks: self.sampled_chunks.load(Relaxed),
            sample_rate: self.sample_rate.load(Relaxed),
            fault_ns: self.fault_ns.load(Relaxed),
            page_in_latency_buckets: self.page_in_latency.counts(),
            page_in_latency_sum_ns: self.page_in_latency.sum_ns(),
            clean_drops: self.clean_drops.load(Relaxed),
            first_writes: self.first_writes.load(Relaxed),
            prefetched_pages: self.prefetched_pages.load(Relaxed),
            write_hinted_pages: self.write_hinted_pages.load(Relaxed),
            page_in_cpu_ns: self.page_in_cpu_ns.load(Relaxed),
            page_out_cpu_ns: self.page_out_cpu_ns.load(Relaxed),
            direct_reclaims: self.direct_reclaims.load(Relaxed),
            direct_reclaim_ns: self.direct_reclaim_ns.load(Relaxed),
            degraded_pages: self.degraded_pages.load(Relaxed),
            rereplicated_pages: self.rereplicated_pages.load(Relaxed),
            servers_down: self.servers_down.load(Relaxed),
            server_failures: self.server_failures.load(Relaxed),
            servers_revived: self.servers_revived.load(Relaxed),
            hedged_reads: self.hedged_reads.load(Relaxed),
            remote_faults: self.remote_faults.load(Relaxed),
            zero_faults: self.zero_faults.load(Relaxed),
            prefetch_hits: self.prefetch_hits.load(Relaxed),
            prefetch_misses: self.prefetch_misses.load(Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Histogram;

    #[test]
    fn quarter_octave_buckets_bound_each_time() {
        assert_eq!(Histogram::bucket(1e12), Histogram::BUCKETS - 1, "clamped");
        for us in [0.5, 1.0, 1.3, 63.0, 64.0, 79.9, 80.0, 1000.0, 1e6] {
            let i = Histogram::bucket(us);
            assert!(us <= Histogram::upper_us(i), "{us} above bucket {i}");
            if i > 0 && i < Histogram::BUCKETS - 1 {
                assert!(us >= Histogram::upper_us(i - 1), "{us} below bucket {i}");
            }
        }
        let h = Histogram::default();
        for _ in 0..98 {
            h.record_us(70.0);
        }
        h.record_us(700.0);
        h.record_us(700.0);
        let c = h.counts();
        assert_eq!(Histogram::percentile(&c, 50.0), 80.0);
        assert_eq!(Histogram::percentile(&c, 99.0), 768.0);
    }
}
