//! A loop device and blkio cgroups for the I/O controller's tests.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The cgroup v1 blkio hierarchy.
pub const V1: &str = "/sys/fs/cgroup/blkio";

/// A scratch loop device (direct I/O) and blkio cgroups, removed on drop:
/// the I/O controller's device and tenants in tests.
pub struct IoRig {
    /// The loop device.
    pub dev: String,
    file: PathBuf,
    groups: Vec<PathBuf>,
}

impl IoRig {
    /// A 256 MiB loop device and a blkio cgroup per tenant name (None,
    /// said on stderr, without root, cgroup v1 blkio or fio).
    pub fn new(tag: &str, tenants: &[&str]) -> Option<IoRig> {
        if !crate::is_root()
            || !Path::new(V1)
                .join("blkio.throttle.read_bps_device")
                .exists()
            || pagefleet_lab::proc::which("fio").is_err()
        {
            eprintln!("skipped: needs root, cgroup v1 blkio and fio");
            return None;
        }
        let file = PathBuf::from(format!(
            "/var/tmp/pagefleet-ioqos-{tag}-{}.img",
            std::process::id()
        ));
        let f = std::fs::File::create(&file).unwrap();
        f.set_len(256 << 20).unwrap();
        drop(f);
        let out = Command::new("losetup")
            .args(["--direct-io=on", "-f", "--show"])
            .arg(&file)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "losetup: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let dev = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let mut r = IoRig {
            dev,
            file,
            groups: vec![],
        };
        for t in tenants {
            let g =
                PathBuf::from(V1).join(format!("pagefleet-test-{tag}-{}-{t}", std::process::id()));
            std::fs::create_dir_all(&g).unwrap();
            r.groups.push(g);
        }
        Some(r)
    }

    /// Tenant i's cgroup.
    pub fn group(&self, i: usize) -> &Path {
        &self.groups[i]
    }

    /// fio in tenant i's cgroup: 64 KiB random direct writes, `jobs` processes, for `secs`.
    pub fn fio(&self, i: usize, jobs: u32, secs: u32) -> Child {
        let g = self.group(i).join("cgroup.procs");
        let script = format!(
            "echo $$ > {} && exec fio --name=t{i} --filename={} --rw=randwrite --bs=64k --direct=1 --ioengine=psync --numjobs={jobs} --time_based --runtime={secs} --offset={}M --size=64M --group_reporting --output-format=terse",
            g.display(),
            self.dev,
            i * 64
        );
        Command::new("sh")
            .arg("-c")
            .arg(script)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    }

    /// The throttle rules that actually limit tenant i (the controller's
    /// "unlimited" rule, which keeps v1 counting, is not one).
    pub fn throttle(&self, i: usize) -> String {
        [
            "write_bps_device",
            "write_iops_device",
            "read_bps_device",
            "read_iops_device",
        ]
        .iter()
        .flat_map(|f| {
            std::fs::read_to_string(self.group(i).join(format!("blkio.throttle.{f}")))
                .unwrap_or_default()
                .lines()
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .filter(|l| {
            l.split_whitespace()
                .nth(1)
                .and_then(|v| v.parse::<u64>().ok())
                .is_some_and(|v| v < pagefleet_ioqos::backend::V1_UNLIMITED)
        })
        .collect::<Vec<_>>()
        .join("\n")
    }

    /// Every rule in tenant i's group, "unlimited" ones included.
    pub fn rules(&self, i: usize) -> String {
        [
            "write_bps_device",
            "write_iops_device",
            "read_bps_device",
            "read_iops_device",
        ]
        .iter()
        .map(|f| {
            std::fs::read_to_string(self.group(i).join(format!("blkio.throttle.{f}")))
                .unwrap_or_default()
        })
        .collect::<String>()
    }
}

impl Drop for IoRig {
    fn drop(&mut self) {
        for g in &self.groups {
            // Any process left in it first (fio's job processes outlive a killed parent).
            for _ in 0..50 {
                for pid in std::fs::read_to_string(g.join("cgroup.procs"))
                    .unwrap_or_default()
                    .lines()
                    .filter_map(|l| l.trim().parse::<i32>().ok())
                {
                    let _ = pagefleet_common::sys::process::signal(pid, libc::SIGKILL);
                }
                if std::fs::remove_dir(g).is_ok() || !g.exists() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        let _ = Command::new("losetup").args(["-d", &self.dev]).status();
        let _ = std::fs::remove_file(&self.file);
    }
}
