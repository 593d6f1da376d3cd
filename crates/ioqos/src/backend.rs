//! Where a tenant's I/O is measured and capped: cgroup v1 blkio throttling,
//! cgroup v2 io.stat / io.max, or a QEMU drive over QMP
//! (query-blockstats / block_set_io_throttle).

use crate::device::Dev;
use crate::error::{Context, Result};
use crate::spec::Location;
use serde::Serialize;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Cumulative counters of one tenant on the device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Counters {
    /// Bytes read.
    pub rbytes: u64,
    /// Bytes written.
    pub wbytes: u64,
    /// Reads.
    pub rios: u64,
    /// Writes.
    pub wios: u64,
    /// Total time its requests took, ns (QMP only).
    pub io_time_ns: Option<u64>,
}

/// A limit on a tenant (None: unlimited). Split between reads and writes by
/// the caller when the backend limits them separately.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Limit {
    /// Read bytes/s (None: unlimited).
    pub rbps: Option<u64>,
    /// Write bytes/s.
    pub wbps: Option<u64>,
    /// Read IOPS.
    pub riops: Option<u64>,
    /// Write IOPS.
    pub wiops: Option<u64>,
}

impl Limit {
    /// No limit.
    pub fn none() -> Limit {
        Limit::default()
    }
    /// Whether nothing is limited.
    pub fn is_none(&self) -> bool {
        *self == Limit::default()
    }
}

/// cgroup v1 only counts a group's I/O on a device while it has a throttle
/// rule there, so "no cap" is this rule (1 TiB/s), not the absence of one.
pub const V1_UNLIMITED: u64 = 1 << 40;

/// How a tenant's I/O is measured and capped.
pub enum Backend {
    /// A cgroup v1 blkio group.
    V1(PathBuf),
    /// A cgroup v2 group (io controller).
    V2(PathBuf),
    /// A QEMU drive, through QMP's block_set_io_throttle.
    Qmp(Qmp),
}

impl Backend {
    /// Open the tenant at `l`.
    pub fn open(l: &Location) -> Result<Backend> {
        Ok(match l {
            Location::CgroupV1(p) => {
                if !p.join("blkio.throttle.io_service_bytes_recursive").exists() {
                    return Err(crate::Error::Invalid(format!(
                        "cgroup {} is gone",
                        p.display()
                    )));
                }
                Backend::V1(p.clone())
            }
            Location::CgroupV2(p) => Backend::V2(p.clone()),
            Location::Qmp { socket, device } => Backend::Qmp(Qmp::connect(socket, device)?),
        })
    }

