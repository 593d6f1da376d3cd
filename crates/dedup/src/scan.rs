//! Feeding a host's index: a scanner that hashes the memory of this host's
//! guests (their memfds, found through `/proc/PID/fd`) under a CPU budget,
//! as ksmd scans under its own.
//!
//! A pass reads every data range of a memfd (`SEEK_DATA`/`SEEK_HOLE`: holes
//! are never-touched or punched-out pages and cost nothing), hashes the
//! pages of it that are in memory outside the index's lock and records
//! them; pages in holes or in swap are forgotten (see [`crate::resident`]:
//! reading a swapped-out page would swap it in, charged to its guest).
//! Between chunks it sleeps so that its CPU time stays within the budget.

use crate::resident::GuestMemory;
use crate::{ContentIndex, ContentKey, SourceId, PAGE};
use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Pages hashed between two looks at the budget (256 KiB).
const CHUNK: usize = 64;

/// Name prefix of the memfds that hold guest memory (`memfd:` + region name).
pub const MEMFD_PREFIX: &str = "/memfd:pagefleet-";

/// Where a source's pages can be read from by another process on this
/// host: `/proc/PID/fd/FD`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ProcFd {
    /// The process holding it.
    pub pid: u32,
    /// Its descriptor number there.
    pub fd: u32,
}

impl ProcFd {
    /// Open it read-only, if it still is a guest memfd (a pid may have been
    /// reused: the link's name is checked, and every page read is checked
    /// against its hash anyway).
    pub fn open(&self) -> std::io::Result<File> {
        let path = format!("/proc/{}/fd/{}", self.pid, self.fd);
        let target = std::fs::read_link(&path)?;
        if !target.to_string_lossy().starts_with(MEMFD_PREFIX) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{path} is not a guest memfd"),
            ));
        }
        File::open(&path)
    }
}

/// The guest memfd of process `pid` (the largest `memfd:pagefleet-*` it
/// holds), if any.
pub fn find_memfd(pid: u32) -> Option<ProcFd> {
    let dir = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?;
    let mut best: Option<(u64, ProcFd)> = None;
    for e in dir.flatten() {
        let Ok(fd) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(t) = std::fs::read_link(e.path()) else {
            continue;
        };
        if !t.to_string_lossy().starts_with(MEMFD_PREFIX) {
            continue;
        }
        let len = std::fs::metadata(e.path()).map(|m| m.len()).unwrap_or(0);
        if best.is_none_or(|(l, _)| len > l) {
            best = Some((len, ProcFd { pid, fd }));
        }
    }
    best.map(|(_, p)| p)
}

/// A host's index with the sources it was fed from: what the lookup
/// service answers from.
pub struct HostIndex {
    /// The index.
    pub index: Mutex<ContentIndex>,
    /// Where each source can be opened.
    pub sources: Mutex<HashMap<SourceId, ProcFd>>,
    /// The key (a copy, so scanners hash without the lock).
    pub key: ContentKey,
}

impl HostIndex {
    /// An empty index of at most `max_pages` contents.
    pub fn new(key: ContentKey, max_pages: usize) -> HostIndex {
        HostIndex {
            index: Mutex::new(ContentIndex::new(key.clone(), max_pages)),
            sources: Mutex::new(HashMap::new()),
            key,
        }
    }

    /// The index, locked (a poisoned lock is taken over: the index holds
    /// hints only).
    pub fn lock(&self) -> std::sync::MutexGuard<'_, ContentIndex> {
        self.index.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn sources(&self) -> std::sync::MutexGuard<'_, HashMap<SourceId, ProcFd>> {
        self.sources.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Where source `id` can be opened.
    pub fn source(&self, id: SourceId) -> Option<ProcFd> {
        self.sources().get(&id).copied()
    }

