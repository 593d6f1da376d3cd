//! A reload (SIGHUP, `systemctl reload`): the configuration read again and
//! what can change while the daemon runs applied at once.
//!
//! Changed in place: the log filter, the peers and the join host, whether
//! `/metrics` and the health probes answer without a signature, the
//! orphan collector's grace, the stop drain. Everything else (addresses,
//! memory lent or given to guests, the secret, TLS, the controllers, etcd)
//! is held by a listener, a pool or a thread for the daemon's life: a
//! reload names each such change and leaves it for the next restart
//! (`pagefleet host restart`, an in-place one that keeps guests and pages).
//! A file that does not parse changes nothing; the error is logged.
//!
//! Who owns what: [`Live`] is shared (an `Arc`) by the HTTP gate, the
//! collector, the join loop and the main loop, which read it where they
//! decide; only the main loop writes it, in [`apply`].

use crate::config::Settings;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Duration;

/// The settings a reload may change, read where they are used.
#[derive(Debug, Default)]
pub struct Live {
    /// `GET /metrics` without a signature.
    pub public_metrics: AtomicBool,
    /// `GET /healthz`, `/readyz` without a signature.
    pub public_health: AtomicBool,
    /// The collector's grace, ms (0: it collects nothing on its own).
    gc_grace_ms: AtomicU64,
    /// The stop drain, ms (0: a stop that would lose guests is refused).
    stop_drain_ms: AtomicU64,
    /// The join host.
    join: Mutex<Option<String>>,
}

fn ms(d: Option<Duration>) -> u64 {
    d.map_or(0, |d| d.as_millis().max(1) as u64)
}

fn duration(ms: u64) -> Option<Duration> {
    (ms > 0).then(|| Duration::from_millis(ms))
}

impl Live {
    /// The values of `a`.
    pub fn new(a: &Settings) -> Live {
        let l = Live::default();
        l.set(a);
        l
    }

    fn set(&self, a: &Settings) {
        self.public_metrics.store(a.public_metrics, Relaxed);
        self.public_health.store(a.public_health, Relaxed);
        self.gc_grace_ms.store(ms(a.gc_grace), Relaxed);
        self.stop_drain_ms.store(ms(a.stop_drain), Relaxed);
        *self.join.lock().unwrap_or_else(|e| e.into_inner()) = a.join.clone();
    }

    /// The collector's grace (None: off).
    pub fn gc_grace(&self) -> Option<Duration> {
        duration(self.gc_grace_ms.load(Relaxed))
    }

    /// The stop drain (None: refuse a stop that would lose guests).
    pub fn stop_drain(&self) -> Option<Duration> {
        duration(self.stop_drain_ms.load(Relaxed))
    }

