//! pagefleetd's TOML configuration on arbitrary text: `FileConfig::parse`
//! and `merge` with no flags, as `pagefleetd --config FILE` runs them at
//! start. No file may panic the daemon; a file that is accepted must give
//! settings the daemon can run with: every duration its controllers derive
//! from the file is representable (a `Duration::from_secs_f64` of NaN, of a
//! negative number or of 1e300 panics), and the KSM and I/O controllers'
//! options check out as they will when the daemon starts them.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pagefleet_daemon::config::{merge, FileConfig, Flags};
use std::time::Duration;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(file) = FileConfig::parse(text) else {
        return;
    };
    let Ok(s) = merge(file, Flags::default()) else {
        return;
    };
    assert!(s.max_conns >= 1);
    assert!(!s.io_timeout.is_zero() && !s.handshake_timeout.is_zero());
    if let Some(k) = &s.ksm {
        k.options(None, false, None)
            .expect("a KSM section merge accepted");
    }
    if let Some(q) = &s.ioqos {
        q.check().expect("an I/O section merge accepted");
        // What the controller turns into durations: its decision interval,
        // the calibration's (half) run, the paper policy's cap interval and
        // cap length.
        for secs in [q.interval, q.calibrate_secs.max(0.5) / 2.0] {
            Duration::try_from_secs_f64(secs).expect("a representable duration");
        }
        if q.policy == "paper" {
            for secs in [q.cap_interval, q.cap_time] {
                Duration::try_from_secs_f64(secs).expect("a representable duration");
            }
        }
    }
});
