//! `sort`: the S-memV GNU sort experiment — sort N bytes of fixed-size
//! records (10-byte key, 90-byte payload, like sort benchmarks' records)
//! in place in guest memory.

use crate::{Mem, Rng};
use std::time::Instant;

/// Bytes per record (the sort benchmark's 100-byte records).
pub const RECORD: usize = 100;
/// Bytes of the key at the start of a record.
pub const KEY: usize = 10;

/// What a sort run measured.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    /// Records sorted.
    pub records: u64,
    /// Seconds generating them.
    pub generate_secs: f64,
    /// Seconds sorting them.
    pub sort_secs: f64,
    /// Whether they came out sorted.
    pub sorted: bool,
}

/// Fill the memory with random records (deterministic for `seed`).
pub fn generate(mem: Mem, seed: u64) -> u64 {
    let n = mem.len / RECORD;
    // SAFETY: exclusive use of the region during generation.
    let s = unsafe { std::slice::from_raw_parts_mut(mem.base, n * RECORD) };
    let mut rng = Rng::new(seed);
    for rec in s.chunks_exact_mut(RECORD) {
        for w in rec.chunks_mut(8) {
            let v = rng.next_u64().to_le_bytes();
            w.copy_from_slice(&v[..w.len()]);
        }
    }
    n as u64
}

/// Sort the records in place by key; returns whether the result checks out.
pub fn sort(mem: Mem) -> bool {
    let n = mem.len / RECORD;
    // SAFETY: [u8; 100] has alignment 1; exclusive use of the region.
    let recs = unsafe { std::slice::from_raw_parts_mut(mem.base as *mut [u8; RECORD], n) };
    recs.sort_unstable_by(|a, b| a[..KEY].cmp(&b[..KEY]));
    recs.windows(2).all(|w| w[0][..KEY] <= w[1][..KEY])
}

/// Generate (with `generate_first`) and sort records filling `mem`.
pub fn run(mem: Mem, seed: u64, generate_first: bool) -> Outcome {
    let t = Instant::now();
    let records = if generate_first {
        generate(mem, seed)
    } else {
        (mem.len / RECORD) as u64
    };
    let generate_secs = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let sorted = sort(mem);
    Outcome {
        records,
        generate_secs,
        sort_secs: t.elapsed().as_secs_f64(),
        sorted,
    }
}
