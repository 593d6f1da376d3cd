//! The host's lookup service: a process of this host (an incoming
//! migration's runner) asks which of a batch of contents the host holds
//! and where; it then reads those pages itself and checks each against its
//! hash before using it.
//!
//! Over a unix socket, owned by the daemon (mode 0600 in its directory);
//! the daemon answers only processes it authorizes by their kernel
//! credentials (`SO_PEERCRED`: its own runners), before reading a byte.
//!
//! ```text
//! request  "PFLK" count:u32 LE, count × 16-byte hash
//! reply    "PFLR" count:u32 LE, count × (kind:u8 pad:3 pid:u32 fd:u32 page:u32),
//!          then 4096 bytes for each kind-3 entry, in order
//!          kind 0: not here, 1: the zero page, 2: page `page` of /proc/pid/fd/fd,
//!          3: a page of the daemon's memory server store, its bytes inline
//! request  "PFLF" 0:u32                      — the index's Bloom filter
//! reply    "PFLB" words:u32 LE, words × u64 LE
//! ```
//!
//! The client asks about a content only if the filter (fetched when it
//! connects: an incoming runner connects as its migration starts) says it
//! may be here, and knows the zero
//! page itself: a migration that finds nothing costs no round trips.

use crate::resident::GuestMemory;
use crate::scan::{HostIndex, ProcFd, STORE};
use crate::{ContentKey, PageHash, PAGE};
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;

const REQUEST: [u8; 4] = *b"PFLK";
const REPLY: [u8; 4] = *b"PFLR";
const FILTER_REQUEST: [u8; 4] = *b"PFLF";
const FILTER_REPLY: [u8; 4] = *b"PFLB";
/// Largest filter accepted (64 MiB: 50 M contents).
const MAX_FILTER_WORDS: usize = 8 << 20;
/// Most hashes in one request.
pub const MAX_LOOKUP: usize = 4096;
const ENTRY: usize = 16;

/// The kernel's word on who is at the other end of a unix socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peer {
    /// Its process.
    pub pid: u32,
    /// Its user.
    pub uid: u32,
}

/// `SO_PEERCRED` of a connected unix socket.
pub fn peer_of(s: &UnixStream) -> io::Result<Peer> {
    let (pid, uid) = crate::sys::peer_cred(s)?;
    Ok(Peer { pid, uid })
}

/// Copies a slot of this daemon's memory server store (if it holds a
/// page) into the buffer.
pub type StoreSlots = Arc<dyn Fn(u32, &mut [u8]) -> bool + Send + Sync>;

/// Serve lookups on `l` from `hi`, to peers `authorize` accepts; hits in
/// the memory server's store are read with `slots` and sent inline (the
/// runner cannot read the daemon's memory). Runs until the listener fails.
pub fn serve(
    l: UnixListener,
    hi: Arc<HostIndex>,
    authorize: Arc<dyn Fn(Peer) -> bool + Send + Sync>,
    slots: Option<StoreSlots>,
) {
    for s in l.incoming() {
        let Ok(s) = s else { continue };
        match peer_of(&s) {
            Ok(p) if authorize(p) => {
                let hi = hi.clone();
                let slots = slots.clone();
                let _ = std::thread::Builder::new()
                    .name("dedup lookup".into())
                    .spawn(move || {
                        if let Err(e) = answer(s, &hi, slots.as_ref()) {
                            tracing::debug!("dedup lookup from pid {}: {e}", p.pid);
                        }
                    });
            }
            Ok(p) => tracing::warn!(
                "refused a dedup lookup from pid {} uid {}: not a runner of this host",
                p.pid,
                p.uid
            ),
            Err(e) => tracing::warn!("dedup lookup: {e}"),
        }
    }
}

