//! What every part of the daemon shares: the [`App`] the HTTP routes, the
//! orchestration and the dashboard serve from (the guest host service,
//! the registry, the memory server, this host's report), the daemon's
//! life phase and what an in-place restart needs.

use crate::guests::Guests;
use pagefleet_api::{ClusterHost, ClusterView, HostReport};
use pagefleet_common::http::Client;
use std::sync::Arc;

/// What the routes serve.
pub struct App {
    /// The guest host service, if this host runs guests.
    pub guests: Option<Arc<Guests>>,
    /// This host's report, fresh on each call.
    pub report: Box<dyn Fn() -> HostReport + Send + Sync>,
    /// The Prometheus text, fresh on each call.
    pub metrics: Box<dyn Fn() -> String + Send + Sync>,
    /// The other hosts (the embedded registry): `--peers` less the removed.
    pub peers: crate::registry::Peers,
    /// Signed client for asking the peers.
    pub client: Client,
    /// This host's memory server and its address, if it lends memory.
    pub memserver: Option<(Arc<pagefleet_memserver::ServerState>, String)>,
    /// etcd as the registry (None: the peers list).
    pub etcd: Option<Arc<pagefleet_registry::Etcd>>,
    /// Cordoned: placement puts nothing new here (in `HostReport`). Held
    /// by this daemon until uncordoned; handed over by an in-place restart.
    pub cordoned: Arc<std::sync::atomic::AtomicBool>,
    /// In-place restarts: what to exec, and who asked.
    pub restart: Restart,
    /// Whether this daemon takes work (`GET /readyz`).
    pub ready: Readiness,
    /// The web dashboard's sessions and viewers.
    pub ui: Arc<crate::ui::state::Ui>,
    /// What a reload may change.
    pub live: Arc<crate::reload::Live>,
    /// The last view [`App::view_recent`] took, and when.
    pub recent_view: std::sync::Mutex<Option<(std::time::Instant, ClusterView)>>,
}

/// How old a view the series and the dashboard may show: each asks every
/// peer (or etcd), and a scrape, a dashboard's tick and another scraper
/// coming within this share one asking.
pub const RECENT_VIEW: std::time::Duration = std::time::Duration::from_secs(1);

/// Where the daemon is in its life, as `GET /readyz` and systemd see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    /// Its services are still starting.
    Starting = 0,
    /// Every listener serves.
    Serving = 1,
    /// Execing itself (an in-place restart): back in well under a second.
    Restarting = 2,
    /// Stopping.
    Stopping = 3,
}

/// The daemon's [`Phase`], shared by the main loop and the API.
#[derive(Default)]
pub struct Readiness(std::sync::atomic::AtomicU8);

impl Readiness {
    /// Now in `p`.
    pub fn set(&self, p: Phase) {
        self.0.store(p as u8, std::sync::atomic::Ordering::SeqCst);
    }

    /// The phase now.
    pub fn get(&self) -> Phase {
        match self.0.load(std::sync::atomic::Ordering::SeqCst) {
            1 => Phase::Serving,
            2 => Phase::Restarting,
            3 => Phase::Stopping,
            _ => Phase::Starting,
        }
    }
}

/// What an in-place restart (`POST /host/restart`, SIGUSR2) needs.
pub struct Restart {
    /// The binary at the path this daemon was started from.
    pub exe: std::path::PathBuf,
    /// Set to ask the main loop to restart.
    pub requested: &'static std::sync::atomic::AtomicBool,
    /// Migrations and evacuations this daemon orchestrates now (a restart
    /// would cut them off).
    busy: std::sync::atomic::AtomicUsize,
}

impl Restart {
    /// Restarts exec `exe` when `requested` is set.
    pub fn new(
        exe: std::path::PathBuf,
        requested: &'static std::sync::atomic::AtomicBool,
    ) -> Restart {
        Restart {
            exe,
            requested,
            busy: Default::default(),
        }
    }

    /// Orchestrations running now.
    pub fn busy(&self) -> usize {
        self.busy.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Count an orchestration while the guard lives.
    pub(crate) fn orchestrating(&self) -> impl Drop + '_ {
        struct Busy<'a>(&'a std::sync::atomic::AtomicUsize);
        impl Drop for Busy<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
        self.busy.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Busy(&self.busy)
    }
}

