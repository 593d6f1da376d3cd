//! Evacuation: moving every page on one server to another (pages read
//! from it and, with two replicas, mirror copies it holds).

use super::*;

/// An evacuation in progress: pages on server `from` move to `to`.
pub(super) struct Evac {
    /// The server being emptied.
    pub(super) from: usize,
    /// Where its pages go.
    pub(super) to: usize,
    /// The next page to look at.
    pub(super) cursor: usize,
    /// Pages moved so far.
    pub(super) moved: u64,
    /// Told the outcome when done.
    pub(super) reply: std::sync::mpsc::Sender<Result<u64, String>>,
}

impl Pager {
    /// Move up to a few batches of an evacuation, then go back to faults.
    pub(super) fn evacuate_step(&mut self) {
        let Some(mut ev) = self.evac.take() else {
            return;
        };
        // Replies come in order on a connection: the GETs in flight first.
        self.take_replies(ev.from, true);
        self.take_replies(ev.to, true);
        let (tag, mark) = (REMOTE + ev.from as u8, ev.from as u8 + 1);
        let region = self.region_id;
        for _ in 0..4 {
            let mut list = Vec::with_capacity(MAX_BATCH_PAGES);
            while ev.cursor < self.loc.state.len() && list.len() < MAX_BATCH_PAGES {
                // (An arriving page is taken from `from` by its GET.)
                let q = ev.cursor;
                let on_from = self.loc.state[q] == tag
                    || (self.loc.state[q] >= REMOTE && self.loc.second[q] == mark);
                if on_from && self.loc.out[q] == OUT_NONE {
                    list.push(ev.cursor as u64);
                }
                ev.cursor += 1;
            }
            if list.is_empty() {
                let _ = ev.reply.send(Ok(ev.moved));
                return;
            }
            let n = list.len();
            let buf = self.pagein.buf_mut(n * PAGE);
            // Copy, store at the new server, and only then delete at the old one.
            let r = self
                .servers
                .conn_mut(ev.from)
                .get(
                    region,
                    Pages::List(&list),
                    buf,
                    GetMode::Keep,
                    false,
                    MAX_BATCH_PAGES,
                )
                .and_then(|_| {
                    self.servers.conn_mut(ev.to).put(
                        region,
                        Pages::List(&list),
                        buf,
                        MAX_BATCH_PAGES,
                    )
                })
                .and_then(|_| {
                    self.servers
                        .conn_mut(ev.from)
                        .delete(region, Pages::List(&list))
                });
            if let Err(e) = r {
                let _ = ev.reply.send(Err(format!(
                    "moving pages from {} to {}: {e} ({} moved before)",
                    self.servers.addr(ev.from),
                    self.servers.addr(ev.to),
                    ev.moved
                )));
                return;
            }
            let (to_tag, to_mark) = (REMOTE + ev.to as u8, ev.to as u8 + 1);
            for &p in &list {
                let p = p as usize;
                if self.loc.state[p] == tag {
                    self.loc.state[p] = to_tag;
                    self.mark(p);
                    if self.loc.second[p] == to_mark {
                        // Both copies would be on one server: one it is
                        // (re-replication makes the second elsewhere).
                        self.loc.second[p] = 0;
                        self.repl.degraded();
                    }
                } else if self.loc.state[p] == to_tag {
                    self.loc.second[p] = 0;
                    self.repl.degraded();
                } else {
                    self.loc.second[p] = to_mark;
                }
            }
            self.servers.took(ev.to, n as u64);
            ev.moved += n as u64;
        }
        self.evac = Some(ev);
    }
}
