//! This crate's raw system calls, each behind a function whose `SAFETY:`
//! comments say why the call is sound (the architecture test keeps
//! `libc::` calls in `sys` modules): the merge prctl, and calling it
//! inside another process through ptrace.

/// prctl: make the whole process mergeable.
pub const PR_SET_MEMORY_MERGE: libc::c_int = 67;
/// prctl: whether it is.
pub const PR_GET_MEMORY_MERGE: libc::c_int = 68;
use crate::Result;

/// Mark this process (and what it forks and execs) mergeable.
pub(crate) fn set_memory_merge() -> std::io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(PR_SET_MEMORY_MERGE, 1, 0, 0, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Make process `pid` run `prctl(PR_SET_MEMORY_MERGE, 1)` itself: seize
/// one thread, point it at the `syscall` instruction at `at` in its text,
/// single-step, put every register back, detach. The prctl's return value.
#[cfg(target_arch = "x86_64")]
pub(crate) fn merge_in(pid: u32, at: u64) -> Result<i64> {
    let p = pid as libc::pid_t;
    // SAFETY: PTRACE_SEIZE changes nothing in the tracee by itself.
    if unsafe { libc::ptrace(libc::PTRACE_SEIZE, p, 0, 0) } != 0 {
        return Err(crate::Error::Enroll(format!(
            "cannot attach to process {pid}: {} (root needed; or it is being traced)",
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: p was seized just above; `at` is a syscall instruction in its
    // text (find_syscall_insn read it from the executable mapping).
    let r = unsafe { inject(p, at) };
    // SAFETY: detaching the tracee we seized; it runs on as before.
    unsafe { libc::ptrace(libc::PTRACE_DETACH, p, 0, 0) };
    r
}

/// Wait until tracee `p` stops; its wait status.
#[cfg(target_arch = "x86_64")]
fn wait_stop(p: libc::pid_t) -> Result<libc::c_int> {
    let mut st = 0;
    loop {
        // SAFETY: waitpid writes the status into our local.
        let r = unsafe { libc::waitpid(p, &mut st, libc::__WALL) };
        if r == p {
            break;
        }
        if std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return Err(crate::Error::Enroll(format!(
                "waitpid failed: {}",
                std::io::Error::last_os_error()
            )));
        }
    }
    if !libc::WIFSTOPPED(st) {
        return Err(crate::Error::Enroll(
            "the process exited while being enrolled".to_string(),
        ));
    }
    Ok(st)
}

/// Make tracee `p` run `prctl(PR_SET_MEMORY_MERGE, 1)` once, then put its
/// registers back; the prctl's return value.
///
/// # Safety
/// `p` must be a thread this process seized with `PTRACE_SEIZE`, and `at`
/// the address of a `syscall` instruction in its executable text: the
/// thread is made to execute there.
#[cfg(target_arch = "x86_64")]
unsafe fn inject(p: libc::pid_t, at: u64) -> Result<i64> {
    // SAFETY: ptrace requests on a tracee the caller seized, with register
    // structs we own; the caller guarantees `at` is a syscall instruction,
    // and the saved registers are restored on every path.
    unsafe {
        if libc::ptrace(libc::PTRACE_INTERRUPT, p, 0, 0) != 0 {
            return Err(crate::Error::Enroll(format!(
                "cannot stop the process: {}",
                std::io::Error::last_os_error()
            )));
        }
        // A signal may arrive first: let it through and wait for our stop.
        for _ in 0..16 {
            let st = wait_stop(p)?;
            if (st >> 16) == libc::PTRACE_EVENT_STOP {
                break;
            }
            libc::ptrace(libc::PTRACE_CONT, p, 0, libc::WSTOPSIG(st));
            libc::ptrace(libc::PTRACE_INTERRUPT, p, 0, 0);
        }
        let mut saved: libc::user_regs_struct = std::mem::zeroed();
        if libc::ptrace(libc::PTRACE_GETREGS, p, 0, &mut saved) != 0 {
            return Err(crate::Error::Enroll(format!(
                "cannot read registers: {}",
                std::io::Error::last_os_error()
            )));
        }
        let mut r = saved;
        r.rip = at;
        r.rax = libc::SYS_prctl as u64;
        r.orig_rax = u64::MAX; // not inside a syscall: no restart games
        r.rdi = PR_SET_MEMORY_MERGE as u64;
        r.rsi = 1;
        r.rdx = 0;
        r.r10 = 0;
        r.r8 = 0;
        let result = (|| {
            if libc::ptrace(libc::PTRACE_SETREGS, p, 0, &r) != 0 {
                return Err(crate::Error::Enroll(format!(
                    "cannot set registers: {}",
                    std::io::Error::last_os_error()
                )));
            }
            if libc::ptrace(libc::PTRACE_SINGLESTEP, p, 0, 0) != 0 {
                return Err(crate::Error::Enroll(format!(
                    "cannot single-step: {}",
                    std::io::Error::last_os_error()
                )));
            }
            let st = wait_stop(p)?;
            if libc::WSTOPSIG(st) != libc::SIGTRAP {
                return Err(crate::Error::Enroll(format!(
                    "unexpected stop (signal {}) while enrolling",
                    libc::WSTOPSIG(st)
                )));
            }
            let mut after: libc::user_regs_struct = std::mem::zeroed();
            if libc::ptrace(libc::PTRACE_GETREGS, p, 0, &mut after) != 0 {
                return Err(crate::Error::Enroll(format!(
                    "cannot read registers: {}",
                    std::io::Error::last_os_error()
                )));
            }
            if after.rip != at + 2 {
                return Err(crate::Error::Enroll(format!(
                    "the injected syscall did not run (rip {:#x})",
                    after.rip
                )));
            }
            Ok(after.rax as i64)
        })();
        // Whatever happened, the thread continues exactly where it was.
        libc::ptrace(libc::PTRACE_SETREGS, p, 0, &saved);
        result
    }
}
