//! Reclaim: keeping resident pages within the budget (victim choice, page-out).

use super::*;

impl Pager {
    pub(super) fn hotness(&self, c: usize) -> u32 {
        self.access.hotness(c * self.cp, (c + 1) * self.cp)
    }

    /// Over budget: page out cold chunks until a slack below it. A victim
    /// hand sweeps the chunks (LRU approximation): clock evicts a chunk with
    /// no reference bit and gives the others a second chance (bits cleared,
    /// PTEs zapped so the next touch sets them again); aging evicts the chunk
    /// with the least max age among the next few resident chunks.
    pub(super) fn balance(&mut self) {
        let budget = self.shared.budget.load(Relaxed);
        if self.hold || self.loc.state.len() as u64 <= budget {
            self.evicting = false;
            return;
        }
        // Watermarks: start evicting half a slack below the budget, stop a
        // slack below it; evict in small batches between fault batches so a
        // fault never waits behind a long eviction.
        let slack = crate::paging_slack(budget, self.cp);
        let high = budget.saturating_sub(slack / 2);
        let low = budget.saturating_sub(slack);
        if self.loc.resident > high {
            self.evicting = true;
        }
        if !self.evicting {
            return;
        }
        if self.loc.resident <= low {
            self.evicting = false;
            return;
        }
        // Over the budget itself: get back under it now, in batches of up
        // to 2 MiB; between the watermarks: one small batch per loop.
        let mut steps = 0usize;
        loop {
            // Serve the faults queued meanwhile first: a queued touch is a
            // reference, and a page about to be used must not be chosen.
            if self.uffd.poll(0).unwrap_or(false) {
                self.serve_pending();
            }
            let over = self.loc.resident > budget;
            let cap = if over { 512 } else { 64 };
            let mut batch = Vec::new();
            let mut pages = 0u64;
            while self.loc.resident - pages > low && pages < cap && steps < self.chunks * 3 {
                let Some(c) = self.next_victim(&mut steps) else {
                    break;
                };
                if batch.contains(&c) {
                    break;
                }
                pages += self.loc.chunk_res[c] as u64;
                batch.push(c);
            }
            let c0 = thread_cpu_ns();
            let t0 = Instant::now();
            let ok = !batch.is_empty() && self.page_out(&batch);
            let st = &self.shared.stats;
            st.page_out_cpu_ns
                .fetch_add(thread_cpu_ns().saturating_sub(c0), Relaxed);
            if over {
                // Over the budget itself: faults queue behind this page-out
                // (direct reclaim); between the watermarks they do not wait
                // long (one small batch between fault batches).
                st.direct_reclaims.fetch_add(1, Relaxed);
                st.direct_reclaim_ns
                    .fetch_add(t0.elapsed().as_nanos() as u64, Relaxed);
            }
            if !ok {
                self.evicting = false;
                break;
            }
            if self.loc.resident <= budget || !over {
                break;
            }
        }
        self.publish();
    }

    pub(super) fn next_resident(&mut self, steps: &mut usize) -> Option<usize> {
        for _ in 0..self.chunks {
            let c = self.victim_hand;
            self.victim_hand = (self.victim_hand + 1) % self.chunks;
            *steps += 1;
            if self.loc.chunk_res[c] > 0 {
                return Some(c);
            }
        }
        None
    }

    pub(super) fn next_victim(&mut self, steps: &mut usize) -> Option<usize> {
        match self.policy {
            Policy::Clock => loop {
                let c = self.next_resident(steps)?;
                if self.hotness(c) == 0 || *steps > self.chunks * 2 {
                    return Some(c);
                }
                // Second chance: clear the bits. Whether the chunk is touched
                // again is seen by the (budgeted) sampler or by a page-in:
                // zapping here too would make every hot chunk fault once per
                // revolution, unbudgeted.
                self.access.clear(c * self.cp, (c + 1) * self.cp);
            },
            Policy::Aging => {
                const WINDOW: usize = 32;
                let mut best: Option<(u32, usize)> = None;
                let mut seen = 0;
                while seen < WINDOW {
                    let Some(c) = self.next_resident(steps) else {
                        break;
                    };
                    let h = self.hotness(c);
                    if best.is_none_or(|(bh, _)| h < bh) {
                        best = Some((h, c));
                    }
                    seen += 1;
                    if h == 0 {
                        break;
                    }
                }
                let (_, c) = best?;
                // Resume right after the victim: the rest of the window is looked at again.
                self.victim_hand = (c + 1) % self.chunks;
                Some(c)
            }
        }
    }