fn answer(mut s: UnixStream, hi: &HostIndex, slots: Option<&StoreSlots>) -> io::Result<()> {
    let mut hashes = Vec::new();
    let mut out = Vec::new();
    let mut inline = Vec::new();
    loop {
        let mut h = [0u8; 8];
        match s.read_exact(&mut h) {
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            r => r?,
        }
        let count = u32::from_le_bytes(h[4..8].try_into().unwrap()) as usize;
        if h[..4] == FILTER_REQUEST {
            let f = hi.lock().filter();
            out.clear();
            out.extend_from_slice(&FILTER_REPLY);
            out.extend_from_slice(&(f.words().len() as u32).to_le_bytes());
            for w in f.words() {
                out.extend_from_slice(&w.to_le_bytes());
            }
            s.write_all(&out)?;
            continue;
        }
        if h[..4] != REQUEST || count > MAX_LOOKUP {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "not a lookup request",
            ));
        }
        hashes.resize(count * 16, 0);
        s.read_exact(&mut hashes)?;
        out.clear();
        out.extend_from_slice(&REPLY);
        out.extend_from_slice(&(count as u32).to_le_bytes());
        let found: Vec<_> = {
            let mut ix = hi.lock();
            hashes
                .chunks_exact(16)
                .map(|b| ix.lookup(&PageHash(b.try_into().unwrap())))
                .collect()
        };
        inline.clear();
        for f in found {
            let mut e = [0u8; ENTRY];
            match f {
                None => {}
                Some(None) => e[0] = 1,
                Some(Some(loc)) if loc.source == STORE => {
                    if let Some(read) = slots {
                        let at = inline.len();
                        inline.resize(at + PAGE, 0);
                        if read(loc.page, &mut inline[at..]) {
                            e[0] = 3;
                        } else {
                            inline.truncate(at);
                        }
                    }
                }
                Some(Some(loc)) => {
                    if let Some(at) = hi.source(loc.source) {
                        e[0] = 2;
                        e[4..8].copy_from_slice(&at.pid.to_le_bytes());
                        e[8..12].copy_from_slice(&at.fd.to_le_bytes());
                        e[12..16].copy_from_slice(&loc.page.to_le_bytes());
                    }
                }
            }
            out.extend_from_slice(&e);
        }
        out.extend_from_slice(&inline);
        s.write_all(&out)?;
    }
}

/// Read page `page` of `m` into `dst` if it is in memory (a hint is never
/// worth swapping another guest's page in) and check it against `hash`.
pub fn read_checked(
    key: &ContentKey,
    m: &GuestMemory,
    page: u64,
    hash: &PageHash,
    dst: &mut [u8; PAGE],
) -> bool {
    m.read_resident(page, dst) && key.hash(dst) == *hash
}

/// What a lookup found for one content.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Found {
    /// Not here (or no longer what it was indexed as).
    Miss,
    /// The zero page.
    Zero,
    /// Here: its bytes are in the caller's buffer, checked against the hash.
    Data,
}

/// What a client's lookups came to.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ClientStats {
    /// Contents asked for.
    pub asked: u64,
    /// Found with data (checked).
    pub data: u64,
    /// Found as the zero page.
    pub zero: u64,
    /// The index pointed at a page that had changed since (a stale hint,
    /// counted as a miss).
    pub stale: u64,
    /// Answered here without asking: the zero page, or not in the filter.
    pub local: u64,
    /// Seconds waiting for the host's answers.
    pub ask_secs: f64,
    /// Seconds reading and checking pages.
    pub check_secs: f64,
}

/// A process's connection to its host's lookup service.
pub struct LookupClient {
    s: UnixStream,
    key: ContentKey,
    zero: PageHash,
    filter: Option<crate::Filter>,
    files: HashMap<ProcFd, Option<GuestMemory>>,
    reply: Vec<u8>,
    /// Counters.
    pub stats: ClientStats,
}

impl LookupClient {
    /// Connect to the service at `path`; pages are checked with `key`.
    pub fn connect(path: &std::path::Path, key: ContentKey) -> io::Result<LookupClient> {
        let s = UnixStream::connect(path)?;
        s.set_read_timeout(Some(std::time::Duration::from_secs(10)))?;
        s.set_write_timeout(Some(std::time::Duration::from_secs(10)))?;
        let mut c = LookupClient {
            s,
            zero: key.zero(),
            key,
            filter: None,
            files: HashMap::new(),
            reply: Vec::new(),
            stats: ClientStats::default(),
        };
        c.refresh_filter()?;
        Ok(c)
    }

