//! The skeleton every host controller (KSM, I/O guarantee) shares: one
//! controller per host (an exclusive lock beside its state file), its state
//! published atomically for `status` commands, removed when it stops, and
//! waits that end at once when it is told to stop.

use serde::{de::DeserializeOwned, Serialize};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Why a controller could not take its state file.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// The lock or its directory could not be created.
    #[error("cannot open {path}: {source}")]
    Open {
        /// The lock file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Another controller holds the lock.
    #[error("another {what} is running{} ({path} is locked)", pid.map(|p| format!(" (pid {p})")).unwrap_or_default())]
    Busy {
        /// What kind of controller.
        what: String,
        /// Its pid, from its state file.
        pid: Option<u32>,
        /// The lock file.
        path: PathBuf,
    },
}

/// A state file that names its writer's pid.
pub trait HasPid {
    /// The pid of the controller that wrote it.
    fn pid(&self) -> u32;
}

/// A controller's published state: written atomically (temp file and
/// rename), removed with the lock when the controller stops.
pub struct StateFile {
    path: PathBuf,
    _lock: std::fs::File,
}

impl StateFile {
    /// Take the host-wide lock beside `path` (`*.lock`); `what` names the
    /// controller in the error when another one holds it.
    pub fn lock<S: DeserializeOwned + HasPid>(
        path: &Path,
        what: &str,
    ) -> Result<StateFile, StateError> {
        if let Some(d) = path.parent() {
            std::fs::create_dir_all(d).map_err(|source| StateError::Open {
                path: d.to_path_buf(),
                source,
            })?;
        }
        let lock = path.with_extension("lock");
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&lock)
            .map_err(|source| StateError::Open {
                path: lock.clone(),
                source,
            })?;
        if !crate::sys::file::try_lock_exclusive(&f) {
            return Err(StateError::Busy {
                what: what.to_string(),
                pid: read_raw::<S>(path).map(|s| s.pid()),
                path: lock,
            });
        }
        Ok(StateFile {
            path: path.to_path_buf(),
            _lock: f,
        })
    }

    /// Publish `st` (readers never see a half-written file).
    pub fn publish<S: Serialize>(&self, st: &S) {
        let tmp = self.path.with_extension("json.tmp");
        if std::fs::write(&tmp, serde_json::to_vec_pretty(st).unwrap_or_default()).is_ok() {
            let _ = std::fs::rename(&tmp, &self.path);
        }
    }
}

impl Drop for StateFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn read_raw<S: DeserializeOwned>(path: &Path) -> Option<S> {
    serde_json::from_slice(&std::fs::read(path).ok()?).ok()
}

/// The state a running controller published at `path`, if its process
/// still lives (a stale file from a killed controller reads as none).
pub fn read_live<S: DeserializeOwned + HasPid>(path: &Path) -> Option<S> {
    read_raw::<S>(path).filter(|s| Path::new(&format!("/proc/{}", s.pid())).exists())
}

/// Wait `d`, in short steps; true as soon as `stop` is set or `end` passes
/// (the controller must stop), false when the wait is over.
pub fn wait(d: Duration, stop: &AtomicBool, end: Option<Instant>) -> bool {
    let until = Instant::now() + d;
    loop {
        if stop.load(Ordering::Relaxed) || end.is_some_and(|e| Instant::now() >= e) {
            return true;
        }
        let now = Instant::now();
        if now >= until {
            return false;
        }
        std::thread::sleep((until - now).min(Duration::from_millis(50)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Serialize, serde::Deserialize)]
    struct St {
        pid: u32,
        n: u32,
    }
    impl HasPid for St {
        fn pid(&self) -> u32 {
            self.pid
        }
    }

    #[test]
    fn one_controller_at_a_time_and_its_state_goes_with_it() {
        let dir = std::env::temp_dir().join(format!("pf-ctl-{}", std::process::id()));
        let p = dir.join("state.json");
        let a = StateFile::lock::<St>(&p, "test controller").unwrap();
        a.publish(&St {
            pid: std::process::id(),
            n: 7,
        });
        assert_eq!(read_live::<St>(&p).map(|s| s.n), Some(7));
        let e = StateFile::lock::<St>(&p, "test controller").err().unwrap();
        assert!(
            e.to_string()
                .contains(&format!("pid {}", std::process::id())),
            "{e}"
        );
        drop(a);
        assert!(read_live::<St>(&p).is_none());
        assert!(StateFile::lock::<St>(&p, "test controller").is_ok());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_wait_ends_when_told_to_stop() {
        let stop = AtomicBool::new(true);
        let t = Instant::now();
        assert!(wait(Duration::from_secs(5), &stop, None));
        assert!(t.elapsed() < Duration::from_secs(1));
        let go = AtomicBool::new(false);
        assert!(!wait(Duration::from_millis(20), &go, None));
    }
}
