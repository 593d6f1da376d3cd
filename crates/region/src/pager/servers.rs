//! The server set: one connection per memory server the region pages to,
//! what each has room for, which are down, the GETs in flight on each, and
//! which connections the fault loop's epoll watches.
//!
//! The set owns its connections: connecting (patiently, with the cluster
//! secret), adding a server met later (an evacuation's target),
//! reconnecting to the same server after a broken connection (a restarted
//! server lost its pages, so a new `server_id` is an error, not a
//! connection). Which server holds a page is the location DB's business;
//! what a dead server means for its pages is [`replicate`]'s.

use super::pagein::GetQueues;
use super::replicate::{REPLICA_IO_TIMEOUT, REPLICA_PATIENCE};
use super::{CONNECT_PATIENCE, TOKEN_SERVER0};
use crate::{Config, RegionError};
use pagefleet_client::{ClientError, Conn, ConnectOptions};
use pagefleet_proto::auth::Secret;
use pagefleet_uffd as uffd;
use std::os::fd::RawFd;
use std::time::Duration;
use tracing::warn;

/// At most this many memory servers per region: a page's location is one
/// byte (`REMOTE + server`).
pub(super) const MAX_SERVERS: usize = 250;

/// Requests a pager keeps in flight on one server connection.
const PAGER_WINDOW: usize = 4;

pub(super) struct Servers {
    /// Connection `s` (index = the server number in the location DB).
    conns: Vec<Conn>,
    addrs: Vec<String>,
    /// Pages each server has room for, as far as this region knows.
    free: Vec<u64>,
    /// Found dead: its pages are read from their mirrors.
    down: Vec<bool>,
    /// GETs in flight, per server.
    gets: GetQueues,
    /// Servers whose connection reported new bytes in the last wait.
    ready: Vec<bool>,
    /// The connection fd the epoll watches per server (a reconnect replaces it).
    watched: Vec<RawFd>,
    /// For connecting to servers added later; None: a region made without servers.
    secret: Option<Secret>,
    /// The region's name (connections are called `<name>-pager`).
    name: String,
    /// How long a reconnect keeps trying, and how long any one read or
    /// write waits (see [`patience`], [`io_timeout`]).
    patience: Duration,
    io_timeout: Duration,
}

impl Servers {
    /// Connect to the configured servers (or take the connections a
    /// migration handed over).
    pub fn open(cfg: &Config) -> Result<Servers, RegionError> {
        let mut set = Servers {
            conns: Vec::new(),
            addrs: Vec::new(),
            free: Vec::new(),
            down: Vec::new(),
            gets: Vec::new(),
            ready: Vec::new(),
            watched: Vec::new(),
            secret: cfg.secret.clone(),
            name: cfg.name.clone(),
            patience: patience(cfg.replicas),
            io_timeout: io_timeout(cfg.replicas),
        };
        let Some(secret) = &cfg.secret else {
            return Ok(set);
        };
        for a in &cfg.servers {
            let handed = cfg.adopt.as_ref().and_then(|ad| {
                let mut v = ad.conns.lock().unwrap();
                v.iter()
                    .position(|(x, _)| x == a)
                    .map(|i| v.swap_remove(i).1)
            });
            let c = match handed {
                Some(mut c) => {
                    c.set_window(PAGER_WINDOW);
                    c
                }
                None => connect(&cfg.name, a, secret, CONNECT_PATIENCE, set.io_timeout)?,
            };
            set.push(a, c);
        }
        Ok(set)
    }

    fn push(&mut self, addr: &str, c: Conn) {
        self.free
            .push(c.info.capacity_pages.saturating_sub(c.info.used_pages));
        self.conns.push(c);
        self.addrs.push(addr.to_string());
        self.down.push(false);
        self.gets.push(Default::default());
    }

    pub fn len(&self) -> usize {
        self.conns.len()
    }

    /// Server `s`'s address.
    pub fn addr(&self, s: usize) -> &str {
        &self.addrs[s]
    }

    /// Every server's address, by number.
    pub fn addrs(&self) -> &[String] {
        &self.addrs
    }

    pub fn conn(&self, s: usize) -> &Conn {
        &self.conns[s]
    }

