//! Frame bodies: encoding and validating decoding of every message.
//!
//! Decoders never panic and never allocate more than the frame's own size:
//! every count is checked against the bytes that are actually present.

use crate::frame::*;

/// Flag bits of PUT / GET / DELETE requests.
pub mod flags {
    /// The page descriptor is a run `(first_page: u64)` of `count` pages
    /// instead of a list of `count` page numbers.
    pub const RUN: u32 = 1;
    /// GET: remove the pages from the server once sent (S-memV page-in).
    pub const TAKE: u32 = 2;
    /// GET: pages the server does not hold are reported in the bitmap
    /// instead of failing the whole request with NOT_FOUND.
    pub const ALLOW_MISSING: u32 = 4;
    /// DELETE: drop the whole region; count must be 0 and no descriptor follows.
    pub const WHOLE_REGION: u32 = 8;
    /// Flags a PUT may carry.
    pub const PUT_ALLOWED: u32 = RUN;
    /// Flags a GET may carry.
    pub const GET_ALLOWED: u32 = RUN | TAKE | ALLOW_MISSING;
    /// Flags a DELETE may carry.
    pub const DELETE_ALLOWED: u32 = RUN | WHOLE_REGION;
}

/// Little-endian reader over a body that turns every short read into MALFORMED.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    what: &'static str,
}

impl<'a> Reader<'a> {
    /// A reader over `buf`; `what` names the message in errors.
    pub fn new(buf: &'a [u8], what: &'static str) -> Reader<'a> {
        Reader { buf, pos: 0, what }
    }
    /// The next `n` bytes.
    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.buf.len() - self.pos < n {
            return Err(WireError::malformed(format!(
                "{} body truncated: needs {} more bytes at offset {}, has {}",
                self.what,
                n,
                self.pos,
                self.buf.len() - self.pos
            )));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    /// The next little-endian integer.
    pub fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.bytes(1)?[0])
    }
    /// The next little-endian integer.
    pub fn u16(&mut self) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(self.bytes(2)?.try_into().unwrap()))
    }
    /// The next little-endian integer.
    pub fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.bytes(4)?.try_into().unwrap()))
    }
    /// The next little-endian integer.
    pub fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.bytes(8)?.try_into().unwrap()))
    }
    /// The next 32 bytes.
    pub fn array32(&mut self) -> Result<[u8; 32], WireError> {
        Ok(self.bytes(32)?.try_into().unwrap())
    }
    /// Bytes left.
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    /// Require that the whole body was consumed.
    pub fn finish(&self) -> Result<(), WireError> {
        if self.remaining() != 0 {
            return Err(WireError::malformed(format!(
                "{} body has {} trailing bytes",
                self.what,
                self.remaining()
            )));
        }
        Ok(())
    }
}

/// Server greeting, sent unsolicited right after accept (request id 0).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Welcome {
    /// Oldest version the server speaks.
    pub min_version: u16,
    /// Newest version it speaks.
    pub max_version: u16,
    /// What the server says about TLS: the bits of
    /// `pagefleet_tls::handshake::TlsOffer` (the same in both protocols).
    pub flags: u32,
    /// The server's challenge.
    pub server_nonce: [u8; 32],
    /// Random per server process (a new one means it restarted).
    pub server_id: u64,
}

impl Welcome {
    /// Wire length, bytes.
    pub const LEN: usize = 48;
    /// Append the wire form to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.min_version.to_le_bytes());
        out.extend_from_slice(&self.max_version.to_le_bytes());
        out.extend_from_slice(&self.flags.to_le_bytes());
        out.extend_from_slice(&self.server_nonce);
        out.extend_from_slice(&self.server_id.to_le_bytes());
    }
    /// Parse the wire form.
    pub fn decode(b: &[u8]) -> Result<Welcome, WireError> {
        let mut r = Reader::new(b, "WELCOME");
        let w = Welcome {
            min_version: r.u16()?,
            max_version: r.u16()?,
            flags: r.u32()?,
            server_nonce: r.array32()?,
            server_id: r.u64()?,
        };
        r.finish()?;
        Ok(w)
    }
}

/// HELLO: the client's answer to WELCOME: version, nonce and HMAC proof.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The version the client chose.
    pub version: u16,
    /// Flags (none defined: 0).
    pub flags: u16,
    /// The client's challenge.
    pub client_nonce: [u8; 32],
    /// The HMAC proof.
    pub mac: [u8; 32],
    /// The client's name (for the server's logs).
    pub name: String,
}

