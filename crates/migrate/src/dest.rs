//! The destination side: a runner in incoming mode receives the region
//! straight into the memory the resumed guest will use (received pages are
//! already mapped when it starts), learns where the rest lives, and builds
//! its region at COMMIT.

use crate::wire::{Kind, Stream, WireError, MAX_PAGES, ZERO_SERVER};
use crate::Spec;
use pagefleet_proto::auth::Secret;
use pagefleet_region::{Adopt, Config, Policy, Region, PAGE};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Where each received page is: data here, on server i, or zero.
const HERE: u16 = 0xFFFE;

/// Live counters of an incoming migration.
#[derive(Default, Debug)]
pub struct Progress {
    pub pages: AtomicU64,
    pub located: AtomicU64,
    pub round: AtomicU64,
}

/// A migration received up to its COMMIT.
pub struct Received {
    pub spec: Spec,
    stream: Stream,
    adopt: Adopt,
    loc: Vec<u16>,
}

/// Accept one migration on `s`: authenticate, receive until COMMIT. The
/// guest's memory exists only in this process until then; dropping the
/// result (or an error) discards it.
pub fn receive(s: std::net::TcpStream, secret: &Secret, io_timeout: Duration, progress: &Progress) -> Result<Received, WireError> {
    let mut stream = Stream::new(s);
    stream.set_timeout(Some(io_timeout));
    stream.accept_auth(secret)?;
    let spec: Spec = serde_json::from_value(stream.expect_json(Kind::Spec)?).map_err(|e| WireError::Malformed(format!("SPEC: {e}")))?;
    if spec.size == 0 || spec.size % PAGE as u64 != 0 || spec.size > (1u64 << 46) {
        let _ = stream.send(Kind::Error, 0, &[b"bad region size"]);
        return Err(WireError::Malformed(format!("SPEC: region size {}", spec.size)));
    }
    let adopt = match Adopt::create(&format!("pagefleet-{}", spec.name), spec.size) {
        Ok(a) => a,
        Err(e) => {
            let msg = format!("cannot create {} bytes of guest memory: {e}", spec.size);
            let _ = stream.send(Kind::Error, 0, &[msg.as_bytes()]);
            return Err(WireError::Peer(msg));
        }
    };
    let pages = (spec.size / PAGE as u64) as usize;
    stream.send(Kind::Ready, 0, &[])?;
    let mut r = Received { spec, stream, adopt, loc: vec![ZERO_SERVER; pages] };
    loop {
        let h = r.stream.header()?;
        match h.kind {
            Kind::Pages => {
                let len = h.len as usize;
                let count = len / (PAGE + 1);
                if count == 0 || count > MAX_PAGES || len != count * (PAGE + 1) || h.arg as usize + count > pages {
                    return Err(r.fail(format!("PAGES at {} with {} bytes", h.arg, h.len)));
                }
                let first = h.arg as usize;
                let mut hist = [0u8; MAX_PAGES];
                r.stream.read_exact(&mut hist[..count])?;
                r.adopt.history[first..first + count].copy_from_slice(&hist[..count]);
                // Straight into the guest memory (mapping it as it goes).
                // SAFETY: in bounds (checked above); nothing else uses the
                // mapping before the region is built.
                let dst = unsafe { std::slice::from_raw_parts_mut(r.adopt.guest.addr.add(first * PAGE), count * PAGE) };
                r.stream.read_exact(dst)?;
                r.loc[first..first + count].fill(HERE);
                progress.pages.fetch_add(count as u64, Relaxed);
            }
            Kind::Located => {
                let b = r.stream.body(&h)?;
                if b.len() != 6 {
                    return Err(r.fail("LOCATED must be 6 bytes".into()));
                }
                let count = u32::from_le_bytes(b[0..4].try_into().unwrap()) as usize;
                let server = u16::from_le_bytes(b[4..6].try_into().unwrap());
                let first = h.arg as usize;
                if first.checked_add(count).is_none_or(|e| e > pages) || (server != ZERO_SERVER && server as usize >= r.spec.servers.len()) {
                    return Err(r.fail(format!("LOCATED {first}+{count} on server {server}")));
                }
                // Any stale copy here goes: the location list wins.
                let mut q = first;
                while q < first + count {
                    if r.loc[q] == HERE {
                        let s = q;
                        while q < first + count && r.loc[q] == HERE {
                            q += 1;
                        }
                        let _ = pagefleet_uffd::punch_hole(r.adopt.memfd.as_raw_fd(), (s * PAGE) as u64, ((q - s) * PAGE) as u64);
                    } else {
                        q += 1;
                    }
                }
                r.loc[first..first + count].fill(server);
                progress.located.fetch_add(count as u64, Relaxed);
            }
            Kind::Round => {
                r.stream.body(&h)?;
                progress.round.store(h.arg, Relaxed);
                r.stream.send(Kind::RoundDone, h.arg, &[])?;
            }
            Kind::Commit => {
                r.stream.body(&h)?;
                return Ok(r);
            }
            Kind::Abort => {
                let b = r.stream.body(&h)?;
                return Err(WireError::Aborted(String::from_utf8_lossy(&b).into_owned()));
            }
            k => return Err(r.fail(format!("unexpected {k:?} during pre-copy"))),
        }
    }
}