    pub fn conn_mut(&mut self, s: usize) -> &mut Conn {
        &mut self.conns[s]
    }

    /// Pages server `s` has room for, as far as this region knows.
    pub fn room(&self, s: usize) -> u64 {
        self.free[s]
    }

    /// Every server's room, by number.
    pub fn rooms(&self) -> &[u64] {
        &self.free
    }

    /// Server `s` took `n` pages.
    pub fn took(&mut self, s: usize, n: u64) {
        self.free[s] = self.free[s].saturating_sub(n);
    }

    /// Server `s` freed `n` pages.
    pub fn freed(&mut self, s: usize, n: u64) {
        self.free[s] += n;
    }

    /// Server `s` takes nothing more (it said it is full, or it is being emptied).
    pub fn full(&mut self, s: usize) {
        self.free[s] = 0;
    }

    /// Server `s` said it has room for `n` pages.
    pub fn set_room(&mut self, s: usize, n: u64) {
        self.free[s] = n;
    }

    /// Whether server `s` was called down.
    pub fn is_down(&self, s: usize) -> bool {
        self.down[s]
    }

    /// Every server's down flag, by number.
    pub fn downs(&self) -> &[bool] {
        &self.down
    }

    pub fn set_down(&mut self, s: usize, down: bool) {
        self.down[s] = down;
    }

    /// The GETs in flight on server `s`, oldest first.
    pub fn gets_mut(&mut self, s: usize) -> &mut std::collections::VecDeque<super::pagein::Get> {
        &mut self.gets[s]
    }

    /// The GETs in flight on server `s`, taken (its connection is gone).
    pub fn take_gets(&mut self, s: usize) -> std::collections::VecDeque<super::pagein::Get> {
        std::mem::take(&mut self.gets[s])
    }

    /// Server `s`'s connection and the GETs in flight on it, together.
    pub fn conn_and_gets(
        &mut self,
        s: usize,
    ) -> (
        &mut Conn,
        &mut std::collections::VecDeque<super::pagein::Get>,
    ) {
        (&mut self.conns[s], &mut self.gets[s])
    }

    /// Whether server `s` has replies to take in: GETs in flight and new
    /// bytes (`readable`: the last wait said so) or bytes read ahead.
    pub fn reply_due(&self, s: usize, readable: bool) -> bool {
        !self.gets[s].is_empty() && (readable || self.conns[s].buffered())
    }

    /// A new wait begins: no connection has reported bytes yet.
    pub fn clear_ready(&mut self) {
        self.ready.iter_mut().for_each(|r| *r = false);
    }

    /// Server `s`'s connection reported new bytes (an epoll edge).
    pub fn mark_ready(&mut self, s: usize) {
        if let Some(r) = self.ready.get_mut(s) {
            *r = true;
        }
    }

    /// Whether server `s`'s connection reported new bytes in the last wait.
    pub fn is_ready(&self, s: usize) -> bool {
        self.ready.get(s).copied().unwrap_or(false)
    }

    /// Whether any GET is in flight.
    pub fn any_in_flight(&self) -> bool {
        self.gets.iter().any(|q| !q.is_empty())
    }

    pub fn index_of(&self, addr: &str) -> Option<usize> {
        self.addrs.iter().position(|a| a == addr)
    }

    /// Connect to a server met later; its index.
    pub fn add(&mut self, addr: &str) -> Result<usize, String> {
        if self.addrs.len() >= MAX_SERVERS {
            return Err(format!("at most {MAX_SERVERS} memory servers per region"));
        }
        let secret = self
            .secret
            .as_ref()
            .ok_or("this region has no cluster secret (it was made without memory servers)")?;
        let c = connect(&self.name, addr, secret, CONNECT_PATIENCE, self.io_timeout)
            .map_err(|e| e.to_string())?;
        self.push(addr, c);
        Ok(self.addrs.len() - 1)
    }