    /// Fetch the index's filter again (the host's guests change).
    pub fn refresh_filter(&mut self) -> io::Result<()> {
        let mut req = FILTER_REQUEST.to_vec();
        req.extend_from_slice(&0u32.to_le_bytes());
        self.s.write_all(&req)?;
        let mut h = [0u8; 8];
        self.s.read_exact(&mut h)?;
        let n = u32::from_le_bytes(h[4..8].try_into().unwrap()) as usize;
        if h[..4] != FILTER_REPLY || n > MAX_FILTER_WORDS {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "malformed filter reply",
            ));
        }
        let mut b = vec![0u8; n * 8];
        self.s.read_exact(&mut b)?;
        let words = b
            .chunks_exact(8)
            .map(|w| u64::from_le_bytes(w.try_into().unwrap()))
            .collect();
        self.filter = Some(crate::Filter::from_words(words).ok_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidData, "filter size not a power of two")
        })?);
        Ok(())
    }

    /// Find `hashes` here: for each, whether the host holds it; the page's
    /// bytes of each [`Found::Data`] are written to `out[k * PAGE..]`
    /// (`out` holds `hashes.len()` pages) after they were checked against
    /// the hash. A reading or checking failure is a miss, never an error.
    pub fn find(&mut self, hashes: &[PageHash], out: &mut [u8]) -> io::Result<Vec<Found>> {
        assert!(
            out.len() >= hashes.len() * PAGE,
            "one page of room per hash"
        );
        let mut rooms: Vec<&mut [u8]> = out.chunks_mut(PAGE).take(hashes.len()).collect();
        self.find_into(hashes, &mut rooms)
    }

    /// [`LookupClient::find`], the page of `hashes[k]` going to `out[k]`
    /// (one page each; e.g. straight into guest memory). A page that fails
    /// its check leaves its room holding what it read: the caller fills a
    /// miss's room itself.
    pub fn find_into(
        &mut self,
        hashes: &[PageHash],
        out: &mut [&mut [u8]],
    ) -> io::Result<Vec<Found>> {
        assert!(out.len() >= hashes.len(), "one room per hash");
        let mut res = Vec::with_capacity(hashes.len());
        for (part, rooms) in hashes.chunks(MAX_LOOKUP).zip(out.chunks_mut(MAX_LOOKUP)) {
            self.find_some(part, rooms, &mut res)?;
        }
        Ok(res)
    }

    fn find_some(
        &mut self,
        hashes: &[PageHash],
        out: &mut [&mut [u8]],
        res: &mut Vec<Found>,
    ) -> io::Result<()> {
        self.stats.asked += hashes.len() as u64;
        // Answered here: the zero page, and what the filter rules out.
        let ask: Vec<usize> = (0..hashes.len())
            .filter(|&k| {
                hashes[k] != self.zero
                    && self
                        .filter
                        .as_ref()
                        .is_none_or(|f| f.may_contain(&hashes[k]))
            })
            .collect();
        self.stats.local += (hashes.len() - ask.len()) as u64;
        let first = res.len();
        for h in hashes {
            res.push(if *h == self.zero {
                self.stats.zero += 1;
                Found::Zero
            } else {
                Found::Miss
            });
        }
        if ask.is_empty() {
            return Ok(());
        }
        let mut req = Vec::with_capacity(8 + ask.len() * 16);
        req.extend_from_slice(&REQUEST);
        req.extend_from_slice(&(ask.len() as u32).to_le_bytes());
        for &k in &ask {
            req.extend_from_slice(&hashes[k].0);
        }
        let t = std::time::Instant::now();
        self.s.write_all(&req)?;
        self.reply.resize(8 + ask.len() * ENTRY, 0);
        self.s.read_exact(&mut self.reply)?;
        self.stats.ask_secs += t.elapsed().as_secs_f64();
        let count = u32::from_le_bytes(self.reply[4..8].try_into().unwrap()) as usize;
        if self.reply[..4] != REPLY || count != ask.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "malformed lookup reply",
            ));
        }
        let inline = self.reply[8..]
            .chunks_exact(ENTRY)
            .filter(|e| e[0] == 3)
            .count();
        let mut pages = vec![0u8; inline * PAGE];
        self.s.read_exact(&mut pages)?;
        let mut pages = pages.chunks_exact(PAGE);
        // Hints to pages here: open their files (once), then read and
        // check the pages.
        let mut work: Vec<(usize, ProcFd, u64, &mut [u8])> = Vec::new();
        let mut sent: Vec<(usize, bool)> = Vec::new();
        for (i, &k) in ask.iter().enumerate() {
            let e = &self.reply[8 + i * ENTRY..8 + (i + 1) * ENTRY];
            match e[0] {
                1 => {
                    self.stats.zero += 1;
                    res[first + k] = Found::Zero;
                }
                2 => {
                    let at = ProcFd {
                        pid: u32::from_le_bytes(e[4..8].try_into().unwrap()),
                        fd: u32::from_le_bytes(e[8..12].try_into().unwrap()),
                    };
                    let page = u32::from_le_bytes(e[12..16].try_into().unwrap()) as u64;
                    self.files
                        .entry(at)
                        .or_insert_with(|| at.open().and_then(GuestMemory::new).ok());
                    work.push((k, at, page, std::mem::take(&mut out[k])));
                }
                3 => {
                    let p = pages.next().expect("counted above");
                    let room = &mut out[k][..PAGE];
                    room.copy_from_slice(p);
                    let page: &[u8; PAGE] = (&*room).try_into().expect("page");
                    sent.push((k, self.key.hash(page) == hashes[k]));
                }
                _ => {}
            }
        }
        let t = std::time::Instant::now();
        let (files, key) = (&self.files, &self.key);
        let checked: Vec<(usize, bool)> = work
            .iter_mut()
            .map(|(k, at, page, room)| {
                let ok = match (files.get(at), (&mut room[..]).try_into()) {
                    (Some(Some(f)), Ok(dst)) => read_checked(key, f, *page, &hashes[*k], dst),
                    _ => false,
                };
                (*k, ok)
            })
            .collect();
        self.stats.check_secs += t.elapsed().as_secs_f64();
        for (k, ok) in checked.into_iter().chain(sent) {
            if ok {
                self.stats.data += 1;
                res[first + k] = Found::Data;
            } else {
                self.stats.stale += 1;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SourceId;
    use pagefleet_proto::auth::Secret;
    use std::os::unix::fs::FileExt;

    fn key() -> ContentKey {
        let s = Secret::from_bytes(b"0123456789abcdef0123456789abcdef", "test").unwrap();
        ContentKey::from_secret(&s)
    }

    #[test]
    fn a_runner_finds_pages_its_host_holds_and_a_stale_hint_is_a_miss() {
        let f = crate::sys::memfd(c"pagefleet-lookup-test", 16 * PAGE as u64);
        f.write_all_at(&[5; PAGE], 2 * PAGE as u64).unwrap();
        f.write_all_at(&[6; PAGE], 3 * PAGE as u64).unwrap();
        let hi = Arc::new(HostIndex::new(key(), 100));
        let at = ProcFd {
            pid: std::process::id(),
            fd: std::os::fd::AsRawFd::as_raw_fd(&f) as u32,
        };
        let stop = std::sync::atomic::AtomicBool::new(false);
        hi.scan(SourceId(7), at, 1.0, &stop).unwrap();

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lookup.sock");
        let l = UnixListener::bind(&path).unwrap();
        let me = std::process::id();
        let h2 = hi.clone();
        // A store of one slot holding a page of 4s.
        let mut read = |first: u32, n: usize, buf: &mut [u8]| -> Vec<Option<bool>> {
            assert_eq!((first, n), (0, 1));
            buf[..PAGE].fill(4);
            vec![Some(true)]
        };
        hi.scan_slots(STORE, 1, &mut read, 1.0, &stop).unwrap();
        let slots: StoreSlots = Arc::new(|slot: u32, dst: &mut [u8]| {
            dst.fill(4);
            slot == 0
        });
        std::thread::spawn(move || serve(l, h2, Arc::new(move |p: Peer| p.pid == me), Some(slots)));

        let k = key();
        let mut c = LookupClient::connect(&path, k.clone()).unwrap();
        // Page 3 changes after the scan: its old content is no longer here.
        f.write_all_at(&[9; PAGE], 3 * PAGE as u64).unwrap();
        let asked = [
            k.hash(&[5; PAGE]),
            k.hash(&[0; PAGE]),
            k.hash(&[6; PAGE]),
            k.hash(&[1; PAGE]),
            k.hash(&[4; PAGE]),
        ];
        let mut out = vec![0u8; asked.len() * PAGE];
        let r = c.find(&asked, &mut out).unwrap();
        assert_eq!(
            r,
            vec![
                Found::Data,
                Found::Zero,
                Found::Miss,
                Found::Miss,
                Found::Data
            ]
        );
        assert!(out[..PAGE].iter().all(|&b| b == 5));
        assert!(
            out[4 * PAGE..].iter().all(|&b| b == 4),
            "the store's page, inline"
        );
        assert_eq!(c.stats.stale, 1);
    }

    #[test]
    fn a_stranger_is_refused_before_anything_is_read() {
        let hi = Arc::new(HostIndex::new(key(), 100));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lookup.sock");
        let l = UnixListener::bind(&path).unwrap();
        std::thread::spawn(move || serve(l, hi, Arc::new(|_| false), None));
        assert!(LookupClient::connect(&path, key()).is_err());
    }
}
