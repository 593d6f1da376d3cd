//! Page-in: the faulting pages and their read-ahead, from their servers.

use super::*;
use std::collections::HashSet;

impl Pager {
    /// The pages to bring with a fault at `p` from server `s`: the rest of
    /// its chunk (fixed prefetch) or its stream's window (adaptive), only
    /// those on `s` and not in `asked` (which gains them).
    pub(super) fn prefetch_list(
        &mut self,
        p: usize,
        s: usize,
        asked: &mut HashSet<usize>,
    ) -> Vec<u64> {
        let tag = (REMOTE as usize + s) as u8;
        let (lo, hi) = match self.prefetch {
            crate::Prefetch::Chunk => {
                let lo = p / self.cp * self.cp;
                (lo, lo + self.cp)
            }
            crate::Prefetch::Adaptive => {
                let cap = (self.shared.budget.load(Relaxed) / 16) as usize;
                let w = self.readahead.window(p, cap);
                (p, (p + w).min(self.loc.state.len()))
            }
        };
        (lo..hi)
            .filter(|q| *q != p && self.loc.state[*q] == tag && asked.insert(*q))
            .map(|q| q as u64)
            .collect()
    }

    /// Bring back the pages of this batch's remote faults: for every server,
    /// first the faulting pages (each installed, and its thread woken, as
    /// soon as it arrives), then their read-ahead that lives there.
    ///
    /// Outside change tracking the server keeps its copy (GET keep) and the
    /// page is installed write-protected: until the guest writes it, evicting
    /// it again is a local drop. A write fault installs its page writable
    /// (dirty at once: no second fault for the write).
    pub(super) fn page_in_batch(&mut self, t_read: Instant) {
        let pending = std::mem::take(&mut self.pending_in);
        let mut servers: Vec<usize> = pending.iter().map(|x| x.1).collect();
        servers.sort_unstable();
        servers.dedup();
        for s in servers {
            let firsts: Vec<(usize, bool)> = pending
                .iter()
                .filter(|x| x.1 == s)
                .map(|x| (x.0, x.2))
                .collect();
            // Every page is asked for once: the faulting ones first.
            let mut asked: HashSet<usize> = firsts.iter().map(|x| x.0).collect();
            let mut rests: Vec<Vec<u64>> = firsts
                .iter()
                .map(|&(p, _)| self.prefetch_list(p, s, &mut asked))
                .collect();
            // Pages of a server being emptied are taken, never kept there.
            let keep = !self.tracking && self.evac.as_ref().is_none_or(|ev| ev.from != s);
            let Err((p, e)) = self.fetch(s, &firsts, &rests, keep, t_read) else {
                continue;
            };
            // A keep GET can be repeated: ride out a dropped connection or a
            // restarting proxy by reconnecting once (a take cannot: the
            // server may have dropped the pages already).
            if !(keep && e.is_transient()) || self.reconnect(s).is_err() {
                return self.lost(p, s, e);
            }
            let tag = (REMOTE as usize + s) as u8;
            let firsts: Vec<(usize, bool)> = firsts
                .into_iter()
                .filter(|x| self.loc.state[x.0] == tag)
                .collect();
            for r in rests.iter_mut() {
                r.retain(|q| self.loc.state[*q as usize] == tag);
            }
            if let Err((p, e)) = self.fetch(s, &firsts, &rests, keep, t_read) {
                return self.lost(p, s, e);
            }
        }
        self.publish();
    }

    /// GET the faulting pages, then their read-ahead, from server `s`, and
    /// install each as it arrives. On failure: the page that could not be
    /// brought in and why.
    pub(super) fn fetch(
        &mut self,
        s: usize,
        firsts: &[(usize, bool)],
        rests: &[Vec<u64>],
        keep: bool,
        t_read: Instant,
    ) -> Result<(), (usize, pagefleet_client::ClientError)> {
        let region = self.region_id;
        let mode = if keep { GetMode::Keep } else { GetMode::Take };
        let conn = &mut self.conns[s];
        let mut first_ids = Vec::new();
        let mut rest_ids = Vec::new();
        let queued: Result<(), pagefleet_client::ClientError> = (|| {
            for &(p, _) in firsts {
                first_ids.push(conn.queue_get(
                    region,
                    &PageSel::Run {
                        first: p as u64,
                        count: 1,
                    },
                    mode,
                    false,
                )?);
            }
            for rest in rests {
                for part in rest.chunks(MAX_BATCH_PAGES) {
                    rest_ids.push((
                        conn.queue_get(region, &PageSel::List(part.to_vec()), mode, false)?,
                        part.to_vec(),
                    ));
                }
            }
            conn.flush()
        })();
        if let Err(e) = queued {
            return Err((firsts.first().map_or(0, |x| x.0), e));
        }
        let shared = self.shared.clone();
        let st = &shared.stats;
        for (&(p, write), id) in firsts.iter().zip(first_ids) {
            if let Err(e) = self.conns[s].recv_get(id, &mut self.buf[..PAGE]) {
                return Err((p, e));
            }
            let wp = keep && !write;
            if let Err(e) = self
                .uffd
                .copy_mode(self.addr(p), &self.buf[..PAGE], false, wp)
            {
                self.internal(p, e.to_string());
                return Ok(());
            }
            self.arrived(p, s, keep, wp);
            self.access.refb[p] = 1;
            st.page_in_latency
                .record_us(t_read.elapsed().as_secs_f64() * 1e6);
            st.page_ins.fetch_add(1, Relaxed);
            st.page_in_requests.fetch_add(1, Relaxed);
            st.bytes_in.fetch_add(PAGE as u64, Relaxed);
        }
        for (id, part) in rest_ids {
            let len = part.len() * PAGE;
            if let Err(e) = self.conns[s].recv_get(id, &mut self.buf[..len]) {
                return Err((part[0] as usize, e));
            }
            // Install contiguous runs with one ioctl each.
            let mut i = 0;
            while i < part.len() {
                let mut j = i + 1;
                while j < part.len() && part[j] == part[j - 1] + 1 {
                    j += 1;
                }
                let q = part[i] as usize;
                if let Err(e) =
                    self.uffd
                        .copy_mode(self.addr(q), &self.buf[i * PAGE..j * PAGE], false, keep)
                {
                    self.internal(q, e.to_string());
                    return Ok(());
                }
                for r in part[i..j].iter() {
                    self.arrived(*r as usize, s, keep, keep);
                }
                i = j;
            }
            st.page_ins.fetch_add(part.len() as u64, Relaxed);
            st.prefetched_pages.fetch_add(part.len() as u64, Relaxed);
            st.page_in_requests.fetch_add(1, Relaxed);
            st.bytes_in.fetch_add(len as u64, Relaxed);
        }
        Ok(())
    }

    /// Page `q` arrived from server `s` and is resident now; with `keep` the
    /// server still holds it (clean while installed write-protected).
    pub(super) fn arrived(&mut self, q: usize, s: usize, keep: bool, clean: bool) {
        self.set_local(q);
        if keep {
            self.loc.keep_copy(q, s, clean);
        } else {
            self.free[s] += 1;
        }
    }
}