impl Hello {
    /// Append the wire form to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&self.flags.to_le_bytes());
        out.extend_from_slice(&self.client_nonce);
        out.extend_from_slice(&self.mac);
        let name = truncate_str(&self.name, MAX_NAME);
        out.push(name.len() as u8);
        out.extend_from_slice(name.as_bytes());
    }
    /// Parse the wire form.
    pub fn decode(b: &[u8]) -> Result<Hello, WireError> {
        let mut r = Reader::new(b, "HELLO");
        let version = r.u16()?;
        let flags = r.u16()?;
        let client_nonce = r.array32()?;
        let mac = r.array32()?;
        let n = r.u8()? as usize;
        if n > MAX_NAME {
            return Err(WireError::malformed(format!(
                "client name of {n} bytes exceeds {MAX_NAME}"
            )));
        }
        let name = String::from_utf8_lossy(r.bytes(n)?).into_owned();
        r.finish()?;
        Ok(Hello {
            version,
            flags,
            client_nonce,
            mac,
            name,
        })
    }
}

/// HELLO_OK: the server's proof and its vital numbers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HelloOk {
    /// The HMAC proof.
    pub mac: [u8; 32],
    /// Random per server process (a new one means it restarted).
    pub server_id: u64,
    /// Pages the server lends.
    pub capacity_pages: u64,
    /// Pages it holds.
    pub used_pages: u64,
    /// Bytes per page (4096).
    pub page_size: u32,
    /// Most pages per request.
    pub max_batch_pages: u32,
}

impl HelloOk {
    /// Wire length, bytes.
    pub const LEN: usize = 64;
    /// Append the wire form to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.mac);
        out.extend_from_slice(&self.server_id.to_le_bytes());
        out.extend_from_slice(&self.capacity_pages.to_le_bytes());
        out.extend_from_slice(&self.used_pages.to_le_bytes());
        out.extend_from_slice(&self.page_size.to_le_bytes());
        out.extend_from_slice(&self.max_batch_pages.to_le_bytes());
    }
    /// Parse the wire form.
    pub fn decode(b: &[u8]) -> Result<HelloOk, WireError> {
        let mut r = Reader::new(b, "HELLO_OK");
        let v = HelloOk {
            mac: r.array32()?,
            server_id: r.u64()?,
            capacity_pages: r.u64()?,
            used_pages: r.u64()?,
            page_size: r.u32()?,
            max_batch_pages: r.u32()?,
        };
        r.finish()?;
        Ok(v)
    }
}

/// Which pages a PUT/GET/DELETE names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PageSel {
    /// `count` consecutive pages starting at `first`.
    Run {
        /// The first page.
        first: u64,
        /// How many.
        count: u32,
    },
    /// Explicit page numbers, in the order the data follows.
    List(Vec<u64>),
}

impl PageSel {
    /// How many (pages, bytes).
    pub fn len(&self) -> usize {
        match self {
            PageSel::Run { count, .. } => *count as usize,
            PageSel::List(v) => v.len(),
        }
    }
    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The i-th page number.
    pub fn page(&self, i: usize) -> u64 {
        match self {
            PageSel::Run { first, .. } => first + i as u64,
            PageSel::List(v) => v[i],
        }
    }
    /// The page numbers in order.
    pub fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        (0..self.len()).map(move |i| self.page(i))
    }
}

/// The fixed 16-byte start of every PUT / GET / DELETE body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagesPrefix {
    /// The region.
    pub region: u64,
    /// Pages named.
    pub count: u32,
    /// Flags (none defined: 0).
    pub flags: u32,
}

