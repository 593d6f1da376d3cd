//! A QMP client (QEMU Machine Protocol: JSON lines over a Unix socket):
//! the greeting, `qmp_capabilities`, then commands whose `return` or
//! `error` is the next non-event line.

use crate::VmError;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

/// An open QMP session.
pub struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    /// Events seen while waiting for replies (name, data, QEMU's
    /// timestamp in Unix seconds), oldest first.
    pub events: Vec<(String, Value, f64)>,
}

/// One line from QEMU.
#[derive(Deserialize)]
struct Line {
    #[serde(rename = "return")]
    ret: Option<Value>,
    error: Option<QmpErrorBody>,
    event: Option<String>,
    data: Option<Value>,
    #[serde(rename = "QMP")]
    greeting: Option<Value>,
    timestamp: Option<Stamp>,
}

#[derive(Deserialize)]
struct Stamp {
    seconds: i64,
    microseconds: i64,
}

#[derive(Deserialize)]
struct QmpErrorBody {
    class: String,
    desc: String,
}

/// `query-status`.
#[derive(Debug, Deserialize)]
pub struct Status {
    /// Whether the vCPUs run.
    pub running: bool,
    /// QEMU's run state: running, paused, inmigrate, postmigrate, ...
    pub status: String,
}

/// `query-migrate` (the fields pagefleet reads).
#[derive(Debug, Default, Deserialize)]
pub struct MigrateInfo {
    /// none, setup, active, completed, failed, cancelled, ...
    #[serde(default)]
    pub status: Option<String>,
    /// Milliseconds the guest was stopped (set when completed).
    #[serde(default)]
    pub downtime: Option<u64>,
    /// Milliseconds the migration took.
    #[serde(rename = "total-time", default)]
    pub total_time: Option<u64>,
    /// RAM counters.
    #[serde(default)]
    pub ram: Option<RamInfo>,
    /// Why it failed.
    #[serde(rename = "error-desc", default)]
    pub error_desc: Option<String>,
}

/// `query-migrate`'s `ram`.
#[derive(Debug, Default, Deserialize)]
pub struct RamInfo {
    /// Bytes sent.
    #[serde(default)]
    pub transferred: u64,
    /// Bytes left.
    #[serde(default)]
    pub remaining: u64,
    /// Passes over the dirty bitmap so far (2 once the first full pass
    /// has been sent).
    #[serde(rename = "dirty-sync-count", default)]
    pub dirty_sync_count: Option<u64>,
}

impl Qmp {
    /// Connect to QEMU's QMP socket (retrying while QEMU starts, up to
    /// `patience`) and enter command mode.
    pub fn connect(path: &Path, patience: Duration) -> Result<Qmp, VmError> {
        let t0 = Instant::now();
        let s = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if t0.elapsed() < patience => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(VmError::io(format!("QMP socket {}", path.display()), e)),
            }
        };
        Qmp::over(s, &path.display().to_string())
    }

    /// Enter command mode on a connected QMP socket `s` (`what` names it in
    /// errors): its greeting, then `qmp_capabilities`.
    pub fn over(s: UnixStream, what: &str) -> Result<Qmp, VmError> {
        s.set_read_timeout(Some(Duration::from_secs(60)))
            .map_err(|e| VmError::io("QMP socket", e))?;
        let writer = s.try_clone().map_err(|e| VmError::io("QMP socket", e))?;
        let mut q = Qmp {
            reader: BufReader::new(s),
            writer,
            events: Vec::new(),
        };
        let greeting = q.line()?;
        if greeting.greeting.is_none() {
            return Err(VmError::Qmp(format!(
                "no QMP greeting on {what} (the first line was event {:?}, return {:?})",
                greeting.event, greeting.ret
            )));
        }
        q.execute::<Value>("qmp_capabilities", None)?;
        Ok(q)
    }

    fn line(&mut self) -> Result<Line, VmError> {
        let mut text = String::new();
        let n = self
            .reader
            .read_line(&mut text)
            .map_err(|e| VmError::io("reading QMP", e))?;
        if n == 0 {
            return Err(VmError::QmpClosed);
        }
        serde_json::from_str(&text).map_err(|e| VmError::Qmp(format!("bad QMP line {text:?}: {e}")))
    }

    /// Run `command` with `arguments`; its `return` as `T`.
    pub fn execute<T: DeserializeOwned>(
        &mut self,
        command: &str,
        arguments: Option<Value>,
    ) -> Result<T, VmError> {
        let mut req = serde_json::json!({ "execute": command });
        if let Some(a) = arguments {
            req["arguments"] = a;
        }
        let mut bytes = serde_json::to_vec(&req).expect("JSON");
        bytes.push(b'\n');
        self.writer
            .write_all(&bytes)
            .map_err(|e| VmError::io("writing QMP", e))?;
        loop {
            let l = self.line()?;
            if let Some(ev) = l.event {
                let t = l
                    .timestamp
                    .map(|s| s.seconds as f64 + s.microseconds as f64 * 1e-6)
                    .unwrap_or(0.0);
                self.events.push((ev, l.data.unwrap_or(Value::Null), t));
                continue;
            }
            if let Some(e) = l.error {
                return Err(VmError::Qmp(format!("{command}: {} ({})", e.desc, e.class)));
            }
            if let Some(r) = l.ret {
                return serde_json::from_value(r)
                    .map_err(|e| VmError::Qmp(format!("{command}: unexpected reply: {e}")));
            }
        }
    }

    /// When event `name` last arrived (QEMU's timestamp), if it did.
    pub fn last_event(&self, name: &str) -> Option<f64> {
        self.events.iter().rev().find(|e| e.0 == name).map(|e| e.2)
    }

    /// `query-status`.
    pub fn status(&mut self) -> Result<Status, VmError> {
        self.execute("query-status", None)
    }

    /// `stop`: the vCPUs pause.
    pub fn stop(&mut self) -> Result<(), VmError> {
        self.execute::<Value>("stop", None).map(|_| ())
    }

    /// `cont`: the vCPUs run.
    pub fn cont(&mut self) -> Result<(), VmError> {
        self.execute::<Value>("cont", None).map(|_| ())
    }

    /// `query-migrate`.
    pub fn query_migrate(&mut self) -> Result<MigrateInfo, VmError> {
        self.execute("query-migrate", None)
    }

    /// Set migration capabilities (name, on).
    pub fn set_capabilities(&mut self, caps: &[(&str, bool)]) -> Result<(), VmError> {
        let list: Vec<Value> = caps
            .iter()
            .map(|(c, on)| serde_json::json!({ "capability": c, "state": on }))
            .collect();
        self.execute::<Value>(
            "migrate-set-capabilities",
            Some(serde_json::json!({ "capabilities": list })),
        )
        .map(|_| ())
    }
}
