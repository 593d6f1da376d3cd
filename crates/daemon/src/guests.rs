//! The guest host service: starts and stops this host's runners, hands
//! out this host's guest memory (a budget per guest, never more in total
//! than `--guest-memory`), starts runners for incoming migrations, and
//! forwards migrate requests to a guest's runner (its control socket).

use crate::http::{Request, Response};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tracing::{info, warn};

#[derive(Clone, Debug)]
pub struct GuestConfig {
    /// Memory this host gives guests (sum of budgets), bytes.
    pub memory: u64,
    /// The `pagefleet` binary runners are started from.
    pub runner: PathBuf,
    /// Control sockets and runner logs.
    pub dir: PathBuf,
    /// Device a guest's service address goes on.
    pub service_dev: String,
    /// IP this host's runners listen on for incoming migrations.
    pub ip: String,
    pub secret_file: Option<PathBuf>,
}

struct Entry {
    pid: u32,
    control: PathBuf,
    budget_pages: u64,
    incoming: bool,
}

type SpawnReq = (Command, std::sync::mpsc::Sender<std::io::Result<Child>>);

pub struct Guests {
    pub cfg: GuestConfig,
    map: Mutex<BTreeMap<String, Entry>>,
    /// Runners are forked by one long-lived thread: their parent-death
    /// signal fires when the forking *thread* exits, not just the daemon.
    spawner: Mutex<std::sync::mpsc::Sender<SpawnReq>>,
}

fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 32
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// One request on a runner's control socket; every reply line goes to `each`.
pub fn control(
    path: &std::path::Path,
    req: &Value,
    timeout: Option<Duration>,
    each: impl FnMut(Value) -> bool,
) -> anyhow::Result<()> {
    let s = connect(path)?;
    s.set_read_timeout(timeout)?;
    lines(s, req, each)
}

fn connect(path: &std::path::Path) -> anyhow::Result<UnixStream> {
    UnixStream::connect(path).map_err(|e| anyhow::anyhow!("runner control {}: {e}", path.display()))
}

fn lines(
    mut s: UnixStream,
    req: &Value,
    mut each: impl FnMut(Value) -> bool,
) -> anyhow::Result<()> {
    writeln!(s, "{req}")?;
    for line in BufReader::new(s).lines() {
        let v: Value = serde_json::from_str(&line?)?;
        if !each(v) {
            break;
        }
    }
    Ok(())
}

fn control1(path: &std::path::Path, req: &Value) -> anyhow::Result<Value> {
    control_within(path, req, Duration::from_secs(5))
}

/// One request; the first reply line (waiting at most `t`).
pub fn control_within(path: &std::path::Path, req: &Value, t: Duration) -> anyhow::Result<Value> {
    let mut out = Value::Null;
    control(path, req, Some(t), |v| {
        out = v;
        false
    })?;
    Ok(out)
}

