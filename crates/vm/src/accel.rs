//! Which accelerator a VM runs on: KVM where it works, TCG otherwise, and
//! the reason said.
//!
//! "Where it works" is found by booting, not by opening `/dev/kvm`: on
//! this project's machines `/dev/kvm` opens, `KVM_GET_API_VERSION` says
//! 12, SeaBIOS runs and even a payload that enters long mode and writes to
//! a debug port passes — yet a Linux kernel hangs after its real-mode setup
//! (the host's KVM runs only PVM guests). So the probe boots a real Linux
//! kernel with KVM and no root file system, and KVM works when that kernel
//! reaches its panic ("VFS: Unable to mount root") within [`PROBE_SECS`]:
//! QEMU, started `-no-reboot` with `panic=-1`, then exits by itself.
//!
//! The probe kernel: `PAGEFLEET_KVM_PROBE_KERNEL`, else the host's own
//! (`/boot/vmlinuz-$(uname -r)`, `/boot/vmlinuz`), else the VM's own
//! kernel when it has one. The answer is kept for the host in
//! [`CACHE_FILE`] (keyed by the host kernel's release, QEMU's binary and the
//! probe kernel), so one probe serves every VM the host starts until one
//! of them changes. `PAGEFLEET_ACCEL=kvm|tcg` on the host skips the probe.
//!
//! A migrated VM runs on what the destination chooses: hosts of one
//! cluster choose alike when they are alike; a migration between a KVM
//! and a TCG host fails at QEMU's device state and the VM stays on the
//! source (the abort path).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A VM's accelerator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accel {
    /// Hardware virtualization.
    Kvm,
    /// QEMU's translator.
    Tcg,
}

impl Accel {
    /// QEMU's `-accel` value.
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

/// What was chosen, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Choice {
    /// The accelerator.
    pub accel: Accel,
    /// Why (for the log and `guest status`).
    pub why: String,
}

/// Seconds a probe kernel has to reach its panic under KVM (a kernel under
/// working KVM takes 1–3 s).
pub const PROBE_SECS: u64 = 20;

/// Where a host keeps its probe's answer.
pub const CACHE_FILE: &str = "/run/pagefleet/kvm-probe";

/// The accelerator for a VM whose own kernel (if any) is `vm_kernel`.
pub fn choose(vm_kernel: Option<&Path>) -> Choice {
    match std::env::var("PAGEFLEET_ACCEL").as_deref() {
        Ok("kvm") => {
            return Choice {
                accel: Accel::Kvm,
                why: "PAGEFLEET_ACCEL=kvm".into(),
            }
        }
        Ok("tcg") => {
            return Choice {
                accel: Accel::Tcg,
                why: "PAGEFLEET_ACCEL=tcg".into(),
            }
        }
        _ => {}
    }
    if let Err(why) = kvm_device() {
        return Choice {
            accel: Accel::Tcg,
            why,
        };
    }
    let Some(kernel) = probe_kernel(vm_kernel) else {
        return Choice {
            accel: Accel::Tcg,
            why: "no kernel to probe KVM with (set PAGEFLEET_KVM_PROBE_KERNEL, or PAGEFLEET_ACCEL=kvm)".into(),
        };
    };
    // One probe at a time in this process; the file serves the others.
    static ONE: Mutex<()> = Mutex::new(());
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let key = cache_key(&kernel);
    if let Some(c) = read_cache(Path::new(CACHE_FILE), &key) {
        return c;
    }
    let c = match probe(&crate::process::qemu_binary(), &kernel, Accel::Kvm) {
        Ok(secs) => Choice {
            accel: Accel::Kvm,
            why: format!("KVM booted {} in {secs:.1} s", kernel.display()),
        },
        Err(e) => Choice {
            accel: Accel::Tcg,
            why: format!("KVM is present but did not boot {}: {e}", kernel.display()),
        },
    };
    write_cache(Path::new(CACHE_FILE), &key, &c);
    c
}

/// `/dev/kvm` opens and speaks the stable API.
fn kvm_device() -> Result<(), String> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .map_err(|e| format!("no KVM (/dev/kvm: {e})"))?;
    let v = crate::sys::kvm_api_version(&f);
    if v != 12 {
        return Err(format!("no KVM (/dev/kvm API version {v}, not 12)"));
    }
    Ok(())
}