impl PagesPrefix {
    /// Wire length, bytes.
    pub const LEN: usize = 16;
    /// Append the wire form to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.region.to_le_bytes());
        out.extend_from_slice(&self.count.to_le_bytes());
        out.extend_from_slice(&self.flags.to_le_bytes());
    }
    /// Decode and check the prefix for `op`: allowed flags and count limits.
    pub fn decode(op: Opcode, b: &[u8]) -> Result<PagesPrefix, WireError> {
        let mut r = Reader::new(b, op.name());
        let p = PagesPrefix {
            region: r.u64()?,
            count: r.u32()?,
            flags: r.u32()?,
        };
        let (allowed, max) = match op {
            Opcode::Put => (flags::PUT_ALLOWED, MAX_BATCH_PAGES as u32),
            Opcode::Get => (flags::GET_ALLOWED, MAX_BATCH_PAGES as u32),
            Opcode::Delete => (
                flags::DELETE_ALLOWED,
                if p.flags & flags::RUN != 0 {
                    u32::MAX
                } else {
                    MAX_DELETE_LIST as u32
                },
            ),
            _ => return Err(WireError::malformed("not a page operation")),
        };
        if p.flags & !allowed != 0 {
            return Err(WireError::malformed(format!(
                "{} flags {:#x} include unknown bits (allowed {:#x})",
                op.name(),
                p.flags,
                allowed
            )));
        }
        if op == Opcode::Delete && p.flags & flags::WHOLE_REGION != 0 {
            if p.count != 0 || p.flags & flags::RUN != 0 {
                return Err(WireError::malformed(
                    "DELETE of a whole region takes count 0 and no RUN flag",
                ));
            }
            return Ok(p);
        }
        if p.count == 0 || p.count > max {
            return Err(WireError::malformed(format!(
                "{} page count {} outside 1..={}",
                op.name(),
                p.count,
                max
            )));
        }
        Ok(p)
    }
    /// Bytes of page descriptor that follow the prefix.
    pub fn desc_len(&self) -> usize {
        if self.flags & flags::WHOLE_REGION != 0 {
            0
        } else if self.flags & flags::RUN != 0 {
            8
        } else {
            self.count as usize * 8
        }
    }
    /// Parse the descriptor and check every page number.
    pub fn decode_sel(&self, b: &[u8]) -> Result<PageSel, WireError> {
        if b.len() != self.desc_len() {
            return Err(WireError::malformed("page descriptor length mismatch"));
        }
        if self.flags & flags::RUN != 0 {
            let first = u64::from_le_bytes(b.try_into().unwrap());
            let end = first.checked_add(self.count as u64);
            if end.is_none_or(|e| e > MAX_PAGE) {
                return Err(WireError::new(
                    ErrorCode::InvalidArgument,
                    format!(
                        "page run {first}+{} exceeds the page limit 2^52",
                        self.count
                    ),
                ));
            }
            Ok(PageSel::Run {
                first,
                count: self.count,
            })
        } else {
            let mut v = Vec::with_capacity(self.count as usize);
            for c in b.chunks_exact(8) {
                let p = u64::from_le_bytes(c.try_into().unwrap());
                if p >= MAX_PAGE {
                    return Err(WireError::new(
                        ErrorCode::InvalidArgument,
                        format!("page number {p} exceeds the page limit 2^52"),
                    ));
                }
                v.push(p);
            }
            Ok(PageSel::List(v))
        }
    }
}

/// Encode the non-data part of a PUT/GET/DELETE body.
pub fn encode_pages_req(region: u64, sel: &PageSel, extra_flags: u32, out: &mut Vec<u8>) {
    let (count, f) = match sel {
        PageSel::Run { count, .. } => (*count, flags::RUN),
        PageSel::List(v) => (v.len() as u32, 0),
    };
    PagesPrefix {
        region,
        count,
        flags: f | extra_flags,
    }
    .encode(out);
    match sel {
        PageSel::Run { first, .. } => out.extend_from_slice(&first.to_le_bytes()),
        PageSel::List(v) => {
            for p in v {
                out.extend_from_slice(&p.to_le_bytes());
            }
        }
    }
}

/// A fully decoded GET or DELETE request (PUT data is streamed separately).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PagesReq {
    /// The fixed part.
    pub prefix: PagesPrefix,
    /// The pages.
    pub sel: PageSel,
}

impl PagesReq {
    /// Parse the wire form.
    pub fn decode(op: Opcode, b: &[u8]) -> Result<PagesReq, WireError> {
        if b.len() < PagesPrefix::LEN {
            return Err(WireError::malformed(format!(
                "{} body shorter than its 16-byte prefix",
                op.name()
            )));
        }
        let prefix = PagesPrefix::decode(op, &b[..PagesPrefix::LEN])?;
        let rest = &b[PagesPrefix::LEN..];
        let data = if op == Opcode::Put {
            prefix.count as usize * PAGE_SIZE
        } else {
            0
        };
        if rest.len() != prefix.desc_len() + data {
            return Err(WireError::malformed(format!(
                "{} body is {} bytes, expected {}",
                op.name(),
                b.len(),
                PagesPrefix::LEN + prefix.desc_len() + data
            )));
        }
        let sel = if prefix.flags & flags::WHOLE_REGION != 0 {
            PageSel::List(Vec::new())
        } else {
            prefix.decode_sel(&rest[..prefix.desc_len()])?
        };
        Ok(PagesReq { prefix, sel })
    }
}

/// PUT_OK.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PutOk {
    /// Pages stored.
    pub stored: u32,
    /// Of which were new (not overwrites).
    pub new_pages: u32,
}

impl PutOk {
    /// Wire length, bytes.
    pub const LEN: usize = 8;
    /// Append the wire form to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.stored.to_le_bytes());
        out.extend_from_slice(&self.new_pages.to_le_bytes());
    }
    /// Parse the wire form.
    pub fn decode(b: &[u8]) -> Result<PutOk, WireError> {
        let mut r = Reader::new(b, "PUT_OK");
        let v = PutOk {
            stored: r.u32()?,
            new_pages: r.u32()?,
        };
        r.finish()?;
        Ok(v)
    }
}

