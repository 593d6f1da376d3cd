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
pub struct TermSignals(libc::sigset_t);

impl TermSignals {
    /// Block both signals (call before starting threads: they inherit the mask).
    pub fn block() -> TermSignals {
        // SAFETY: plain signal-mask calls on a local set.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGINT);
            libc::sigaddset(&mut set, libc::SIGTERM);
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            TermSignals(set)
        }
    }

    /// The set of both signals, without changing any thread's mask: for a
    /// thread that waits for them after [`TermSignals::block`] ran.
    pub fn current() -> TermSignals {
        // SAFETY: plain signal-set calls on a local set.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGINT);
            libc::sigaddset(&mut set, libc::SIGTERM);
            TermSignals(set)
        }
    }

    /// Wait until one of them arrives.
    pub fn wait(&self) {
        let mut sig = 0;
        // SAFETY: waits for signals this set blocked.
        unsafe { libc::sigwait(&self.0, &mut sig) };
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
