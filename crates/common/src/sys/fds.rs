//! The process's file-descriptor limit.

/// Raise this process's soft limit on open files to `want` (at most the
/// hard limit; never lowered). A daemon holds one descriptor per waiting
/// handshake, session and HTTP connection: the soft limit's usual 1024
/// would let a connection flood push it into EMFILE, where accept fails
/// for everyone. Returns the soft limit now.
pub fn raise_fd_limit(want: u64) -> u64 {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: r is a valid rlimit for getrlimit to fill and setrlimit to read.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) != 0 {
            return 0;
        }
        if r.rlim_cur < want {
            let old = r.rlim_cur;
            r.rlim_cur = r.rlim_max.min(want);
            if libc::setrlimit(libc::RLIMIT_NOFILE, &r) != 0 {
                r.rlim_cur = old;
            }
        }
    }
    r.rlim_cur
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_limit_is_raised_never_lowered() {
        let now = super::raise_fd_limit(0);
        assert!(now > 0);
        assert!(super::raise_fd_limit(now + 1) >= now);
        assert!(super::raise_fd_limit(1) >= now);
    }
}
