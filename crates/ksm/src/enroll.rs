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

pub use crate::sys::{PR_GET_MEMORY_MERGE, PR_SET_MEMORY_MERGE};

/// Mark this process (and what it forks and execs) mergeable.
pub fn merge_self() -> Result<()> {
    crate::sys::set_memory_merge().map_err(|e| {
        crate::Error::Enroll(format!(
            "prctl(PR_SET_MEMORY_MERGE) failed: {e} (needs Linux 6.4+ with KSM)"
        ))
    })
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
    let ret = crate::sys::merge_in(pid, at)?;
    if ret != 0 {
        return Err(crate::Error::Enroll(format!(
            "process {pid}: prctl(PR_SET_MEMORY_MERGE) returned {}",
            std::io::Error::from_raw_os_error((-ret) as i32)
        )));
    }
    Ok(())
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
