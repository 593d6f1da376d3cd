//! The kernel's KSM interface (/sys/kernel/mm/ksm), ksmd's CPU time and the
//! host's memory pressure (/proc/meminfo, PSI).

use crate::error::io;
use crate::Result;
use serde::Serialize;
use std::path::{Path, PathBuf};

/// KSM's sysfs directory.
pub const KSM: &str = "/sys/kernel/mm/ksm";
/// The page size.
pub const PAGE: u64 = pagefleet_units::PAGE_SIZE as u64;

fn knob(name: &str) -> PathBuf {
    Path::new(KSM).join(name)
}

/// Whether this kernel has KSM.
pub fn available() -> Result<()> {
    if !knob("run").exists() {
        return Err(crate::Error::Kernel(format!(
            "this kernel has no KSM ({KSM} is missing: CONFIG_KSM is off)"
        )));
    }
    Ok(())
}

/// Read a KSM sysfs file.
pub fn read(name: &str) -> Result<String> {
    let s = std::fs::read_to_string(knob(name)).map_err(io(format!("cannot read {KSM}/{name}")))?;
    Ok(s.trim().to_string())
}

/// Read a numeric KSM sysfs file.
pub fn read_u64(name: &str) -> Result<u64> {
    read(name)?
        .parse()
        .map_err(|_| crate::Error::Kernel(format!("{KSM}/{name} is not a number")))
}

fn read_i64(name: &str) -> Result<i64> {
    read(name)?
        .parse()
        .map_err(|_| crate::Error::Kernel(format!("{KSM}/{name} is not a number")))
}

/// Write a KSM sysfs file (root).
pub fn write(name: &str, v: &str) -> Result<()> {
    std::fs::write(knob(name), v).map_err(io(format!(
        "cannot write {v} to {KSM}/{name} (root needed)"
    )))
}

/// The selected word of a "[a] b" style knob (advisor_mode).
pub fn selected(name: &str) -> Result<String> {
    let s = read(name)?;
    Ok(s.split_whitespace()
        .find(|w| w.starts_with('['))
        .map(|w| w.trim_matches(|c| c == '[' || c == ']').to_string())
        .unwrap_or(s))
}

/// One reading of the counters.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Stats {
    /// run.
    pub run: u64,
    /// pages_to_scan.
    pub pages_to_scan: u64,
    /// sleep_millisecs.
    pub sleep_millisecs: u64,
    /// pages_shared.
    pub pages_shared: u64,
    /// pages_sharing.
    pub pages_sharing: u64,
    /// pages_unshared.
    pub pages_unshared: u64,
    /// pages_volatile.
    pub pages_volatile: u64,
    /// pages_scanned.
    pub pages_scanned: u64,
    /// full_scans.
    pub full_scans: u64,
    /// general_profit, bytes.
    pub general_profit: i64,
    /// ksm_zero_pages.
    pub ksm_zero_pages: u64,
    /// ksmd's CPU time so far, seconds.
    pub ksmd_cpu: f64,
    /// Time ksmd has spent runnable but waiting for a CPU, seconds.
    pub ksmd_wait: f64,
}

impl Stats {
    /// Read the counters.
    pub fn read() -> Result<Stats> {
        let (cpu, wait) = ksmd_sched()?;
        Ok(Stats {
            run: read_u64("run")?,
            pages_to_scan: read_u64("pages_to_scan")?,
            sleep_millisecs: read_u64("sleep_millisecs")?,
            pages_shared: read_u64("pages_shared")?,
            pages_sharing: read_u64("pages_sharing")?,
            pages_unshared: read_u64("pages_unshared")?,
            pages_volatile: read_u64("pages_volatile")?,
            pages_scanned: read_u64("pages_scanned").unwrap_or(0),
            full_scans: read_u64("full_scans")?,
            general_profit: read_i64("general_profit").unwrap_or(0),
            ksm_zero_pages: read_u64("ksm_zero_pages").unwrap_or(0),
            ksmd_cpu: cpu,
            ksmd_wait: wait,
        })
    }
    /// Memory the merging saves, bytes (sharing sites beyond the first copy).
    pub fn saved(&self) -> u64 {
        (self.pages_sharing + self.ksm_zero_pages) * PAGE
    }
    /// Pages per second ksmd is set to scan (0 when stopped).
    pub fn scan_rate(&self) -> f64 {
        if self.run != 1 {
            return 0.0;
        }
        self.pages_to_scan as f64 * 1000.0 / self.sleep_millisecs.max(1) as f64
    }
}

/// ksmd's CPU time in seconds (schedstat: nanoseconds on the CPU).
pub fn ksmd_cpu() -> Result<f64> {
    Ok(ksmd_sched()?.0)
}

/// ksmd's (time on a CPU, time waiting in a run queue), seconds.
pub fn ksmd_sched() -> Result<(f64, f64)> {
    let pid = ksmd_pid()?;
    let s = std::fs::read_to_string(format!("/proc/{pid}/schedstat"))
        .map_err(io("cannot read ksmd's schedstat"))?;
    let mut w = s.split_whitespace().map(|w| w.parse::<u64>().ok());
    match (w.next().flatten(), w.next().flatten()) {
        (Some(run), Some(wait)) => Ok((run as f64 / 1e9, wait as f64 / 1e9)),
        _ => Err(crate::Error::Kernel(format!(
            "bad schedstat for ksmd: {s:?}"
        ))),
    }
}

/// The kernel starts ksmd at nice 5.
pub const KSMD_DEFAULT_NICE: i32 = 5;

