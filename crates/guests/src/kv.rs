//! `kv`: a key-value server speaking memcached's text protocol whose hash
//! table, items and allocator all live in guest memory (the region). Real
//! memcached clients work against it (libmemcached's tools, memcaslap,
//! pymemcache). Opening memory that already holds a table resumes it.
//!
//! Layout: a 4 KiB header (magic, geometry, allocator heads, counters), the
//! bucket array (u64 item offsets), then an arena of items in power-of-two
//! size classes from 64 B to 2 MiB with per-class free lists.

use crate::Mem;
use std::io::{BufRead, BufReader, BufWriter, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tracing::{debug, warn};

const MAGIC: u64 = 0x5046_4b56_0000_0001; // "PFKV" v1
const H_MAGIC: usize = 0;
const H_NBUCKETS: usize = 8;
const H_ARENA_START: usize = 16;
const H_ARENA_END: usize = 24;
const H_BUMP: usize = 32;
const H_ITEMS: usize = 40;
const H_BYTES: usize = 48;
const H_CAS: usize = 56;
const H_FREE: usize = 64; // 16 class heads
const NCLASS: usize = 16;
const MIN_CLASS: usize = 64;
const ITEM_HDR: usize = 32;
const STRIPES: usize = 64;
/// Longest key (memcached's limit).
pub const MAX_KEY: usize = 250;
/// Largest value.
pub const MAX_VALUE: usize = 1 << 20;

/// The outcome of a storage command.
#[derive(Debug, PartialEq, Eq)]
pub enum Store {
    /// Stored.
    Stored,
    /// Not stored (add of an existing key, replace/append of a missing one).
    NotStored,
    /// cas: the item changed since it was read.
    Exists,
    /// cas: no such item.
    NotFound,
    /// No room in the guest memory.
    NoMemory,
}

/// A storage command.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Store unconditionally.
    Set,
    /// Store if absent.
    Add,
    /// Store if present.
    Replace,
    /// Add to the end of a present value.
    Append,
    /// Add to the start of a present value.
    Prepend,
    /// Store if the item still has this cas id.
    Cas(u64),
}

/// Extra `stats` lines a host adds (the runner adds its region's counters).
pub type ExtraStats = Box<dyn Fn() -> Vec<(String, u64)> + Send + Sync>;

/// A memcached-protocol table living entirely in guest memory.
pub struct Kv {
    mem: Mem,
    /// Extra lines for `stats` (the runner adds its region's counters).
    pub extra_stats: Option<ExtraStats>,
    /// Bucket-striped locks: a page fault while one request holds its stripe
    /// (the item is on a memory server) does not stall requests elsewhere.
    /// Readers share a stripe: a get that faults (its item is on a memory
    /// server) holds up only the writers of that stripe, not other gets.
    stripes: Vec<RwLock<()>>,
    /// Guards the allocator and the header counters.
    alloc_lock: Mutex<()>,
    /// Safepoint: every request passes through it (migration quiesces here).
    pub gate: Arc<crate::Gate>,
    /// Requests served.
    pub ops: AtomicU64,
    /// get requests.
    pub gets: AtomicU64,
    /// gets that found their item.
    pub hits: AtomicU64,
    /// Storage requests.
    pub sets: AtomicU64,
    /// Connected clients (a copy of each socket), so a guest moving away
    /// can hang them up at once instead of leaving them to time out.
    clients: Mutex<std::collections::HashMap<u64, TcpStream>>,
    next_client: AtomicU64,
}

fn now() -> u32 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as u32)
        .unwrap_or(0)
}

