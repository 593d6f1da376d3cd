//! The destination's side of sharing-aware migration: a filler thread takes
//! each HASHES batch off the receiver, finds the pages its host holds
//! (through the host's lookup service), writes them into the guest's
//! memory and answers HAVE itself, so the receiver keeps reading data
//! while pages are being filled.
//!
//! Ordering needs no more than the protocol gives: the source sends a
//! hashed page's data only after its HAVE said "not filled", and ends a
//! round (ROUND, answered by the receiver) only after every HAVE of it
//! arrived. Both threads write the socket under one lock.

use crate::landing::{Shared, HERE, PULLED};
use crate::wire::Filled;
use crate::wire::{Header, Kind, ZERO_SERVER};
use pagefleet_dedup::lookup::{Found, LookupClient};
use pagefleet_dedup::PageHash;
use pagefleet_region::PAGE;
use pagefleet_tls::Stream as Socket;
use std::io::Write;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

/// Where filled pages go.
#[derive(Clone)]
pub(crate) struct Target {
    /// The guest memory's memfd.
    pub fd: std::sync::Arc<std::os::fd::OwnedFd>,
    /// Receive location state and the guest mapping.
    pub shared: Arc<Shared>,
    /// Pages are read straight into guest memory. Not so in a gather
    /// (pullers write the memory too) or in a memory cgroup: there they are
    /// read into a buffer and copied under the lock the pullers take.
    pub direct: bool,
}

/// One HASHES batch: its number, (page, history) and hashes.
struct Job {
    batch: u64,
    pages: Vec<(usize, u8)>,
    hashes: Vec<PageHash>,
}

/// What the filler did, when it is done.
#[derive(Default)]
pub(crate) struct Outcome {
    pub filled: Filled,
    /// Access history of the filled pages (the receiver owns the array).
    pub history: Vec<(usize, u8)>,
}

/// The filler thread; dropping it waits for it.
pub(crate) struct Filler {
    queue: Option<Sender<Job>>,
    thread: Option<JoinHandle<Outcome>>,
}

/// Send one message on `w` under `lock` (the receiver writes the same socket).
pub(crate) fn send_locked(
    w: &Socket,
    lock: &Mutex<()>,
    kind: Kind,
    arg: u64,
    body: &[u8],
) -> std::io::Result<()> {
    let h = Header {
        kind,
        len: body.len() as u32,
        arg,
    }
    .encode();
    let mut m = Vec::with_capacity(h.len() + body.len());
    m.extend_from_slice(&h);
    m.extend_from_slice(body);
    let _g = lock.lock().unwrap_or_else(|e| e.into_inner());
    let mut w = w;
    w.write_all(&m)
}

impl Filler {
    /// Start filling into `t` with `lookup`, answering on `w` under `lock`.
    pub fn start(
        mut lookup: LookupClient,
        t: Target,
        w: Socket,
        lock: Arc<Mutex<()>>,
    ) -> std::io::Result<Filler> {
        let (tx, rx) = channel::<Job>();
        let thread = std::thread::Builder::new()
            .name("dedup filler".into())
            .spawn(move || {
                let mut out = Outcome::default();
                let mut ok = true;
                let mut buf = Vec::new();
                for job in rx {
                    let t0 = Instant::now();
                    let c0 = pagefleet_common::clock::thread_cpu_secs();
                    let n = job.hashes.len();
                    // A miss's page read in place gets its data from the
                    // source next.
                    let direct = t.direct;
                    let found = if !ok {
                        vec![Found::Miss; n]
                    } else {
                        let r = if direct {
                            // The pages' memory in runs first (one call per
                            // run, not a fault per page inside each read).
                            populate_runs(&t, &job.pages);
                            let mut rooms: Vec<&mut [u8]> = job
                                .pages
                                .iter()
                                .map(|&(p, _)| {
                                    // SAFETY: p is in bounds (the receiver checked it),
                                    // distinct within a batch, and nothing else reads
                                    // or writes a page named in a HASHES batch until
                                    // its HAVE is sent.
                                    unsafe {
                                        std::slice::from_raw_parts_mut(
                                            (t.shared.base as *mut u8).add(p * PAGE),
                                            PAGE,
                                        )
                                    }
                                })
                                .collect();
                            lookup.find_into(&job.hashes, &mut rooms)
                        } else {
                            buf.resize(n * PAGE, 0);
                            lookup.find(&job.hashes, &mut buf)
                        };
                        r.unwrap_or_else(|e| {
                            // The host's index is an optimization: without it
                            // every page comes as data.
                            tracing::warn!(
                                "content lookup failed ({e}); receiving every page as data"
                            );
                            ok = false;
                            vec![Found::Miss; n]
                        })
                    };
                    let mut filled = vec![false; n];
                    for (k, (&(p, hist), f)) in job.pages.iter().zip(&found).enumerate() {
                        let data = match f {
                            Found::Miss => continue,
                            Found::Zero => Fill::Zero,
                            Found::Data if direct => Fill::InPlace,
                            Found::Data => Fill::Copy(&buf[k * PAGE..(k + 1) * PAGE]),
                        };
                        match fill_page(&t, p, data) {
                            Ok(()) => {
                                out.history.push((p, hist));
                                filled[k] = true;
                                match f {
                                    Found::Zero => out.filled.zero += 1,
                                    _ => out.filled.pages += 1,
                                }
                            }
                            // Not filled: its data comes, and meets the same
                            // error on the receiver, which fails the migration.
                            Err(e) => tracing::warn!("filling page {p}: {e}"),
                        }
                    }
                    out.filled.asked += n as u64;
                    out.filled.stale = lookup.stats.stale;
                    out.filled.ask_secs = lookup.stats.ask_secs;
                    out.filled.check_secs = lookup.stats.check_secs;
                    out.filled.secs += t0.elapsed().as_secs_f64();
                    out.filled.cpu_secs += pagefleet_common::clock::thread_cpu_secs() - c0;
                    let have = crate::dedup::bitmap(&filled);
                    if send_locked(&w, &lock, Kind::Have, job.batch, &have).is_err() {
                        // The receiver sees the broken stream too.
                        break;
                    }
                }
                out
            });
        Ok(Filler {
            queue: Some(tx),
            thread: Some(thread?),
        })
    }

