//! Processes: signals to them, whether they live, who we run as.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::Command;

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

/// Make `cmd`'s child die with SIGKILL when the thread that spawns it
/// exits (`PR_SET_PDEATHSIG`), and fail to start if this process is
/// already gone by then: a bench or test never leaves a daemon behind.
pub fn die_with_parent(cmd: &mut Command) {
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: between fork and exec the closure makes only
    // async-signal-safe calls (prctl, getppid) and allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The parent died before the prctl: nothing will signal.
            if libc::getppid() != parent {
                return Err(io::Error::other("the parent exited"));
            }
            Ok(())
        });
    }
}

/// Start `cmd`'s child in a session of its own (setsid): it leaves our
/// process group and terminal, and outlives them.
pub fn new_session(cmd: &mut Command) {
    // SAFETY: setsid is async-signal-safe; failure (already a group
    // leader, impossible in a fresh child) is harmless.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
}

/// Move `cmd`'s child into the cgroup whose `cgroup.procs` file is
/// `procs` before it executes (so everything it allocates is charged
/// there). Fails to spawn if the write fails.
pub fn enter_cgroup(cmd: &mut Command, procs: &std::path::Path) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(procs.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in a cgroup path"))?;
    // SAFETY: after fork the closure calls only async-signal-safe functions
    // (getpid, open, write, close) on a path made before the fork, and
    // formats the pid into a stack buffer: no allocation.
    unsafe {
        cmd.pre_exec(move || {
            let mut buf = [0u8; 12];
            let mut i = buf.len();
            let mut pid = libc::getpid() as u32;
            loop {
                i -= 1;
                buf[i] = b'0' + (pid % 10) as u8;
                pid /= 10;
                if pid == 0 {
                    break;
                }
            }
            let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            let n = libc::write(fd, buf[i..].as_ptr().cast(), buf.len() - i);
            let e = io::Error::last_os_error();
            libc::close(fd);
            if n != (buf.len() - i) as isize {
                return Err(e);
            }
            Ok(())
        });
    }
    Ok(())
}

/// Move the calling thread into the network namespace `ns` (a
/// `/run/netns/NAME` file).
pub fn enter_netns(ns: &impl AsFd) -> io::Result<()> {
    // SAFETY: setns on a namespace file the borrow keeps open; it changes
    // only this thread's namespace.
    if unsafe { libc::setns(ns.as_fd().as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
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

/// A pidfd for process `pid` (pidfd_open): it stays valid, and names the
/// same process, even after the pid is reused.
pub fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    let pid = libc::pid_t::try_from(pid)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "pid beyond pid_t"))?;
    // SAFETY: pidfd_open takes a pid and flags, no memory.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor the kernel just returned; nobody else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// A copy of descriptor `fd` of the process `pidfd` names (pidfd_getfd;
/// needs ptrace access to it).
pub fn pidfd_getfd(pidfd: BorrowedFd<'_>, fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_getfd takes a pidfd the borrow keeps open, a descriptor
    // number in the other process and flags; no memory.
    let copy = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if copy < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor the kernel just returned; nobody else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(copy as RawFd) })
}

/// Block until the process `pidfd` names ends; then, if it is our child,
/// reap it: its `(si_code, si_status)` (`CLD_EXITED` and the exit code, or
/// `CLD_KILLED` and the signal). None for a process that is not our child.
pub fn wait_pidfd(pidfd: BorrowedFd<'_>) -> Option<(i32, i32)> {
    let mut p = [crate::sys::poll::pollfd(&pidfd, libc::POLLIN)];
    // A pidfd becomes readable when its process ends.
    while !matches!(crate::sys::poll::poll(&mut p, -1), Ok(1..)) {}
    // SAFETY: a zeroed siginfo_t is a valid value for waitid to fill.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: waitid fills `info` for the process the borrowed pidfd names;
    // for a process that is not our child it fails (ECHILD), touching nothing.
    let r = unsafe {
        libc::waitid(
            libc::P_PIDFD,
            pidfd.as_raw_fd() as libc::id_t,
            &mut info,
            libc::WEXITED,
        )
    };
    // SAFETY: waitid succeeded, so info describes a child's exit.
    (r == 0).then(|| (info.si_code, unsafe { info.si_status() }))
}

/// Reap our child `pid` if it has ended, without waiting: its wait status
/// (`ExitStatus::from_raw`). None while it runs, and (nothing touched) for
/// a pid that is not our child.
pub fn reap_if_ended(pid: u32) -> Option<i32> {
    let mut st = 0;
    // SAFETY: waitpid writes the status int we own.
    let r = unsafe { libc::waitpid(pid as libc::pid_t, &mut st, libc::WNOHANG) };
    (r == pid as libc::pid_t && r > 0).then_some(st)
}

/// Shut down both directions of socket `s` (any family): its peer reads
/// end-of-stream, whoever else holds the descriptor.
pub fn shutdown_socket(s: &impl AsFd) -> io::Result<()> {
    // SAFETY: shutdown on a descriptor the borrow keeps open.
    if unsafe { libc::shutdown(s.as_fd().as_raw_fd(), libc::SHUT_RDWR) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Set priority `nice` for the calling thread (setpriority on its tid).
pub fn set_thread_nice(nice: i32) {
    // SAFETY: setpriority takes integers; who=0 is the calling thread.
    unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, nice) };
}

/// The nice value of process `pid` (getpriority).
pub fn nice_of(pid: u32) -> io::Result<i32> {
    // SAFETY: errno is this thread's; clearing it tells a -1 nice value
    // from a failure. getpriority takes integers only.
    unsafe {
        *libc::__errno_location() = 0;
        let n = libc::getpriority(libc::PRIO_PROCESS, pid as libc::id_t);
        if n == -1 && *libc::__errno_location() != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n)
    }
}

/// Set the nice value of process `pid` (setpriority; lowering it needs root).
pub fn set_nice(pid: u32, nice: i32) -> io::Result<()> {
    // SAFETY: setpriority takes integers only.
    if unsafe { libc::setpriority(libc::PRIO_PROCESS, pid as libc::id_t, nice) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Read `buf.len()` bytes at address `addr` of process `pid`
/// (process_vm_readv): how many arrived (fewer at an unmapped page).
pub fn read_process_memory(pid: u32, addr: u64, buf: &mut [u8]) -> io::Result<usize> {
    let local = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let remote = libc::iovec {
        iov_base: addr as usize as *mut libc::c_void,
        iov_len: buf.len(),
    };
    // SAFETY: `local` is the caller's buffer, its length; the remote range
    // is read by the kernel in the other process, never dereferenced here.
    let got = unsafe { libc::process_vm_readv(pid as libc::pid_t, &local, 1, &remote, 1, 0) };
    if got < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(got as usize)
}

/// This process's effective uid.
pub fn euid() -> u32 {
    // SAFETY: geteuid takes nothing and cannot fail.
    unsafe { libc::geteuid() }
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