fn hash(key: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key {
        h ^= *b as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h
}

fn class_of(size: usize) -> Option<usize> {
    let c = size.max(MIN_CLASS).next_power_of_two().trailing_zeros() as usize
        - MIN_CLASS.trailing_zeros() as usize;
    (c < NCLASS).then_some(c)
}

/// memcached's exptime: 0 never; ≤ 30 days relative; else absolute; negative: already expired.
fn abs_exptime(e: i64) -> u32 {
    if e == 0 {
        0
    } else if e < 0 {
        1
    } else if e <= 30 * 24 * 3600 {
        now().saturating_add(e as u32)
    } else {
        e as u32
    }
}

impl Kv {
    /// Open the table in `mem`, creating it if the memory does not hold one.
    pub fn open(mem: Mem) -> Kv {
        let kv = Kv {
            mem,
            extra_stats: None,
            stripes: (0..STRIPES).map(|_| RwLock::new(())).collect(),
            alloc_lock: Mutex::new(()),
            gate: Arc::new(crate::Gate::default()),
            ops: AtomicU64::new(0),
            gets: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            sets: AtomicU64::new(0),
            clients: Mutex::new(std::collections::HashMap::new()),
            next_client: AtomicU64::new(0),
        };
        if kv.r(H_MAGIC) != MAGIC {
            kv.format();
        }
        kv
    }

    fn r(&self, off: usize) -> u64 {
        self.mem.read_u64(off)
    }
    fn w(&self, off: usize, v: u64) {
        self.mem.write_u64(off, v)
    }
    fn bytes(&self, off: usize, len: usize) -> &[u8] {
        // SAFETY: offsets come from our own item layout, inside the region.
        unsafe { std::slice::from_raw_parts(self.mem.base.add(off), len) }
    }
    #[allow(clippy::mut_from_ref)]
    fn bytes_mut(&self, off: usize, len: usize) -> &mut [u8] {
        // SAFETY: as above; callers hold the lock.
        unsafe { std::slice::from_raw_parts_mut(self.mem.base.add(off), len) }
    }

    fn format(&self) {
        let len = self.mem.len;
        let nb = ((len / 1024).max(1024)).next_power_of_two().min(1 << 26);
        let arena = (4096 + nb * 8).div_ceil(64) * 64;
        for b in 0..nb {
            self.w(4096 + b * 8, 0);
        }
        for c in 0..NCLASS {
            self.w(H_FREE + c * 8, 0);
        }
        self.w(H_NBUCKETS, nb as u64);
        self.w(H_ARENA_START, arena as u64);
        self.w(H_ARENA_END, len as u64);
        self.w(H_BUMP, arena as u64);
        self.w(H_ITEMS, 0);
        self.w(H_BYTES, 0);
        self.w(H_CAS, 1);
        self.w(H_MAGIC, MAGIC);
    }

    /// Items stored.
    pub fn items(&self) -> u64 {
        self.r(H_ITEMS)
    }
    /// Bytes of values stored.
    pub fn value_bytes(&self) -> u64 {
        self.r(H_BYTES)
    }

    fn bucket(&self, key: &[u8]) -> usize {
        4096 + (hash(key) as usize & (self.r(H_NBUCKETS) as usize - 1)) * 8
    }

    fn stripe(&self, key: &[u8]) -> RwLockWriteGuard<'_, ()> {
        let b = (self.bucket(key) - 4096) / 8;
        self.stripes[b % STRIPES]
            .write()
            .unwrap_or_else(|e| e.into_inner())
    }

    fn stripe_read(&self, key: &[u8]) -> RwLockReadGuard<'_, ()> {
        let b = (self.bucket(key) - 4096) / 8;
        self.stripes[b % STRIPES]
            .read()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Look up without modifying anything (safe under a read lock): an
    /// expired item is a miss here and is unlinked by the next writer.
    fn find_ro(&self, key: &[u8]) -> Option<usize> {
        let mut it = self.r(self.bucket(key)) as usize;
        let t = now();
        while it != 0 {
            if self.i_key(it) == key {
                let (_, exp, ..) = self.i_meta(it);
                return (exp == 0 || exp > t).then_some(it);
            }
            it = self.i_next(it);
        }
        None
    }

    // item field accessors
    fn i_next(&self, it: usize) -> usize {
        self.r(it) as usize
    }
    fn i_meta(&self, it: usize) -> (u64, u32, u32, usize, usize, usize) {
        let cas = self.r(it + 8);
        let a = self.r(it + 16);
        let b = self.r(it + 24);
        let (exp, flags) = (a as u32, (a >> 32) as u32);
        let vlen = b as u32 as usize;
        let klen = (b >> 32) as u16 as usize;
        let class = (b >> 48) as u8 as usize;
        (cas, exp, flags, vlen, klen, class)
    }
    fn i_key(&self, it: usize) -> &[u8] {
        let (_, _, _, _, klen, _) = self.i_meta(it);
        self.bytes(it + ITEM_HDR, klen)
    }

    fn alloc(&self, size: usize) -> Option<(usize, usize)> {
        let c = class_of(size)?;
        let _a = self.alloc_lock.lock().unwrap_or_else(|e| e.into_inner());
        let head = self.r(H_FREE + c * 8) as usize;
        if head != 0 {
            self.w(H_FREE + c * 8, self.r(head));
            return Some((head, c));
        }
        let bump = self.r(H_BUMP) as usize;
        let sz = MIN_CLASS << c;
        if bump + sz > self.r(H_ARENA_END) as usize {
            return None;
        }
        self.w(H_BUMP, (bump + sz) as u64);
        Some((bump, c))
    }

    fn free(&self, it: usize) {
        let (_, _, _, vlen, _, class) = self.i_meta(it);
        let _a = self.alloc_lock.lock().unwrap_or_else(|e| e.into_inner());
        self.w(it, self.r(H_FREE + class * 8));
        self.w(H_FREE + class * 8, it as u64);
        self.w(H_ITEMS, self.r(H_ITEMS) - 1);
        self.w(H_BYTES, self.r(H_BYTES) - vlen as u64);
    }

    /// Find a live item; unlink and free it if expired. Returns (prev link offset, item).
    fn find(&self, key: &[u8]) -> Option<(usize, usize)> {
        let mut link = self.bucket(key);
        let t = now();
        loop {
            let it = self.r(link) as usize;
            if it == 0 {
                return None;
            }
            if self.i_key(it) == key {
                let (_, exp, ..) = self.i_meta(it);
                if exp != 0 && exp <= t {
                    self.w(link, self.i_next(it) as u64);
                    self.free(it);
                    return None;
                }
                return Some((link, it));
            }
            link = it;
        }
    }

    fn write_item(&self, key: &[u8], flags: u32, exp: u32, parts: &[&[u8]]) -> Option<usize> {
        let vlen: usize = parts.iter().map(|p| p.len()).sum();
        let (it, class) = self.alloc(ITEM_HDR + key.len() + vlen)?;
        let cas = {
            let _a = self.alloc_lock.lock().unwrap_or_else(|e| e.into_inner());
            let cas = self.r(H_CAS);
            self.w(H_CAS, cas + 1);
            self.w(H_ITEMS, self.r(H_ITEMS) + 1);
            self.w(H_BYTES, self.r(H_BYTES) + vlen as u64);
            cas
        };
        self.w(it, 0);
        self.w(it + 8, cas);
        self.w(it + 16, exp as u64 | (flags as u64) << 32);
        self.w(
            it + 24,
            vlen as u64 | (key.len() as u64) << 32 | (class as u64) << 48,
        );
        self.bytes_mut(it + ITEM_HDR, key.len())
            .copy_from_slice(key);
        let mut at = it + ITEM_HDR + key.len();
        for p in parts {
            self.bytes_mut(at, p.len()).copy_from_slice(p);
            at += p.len();
        }
        Some(it)
    }

    /// Get: (flags, cas, value) copied out.
    pub fn get(&self, key: &[u8]) -> Option<(u32, u64, Vec<u8>)> {
        let _g = self.stripe_read(key);
        self.gets.fetch_add(1, Relaxed);
        let it = self.find_ro(key)?;
        let (cas, _, flags, vlen, klen, _) = self.i_meta(it);
        self.hits.fetch_add(1, Relaxed);
        Some((flags, cas, self.bytes(it + ITEM_HDR + klen, vlen).to_vec()))
    }

    /// A storage command on `key`.
    pub fn store(&self, mode: Mode, key: &[u8], flags: u32, exptime: i64, data: &[u8]) -> Store {
        let _g = self.stripe(key);
        self.sets.fetch_add(1, Relaxed);
        let found = self.find(key);
        let (parts, flags, exp): (Vec<&[u8]>, u32, u32) = match (mode, found) {
            (Mode::Add, Some(_)) => return Store::NotStored,
            (Mode::Replace | Mode::Append | Mode::Prepend, None) => return Store::NotStored,
            (Mode::Cas(_), None) => return Store::NotFound,
            (Mode::Cas(c), Some((_, it))) if self.i_meta(it).0 != c => return Store::Exists,
            (Mode::Append | Mode::Prepend, Some((_, it))) => {
                let (_, exp, fl, vlen, klen, _) = self.i_meta(it);
                if vlen + data.len() > MAX_VALUE {
                    return Store::NoMemory;
                }
                let old = self.bytes(it + ITEM_HDR + klen, vlen);
                let parts = if mode == Mode::Append {
                    vec![old, data]
                } else {
                    vec![data, old]
                };
                (parts, fl, exp)
            }
            _ => (vec![data], flags, abs_exptime(exptime)),
        };
        // Build the new item before unlinking the old (append reads the old value).
        let Some(new) = self.write_item(key, flags, exp, &parts) else {
            return Store::NoMemory;
        };
        let link = self.bucket(key);
        if let Some((prev, old)) = self.find(key) {
            self.w(prev, self.i_next(old) as u64);
            self.free(old);
        }
        self.w(new, self.r(link));
        self.w(link, new as u64);
        Store::Stored
    }

    /// Remove `key`; whether it was there.
    pub fn delete(&self, key: &[u8]) -> bool {
        let _g = self.stripe(key);
        match self.find(key) {
            Some((prev, it)) => {
                self.w(prev, self.i_next(it) as u64);
                self.free(it);
                true
            }
            None => false,
        }
    }

    /// incr/decr: Ok(Some(new)), Ok(None) when absent, Err when not a number.
    #[allow(clippy::result_unit_err)]
    pub fn incr(&self, key: &[u8], delta: u64, up: bool) -> Result<Option<u64>, ()> {
        let _g = self.stripe(key);
        let cur = {
            let Some((_, it)) = self.find(key) else {
                return Ok(None);
            };
            let (_, _, _, vlen, klen, _) = self.i_meta(it);
            let v = self.bytes(it + ITEM_HDR + klen, vlen);
            std::str::from_utf8(v)
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
                .ok_or(())?
        };
        let new = if up {
            cur.wrapping_add(delta)
        } else {
            cur.saturating_sub(delta)
        };
        let Some((prev, it)) = self.find(key) else {
            return Ok(None);
        };
        let (_, exp, flags, ..) = self.i_meta(it);
        let s = new.to_string();
        let Some(n) = self.write_item(key, flags, exp, &[s.as_bytes()]) else {
            return Err(());
        };
        self.w(n, self.i_next(it) as u64);
        self.w(prev, n as u64);
        self.free(it);
        Ok(Some(new))
    }

    /// Give `key` a new expiry; whether it was there.
    pub fn touch(&self, key: &[u8], exptime: i64) -> bool {
        let _g = self.stripe(key);
        let Some((_, it)) = self.find(key) else {
            return false;
        };
        let (_, _, flags, ..) = self.i_meta(it);
        self.w(it + 16, abs_exptime(exptime) as u64 | (flags as u64) << 32);
        true
    }

    /// Empty the table.
    pub fn flush_all(&self) {
        let _all: Vec<_> = self
            .stripes
            .iter()
            .map(|m| m.write().unwrap_or_else(|e| e.into_inner()))
            .collect();
        let _a = self.alloc_lock.lock().unwrap_or_else(|e| e.into_inner());
        self.format();
    }
}