    /// Keep exactly these sources (a guest that went away is forgotten).
    pub fn retain(&self, live: &[(SourceId, ProcFd)]) {
        let gone: Vec<SourceId> = self
            .sources()
            .iter()
            .filter(|(id, p)| !live.iter().any(|(l, lp)| l == *id && lp == *p))
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            self.sources().remove(&id);
            self.lock().remove_source(id);
        }
    }

    /// One pass over source `id` (readable at `at`): hash every page with
    /// data, forget the holes, spending at most `budget` of one CPU.
    /// Returns the pages hashed (None: stopped or the source went away).
    pub fn scan(&self, id: SourceId, at: ProcFd, budget: f64, stop: &AtomicBool) -> Option<u64> {
        let mem = GuestMemory::new(at.open().ok()?).ok()?;
        let pages = mem.pages().min(u32::MAX as u64) as u32;
        {
            self.sources().insert(id, at);
            self.lock().add_source(id, pages);
        }
        let mut buf = vec![0u8; CHUNK * PAGE];
        let mut here = [false; CHUNK];
        let mut hashed = 0u64;
        let mut p = 0u64;
        let pace = Pace::new(budget);
        while p < pages as u64 {
            if stop.load(Relaxed) {
                return None;
            }
            let (data, end) = crate::sys::data_range(mem.file(), p, pages as u64);
            // Holes before the next data: nothing to hash there.
            if data > p {
                let mut ix = self.lock();
                for q in p..data {
                    ix.forget(id, q as u32);
                }
            }
            let mut q = data;
            while q < end {
                if stop.load(Relaxed) {
                    return None;
                }
                let t = Instant::now();
                let n = ((end - q) as usize).min(CHUNK);
                // Only pages in memory are read: reading a swapped-out one
                // would swap it in behind its guest's memory limit.
                mem.resident(q, &mut here[..n]);
                let mut hs = Vec::with_capacity(n);
                let mut i = 0;
                while i < n {
                    let j = (i..n).find(|&k| here[k] != here[i]).unwrap_or(n);
                    if here[i] {
                        let b = &mut buf[..(j - i) * PAGE];
                        if mem
                            .file()
                            .read_exact_at(b, (q + i as u64) * PAGE as u64)
                            .is_err()
                        {
                            return None;
                        }
                        hs.extend(b.chunks_exact(PAGE).enumerate().map(|(k, c)| {
                            (i + k, Some(self.key.hash(c.try_into().expect("page"))))
                        }));
                    } else {
                        hs.extend((i..j).map(|k| (k, None)));
                    }
                    i = j;
                }
                {
                    let mut ix = self.lock();
                    for (k, h) in hs {
                        let page = (q + k as u64) as u32;
                        match h {
                            Some(h) => {
                                ix.record(id, page, h);
                                hashed += 1;
                            }
                            None => ix.forget(id, page),
                        }
                    }
                }
                q += n as u64;
                pace.after(t.elapsed());
            }
            p = if end > data { end } else { pages as u64 };
        }
        Some(hashed)
    }
}

/// The next run of pages with data at or after `from`: (first, end). When
/// there is none, (pages, pages).
/// The memory server's store as a content source (no guest has pid 0).
pub const STORE: SourceId = SourceId(0);

/// Copies slots `first..first + n` that changed since the last read and
/// hold pages into the buffer (slot `first + i` at `i * PAGE`) and says,
/// per slot, `Some(true)` copied, `Some(false)` holds no page, `None`
/// unchanged since the last read (what the index has for it stands).
pub type ReadSlots<'a> = dyn FnMut(u32, usize, &mut [u8]) -> Vec<Option<bool>> + 'a;

