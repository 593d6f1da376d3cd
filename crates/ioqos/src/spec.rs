//! Tenants as users write them:
//!
//!   NAME=LOCATION[:min=RATE][:min-iops=N][:weight=W], comma-separated
//!
//! LOCATION is a cgroup (absolute path, or a name under the blkio / unified
//! hierarchy) or `qmp:SOCKET@DEVICE` for a QEMU guest's drive. RATE is bytes
//! per second with an optional unit: 20MiB, 20M (= MB), 5000K.

use crate::error::{Context, Result};
use serde::Serialize;
use std::path::PathBuf;

/// Where a tenant's I/O is measured and capped.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub enum Location {
    /// A cgroup v1 blkio group.
    CgroupV1(PathBuf),
    /// A cgroup v2 group.
    CgroupV2(PathBuf),
    /// A QEMU drive.
    Qmp {
        /// QEMU's QMP socket.
        socket: PathBuf,
        /// The drive (device, qdev or node name).
        device: String,
    },
}

/// A tenant of the shared device.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Tenant {
    /// Its name.
    pub name: String,
    /// Where it is.
    pub location: Location,
    /// Guaranteed bytes per second (0: none).
    pub min_bps: u64,
    /// Guaranteed I/Os per second (0: none).
    pub min_iops: u64,
    /// Its share weight.
    pub weight: f64,
}

/// Where cgroup v1 blkio groups live.
pub const V1_ROOT: &str = "/sys/fs/cgroup/blkio";
/// Where cgroup v2 groups live.
pub const V2_ROOT: &str = "/sys/fs/cgroup";

/// "20MiB" -> 20971520, "20M" -> 20000000, "512" -> 512.
pub fn parse_rate(s: &str) -> Result<u64> {
    let t = s.trim().trim_end_matches("/s");
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num
        .parse()
        .with_context(|| format!("bad rate {s:?}: want e.g. 20MiB or 5000K"))?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "kib" => 1024.0,
        "mib" => 1048576.0,
        "gib" => 1073741824.0,
        u => {
            return Err(crate::Error::Invalid(format!(
                "bad rate {s:?}: unknown unit {u:?}"
            )))
        }
    };
    Ok((v * mult) as u64)
}

fn location(s: &str) -> Result<Location> {
    if let Some(q) = s.strip_prefix("qmp:") {
        let (sock, dev) = q
            .rsplit_once('@')
            .with_context(|| format!("{s}: want qmp:SOCKET@DEVICE"))?;
        if dev.is_empty() {
            return Err(crate::Error::Invalid(format!("{s}: no device after @")));
        }
        return Ok(Location::Qmp {
            socket: sock.into(),
            device: dev.into(),
        });
    }
    let p = PathBuf::from(s);
    let cands = if p.is_absolute() {
        vec![p]
    } else {
        vec![
            PathBuf::from(V1_ROOT).join(s),
            PathBuf::from(V2_ROOT).join(s),
        ]
    };
    for c in &cands {
        if c.join("blkio.throttle.io_service_bytes").exists() {
            return Ok(Location::CgroupV1(c.clone()));
        }
        if c.join("io.stat").exists() {
            return Ok(Location::CgroupV2(c.clone()));
        }
    }
    Err(crate::Error::Invalid(format!(
        "cgroup {s} not found (looked for {})",
        cands
            .iter()
            .map(|c| c.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )))
}

/// Parse the tenant list; every location must exist now.
pub fn parse(spec: &str) -> Result<Vec<Tenant>> {
    let mut out: Vec<Tenant> = Vec::new();
    for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (name, rest) = item.split_once('=').with_context(|| {
            format!("tenant {item:?}: want NAME=LOCATION[:min=RATE][:weight=W]")
        })?;
        if name.is_empty() || out.iter().any(|t| t.name == name) {
            return Err(crate::Error::Invalid(format!(
                "tenant names must be unique and not empty ({name:?})"
            )));
        }
        // Options are the trailing ":key=value" parts (paths may contain ':' only before them).
        let mut parts: Vec<&str> = rest.split(':').collect();
        let mut opts = Vec::new();
        while parts.len() > 1 && parts.last().is_some_and(|p| p.contains('=')) {
            opts.push(parts.pop().unwrap());
        }
        let loc = parts.join(":");
        let mut t = Tenant {
            name: name.into(),
            location: location(&loc).with_context(|| format!("tenant {name}"))?,
            min_bps: 0,
            min_iops: 0,
            weight: 1.0,
        };
        for o in opts {
            let (k, v) = o.split_once('=').unwrap();
            match k {
                "min" => t.min_bps = parse_rate(v).with_context(|| format!("tenant {name}"))?,
                "min-iops" => {
                    t.min_iops = v
                        .parse()
                        .with_context(|| format!("tenant {name}: bad min-iops {v:?}"))?
                }
                "weight" => {
                    t.weight = v.parse().ok().filter(|w: &f64| *w > 0.0).with_context(|| {
                        format!("tenant {name}: weight must be a positive number")
                    })?;
                }
                _ => {
                    return Err(crate::Error::Invalid(format!(
                        "tenant {name}: unknown option {k:?} (min, min-iops, weight)"
                    )))
                }
            }
        }
        out.push(t);
    }
    if out.is_empty() {
        return Err(crate::Error::Invalid("no tenants given".to_string()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates() {
        assert_eq!(parse_rate("20MiB").unwrap(), 20 << 20);
        assert_eq!(parse_rate("20M").unwrap(), 20_000_000);
        assert_eq!(parse_rate("1.5GiB/s").unwrap(), 1610612736);
        assert_eq!(parse_rate("512").unwrap(), 512);
        assert!(parse_rate("fast").is_err());
        assert!(parse_rate("10parsecs").is_err());
    }

    #[test]
    fn qmp_tenants_and_errors() {
        let t = parse("vm1=qmp:/run/vm1.sock@drive0:min=10MiB:weight=2").unwrap();
        assert_eq!(
            t[0].location,
            Location::Qmp {
                socket: "/run/vm1.sock".into(),
                device: "drive0".into()
            }
        );
        assert_eq!((t[0].min_bps, t[0].weight), (10 << 20, 2.0));
        assert!(parse("").is_err());
        assert!(parse("a=qmp:/x@d,a=qmp:/y@d").is_err(), "duplicate names");
        assert!(format!("{:#}", parse("a=/no/such/cgroup").unwrap_err()).contains("not found"));
        assert!(
            format!("{:#}", parse("a=qmp:/x@d:speed=1").unwrap_err()).contains("unknown option")
        );
        assert!(parse("a=qmp:/x@d:weight=0").is_err());
    }
}