    /// Queue a batch; false if the filler is gone.
    pub fn push(&self, batch: u64, pages: Vec<(usize, u8)>, hashes: Vec<PageHash>) -> bool {
        self.queue.as_ref().is_some_and(|q| {
            q.send(Job {
                batch,
                pages,
                hashes,
            })
            .is_ok()
        })
    }

    /// Wait for every queued batch; what was filled.
    pub fn finish(mut self) -> Outcome {
        self.queue.take();
        self.thread
            .take()
            .and_then(|t| t.join().ok())
            .unwrap_or_default()
    }
}

impl Drop for Filler {
    fn drop(&mut self) {
        self.queue.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What a filled page gets.
enum Fill<'a> {
    /// The zero page.
    Zero,
    /// Already read into its place in guest memory (and checked).
    InPlace,
    /// These bytes (checked).
    Copy(&'a [u8]),
}

/// Page `p` is filled from this host, by the same rules as a page that
/// came as data.
fn fill_page(t: &Target, p: usize, data: Fill<'_>) -> std::io::Result<()> {
    let mut loc = t.shared.loc.lock().unwrap_or_else(|e| e.into_inner());
    if loc[p] == PULLED {
        t.shared.replaced.fetch_add(1, Relaxed);
    }
    match data {
        Fill::Zero => {
            // A hole reads as zeros; data from an earlier round (or memory
            // populated for a direct read) goes.
            if loc[p] == HERE || loc[p] == PULLED || t.direct {
                pagefleet_uffd::punch_hole(&t.fd, (p * PAGE) as u64, PAGE as u64)?;
            }
            loc[p] = ZERO_SERVER;
            return Ok(());
        }
        Fill::InPlace => {}
        // SAFETY: in bounds (the receiver checked p); the guest does not run
        // yet, and every writer of its memory holds `loc`'s lock (held).
        Fill::Copy(d) => unsafe {
            std::ptr::copy_nonoverlapping(
                d.as_ptr(),
                (t.shared.base as *mut u8).add(p * PAGE),
                PAGE,
            )
        },
    }
    loc[p] = HERE;
    Ok(())
}

/// Allocate and map the memory of a batch's pages, in runs.
fn populate_runs(t: &Target, pages: &[(usize, u8)]) {
    let mut i = 0;
    while i < pages.len() {
        let mut j = i + 1;
        while j < pages.len() && pages[j].0 == pages[j - 1].0 + 1 {
            j += 1;
        }
        // SAFETY: part of the guest mapping (in bounds: the receiver
        // checked the pages), which the target holds.
        unsafe {
            crate::sys::populate_write(
                (t.shared.base as *mut u8).add(pages[i].0 * PAGE),
                (j - i) * PAGE,
            );
        }
        i = j;
    }
}