    /// Page out the chunks atomically: write-protect them; send each dirty
    /// resident page (straight from the shadow mapping, pipelined) to the
    /// server that keeps its copy, or, without one, to the server with the
    /// most free room; wait for every ack; punch the holes; update the
    /// location DB; unprotect (which wakes blocked writers; their retry faults
    /// MISSING and pages back in). Clean pages (their kept copy is current)
    /// are only dropped. Returns false if no server can take the dirty pages
    /// (balancing stops; the guest keeps running over budget).
    pub(super) fn page_out(&mut self, chunks: &[usize]) -> bool {
        let mut pages = Vec::new();
        for &c in chunks {
            let lo = c * self.cp;
            pages.extend((lo..lo + self.cp).filter(|q| self.loc.state[*q] == LOCAL));
        }
        let n = pages.len() as u64;
        let fresh = |copy: &[u8]| pages.iter().filter(|q| copy[**q] == 0).count() as u64;
        let pick = |free: &[u64], new: u64| {
            (0..free.len())
                .filter(|s| free[*s] >= new)
                .max_by_key(|s| free[*s])
        };
        let mut new = fresh(&self.loc.copy);
        let mut chosen = pick(&self.free, new);
        if chosen.is_none() && new > 0 && self.loc.copies.iter().any(|c| *c > 0) {
            // Room held by kept copies of resident pages is worth less
            // than room for pages that must leave: give it back.
            if !self.drop_copies(None, new.max(64)) {
                return false;
            }
            new = fresh(&self.loc.copy);
            chosen = pick(&self.free, new);
        }
        let Some(s) = chosen.or(if new == 0 { Some(0) } else { None }) else {
            if !self.full_warned {
                warn!("every memory server is full: the region stays over its budget");
                self.full_warned = true;
            }
            return false;
        };
        let target = |q: usize, copy: &[u8]| {
            if copy[q] > 0 {
                copy[q] as usize - 1
            } else {
                s
            }
        };
        let span = (self.cp * PAGE) as u64;
        for &c in chunks {
            if let Err(e) = self.uffd.writeprotect(self.addr(c * self.cp), span, true) {
                self.internal(c * self.cp, e.to_string());
                return false;
            }
        }
        // Dirty pages per destination server, in frames of up to
        // MAX_BATCH_PAGES (scattered pages share a frame: one send and one
        // ack per 32 pages, not per run).
        let mut batches: Vec<(usize, Vec<u64>)> = Vec::new();
        for &q in &pages {
            if self.loc.clean[q] {
                continue;
            }
            let t = target(q, &self.loc.copy);
            match batches
                .iter_mut()
                .rev()
                .find(|(bt, b)| *bt == t && b.len() < MAX_BATCH_PAGES)
            {
                Some((_, b)) => b.push(q as u64),
                None => batches.push((t, vec![q as u64])),
            }
        }
        let mut failed: Option<(usize, pagefleet_client::ClientError)> = None;
        let mut servers: Vec<usize> = batches.iter().map(|r| r.0).collect();
        servers.sort_unstable();
        servers.dedup();
        for t in servers {
            let mut sent = self.send_batches(t, &batches);
            // A PUT can be repeated (it overwrites): ride out a dropped
            // connection by reconnecting once; the pages are still here.
            if sent.as_ref().is_err_and(|e| e.is_transient()) && self.reconnect(t).is_ok() {
                sent = self.send_batches(t, &batches);
            }
            if let Err(e) = sent {
                failed = Some((t, e));
                break;
            }
        }
        if let Some((t, e)) = failed {
            for &c in chunks {
                let _ = self.uffd.writeprotect(self.addr(c * self.cp), span, false);
            }
            if e.code() == Some(pagefleet_proto::ErrorCode::OutOfCapacity) {
                debug!("memory server {} is full", self.addrs[t]);
                self.free[t] = 0;
                return true;
            }
            let msg = format!(
                "pagefleet: cannot page out to memory server {} (region {:#x}): {e}. The server is unusable; \
                 pages already there cannot be trusted to come back.",
                self.addrs[t], self.region_id
            );
            self.fatal(msg, chunks[0] * self.cp);
            return false;
        }
        // Punch holes, coalescing adjacent pages.
        let mut i = 0;
        while i < pages.len() {
            let mut j = i + 1;
            while j < pages.len() && pages[j] == pages[j - 1] + 1 {
                j += 1;
            }
            if let Err(e) = uffd::punch_hole(
                self.memfd.as_raw_fd(),
                (pages[i] * PAGE) as u64,
                ((j - i) * PAGE) as u64,
            ) {
                self.internal(pages[i], e.to_string());
                return false;
            }
            i = j;
        }
        let mut dropped = 0u64;
        for &q in &pages {
            self.mark(q);
            let t = target(q, &self.loc.copy);
            if self.loc.clean[q] {
                dropped += 1;
            }
            self.loc.set_remote(q, t);
            self.access.clear(q, q + 1);
        }
        self.free[s] -= new;
        let st = &self.shared.stats;
        st.page_outs.fetch_add(n - dropped, Relaxed);
        st.clean_drops.fetch_add(dropped, Relaxed);
        st.page_out_chunks.fetch_add(chunks.len() as u64, Relaxed);
        st.bytes_out.fetch_add((n - dropped) * PAGE as u64, Relaxed);
        for &c in chunks {
            if let Err(e) = self.uffd.writeprotect(self.addr(c * self.cp), span, false) {
                self.internal(c * self.cp, e.to_string());
                return false;
            }
        }
        true
    }