/// Bytes of one PUT_HASHED entry: page u64, keyed hash 16 bytes.
pub const HASHED_ENTRY: usize = 24;

/// PUT_HASHED: pages named by their keyed content hash (sharing-aware
/// migration to a sub-host). Body: the 16-byte prefix (region, count
/// 1..=32, flags 0), then count × (page u64, hash 16 bytes). The server
/// stores, like a PUT, each page whose content its host holds (checked
/// against the hash) and says which in PUT_HASHED_OK; the client PUTs the
/// others.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PutHashedReq {
    /// The region.
    pub region: u64,
    /// (page, keyed hash of its content).
    pub entries: Vec<(u64, [u8; 16])>,
}

impl PutHashedReq {
    /// Body length for `count` entries.
    pub fn body_len(count: usize) -> usize {
        PagesPrefix::LEN + count * HASHED_ENTRY
    }
    /// Append the wire form to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        PagesPrefix {
            region: self.region,
            count: self.entries.len() as u32,
            flags: 0,
        }
        .encode(out);
        for (p, h) in &self.entries {
            out.extend_from_slice(&p.to_le_bytes());
            out.extend_from_slice(h);
        }
    }
    /// Parse and check the wire form.
    pub fn decode(b: &[u8]) -> Result<PutHashedReq, WireError> {
        let mut r = Reader::new(b, "PUT_HASHED");
        let region = r.u64()?;
        let count = r.u32()? as usize;
        let flags = r.u32()?;
        if flags != 0 {
            return Err(WireError::malformed(format!(
                "PUT_HASHED flags {flags:#x}: none are defined"
            )));
        }
        if count == 0 || count > MAX_BATCH_PAGES {
            return Err(WireError::malformed(format!(
                "PUT_HASHED page count {count} outside 1..={MAX_BATCH_PAGES}"
            )));
        }
        if r.remaining() != count * HASHED_ENTRY {
            return Err(WireError::malformed(format!(
                "PUT_HASHED body is {} bytes, {count} entries need {}",
                b.len(),
                Self::body_len(count)
            )));
        }
        let mut entries = Vec::with_capacity(count);
        for _ in 0..count {
            let p = r.u64()?;
            if p >= MAX_PAGE {
                return Err(WireError::new(
                    ErrorCode::InvalidArgument,
                    format!("page number {p} exceeds the page limit 2^52"),
                ));
            }
            entries.push((p, r.bytes(16)?.try_into().unwrap()));
        }
        r.finish()?;
        Ok(PutHashedReq { region, entries })
    }
}

/// PUT_HASHED_OK: count u32, stored u32, then a bitmap of ceil(count/8)
/// bytes (bit i of byte i/8, LSB first): entry i was stored from the
/// server's own host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PutHashedOk {
    /// Entries asked about.
    pub count: u32,
    /// Of which stored.
    pub stored: u32,
    /// Which.
    pub bitmap: Vec<u8>,
}

impl PutHashedOk {
    /// A reply for `found`.
    pub fn from_found(found: &[bool]) -> PutHashedOk {
        let mut bitmap = vec![0u8; found.len().div_ceil(8)];
        for (i, f) in found.iter().enumerate() {
            if *f {
                bitmap[i / 8] |= 1 << (i % 8);
            }
        }
        PutHashedOk {
            count: found.len() as u32,
            stored: found.iter().filter(|f| **f).count() as u32,
            bitmap,
        }
    }
    /// Whether entry `i` was stored.
    pub fn is_stored(&self, i: usize) -> bool {
        self.bitmap[i / 8] & (1 << (i % 8)) != 0
    }
    /// Append the wire form to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.count.to_le_bytes());
        out.extend_from_slice(&self.stored.to_le_bytes());
        out.extend_from_slice(&self.bitmap);
    }
    /// Parse and check the wire form.
    pub fn decode(b: &[u8]) -> Result<PutHashedOk, WireError> {
        let mut r = Reader::new(b, "PUT_HASHED_OK");
        let count = r.u32()?;
        let stored = r.u32()?;
        if count as usize > MAX_BATCH_PAGES || stored > count {
            return Err(WireError::malformed(format!(
                "PUT_HASHED_OK count {count} stored {stored} out of range"
            )));
        }
        let bitmap = r.bytes((count as usize).div_ceil(8))?.to_vec();
        r.finish()?;
        let ones: u32 = bitmap.iter().map(|b| b.count_ones()).sum();
        let pad_ok = count % 8 == 0 || bitmap.last().is_none_or(|l| l >> (count % 8) == 0);
        if ones != stored || !pad_ok {
            return Err(WireError::malformed(
                "PUT_HASHED_OK bitmap disagrees with its stored count",
            ));
        }
        Ok(PutHashedOk {
            count,
            stored,
            bitmap,
        })
    }
}

