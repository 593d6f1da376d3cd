//! Processes: signals to them, whether they live, who we run as.

use std::io;

/// A signal (`libc::SIGTERM`, ...) to the process `pid`, or to the process
/// group `-pid` when `pid` is negative (as kill(2)).
pub fn signal(pid: i32, sig: libc::c_int) -> io::Result<()> {
    if pid == 0 || pid == -1 {
        // kill(0) signals our own group and kill(-1) every process we may:
        // never what a caller holding a pid meant.
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("refusing to signal pid {pid}"),
        ));
    }
    // SAFETY: kill takes no pointers.
    if unsafe { libc::kill(pid, sig) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A signal to the child `c` (ignoring a child that is already gone).
pub fn signal_child(c: &std::process::Child, sig: libc::c_int) {
    let _ = signal(c.id() as i32, sig);
}

/// Whether `pid` names a live process (or a zombie) we may signal.
pub fn alive(pid: i32) -> bool {
    pid > 0
        // SAFETY: signal 0 only checks that the process exists.
        && unsafe { libc::kill(pid, 0) } == 0
}

/// Whether this process runs as root (effective uid 0).
pub fn is_root() -> bool {
    // SAFETY: geteuid takes nothing and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// The process group of `pid`, if it exists.
pub fn process_group(pid: i32) -> Option<i32> {
    // SAFETY: getpgid takes no pointers.
    let g = unsafe { libc::getpgid(pid) };
    (g > 0).then_some(g)
}

/// The calling thread's id (gettid).
pub fn thread_id() -> i32 {
    // SAFETY: gettid takes nothing and cannot fail.
    unsafe { libc::gettid() }
}

/// Die with `sig` when the parent thread exits (`PR_SET_PDEATHSIG`), and at
/// once if the parent `parent` is already gone. Call in a child between
/// fork and exec (async-signal-safe calls only).
///
/// # Safety
/// Only async-signal-safe work may follow in a forked child; this is.
pub unsafe fn die_with_parent(parent: libc::pid_t, sig: libc::c_int) -> io::Result<()> {
    // SAFETY: prctl with integer arguments; getppid takes nothing.
    unsafe {
        if libc::prctl(libc::PR_SET_PDEATHSIG, sig) != 0 {
            return Err(io::Error::last_os_error());
        }
        if libc::getppid() != parent {
            return Err(io::Error::from_raw_os_error(libc::ESRCH));
        }
    }
    Ok(())
}

/// Start a new session (setsid) in a forked child: it leaves our process
/// group and terminal. Async-signal-safe.
pub fn new_session() {
    // SAFETY: setsid takes nothing; failure (already a group leader) is harmless.
    unsafe { libc::setsid() };
}

/// Leave the process at once with `code`, running no destructors or
/// atexit handlers (`_exit`): for a signal handler or a forked child.
pub fn exit_now(code: i32) -> ! {
    // SAFETY: _exit never returns and touches no Rust state.
    unsafe { libc::_exit(code) }
}

/// Clock ticks per second (`_SC_CLK_TCK`: the unit of /proc's CPU times).
pub fn clock_ticks() -> u64 {
    // SAFETY: sysconf takes an integer name.
    (unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).max(1) as u64
}

/// CPUs online now.
pub fn online_cpus() -> usize {
    // SAFETY: sysconf takes an integer name.
    (unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }).max(1) as usize
}

/// Let thread `tid` (0: the caller) run only on `cpus`.
pub fn set_affinity(tid: i32, cpus: &[usize]) -> io::Result<()> {
    // SAFETY: a zeroed cpu_set_t is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        if c >= libc::CPU_SETSIZE as usize {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("no CPU {c}"),
            ));
        }
        // SAFETY: c is below CPU_SETSIZE (checked), so the bit is inside set.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: set is a valid cpu_set_t of the size given.
    let r = unsafe { libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_refuse_the_pids_that_mean_many_processes() {
        assert!(signal(0, 0).is_err());
        assert!(signal(-1, 0).is_err());
        assert!(alive(std::process::id() as i32));
        assert!(!alive(0));
        assert!(signal(std::process::id() as i32, 0).is_ok());
    }
}
