//! A read-only base image with a writable qcow2 overlay
//! (`--disk BASE,overlay=FILE`): the guest's writes land in the overlay,
//! the base is never written, so many VMs can boot one base, each with its
//! own overlay.
//!
//! The overlay is made once, when the guest first starts on a host
//! ([`ensure`], called by the runner before QEMU starts; never for an
//! incoming migration, whose overlay must be the source's: an empty one
//! made there would silently drop every write). It is made by `qemu-img
//! create` (a fixed program, with paths the spec checked) and put in place
//! by [`crate::place::make_new`]: two starts racing never truncate each
//! other's overlay.
//!
//! QEMU is never left to follow the backing file name written in the
//! overlay: the drive names the base and its format itself
//! (`backing.driver=`, `backing.file.filename=`, see `qemu.rs`), and the
//! name in the header is only compared with the base
//! ([`pagefleet_common::disk_image::check_overlay`]).

use crate::{Disk, VmError};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The host's qemu-img (beside its QEMU: `PAGEFLEET_QEMU_IMG` overrides).
fn qemu_img() -> PathBuf {
    std::env::var_os("PAGEFLEET_QEMU_IMG")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("qemu-img"))
}

/// Make `d`'s overlay when it has one and the file is missing; then check
/// it is an overlay of `d`'s base. True when it was made here.
pub fn ensure(d: &Disk) -> Result<bool, VmError> {
    let Some(o) = &d.overlay else {
        return Ok(false);
    };
    let made = if o.exists() {
        false
    } else {
        create(o, &d.path, d.format)?;
        true
    };
    pagefleet_common::disk_image::check_overlay(o, &d.path).map_err(VmError::Invalid)?;
    Ok(made)
}

/// `qemu-img create -f qcow2 -F FORMAT -b BASE`, put in place as
/// [`crate::place::make_new`] does.
fn create(overlay: &Path, base: &Path, format: pagefleet_api::DiskFormat) -> Result<(), VmError> {
    crate::place::make_new(overlay, "overlay", |tmp| {
        let out = Command::new(qemu_img())
            .args(["create", "-q", "-f", "qcow2", "-F", format.as_str(), "-b"])
            .arg(base)
            .arg(tmp)
            .output()
            .map_err(|e| VmError::Io {
                context: format!(
                    "running {} to make overlay {}",
                    qemu_img().display(),
                    overlay.display()
                ),
                cause: e,
            })?;
        if !out.status.success() {
            return Err(VmError::Invalid(format!(
                "making overlay {} over {}: qemu-img: {}",
                overlay.display(),
                base.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use pagefleet_api::DiskFormat;

    fn have_qemu_img() -> bool {
        Command::new(qemu_img())
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    }

    #[test]
    fn an_overlay_is_made_once_over_its_base_and_kept_after() {
        if !have_qemu_img() {
            panic!("qemu-img is missing: `make deps` installs qemu-utils");
        }
        let dir = std::env::temp_dir().join(format!("pf-overlay-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let base = dir.join("base.img");
        std::fs::write(&base, vec![7u8; 1 << 20]).unwrap();
        let d = Disk {
            path: base.clone(),
            format: DiskFormat::Raw,
            readonly: false,
            overlay: Some(dir.join("vm1.qcow2")),
        };
        let first = ensure(&d);
        // Something written into the overlay stays: a second ensure keeps it.
        let o = d.overlay.clone().unwrap();
        let len0 = std::fs::metadata(&o).map(|m| m.len()).unwrap_or(0);
        std::fs::OpenOptions::new().append(true).open(&o).unwrap();
        let second = ensure(&d);
        let len1 = std::fs::metadata(&o).map(|m| m.len()).unwrap_or(0);
        // Over another base: refused, naming both.
        let other = Disk {
            path: dir.join("other.img"),
            ..d.clone()
        };
        std::fs::write(&other.path, vec![1u8; 4096]).unwrap();
        let wrong = ensure(&other);
        let leftovers: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().ends_with(".new"))
            .collect();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(first.unwrap(), "made the first time");
        assert!(!second.unwrap(), "kept the second time");
        assert_eq!(len0, len1);
        let e = wrong.unwrap_err().to_string();
        assert!(e.contains("made over") && e.contains("other.img"), "{e}");
        assert!(leftovers.is_empty());
    }
}