/// The fixed part of GET_OK: count, present, then a presence bitmap of
/// ceil(count/8) bytes (bit i of byte i/8, LSB first), then `present` pages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GetOkHead {
    /// Pages named.
    pub count: u32,
    /// Pages present.
    pub present: u32,
    /// Presence bitmap, bit i of byte i/8, LSB first.
    pub bitmap: Vec<u8>,
}

impl GetOkHead {
    /// Bitmap bytes for `count` pages.
    pub fn bitmap_len(count: u32) -> usize {
        (count as usize).div_ceil(8)
    }
    /// Bytes of the fixed part for `count` pages.
    pub fn head_len(count: u32) -> usize {
        8 + Self::bitmap_len(count)
    }
    /// Whether page `i` of the request is present.
    pub fn is_present(&self, i: usize) -> bool {
        self.bitmap[i / 8] & (1 << (i % 8)) != 0
    }
    /// Append the wire form to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.count.to_le_bytes());
        out.extend_from_slice(&self.present.to_le_bytes());
        out.extend_from_slice(&self.bitmap);
    }
    /// Decode the head from the first bytes of a GET_OK body of `body_len`
    /// bytes; checks that the bitmap agrees with `present` and the length.
    pub fn decode(b: &[u8], body_len: usize) -> Result<GetOkHead, WireError> {
        let mut r = Reader::new(b, "GET_OK");
        let count = r.u32()?;
        let present = r.u32()?;
        if count as usize > MAX_BATCH_PAGES || present > count {
            return Err(WireError::malformed(format!(
                "GET_OK count {count} present {present} out of range"
            )));
        }
        let bitmap = r.bytes(Self::bitmap_len(count))?.to_vec();
        let ones: u32 = bitmap.iter().map(|b| b.count_ones()).sum();
        let pad_ok = count % 8 == 0 || bitmap.last().is_none_or(|l| l >> (count % 8) == 0);
        if ones != present || !pad_ok {
            return Err(WireError::malformed(
                "GET_OK bitmap disagrees with its present count",
            ));
        }
        if body_len != Self::head_len(count) + present as usize * PAGE_SIZE {
            return Err(WireError::malformed(
                "GET_OK body length disagrees with its present count",
            ));
        }
        Ok(GetOkHead {
            count,
            present,
            bitmap,
        })
    }
}

/// DELETE_OK.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeleteOk {
    /// Pages dropped.
    pub deleted: u64,
}

impl DeleteOk {
    /// Append the wire form to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.deleted.to_le_bytes());
    }
    /// Parse the wire form.
    pub fn decode(b: &[u8]) -> Result<DeleteOk, WireError> {
        let mut r = Reader::new(b, "DELETE_OK");
        let v = DeleteOk { deleted: r.u64()? };
        r.finish()?;
        Ok(v)
    }
}

/// Most pages one PUSH names.
pub const MAX_PUSH_PAGES: usize = 1024;

/// PUSH request: store `pages` of `region`, as this server holds them, on
/// the memory server at `target` (which must answer with id `target_id`,
/// so a restarted one is not taken for the one the client knew).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PushReq {
    /// The region.
    pub region: u64,
    /// The other server's id (its HELLO_OK / WELCOME server id).
    pub target_id: u64,
    /// The other server, HOST:PORT (at most 255 bytes).
    pub target: String,
    /// The pages, 1..=MAX_PUSH_PAGES.
    pub pages: Vec<u64>,
}

impl PushReq {
    /// Append the wire form to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.region.to_le_bytes());
        out.extend_from_slice(&self.target_id.to_le_bytes());
        out.extend_from_slice(&(self.target.len() as u16).to_le_bytes());
        out.extend_from_slice(self.target.as_bytes());
        out.extend_from_slice(&(self.pages.len() as u32).to_le_bytes());
        for p in &self.pages {
            out.extend_from_slice(&p.to_le_bytes());
        }
    }
    /// Largest body.
    pub const MAX_LEN: usize = 8 + 8 + 2 + 255 + 4 + MAX_PUSH_PAGES * 8;
    /// Parse the wire form.
    pub fn decode(b: &[u8]) -> Result<PushReq, WireError> {
        let mut r = Reader::new(b, "PUSH");
        let region = r.u64()?;
        let target_id = r.u64()?;
        let n = r.u16()? as usize;
        if n == 0 || n > 255 {
            return Err(WireError::new(
                ErrorCode::InvalidArgument,
                format!("PUSH target of {n} bytes: 1..=255"),
            ));
        }
        let target = std::str::from_utf8(r.bytes(n)?)
            .map_err(|_| WireError::malformed("PUSH target is not UTF-8"))?
            .to_string();
        let count = r.u32()? as usize;
        if count == 0 || count > MAX_PUSH_PAGES {
            return Err(WireError::new(
                ErrorCode::InvalidArgument,
                format!("PUSH of {count} pages: 1..={MAX_PUSH_PAGES}"),
            ));
        }
        let pages = (0..count).map(|_| r.u64()).collect::<Result<_, _>>()?;
        r.finish()?;
        Ok(PushReq {
            region,
            target_id,
            target,
            pages,
        })
    }
}

