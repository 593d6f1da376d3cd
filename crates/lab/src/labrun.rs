//! A testbed lab run by a test, the demo or a benchmark: hosts in network
//! namespaces with one pagefleetd each, driven with the `pagefleet` CLI run
//! inside a host (as a user would), removed on drop even on failure.

use anyhow::Result;
use pagefleet_api::{GuestStatus, HostReport};

/// One host in `pagefleet status --json`.
#[derive(Clone, Debug, serde::Deserialize)]
pub struct StatusEntry {
    /// Its HTTP address.
    pub host: String,
    /// Its report, if it answered.
    #[serde(default)]
    pub report: Option<HostReport>,
    /// Its guests, if it answered.
    #[serde(default)]
    pub guests: Option<Vec<GuestStatus>>,
    /// Why it did not answer.
    #[serde(default)]
    pub error: Option<String>,
}
use std::path::{Path, PathBuf};

/// A testbed lab for one test, removed (daemons, runners, namespaces,
/// state) on drop, even when the test fails.
pub struct LabRun {
    pub lab: pagefleet_testbed::Lab,
    dir: PathBuf,
    bins: PathBuf,
    /// What the lab was brought up with (a daemon's restart uses it).
    opts: pagefleet_testbed::Options,
}

impl LabRun {
    /// `guest_memory`: per host (the last value repeats).
    /// `bins`: the directory holding pagefleetd and pagefleet.
    pub fn up(
        tag: &str,
        bins: &Path,
        hosts: usize,
        link: pagefleet_testbed::Link,
        lend: u64,
        guest_memory: &[u64],
    ) -> Result<LabRun> {
        Self::up_opts(tag, bins, hosts, link, lend, guest_memory, |_| {})
    }

    /// [`LabRun::up`] with the testbed's options adjusted by `adjust`
    /// (etcd members, TLS, ...).
    pub fn up_opts(
        tag: &str,
        bins: &Path,
        hosts: usize,
        link: pagefleet_testbed::Link,
        lend: u64,
        guest_memory: &[u64],
        adjust: impl FnOnce(&mut pagefleet_testbed::Options),
    ) -> Result<LabRun> {
        let r = pagefleet_proto::auth::random_u64();
        let dir = crate::proc::temp_dir(tag)?;
        let mut o = pagefleet_testbed::Options::new(hosts, link, bins.join("pagefleetd"));
        o.prefix = format!("{}{:04x}", &tag[..1], r & 0xffff);
        o.dir = dir.clone();
        o.lend = lend;
        o.guest_memory = guest_memory.to_vec();
        // The VM image `make vm` builds (target/vm, beside target/release).
        if let Some(t) = bins.parent() {
            o.vm_images = vec![t.join("vm")];
        }
        o.subnet_octet = 100 + (r >> 16) as u8 % 100;
        adjust(&mut o);
        let lab = pagefleet_testbed::Lab::up(&o)?;
        Ok(LabRun {
            lab,
            dir,
            bins: bins.to_path_buf(),
            opts: o,
        })
    }

    /// Start host `h`'s pagefleetd again (after it stopped), as it was.
    pub fn restart_daemon(&mut self, h: usize) -> Result<()> {
        Ok(self.lab.restart_daemon(&self.opts, h)?)
    }

    /// Run `pagefleet ARGS` inside host `h`; (success, stdout, stderr).
    pub fn pf(&self, h: usize, args: &[&str]) -> (bool, String, String) {
        let out = self
            .lab
            .exec(h, self.bins.join("pagefleet"))
            .args(args)
            .output()
            .expect("run pagefleet in the lab");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// `pagefleet status --json` from host `h`: one entry per host.
    pub fn status(&self, h: usize) -> Vec<StatusEntry> {
        let (_, out, _) = self.pf(h, &["status", "--json"]);
        serde_json::from_str(&out).unwrap_or_default()
    }

    /// The guest `name` as the registry reports it: (host index, status).
    pub fn guest(&self, name: &str) -> Option<(usize, GuestStatus)> {
        self.status(0).into_iter().enumerate().find_map(|(i, h)| {
            h.guests
                .into_iter()
                .flatten()
                .find(|g| g.name == name && g.state.is_live())
                .map(|g| (i, g))
        })
    }

    /// A host's report (memory, lending) from the registry.
    pub fn host_report(&self, h: usize) -> Option<HostReport> {
        self.status(0).into_iter().nth(h).and_then(|v| v.report)
    }

    /// A guest's control socket on host `h` (reachable from the test's namespace).
    pub fn control(&self, h: usize, name: &str) -> PathBuf {
        self.dir
            .join(format!("{}-guests", self.lab.hosts[h].netns))
            .join(format!("{name}.sock"))
    }
}

impl LabRun {
    /// The lab's signed API client (its cluster secret; with TLS, the
    /// lab's admin certificate).
    pub fn client(&self) -> Result<pagefleet_common::http::Client> {
        let secret = pagefleet_proto::auth::Secret::load(&self.lab.secret_file)?;
        let tls = match &self.lab.admin_tls {
            Some(d) => Some(std::sync::Arc::new(pagefleet_tls::Identity::load(d)?)),
            None => None,
        };
        Ok(pagefleet_common::http::Client::new(secret).with_tls(tls))
    }

    /// GET a text route (e.g. `/metrics`) of host `h`'s pagefleetd from inside the lab.
    pub fn get_text(&self, h: usize, path: &str) -> Result<String> {
        let c = self.client()?;
        let (addr, path) = (self.lab.hosts[h].http(), path.to_string());
        self.lab
            .spawn_in(h, move || c.get_text(&addr, &path))
            .join()
            .map_err(|_| anyhow::anyhow!("lab thread panicked"))??
            .map_err(anyhow::Error::from)
    }

    /// POST to host `h`'s pagefleetd from inside the lab (typed JSON reply).
    pub fn post<B, T>(
        &self,
        h: usize,
        path: &str,
        body: &B,
        timeout: std::time::Duration,
    ) -> Result<T>
    where
        B: serde::Serialize + Send + Sync + 'static + Clone,
        T: serde::de::DeserializeOwned + Send + 'static,
    {
        let c = self.client()?.timeout(timeout);
        let (addr, path, body) = (self.lab.hosts[h].http(), path.to_string(), body.clone());
        self.lab
            .spawn_in(h, move || c.post::<B, T>(&addr, &path, &body))
            .join()
            .map_err(|_| anyhow::anyhow!("lab thread panicked"))??
            .map_err(anyhow::Error::from)
    }
}

impl Drop for LabRun {
    fn drop(&mut self) {
        // A failing test shows what its daemons and etcd members said: CI
        // keeps nothing else once the lab is gone.
        if std::thread::panicking() {
            dump_logs(&self.dir);
        }
        let _ = self.lab.down();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The last 40 lines of every log in `dir`, to stderr.
fn dump_logs(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut logs: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "log"))
        .collect();
    logs.sort();
    for p in logs {
        let text = std::fs::read_to_string(&p).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        eprintln!("----- {} (last {} lines)", p.display(), lines.len().min(40));
        for l in &lines[lines.len().saturating_sub(40)..] {
            eprintln!("{l}");
        }
    }
}
