//! Sharing-aware migration to a sub-host (docs/dedup.md): the pages
//! planned for a memory server go as PUT_HASHED first (page number and
//! keyed hash); the server stores those its host holds (read and checked
//! there) and the source PUTs the others.
//!
//! Same policy as toward the main host ([`crate::dedup::Sender`]): every
//! page is hashed until [`crate::dedup::COLD_AFTER`] frames found nothing,
//! then one page in 32 (a probe) while the rest is PUT at once; a probe
//! that hits makes the source hash every page again. A server without a
//! content index answers UNKNOWN_OPCODE once and gets plain PUTs.

use crate::dedup::Sender;
use crate::outcome::{MigrateError, Progress};
use crate::pread_pages;
use crate::wire::runs;
use pagefleet_client::{ClientError, Conn};
use pagefleet_proto::{ErrorCode, PageSel, MAX_BATCH_PAGES};
use pagefleet_region::PAGE;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

/// Frames in flight to one sub-host.
const WINDOW: usize = 32;

/// A request whose reply has not come yet.
enum Pending {
    /// PUT_HASHED for `asked` (indexes into `pages`); `data` holds the
    /// frame's pages until the answer says which must still be sent.
    Hashed {
        id: u64,
        pages: Vec<u64>,
        asked: Vec<usize>,
        data: Vec<u8>,
        /// Which of `pages` are zero.
        zero: Vec<bool>,
    },
    /// A PUT of `n` pages.
    Put { id: u64, n: usize },
}

/// One sub-host's connection, its dedup state and what it cost.
pub(crate) struct SubPut<'a> {
    pub c: &'a mut Conn,
    pub addr: &'a str,
    pub region: u64,
    /// None: plain PUTs only (dedup off, or the server cannot).
    pub dedup: Option<&'a mut Sender>,
    pub progress: &'a Progress,
    inflight: VecDeque<Pending>,
    spare: Vec<Vec<u8>>,
    bytes: u64,
}