/// The kernel to probe with (see the module's docs).
fn probe_kernel(vm_kernel: Option<&Path>) -> Option<PathBuf> {
    if let Some(k) = std::env::var_os("PAGEFLEET_KVM_PROBE_KERNEL") {
        return Some(PathBuf::from(k));
    }
    let release = host_release();
    [
        PathBuf::from(format!("/boot/vmlinuz-{release}")),
        PathBuf::from("/boot/vmlinuz"),
    ]
    .into_iter()
    .chain(vm_kernel.map(Path::to_path_buf))
    .find(|p| p.is_file())
}

fn host_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// What the probe's answer depends on.
fn cache_key(kernel: &Path) -> String {
    let stamp = |p: &Path| {
        std::fs::metadata(p)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| d.as_secs())
            .unwrap_or(0)
    };
    let qemu = crate::process::qemu_binary();
    let qemu_real = which(&qemu).unwrap_or(qemu);
    format!(
        "host={} qemu={}@{} kernel={}@{}",
        host_release(),
        qemu_real.display(),
        stamp(&qemu_real),
        kernel.display(),
        stamp(kernel)
    )
}

fn which(p: &Path) -> Option<PathBuf> {
    if p.components().count() > 1 {
        return Some(p.to_path_buf());
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(p))
        .find(|c| c.is_file())
}

/// The cached answer for `key`, if the file holds one.
fn read_cache(file: &Path, key: &str) -> Option<Choice> {
    let s = std::fs::read_to_string(file).ok()?;
    let mut lines = s.lines();
    if lines.next()? != key {
        return None;
    }
    let (accel, why) = lines.next()?.split_once(' ')?;
    let accel = match accel {
        "kvm" => Accel::Kvm,
        "tcg" => Accel::Tcg,
        _ => return None,
    };
    Some(Choice {
        accel,
        why: format!("{why} (probed earlier: {})", file.display()),
    })
}

fn write_cache(file: &Path, key: &str, c: &Choice) {
    let Some(dir) = file.parent() else { return };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let tmp = file.with_extension(format!("tmp{}", std::process::id()));
    let body = format!("{key}\n{} {}\n", c.accel.as_str(), c.why);
    if std::fs::write(&tmp, body).is_ok() {
        let _ = std::fs::rename(&tmp, file);
    }
}

/// Boot `kernel` (no initramfs, no root) with `accel` and wait for its
/// panic: QEMU exits by itself (`-no-reboot`, `panic=-1`) after the kernel
/// printed its banner. Seconds it took, or why it did not.
pub fn probe(qemu: &Path, kernel: &Path, accel: Accel) -> Result<f64, String> {
    let t0 = Instant::now();
    let mut child = Command::new(qemu)
        .args(["-accel", accel.as_str(), "-machine", "pc", "-m", "128"])
        .args(["-nodefaults", "-no-user-config", "-display", "none"])
        .args(["-serial", "stdio", "-no-reboot", "-kernel"])
        .arg(kernel)
        .args(["-append", "console=ttyS0 panic=-1 root=/dev/null"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{}: {e}", qemu.display()))?;
    let limit = Duration::from_secs(PROBE_SECS);
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Some(s),
            Ok(None) if t0.elapsed() < limit => std::thread::sleep(Duration::from_millis(50)),
            _ => break None,
        }
    };
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let mut out = String::new();
    if let Some(mut o) = child.stdout.take() {
        let _ = o.read_to_string(&mut out);
    }
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    let booted = out.contains("Linux version") && out.contains("Kernel panic");
    match status {
        Some(_) if booted => Ok(t0.elapsed().as_secs_f64()),
        Some(s) => Err(format!(
            "QEMU exited ({s}) before the kernel's panic{}",
            said(&err)
        )),
        None => Err(format!(
            "no panic within {PROBE_SECS} s (last console line: {:?}){}",
            out.lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or(""),
            said(&err)
        )),
    }
}

fn said(err: &str) -> String {
    match err.lines().rev().find(|l| !l.trim().is_empty()) {
        Some(l) => format!("; QEMU said: {l}"),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cached_answer_is_used_only_for_its_key() {
        let dir = std::env::temp_dir().join(format!("pf-accel-{}", std::process::id()));
        let file = dir.join("kvm-probe");
        let c = Choice {
            accel: Accel::Kvm,
            why: "KVM booted /k in 1.2 s".into(),
        };
        write_cache(&file, "host=a qemu=b@1 kernel=c@2", &c);
        let got = read_cache(&file, "host=a qemu=b@1 kernel=c@2").expect("cached");
        assert_eq!(got.accel, Accel::Kvm);
        assert!(
            got.why
                .starts_with("KVM booted /k in 1.2 s (probed earlier"),
            "{got:?}"
        );
        assert_eq!(read_cache(&file, "host=a qemu=b@1 kernel=c@3"), None);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