/// ksmd's nice value.
pub fn ksmd_nice() -> Result<i32> {
    let pid = ksmd_pid()?;
    pagefleet_common::sys::process::nice_of(pid)
        .map_err(|e| crate::Error::Kernel(format!("cannot read ksmd's priority: {e}")))
}

/// Set ksmd's nice value (root).
pub fn set_ksmd_nice(n: i32) -> Result<()> {
    let pid = ksmd_pid()?;
    pagefleet_common::sys::process::set_nice(pid, n)
        .map_err(|e| crate::Error::Kernel(format!("cannot set ksmd's priority to {n}: {e}")))
}

fn ksmd_pid() -> Result<u32> {
    use std::sync::OnceLock;
    static PID: OnceLock<u32> = OnceLock::new();
    if let Some(p) = PID.get() {
        return Ok(*p);
    }
    for e in std::fs::read_dir("/proc")
        .map_err(io("cannot list /proc"))?
        .flatten()
    {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if std::fs::read_to_string(format!("/proc/{pid}/comm"))
            .map(|c| c.trim() == "ksmd")
            .unwrap_or(false)
        {
            return Ok(*PID.get_or_init(|| pid));
        }
    }
    Err(crate::Error::Kernel(
        "no ksmd kernel thread found".to_string(),
    ))
}

/// The writable knobs a controller changes, saved to be put back.
#[derive(Clone, Debug, Serialize)]
pub struct Settings {
    /// run.
    pub run: u64,
    /// pages_to_scan.
    pub pages_to_scan: u64,
    /// sleep_millisecs.
    pub sleep_millisecs: u64,
    /// smart_scan, if the kernel has it.
    pub smart_scan: Option<u64>,
    /// advisor_mode, if the kernel has it.
    pub advisor_mode: Option<String>,
    /// ksmd's nice value.
    pub ksmd_nice: Option<i32>,
}

impl Settings {
    /// The settings now (to restore later).
    pub fn save() -> Result<Settings> {
        available()?;
        Ok(Settings {
            run: read_u64("run")?,
            pages_to_scan: read_u64("pages_to_scan")?,
            sleep_millisecs: read_u64("sleep_millisecs")?,
            smart_scan: read_u64("smart_scan").ok(),
            advisor_mode: selected("advisor_mode").ok(),
            ksmd_nice: ksmd_nice().ok(),
        })
    }
    /// Put everything back; `run` last so ksmd never runs with foreign settings.
    pub fn restore(&self) -> Result<()> {
        if let Some(m) = &self.advisor_mode {
            write("advisor_mode", m)?;
        }
        write("pages_to_scan", &self.pages_to_scan.to_string())?;
        write("sleep_millisecs", &self.sleep_millisecs.to_string())?;
        if let Some(s) = self.smart_scan {
            write("smart_scan", &s.to_string())?;
        }
        if let Some(n) = self.ksmd_nice {
            set_ksmd_nice(n)?;
        }
        // run=2 (unmerge everything) is not put back: it would only re-expand memory.
        write("run", &self.run.min(1).to_string())
    }
}

/// What the host's memory looks like (kB values from /proc/meminfo).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Memory {
    /// MemTotal, kB.
    pub total_kb: u64,
    /// MemAvailable, kB.
    pub available_kb: u64,
    /// ksmtuned's "free": MemFree + Buffers + Cached.
    pub free_kb: u64,
    /// PSI memory "some" avg10, percent (None without PSI).
    pub psi_some10: Option<f64>,
    /// Pages swapped in since boot (`pswpin` in /proc/vmstat).
    pub swapped_in_pages: u64,
    /// Swap in use (SwapTotal - SwapFree), kB.
    pub swap_used_kb: u64,
}

impl Memory {
    /// Read /proc/meminfo and PSI.
    pub fn read() -> Result<Memory> {
        let s =
            std::fs::read_to_string("/proc/meminfo").map_err(io("cannot read /proc/meminfo"))?;
        let mut m = Memory::default();
        let (mut swap_total, mut swap_free) = (0, 0);
        for l in s.lines() {
            let mut w = l.split_whitespace();
            let (Some(k), Some(v)) = (w.next(), w.next().and_then(|v| v.parse::<u64>().ok()))
            else {
                continue;
            };
            match k {
                "MemTotal:" => m.total_kb = v,
                "MemAvailable:" => m.available_kb = v,
                "MemFree:" | "Buffers:" | "Cached:" => m.free_kb += v,
                "SwapTotal:" => swap_total = v,
                "SwapFree:" => swap_free = v,
                _ => {}
            }
        }
        m.swap_used_kb = swap_total.saturating_sub(swap_free);
        m.psi_some10 = std::fs::read_to_string("/proc/pressure/memory")
            .ok()
            .and_then(|p| {
                p.lines().find(|l| l.starts_with("some")).and_then(|l| {
                    l.split_whitespace()
                        .find_map(|w| w.strip_prefix("avg10="))
                        .and_then(|v| v.parse().ok())
                })
            });
        m.swapped_in_pages = std::fs::read_to_string("/proc/vmstat")
            .ok()
            .and_then(|v| {
                v.lines()
                    .find_map(|l| l.strip_prefix("pswpin "))
                    .and_then(|x| x.trim().parse().ok())
            })
            .unwrap_or(0);
        Ok(m)
    }
    /// MemAvailable as a share of MemTotal.
    pub fn available_frac(&self) -> f64 {
        self.available_kb as f64 / self.total_kb.max(1) as f64
    }
    /// Pages in swap.
    pub fn swap_used_pages(&self) -> u64 {
        self.swap_used_kb * 1024 / PAGE
    }
}