impl<'a> SubPut<'a> {
    pub fn new(
        c: &'a mut Conn,
        addr: &'a str,
        region: u64,
        dedup: Option<&'a mut Sender>,
        progress: &'a Progress,
    ) -> SubPut<'a> {
        SubPut {
            c,
            addr,
            region,
            dedup,
            progress,
            inflight: VecDeque::new(),
            spare: Vec::new(),
            bytes: 0,
        }
    }

    fn err(&self, source: ClientError) -> MigrateError {
        MigrateError::Sub {
            addr: self.addr.to_string(),
            source,
        }
    }

    /// PUT pages `idx` of a frame (`data` holds page k at `k * PAGE`);
    /// the reply to await, which the caller queues in sending order.
    fn put(
        &mut self,
        pages: &[u64],
        idx: &[usize],
        data: &[u8],
    ) -> Result<Option<Pending>, MigrateError> {
        if idx.is_empty() {
            return Ok(None);
        }
        let sel = PageSel::List(idx.iter().map(|&k| pages[k]).collect());
        let bufs: Vec<&[u8]> = idx
            .iter()
            .map(|&k| &data[k * PAGE..(k + 1) * PAGE])
            .collect();
        let id = self
            .c
            .send_put_pages(self.region, &sel, &bufs)
            .map_err(|e| self.err(e))?;
        self.bytes += (idx.len() * (PAGE + 8) + 40) as u64;
        self.progress
            .bytes_subs
            .fetch_add((idx.len() * PAGE) as u64, Relaxed);
        Ok(Some(Pending::Put { id, n: idx.len() }))
    }

    /// Send one frame's worth of pages (`data` holds them in order).
    fn send(&mut self, pages: Vec<u64>, data: Vec<u8>) -> Result<(), MigrateError> {
        let all: Vec<usize> = (0..pages.len()).collect();
        let Some(d) = self.dedup.as_deref_mut() else {
            let p = self.put(&pages, &all, &data)?;
            self.inflight.extend(p);
            self.spare.push(data);
            return Ok(());
        };
        let t = pagefleet_common::clock::thread_cpu_secs();
        let zero = crate::dedup::zero_pages(&data[..pages.len() * PAGE]);
        let asked = d.pick(&zero);
        let entries: Vec<(u64, [u8; 16])> = asked
            .iter()
            .map(|&k| {
                let page: &[u8; PAGE] = data[k * PAGE..(k + 1) * PAGE].try_into().expect("page");
                (pages[k], d.hash(page, zero[k]))
            })
            .collect();
        d.hash_secs += pagefleet_common::clock::thread_cpu_secs() - t;
        d.hashed += asked.len() as u64;
        let frame = pagefleet_proto::PutHashedReq::body_len(entries.len()) as u64 + 16;
        d.hash_bytes += frame;
        self.bytes += frame;
        let id = self
            .c
            .send_put_hashed(self.region, &entries)
            .map_err(|e| self.err(e))?;
        // A probe: the pages not asked about go now. Replies come in
        // sending order: the PUT_HASHED's first.
        let rest: Vec<usize> = all.into_iter().filter(|k| !asked.contains(k)).collect();
        let put = self.put(&pages, &rest, &data)?;
        self.inflight.push_back(Pending::Hashed {
            id,
            pages,
            asked,
            data,
            zero,
        });
        self.inflight.extend(put);
        Ok(())
    }

    /// Take the oldest reply; a PUT_HASHED's misses are PUT (queued last).
    fn settle_oldest(&mut self) -> Result<bool, MigrateError> {
        let Some(p) = self.inflight.pop_front() else {
            return Ok(false);
        };
        match p {
            Pending::Put { id, n } => {
                self.c.recv_put(id).map_err(|e| self.err(e))?;
                self.progress.round_sent.fetch_add(n as u64, Relaxed);
            }
            Pending::Hashed {
                id,
                pages,
                asked,
                data,
                zero,
            } => {
                let missing: Vec<usize> = match self.c.recv_put_hashed(id) {
                    Ok(ok) => {
                        let hits = (0..asked.len()).filter(|&i| ok.is_stored(i)).count();
                        let zero_hits = (0..asked.len())
                            .filter(|&i| ok.is_stored(i) && zero[asked[i]])
                            .count();
                        if let Some(d) = self.dedup.as_deref_mut() {
                            d.learned(hits, zero_hits);
                        }
                        self.progress.round_sent.fetch_add(hits as u64, Relaxed);
                        (0..asked.len())
                            .filter(|&i| !ok.is_stored(i))
                            .map(|i| asked[i])
                            .collect()
                    }
                    Err(ClientError::Server { err, .. })
                        if err.code == ErrorCode::UnknownOpcode =>
                    {
                        tracing::info!(
                            "sub-host {} has no content index: its pages go as data",
                            self.addr
                        );
                        self.dedup = None;
                        asked
                    }
                    Err(e) => return Err(self.err(e)),
                };
                let p = self.put(&pages, &missing, &data)?;
                self.inflight.extend(p);
                self.spare.push(data);
            }
        }
        Ok(true)
    }
}

/// PUT `pages` (sorted) of the region's memfd `fd` to one sub-host,
/// pipelined, sharing-aware when `sp.dedup` is set. Returns bytes sent.
pub(crate) fn put_pages(
    mut sp: SubPut<'_>,
    fd: std::os::fd::BorrowedFd<'_>,
    pages: &[u64],
    cancel: &AtomicBool,
) -> Result<u64, MigrateError> {
    for (first, count) in runs(pages, MAX_BATCH_PAGES) {
        if cancel.load(Relaxed) {
            // Let the server finish what it has (so the abort's delete
            // comes after every stored page), then stop.
            while sp.settle_oldest()? {}
            return Err(MigrateError::Cancelled);
        }
        while sp.inflight.len() >= WINDOW {
            sp.settle_oldest()?;
        }
        let mut data = sp.spare.pop().unwrap_or_default();
        data.resize(count * PAGE, 0);
        pread_pages(fd, first, &mut data)
            .map_err(|e| MigrateError::Other(format!("reading the region: {e}")))?;
        sp.send((first..first + count as u64).collect(), data)?;
    }
    while sp.settle_oldest()? {}
    Ok(sp.bytes)
}
