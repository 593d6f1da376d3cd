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

use crate::dedup::Filled;
use crate::dest::{map_resident, Shared, HERE, PULLED};
use crate::wire::{Header, Kind, MAX_PAGES, ZERO_SERVER};
use pagefleet_dedup::lookup::{Found, LookupClient};
use pagefleet_dedup::PageHash;
use pagefleet_region::PAGE;
use std::io::Write;
use std::net::TcpStream;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

/// Where filled pages go.
#[derive(Clone)]
pub(crate) struct Target {
    /// The guest memory's memfd (owned by the receiver, which outlives the filler).
    pub fd: i32,
    /// Receive location state and the guest mapping.
    pub shared: Arc<Shared>,
    /// Gather: pullers write the memory too (copy under the lock).
    pub gather: bool,
    /// In a memory cgroup: write through the mapping, not the file.
    pub limited: bool,
    /// A native guest: map filled pages so it takes no fault on them.
    pub populate: bool,
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
    w: &mut TcpStream,
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
    w.write_all(&m)
}

impl Filler {
    /// Start filling into `t` with `lookup`, answering on `w` under `lock`.
    pub fn start(
        mut lookup: LookupClient,
        t: Target,
        mut w: TcpStream,
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
                    let c0 = thread_cpu_secs();
                    let n = job.hashes.len();
                    // A native or VM guest outside gather and memory cgroups:
                    // pages are read straight into its memory (a miss's page
                    // gets its data from the source next). Otherwise into a
                    // buffer, copied under the lock pullers take.
                    let direct = !(t.gather || t.limited);
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
                    let mut to_map = Vec::new();
                    for (k, (&(p, hist), f)) in job.pages.iter().zip(&found).enumerate() {
                        let data = match f {
                            Found::Miss => continue,
                            Found::Zero => Fill::Zero,
                            Found::Data if direct => Fill::InPlace,
                            Found::Data => Fill::Copy(&buf[k * PAGE..(k + 1) * PAGE]),
                        };
                        match fill_page(&t, p, data) {
                            Ok(through_file) => {
                                if through_file && t.populate {
                                    to_map.push(p);
                                }
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
                    map_runs(&t, &to_map);
                    out.filled.asked += n as u64;
                    out.filled.stale = lookup.stats.stale;
                    out.filled.ask_secs = lookup.stats.ask_secs;
                    out.filled.check_secs = lookup.stats.check_secs;
                    out.filled.secs += t0.elapsed().as_secs_f64();
                    out.filled.cpu_secs += thread_cpu_secs() - c0;
                    let have = crate::dedup::bitmap(&filled);
                    if send_locked(&mut w, &lock, Kind::Have, job.batch, &have).is_err() {
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

/// CPU time of the calling thread, seconds.
pub(crate) fn thread_cpu_secs() -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.tv_sec as f64 + t.tv_nsec as f64 / 1e9
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
/// came as data. Returns whether it was written through the file (to be
/// mapped afterwards).
fn fill_page(t: &Target, p: usize, data: Fill<'_>) -> std::io::Result<bool> {
    let mut loc = t.shared.loc.lock().unwrap_or_else(|e| e.into_inner());
    if loc[p] == PULLED {
        t.shared.replaced.fetch_add(1, Relaxed);
    }
    let d = match data {
        Fill::Zero => {
            // A hole reads as zeros; data from an earlier round (or memory
            // populated for a direct read) goes.
            if loc[p] == HERE || loc[p] == PULLED || !(t.gather || t.limited) {
                pagefleet_uffd::punch_hole(t.fd, (p * PAGE) as u64, PAGE as u64)?;
            }
            loc[p] = ZERO_SERVER;
            return Ok(false);
        }
        Fill::InPlace => {
            loc[p] = HERE;
            return Ok(false);
        }
        Fill::Copy(d) => d,
    };
    let through_file = !(t.gather || t.limited);
    if through_file {
        // As for PAGES: written through the file (no zeroing of a fresh page).
        // SAFETY: pwrite from a buffer we hold into the guest's memfd.
        let n = unsafe { libc::pwrite(t.fd, d.as_ptr().cast(), PAGE, (p * PAGE) as i64) };
        if n != PAGE as isize {
            return Err(if n < 0 {
                std::io::Error::last_os_error()
            } else {
                std::io::ErrorKind::WriteZero.into()
            });
        }
    } else {
        // SAFETY: in bounds (the receiver checked p); the guest does not run
        // yet, and every writer of its memory holds `loc`'s lock (held).
        unsafe {
            std::ptr::copy_nonoverlapping(
                d.as_ptr(),
                (t.shared.base as *mut u8).add(p * PAGE),
                PAGE,
            )
        };
    }
    loc[p] = HERE;
    Ok(through_file)
}

/// Allocate and map the memory of a batch's pages, in runs.
fn populate_runs(t: &Target, pages: &[(usize, u8)]) {
    let mut i = 0;
    while i < pages.len() {
        let mut j = i + 1;
        while j < pages.len() && pages[j].0 == pages[j - 1].0 + 1 {
            j += 1;
        }
        // SAFETY: madvise on part of the guest mapping (in bounds: the
        // receiver checked the pages); populating changes no data.
        unsafe {
            libc::madvise(
                (t.shared.base as *mut u8).add(pages[i].0 * PAGE).cast(),
                (j - i) * PAGE,
                23, /* MADV_POPULATE_WRITE */
            );
        }
        i = j;
    }
}

/// Map `pages` (sorted) in runs, so the resumed guest takes no fault on them.
fn map_runs(t: &Target, pages: &[usize]) {
    let mut i = 0;
    while i < pages.len() {
        let mut j = i + 1;
        while j < pages.len() && pages[j] == pages[j - 1] + 1 && j - i < MAX_PAGES {
            j += 1;
        }
        // SAFETY: in bounds (checked by the receiver); mapping pages in
        // changes no data.
        let run = unsafe {
            std::slice::from_raw_parts_mut(
                (t.shared.base as *mut u8).add(pages[i] * PAGE),
                (j - i) * PAGE,
            )
        };
        map_resident(run);
        i = j;
    }
}
