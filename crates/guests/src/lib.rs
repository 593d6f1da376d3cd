//! Native guests: workloads that keep *all* their state in the guest memory
//! they are given (a pagefleet region, or plain memory for the all-local
//! baseline), like a VM's RAM, so a runner elsewhere could resume them.

pub mod kv;
pub mod sort;
pub mod synthetic;

/// Guest memory: a raw, shared view of a region. Threads coordinate through
/// the workload's own rules (disjoint slices, locks inside the data). Only
/// [`Mem::new`] (unsafe) makes one, so every `Mem` covers mapped memory;
/// accesses are bounds-checked.
#[derive(Clone, Copy)]
pub struct Mem {
    base: *mut u8,
    len: usize,
}

// SAFETY: Mem is a plain view of shared memory; workloads synchronise their
// own accesses (volatile word accesses, locks inside the data).
unsafe impl Send for Mem {}
// SAFETY: as for Send.
unsafe impl Sync for Mem {}

impl Mem {
    /// A view of `len` bytes at `base`.
    ///
    /// # Safety
    /// `base..base+len` must stay mapped and writable while the Mem (or any
    /// copy or sub-view of it) is used, and be 8-byte aligned.
    pub unsafe fn new(base: *mut u8, len: usize) -> Mem {
        Mem { base, len }
    }
    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Its first byte (for handing to code that takes raw memory).
    pub fn as_ptr(&self) -> *mut u8 {
        self.base
    }
    /// The sub-view `[off, off+len)`; panics outside this view.
    pub fn sub(&self, off: usize, len: usize) -> Mem {
        assert!(
            off.checked_add(len).is_some_and(|e| e <= self.len),
            "sub-view {off}+{len} outside {} bytes",
            self.len
        );
        Mem {
            // SAFETY: in bounds (checked above) of memory valid for self.
            base: unsafe { self.base.add(off) },
            len,
        }
    }
    /// The address of the 8-byte word at `off`: in the view (no overflow)
    /// and 8-byte aligned, else a panic naming the access.
    #[inline]
    fn word(&self, off: usize, what: &str) -> *mut u64 {
        assert!(
            off.checked_add(8).is_some_and(|end| end <= self.len),
            "{what} at {off} outside {} bytes",
            self.len
        );
        // SAFETY: off + 8 <= len (checked above): in bounds of the view.
        let p = unsafe { self.base.add(off) };
        assert!(
            (p as usize).is_multiple_of(8),
            "{what} at {off}: not 8-byte aligned"
        );
        p.cast()
    }
    /// Read the word at `off`; panics outside the view or unaligned.
    #[inline]
    pub fn read_u64(&self, off: usize) -> u64 {
        let p = self.word(off, "read");
        // SAFETY: in bounds and aligned (`word`); volatile so the access
        // really touches guest memory.
        unsafe { std::ptr::read_volatile(p) }
    }
    /// Write the word at `off`; panics outside the view or unaligned.
    #[inline]
    pub fn write_u64(&self, off: usize, v: u64) {
        let p = self.word(off, "write");
        // SAFETY: in bounds and aligned (`word`).
        unsafe { std::ptr::write_volatile(p, v) }
    }
}

/// Per-thread xorshift64* generator.
#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator seeded with `seed` (any value).
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// A uniform number in [0, 1).
    #[inline]
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// A safepoint gate: workers enter it around each unit of work; `pause`
/// waits until no unit is in flight and holds new ones back (a quiesced
/// guest for a migration's final copy), `resume` lets them go on.
#[derive(Debug, Default)]
pub struct Gate {
    st: std::sync::Mutex<(bool, usize)>,
    cv: std::sync::Condvar,
}

impl Gate {
    /// Start a unit of work (waits while paused).
    pub fn enter(&self) {
        let mut g = self.st.lock().unwrap_or_else(|e| e.into_inner());
        while g.0 {
            g = self.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        g.1 += 1;
    }
    /// End a unit of work.
    pub fn exit(&self) {
        let mut g = self.st.lock().unwrap_or_else(|e| e.into_inner());
        g.1 -= 1;
        if g.1 == 0 {
            self.cv.notify_all();
        }
    }
    /// Stop new work and wait for the work in flight; false (and resumed) on timeout.
    pub fn pause(&self, timeout: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        let mut g = self.st.lock().unwrap_or_else(|e| e.into_inner());
        g.0 = true;
        while g.1 > 0 {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                g.0 = false;
                self.cv.notify_all();
                return false;
            }
            g = self
                .cv
                .wait_timeout(g, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }
    /// Let work go on after a pause.
    pub fn resume(&self) {
        let mut g = self.st.lock().unwrap_or_else(|e| e.into_inner());
        g.0 = false;
        self.cv.notify_all();
    }
    /// Whether the gate holds work back now.
    pub fn is_paused(&self) -> bool {
        self.st.lock().unwrap_or_else(|e| e.into_inner()).0
    }
}

#[cfg(test)]
mod tests {
    use super::Mem;

    fn view(words: &mut [u64]) -> Mem {
        // SAFETY: the slice outlives every use of the view in these tests
        // and is 8-byte aligned.
        unsafe { Mem::new(words.as_mut_ptr().cast(), words.len() * 8) }
    }

    #[test]
    fn words_in_the_view_read_back() {
        let mut w = [0u64; 4];
        let m = view(&mut w);
        m.write_u64(24, 7);
        assert_eq!(m.read_u64(24), 7);
        assert_eq!(m.sub(8, 24).read_u64(16), 7);
    }

    #[test]
    #[should_panic(expected = "outside 32 bytes")]
    fn an_offset_that_would_wrap_is_refused() {
        let mut w = [0u64; 4];
        view(&mut w).read_u64(usize::MAX - 3);
    }

    #[test]
    #[should_panic(expected = "outside 32 bytes")]
    fn the_last_partial_word_is_refused() {
        let mut w = [0u64; 4];
        view(&mut w).write_u64(25, 1);
    }

    #[test]
    #[should_panic(expected = "not 8-byte aligned")]
    fn an_unaligned_word_is_refused() {
        let mut w = [0u64; 4];
        view(&mut w).read_u64(4);
    }

    #[test]
    #[should_panic(expected = "not 8-byte aligned")]
    fn an_unaligned_sub_view_is_refused_at_access() {
        let mut w = [0u64; 4];
        view(&mut w).sub(1, 16).read_u64(0);
    }
}
