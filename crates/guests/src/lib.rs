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
    /// Read the word at `off`; panics outside the view.
    #[inline]
    pub fn read_u64(&self, off: usize) -> u64 {
        assert!(
            off + 8 <= self.len,
            "read at {off} outside {} bytes",
            self.len
        );
        // SAFETY: in bounds; volatile so the access really touches guest memory.
        unsafe { std::ptr::read_volatile(self.base.add(off) as *const u64) }
    }
    /// Write the word at `off`; panics outside the view.
    #[inline]
    pub fn write_u64(&self, off: usize, v: u64) {
        assert!(
            off + 8 <= self.len,
            "write at {off} outside {} bytes",
            self.len
        );
        // SAFETY: in bounds.
        unsafe { std::ptr::write_volatile(self.base.add(off) as *mut u64, v) }
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