/// PUSH_OK: the pages are stored on the other server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PushOk {
    /// Pages stored there.
    pub pushed: u64,
}

impl PushOk {
    /// Append the wire form to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.pushed.to_le_bytes());
    }
    /// Parse the wire form.
    pub fn decode(b: &[u8]) -> Result<PushOk, WireError> {
        let mut r = Reader::new(b, "PUSH_OK");
        let v = PushOk { pushed: r.u64()? };
        r.finish()?;
        Ok(v)
    }
}

/// STAT request: flags bit 0 = list regions; at most `max_regions` listed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatReq {
    /// Flags (none defined: 0).
    pub flags: u32,
    /// Most regions to list.
    pub max_regions: u32,
}

impl StatReq {
    /// Flag: list the regions.
    pub const LIST_REGIONS: u32 = 1;
    /// Most regions one STAT_OK lists (keeps the reply under MAX_BODY).
    pub const MAX_LISTED: u32 = 4096;
    /// Append the wire form to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.flags.to_le_bytes());
        out.extend_from_slice(&self.max_regions.to_le_bytes());
    }
    /// Parse the wire form.
    pub fn decode(b: &[u8]) -> Result<StatReq, WireError> {
        let mut r = Reader::new(b, "STAT");
        let v = StatReq {
            flags: r.u32()?,
            max_regions: r.u32()?,
        };
        r.finish()?;
        if v.flags & !Self::LIST_REGIONS != 0 {
            return Err(WireError::malformed(format!(
                "STAT flags {:#x} include unknown bits",
                v.flags
            )));
        }
        Ok(v)
    }
}

/// STAT_OK.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct StatOk {
    /// Pages the server lends.
    pub capacity_pages: u64,
    /// Pages it holds.
    pub used_pages: u64,
    /// Random per server process (a new one means it restarted).
    pub server_id: u64,
    /// Open connections.
    pub connections: u32,
    /// Regions with pages.
    pub region_count: u32,
    /// More regions exist than are listed.
    pub truncated: bool,
    /// (region id, pages stored), ascending by region id.
    pub regions: Vec<(u64, u64)>,
}

impl StatOk {
    /// Append the wire form to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.capacity_pages.to_le_bytes());
        out.extend_from_slice(&self.used_pages.to_le_bytes());
        out.extend_from_slice(&self.server_id.to_le_bytes());
        out.extend_from_slice(&self.connections.to_le_bytes());
        out.extend_from_slice(&self.region_count.to_le_bytes());
        out.extend_from_slice(&(self.regions.len() as u32).to_le_bytes());
        out.extend_from_slice(&(self.truncated as u32).to_le_bytes());
        for (r, n) in &self.regions {
            out.extend_from_slice(&r.to_le_bytes());
            out.extend_from_slice(&n.to_le_bytes());
        }
    }
    /// Parse the wire form.
    pub fn decode(b: &[u8]) -> Result<StatOk, WireError> {
        let mut r = Reader::new(b, "STAT_OK");
        let mut v = StatOk {
            capacity_pages: r.u64()?,
            used_pages: r.u64()?,
            server_id: r.u64()?,
            connections: r.u32()?,
            region_count: r.u32()?,
            ..Default::default()
        };
        let listed = r.u32()?;
        v.truncated = r.u32()? & 1 != 0;
        if listed as usize * 16 != r.remaining() {
            return Err(WireError::malformed("STAT_OK region list length mismatch"));
        }
        for _ in 0..listed {
            v.regions.push((r.u64()?, r.u64()?));
        }
        Ok(v)
    }
}

