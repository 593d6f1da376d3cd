//! What a disk image is, read from its header: raw or qcow2, and nothing
//! QEMU would open besides the file itself.
//!
//! QEMU opens a qcow2 image's backing file and external data file by the
//! names written *inside* the image, as root on a pagefleet host: an image
//! that names `/etc/shadow` as its backing file would hand that file to
//! the guest. So a qcow2 image is accepted only whole (no backing file, no
//! external data file, not encrypted — QEMU would ask for a secret), and the
//! formats QEMU knows but pagefleet does not attach are refused by name
//! (with how to convert them), never attached as raw bytes: a guest that
//! saw a VMDK's header as its disk would see garbage.
//!
//! The format is detected once, when the guest first starts, and kept in
//! its spec ([`pagefleet_api::VmDisk::format`]) by the host daemon that
//! starts it (or by `pagefleet run vm`); a raw image is never probed
//! again, so what its guest writes at offset 0 cannot change how the next
//! host opens it.

use pagefleet_api::DiskFormat;
use std::io::Read;
use std::path::Path;

/// Bytes of an image's start read to tell its format: a qcow2 image's
/// backing file name lies in its first cluster (64 KiB by default).
const HEADER: usize = 64 << 10;

/// qcow2's magic, "QFI\xfb".
const QCOW2_MAGIC: &[u8; 4] = b"QFI\xfb";

/// The qcow2 incompatible-feature bit for an external data file.
const QCOW2_EXTERNAL_DATA: u64 = 1 << 2;

/// Formats QEMU opens that pagefleet refuses, by their magic at offset 0.
const OTHER_FORMATS: &[(&[u8], &str)] = &[
    (b"QFI\x00", "qcow (version 1)"),
    (b"KDMV", "VMDK"),
    (b"# Disk DescriptorFile", "VMDK (descriptor)"),
    (b"vhdxfile", "VHDX"),
    (b"conectix", "VHD (VPC)"),
    (b"QED\x00", "QED"),
    (b"LUKS\xba\xbe", "LUKS"),
    (b"WithoutFreeSpace", "Parallels"),
    (b"ParallelsDiskImage", "Parallels"),
    (b"<<< Oracle VM VirtualBox Disk Image >>>", "VDI"),
    (b"<<< Sun xVM VirtualBox Disk Image >>>", "VDI"),
    (b"<<< Sun VirtualBox Disk Image >>>", "VDI"),
    (b"<<< innotek VirtualBox Disk Image >>>", "VDI"),
];

/// The format of the image at `path`, from its header (see the module's
/// docs for what is refused); the error names the image and why.
pub fn detect(path: &Path) -> Result<DiskFormat, String> {
    let h = header(path, "disk")?;
    classify(&h).map_err(|why| format!("disk {}: {why}", path.display()))
}

/// The first [`HEADER`] bytes of the image at `path` (`what` names it in
/// the error).
fn header(path: &Path, what: &str) -> Result<Vec<u8>, String> {
    let fail = |e: std::io::Error| format!("{what} {}: {e}", path.display());
    let f = std::fs::File::open(path).map_err(fail)?;
    let mut h = Vec::with_capacity(HEADER);
    f.take(HEADER as u64).read_to_end(&mut h).map_err(fail)?;
    Ok(h)
}

/// The format to attach the image at `path` with: `given` when the caller
/// says (a qcow2 image is checked all the same: QEMU would follow what its
/// header names; raw reads nothing but the file), else what its header
/// says ([`detect`]).
pub fn check(path: &Path, given: Option<DiskFormat>) -> Result<DiskFormat, String> {
    match given {
        Some(DiskFormat::Raw) => Ok(DiskFormat::Raw),
        Some(DiskFormat::Qcow2) => match detect(path)? {
            DiskFormat::Qcow2 => Ok(DiskFormat::Qcow2),
            DiskFormat::Raw => Err(format!(
                "disk {}: format=qcow2, but it has no qcow2 header",
                path.display()
            )),
        },
        None => detect(path),
    }
}

