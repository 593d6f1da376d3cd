//! A VM's firmware: SeaBIOS (QEMU's default, no state of its own) or UEFI
//! (the host's OVMF, without Secure Boot) with the VM's own variable store.
//!
//! UEFI keeps boot entries and settings in a variable store the guest
//! writes (a second pflash device). That store is the VM's, like a
//! writable disk: its file is made from OVMF's template when the VM first
//! starts ([`ensure_vars`]; never for an incoming migration, whose store is
//! the source's), attached writable, and handed over by a migration as a
//! disk is (the destination must see the same file; the pflash contents in
//! QEMU's memory move with the device state, which carries every RAM block
//! but the guest's memory). The code image is the host's, read-only.

use crate::VmError;
use std::path::PathBuf;

/// The firmware QEMU starts the VM with.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Firmware {
    /// SeaBIOS.
    #[default]
    Bios,
    /// OVMF: `code` read-only, `vars` the VM's variable store.
    Uefi {
        /// The firmware image (the host's).
        code: PathBuf,
        /// The VM's variable store.
        vars: PathBuf,
    },
}

/// The host's OVMF code image (`PAGEFLEET_OVMF_CODE` overrides): Debian's
/// `ovmf` package, 4 MiB, no Secure Boot.
pub fn ovmf_code() -> PathBuf {
    std::env::var_os("PAGEFLEET_OVMF_CODE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/share/OVMF/OVMF_CODE_4M.fd"))
}

/// The empty variable store that goes with [`ovmf_code`]
/// (`PAGEFLEET_OVMF_VARS` overrides).
pub fn ovmf_vars_template() -> PathBuf {
    std::env::var_os("PAGEFLEET_OVMF_VARS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/share/OVMF/OVMF_VARS_4M.fd"))
}

impl Firmware {
    /// The firmware of an API spec, with this host's OVMF.
    pub fn of(f: &pagefleet_api::VmFirmware) -> Firmware {
        match f {
            pagefleet_api::VmFirmware::Bios => Firmware::Bios,
            pagefleet_api::VmFirmware::Uefi { nvram } => Firmware::Uefi {
                code: ovmf_code(),
                vars: PathBuf::from(nvram),
            },
        }
    }

    /// QEMU's arguments for it (none for SeaBIOS).
    pub(crate) fn args(&self) -> Vec<String> {
        match self {
            Firmware::Bios => Vec::new(),
            Firmware::Uefi { code, vars } => vec![
                "-drive".into(),
                format!(
                    "if=pflash,format=raw,unit=0,readonly=on,file={}",
                    code.display()
                ),
                "-drive".into(),
                format!("if=pflash,format=raw,unit=1,file={}", vars.display()),
            ],
        }
    }

    /// Checks before QEMU starts: the code image is there, and the store
    /// is a file of the template's size (QEMU maps both as flash of fixed
    /// sizes; another store would not fit).
    pub(crate) fn check(&self) -> Result<(), VmError> {
        let Firmware::Uefi { code, vars } = self else {
            return Ok(());
        };
        if !code.is_file() {
            return Err(VmError::Invalid(format!(
                "UEFI firmware {} is missing on this host (Debian's ovmf package)",
                code.display()
            )));
        }
        let want = std::fs::metadata(ovmf_vars_template())
            .map(|m| m.len())
            .ok();
        let have = std::fs::metadata(vars)
            .map(|m| m.len())
            .map_err(|e| VmError::Io {
                context: format!("UEFI variable store {}", vars.display()),
                cause: e,
            })?;
        if want.is_some_and(|w| w != have) {
            return Err(VmError::Invalid(format!(
                "UEFI variable store {} is {have} bytes, not the {} bytes of this host's OVMF ({})",
                vars.display(),
                want.unwrap_or(0),
                ovmf_vars_template().display()
            )));
        }
        Ok(())
    }
}

/// Make the VM's variable store from OVMF's template when it is missing
/// (put in place by [`crate::place::make_new`]). True when it was made here.
pub fn ensure_vars(f: &Firmware) -> Result<bool, VmError> {
    let Firmware::Uefi { vars, .. } = f else {
        return Ok(false);
    };
    if vars.exists() {
        return Ok(false);
    }
    let template = ovmf_vars_template();
    crate::place::make_new(vars, "UEFI variable store", |tmp| {
        std::fs::copy(&template, tmp)
            .map(|_| ())
            .map_err(|e| VmError::Io {
                context: format!(
                    "copying {} to make UEFI variable store {}",
                    template.display(),
                    vars.display()
                ),
                cause: e,
            })
    })?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vars_store_is_made_once_from_the_template_and_kept() {
        let dir = std::env::temp_dir().join(format!("pf-nvram-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let vars = dir.join("vm1.vars");
        let f = Firmware::Uefi {
            code: ovmf_code(),
            vars: vars.clone(),
        };
        let made = ensure_vars(&f);
        let template = std::fs::read(ovmf_vars_template());
        let copy = std::fs::read(&vars);
        // What the guest wrote stays.
        std::fs::write(
            &vars,
            vec![9u8; copy.as_ref().map(|c| c.len()).unwrap_or(1)],
        )
        .unwrap();
        let again = ensure_vars(&f);
        let kept = std::fs::read(&vars).unwrap();
        let checked = f.check();
        std::fs::write(&vars, b"short").unwrap();
        let short = f.check();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(made.unwrap());
        assert_eq!(
            copy.unwrap(),
            template.expect("OVMF's template (the ovmf package)")
        );
        assert!(!again.unwrap());
        assert!(kept.iter().all(|&b| b == 9));
        checked.unwrap();
        let e = short.unwrap_err().to_string();
        assert!(e.contains("5 bytes") && e.contains("vm1.vars"), "{e}");
        assert!(f
            .args()
            .iter()
            .any(|a| a.contains("unit=1") && a.contains("vm1.vars")));
        assert!(Firmware::Bios.args().is_empty());
    }
}
