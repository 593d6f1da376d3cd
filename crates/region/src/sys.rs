//! Every raw system call of the paging runtime outside `pagefleet_uffd`
//! (which owns userfaultfd, mappings and PAGEMAP_SCAN), each behind one
//! function with its safety argument here.

use std::io;
use std::os::fd::RawFd;

pub(crate) use libc::{MADV_DONTNEED, MADV_NOHUGEPAGE};

/// The calling thread's kernel id.
pub(crate) fn gettid() -> i32 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::gettid() }
}

/// CPU time the calling thread has run, ns.
pub(crate) fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// CPUs online now (at least 1).
pub(crate) fn online_cpus() -> usize {
    // SAFETY: sysconf has no preconditions.
    (unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }).max(1) as usize
}

/// `struct sched_attr` (include/uapi/linux/sched/types.h).
#[repr(C)]
#[derive(Default)]
struct SchedAttr {
    size: u32,
    sched_policy: u32,
    sched_flags: u64,
    sched_nice: i32,
    sched_priority: u32,
    sched_runtime: u64,
    sched_deadline: u64,
    sched_period: u64,
    sched_util_min: u32,
    sched_util_max: u32,
}

/// Ask for a CPU slice of `runtime_ns` (the kernel clamps it to 0.1–100
/// ms; zero: the default) for the calling thread, keeping its nice value
/// and policy SCHED_OTHER.
pub(crate) fn set_sched_runtime(runtime_ns: u64) -> io::Result<()> {
    // SAFETY: getpriority has no memory preconditions; errno is reset first
    // because -1 is a valid nice value.
    let nice = unsafe {
        *libc::__errno_location() = 0;
        libc::getpriority(libc::PRIO_PROCESS, 0)
    };
    let attr = SchedAttr {
        size: std::mem::size_of::<SchedAttr>() as u32,
        sched_policy: libc::SCHED_OTHER as u32,
        sched_nice: nice,
        sched_runtime: runtime_ns,
        ..Default::default()
    };
    // SAFETY: sched_setattr reads `attr.size` bytes of a valid struct; pid 0
    // is the calling thread.
    let r = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const SchedAttr, 0) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The calling thread's slice as the kernel reports it, ns.
#[cfg(test)]
pub(crate) fn sched_runtime() -> io::Result<u64> {
    let mut attr = SchedAttr::default();
    // SAFETY: sched_getattr writes at most `size` bytes into a valid struct
    // of that size; pid 0 is the calling thread.
    let r = unsafe {
        libc::syscall(
            libc::SYS_sched_getattr,
            0,
            &mut attr as *mut SchedAttr,
            std::mem::size_of::<SchedAttr>() as u32,
            0,
        )
    };
    if r == 0 {
        Ok(attr.sched_runtime)
    } else {
        Err(io::Error::last_os_error())
    }
}

/// End a socket's traffic both ways (its fd stays open).
///
/// # Safety
/// `fd` must be an open socket for the whole call (its owner may not close
/// it meanwhile); shutdown does not close or invalidate it.
pub(crate) unsafe fn shutdown(fd: RawFd) {
    // SAFETY: the caller keeps `fd` open; shutdown touches no memory.
    unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
}