/// The format a header (the image's first bytes, up to [`HEADER`]) says.
pub fn classify(h: &[u8]) -> Result<DiskFormat, String> {
    if h.starts_with(QCOW2_MAGIC) {
        if let Some(name) = qcow2(h)? {
            return Err(format!(
                "a qcow2 image with a backing file ({name}): QEMU would open that file as root; give a whole image (qemu-img convert -O qcow2 IN OUT), or the base image with an overlay (--disk BASE,overlay=FILE)"
            ));
        }
        return Ok(DiskFormat::Qcow2);
    }
    if let Some((_, name)) = OTHER_FORMATS.iter().find(|(m, _)| h.starts_with(m)) {
        return Err(format!(
            "a {name} image: pagefleet attaches raw and qcow2 images (qemu-img convert -O qcow2 IN OUT)"
        ));
    }
    Ok(DiskFormat::Raw)
}

/// Check that the file at `overlay` is a qcow2 overlay of `base`: a qcow2
/// image (as [`check`] wants one) whose header names exactly `base` as its
/// backing file. QEMU is given the backing image by pagefleet, not by that
/// name (see `pagefleet_vm::overlay`); the name only ties the overlay to
/// the base it was made on, so an overlay attached over another image (its
/// clusters would then read as garbage) is refused.
pub fn check_overlay(overlay: &Path, base: &Path) -> Result<(), String> {
    let h = header(overlay, "overlay")?;
    if !h.starts_with(QCOW2_MAGIC) {
        return Err(format!(
            "overlay {}: not a qcow2 image (an overlay is a qcow2 file over its base)",
            overlay.display()
        ));
    }
    let named = qcow2(&h).map_err(|why| format!("overlay {}: {why}", overlay.display()))?;
    match named {
        Some(n) if Path::new(&n) == base => Ok(()),
        Some(n) => Err(format!(
            "overlay {} was made over {n}, not over {}: give its own base image, or a new overlay file",
            overlay.display(),
            base.display()
        )),
        None => Err(format!(
            "overlay {}: a whole qcow2 image with no backing file, not an overlay of {}",
            overlay.display(),
            base.display()
        )),
    }
}