    /// A new connection to server `s`, the same server (not a restarted
    /// one, which lost its pages), trying for `patience`.
    pub fn connect_again(
        &self,
        s: usize,
        patience: Duration,
        io_timeout: Duration,
    ) -> Result<Conn, ClientError> {
        let secret = self
            .secret
            .as_ref()
            .ok_or_else(|| ClientError::Usage("no cluster secret to reconnect with".into()))?;
        let c = connect(&self.name, &self.addrs[s], secret, patience, io_timeout)?;
        if c.info.server_id != self.conns[s].info.server_id {
            // Restarted: whatever it held is gone; reconnecting cannot help.
            return Err(ClientError::Protocol {
                addr: self.addrs[s].clone(),
                msg: "the server restarted and lost its pages".into(),
            });
        }
        Ok(c)
    }

    /// A fresh connection to server `s` in place of a broken one.
    pub fn reconnect(&mut self, s: usize) -> Result<(), ClientError> {
        let c = self.connect_again(s, self.patience, self.io_timeout)?;
        self.replace(s, c);
        Ok(())
    }

    /// Use connection `c` for server `s` from now on.
    pub fn replace(&mut self, s: usize, c: Conn) {
        self.conns[s] = c;
        // The old fd is closed (it left the epoll set); the loop registers
        // the new one (a server added since the loop last looked has no
        // entry yet).
        if let Some(w) = self.watched.get_mut(s) {
            *w = -1;
        }
    }

    /// What a probe thread needs to try server `s` on its own: its
    /// address, the secret and the options (None without a secret).
    pub fn probe(&self, s: usize, timeout: Duration) -> Option<(String, Secret, ConnectOptions)> {
        let secret = self.secret.clone()?;
        let opts = ConnectOptions {
            name: format!("{}-probe", self.name),
            window: PAGER_WINDOW,
            connect_timeout: timeout,
            io_timeout: timeout,
            ..Default::default()
        };
        Some((self.addrs[s].clone(), secret, opts))
    }

    /// Register connections that are new (a server added, a reconnect)
    /// with the fault loop's epoll; a closed fd left the set by itself.
    pub fn watch(&mut self, epoll: &uffd::Epoll) {
        self.ready.resize(self.conns.len(), false);
        self.watched.resize(self.conns.len(), -1);
        for s in 0..self.conns.len() {
            let fd = self.conns[s].raw_fd();
            if self.watched[s] != fd {
                let conn = self.conns[s].fd();
                match epoll.add(conn, TOKEN_SERVER0 + s as u64, uffd::Trigger::Edge) {
                    Ok(()) => self.watched[s] = fd,
                    Err(e) => warn!("watching server {}: {e}", self.addrs[s]),
                }
            }
        }
    }

    /// Whether any connection holds reply bytes read ahead for a GET in
    /// flight (epoll does not see those).
    pub fn buffered(&self) -> bool {
        (0..self.conns.len()).any(|s| !self.gets[s].is_empty() && self.conns[s].buffered())
    }
}

/// How long a reconnect keeps trying: with one replica, long (the guest
/// cannot go on without the server); with two, briefly (the mirror serves).
pub(super) fn patience(replicas: usize) -> Duration {
    if replicas > 1 {
        REPLICA_PATIENCE
    } else {
        CONNECT_PATIENCE
    }
}

/// How long a server connection waits for any one read or write: with one
/// replica, the client's default (30 s: the guest cannot go on without the
/// server, so a slow one is waited for); with two, short — a hung server's
/// requests are hedged to the mirror long before (see `replicate`), and
/// this only bounds a connect or HELLO to a server that accepts and then
/// says nothing.
pub(super) fn io_timeout(replicas: usize) -> Duration {
    if replicas > 1 {
        REPLICA_IO_TIMEOUT
    } else {
        ConnectOptions::default().io_timeout
    }
}

/// A pager's connection to a memory server: a window of 4 frames, patient
/// with a busy or restarting server.
pub(super) fn connect(
    name: &str,
    addr: &str,
    secret: &Secret,
    patience: Duration,
    io_timeout: Duration,
) -> Result<Conn, ClientError> {
    let opts = ConnectOptions {
        name: format!("{name}-pager"),
        window: PAGER_WINDOW,
        io_timeout,
        ..Default::default()
    };
    Conn::connect_patiently(addr, secret, &opts, patience)
}
