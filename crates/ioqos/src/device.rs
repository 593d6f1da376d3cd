//! The shared block device, by path (/dev/loop0) or MAJ:MIN.

use crate::error::{Context, Result};
use std::os::unix::fs::{FileTypeExt, MetadataExt};

/// A block device by number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Dev {
    /// Major number.
    pub major: u32,
    /// Minor number.
    pub minor: u32,
}

impl std::fmt::Display for Dev {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "{}:{}", self.major, self.minor)
    }
}

impl Dev {
    /// A device path or MAJ:MIN.
    pub fn parse(s: &str) -> Result<Dev> {
        let d = if let Some((a, b)) = s.split_once(':').filter(|_| !s.starts_with('/')) {
            Dev {
                major: a.parse().context("bad major number")?,
                minor: b.parse().context("bad minor number")?,
            }
        } else {
            let m = std::fs::metadata(s).with_context(|| format!("unknown device {s}"))?;
            if !m.file_type().is_block_device() {
                return Err(crate::Error::Invalid(format!("{s} is not a block device")));
            }
            let r = m.rdev();
            let (major, minor) = pagefleet_common::sys::mapping::dev_numbers(r);
            Dev { major, minor }
        };
        if !std::path::Path::new(&format!("/sys/dev/block/{d}")).exists() {
            return Err(crate::Error::Invalid(format!(
                "unknown device {s}: no block device {d} on this host"
            )));
        }
        Ok(d)
    }
}