/// ERROR frame body: code, flags (bit 0: fatal, the server closes the
/// connection after it), detail, message.
impl WireError {
    /// Append the wire form to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&(self.code as u16).to_le_bytes());
        out.extend_from_slice(&(self.code.is_fatal() as u16).to_le_bytes());
        out.extend_from_slice(&self.detail.to_le_bytes());
        let m = truncate_str(&self.message, MAX_MESSAGE);
        out.extend_from_slice(&(m.len() as u16).to_le_bytes());
        out.extend_from_slice(m.as_bytes());
    }
    /// Parse the wire form.
    pub fn decode(b: &[u8], id: u64) -> Result<WireError, WireError> {
        let mut r = Reader::new(b, "ERROR");
        let raw = r.u16()?;
        let _flags = r.u16()?;
        let detail = r.u64()?;
        let n = r.u16()? as usize;
        if n > MAX_MESSAGE {
            return Err(WireError::malformed("ERROR message too long"));
        }
        let message = String::from_utf8_lossy(r.bytes(n)?).into_owned();
        r.finish()?;
        let code = ErrorCode::from_u16(raw)
            .ok_or_else(|| WireError::malformed(format!("unknown error code {raw}")))?;
        Ok(WireError {
            code,
            message,
            id,
            detail,
        })
    }
}

fn truncate_str(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut cut = max;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    &s[..cut]
}

