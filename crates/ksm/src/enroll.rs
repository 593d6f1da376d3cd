//! Enrolment: making a process's anonymous memory mergeable.
//!
//! A process can ask for itself (prctl PR_SET_MEMORY_MERGE, kept across
//! fork and exec), which is what `pagefleet run --merge -- CMD` does. For a
//! process that is already running there is no outside interface
//! (process_madvise refuses MADV_MERGEABLE), so `enroll_pid` makes the
//! process call that prctl itself: it stops one thread with ptrace, points
//! it at a `syscall` instruction already in its code, single-steps the
//! prctl, and puts every register back (the way a debugger calls a function
//! in its inferior). The flag covers the whole address space and every
//! thread.

use crate::error::io;
use crate::Result;
use std::path::Path;

/// prctl: make the whole process mergeable.
pub const PR_SET_MEMORY_MERGE: libc::c_int = 67;
/// prctl: whether it is.
pub const PR_GET_MEMORY_MERGE: libc::c_int = 68;

/// Mark this process (and what it forks and execs) mergeable.
pub fn merge_self() -> Result<()> {
    // SAFETY: plain prctl.
    let r = unsafe { libc::prctl(PR_SET_MEMORY_MERGE, 1, 0, 0, 0) };
    if r != 0 {
        return Err(crate::Error::Enroll(format!(
            "prctl(PR_SET_MEMORY_MERGE) failed: {} (needs Linux 6.4+ with KSM)",
            std::io::Error::last_os_error()
        )));
    }
    Ok(())
}

/// Whether a process is enrolled (/proc/PID/status "ksm_merge_any" or ksm_stat).
pub fn is_enrolled(pid: u32) -> Result<bool> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/ksm_stat")).map_err(io(format!(
        "cannot read /proc/{pid}/ksm_stat (no such process, or not root)"
    )))?;
    Ok(s.lines().any(|l| l.trim() == "ksm_merge_any: yes"))
}

/// Mark a running process mergeable from outside (root or CAP_SYS_PTRACE).
#[cfg(target_arch = "x86_64")]
pub fn enroll_pid(pid: u32) -> Result<()> {
    if pid == std::process::id() {
        return merge_self();
    }
    if !Path::new(&format!("/proc/{pid}")).exists() {
        return Err(crate::Error::Enroll(format!("no such process: {pid}")));
    }
    if is_enrolled(pid)? {
        return Ok(());
    }
    let at = find_syscall_insn(pid)?;
    let p = pid as libc::pid_t;
    // SAFETY: ptrace on another process; every path below detaches.
    unsafe {
        if libc::ptrace(libc::PTRACE_SEIZE, p, 0, 0) != 0 {
            return Err(crate::Error::Enroll(format!(
                "cannot attach to process {pid}: {} (root needed; or it is being traced)",
                std::io::Error::last_os_error()
            )));
        }
        let r = inject(p, at);
        libc::ptrace(libc::PTRACE_DETACH, p, 0, 0);
        let ret = r?;
        if ret != 0 {
            return Err(crate::Error::Enroll(format!(
                "process {pid}: prctl(PR_SET_MEMORY_MERGE) returned {}",
                std::io::Error::from_raw_os_error((-ret) as i32)
            )));
        }
    }
    Ok(())
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

/// Address of a `syscall` instruction (0f 05) in an executable mapping of the process.
fn find_syscall_insn(pid: u32) -> Result<u64> {
    use std::io::{Read, Seek, SeekFrom};
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .map_err(io(format!("no process {pid}")))?;
    let mut mem = std::fs::File::open(format!("/proc/{pid}/mem")).map_err(io(format!(
        "cannot read process {pid}'s memory (root needed)"
    )))?;
    // The vDSO first (always there, tiny), then any executable mapping.
    let mut maps: Vec<&str> = maps
        .lines()
        .filter(|l| l.split_whitespace().nth(1).is_some_and(|p| p.contains('x')))
        .collect();
    maps.sort_by_key(|l| !l.ends_with("[vdso]"));
    for l in maps {
        let range = l.split_whitespace().next().unwrap_or("");
        let Some((a, b)) = range.split_once('-') else {
            continue;
        };
        let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) else {
            continue;
        };
        let len = (b - a).min(4 << 20) as usize;
        let mut buf = vec![0u8; len];
        if mem.seek(SeekFrom::Start(a)).is_err() || mem.read_exact(&mut buf).is_err() {
            continue;
        }
        if let Some(i) = buf.windows(2).position(|w| w == [0x0f, 0x05]) {
            return Ok(a + i as u64);
        }
    }
    Err(crate::Error::Enroll(format!(
        "process {pid} has no syscall instruction in its code (is it a kernel thread?)"
    )))
}

/// Enrol every process of a cgroup (a directory with cgroup.procs, v1 or v2).
/// Returns the pids enrolled; processes that vanish meanwhile are skipped.
pub fn enroll_cgroup(dir: &Path) -> Result<Vec<u32>> {
    let procs = dir.join("cgroup.procs");
    let s = std::fs::read_to_string(&procs).map_err(io(format!(
        "{} is not a cgroup (no cgroup.procs)",
        dir.display()
    )))?;
    let mut done = Vec::new();
    for pid in s.lines().filter_map(|l| l.trim().parse::<u32>().ok()) {
        match enroll_pid(pid) {
            Ok(()) => done.push(pid),
            Err(e) if !Path::new(&format!("/proc/{pid}")).exists() => {
                tracing::debug!("process {pid} left: {e}")
            }
            Err(e) => {
                return Err(crate::Error::Enroll(format!(
                    "enrolling process {pid} of {}: {e}",
                    dir.display()
                )))
            }
        }
    }
    Ok(done)
}
