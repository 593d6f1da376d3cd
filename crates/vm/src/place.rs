//! A VM file made once on its host (a disk's overlay, a UEFI variable
//! store): written under a temporary name beside its place, then
//! hard-linked into place only if nothing is there by then, so two starts
//! racing never truncate the file one of them already made (the file that
//! stands is the caller's to check).

use crate::VmError;
use std::path::Path;

/// Make `to` (`what` names it in errors): `make` writes the temporary file
/// it is given, which is then linked to `to` unless `to` exists by then.
/// The temporary file is gone afterwards, whatever happened.
pub(crate) fn make_new(
    to: &Path,
    what: &str,
    make: impl FnOnce(&Path) -> Result<(), VmError>,
) -> Result<(), VmError> {
    let name = to
        .file_name()
        .ok_or_else(|| VmError::Invalid(format!("{what} {}: not a file name", to.display())))?;
    let tmp = to.with_file_name(format!(
        ".{}.{}.new",
        name.to_string_lossy(),
        std::process::id()
    ));
    let made = make(&tmp);
    let linked = made.and_then(|()| {
        std::fs::hard_link(&tmp, to).or_else(|e| match e.kind() {
            // Another start made it first.
            std::io::ErrorKind::AlreadyExists => Ok(()),
            _ => Err(VmError::Io {
                context: format!("putting {what} {} in place", to.display()),
                cause: e,
            }),
        })
    });
    let _ = std::fs::remove_file(&tmp);
    linked
}
