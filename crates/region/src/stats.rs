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

/// Defines the region's counters once: the atomics the pager and writer
/// threads update ([`Counters`]), the snapshot every report reads
/// ([`Stats`]: status, metrics, the C ABI, the kv guest's `stats`), and
/// each counter's reported name ([`Stats::named`]). A counter added here
/// is in all of them.
macro_rules! counters {
    ($($(#[doc = $doc:literal])* $name:ident $(as $shown:literal)?,)*) => {
        /// The region's counters, updated by the pager and writer threads.
        #[derive(Default)]
        pub struct Counters {
            $($(#[doc = $doc])* pub $name: AtomicU64,)*
            /// Remote page-in service times (fault read to faulting page installed).
            pub page_in_latency: Histogram,
        }

        /// A consistent-enough snapshot for reporting.
        #[derive(Clone, Debug, Default)]
        pub struct Stats {
            /// Pages allowed resident.
            pub budget_pages: u64,
            $($(#[doc = $doc])* pub $name: u64,)*
            /// Page-in latency histogram counts (bucket bounds: [`Histogram::upper_us`]).
            pub page_in_latency_buckets: Vec<u64>,
            /// The sum of those latencies, ns.
            pub page_in_latency_sum_ns: u64,
        }

        impl Counters {
            /// Every counter now, with the region's budget.
            pub fn snapshot(&self, budget: u64) -> Stats {
                Stats {
                    budget_pages: budget,
                    $($name: self.$name.load(Relaxed),)*
                    page_in_latency_buckets: self.page_in_latency.counts(),
                    page_in_latency_sum_ns: self.page_in_latency.sum_ns(),
                }
            }
        }

        impl Stats {
            /// Every counter by name (the kv guest's `stats` shows them as
            /// `pf_NAME`), then the page-in latency's p50 and p99 in µs.
            pub fn named(&self) -> Vec<(&'static str, u64)> {
                let mut v = vec![("budget_pages", self.budget_pages)];
                $(v.push((counters!(@shown $name $($shown)?), self.$name));)*
                v.push(("page_in_p50_us", self.page_in_p50_us() as u64));
                v.push(("page_in_p99_us", self.page_in_p99_us() as u64));
                v
            }
        }
    };
    (@shown $name:ident) => { stringify!($name) };
    (@shown $name:ident $shown:literal) => { $shown };
}

counters! {
    /// Pages resident now.
    resident_pages,
    /// Pages on memory servers.
    remote_pages,
    /// MISSING faults served (first touch or page-in).
    missing_faults,
    /// Pages the sampler found touched since it unmapped them (each a minor
    /// fault the kernel resolved).
    minor_faults,
    /// `madvise` calls that unmapped resident pages so that their next
    /// touch shows (sampling, the victim hand's re-arms): each a TLB
    /// shootdown on the guest's CPUs.
    unmaps,
    /// Write-protect faults (migration change tracking).
    wp_faults,
    /// Never-touched pages filled with zeros.
    zero_filled_pages,
    /// Pages brought in from memory servers.
    page_ins,
    /// GET requests that brought them.
    page_in_requests,
    /// Of the page-ins, pages brought by read-ahead (not the faulting page).
    prefetched_pages,
    /// Faulting pages installed writable, not clean, because they were
    /// written when resident before (no WP fault for their next write).
    write_hinted_pages,
    /// Pages sent out to memory servers.
    page_outs,
    /// Chunks evicted.
    page_out_chunks,
    /// Evicted pages whose kept server copy was current: dropped, not sent.
    clean_drops,
    /// Paged-in pages written afterwards (their kept copy went stale).
    first_writes,
    /// Bytes received from memory servers.
    bytes_in,
    /// Bytes sent to them.
    bytes_out,
    /// Chunks the sampling hand has swept.
    sampled_chunks,
    /// Sweep rate of the sampling hand, chunks/s.
    sample_rate as "sample_rate_chunks_per_s",
    /// Total fault service time, ns.
    fault_ns,
    /// Pager CPU time spent bringing pages in, ns.
    page_in_cpu_ns,
    /// Pager CPU time spent evicting (sending and dropping), ns.
    page_out_cpu_ns,
    /// Page-out batches run while over the budget itself (faults wait).
    direct_reclaims,
    /// Wall time of those batches, ns.
    direct_reclaim_ns,
    /// Remote pages with fewer copies than the region's replicas (after a
    /// server's death, until re-replication restores them).
    degraded_pages,
    /// Pages re-replication copied to another server.
    rereplicated_pages,
    /// Memory servers down now: found dead or hung (their pages served by
    /// mirrors), not answering since.
    servers_down,
    /// Times a memory server was found dead or hung.
    server_failures,
    /// Times a server called down answered again and was used again.
    servers_revived,
    /// Faulting pages asked of a mirror because their server missed its
    /// deadline.
    hedged_reads,
    /// Faults that waited for a memory server (the page was remote).
    remote_faults,
    /// First touches: faults served by filling zeros.
    zero_faults,
    /// Read-ahead pages used after they came.
    prefetch_hits,
    /// Read-ahead pages evicted with no use seen (an upper bound: a read
    /// of a mapped page shows only once the sampler has unmapped it).
    prefetch_misses,
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

    /// Median page-in latency, µs.
    pub fn page_in_p50_us(&self) -> f64 {
        Histogram::percentile(&self.page_in_latency_buckets, 50.0)
    }
    /// 99th-percentile page-in latency, µs.
    pub fn page_in_p99_us(&self) -> f64 {
        Histogram::percentile(&self.page_in_latency_buckets, 99.0)
    }
}

#[cfg(test)]
mod tests {
    use super::{Counters, Histogram};
    use std::sync::atomic::Ordering::Relaxed;

    /// Every counter reaches the snapshot and the named list, once.
    #[test]
    fn every_counter_is_reported_once() {
        let c = Counters::default();
        c.page_ins.store(7, Relaxed);
        c.prefetch_misses.store(9, Relaxed);
        c.sample_rate.store(3, Relaxed);
        let s = c.snapshot(100);
        assert_eq!((s.page_ins, s.prefetch_misses, s.budget_pages), (7, 9, 100));
        let named = s.named();
        let mut names: Vec<_> = named.iter().map(|(n, _)| *n).collect();
        assert!(
            named.contains(&("page_ins", 7)) && named.contains(&("sample_rate_chunks_per_s", 3))
        );
        let total = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), total, "a name twice");
    }

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
