//! Sharing-aware migration on the migration stream (paper 002,
//! docs/dedup.md): for a batch of pages the source sends their keyed
//! hashes first; the destination fills the pages its host already holds
//! (checked against the hash) and says which; the source sends the data of
//! the others only.
//!
//! The source keeps a few batches in flight, so the answer's round trip
//! hides behind the data of later batches. A migration that finds nothing
//! must cost nothing: after [`COLD_AFTER`] batches without a hit the source
//! hashes only every [`PROBE_EVERY`]th page of a batch (a probe); the rest
//! of the batch waits for the probe's answer (behind the batches in flight,
//! so the link stays busy) and is sent if the probe missed, asked about if
//! it hit; a hit also makes the source hash whole batches again.

use crate::outcome::{MigrateError, Progress};
use crate::pread_pages;
use crate::wire::runs;
pub use crate::wire::Filled;
use crate::wire::{Kind, Stream, HASH_ENTRY, MAX_PAGES};
use pagefleet_dedup::ContentKey;
use pagefleet_region::PAGE;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

/// Pages per HASHES batch (1 MiB of data).
pub const BATCH: usize = 256;
/// Batches in flight before the source waits for the oldest answer.
pub const DEPTH: usize = 4;
/// Batches without a hit before the source only probes.
pub const COLD_AFTER: u32 = 2;
/// A probing source hashes one page in this many.
pub const PROBE_EVERY: usize = 32;

/// The source's state across the rounds of one migration.
pub struct Sender {
    key: ContentKey,
    cold: u32,
    /// Pages hashed.
    pub hashed: u64,
    /// Pages the destination filled (not sent).
    pub found: u64,
    /// Bytes of HASHES messages.
    pub hash_bytes: u64,
    /// CPU seconds spent hashing.
    pub hash_secs: f64,
    /// Batches sent only as a probe.
    pub probes: u64,
}

impl Sender {
    /// A sender hashing with the cluster's key.
    pub fn new(key: ContentKey) -> Sender {
        Sender {
            key,
            cold: 0,
            hashed: 0,
            found: 0,
            hash_bytes: 0,
            hash_secs: 0.0,
            probes: 0,
        }
    }

    /// The key pages are hashed with.
    pub(crate) fn key(&self) -> &ContentKey {
        &self.key
    }

    /// Which of a batch of `n` pages to hash.
    pub(crate) fn pick(&mut self, n: usize) -> Vec<usize> {
        if self.cold < COLD_AFTER {
            (0..n).collect()
        } else {
            self.probes += 1;
            (0..n).step_by(PROBE_EVERY).collect()
        }
    }

    /// A batch's answer: `hits` of its hashed pages were there.
    pub(crate) fn learned(&mut self, hits: usize) {
        self.found += hits as u64;
        self.cold = if hits > 0 { 0 } else { self.cold + 1 };
    }
}

/// A batch whose answer has not come yet.
struct Pending {
    id: u64,
    pages: Vec<u64>,
    hist: Vec<u8>,
    data: Vec<u8>,
    /// Indexes (into `pages`) asked about, in order.
    hashed: Vec<usize>,
    /// Indexes neither asked about nor sent: a probe's batch waits for the
    /// probe's answer (hashed if it hit, sent if not).
    deferred: Vec<usize>,
}

/// The batches in flight, oldest first, and buffers to reuse.
#[derive(Default)]
struct Flight {
    inflight: VecDeque<Pending>,
    spare: Vec<Vec<u8>>,
    next_id: u64,
}

impl Flight {
    /// Ask about a batch (numbered here) and keep it until its answer.
    fn launch(
        &mut self,
        stream: &mut Stream,
        sender: &mut Sender,
        mut p: Pending,
    ) -> Result<u64, MigrateError> {
        p.id = self.next_id;
        self.next_id += 1;
        let bytes = ask(stream, &p, sender)?;
        self.inflight.push_back(p);
        Ok(bytes)
    }

    /// Settle the oldest batch (None: nothing in flight).
    fn settle_oldest(
        &mut self,
        stream: &mut Stream,
        sender: &mut Sender,
        progress: &Progress,
    ) -> Result<Option<u64>, MigrateError> {
        match self.inflight.pop_front() {
            Some(p) => settle(stream, p, sender, progress, self).map(Some),
            None => Ok(None),
        }
    }
}

/// Send `pages` (sorted; `hist[i]` is the history of `pages[i]`) to the
/// main host, each either as data or, where the destination holds its
/// content, as a hash only. Returns the bytes sent.
pub fn send(
    stream: &mut Stream,
    fd: std::os::fd::BorrowedFd<'_>,
    pages: &[u64],
    hist: &[u8],
    sender: &mut Sender,
    progress: &Progress,
    cancel: &AtomicBool,
) -> Result<u64, MigrateError> {
    let mut bytes = 0u64;
    let mut flight = Flight::default();
    for (chunk, h) in pages.chunks(BATCH).zip(hist.chunks(BATCH)) {
        if cancel.load(Relaxed) {
            return Err(MigrateError::Cancelled);
        }
        let mut data = flight.spare.pop().unwrap_or_default();
        data.resize(chunk.len() * PAGE, 0);
        let mut at = 0;
        for (first, count) in runs(chunk, BATCH) {
            pread_pages(fd, first, &mut data[at * PAGE..(at + count) * PAGE])
                .map_err(|e| MigrateError::Other(format!("reading the region: {e}")))?;
            at += count;
        }
        let hashed = sender.pick(chunk.len());
        let deferred = if hashed.len() == chunk.len() {
            Vec::new()
        } else {
            (0..chunk.len()).filter(|k| k % PROBE_EVERY != 0).collect()
        };
        let p = Pending {
            id: 0,
            pages: chunk.to_vec(),
            hist: h.to_vec(),
            data,
            hashed,
            deferred,
        };
        bytes += flight.launch(stream, sender, p)?;
        while flight.inflight.len() > DEPTH {
            bytes += flight.settle_oldest(stream, sender, progress)?.unwrap_or(0);
        }
    }
    while let Some(b) = flight.settle_oldest(stream, sender, progress)? {
        bytes += b;
    }
    Ok(bytes)
}