    /// cgroup-v1, cgroup-v2 or qmp.
    pub fn kind(&self) -> &'static str {
        match self {
            Backend::V1(_) => "cgroup v1 blkio",
            Backend::V2(_) => "cgroup v2 io",
            Backend::Qmp(_) => "QEMU QMP",
        }
    }

    /// Start measuring (cgroup v1 needs a rule in place to count).
    pub fn attach(&mut self, dev: Dev) -> Result<()> {
        match self {
            Backend::V1(_) => self.set(dev, &Limit::none()),
            _ => Ok(()),
        }
    }

    /// Leave the tenant as it was before the controller: no rules at all.
    pub fn detach(&mut self, dev: Dev) -> Result<()> {
        match self {
            Backend::V1(p) => {
                for file in [
                    "read_bps_device",
                    "write_bps_device",
                    "read_iops_device",
                    "write_iops_device",
                ] {
                    let f = p.join(format!("blkio.throttle.{file}"));
                    std::fs::write(&f, format!("{dev} 0"))
                        .with_context(|| format!("cannot write {}", f.display()))?;
                }
                Ok(())
            }
            _ => self.set(dev, &Limit::none()),
        }
    }

    /// The tenant's counters on `dev`.
    pub fn read(&mut self, dev: Dev) -> Result<Counters> {
        match self {
            Backend::V1(p) => {
                let b = read_v1(&p.join("blkio.throttle.io_service_bytes_recursive"), dev)?;
                let n = read_v1(&p.join("blkio.throttle.io_serviced_recursive"), dev)?;
                Ok(Counters {
                    rbytes: b.0,
                    wbytes: b.1,
                    rios: n.0,
                    wios: n.1,
                    io_time_ns: None,
                })
            }
            Backend::V2(p) => read_v2(&p.join("io.stat"), dev),
            Backend::Qmp(q) => q.stats(),
        }
    }

    /// Set (or clear) its cap on `dev`.
    pub fn set(&mut self, dev: Dev, l: &Limit) -> Result<()> {
        match self {
            Backend::V1(p) => {
                for (file, v, none) in [
                    ("read_bps_device", l.rbps, V1_UNLIMITED),
                    ("write_bps_device", l.wbps, V1_UNLIMITED),
                    ("read_iops_device", l.riops, 0),
                    ("write_iops_device", l.wiops, 0),
                ] {
                    let f = p.join(format!("blkio.throttle.{file}"));
                    // 0 removes a rule; bandwidth keeps an "unlimited" one so the I/O stays counted.
                    std::fs::write(&f, format!("{dev} {}", v.unwrap_or(none)))
                        .with_context(|| format!("cannot write {}", f.display()))?;
                }
                Ok(())
            }
            Backend::V2(p) => {
                let v = |x: Option<u64>| x.map(|x| x.to_string()).unwrap_or_else(|| "max".into());
                let f = p.join("io.max");
                std::fs::write(
                    &f,
                    format!(
                        "{dev} rbps={} wbps={} riops={} wiops={}",
                        v(l.rbps),
                        v(l.wbps),
                        v(l.riops),
                        v(l.wiops)
                    ),
                )
                .with_context(|| format!("cannot write {}", f.display()))?;
                Ok(())
            }
            Backend::Qmp(q) => q.throttle(l),
        }
    }
}

/// "MAJ:MIN Read N" / "MAJ:MIN Write N" lines -> (read, write).
fn read_v1(p: &Path, dev: Dev) -> Result<(u64, u64)> {
    let s = std::fs::read_to_string(p)
        .with_context(|| format!("cannot read {} (cgroup gone?)", p.display()))?;
    let key = dev.to_string();
    let (mut r, mut w) = (0, 0);
    for l in s.lines() {
        let mut it = l.split_whitespace();
        if it.next() != Some(&key) {
            continue;
        }
        match (it.next(), it.next().and_then(|v| v.parse::<u64>().ok())) {
            (Some("Read"), Some(v)) => r = v,
            (Some("Write"), Some(v)) => w = v,
            _ => {}
        }
    }
    Ok((r, w))
}

fn read_v2(p: &Path, dev: Dev) -> Result<Counters> {
    let s = std::fs::read_to_string(p)
        .with_context(|| format!("cannot read {} (cgroup gone?)", p.display()))?;
    let mut c = Counters::default();
    let key = dev.to_string();
    if let Some(l) = s
        .lines()
        .find(|l| l.split_whitespace().next() == Some(&key))
    {
        for kv in l.split_whitespace().skip(1) {
            let Some((k, v)) = kv.split_once('=') else {
                continue;
            };
            let v: u64 = v.parse().unwrap_or(0);
            match k {
                "rbytes" => c.rbytes = v,
                "wbytes" => c.wbytes = v,
                "rios" => c.rios = v,
                "wios" => c.wios = v,
                _ => {}
            }
        }
    }
    Ok(c)
}

/// One line QEMU sends on its QMP socket: a greeting, an event, a command's
/// return value or its error.
#[derive(serde::Deserialize)]
struct QmpLine {
    #[serde(rename = "QMP", default)]
    greeting: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    event: Option<String>,
    #[serde(default)]
    error: Option<QmpError>,
    #[serde(rename = "return", default)]
    ret: Option<serde_json::Value>,
}

#[derive(serde::Deserialize)]
struct QmpError {
    desc: String,
}

