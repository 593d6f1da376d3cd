//! Reference bits from the page tables: which resident pages the guest
//! touched since the pager last unmapped them.
//!
//! The region is registered for MISSING and WP faults only. Unmapping a
//! resident page (`madvise(DONTNEED)`, a *zap*: the memfd keeps the page)
//! arms it: the guest's next touch is an ordinary minor fault the kernel
//! resolves by itself in about 1 µs — no userfaultfd event, no pager wake-up,
//! and one page per touch (userfaultfd-WP registration turns fault-around
//! off) — and `PAGEMAP_SCAN` then reports the page as mapped. Mapped since
//! the zap = referenced: the accessed bit the kernel's own LRU reads, at a
//! fraction of a uffd MINOR fault's cost (a pager round trip of ~20 µs that
//! also stops the touching thread). Write protection survives a zap (the
//! kernel leaves a uffd-wp marker), so clean-page and change tracking are
//! unaffected.

use super::location::AccessHistory;
use super::victims::RefProbe;
use super::*;

/// Spared chunks this close together are unmapped by one `madvise` (the
/// chunks between are read first, so their references are kept).
const REARM_GAP: usize = 8;

/// Chunks read per `PAGEMAP_SCAN` while the victim hand advances.
const PROBE_WINDOW: usize = 64;

/// How long what a probe read stays good. The hand passes a 64-chunk
/// window in a few ms in a sequential scan; re-reading it for every small
/// batch (64 pages between the watermarks) cost a quarter of the pager's
/// CPU there. A touch in the last few ms can be missed (that chunk is
/// evicted a pass early), as the kernel's LRU misses accessed bits it has
/// not looked at yet.
const PROBE_FRESH: Duration = Duration::from_millis(10);

/// The page tables' reference bits for this region.
pub(super) struct RefBits {
    /// `PAGEMAP_SCAN` for reference bits; None on kernels before 6.7
    /// (then only page-ins count as references).
    pagemap: Option<uffd::Pagemap>,
    /// What the victim hand's probe read last.
    probe_window: ProbeWindow,
}

impl RefBits {
    pub fn new(pagemap: Option<uffd::Pagemap>) -> Self {
        RefBits {
            pagemap,
            probe_window: ProbeWindow::default(),
        }
    }

    /// Whether the page tables can be read (Linux 6.7+).
    pub fn available(&self) -> bool {
        self.pagemap.is_some()
    }

    /// The victim hand's probe over a region at `base` of `chunks` chunks
    /// of `cp` pages.
    pub fn probe(&mut self, base: u64, cp: usize, chunks: usize) -> PagemapProbe<'_> {
        PagemapProbe::new(
            self.pagemap.as_mut(),
            base,
            cp,
            chunks,
            &mut self.probe_window,
        )
    }
}

/// The chunks a probe has read already, and when.
pub(super) struct ProbeWindow {
    lo: usize,
    hi: usize,
    at: Instant,
}

impl Default for ProbeWindow {
    fn default() -> Self {
        ProbeWindow {
            lo: 0,
            hi: 0,
            at: Instant::now(),
        }
    }
}

/// The victim hand's probe: reads the mapped pages of a window of chunks at
/// a time and sets their reference bits.
pub(super) struct PagemapProbe<'a> {
    pub(super) pm: Option<&'a mut uffd::Pagemap>,
    pub(super) base: u64,
    pub(super) cp: usize,
    pub(super) chunks: usize,
    window: &'a mut ProbeWindow,
}

impl<'a> PagemapProbe<'a> {
    pub(super) fn new(
        pm: Option<&'a mut uffd::Pagemap>,
        base: u64,
        cp: usize,
        chunks: usize,
        window: &'a mut ProbeWindow,
    ) -> Self {
        PagemapProbe {
            pm,
            base,
            cp,
            chunks,
            window,
        }
    }
}

impl RefProbe for PagemapProbe<'_> {
    fn refresh(&mut self, chunk: usize, access: &mut AccessHistory) {
        let w = &mut *self.window;
        if (w.lo..w.hi).contains(&chunk) && w.at.elapsed() < PROBE_FRESH {
            return;
        }
        let Some(pm) = self.pm.as_deref_mut() else {
            return;
        };
        w.lo = chunk;
        w.hi = (chunk + PROBE_WINDOW).min(self.chunks);
        w.at = Instant::now();
        read_mapped(pm, self.base, w.lo * self.cp, w.hi * self.cp, access);
    }
}

/// Set the reference bits of pages `lo..hi` the guest mapped since their
/// last zap (one `PAGEMAP_SCAN`); returns how many.
fn read_mapped(
    pm: &mut uffd::Pagemap,
    base: u64,
    lo: usize,
    hi: usize,
    access: &mut AccessHistory,
) -> u64 {
    let addr = base + (lo * PAGE) as u64;
    let mut found = 0;
    let _ = pm.present(addr, ((hi - lo) * PAGE) as u64, &mut |a, b| {
        found += access.mapped(lo, a, b);
    });
    found
}

impl Pager {
    /// Set the reference bits of pages `lo..hi` mapped now (touched since
    /// their last zap, or installed since); returns how many.
    pub(super) fn read_refs(&mut self, lo: usize, hi: usize) -> u64 {
        match self.refs.pagemap.as_mut() {
            Some(pm) => read_mapped(pm, self.guest.base(), lo, hi, &mut self.access),
            None => 0,
        }
    }

    /// Unmap pages `lo..hi` (one `madvise`, a TLB shootdown): their next
    /// touch shows in the page tables as a use.
    pub(super) fn zap(&mut self, lo: usize, hi: usize) {
        let _ = self.guest.unmap(lo * PAGE, (hi - lo) * PAGE);
        self.shared.stats.unmaps.fetch_add(1, Relaxed);
        self.access.unmapped(lo, hi);
    }

    /// Unmap the pages of these chunks (sorted), one `madvise` per
    /// run of chunks at most `REARM_GAP` apart: their next touch shows in
    /// the page tables again.
    /// Returns the number of `madvise` calls (each a TLB shootdown).
    pub(super) fn rearm(&mut self, chunks: &[usize]) -> u64 {
        if self.refs.pagemap.is_none() || chunks.is_empty() {
            return 0;
        }
        debug_assert!(chunks.windows(2).all(|w| w[0] <= w[1]));
        let mut calls = 0;
        let mut i = 0;
        while i < chunks.len() {
            let mut j = i + 1;
            while j < chunks.len() && chunks[j] <= chunks[j - 1] + REARM_GAP {
                j += 1;
            }
            let (a, b) = (chunks[i], chunks[j - 1] + 1);
            if b - a > j - i {
                // Gaps between spared chunks: keep what their pages show.
                self.read_refs(a * self.cp, b * self.cp);
            }
            self.zap(a * self.cp, b * self.cp);
            calls += 1;
            i = j;
        }
        calls
    }
}
