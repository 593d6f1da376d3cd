//! PUSH: storing pages this server holds on another memory server.
//!
//! Re-replication after a server's death copies every page that lost its
//! second copy. Relayed through the guest's host each byte crosses two
//! links and that host's CPU twice; pushed from the server holding the
//! surviving copy it crosses one, and the guest's host only asks. The
//! session connects to the other server as an ordinary client (the
//! cluster secret, TLS by the process identity), keeps that connection
//! for the session's next pushes, and sends the pages straight from their
//! slots, every frame in flight before the first ack is read.

use pagefleet_client::{Conn, ConnectOptions};
use pagefleet_proto::{PageSel, PushReq, MAX_BATCH_PAGES};
use std::collections::HashMap;

/// A session's connections to other memory servers, by address.
#[derive(Default)]
pub(crate) struct Peers {
    conns: HashMap<String, Conn>,
}

impl Peers {
    /// Store `ptrs` (the pages of `req`, in its order) on `req.target`
    /// for the server `server_id` (which a PUSH to itself names).
    ///
    /// # Safety
    /// Every pointer must stay readable for `PAGE_SIZE` bytes for the call
    /// (pinned store slots).
    pub(crate) unsafe fn push(
        &mut self,
        server_id: u64,
        secret: &pagefleet_proto::auth::Secret,
        req: &PushReq,
        ptrs: &[*const u8],
    ) -> Result<u64, String> {
        if req.target_id == server_id {
            return Err("a PUSH to this server itself".into());
        }
        if !self.conns.contains_key(&req.target) {
            let opts = ConnectOptions {
                name: "pagefleet-memserver-push".into(),
                window: 64,
                ..Default::default()
            };
            let c = Conn::connect(&req.target, secret, &opts)
                .map_err(|e| format!("cannot reach {}: {e}", req.target))?;
            self.conns.insert(req.target.clone(), c);
        }
        let conn = self.conns.get_mut(&req.target).expect("connected above");
        if conn.info.server_id != req.target_id {
            return Err(format!(
                "{} is not the server the client named (it restarted: another id)",
                req.target
            ));
        }
        // SAFETY: the caller keeps the pointers readable.
        let r = unsafe { send_all(conn, req, ptrs) };
        if r.is_err() {
            self.conns.remove(&req.target);
        }
        r
    }
}

/// SAFETY: as [`Peers::push`].
unsafe fn send_all(conn: &mut Conn, req: &PushReq, ptrs: &[*const u8]) -> Result<u64, String> {
    let mut ids = Vec::with_capacity(req.pages.len().div_ceil(MAX_BATCH_PAGES));
    for (pages, ptrs) in req
        .pages
        .chunks(MAX_BATCH_PAGES)
        .zip(ptrs.chunks(MAX_BATCH_PAGES))
    {
        let sel = PageSel::List(pages.to_vec());
        // SAFETY: the caller keeps every pointer readable for a page.
        let id = unsafe { conn.send_put_raw(req.region, &sel, ptrs) }
            .map_err(|e| format!("storing on {}: {e}", req.target))?;
        ids.push(id);
    }
    let mut first = None;
    for id in ids {
        if let Err(e) = conn.recv_put(id) {
            first.get_or_insert(format!("storing on {}: {e}", req.target));
        }
    }
    match first {
        Some(e) => Err(e),
        None => Ok(req.pages.len() as u64),
    }
}
