//! The fault loop's spin for a faulting page's reply.
//!
//! After a faulting page's GET goes out, the fault loop may poll (not
//! sleep) until its reply is in or `Config::reply_spin` has passed — while
//! the host has idle CPUs, and only if such replies usually come within
//! the spin. Sleeping through the wait costs a wake-up on the reply's
//! arrival: on this machine's virtual CPUs, an idle one halts and is woken
//! by the hypervisor, 20–40 µs a time (Fastswap polls for the faulting
//! page's completion the same way and takes prefetched pages by
//! interrupt). Spinning only pays on a host with idle CPUs: on an
//! oversubscribed one it takes the CPU the server or a guest needs.
//!
//! [`ReplySpin`] owns that decision; the host's load comes in as a number,
//! so it is tested without a kernel.

use std::time::{Duration, Instant};

/// How often the host's run queue is read (/proc/loadavg).
const HOST_CHECK: Duration = Duration::from_millis(100);

/// Weight of one reply in the moving average of reply times.
const EWMA_WEIGHT: f64 = 1.0 / 16.0;

pub(super) struct ReplySpin {
    /// The longest spin (`Config::reply_spin`; zero: never).
    spin: Duration,
    /// The host had idle CPUs when last looked at, and when.
    host_idle: bool,
    checked: Option<Instant>,
    /// Spin until then (a faulting page's reply is due).
    until: Option<Instant>,
    /// How long faulting pages' replies take, µs (moving average).
    reply_us: f64,
}

impl ReplySpin {
    pub fn new(spin: Duration) -> Self {
        ReplySpin {
            spin,
            host_idle: true,
            checked: None,
            until: None,
            reply_us: 0.0,
        }
    }

    /// A faulting page's reply took `us`.
    pub fn replied(&mut self, us: f64) {
        self.reply_us += (us - self.reply_us) * EWMA_WEIGHT;
    }

    /// The loop's turn: `runnable_per_cpu` reads the host's load when it
    /// is time to look again (every [`HOST_CHECK`], off the fault path).
    pub fn look_at_host(&mut self, now: Instant, runnable_per_cpu: impl FnOnce() -> f64) {
        if self
            .checked
            .is_none_or(|t| now.saturating_duration_since(t) >= HOST_CHECK)
        {
            self.host_idle = runnable_per_cpu() <= 1.0;
            self.checked = Some(now);
        }
    }

    /// A faulting page's GET went out at `sent`.
    pub fn sent(&mut self, sent: Instant) {
        if self.host_idle && !self.spin.is_zero() && self.reply_us <= self.spin.as_secs_f64() * 1e6
        {
            self.until = Some(sent + self.spin);
        }
    }

    /// Whether the loop should poll now; `waiting`: some GET is in flight.
    pub fn spinning(&mut self, now: Instant, waiting: bool) -> bool {
        let Some(until) = self.until else {
            return false;
        };
        if !waiting || now >= until {
            self.until = None;
            return false;
        }
        true
    }
}

/// Runnable threads per CPU right now (at least 1), from /proc/loadavg.
pub(super) fn runqueue_factor() -> f64 {
    let Ok(s) = std::fs::read_to_string("/proc/loadavg") else {
        return 1.0;
    };
    let running = s
        .split_whitespace()
        .nth(3)
        .and_then(|f| f.split('/').next())
        .and_then(|r| r.parse::<f64>().ok());
    let cpus = crate::sys::online_cpus() as f64;
    running.map_or(1.0, |r| (r / cpus).max(1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn spins_until_the_reply_is_due_or_in() {
        let t0 = Instant::now();
        let mut s = ReplySpin::new(US * 50);
        s.look_at_host(t0, || 1.0);
        s.sent(t0);
        assert!(s.spinning(t0 + US * 10, true));
        assert!(!s.spinning(t0 + US * 10, false), "the reply came");
        s.look_at_host(t0, || 1.0);
        s.sent(t0);
        assert!(!s.spinning(t0 + US * 50, true), "the spin ran out");
        assert!(!s.spinning(t0 + US * 10, true), "and stays off");
    }

    #[test]
    fn a_busy_host_or_slow_replies_do_not_spin() {
        let t0 = Instant::now();
        let mut busy = ReplySpin::new(US * 50);
        busy.look_at_host(t0, || 1.5);
        busy.sent(t0);
        assert!(!busy.spinning(t0, true));
        // The load is read again only after HOST_CHECK.
        busy.look_at_host(t0 + US, || 1.0);
        busy.sent(t0 + US);
        assert!(!busy.spinning(t0 + US, true));
        busy.look_at_host(t0 + HOST_CHECK, || 1.0);
        busy.sent(t0 + HOST_CHECK);
        assert!(busy.spinning(t0 + HOST_CHECK, true));

        let mut slow = ReplySpin::new(US * 50);
        for _ in 0..64 {
            slow.replied(200.0);
        }
        slow.look_at_host(t0, || 1.0);
        slow.sent(t0);
        assert!(!slow.spinning(t0, true));

        let mut off = ReplySpin::new(Duration::ZERO);
        off.look_at_host(t0, || 1.0);
        off.sent(t0);
        assert!(!off.spinning(t0, true));
    }
}
