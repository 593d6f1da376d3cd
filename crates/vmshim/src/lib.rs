//! `libpagefleet_vmshim.so`: loaded into QEMU with `LD_PRELOAD` by the
//! pagefleet runner of a VM guest. QEMU maps its RAM file (a memfd of the
//! runner, opened through `/proc/PID/fd/N`) with `mmap(MAP_SHARED)` right
//! after opening it; this shim wraps `mmap`, recognises that mapping by the
//! file's device and inode (`PAGEFLEET_VM_RAM=DEV:INO`), registers it with
//! a userfaultfd (MISSING and WP, kernel-mode faults included: QEMU's
//! `read()`s into guest RAM fault in the kernel) and passes the fd to the
//! runner over the Unix socket `PAGEFLEET_VM_SOCKET`. The runner's pager then
//! serves the VM's faults as it serves a native guest's. A thread stays on
//! that socket to unmap pages on the runner's behalf (the sampler's zaps:
//! `madvise` works only on the caller's own mappings); when the runner is
//! gone, QEMU exits with status 75 rather than hang on faults nobody serves.
//!
//! Why a shim and not the paging runtime inside QEMU: the runner stays one
//! program for every guest kind (migration, control socket, status), and
//! QEMU keeps its own threads only; the shim is ~200 lines with no state
//! beyond one socket.

use pagefleet_uffd::handoff::{self, agent, Hello};
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

type MmapFn =
    unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, c_int, libc::off_t) -> *mut c_void;

/// The guest RAM was handed over (there is one such mapping per QEMU).
static HANDED: AtomicBool = AtomicBool::new(false);

fn real_mmap() -> MmapFn {
    static REAL: OnceLock<usize> = OnceLock::new();
    let p = *REAL.get_or_init(|| {
        // SAFETY: dlsym with a NUL-terminated name; RTLD_NEXT finds libc's mmap.
        unsafe { libc::dlsym(libc::RTLD_NEXT, c"mmap".as_ptr()) as usize }
    });
    assert!(p != 0, "pagefleet vmshim: libc's mmap not found");
    // SAFETY: p is libc's mmap, whose signature MmapFn is.
    unsafe { std::mem::transmute::<usize, MmapFn>(p) }
}

/// `PAGEFLEET_VM_RAM` as (dev, ino), read once.
fn ram_id() -> Option<(u64, u64)> {
    static ID: OnceLock<Option<(u64, u64)>> = OnceLock::new();
    *ID.get_or_init(|| {
        let v = std::env::var("PAGEFLEET_VM_RAM").ok()?;
        let (d, i) = v.split_once(':')?;
        Some((d.parse().ok()?, i.parse().ok()?))
    })
}

fn is_guest_ram(fd: c_int) -> bool {
    let Some((dev, ino)) = ram_id() else {
        return false;
    };
    // SAFETY: fstat into a zeroed stat buffer; fd is the caller's.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return false;
    }
    st.st_dev == dev && st.st_ino == ino
}

/// The wrapped `mmap`: libc's, then the hand-over for the guest RAM.
///
/// # Safety
/// As `mmap(2)`.
#[no_mangle]
pub unsafe extern "C" fn mmap(
    addr: *mut c_void,
    len: usize,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: libc::off_t,
) -> *mut c_void {
    // SAFETY: the caller's arguments, passed on unchanged.
    let p = unsafe { real_mmap()(addr, len, prot, flags, fd, off) };
    if p == libc::MAP_FAILED
        || fd < 0
        || flags & libc::MAP_SHARED == 0
        || off != 0
        || HANDED.load(Ordering::Relaxed)
        || !is_guest_ram(fd)
    {
        return p;
    }
    HANDED.store(true, Ordering::Relaxed);
    match hand_over(p as u64, len as u64) {
        Ok(()) => p,
        Err(e) => {
            say(&format!("cannot hand the guest RAM to the runner: {e}"));
            // SAFETY: unmapping what was just mapped here; QEMU sees the
            // failure and exits with its own error.
            unsafe { libc::munmap(p, len) };
            // SAFETY: errno is thread-local.
            unsafe { *libc::__errno_location() = libc::EIO };
            libc::MAP_FAILED
        }
    }
}

