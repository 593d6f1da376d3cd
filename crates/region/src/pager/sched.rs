//! The pager's CPU slice. Under EEVDF (Linux 6.6+; custom slices 6.12+) a
//! SCHED_OTHER thread may ask for a shorter slice (`sched_runtime` of
//! `sched_setattr`): at equal weight it gets no more CPU than the guest's
//! threads, but its deadlines come sooner, so when a reply or a fault wakes
//! it, it preempts a running guest thread instead of waiting out that
//! thread's slice — what nice -20 gave without nice -20's weight (which let
//! every single fault preempt and cost the kv guest 4x the CPU per page-in).

/// The slice the pager and the writer ask for.
pub const SLICE: std::time::Duration = std::time::Duration::from_micros(100);

/// [`set_slice`] of [`SLICE`] for the calling thread; a kernel without
/// custom slices (before 6.12) keeps its default, with a debug line.
pub fn ask_for_slice(who: &str) {
    if let Err(e) = set_slice(SLICE) {
        tracing::debug!("{who}: a {SLICE:?} CPU slice: {e}");
    }
}

/// `struct sched_attr` (include/uapi/linux/sched/types.h), version 1.
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

/// Ask for a `slice` of CPU (clamped by the kernel to 0.1–100 ms) for the
/// calling thread, keeping its nice value and policy SCHED_OTHER.
pub fn set_slice(slice: std::time::Duration) -> std::io::Result<()> {
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
        sched_runtime: slice.as_nanos() as u64,
        ..Default::default()
    };
    // SAFETY: sched_setattr reads `attr.size` bytes of a valid struct; pid 0
    // is the calling thread.
    let r = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const SchedAttr, 0) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}
