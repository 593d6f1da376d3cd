//! This crate's raw system calls, each behind a function whose `SAFETY:`
//! comments say why the call is sound (the architecture test keeps
//! `libc::` calls in `sys` modules).

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// A `len`-byte file on a tmpfs of its own mounted `huge=always`, already
/// unlinked and the tmpfs detached: only the descriptor reaches it.
pub(crate) fn huge_tmpfs_file(len: usize) -> io::Result<OwnedFd> {
    let dir = std::env::temp_dir().join(format!(
        ".pagefleet-pool-{}-{:x}",
        std::process::id(),
        pagefleet_proto::auth::random_u64()
    ));
    std::fs::create_dir(&dir)?;
    let cdir = cstr(&dir)?;
    // Room for the file rounded up to whole huge pages, and no more.
    let size = len.div_ceil(2 << 20) * (2 << 20) + (2 << 20);
    let opts =
        CString::new(format!("huge=always,mode=0700,nr_inodes=4,size={size}")).expect("no NUL");
    let (src, fstype) = (c"pagefleet-pool", c"tmpfs");
    // SAFETY: NUL-terminated strings that outlive the call.
    let mounted = check(unsafe {
        libc::mount(
            src.as_ptr(),
            cdir.as_ptr(),
            fstype.as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            opts.as_ptr().cast(),
        )
    });
    let file = mounted.and_then(|()| {
        let path = dir.join("pool");
        let cpath = cstr(&path)?;
        // SAFETY: a NUL-terminated path; the descriptor is ours from here.
        let fd = unsafe {
            libc::open(
                cpath.as_ptr(),
                libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC,
                0o600,
            )
        };
        check(fd)?;
        // SAFETY: fd was just opened and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let _ = std::fs::remove_file(&path);
        // SAFETY: sizing our own file.
        check(unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) })?;
        Ok(fd)
    });
    // SAFETY: detaching the mount made above (if it was made) and removing
    // its empty mount point; the open file keeps the tmpfs alive.
    unsafe { libc::umount2(cdir.as_ptr(), libc::MNT_DETACH) };
    let _ = std::fs::remove_dir(&dir);
    file
}

pub(crate) fn cstr(p: &std::path::Path) -> io::Result<CString> {
    use std::os::unix::ffi::OsStrExt;
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in a path"))
}

pub(crate) fn check(r: libc::c_int) -> io::Result<()> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}
