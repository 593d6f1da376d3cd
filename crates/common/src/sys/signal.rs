//! Stopping on SIGINT / SIGTERM: long-running commands and daemons end
//! cleanly (controllers put the host's settings back, exports delete their
//! blocks) instead of dying mid-work.

use std::sync::atomic::{AtomicBool, Ordering};

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

/// Make SIGINT and SIGTERM set a flag instead of killing the process; the
/// flag, for loops to poll.
pub fn stop_flag() -> &'static AtomicBool {
    set_handler(libc::SIGINT, on_signal);
    set_handler(libc::SIGTERM, on_signal);
    &STOP
}

static RESTART: AtomicBool = AtomicBool::new(false);

extern "C" fn on_restart(_: libc::c_int) {
    RESTART.store(true, Ordering::Relaxed);
}

/// Make SIGUSR2 set a flag (pagefleetd: restart in place, an upgrade)
/// instead of killing the process; the flag.
pub fn restart_flag() -> &'static AtomicBool {
    set_handler(libc::SIGUSR2, on_restart);
    &RESTART
}

static RELOAD: AtomicBool = AtomicBool::new(false);

extern "C" fn on_reload(_: libc::c_int) {
    RELOAD.store(true, Ordering::Relaxed);
}

/// Make SIGHUP set a flag (pagefleetd: read the configuration again, what
/// `systemctl reload` sends) instead of killing the process; the flag.
pub fn reload_flag() -> &'static AtomicBool {
    set_handler(libc::SIGHUP, on_reload);
    &RELOAD
}

/// SIGINT and SIGTERM, blocked in every thread started after this call,
/// to be waited for with [`TermSignals::wait`].
pub struct TermSignals(SignalSet);

impl TermSignals {
    /// Block both signals (call before starting threads: they inherit the mask).
    pub fn block() -> TermSignals {
        TermSignals(SignalSet::of(&[libc::SIGINT, libc::SIGTERM]).block())
    }

    /// The set of both signals, without changing any thread's mask: for a
    /// thread that waits for them after [`TermSignals::block`] ran.
    pub fn current() -> TermSignals {
        TermSignals(SignalSet::of(&[libc::SIGINT, libc::SIGTERM]))
    }

    /// Wait until one of them arrives.
    pub fn wait(&self) {
        self.0.wait();
    }
}

/// A set of signals to block and wait for (sigwait), rather than handle.
#[derive(Clone, Copy)]
pub struct SignalSet(libc::sigset_t);

impl SignalSet {
    /// The set of `sigs`.
    pub fn of(sigs: &[libc::c_int]) -> SignalSet {
        // SAFETY: a zeroed sigset_t is valid storage for sigemptyset.
        let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: sigemptyset/sigaddset write inside the set we own; an
        // invalid signal number only makes sigaddset fail (EINVAL).
        unsafe {
            libc::sigemptyset(&mut set);
            for &s in sigs {
                libc::sigaddset(&mut set, s);
            }
        }
        SignalSet(set)
    }

    /// Block them in the calling thread (call before starting threads:
    /// they inherit the mask). Returns the set, to wait on.
    pub fn block(self) -> SignalSet {
        // SAFETY: changes the calling thread's mask from a set we own.
        unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &self.0, std::ptr::null_mut()) };
        self
    }

    /// Wait until one of them arrives (blocked in every thread): which, or
    /// None if sigwait fails.
    pub fn wait(&self) -> Option<libc::c_int> {
        let mut sig = 0;
        // SAFETY: sigwait reads the set and writes the int we own.
        (unsafe { libc::sigwait(&self.0, &mut sig) } == 0).then_some(sig)
    }
}

/// Run `handler` on `sig` (signal(2)). The handler may only touch atomics
/// and call async-signal-safe functions such as
/// [`crate::sys::process::exit_now`].
pub fn set_handler(sig: libc::c_int, handler: extern "C" fn(libc::c_int)) {
    // SAFETY: installing a handler; what it may do is its author's contract
    // above (the handlers in this workspace store to atomics or _exit).
    unsafe { libc::signal(sig, handler as *const () as libc::sighandler_t) };
}
