//! Commands from the region's owner (tracking, snapshots, holds, evacuations).

use super::*;

impl Pager {
    pub(super) fn command(&mut self, c: Command) {
        let (base, len) = (self.guest.base(), self.guest.len() as u64);
        match c {
            Command::TrackDirty(on, reply) => {
                // Page-outs in flight land first: tracking starts (or ends)
                // on settled locations and no kept copy is in a job.
                self.quiesce();
                self.changes.set(on);
                // A migration moves resident pages itself: copies kept on
                // servers would be orphaned there, so they go now (and
                // page-ins take while tracking).
                if on {
                    self.drop_copies(None, u64::MAX);
                }
                // Mapped resident pages fault on their next write; unmapped
                // ones keep a write-protect marker (the kernel installs one).
                if let Err(e) = self.uffd.writeprotect(base, len, on) {
                    warn!("change tracking: {e}");
                }
                let _ = reply.send(());
            }
            Command::TakeDirty(reply) => {
                let list = self.changes.take();
                // Re-arm: resident pages written this round fault on their next write.
                if self.changes.on() {
                    for run in consecutive_runs(&list) {
                        let _ = self.uffd.writeprotect(
                            self.addr(list[run.start] as usize),
                            (run.len() * PAGE) as u64,
                            true,
                        );
                    }
                }
                let _ = reply.send(list);
            }
            Command::Evacuate { from, to, reply } => {
                if self.evac.is_some() {
                    let _ = reply.send(Err("an evacuation is already running".into()));
                    return;
                }
                let Some(f) = self.servers.addrs().iter().position(|a| *a == from) else {
                    let _ = reply.send(Ok(0));
                    return;
                };
                if from == to {
                    let _ = reply.send(Err("evacuating a server onto itself".into()));
                    return;
                }
                match self.server_index(&to) {
                    Ok(t) => {
                        self.quiesce();
                        // Nothing pages out to the server being emptied,
                        // and nothing stays kept there.
                        self.drop_copies(Some(f), u64::MAX);
                        self.servers.full(f);
                        self.evac = Some(super::evacuate::Evac {
                            from: f,
                            to: t,
                            cursor: 0,
                            moved: 0,
                            reply,
                        });
                    }
                    Err(e) => {
                        let _ = reply.send(Err(format!("cannot use {to}: {e}")));
                    }
                }
            }
            Command::Hold(on, reply) => {
                // A hold precedes a migration's final copy: what is in
                // flight lands first, so the memfd and the location DB agree.
                self.quiesce();
                self.owner.hold(on);
                self.reclaim.stop();
                let _ = reply.send(());
            }
            Command::Pages(pages, reply) => {
                let v = pages
                    .iter()
                    .map(|&p| {
                        let p = (p as usize).min(self.loc.pages() - 1);
                        (self.loc.location(p), self.access.byte(p))
                    })
                    .collect();
                let _ = reply.send(v);
            }
            Command::Snapshot(reply) => {
                let location = (0..self.loc.pages())
                    .map(|p| self.loc.location(p))
                    .collect();
                let history = (0..self.loc.pages()).map(|p| self.access.byte(p)).collect();
                let _ = reply.send(Snapshot {
                    region_id: self.region_id,
                    chunk_pages: self.cp,
                    servers: self.servers.addrs().to_vec(),
                    location,
                    history,
                });
            }
        }
    }
}