/// One drive of `query-blockstats`.
#[derive(serde::Deserialize)]
struct BlockStats {
    #[serde(default)]
    device: Option<String>,
    #[serde(default)]
    qdev: Option<String>,
    #[serde(rename = "node-name", default)]
    node_name: Option<String>,
    stats: DriveStats,
}

#[derive(serde::Deserialize)]
struct DriveStats {
    #[serde(default)]
    rd_bytes: u64,
    #[serde(default)]
    wr_bytes: u64,
    #[serde(default)]
    rd_operations: u64,
    #[serde(default)]
    wr_operations: u64,
    #[serde(default)]
    rd_total_time_ns: u64,
    #[serde(default)]
    wr_total_time_ns: u64,
}

/// A QMP connection to one QEMU, for one of its drives.
pub struct Qmp {
    r: BufReader<UnixStream>,
    w: UnixStream,
    device: String,
}

impl Qmp {
    /// Connect to QEMU at `socket` for drive `device`.
    pub fn connect(socket: &Path, device: &str) -> Result<Qmp> {
        let s = UnixStream::connect(socket)
            .with_context(|| format!("cannot connect to QMP at {}", socket.display()))?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut q = Qmp {
            r: BufReader::new(s.try_clone()?),
            w: s,
            device: device.into(),
        };
        let greeting = q.line()?;
        if greeting.greeting.is_none() {
            return Err(crate::Error::Invalid(format!(
                "{} is not a QMP socket",
                socket.display()
            )));
        }
        q.execute("qmp_capabilities", serde_json::json!({}))?;
        q.stats()
            .with_context(|| format!("QEMU has no drive {device}"))?;
        Ok(q)
    }

    fn line(&mut self) -> Result<QmpLine> {
        let mut l = String::new();
        if self.r.read_line(&mut l)? == 0 {
            return Err(crate::Error::Invalid(
                "QEMU closed its QMP socket".to_string(),
            ));
        }
        Ok(serde_json::from_str(&l)?)
    }

    fn execute(&mut self, cmd: &str, args: serde_json::Value) -> Result<serde_json::Value> {
        let m = serde_json::json!({"execute": cmd, "arguments": args});
        self.w.write_all(format!("{m}\n").as_bytes())?;
        loop {
            let v = self.line()?;
            if v.event.is_some() {
                continue;
            }
            if let Some(e) = v.error {
                return Err(crate::Error::Invalid(format!("QMP {cmd}: {}", e.desc)));
            }
            return v
                .ret
                .ok_or_else(|| crate::Error::Invalid(format!("QMP {cmd}: no return")));
        }
    }

    /// The drive's counters.
    pub fn stats(&mut self) -> Result<Counters> {
        let r = self.execute("query-blockstats", serde_json::json!({}))?;
        let drives: Vec<BlockStats> = serde_json::from_value(r).map_err(|e| {
            crate::Error::Invalid(format!("QMP query-blockstats: unexpected reply: {e}"))
        })?;
        let d = self.device.as_str();
        let e = drives
            .into_iter()
            .find(|e| {
                [&e.device, &e.qdev, &e.node_name]
                    .iter()
                    .any(|n| n.as_deref() == Some(d))
            })
            .ok_or_else(|| crate::Error::Invalid(format!("no drive {d} in query-blockstats")))?;
        let s = e.stats;
        Ok(Counters {
            rbytes: s.rd_bytes,
            wbytes: s.wr_bytes,
            rios: s.rd_operations,
            wios: s.wr_operations,
            io_time_ns: Some(s.rd_total_time_ns + s.wr_total_time_ns),
        })
    }

    /// Set the drive's I/O throttle.
    pub fn throttle(&mut self, l: &Limit) -> Result<()> {
        let v = |x: Option<u64>| x.unwrap_or(0);
        let key = if self.device.starts_with('/') {
            "id"
        } else {
            "device"
        };
        self.execute(
            "block_set_io_throttle",
            serde_json::json!({key: self.device, "bps": 0, "bps_rd": v(l.rbps), "bps_wr": v(l.wbps), "iops": 0, "iops_rd": v(l.riops), "iops_wr": v(l.wiops)}),
        )
        .map(|_| ())
    }
}
