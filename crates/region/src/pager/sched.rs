//! The pager's CPU slice. Under EEVDF (Linux 6.6+; custom slices 6.12+) a
//! SCHED_OTHER thread may ask for a shorter slice (`sched_runtime` of
//! `sched_setattr`): at equal weight it gets no more CPU than the guest's
//! threads, but its deadlines come sooner, so when a reply or a fault wakes
//! it, it preempts a running guest thread instead of waiting out that
//! thread's slice — what nice -20 gave without nice -20's weight (which let
//! every single fault preempt and cost the kv guest 4x the CPU per page-in).

/// The short slice the pager asks for while it serves a scan.
pub const SLICE: std::time::Duration = std::time::Duration::from_micros(100);

/// How long after the last stream-sized fault the short slice is kept.
const LINGER: std::time::Duration = std::time::Duration::from_millis(100);

/// The pager's slice follows what it serves. A scan waits on one page-in
/// after another, so a reply that preempts the running guest thread at
/// once is throughput (sequential scan at 25%: 0.91 GB/s with the default
/// slice, 1.14 GB/s with the short one, 2026-11-25). Random faults from
/// many guest threads are not: there the preemptions cost the guest more
/// than the earlier service gives (kv at 50% in the same rounds: +2.0% and
/// +2.6% without the short slice, 2026-11-28). So the short slice is asked
/// for while read-ahead follows a stream and given back [`LINGER`] after.
pub struct SliceSwitch {
    short: bool,
    last_stream: std::time::Instant,
}

impl Default for SliceSwitch {
    fn default() -> Self {
        SliceSwitch {
            short: false,
            last_stream: std::time::Instant::now(),
        }
    }
}

impl SliceSwitch {
    /// A fault brought a stream's window: keep (or take) the short slice.
    pub fn streaming(&mut self) {
        self.last_stream = std::time::Instant::now();
        if !self.short {
            self.short = true;
            if let Err(e) = set_slice(SLICE) {
                tracing::debug!("pager: a {SLICE:?} CPU slice: {e}");
            }
        }
    }

    /// Give the short slice back once no stream was served for a while.
    pub fn tick(&mut self) {
        if self.short && self.last_stream.elapsed() > LINGER {
            self.short = false;
            // A runtime of 0 is the default slice again.
            let _ = set_slice(std::time::Duration::ZERO);
        }
    }
}

/// `struct sched_attr` (include/uapi/linux/sched/types.h), version 1.
/// Ask for a `slice` of CPU (clamped by the kernel to 0.1–100 ms; zero: the
/// default slice) for the calling thread, keeping its nice value and policy
/// SCHED_OTHER.
pub fn set_slice(slice: std::time::Duration) -> std::io::Result<()> {
    crate::sys::set_sched_runtime(slice.as_nanos() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// The calling thread's slice as the kernel reports it (`sched_getattr`).
    fn slice_now() -> Duration {
        Duration::from_nanos(crate::sys::sched_runtime().expect("sched_getattr"))
    }

    #[test]
    fn the_short_slice_is_taken_for_a_stream_and_given_back() {
        // A thread of its own: the slice is per thread.
        std::thread::spawn(|| {
            let default = slice_now();
            let mut s = SliceSwitch::default();
            s.tick();
            assert_eq!(slice_now(), default, "no stream yet: the default slice");
            s.streaming();
            if set_slice(SLICE).is_err() {
                eprintln!("this kernel has no custom slices (before 6.12): nothing to check");
                return;
            }
            assert_eq!(slice_now(), SLICE, "a stream: the short slice");
            s.tick();
            assert_eq!(slice_now(), SLICE, "kept within LINGER");
            std::thread::sleep(LINGER + Duration::from_millis(50));
            s.tick();
            assert_eq!(slice_now(), default, "given back after LINGER");
        })
        .join()
        .unwrap();
    }
}
