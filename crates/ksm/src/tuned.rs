//! ksmtuned's algorithm, exactly as Debian's /usr/sbin/ksmtuned (Red Hat,
//! 2009) runs it, with the paper's scan-interval factor: every
//! KSM_MONITOR_INTERVAL (60 s × scale) it stops KSM when memory committed to
//! KVM guests plus a threshold fits and free memory is above the threshold;
//! otherwise it boosts pages_to_scan by 300 while free memory is below the
//! threshold and decays it by 50 when not, between 64 and 1250, sleeping
//! 10 ms × 16 GiB / MemTotal (at least 10 ms) between batches.

use crate::sysfs::Memory;
use serde::Serialize;

/// ksmtuned's configuration variables (defaults as in the script).
#[derive(Clone, Debug, Serialize)]
pub struct TunedConfig {
    /// KSM_MONITOR_INTERVAL: seconds between adjustments.
    pub monitor_interval_s: f64,
    /// KSM_NPAGES_BOOST.
    pub npages_boost: i64,
    /// KSM_NPAGES_DECAY.
    pub npages_decay: i64,
    /// KSM_NPAGES_MIN.
    pub npages_min: i64,
    /// KSM_NPAGES_MAX.
    pub npages_max: i64,
    /// KSM_SLEEP_MSEC (per 16 GiB of memory).
    pub sleep_msec: u64,
    /// KSM_THRES_COEF (% of memory).
    pub thres_coef: u64,
    /// KSM_THRES_CONST (kB).
    pub thres_const: u64,
}

impl Default for TunedConfig {
    fn default() -> Self {
        TunedConfig {
            monitor_interval_s: 60.0,
            npages_boost: 300,
            npages_decay: -50,
            npages_min: 64,
            npages_max: 1250,
            sleep_msec: 10,
            thres_coef: 20,
            thres_const: 2048,
        }
    }
}

/// What one `adjust` decides.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Action {
    /// Stop KSM.
    Stop,
    /// Run KSM with these settings.
    Start {
        /// pages_to_scan.
        pages_to_scan: u64,
        /// sleep_millisecs.
        sleep_millisecs: u64,
    },
}

/// Debian's ksmtuned algorithm.
pub struct Tuned {
    /// Its settings.
    pub cfg: TunedConfig,
    npages: i64,
}

impl Tuned {
    /// A ksmtuned as the script starts.
    pub fn new(cfg: TunedConfig) -> Tuned {
        Tuned { cfg, npages: 0 }
    }

    /// The script's `sleep`: integer arithmetic on kB, floor 10.
    pub fn sleep_ms(&self, total_kb: u64) -> u64 {
        let s = self.cfg.sleep_msec * 16 * 1024 * 1024 / total_kb.max(1);
        if s <= 10 {
            10
        } else {
            s
        }
    }

    /// ksmtuned's free-memory threshold, kB.
    pub fn thres_kb(&self, total_kb: u64) -> u64 {
        (total_kb * self.cfg.thres_coef / 100).max(self.cfg.thres_const)
    }

    /// The script's `adjust`, given /proc/meminfo and the RSS (kB) of KVM guests.
    pub fn adjust(&mut self, m: &Memory, committed_kb: u64) -> Action {
        let (total, free) = (m.total_kb, m.free_kb);
        let thres = self.thres_kb(total);
        if committed_kb + thres < total && free > thres {
            return Action::Stop;
        }
        let delta = if free < thres {
            self.cfg.npages_boost
        } else {
            self.cfg.npages_decay
        };
        self.npages = (self.npages + delta).clamp(self.cfg.npages_min, self.cfg.npages_max);
        Action::Start {
            pages_to_scan: self.npages as u64,
            sleep_millisecs: self.sleep_ms(total),
        }
    }
}

/// RSS (kB) of processes whose command line matches ksmtuned's
/// `pgrep -f '^qemu-system.*-enable-kvm'`.
pub fn committed_kb() -> u64 {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let mut sum = 0;
    for e in rd.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let cmd: String = String::from_utf8_lossy(&cmd).replace('\0', " ");
        if !cmd.starts_with("qemu-system") || !cmd["qemu-system".len()..].contains("-enable-kvm") {
            continue;
        }
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        sum += status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap_or(0);
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mem(total_gib: u64, free_gib: f64) -> Memory {
        Memory {
            total_kb: total_gib << 20,
            available_kb: 0,
            free_kb: (free_gib * (1 << 20) as f64) as u64,
            psi_some10: None,
            swapped_in_pages: 0,
            swap_used_kb: 0,
        }
    }

    #[test]
    fn the_scripts_arithmetic() {
        let mut t = Tuned::new(TunedConfig::default());
        // 24 GiB: 10*16GiB/24GiB = 6 ms -> floor 10; 16 GiB -> 10; 4 GiB -> 40.
        assert_eq!(t.sleep_ms(24 << 20), 10);
        assert_eq!(t.sleep_ms(4 << 20), 40);
        assert_eq!(t.thres_kb(24 << 20), (24 << 20) / 5);
        assert_eq!(t.thres_kb(4096), 2048);
        // Plenty free, no guests: stop.
        assert_eq!(t.adjust(&mem(24, 20.0), 0), Action::Stop);
        // Under the threshold: boost from 0 by 300, up to 1250.
        let want = [300, 600, 900, 1200, 1250, 1250];
        for w in want {
            assert_eq!(
                t.adjust(&mem(24, 2.0), 0),
                Action::Start {
                    pages_to_scan: w,
                    sleep_millisecs: 10
                }
            );
        }
        // Guests committed over total - thres but free above it: decay by 50.
        assert_eq!(
            t.adjust(&mem(24, 10.0), 22 << 20),
            Action::Start {
                pages_to_scan: 1200,
                sleep_millisecs: 10
            }
        );
        // Decay stops at 64.
        let mut t = Tuned::new(TunedConfig::default());
        assert_eq!(
            t.adjust(&mem(24, 10.0), 22 << 20),
            Action::Start {
                pages_to_scan: 64,
                sleep_millisecs: 10
            }
        );
    }
}