    /// PUT the batches bound for server `t` and wait for every ack.
    fn send_batches(
        &mut self,
        t: usize,
        batches: &[(usize, Vec<u64>)],
    ) -> Result<(), pagefleet_client::ClientError> {
        let region = self.region_id;
        let mut ids = std::collections::VecDeque::new();
        for (_, list) in batches.iter().filter(|r| r.0 == t) {
            let data: Vec<&[u8]> = list
                .iter()
                .map(|&q| {
                    // SAFETY: inside the shadow mapping; the page is
                    // resident and write-protected until it is punched.
                    unsafe {
                        std::slice::from_raw_parts(self.shadow.addr().add(q as usize * PAGE), PAGE)
                    }
                })
                .collect();
            let contiguous = list.windows(2).all(|w| w[1] == w[0] + 1);
            let sel = if contiguous {
                PageSel::Run {
                    first: list[0],
                    count: list.len() as u32,
                }
            } else {
                PageSel::List(list.clone())
            };
            ids.push_back(self.conns[t].send_put_pages(region, &sel, &data)?);
            // Bound the acks outstanding so neither side's buffers fill up.
            if ids.len() >= 64 {
                self.conns[t].recv_put(ids.pop_front().unwrap())?;
            }
        }
        for id in ids {
            self.conns[t].recv_put(id)?;
        }
        Ok(())
    }

    /// Delete kept copies of resident pages (on server `only`, or on any),
    /// at most `max` of them; their pages become plain resident (dirty).
    /// Returns false if a server could not be told (the guest is ended).
    pub(super) fn drop_copies(&mut self, only: Option<usize>, max: u64) -> bool {
        let mut lists: Vec<Vec<u64>> = vec![Vec::new(); self.conns.len()];
        let mut n = 0u64;
        // A hand, so repeated small calls do not rescan the same pages.
        let len = self.loc.copy.len();
        for i in 0..len {
            if n >= max {
                self.copy_hand = (self.copy_hand + i) % len;
                break;
            }
            let q = (self.copy_hand + i) % len;
            let c = self.loc.copy[q];
            if c == 0 || only.is_some_and(|o| o + 1 != c as usize) {
                continue;
            }
            lists[c as usize - 1].push(q as u64);
            self.loc.forget_copy(q);
            n += 1;
        }
        let region = self.region_id;
        for (s, list) in lists.into_iter().enumerate() {
            if list.is_empty() {
                continue;
            }
            for part in list.chunks(pagefleet_proto::MAX_DELETE_LIST) {
                let mut r = self.conns[s].delete(region, Pages::List(part));
                if r.as_ref().is_err_and(|e| e.is_transient()) && self.reconnect(s).is_ok() {
                    r = self.conns[s].delete(region, Pages::List(part));
                }
                if let Err(e) = r {
                    let msg = format!(
                        "pagefleet: cannot free kept pages on memory server {} (region {:#x}): {e}",
                        self.addrs[s], self.region_id
                    );
                    self.fatal(msg, part[0] as usize);
                    return false;
                }
            }
            self.free[s] += list.len() as u64;
        }
        true
    }
}