impl HostIndex {
    /// One pass over a slot store (the memory server's pool) of `slots`
    /// slots: of the slots changed since the last pass, those holding a
    /// page are hashed, the others forgotten (a store of 64 GiB is not
    /// re-hashed every pass for the few pages written meanwhile). Same
    /// pacing as [`HostIndex::scan`]; returns the pages hashed, `None` if
    /// stopped.
    pub fn scan_slots(
        &self,
        id: SourceId,
        slots: u32,
        read: &mut ReadSlots<'_>,
        budget: f64,
        stop: &AtomicBool,
    ) -> Option<u64> {
        self.lock().add_source(id, slots);
        let mut buf = vec![0u8; CHUNK * PAGE];
        let pace = Pace::new(budget);
        let mut hashed = 0u64;
        let mut first = 0u32;
        while first < slots {
            if stop.load(Relaxed) {
                return None;
            }
            let t = Instant::now();
            let n = ((slots - first) as usize).min(CHUNK);
            let held = read(first, n, &mut buf[..n * PAGE]);
            let hs: Vec<_> = held
                .iter()
                .enumerate()
                .map(|(k, h)| {
                    h.map(|h| {
                        h.then(|| {
                            let page = &buf[k * PAGE..(k + 1) * PAGE];
                            self.key.hash(page.try_into().expect("page"))
                        })
                    })
                })
                .collect();
            if hs.iter().any(Option::is_some) {
                let mut ix = self.lock();
                for (k, h) in hs.into_iter().enumerate() {
                    let slot = first + k as u32;
                    match h {
                        Some(Some(h)) => {
                            ix.record(id, slot, h);
                            hashed += 1;
                        }
                        Some(None) => ix.forget(id, slot),
                        None => {}
                    }
                }
            }
            first += n as u32;
            pace.after(t.elapsed());
        }
        Some(hashed)
    }
}

/// Sleeps after work so that work takes at most `budget` of the time.
struct Pace {
    factor: f64,
}

impl Pace {
    fn new(budget: f64) -> Pace {
        let b = budget.clamp(0.001, 1.0);
        Pace {
            factor: 1.0 / b - 1.0,
        }
    }
    fn after(&self, busy: Duration) {
        if self.factor > 0.0 {
            std::thread::sleep(busy.mul_f64(self.factor));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pagefleet_proto::auth::Secret;
    use std::os::fd::AsRawFd;

    fn key() -> ContentKey {
        let s = Secret::from_bytes(b"0123456789abcdef0123456789abcdef", "test").unwrap();
        ContentKey::from_secret(&s)
    }

    /// A real memfd named as guest memory, with data in some pages only.
    fn memfd(pages: u64, data: &[(u64, u8)]) -> File {
        let f = crate::sys::memfd(c"pagefleet-scan-test", pages * PAGE as u64);
        for &(p, v) in data {
            f.write_all_at(&[v; PAGE], p * PAGE as u64).unwrap();
        }
        f
    }

    #[test]
    fn a_pass_indexes_the_data_pages_of_this_process_memfd() {
        let f = memfd(300, &[(3, 7), (4, 8), (200, 9)]);
        // Tests run side by side: name this test's memfd, not the largest.
        let at = ProcFd {
            pid: std::process::id(),
            fd: f.as_raw_fd() as u32,
        };
        assert!(find_memfd(at.pid).is_some());
        let hi = HostIndex::new(key(), 1000);
        let stop = AtomicBool::new(false);
        let n = hi.scan(SourceId(1), at, 1.0, &stop).unwrap();
        assert_eq!(n, 3, "only pages with data are hashed");
        let k = key();
        let mut ix = hi.lock();
        let loc = ix.lookup(&k.hash(&[8; PAGE])).unwrap().unwrap();
        assert_eq!((loc.source, loc.page), (SourceId(1), 4));
        assert!(ix.lookup(&k.hash(&[1; PAGE])).is_none());
        drop(ix);
        // A page punched out is forgotten on the next pass.
        crate::sys::punch_hole(&f, 4 * PAGE as u64, PAGE as u64).unwrap();
        hi.scan(SourceId(1), at, 1.0, &stop).unwrap();
        assert!(hi.lock().lookup(&k.hash(&[8; PAGE])).is_none());
        hi.retain(&[]);
        assert!(hi.lock().lookup(&k.hash(&[9; PAGE])).is_none());
        drop(f);
    }

    #[test]
    fn a_file_that_is_not_guest_memory_is_refused() {
        let me = std::process::id();
        let f = File::open("/proc/self/status").unwrap();
        let at = ProcFd {
            pid: me,
            fd: f.as_raw_fd() as u32,
        };
        assert!(at.open().is_err());
    }
}
