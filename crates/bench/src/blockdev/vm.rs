//! DMPS for what the paper built it for: a guest with little memory that
//! swaps. A QEMU (TCG) guest with 128 MiB runs memtest — write N MiB, read
//! every value back — with its swap on the DMPS export, on a local disk
//! image file, and on zram in the guest's own memory; the guest reports its
//! workload rate (MiB written and read back per second). The guest is the
//! swap-test image `make guest` builds (target/guest). memtest's data is
//! [`Fill::Random`] (nothing compresses: zram cannot hold it in a guest this
//! small) or [`Fill::Sparse`] (compresses about 6:1, as much of a real
//! guest's memory does: the rows that compare zram with the disks).

use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// What memtest writes (see crates/systest/guest/memtest.c).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Fill {
    /// Every word a distinct value.
    Random,
    /// One word in 8 the value, the rest zeros.
    Sparse,
}

impl Fill {
    pub fn arg(self) -> &'static str {
        match self {
            Fill::Random => "random",
            Fill::Sparse => "sparse",
        }
    }
}

/// One guest run.
#[derive(Clone, Debug, Serialize)]
pub struct VmRow {
    /// Where it swapped.
    pub swap: String,
    /// What memtest wrote.
    pub fill: Fill,
    /// Which round of the bench's guest rows.
    pub round: u32,
    /// memtest's rate, MiB/s (None: it failed).
    pub rate_mib_s: Option<f64>,
    /// MiB of swap in use after the write phase.
    pub swap_used_mib: u64,
    /// Why it failed, if it did.
    pub error: Option<String>,
}

/// The guest image (vmlinuz, initrd.gz), built if missing.
pub fn guest_dir() -> Result<PathBuf> {
    let bin = crate::util::sibling_binary("pagefleet")?;
    let dir = bin
        .parent()
        .and_then(Path::parent)
        .context("the binary's directory")?
        .join("guest");
    if !dir.join("initrd.gz").exists() {
        bail!("no guest image in {} (run `make guest`)", dir.display());
    }
    Ok(dir)
}

/// Seconds a guest may take (a healthy one takes well under a minute; one
/// whose disk hangs is killed, its row failed).
const GUEST_TIMEOUT: &str = "300";

/// Boot the guest with `drive` (None: zram in the guest) and `mb` MiB of memtest.
pub fn run(
    guest: &Path,
    swap: &str,
    round: u32,
    drive: Option<&str>,
    mb: u64,
    fill: Fill,
) -> VmRow {
    let mut cmd = Command::new("timeout");
    cmd.args([
        "-s",
        "KILL",
        GUEST_TIMEOUT,
        "qemu-system-x86_64",
        "-accel",
        "tcg",
        "-m",
        "128",
        "-nographic",
        "-no-reboot",
    ])
    .arg("-kernel")
    .arg(guest.join("vmlinuz"))
    .arg("-initrd")
    .arg(guest.join("initrd.gz"));
    let zram = if drive.is_none() { " swap=zram" } else { "" };
    cmd.args([
        "-append",
        &format!(
            "console=ttyS0 quiet memtest_mb={mb} memtest_fill={} panic=-1{zram}",
            fill.arg()
        ),
    ]);
    if let Some(d) = drive {
        cmd.args(["-drive", d]);
    }
    let out = match cmd.stdin(Stdio::null()).output() {
        Ok(o) => String::from_utf8_lossy(&o.stdout).into_owned(),
        Err(e) => {
            return VmRow {
                swap: swap.into(),
                fill,
                round,
                rate_mib_s: None,
                swap_used_mib: 0,
                error: Some(format!("qemu: {e}")),
            }
        }
    };
    let field = |key: &str| -> Option<f64> {
        out.lines()
            .find_map(|l| l.split(key).nth(1)?.split_whitespace().next()?.parse().ok())
    };
    let ok = out.contains(&format!("MEMTEST OK {mb} MiB"));
    VmRow {
        swap: swap.into(),
        fill,
        round,
        rate_mib_s: if ok { field("MEMTEST RATE ") } else { None },
        swap_used_mib: field("swap used ").unwrap_or(0.0) as u64,
        error: (!ok).then(|| {
            let tail: Vec<&str> = out.lines().rev().take(4).collect();
            format!("the guest did not finish memtest: {}", tail.join(" | "))
        }),
    }
}
