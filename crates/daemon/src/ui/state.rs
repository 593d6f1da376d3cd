//! The dashboard's state: its sessions (opened by login links), the event
//! streams open now and the snapshot every stream is sent.

use pagefleet_proto::auth::hex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a session lasts: a working day of watching migrations.
pub const SESSION_TTL: Duration = Duration::from_secs(12 * 3600);
/// Sessions kept at once: each is 32 bytes and an instant; a login link is
/// needed for each, so only holders of the secret make them.
pub const MAX_SESSIONS: usize = 64;
/// Event streams at once: each holds one of the HTTP endpoint's
/// connection slots (`http::MAX_CONNS`) for as long as the page is open.
pub const MAX_VIEWERS: usize = 32;
/// How often the cluster is asked while anyone watches.
pub const TICK: Duration = Duration::from_secs(1);
/// The dashboard's state: sessions, viewers and the shared snapshot.
pub struct Ui {
    /// Session id (hex) to when it ends.
    sessions: Mutex<HashMap<String, Instant>>,
    pub(super) viewers: AtomicUsize,
    pub(super) producing: AtomicBool,
    pub(super) snapshot: tokio::sync::watch::Sender<Arc<str>>,
}

impl Default for Ui {
    fn default() -> Self {
        Ui {
            sessions: Mutex::default(),
            viewers: AtomicUsize::new(0),
            producing: AtomicBool::new(false),
            snapshot: tokio::sync::watch::channel(Arc::<str>::from("")).0,
        }
    }
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Ui {
    /// A new session; its id.
    pub(super) fn open_session(&self, now: Instant) -> String {
        let id = hex(&pagefleet_proto::auth::random_nonce());
        let mut s = lock(&self.sessions);
        s.retain(|_, end| *end > now);
        if s.len() >= MAX_SESSIONS {
            if let Some(k) = s
                .iter()
                .min_by_key(|(_, end)| **end)
                .map(|(k, _)| k.clone())
            {
                s.remove(&k);
            }
        }
        s.insert(id.clone(), now + SESSION_TTL);
        id
    }

    /// `id` is a session that has not ended.
    pub(super) fn session_valid(&self, id: &str, now: Instant) -> bool {
        lock(&self.sessions).get(id).is_some_and(|end| *end > now)
    }

    /// Sessions open now.
    pub fn sessions(&self) -> usize {
        let now = Instant::now();
        lock(&self.sessions)
            .values()
            .filter(|end| **end > now)
            .count()
    }

    /// Event streams open now.
    pub fn viewers(&self) -> usize {
        self.viewers.load(SeqCst)
    }
}