/// Check a qcow2 header: a version QEMU opens, nothing outside the file
/// but the backing file it names (returned: the caller decides).
fn qcow2(h: &[u8]) -> Result<Option<String>, String> {
    let be32 = |at: usize| {
        h.get(at..at + 4)
            .map(|b| u32::from_be_bytes(b.try_into().unwrap()))
    };
    let be64 = |at: usize| {
        h.get(at..at + 8)
            .map(|b| u64::from_be_bytes(b.try_into().unwrap()))
    };
    let (Some(version), Some(backing_offset), Some(backing_len), Some(crypt)) =
        (be32(4), be64(8), be32(16), be32(32))
    else {
        return Err("a qcow2 header cut short".into());
    };
    if !(2..=3).contains(&version) {
        return Err(format!(
            "qcow2 version {version}: QEMU opens versions 2 and 3"
        ));
    }
    let backing = if backing_offset != 0 || backing_len != 0 {
        let name = usize::try_from(backing_offset)
            .ok()
            .and_then(|o| h.get(o..o.checked_add(backing_len as usize)?))
            .ok_or("a qcow2 header whose backing file name lies outside its first 64 KiB")?;
        Some(String::from_utf8_lossy(name).into_owned())
    } else {
        None
    };
    if crypt != 0 {
        return Err("an encrypted qcow2 image: not supported".into());
    }
    if version == 3 {
        let incompatible = be64(72).ok_or("a qcow2 v3 header cut short")?;
        if incompatible & QCOW2_EXTERNAL_DATA != 0 {
            return Err(
                "a qcow2 image with an external data file: QEMU would open that file as root"
                    .into(),
            );
        }
    }
    Ok(backing)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A qcow2 header as qemu-img writes one (version, backing file,
    /// encryption, incompatible features), zero-padded to 512 bytes.
    fn qcow2_header(version: u32, backing: Option<&str>, crypt: u32, incompatible: u64) -> Vec<u8> {
        let mut h = vec![0u8; 512];
        h[..4].copy_from_slice(QCOW2_MAGIC);
        h[4..8].copy_from_slice(&version.to_be_bytes());
        if let Some(b) = backing {
            let off = 200usize;
            h[8..16].copy_from_slice(&(off as u64).to_be_bytes());
            h[16..20].copy_from_slice(&(b.len() as u32).to_be_bytes());
            h[off..off + b.len()].copy_from_slice(b.as_bytes());
        }
        h[32..36].copy_from_slice(&crypt.to_be_bytes());
        h[72..80].copy_from_slice(&incompatible.to_be_bytes());
        h
    }

    #[test]
    fn a_whole_qcow2_image_is_qcow2_and_anything_without_a_known_header_is_raw() {
        assert_eq!(
            classify(&qcow2_header(3, None, 0, 0)),
            Ok(DiskFormat::Qcow2)
        );
        assert_eq!(
            classify(&qcow2_header(2, None, 0, 0)),
            Ok(DiskFormat::Qcow2)
        );
        assert_eq!(classify(&[0u8; 512]), Ok(DiskFormat::Raw));
        // An MBR boot sector, and an empty file.
        let mut mbr = vec![0u8; 512];
        mbr[510] = 0x55;
        mbr[511] = 0xaa;
        assert_eq!(classify(&mbr), Ok(DiskFormat::Raw));
        assert_eq!(classify(&[]), Ok(DiskFormat::Raw));
    }

    #[test]
    fn a_qcow2_image_that_names_another_file_is_refused_with_that_name() {
        let e = classify(&qcow2_header(3, Some("/etc/shadow"), 0, 0)).unwrap_err();
        assert!(e.contains("backing file (/etc/shadow)"), "{e}");
        let e = classify(&qcow2_header(3, None, 0, QCOW2_EXTERNAL_DATA)).unwrap_err();
        assert!(e.contains("external data file"), "{e}");
        let e = classify(&qcow2_header(3, None, 1, 0)).unwrap_err();
        assert!(e.contains("encrypted"), "{e}");
        let e = classify(&qcow2_header(4, None, 0, 0)).unwrap_err();
        assert!(e.contains("version 4"), "{e}");
        let e = classify(&QCOW2_MAGIC[..]).unwrap_err();
        assert!(e.contains("cut short"), "{e}");
    }

    #[test]
    fn an_overlay_is_accepted_over_the_base_it_names_and_no_other() {
        let dir = std::env::temp_dir().join(format!("pf-overlay-check-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let base = dir.join("base.img");
        let write = |name: &str, h: Vec<u8>| {
            let p = dir.join(name);
            std::fs::write(&p, h).unwrap();
            p
        };
        let b = base.to_str().unwrap();
        let ok = write("ok.qcow2", qcow2_header(3, Some(b), 0, 0));
        let other = write(
            "other.qcow2",
            qcow2_header(3, Some("/images/other.img"), 0, 0),
        );
        let whole = write("whole.qcow2", qcow2_header(3, None, 0, 0));
        let raw = write("raw.img", vec![0u8; 512]);
        let crypt = write("crypt.qcow2", qcow2_header(3, Some(b), 1, 0));
        let results = [
            check_overlay(&ok, &base),
            check_overlay(&other, &base),
            check_overlay(&whole, &base),
            check_overlay(&raw, &base),
            check_overlay(&crypt, &base),
            check_overlay(&dir.join("missing.qcow2"), &base),
        ];
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(results[0], Ok(()));
        let e = |i: usize| results[i].clone().unwrap_err();
        assert!(e(1).contains("made over /images/other.img"), "{}", e(1));
        assert!(e(2).contains("no backing file"), "{}", e(2));
        assert!(e(3).contains("not a qcow2 image"), "{}", e(3));
        assert!(e(4).contains("encrypted"), "{}", e(4));
        assert!(e(5).contains("missing.qcow2"), "{}", e(5));
        // As a disk of its own, an overlay is refused with its base's name.
        let e = classify(&qcow2_header(3, Some(b), 0, 0)).unwrap_err();
        assert!(e.contains(b) && e.contains("overlay="), "{e}");
    }

    #[test]
    fn formats_pagefleet_does_not_attach_are_refused_by_name() {
        for (magic, name) in OTHER_FORMATS {
            let mut h = magic.to_vec();
            h.resize(512, 0);
            let e = classify(&h).unwrap_err();
            assert!(e.contains(name) && e.contains("qemu-img convert"), "{e}");
        }
    }
}