    /// The join host.
    pub fn join(&self) -> Option<String> {
        self.join.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Sets the log filter (RUST_LOG syntax); why not, for the log.
pub type SetLog = Box<dyn Fn(&str) -> Result<(), String> + Send>;

/// How the daemon reloads: given by `main`, which owns the command line
/// and the log subscriber.
pub struct Reloader {
    /// The configuration file read again, merged with the flags given at
    /// start (flags still win).
    pub reread: Box<dyn Fn() -> Result<Settings, String> + Send>,
    /// Set the log filter.
    pub set_log: SetLog,
}

impl Reloader {
    /// A daemon whose settings never change (tests, embedding).
    pub fn fixed(a: &Settings) -> Reloader {
        let a = a.clone();
        Reloader {
            reread: Box::new(move || Ok(a.clone())),
            set_log: Box::new(|_| Err("this daemon's log filter is fixed".into())),
        }
    }
}

/// What a reload did.
#[derive(Debug, Default, PartialEq)]
pub struct Outcome {
    /// Changes applied, for the log line.
    pub applied: Vec<String>,
    /// Settings that changed in the file but wait for a restart.
    pub at_restart: Vec<&'static str>,
}

/// Compare `old` with `new`: what a reload applies and what waits.
pub fn changes(old: &Settings, new: &Settings) -> Outcome {
    let mut o = Outcome::default();
    let mut applied = |name: &str, was: String, now: String| {
        if was != now {
            o.applied.push(format!("{name} {was} -> {now}"));
        }
    };
    applied("log", old.log.clone(), new.log.clone());
    applied(
        "peers",
        format!("{:?}", old.peers),
        format!("{:?}", new.peers),
    );
    applied("join", format!("{:?}", old.join), format!("{:?}", new.join));
    applied(
        "public_metrics",
        old.public_metrics.to_string(),
        new.public_metrics.to_string(),
    );
    applied(
        "public_health",
        old.public_health.to_string(),
        new.public_health.to_string(),
    );
    applied("gc_grace", secs(old.gc_grace), secs(new.gc_grace));
    applied("stop_drain", secs(old.stop_drain), secs(new.stop_drain));
    let fixed: [(&'static str, bool); 21] = [
        ("lend", old.lend != new.lend),
        ("listen", old.listen != new.listen),
        ("metrics", old.metrics != new.metrics),
        ("advertise", old.advertise != new.advertise),
        ("secret_file", old.secret_file != new.secret_file),
        ("tls_dir", old.tls_dir != new.tls_dir),
        ("max_conns", old.max_conns != new.max_conns),
        ("io_timeout", old.io_timeout != new.io_timeout),
        (
            "handshake_timeout",
            old.handshake_timeout != new.handshake_timeout,
        ),
        ("log_format", old.log_format != new.log_format),
        ("guests memory", old.guest_memory != new.guest_memory),
        ("runner", old.runner != new.runner),
        ("guests dir", old.guest_dir != new.guest_dir),
        ("service_dev", old.service_dev != new.service_dev),
        ("name", old.name != new.name),
        ("ksm", old.ksm != new.ksm),
        ("ioqos", old.ioqos != new.ioqos),
        ("vm_images", old.vm_images != new.vm_images),
        ("vm_bridge", old.vm_bridge != new.vm_bridge),
        ("dedup", old.dedup != new.dedup),
        ("etcd", old.etcd != new.etcd),
    ];
    o.at_restart = fixed.iter().filter(|(_, c)| *c).map(|(n, _)| *n).collect();
    o
}

fn secs(d: Option<Duration>) -> String {
    d.map_or("off".into(), |d| format!("{} s", d.as_secs_f64()))
}

/// Apply `new` over `old`: the log filter through `set_log`, the peers to
/// `peers`, the rest to `live`. A log filter that does not parse keeps the
/// old one (and is said in `applied`).
pub fn apply(
    old: &Settings,
    new: &Settings,
    live: &Live,
    peers: Option<&crate::registry::Peers>,
    set_log: &dyn Fn(&str) -> Result<(), String>,
) -> Outcome {
    let mut o = changes(old, new);
    if old.log != new.log {
        if let Err(e) = set_log(&new.log) {
            o.applied.retain(|c| !c.starts_with("log "));
            o.applied.push(format!("log kept at {} ({e})", old.log));
        }
    }
    if let Some(p) = peers {
        p.reconfigure(&old.peers, &new.peers);
    }
    live.set(new);
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{merge, FileConfig, Flags};

    fn settings(toml: &str) -> Settings {
        merge(FileConfig::parse(toml).unwrap(), Flags::default()).unwrap()
    }

    #[test]
    fn a_reload_applies_what_can_change_and_names_what_waits() {
        let old = settings(
            "log = \"info\"\n[memserver]\nlend = \"1GiB\"\ngc_grace_secs = 600\n[registry]\npeers = [\"a:1\", \"b:1\"]\n",
        );
        let new = settings(
            "log = \"debug\"\n[memserver]\nlend = \"2GiB\"\ngc_grace_secs = 0\npublic_metrics = true\n[registry]\npeers = [\"b:1\", \"c:1\"]\njoin = \"a:1\"\n",
        );
        let live = Live::new(&old);
        assert_eq!(live.gc_grace(), Some(Duration::from_secs(600)));
        let peers = crate::registry::Peers::new(old.peers.clone());
        peers.learn("d:1").unwrap();
        let logged = std::cell::RefCell::new(String::new());
        let o = apply(&old, &new, &live, Some(&peers), &|f| {
            *logged.borrow_mut() = f.to_string();
            Ok(())
        });
        assert_eq!(*logged.borrow(), "debug");
        assert_eq!(o.at_restart, ["lend"]);
        assert_eq!(o.applied.len(), 5, "{:?}", o.applied);
        assert!(live.public_metrics.load(Relaxed));
        assert_eq!(live.gc_grace(), None);
        assert_eq!(live.join().as_deref(), Some("a:1"));
        // a:1 left the file, c:1 came; d:1 was learned, not configured.
        assert_eq!(peers.list(), ["b:1", "d:1", "c:1"]);
        // Nothing changed: nothing said.
        assert_eq!(changes(&new, &new), Outcome::default());
    }

    #[test]
    fn a_bad_log_filter_keeps_the_old_one() {
        let old = settings("log = \"info\"\n");
        let new = settings("log = \"debug\"\n");
        let o = apply(&old, &new, &Live::new(&old), None, &|_| Err("no".into()));
        assert_eq!(o.applied, ["log kept at info (no)"]);
    }
}