impl Guests {
    pub fn new(cfg: GuestConfig) -> anyhow::Result<Arc<Guests>> {
        std::fs::create_dir_all(&cfg.dir).map_err(|e| {
            anyhow::anyhow!("cannot create guest directory {}: {e}", cfg.dir.display())
        })?;
        let (tx, rx) = std::sync::mpsc::channel::<SpawnReq>();
        std::thread::Builder::new()
            .name("runner spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            })?;
        Ok(Arc::new(Guests {
            cfg,
            map: Mutex::new(BTreeMap::new()),
            spawner: Mutex::new(tx),
        }))
    }

    pub fn used_pages(&self) -> u64 {
        self.map
            .lock()
            .unwrap()
            .values()
            .map(|e| e.budget_pages)
            .sum()
    }
    pub fn free_bytes(&self) -> u64 {
        self.cfg.memory.saturating_sub(self.used_pages() * 4096)
    }
    pub fn count(&self) -> usize {
        self.map.lock().unwrap().len()
    }

    /// Prometheus text for the guest host service.
    pub fn metrics(&self) -> String {
        let (n, incoming, used) = {
            let m = self.map.lock().unwrap();
            (
                m.len(),
                m.values().filter(|e| e.incoming).count(),
                m.values().map(|e| e.budget_pages).sum::<u64>(),
            )
        };
        format!(
            "# HELP pagefleet_guest_memory_bytes Memory this host gives guests (sum of budgets allowed).\n\
             # TYPE pagefleet_guest_memory_bytes gauge\npagefleet_guest_memory_bytes {}\n\
             # HELP pagefleet_guest_budget_bytes Sum of the budgets of the guests here.\n\
             # TYPE pagefleet_guest_budget_bytes gauge\npagefleet_guest_budget_bytes {}\n\
             # HELP pagefleet_guests Runners on this host (incoming: waiting for a migration).\n\
             # TYPE pagefleet_guests gauge\npagefleet_guests{{state=\"running\"}} {}\npagefleet_guests{{state=\"incoming\"}} {}\n",
            self.cfg.memory,
            used * 4096,
            n - incoming,
            incoming
        )
    }

    fn spawn(
        self: &Arc<Guests>,
        name: &str,
        mut cmd: Command,
        budget_pages: u64,
        incoming: bool,
        ready: &str,
        cgroup: Option<PathBuf>,
    ) -> Result<String, Response> {
        let control = self.cfg.dir.join(format!("{name}.sock"));
        let log = std::fs::File::create(self.cfg.dir.join(format!("{name}.log")))
            .map_err(|e| Response::error(500, e))?;
        cmd.arg("--control")
            .arg(&control)
            .stdout(Stdio::piped())
            .stderr(log)
            .stdin(Stdio::null());
        if let Some(f) = &self.cfg.secret_file {
            cmd.arg("--secret-file").arg(f);
        }
        // Runners die with their host daemon.
        unsafe {
            use std::os::unix::process::CommandExt;
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        {
            let mut m = self.map.lock().unwrap();
            if m.contains_key(name) {
                return Err(Response::error(
                    409,
                    format!("guest {name:?} already exists on this host"),
                ));
            }
            let used: u64 = m.values().map(|e| e.budget_pages).sum();
            if (used + budget_pages) * 4096 > self.cfg.memory {
                return Err(Response::error(
                    409,
                    format!(
                        "not enough guest memory here: {} pages asked, {} free",
                        budget_pages,
                        (self.cfg.memory / 4096).saturating_sub(used)
                    ),
                ));
            }
            // Reserve before starting, so two requests cannot both take the same memory.
            m.insert(
                name.to_string(),
                Entry {
                    pid: 0,
                    control: control.clone(),
                    budget_pages,
                    incoming,
                },
            );
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let sent = self.spawner.lock().unwrap().send((cmd, tx));
        let spawned = match sent {
            Ok(()) => rx
                .recv()
                .unwrap_or_else(|_| Err(std::io::Error::other("spawner thread gone"))),
            Err(_) => Err(std::io::Error::other("spawner thread gone")),
        };
        let mut child: Child = match spawned {
            Ok(c) => c,
            Err(e) => {
                self.map.lock().unwrap().remove(name);
                return Err(Response::error(
                    500,
                    format!("cannot start runner {}: {e}", self.cfg.runner.display()),
                ));
            }
        };
        let pid = child.id();
        if let Some(cg) = &cgroup {
            // Before it prints its address, so before any guest memory exists.
            if let Err(e) = std::fs::write(cg.join("cgroup.procs"), pid.to_string()) {
                let _ = child.kill();
                let _ = child.wait();
                self.map.lock().unwrap().remove(name);
                return Err(Response::error(
                    400,
                    format!("cannot put the runner into cgroup {}: {e}", cg.display()),
                ));
            }
        }
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        let got = out.read_line(&mut line).unwrap_or(0);
        if got == 0 || !line.starts_with(ready) {
            let _ = child.kill();
            let _ = child.wait();
            self.map.lock().unwrap().remove(name);
            let log = std::fs::read_to_string(self.cfg.dir.join(format!("{name}.log")))
                .unwrap_or_default();
            return Err(Response::error(
                500,
                format!("runner for {name} did not start: {}", log.trim()),
            ));
        }
        if let Some(e) = self.map.lock().unwrap().get_mut(name) {
            e.pid = pid;
        }
        // Reap it; its memory goes back when it exits (stopped or migrated away).
        let me = self.clone();
        let n = name.to_string();
        std::thread::spawn(move || {
            let mut sink = String::new();
            while out.read_line(&mut sink).unwrap_or(0) > 0 {
                sink.clear();
            }
            let st = child.wait();
            let mut m = me.map.lock().unwrap();
            if m.get(&n).is_some_and(|e| e.pid == pid) {
                m.remove(&n);
            }
            info!("guest {n} (runner {pid}) exited: {st:?}");
        });
        Ok(line.trim().to_string())
    }

    /// POST /guests {name, budget_pages, args: [workload and `pagefleet run` flags]}
    fn start(self: &Arc<Guests>, v: &Value) -> Response {
        let name = v["name"].as_str().unwrap_or("");
        if !valid_name(name) {
            return Response::error(400, "guest name: 1-32 letters, digits, - or _");
        }
        let Some(args) = v["args"].as_array() else {
            return Response::error(
                400,
                "\"args\": the workload and its flags, e.g. [\"kv\", \"--size\", \"1GiB\"]",
            );
        };
        let args: Vec<String> = args
            .iter()
            .filter_map(|a| a.as_str().map(String::from))
            .collect();
        let Some(size) = v["size"].as_u64() else {
            return Response::error(400, "\"size\" (bytes) is required");
        };
        let budget_pages = v["budget_pages"].as_u64().unwrap_or(size.div_ceil(4096));
        let mut cmd = Command::new(&self.cfg.runner);
        cmd.arg("run").args(&args).args([
            "--name",
            name,
            "--size",
            &size.to_string(),
            "--budget",
            &(budget_pages * 4096).to_string(),
        ]);
        cmd.args(["--service-dev", &self.cfg.service_dev]);
        match self.spawn(name, cmd, budget_pages, false, "guest ", None) {
            Ok(_) => Response::json(200, &json!({"ok": true, "name": name})),
            Err(r) => r,
        }
    }

    /// POST /incoming {name, budget_pages, cgroup?}: a runner waiting for a migration.
    fn incoming(self: &Arc<Guests>, v: &Value) -> Response {
        let name = v["name"].as_str().unwrap_or("");
        if !valid_name(name) {
            return Response::error(400, "guest name: 1-32 letters, digits, - or _");
        }
        let Some(budget_pages) = v["budget_pages"].as_u64() else {
            return Response::error(400, "\"budget_pages\" is required");
        };
        let mut cmd = Command::new(&self.cfg.runner);
        cmd.args([
            "runner-incoming",
            "--listen",
            &format!("{}:0", self.cfg.ip),
            "--budget-pages",
            &budget_pages.to_string(),
        ]);
        cmd.args(["--service-dev", &self.cfg.service_dev]);
        // Optionally inside a memory cgroup the caller set up (e.g. a
        // destination whose memory is limited, with the kernel swapping).
        let cgroup = v["cgroup"].as_str().map(PathBuf::from);
        if let Some(cg) = &cgroup {
            if !cg.starts_with("/sys/fs/cgroup/") || !cg.join("cgroup.procs").exists() {
                return Response::error(400, format!("{} is not a cgroup", cg.display()));
            }
        }
        match self.spawn(name, cmd, budget_pages, true, "migrate listening ", cgroup) {
            Ok(line) => Response::json(
                200,
                &json!({"ok": true, "migrate_addr": line.trim_start_matches("migrate listening ").trim()}),
            ),
            Err(r) => r,
        }
    }

    pub fn list(&self) -> Vec<Value> {
        let entries: Vec<(String, PathBuf, u64, bool, u32)> = self
            .map
            .lock()
            .unwrap()
            .iter()
            .map(|(n, e)| {
                (
                    n.clone(),
                    e.control.clone(),
                    e.budget_pages,
                    e.incoming,
                    e.pid,
                )
            })
            .collect();
        entries
            .into_iter()
            .map(|(n, c, b, inc, pid)| match control1(&c, &json!({"op": "status"})) {
                Ok(v) if v.get("name").is_some() => v,
                _ => json!({"name": n, "state": if inc { "incoming" } else { "starting" }, "budget_pages": b, "pid": pid}),
            })
            .collect()
    }

    fn entry_control(&self, name: &str) -> Option<PathBuf> {
        self.map
            .lock()
            .unwrap()
            .get(name)
            .map(|e| e.control.clone())
    }

    /// Routes under /guests and /incoming.
    pub fn route(self: &Arc<Guests>, r: &Request) -> Option<Response> {
        let body = || serde_json::from_slice::<Value>(&r.body).unwrap_or(Value::Null);
        let parts: Vec<&str> = r.path.trim_matches('/').split('/').collect();
        Some(match (r.method.as_str(), parts.as_slice()) {
            ("GET", ["guests"]) => Response::json(200, &Value::Array(self.list())),
            ("POST", ["guests"]) => self.start(&body()),
            ("POST", ["incoming"]) => self.incoming(&body()),
            ("GET", ["guests", name]) => match self.entry_control(name) {
                None => Response::error(404, format!("no guest {name:?} here")),
                Some(c) => match control1(&c, &json!({"op": "status"})) {
                    Ok(v) => Response::json(200, &v),
                    Err(e) => Response::error(502, e),
                },
            },
            (
                "POST",
                ["guests", name, op @ ("stop" | "cancel" | "set_budget" | "evacuate" | "sort")],
            ) => match self.entry_control(name) {
                None => Response::error(404, format!("no guest {name:?} here")),
                Some(c) => {
                    let mut req = body();
                    if !req.is_object() {
                        req = json!({});
                    }
                    req["op"] = json!(op);
                    // Moving a sub-host's pages takes as long as they take.
                    let t = if matches!(*op, "evacuate" | "sort") {
                        Duration::from_secs(3600)
                    } else {
                        Duration::from_secs(5)
                    };
                    match control_within(&c, &req, t) {
                        Ok(v) => Response::json(200, &v),
                        Err(e) => Response::error(502, e),
                    }
                }
            },
            ("POST", ["guests", name, "migrate"]) => match self.entry_control(name) {
                None => Response::error(404, format!("no guest {name:?} here")),
                Some(c) => {
                    let mut req = body();
                    req["op"] = json!("migrate");
                    let name = name.to_string();
                    let me = self.clone();
                    Response::Stream(Box::new(move |s| {
                        // The caller's Ctrl-C (its connection closing) reaches
                        // the runner at once: a watcher shuts the runner's
                        // socket down, which the runner takes as a cancel.
                        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
                        let r = connect(&c).and_then(|runner| {
                            if let (Ok(caller), Ok(r2)) = (s.try_clone(), runner.try_clone()) {
                                let done = done.clone();
                                std::thread::spawn(move || {
                                    while !done.load(std::sync::atomic::Ordering::Relaxed) {
                                        if pagefleet_proto::io::peer_hung_up(&caller, 100) {
                                            let _ = r2.shutdown(std::net::Shutdown::Both);
                                            return;
                                        }
                                    }
                                });
                            }
                            lines(runner, &req, |v| {
                                if v.get("report").is_some() {
                                    // The guest runs elsewhere now: its memory here is free
                                    // at once (the runner exits right after).
                                    me.map.lock().unwrap().remove(&name);
                                }
                                writeln!(s, "{v}").is_ok()
                            })
                        });
                        done.store(true, std::sync::atomic::Ordering::Relaxed);
                        if let Err(e) = r {
                            warn!("migrate {name}: {e}");
                            let _ = writeln!(s, "{}", json!({"error": e.to_string()}));
                        }
                    }))
                }
            },
            _ => return None,
        })
    }
}
