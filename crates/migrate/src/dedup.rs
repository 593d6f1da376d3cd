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
//!
//! Asking must also never cost time where the link is fast and the CPU
//! is not: the source measures wall seconds per page asking and sending
//! every page as data, and runs the cheaper ([`crate::choice`]).
//!
//! Zero pages are the source's to find: a scan that stops at the first
//! non-zero word costs a data page next to nothing, and a zero page's hash
//! is one constant, so every zero page is asked about (never sent) whether
//! the source is probing or not. Only hits on other content keep it
//! hashing whole batches: a guest whose only sharing is zero pages (most
//! VMs) costs one scan per page, not a hash.

use crate::choice::{Choice, Mode};
use crate::outcome::{MigrateError, Progress};
use crate::pread_pages;
use crate::wire::runs;
pub use crate::wire::Filled;
use crate::wire::{Kind, Stream, HASH_ENTRY, MAX_PAGES};
use pagefleet_dedup::ContentKey;
use pagefleet_region::PAGE;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

/// The longest a mode switch waits for the socket's send queue to empty
/// (a stalled destination is the stream's timeout's to report).
const DRAIN_LIMIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Wait until the stream's socket has sent everything written (nothing
/// waits in its send queue), for at most [`DRAIN_LIMIT`]. For measuring: a
/// window timed from an empty queue to an empty queue is the link's time,
/// not the socket buffer's.
fn wait_sent(stream: &Stream) -> Result<(), MigrateError> {
    let t = std::time::Instant::now();
    loop {
        let n = crate::sys::unsent_bytes(stream.s.socket()).map_err(|e| stream.io_error(e))?;
        if n == 0 || t.elapsed() >= DRAIN_LIMIT {
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_micros(50));
    }
}

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
    /// The zero page's hash under `key`.
    zero: pagefleet_dedup::PageHash,
    cold: u32,
    /// Pages whose content was hashed (not found zero).
    pub hashed_data: u64,
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
    /// Asking or sending, from what this migration measured.
    pub choice: Choice,
}

impl Sender {
    /// A sender hashing with the cluster's key.
    pub fn new(key: ContentKey) -> Sender {
        Sender {
            zero: key.zero(),
            key,
            cold: 0,
            hashed_data: 0,
            hashed: 0,
            found: 0,
            hash_bytes: 0,
            hash_secs: 0.0,
            probes: 0,
            choice: Choice::new(),
        }
    }

    /// Which pages of a batch to ask about (`zero[k]`: page k is zero):
    /// all of them, or when cold a probe and the zero pages.
    pub(crate) fn pick(&mut self, zero: &[bool]) -> Vec<usize> {
        if self.cold < COLD_AFTER {
            (0..zero.len()).collect()
        } else {
            self.probes += 1;
            (0..zero.len())
                .filter(|&k| k % PROBE_EVERY == 0 || zero[k])
                .collect()
        }
    }

    /// The hash of `page` (the constant when the caller found it zero).
    pub(crate) fn hash(&mut self, page: &[u8; PAGE], zero: bool) -> [u8; 16] {
        if zero {
            return self.zero.to_bytes();
        }
        self.hashed_data += 1;
        self.key.hash(page).to_bytes()
    }

    /// A batch's answer: `hits` of its asked pages were there, `zero_hits`
    /// of them zero pages (which do not keep the source hashing).
    pub(crate) fn learned(&mut self, hits: usize, zero_hits: usize) {
        self.found += hits as u64;
        self.cold = if hits > zero_hits { 0 } else { self.cold + 1 };
    }
}

