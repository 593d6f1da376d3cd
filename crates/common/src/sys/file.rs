//! File locks.

use std::os::fd::{AsFd, AsRawFd};

/// Take `f`'s exclusive advisory lock without waiting (`flock(LOCK_EX |
/// LOCK_NB)`): false when another open file description holds it. The lock
/// goes with the last descriptor of this open file.
pub fn try_lock_exclusive(f: &impl AsFd) -> bool {
    // SAFETY: flock on a descriptor the caller's borrow keeps open.
    unsafe { libc::flock(f.as_fd().as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}