impl Kv {
    /// Hang up every connected client now (they reconnect, e.g. to the
    /// host the guest moved to). Returns how many there were.
    pub fn close_clients(&self) -> usize {
        let m = self.clients.lock().unwrap_or_else(|e| e.into_inner());
        for s in m.values() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        m.len()
    }
}

/// Serve the memcached text protocol until `stop` is set.
pub fn serve(kv: Arc<Kv>, listener: TcpListener, stop: Arc<AtomicBool>) {
    let _ = listener.set_nonblocking(true);
    while !stop.load(Relaxed) {
        match listener.accept() {
            Ok((s, peer)) => {
                let kv = kv.clone();
                let _ = s.set_nonblocking(false);
                let id = kv.next_client.fetch_add(1, Relaxed);
                if let Ok(c) = s.try_clone() {
                    kv.clients
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(id, c);
                }
                std::thread::spawn(move || {
                    debug!(%peer, "kv client connected");
                    if let Err(e) = session(&kv, s) {
                        debug!(%peer, "kv client: {e}");
                    }
                    kv.clients
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&id);
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => {
                warn!("kv accept: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

fn session(kv: &Kv, s: TcpStream) -> std::io::Result<()> {
    let _ = s.set_nodelay(true);
    let mut r = BufReader::with_capacity(64 * 1024, s.try_clone()?);
    let mut w = BufWriter::with_capacity(64 * 1024, s);
    let mut line = Vec::with_capacity(512);
    loop {
        line.clear();
        let n = (&mut r).take(8192).read_until(b'\n', &mut line)?;
        if n == 0 {
            return Ok(());
        }
        if line.last() != Some(&b'\n') {
            w.write_all(b"CLIENT_ERROR line too long\r\n")?;
            w.flush()?;
            return Ok(());
        }
        while matches!(line.last(), Some(b'\n' | b'\r')) {
            line.pop();
        }
        let text = String::from_utf8_lossy(&line).into_owned();
        let args: Vec<&str> = text.split_ascii_whitespace().collect();
        if args.is_empty() {
            w.write_all(b"ERROR\r\n")?;
            w.flush()?;
            continue;
        }
        kv.ops.fetch_add(1, Relaxed);
        let noreply = args.last() == Some(&"noreply");
        // A request is one unit of work for the safepoint gate (migration).
        kv.gate.enter();
        let next = command(kv, &args, noreply, &mut r, &mut w);
        kv.gate.exit();
        match next? {
            Next::Continue => {}
            Next::Quit => {
                w.flush()?;
                return Ok(());
            }
        }
        // Flush only when no further request is already buffered (pipelining).
        if r.buffer().is_empty() {
            w.flush()?;
        }
    }
}

enum Next {
    Continue,
    Quit,
}

fn reply(w: &mut impl Write, noreply: bool, msg: &[u8]) -> std::io::Result<Next> {
    if !noreply {
        w.write_all(msg)?;
    }
    Ok(Next::Continue)
}

fn command(
    kv: &Kv,
    a: &[&str],
    noreply: bool,
    r: &mut impl BufRead,
    w: &mut impl Write,
) -> std::io::Result<Next> {
    let bad = |w: &mut dyn Write| -> std::io::Result<Next> {
        w.write_all(b"CLIENT_ERROR bad command line format\r\n")?;
        Ok(Next::Continue)
    };
    match a[0] {
        "get" | "gets" => {
            if a.len() < 2 {
                return bad(w);
            }
            for key in &a[1..] {
                if key.len() > MAX_KEY {
                    return bad(w);
                }
                if let Some((flags, cas, v)) = kv.get(key.as_bytes()) {
                    if a[0] == "gets" {
                        write!(w, "VALUE {key} {flags} {} {cas}\r\n", v.len())?;
                    } else {
                        write!(w, "VALUE {key} {flags} {}\r\n", v.len())?;
                    }
                    w.write_all(&v)?;
                    w.write_all(b"\r\n")?;
                }
            }
            w.write_all(b"END\r\n")?;
            Ok(Next::Continue)
        }
        "set" | "add" | "replace" | "append" | "prepend" | "cas" => {
            let need = if a[0] == "cas" { 6 } else { 5 };
            if a.len() < need || a.len() > need + 1 {
                return bad(w);
            }
            let (key, flags, exp, len) = (
                a[1],
                a[2].parse::<u32>(),
                a[3].parse::<i64>(),
                a[4].parse::<usize>(),
            );
            let (Ok(flags), Ok(exp), Ok(len)) = (flags, exp, len) else {
                return bad(w);
            };
            let cas = if a[0] == "cas" {
                a[5].parse::<u64>().ok()
            } else {
                Some(0)
            };
            if key.len() > MAX_KEY || cas.is_none() || len > 64 << 20 {
                return bad(w);
            }
            let mut data = vec![0u8; len + 2];
            r.read_exact(&mut data)?;
            if &data[len..] != b"\r\n" {
                w.write_all(b"CLIENT_ERROR bad data chunk\r\n")?;
                return Ok(Next::Continue);
            }
            if len > MAX_VALUE {
                return reply(w, noreply, b"SERVER_ERROR object too large for cache\r\n");
            }
            let mode = match a[0] {
                "set" => Mode::Set,
                "add" => Mode::Add,
                "replace" => Mode::Replace,
                "append" => Mode::Append,
                "prepend" => Mode::Prepend,
                _ => Mode::Cas(cas.unwrap()),
            };
            let msg: &[u8] = match kv.store(mode, key.as_bytes(), flags, exp, &data[..len]) {
                Store::Stored => b"STORED\r\n",
                Store::NotStored => b"NOT_STORED\r\n",
                Store::Exists => b"EXISTS\r\n",
                Store::NotFound => b"NOT_FOUND\r\n",
                Store::NoMemory => b"SERVER_ERROR out of memory storing object\r\n",
            };
            reply(w, noreply, msg)
        }
        "delete" => {
            if a.len() < 2 || a.len() > 3 {
                return bad(w);
            }
            let msg: &[u8] = if kv.delete(a[1].as_bytes()) {
                b"DELETED\r\n"
            } else {
                b"NOT_FOUND\r\n"
            };
            reply(w, noreply, msg)
        }
        "incr" | "decr" => {
            if a.len() < 3 {
                return bad(w);
            }
            let Ok(d) = a[2].parse::<u64>() else {
                w.write_all(b"CLIENT_ERROR invalid numeric delta argument\r\n")?;
                return Ok(Next::Continue);
            };
            match kv.incr(a[1].as_bytes(), d, a[0] == "incr") {
                Ok(Some(v)) => reply(w, noreply, format!("{v}\r\n").as_bytes()),
                Ok(None) => reply(w, noreply, b"NOT_FOUND\r\n"),
                Err(()) => reply(
                    w,
                    noreply,
                    b"CLIENT_ERROR cannot increment or decrement non-numeric value\r\n",
                ),
            }
        }
        "touch" => {
            if a.len() < 3 {
                return bad(w);
            }
            let Ok(e) = a[2].parse::<i64>() else {
                return bad(w);
            };
            let msg: &[u8] = if kv.touch(a[1].as_bytes(), e) {
                b"TOUCHED\r\n"
            } else {
                b"NOT_FOUND\r\n"
            };
            reply(w, noreply, msg)
        }
        "flush_all" => {
            kv.flush_all();
            reply(w, noreply, b"OK\r\n")
        }
        "version" => reply(
            w,
            false,
            concat!("VERSION pagefleet-kv ", env!("CARGO_PKG_VERSION"), "\r\n").as_bytes(),
        ),
        "verbosity" => reply(w, noreply, b"OK\r\n"),
        "stats" => {
            let s = [
                ("pid", std::process::id() as u64),
                ("curr_items", kv.items()),
                ("bytes", kv.value_bytes()),
                ("limit_maxbytes", kv.mem.len as u64),
                ("cmd_get", kv.gets.load(Relaxed)),
                ("get_hits", kv.hits.load(Relaxed)),
                ("get_misses", kv.gets.load(Relaxed) - kv.hits.load(Relaxed)),
                ("cmd_set", kv.sets.load(Relaxed)),
            ];
            for (k, v) in s {
                write!(w, "STAT {k} {v}\r\n")?;
            }
            if let Some(f) = &kv.extra_stats {
                for (k, v) in f() {
                    write!(w, "STAT {k} {v}\r\n")?;
                }
            }
            w.write_all(b"END\r\n")?;
            Ok(Next::Continue)
        }
        "quit" => Ok(Next::Quit),
        _ => {
            w.write_all(b"ERROR\r\n")?;
            Ok(Next::Continue)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mem(n: usize) -> (Vec<u64>, Mem) {
        let mut v = vec![0u64; n / 8];
        // SAFETY: the Vec outlives the Mem in every test (returned together).
        let m = unsafe { Mem::new(v.as_mut_ptr() as *mut u8, n) };
        (v, m)
    }

    #[test]
    fn store_get_delete_append_cas_incr() {
        let (_v, m) = mem(4 << 20);
        let kv = Kv::open(m);
        assert_eq!(kv.store(Mode::Set, b"a", 7, 0, b"hello"), Store::Stored);
        let (f, cas, v) = kv.get(b"a").unwrap();
        assert_eq!((f, v.as_slice()), (7, &b"hello"[..]));
        assert_eq!(kv.store(Mode::Add, b"a", 0, 0, b"x"), Store::NotStored);
        assert_eq!(kv.store(Mode::Append, b"a", 0, 0, b" world"), Store::Stored);
        assert_eq!(kv.get(b"a").unwrap().2, b"hello world");
        assert_eq!(kv.store(Mode::Cas(cas), b"a", 0, 0, b"z"), Store::Exists);
        let cas2 = kv.get(b"a").unwrap().1;
        assert_eq!(kv.store(Mode::Cas(cas2), b"a", 0, 0, b"41"), Store::Stored);
        assert_eq!(kv.incr(b"a", 1, true), Ok(Some(42)));
        assert_eq!(kv.incr(b"a", 50, false), Ok(Some(0)));
        assert!(kv.delete(b"a"));
        assert!(kv.get(b"a").is_none());
        assert_eq!(kv.items(), 0);
        // Expired on arrival.
        assert_eq!(kv.store(Mode::Set, b"e", 0, -1, b"x"), Store::Stored);
        assert!(kv.get(b"e").is_none());
        // Reopening resumes the table.
        kv.store(Mode::Set, b"keep", 1, 0, b"me");
        let kv2 = Kv::open(m);
        assert_eq!(kv2.get(b"keep").unwrap().2, b"me");
    }

    #[test]
    fn fills_then_reuses_freed_space() {
        let (_v, m) = mem(1 << 20);
        let kv = Kv::open(m);
        let val = vec![1u8; 3000];
        let mut n = 0;
        while kv.store(Mode::Set, format!("k{n}").as_bytes(), 0, 0, &val) == Store::Stored {
            n += 1;
        }
        assert!(n > 100);
        for i in 0..n {
            assert!(kv.delete(format!("k{i}").as_bytes()));
        }
        for i in 0..n {
            assert_eq!(
                kv.store(Mode::Set, format!("j{i}").as_bytes(), 0, 0, &val),
                Store::Stored
            );
        }
    }
}
