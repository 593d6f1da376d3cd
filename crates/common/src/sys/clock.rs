//! Clocks the cost accounting reads.

/// CPU time the calling thread has run, seconds (`CLOCK_THREAD_CPUTIME_ID`):
/// what a piece of work cost, whatever else shared the CPUs meanwhile.
pub fn thread_cpu_secs() -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.tv_sec as f64 + t.tv_nsec as f64 / 1e9
}

/// The monotonic clock now, µs: what `RELOADING=1` carries as
/// `MONOTONIC_USEC` (systemd matches it against the reload it asked for).
pub fn monotonic_usec() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000 + ts.tv_nsec as u64 / 1000
}

#[cfg(test)]
mod tests {
    #[test]
    fn spinning_costs_cpu_and_sleeping_does_not() {
        let t0 = super::thread_cpu_secs();
        std::thread::sleep(std::time::Duration::from_millis(50));
        let t1 = super::thread_cpu_secs();
        assert!(t1 - t0 < 0.02, "sleeping took {} CPU s", t1 - t0);
        let mut x = 0u64;
        while super::thread_cpu_secs() - t1 < 0.01 {
            x = x.wrapping_add(1);
        }
        assert!(x > 0);
    }
}