impl App {
    /// This host as the registry shows it.
    pub fn me(&self) -> ClusterHost {
        let guests = self.guests.as_ref().map(|g| g.list()).unwrap_or_default();
        let r = (self.report)();
        ClusterHost {
            http: r.http.clone().unwrap_or_default(),
            host: Some(r),
            guests,
            error: None,
            claimed: None,
        }
    }

    /// What placement reads: with etcd, every host's report (from the
    /// registry's mirror, as of now) but only this host's guests (the
    /// guest to place is here); else the full view.
    pub fn placement_view(&self) -> ClusterView {
        match &self.etcd {
            Some(etcd) => self.me_first(etcd.placement_view()),
            None => self.view(),
        }
    }

    /// The registry's view, taken at most [`RECENT_VIEW`] ago: for what
    /// only shows it (the series, the dashboard), never for decisions.
    pub fn view_recent(&self) -> ClusterView {
        let mut last = self.recent_view.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((at, v)) = last.as_ref() {
            if at.elapsed() < RECENT_VIEW {
                return v.clone();
            }
        }
        // Held while asking: a second caller meanwhile waits and shares it.
        let v = self.view();
        *last = Some((std::time::Instant::now(), v.clone()));
        v
    }

    /// The registry's view: from etcd (this host first), or this host and
    /// every peer. An unreachable etcd is an entry with its error (so
    /// nothing that needs the whole cluster, like gc, goes ahead).
    pub fn view(&self) -> ClusterView {
        match &self.etcd {
            Some(etcd) => self.me_first(etcd.view()),
            None => self.peers.cluster(self.me(), &self.client),
        }
    }

    /// A view read from etcd with this host's own entry first and fresh
    /// (not its last heartbeat), or this host and the registry's error.
    fn me_first(
        &self,
        read: Result<ClusterView, pagefleet_registry::RegistryError>,
    ) -> ClusterView {
        let mut me = self.me();
        match read {
            Ok(mut v) => {
                let (http, name) = (me.http.clone(), me.name().to_string());
                let mine = |h: &ClusterHost| h.http == http || h.name() == name;
                // Its claims are etcd's to say.
                let claimed = v.hosts.iter().find(|h| mine(h)).and_then(|h| h.claimed);
                me.claimed = claimed;
                v.hosts.retain(|h| !mine(h));
                v.hosts.insert(0, me);
                v
            }
            Err(e) => ClusterView {
                hosts: vec![
                    me,
                    ClusterHost {
                        http: "etcd".into(),
                        host: None,
                        guests: vec![],
                        error: Some(format!("the registry cannot be read: {e}")),
                        claimed: None,
                    },
                ],
            },
        }
    }

    /// Why an in-place restart would cut something off now, if it would: a
    /// guest starting or migrating in or out, or a migration or evacuation
    /// this daemon orchestrates (those run in the daemon's threads).
    pub fn restart_refusal(&self) -> Option<String> {
        let app = self;
        use pagefleet_api::GuestState;
        let mut v = Vec::new();
        if let Some(g) = &app.guests {
            for s in g.list() {
                let what = match s.state {
                    GuestState::Starting => "starting",
                    GuestState::Incoming => "migrating into this host",
                    GuestState::Migrating => "migrating away",
                    GuestState::Running | GuestState::Failed => continue,
                };
                v.push(format!("guest {} is {what}", s.name));
            }
        }
        let n = app.restart.busy();
        if n > 0 {
            v.push(format!(
                "{n} migration(s) or evacuation(s) run from this daemon"
            ));
        }
        (!v.is_empty()).then(|| {
            format!(
                "cannot restart in place now: {}; ask again once they are done",
                v.join("; ")
            )
        })
    }
}

static STARTED: std::sync::OnceLock<f64> = std::sync::OnceLock::new();

/// When this daemon's process image started (an in-place restart keeps the
/// pid, not this).
pub fn started_unix() -> f64 {
    *STARTED.get_or_init(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0)
    })
}