impl Received {
    fn fail(&mut self, msg: String) -> WireError {
        let _ = self.stream.send(Kind::Error, 0, &[msg.as_bytes()]);
        WireError::Malformed(msg)
    }

    /// The region configuration that resumes this guest here.
    pub fn config(&self, secret: &Secret) -> Result<Config, String> {
        let s = &self.spec;
        let mut cfg = Config::new(s.size, s.budget_pages);
        cfg.chunk_pages = s.chunk_pages;
        cfg.policy = s.policy.parse::<Policy>()?;
        cfg.servers = s.servers.clone();
        cfg.secret = Some(secret.clone());
        cfg.region_id = s.region_id;
        cfg.name = format!("pagefleet-{}", s.name);
        let mut i = 0;
        while i < self.loc.len() {
            let v = self.loc[i];
            let mut j = i + 1;
            while j < self.loc.len() && self.loc[j] == v {
                j += 1;
            }
            if v != HERE && v != ZERO_SERVER {
                cfg.initial_remote.push((i as u64, (j - i) as u64, v as usize));
            }
            i = j;
        }
        Ok(cfg)
    }

    /// Pages received with data / located on servers.
    pub fn counts(&self) -> (u64, u64) {
        let here = self.loc.iter().filter(|v| **v == HERE).count() as u64;
        let remote = self.loc.iter().filter(|v| **v != HERE && **v != ZERO_SERVER).count() as u64;
        (here, remote)
    }

    /// Build the region (with `tweak` applied to its configuration), report
    /// PREPARED, and wait for GO. On ABORT or a lost source the region is
    /// dropped without touching the servers: their pages still belong to
    /// the source.
    pub fn commit(mut self, secret: &Secret, tweak: impl FnOnce(&mut Config)) -> Result<Committed, WireError> {
        let t = Instant::now();
        let mut cfg = match self.config(secret) {
            Ok(c) => c,
            Err(e) => return Err(self.fail(e)),
        };
        tweak(&mut cfg);
        let Received { spec, mut stream, adopt, .. } = self;
        cfg.adopt = Some(Arc::new(adopt));
        let region = match Region::new(cfg) {
            Ok(r) => r,
            Err(e) => {
                let msg = format!("cannot build the region: {e}");
                let _ = stream.send(Kind::Error, 0, &[msg.as_bytes()]);
                return Err(WireError::Peer(msg));
            }
        };
        let build_ms = t.elapsed().as_secs_f64() * 1000.0;
        stream.send_json(Kind::Prepared, &serde_json::json!({ "build_ms": build_ms }))?;
        match stream.expect(Kind::Go) {
            Ok(_) => Ok(Committed { spec, stream, region: Some(region) }),
            Err(e) => {
                region.detach();
                Err(e)
            }
        }
    }
}

/// The guest is ours: start it, then confirm with [`Committed::started`].
pub struct Committed {
    pub spec: Spec,
    stream: Stream,
    region: Option<Region>,
}

impl Committed {
    pub fn take_region(&mut self) -> Region {
        self.region.take().expect("region taken once")
    }
    /// Confirm the start to the source (with the resume-time checksum when asked).
    pub fn started(mut self, checksum: Option<String>, checksum_secs: f64) {
        let _ = self.stream.send_json(Kind::Started, &serde_json::json!({ "checksum": checksum, "checksum_secs": checksum_secs }));
    }
}

impl Drop for Committed {
    fn drop(&mut self) {
        // Never delete the guest's pages on the servers from here.
        if let Some(r) = self.region.take() {
            r.detach();
        }
    }
}