/// `mmap64` is the same call on 64-bit Linux.
///
/// # Safety
/// As `mmap(2)`.
#[no_mangle]
pub unsafe extern "C" fn mmap64(
    addr: *mut c_void,
    len: usize,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: libc::off_t,
) -> *mut c_void {
    // SAFETY: the same contract.
    unsafe { mmap(addr, len, prot, flags, fd, off) }
}

fn hand_over(base: u64, len: u64) -> std::io::Result<()> {
    use pagefleet_uffd as u;
    let path = std::env::var("PAGEFLEET_VM_SOCKET")
        .map_err(|_| std::io::Error::other("PAGEFLEET_VM_SOCKET is not set"))?;
    // Paging works per 4 KiB page: no transparent huge pages in guest RAM.
    // SAFETY: advice on the mapping just made.
    unsafe { libc::madvise(base as *mut c_void, len as usize, libc::MADV_NOHUGEPAGE) };
    let uffd = u::Uffd::open_all_faults(handoff::SHIM_FEATURES).map_err(std::io::Error::other)?;
    // SAFETY: QEMU's guest RAM mapping, which no Rust value of the shim
    // lives in (only the guest and the pager's fills touch it).
    unsafe { uffd.register(base, len, u::MODE_MISSING | u::MODE_WP) }
        .map_err(std::io::Error::other)?;
    let sock = std::os::unix::net::UnixStream::connect(&path)
        .map_err(|e| std::io::Error::new(e.kind(), format!("{path}: {e}")))?;
    let hello = Hello {
        base,
        len,
        // SAFETY: getpid has no preconditions.
        pid: unsafe { libc::getpid() } as u64,
        features: uffd.features,
    };
    handoff::send_fd(&sock, &hello.encode(), &uffd)?;
    // Our copy of the fd is not needed: the runner serves it now.
    drop(uffd);
    let mut ack = [0u8; agent::REQUEST_LEN];
    sock.set_read_timeout(Some(std::time::Duration::from_secs(60)))?;
    std::io::Read::read_exact(&mut &sock, &mut ack)?;
    if agent::Request::decode(&ack, len) != Ok(agent::Request::Ack) {
        return Err(std::io::Error::other(
            "the runner did not acknowledge the guest RAM",
        ));
    }
    sock.set_read_timeout(None)?;
    std::thread::Builder::new()
        .name("pagefleet-agent".into())
        .spawn(move || serve(sock, base, len))?;
    Ok(())
}

/// The agent: carry out the runner's requests on QEMU's mapping.
fn serve(sock: std::os::unix::net::UnixStream, base: u64, len: u64) {
    let mut buf = [0u8; agent::REQUEST_LEN];
    loop {
        if std::io::Read::read_exact(&mut &sock, &mut buf).is_err() {
            break;
        }
        let r = match agent::Request::decode(&buf, len) {
            Ok(agent::Request::Zap { off, len: n }) => {
                // SAFETY: whole pages inside the guest RAM mapping (checked
                // by decode); DONTNEED on a shared mapping drops page-table
                // entries only, the memfd keeps the data.
                let rc = unsafe {
                    libc::madvise((base + off) as *mut c_void, n as usize, libc::MADV_DONTNEED)
                };
                if rc == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error()
                        .raw_os_error()
                        .unwrap_or(libc::EIO))
                }
            }
            // A second ACK asks for nothing.
            Ok(agent::Request::Ack) => Ok(()),
            Err(errno) => Err(errno),
        };
        if std::io::Write::write_all(&mut &sock, &agent::reply(r)).is_err() {
            break;
        }
    }
    say("the runner serving this VM's memory is gone; stopping QEMU");
    // SAFETY: _exit ends the process at once; no faults can be served any more.
    unsafe { libc::_exit(75) };
}

/// A line on QEMU's stderr, if anyone still reads it. Never `eprintln!`:
/// that panics on a write error, and QEMU's stderr is a pipe to the runner,
/// whose end closes as the runner dies — the agent thread would die of the
/// panic before its `_exit`, leaving QEMU running with nobody to serve it.
fn say(msg: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "pagefleet vmshim: {msg}");
}