/// A batch whose answer has not come yet.
struct Pending {
    id: u64,
    pages: Vec<u64>,
    hist: Vec<u8>,
    data: Vec<u8>,
    /// Which pages are zero.
    zero: Vec<bool>,
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
    // The measuring window (see crate::choice): when it began, its pages.
    let mut window = (std::time::Instant::now(), 0u64);
    let mut buf = Vec::new();
    for (chunk, h) in pages.chunks(BATCH).zip(hist.chunks(BATCH)) {
        if cancel.load(Relaxed) {
            return Err(MigrateError::Cancelled);
        }
        if window.1 >= sender.choice.window_pages() {
            // Windows are timed launch to launch while a mode goes on (the
            // batches in flight carry over: the link never waits for an
            // answer at a window's end). A window that likely ends its
            // mode is timed until what it sent has left; a switch settles
            // what is in flight and lets the socket empty, counted to the
            // window before, so the next starts from an empty queue.
            let was = sender.choice.mode();
            if was == Mode::Send && sender.choice.exploring() {
                wait_sent(stream)?;
            }
            let next = sender
                .choice
                .record(window.1, window.0.elapsed().as_secs_f64());
            if next != was {
                let t = std::time::Instant::now();
                while let Some(b) = flight.settle_oldest(stream, sender, progress)? {
                    bytes += b;
                }
                wait_sent(stream)?;
                sender.choice.amend(was, t.elapsed().as_secs_f64());
            }
            window = (std::time::Instant::now(), 0);
        }
        window.1 += chunk.len() as u64;
        if sender.choice.mode() == Mode::Send {
            bytes += send_unasked(stream, fd, chunk, h, &mut buf, progress)?;
            continue;
        }
        let mut data = flight.spare.pop().unwrap_or_default();
        data.resize(chunk.len() * PAGE, 0);
        let mut at = 0;
        for (first, count) in runs(chunk, BATCH) {
            pread_pages(fd, first, &mut data[at * PAGE..(at + count) * PAGE])
                .map_err(|e| MigrateError::Other(format!("reading the region: {e}")))?;
            at += count;
        }
        let t = pagefleet_common::clock::thread_cpu_secs();
        let zero = zero_pages(&data);
        sender.hash_secs += pagefleet_common::clock::thread_cpu_secs() - t;
        let hashed = sender.pick(&zero);
        let mut asked = vec![false; chunk.len()];
        for &k in &hashed {
            asked[k] = true;
        }
        let deferred = (0..chunk.len()).filter(|&k| !asked[k]).collect();
        let p = Pending {
            id: 0,
            pages: chunk.to_vec(),
            hist: h.to_vec(),
            data,
            zero,
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
    // A round's last window (short ones count pages, decide nothing),
    // timed as at any window's end.
    if sender.choice.mode() == Mode::Send && sender.choice.exploring() {
        wait_sent(stream)?;
    }
    sender
        .choice
        .record(window.1, window.0.elapsed().as_secs_f64());
    Ok(bytes)
}

/// Send `pages` (sorted, a batch) as data without asking: straight from
/// the region's file to the socket, in runs.
pub(crate) fn send_unasked(
    stream: &mut Stream,
    fd: std::os::fd::BorrowedFd<'_>,
    pages: &[u64],
    hist: &[u8],
    buf: &mut Vec<u8>,
    progress: &Progress,
) -> Result<u64, MigrateError> {
    if buf.is_empty() {
        buf.resize(MAX_PAGES * PAGE, 0);
    }
    let mut bytes = 0u64;
    let mut at = 0;
    for (first, count) in runs(pages, MAX_PAGES) {
        stream.send_pages(Kind::Pages, first, &hist[at..at + count], fd, count, buf)?;
        at += count;
        bytes += (16 + count + count * PAGE) as u64;
        progress
            .bytes_main
            .fetch_add((count * PAGE) as u64, Relaxed);
        progress.round_sent.fetch_add(count as u64, Relaxed);
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
        msg.extend_from_slice(&sender.hash(page, p.zero[k]));
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
    let (mut hits, mut zero_hits) = (0, 0);
    for (i, &k) in p.hashed.iter().enumerate() {
        if have[i / 8] & (1 << (i % 8)) != 0 {
            hits += 1;
            zero_hits += p.zero[k] as usize;
        } else {
            send[k] = true;
        }
    }
    sender.learned(hits, zero_hits);
    progress.round_sent.fetch_add(hits as u64, Relaxed);
    let follow = !p.deferred.is_empty() && hits > zero_hits;
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

/// Which pages of `data` (whole pages) are all zero. A data page's scan
/// stops at its first non-zero word.
pub(crate) fn zero_pages(data: &[u8]) -> Vec<bool> {
    data.chunks_exact(PAGE)
        .map(|p| {
            p.chunks_exact(64).all(|c| {
                c.chunks_exact(8).fold(0u64, |a, w| {
                    a | u64::from_ne_bytes(w.try_into().expect("8 bytes"))
                }) == 0
            })
        })
        .collect()
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
        let none = [false; BATCH];
        assert_eq!(s.pick(&none).len(), BATCH);
        s.learned(0, 0);
        s.learned(0, 0);
        let probe = s.pick(&none);
        assert_eq!(probe.len(), BATCH / PROBE_EVERY);
        assert_eq!(s.probes, 1);
        s.learned(1, 0);
        assert_eq!(s.pick(&none).len(), BATCH);
    }

    #[test]
    fn zero_pages_are_always_asked_about_and_never_keep_the_source_hashing() {
        let mut s = Sender::new(key());
        let mut zero = [false; BATCH];
        zero[5] = true;
        zero[6] = true;
        // Batches whose only hits are their zero pages.
        s.learned(2, 2);
        s.learned(2, 2);
        let asked = s.pick(&zero);
        assert_eq!(asked.len(), BATCH / PROBE_EVERY + 2);
        assert!(asked.contains(&5) && asked.contains(&6));
        // A zero page's hash is the constant; no content was hashed.
        let z = [0u8; PAGE];
        assert_eq!(s.hash(&z, true), key().zero().to_bytes());
        assert_eq!(s.hashed_data, 0);
        let mut d = [0u8; PAGE];
        d[PAGE - 1] = 1;
        assert_ne!(s.hash(&d, false), key().zero().to_bytes());
        assert_eq!(s.hashed_data, 1);
    }

    #[test]
    fn a_zero_scan_finds_a_single_set_byte_anywhere() {
        let mut data = vec![0u8; 4 * PAGE];
        data[PAGE + 4095] = 1;
        data[2 * PAGE] = 0x80;
        data[3 * PAGE + 2000] = 7;
        assert_eq!(zero_pages(&data), vec![true, false, false, false]);
    }

    #[test]
    fn the_bitmap_has_a_bit_per_hashed_page() {
        let f = [true, false, false, true, false, false, false, false, true];
        assert_eq!(bitmap(&f), vec![0b1001, 1]);
        assert!(bitmap(&[]).is_empty());
    }
}