/// Build a whole frame (header + body) into `out`.
pub fn frame(op: Opcode, id: u64, out: &mut Vec<u8>, body: impl FnOnce(&mut Vec<u8>)) {
    let start = out.len();
    out.extend_from_slice(&[0u8; HEADER_LEN]);
    body(out);
    let len = out.len() - start - HEADER_LEN;
    out[start..start + HEADER_LEN].copy_from_slice(&Header::new(op, len, id).encode());
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arb_sel() -> impl Strategy<Value = PageSel> {
        prop_oneof![
            (0u64..MAX_PAGE - 64, 1u32..=32)
                .prop_map(|(first, count)| PageSel::Run { first, count }),
            proptest::collection::vec(0u64..MAX_PAGE, 1..=32).prop_map(PageSel::List),
        ]
    }

    proptest! {
        #[test]
        fn header_roundtrip(op in any::<u8>(), len in 0u32..=MAX_BODY as u32, id in any::<u64>()) {
            let h = Header { opcode: op, body_len: len, id };
            prop_assert_eq!(Header::decode(&h.encode()).unwrap(), h);
        }

        #[test]
        fn put_hashed_roundtrips_and_bad_bodies_are_errors(
            region in any::<u64>(),
            entries in proptest::collection::vec((0u64..MAX_PAGE, any::<[u8; 16]>()), 1..=32),
            found in proptest::collection::vec(any::<bool>(), 0..=32),
            junk in proptest::collection::vec(any::<u8>(), 0..900),
        ) {
            let req = PutHashedReq { region, entries };
            let mut b = Vec::new();
            req.encode(&mut b);
            prop_assert_eq!(b.len(), PutHashedReq::body_len(req.entries.len()));
            prop_assert_eq!(PutHashedReq::decode(&b).unwrap(), req);
            prop_assert!(PutHashedReq::decode(&b[..b.len() - 1]).is_err());
            let ok = PutHashedOk::from_found(&found);
            let mut o = Vec::new();
            ok.encode(&mut o);
            prop_assert_eq!(PutHashedOk::decode(&o).unwrap(), ok);
            let _ = PutHashedReq::decode(&junk);
            let _ = PutHashedOk::decode(&junk);
        }

        #[test]
        fn push_roundtrips_and_bad_bodies_are_errors(
            region in any::<u64>(),
            target_id in any::<u64>(),
            target in "[a-z0-9.:]{1,64}",
            pages in proptest::collection::vec(0u64..MAX_PAGE, 1..=MAX_PUSH_PAGES),
            junk in proptest::collection::vec(any::<u8>(), 0..600),
        ) {
            let req = PushReq { region, target_id, target, pages };
            let mut b = Vec::new();
            req.encode(&mut b);
            prop_assert!(b.len() <= PushReq::MAX_LEN);
            prop_assert_eq!(PushReq::decode(&b).unwrap(), req);
            prop_assert!(PushReq::decode(&b[..b.len() - 1]).is_err());
            let mut o = Vec::new();
            PushOk { pushed: 7 }.encode(&mut o);
            prop_assert_eq!(PushOk::decode(&o).unwrap().pushed, 7);
            let _ = PushReq::decode(&junk);
            let _ = PushOk::decode(&junk);
        }

        #[test]
        fn header_decode_never_panics(b in proptest::collection::vec(any::<u8>(), 0..40)) {
            let _ = Header::decode(&b);
        }

        #[test]
        fn pages_req_roundtrip(region in any::<u64>(), sel in arb_sel(), take in any::<bool>()) {
            let mut body = Vec::new();
            let extra = if take { flags::TAKE } else { 0 };
            encode_pages_req(region, &sel, extra, &mut body);
            let r = PagesReq::decode(Opcode::Get, &body).unwrap();
            prop_assert_eq!(r.prefix.region, region);
            prop_assert_eq!(r.sel, sel);
            prop_assert_eq!(r.prefix.flags & flags::TAKE != 0, take);
        }

        #[test]
        fn body_decoders_never_panic(b in proptest::collection::vec(any::<u8>(), 0..600), id in any::<u64>()) {
            for op in [Opcode::Put, Opcode::Get, Opcode::Delete] {
                let _ = PagesReq::decode(op, &b);
            }
            let _ = Hello::decode(&b);
            let _ = HelloOk::decode(&b);
            let _ = Welcome::decode(&b);
            let _ = StatReq::decode(&b);
            let _ = StatOk::decode(&b);
            let _ = PutOk::decode(&b);
            let _ = DeleteOk::decode(&b);
            let _ = GetOkHead::decode(&b, b.len());
            let _ = WireError::decode(&b, id);
        }

        #[test]
        fn hello_roundtrip(nonce in any::<[u8; 32]>(), mac in any::<[u8; 32]>(), name in "[a-z0-9-]{0,64}") {
            let h = Hello { version: 1, flags: 0, client_nonce: nonce, mac, name };
            let mut b = Vec::new();
            h.encode(&mut b);
            prop_assert_eq!(Hello::decode(&b).unwrap(), h);
        }

        #[test]
        fn stat_roundtrip(regions in proptest::collection::vec((any::<u64>(), any::<u64>()), 0..50), cap in any::<u64>()) {
            let s = StatOk { capacity_pages: cap, used_pages: 3, server_id: 9, connections: 2,
                             region_count: regions.len() as u32, truncated: false, regions };
            let mut b = Vec::new();
            s.encode(&mut b);
            prop_assert_eq!(StatOk::decode(&b).unwrap(), s);
        }

        #[test]
        fn error_roundtrip(ci in 0usize..ErrorCode::ALL.len(), detail in any::<u64>(), msg in ".{0,200}") {
            let e = WireError::new(ErrorCode::ALL[ci], msg).with_detail(detail).with_id(5);
            let mut b = Vec::new();
            e.encode(&mut b);
            prop_assert_eq!(WireError::decode(&b, 5).unwrap(), e);
        }

        #[test]
        fn get_ok_head_roundtrip(bits in proptest::collection::vec(any::<bool>(), 1..=32)) {
            let count = bits.len() as u32;
            let mut bitmap = vec![0u8; GetOkHead::bitmap_len(count)];
            for (i, b) in bits.iter().enumerate() { if *b { bitmap[i / 8] |= 1 << (i % 8); } }
            let present = bits.iter().filter(|b| **b).count() as u32;
            let h = GetOkHead { count, present, bitmap };
            let mut b = Vec::new();
            h.encode(&mut b);
            let body_len = b.len() + present as usize * PAGE_SIZE;
            prop_assert_eq!(GetOkHead::decode(&b, body_len).unwrap(), h);
        }
    }

    #[test]
    fn rejects_bad_headers() {
        let mut h = Header::new(Opcode::Ping, 0, 1).encode();
        h[0] = b'X';
        assert_eq!(Header::decode(&h).unwrap_err().code, ErrorCode::BadMagic);
        let mut h = Header::new(Opcode::Ping, 0, 1).encode();
        h[2] = 9;
        assert_eq!(
            Header::decode(&h).unwrap_err().code,
            ErrorCode::UnsupportedVersion
        );
        let h = Header {
            opcode: 2,
            body_len: MAX_BODY as u32 + 1,
            id: 1,
        }
        .encode();
        assert_eq!(
            Header::decode(&h).unwrap_err().code,
            ErrorCode::FrameTooLarge
        );
    }

    #[test]
    fn rejects_bad_page_requests() {
        let mut b = Vec::new();
        PagesPrefix {
            region: 1,
            count: 33,
            flags: flags::RUN,
        }
        .encode(&mut b);
        b.extend_from_slice(&0u64.to_le_bytes());
        assert_eq!(
            PagesReq::decode(Opcode::Get, &b).unwrap_err().code,
            ErrorCode::Malformed
        );
        let mut b = Vec::new();
        PagesPrefix {
            region: 1,
            count: 2,
            flags: flags::RUN | 0x100,
        }
        .encode(&mut b);
        b.extend_from_slice(&0u64.to_le_bytes());
        assert_eq!(
            PagesReq::decode(Opcode::Get, &b).unwrap_err().code,
            ErrorCode::Malformed
        );
        let mut b = Vec::new();
        PagesPrefix {
            region: 1,
            count: 2,
            flags: flags::RUN,
        }
        .encode(&mut b);
        b.extend_from_slice(&(MAX_PAGE - 1).to_le_bytes());
        assert_eq!(
            PagesReq::decode(Opcode::Get, &b).unwrap_err().code,
            ErrorCode::InvalidArgument
        );
    }
}