/// HASHES for the pages of `p` it asks about.
fn ask(stream: &mut Stream, p: &Pending, sender: &mut Sender) -> Result<u64, MigrateError> {
    let t = pagefleet_common::clock::thread_cpu_secs();
    let mut msg = Vec::with_capacity(p.hashed.len() * HASH_ENTRY);
    for &k in &p.hashed {
        let page: &[u8; PAGE] = p.data[k * PAGE..(k + 1) * PAGE].try_into().expect("page");
        msg.extend_from_slice(&p.pages[k].to_le_bytes());
        msg.push(p.hist[k]);
        msg.extend_from_slice(&sender.key.hash(page).to_bytes());
    }
    sender.hash_secs += pagefleet_common::clock::thread_cpu_secs() - t;
    sender.hashed += p.hashed.len() as u64;
    stream.send(Kind::Hashes, p.id, &[&msg])?;
    sender.hash_bytes += (16 + msg.len()) as u64;
    Ok((16 + msg.len()) as u64)
}

/// Wait for the oldest batch's answer and send the data of what the
/// destination lacks. A probe that hit asks about the rest of its batch
/// (queued behind the batches in flight); one that missed sends it.
fn settle(
    stream: &mut Stream,
    p: Pending,
    sender: &mut Sender,
    progress: &Progress,
    flight: &mut Flight,
) -> Result<u64, MigrateError> {
    let (h, have) = stream.expect(Kind::Have)?;
    if h.arg != p.id || have.len() != p.hashed.len().div_ceil(8) {
        return Err(crate::wire::WireError::Malformed(format!(
            "HAVE for batch {} ({} bytes), expected batch {} of {} pages",
            h.arg,
            have.len(),
            p.id,
            p.hashed.len()
        ))
        .into());
    }
    let mut send = vec![false; p.pages.len()];
    let mut hits = 0;
    for (i, &k) in p.hashed.iter().enumerate() {
        if have[i / 8] & (1 << (i % 8)) != 0 {
            hits += 1;
        } else {
            send[k] = true;
        }
    }
    sender.learned(hits);
    progress.round_sent.fetch_add(hits as u64, Relaxed);
    let follow = !p.deferred.is_empty() && hits > 0;
    if !follow {
        for &k in &p.deferred {
            send[k] = true;
        }
    }
    let mut bytes = send_some(stream, &p.pages, &p.hist, &p.data, &send, progress)?;
    if follow {
        let q = Pending {
            hashed: p.deferred,
            deferred: Vec::new(),
            ..p
        };
        bytes += flight.launch(stream, sender, q)?;
    } else {
        flight.spare.push(p.data);
    }
    Ok(bytes)
}

/// PAGES messages for the pages of a batch marked in `which`, in runs.
fn send_some(
    stream: &mut Stream,
    pages: &[u64],
    hist: &[u8],
    data: &[u8],
    which: &[bool],
    progress: &Progress,
) -> Result<u64, MigrateError> {
    let mut bytes = 0u64;
    let mut i = 0;
    while i < pages.len() {
        if !which[i] {
            i += 1;
            continue;
        }
        let mut j = i + 1;
        while j < pages.len() && which[j] && pages[j] == pages[j - 1] + 1 && j - i < MAX_PAGES {
            j += 1;
        }
        let n = j - i;
        stream.send(
            Kind::Pages,
            pages[i],
            &[&hist[i..j], &data[i * PAGE..j * PAGE]],
        )?;
        bytes += (16 + n + n * PAGE) as u64;
        progress.bytes_main.fetch_add((n * PAGE) as u64, Relaxed);
        progress.round_sent.fetch_add(n as u64, Relaxed);
        i = j;
    }
    Ok(bytes)
}

/// The HAVE bitmap of `filled` (one bit per hashed page, in order).
pub fn bitmap(filled: &[bool]) -> Vec<u8> {
    let mut b = vec![0u8; filled.len().div_ceil(8)];
    for (i, &f) in filled.iter().enumerate() {
        if f {
            b[i / 8] |= 1 << (i % 8);
        }
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;
    use pagefleet_proto::auth::Secret;

    fn key() -> ContentKey {
        ContentKey::from_secret(&Secret::from_bytes(b"0123456789abcdef0123", "t").unwrap())
    }

    #[test]
    fn a_source_that_finds_nothing_only_probes_and_a_hit_wakes_it() {
        let mut s = Sender::new(key());
        assert_eq!(s.pick(BATCH).len(), BATCH);
        s.learned(0);
        s.learned(0);
        let probe = s.pick(BATCH);
        assert_eq!(probe.len(), BATCH / PROBE_EVERY);
        assert_eq!(s.probes, 1);
        s.learned(1);
        assert_eq!(s.pick(BATCH).len(), BATCH);
    }

    #[test]
    fn the_bitmap_has_a_bit_per_hashed_page() {
        let f = [true, false, false, true, false, false, false, false, true];
        assert_eq!(bitmap(&f), vec![0b1001, 1]);
        assert!(bitmap(&[]).is_empty());
    }
}
