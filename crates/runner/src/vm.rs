//! VM guests in the runner: QEMU started on the region's memfd, the
//! region made on the mapping QEMU hands over, QMP for pause and resume,
//! vmwork's console reports as the guest's operations.

use crate::RunnerError;
use pagefleet_api::guest::VmStatus;
use pagefleet_api::Workload;
use pagefleet_region::{Adopt, Config, Region};
use pagefleet_vm::{Disk, Forward, Nic, Vm, VmSpec};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// A VM guest's QEMU and the private directory of its sockets.
pub struct VmGuest {
    /// The QEMU process.
    pub vm: Vm,
    dir: PathBuf,
    operator_qmp: Option<String>,
    /// The operator socket's inode as this QEMU made it: a guest of the
    /// same name started here after this one left has its own.
    operator_qmp_ino: Option<u64>,
}

impl VmGuest {
    fn remove_sockets(&self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        if let (Some(q), Some(ino)) = (&self.operator_qmp, self.operator_qmp_ino) {
            use std::os::unix::fs::MetadataExt;
            if std::fs::symlink_metadata(q).is_ok_and(|m| m.ino() == ino) {
                let _ = std::fs::remove_file(q);
            }
        }
    }
}

impl Drop for VmGuest {
    fn drop(&mut self) {
        // QEMU first: once the region is gone nobody serves its faults.
        self.vm.shutdown(Duration::from_secs(3));
        self.remove_sockets();
    }
}

/// The QEMU spec of a `Workload::Vm` (None for other workloads); a hosted
/// VM's operator QMP socket goes beside its control socket. A disk whose
/// format the spec does not record is detected from its header (the host
/// daemon records it when the guest starts, so a migrated VM's disks are
/// never probed again). A NIC goes on `bridge`, this host's VM bridge.
pub fn spec_of(
    w: &Workload,
    size: u64,
    name: &str,
    control: Option<&std::path::Path>,
    bridge: Option<&str>,
) -> Result<Option<VmSpec>, pagefleet_vm::VmError> {
    let Workload::Vm {
        kernel,
        initrd,
        append,
        smp,
        listen,
        guest_port,
        nic,
        machine,
        firmware,
        ..
    } = w
    else {
        return Ok(None);
    };
    let nic = match (nic, bridge) {
        (None, _) => None,
        (Some(_), None) => {
            return Err(pagefleet_vm::VmError::Invalid(
                "the VM asks for a NIC on the bridge, and this host has no VM bridge (pagefleetd --vm-bridge BR, or [guests] vm_bridge)".into(),
            ))
        }
        (Some(n), Some(b)) => Some(Nic {
            bridge: b.to_string(),
            mac: n.mac.unwrap_or_else(|| pagefleet_api::MacAddr::for_guest(name)),
        }),
    };
    let disks = w
        .vm_disks()
        .iter()
        .map(Disk::resolve)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Some(VmSpec {
        kernel: kernel.as_ref().map(PathBuf::from),
        initrd: initrd.as_ref().map(PathBuf::from),
        append: append.clone(),
        disks,
        smp: *smp,
        machine: *machine,
        // Validated with the spec (GuestSpec::validate).
        forward: listen
            .as_ref()
            .and_then(|l| l.parse().ok())
            .map(|listen| Forward {
                listen,
                port: *guest_port,
            }),
        nic,
        guest_config: guest_settings(w, name),
        size,
        name: name.to_string(),
        operator_qmp: control.map(|c| c.with_extension("qmp")),
        firmware: pagefleet_vm::firmware::Firmware::of(firmware),
    }))
}

/// The line a VM reads at boot (`opt/org.pagefleet/guest`): `host=NAME`
/// (the guest's name as a host name), the NIC's `ip=` and `gw=`, then the
/// spec's own `guest_config` words (which may override them: the guest
/// reads left to right).
fn guest_settings(w: &Workload, name: &str) -> String {
    let Workload::Vm {
        nic, guest_config, ..
    } = w
    else {
        return String::new();
    };
    let host: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .take(63)
        .collect();
    let host = host.trim_start_matches('-');
    let mut words: Vec<String> = (!host.is_empty())
        .then(|| format!("host={host}"))
        .into_iter()
        .collect();
    if let Some(n) = nic {
        words.extend(n.ip.map(|ip| format!("ip={ip}")));
        words.extend(n.gw.map(|g| format!("gw={g}")));
    }
    if !guest_config.is_empty() {
        words.push(guest_config.clone());
    }
    words.join(" ")
}

/// Where a VM's sockets go: beside the runner's control socket
/// (`GUESTDIR/NAME.vm`, removed by the host daemon when the runner exits,
/// however it ends), or a temporary directory for `pagefleet run vm`.
pub fn socket_dir(control: Option<&std::path::Path>, name: &str) -> PathBuf {
    match control {
        // One per runner: a runner retiring after its guest migrated away
        // must not remove the directory of a same-named guest started here
        // since.
        Some(c) => c.with_extension(format!("{}.vm", std::process::id())),
        None => std::env::temp_dir().join(format!(
            "pagefleet-vm-{}-{}",
            std::process::id(),
            name.chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                .collect::<String>()
        )),
    }
}

fn private_dir(dir: &std::path::Path) -> Result<PathBuf, RunnerError> {
    let dir = dir.to_path_buf();
    std::fs::create_dir_all(&dir).map_err(|e| RunnerError::io(dir.display().to_string(), e))?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| RunnerError::io("VM socket directory", e))?;
    Ok(dir)
}

/// Start QEMU on a fresh memfd and the region that pages its RAM under
/// `cfg`'s budget.
pub fn boot(
    mut cfg: Config,
    spec: &VmSpec,
    dir: &std::path::Path,
) -> Result<(Region, Arc<VmGuest>), RunnerError> {
    // The guest's first start here: its missing overlays and UEFI
    // variable store are made now (never for an incoming migration: those
    // files are the source's).
    if pagefleet_vm::firmware::ensure_vars(&spec.firmware)
        .map_err(|e| RunnerError::Invalid(e.to_string()))?
    {
        tracing::info!("made the VM's UEFI variable store from OVMF's template");
    }
    for d in &spec.disks {
        if pagefleet_vm::overlay::ensure(d).map_err(|e| RunnerError::Invalid(e.to_string()))? {
            tracing::info!(
                "made overlay {} over {}",
                d.overlay
                    .as_deref()
                    .unwrap_or(std::path::Path::new("?"))
                    .display(),
                d.path.display()
            );
        }
    }
    let adopt = Arc::new(
        Adopt::create(&format!("pagefleet-vm-{}", spec.name), spec.size)
            .map_err(|e| RunnerError::io("guest memory", e))?,
    );
    let (guest, foreign) = start_qemu(spec, &adopt.memfd, false, dir)?;
    vm_sampling_costs(&mut cfg);
    cfg.adopt = Some(adopt);
    cfg.foreign = Some(Arc::new(foreign));
    let region = Region::new(cfg)?;
    guest.vm.release().map_err(vm_err)?;
    guest.vm.connect_qmp().map_err(vm_err)?;
    guest.vm.forward(true, FORWARD_PATIENCE).map_err(vm_err)?;
    Ok((region, guest))
}

/// The sampler's cost model for a VM's memory. Its unmaps go through the
/// shim's agent and hit a vCPU thread that never sleeps (TCG), and every
/// page it then touches faults in QEMU: the native figures (10 µs per
/// touched page, 200 µs per unmap) let a 2% budget take 63% of a writing
/// VM's throughput after a split (bench vm-migration, 2026-11-25); a
/// quarter of that sampling rate cost it 1%. Charged 4x: the same budget
/// then allows a quarter of the events.
fn vm_sampling_costs(cfg: &mut Config) {
    cfg.minor_fault_cost *= 4;
    cfg.zap_cost *= 4;
}

/// How long a VM's service address may take to become bindable here (it
/// may still be moving from the host the VM left).
const FORWARD_PATIENCE: Duration = Duration::from_secs(2);

fn vm_err(e: pagefleet_vm::VmError) -> RunnerError {
    RunnerError::Invalid(format!("VM: {e}"))
}

/// A migration's destination: QEMU started during pre-copy on the memfd
/// being filled, waiting for its device state (`-incoming defer`), and let
/// on through its RAM `mmap` at once so its start-up is off the downtime
/// (it does not touch guest RAM before the device state; a fault it took
/// would wait for the region). [`attach`] makes the region at commit.
pub fn start_incoming(
    spec: &VmSpec,
    memfd: &std::os::fd::OwnedFd,
    dir: &std::path::Path,
) -> Result<(Arc<VmGuest>, pagefleet_region::Foreign), RunnerError> {
    let (g, f) = start_qemu(spec, memfd, true, dir)?;
    g.vm.release().map_err(vm_err)?;
    Ok((g, f))
}

/// The region of an incoming VM (its memfd is `cfg.adopt`'s), then QMP.
pub fn attach(
    mut cfg: Config,
    guest: &Arc<VmGuest>,
    foreign: pagefleet_region::Foreign,
) -> Result<Region, RunnerError> {
    cfg.foreign = Some(Arc::new(foreign));
    vm_sampling_costs(&mut cfg);
    let region = Region::new(cfg)?;
    guest.vm.connect_qmp().map_err(vm_err)?;
    Ok(region)
}

fn start_qemu(
    spec: &VmSpec,
    memfd: &std::os::fd::OwnedFd,
    incoming: bool,
    dir: &std::path::Path,
) -> Result<(Arc<VmGuest>, pagefleet_region::Foreign), RunnerError> {
    let dir = private_dir(dir)?;
    match Vm::start(spec, memfd, &dir, incoming) {
        Ok((vm, foreign)) => Ok((
            Arc::new(VmGuest {
                vm,
                dir,
                operator_qmp: spec.operator_qmp.as_ref().map(|p| p.display().to_string()),
                operator_qmp_ino: spec.operator_qmp.as_ref().and_then(|p| {
                    use std::os::unix::fs::MetadataExt;
                    std::fs::symlink_metadata(p).ok().map(|m| m.ino())
                }),
            }),
            foreign,
        )),
        Err(e) => {
            let _ = std::fs::remove_dir_all(&dir);
            Err(vm_err(e))
        }
    }
}

impl VmGuest {
    /// Stop the vCPUs (a migration's safepoint).
    pub fn pause(&self) -> bool {
        self.vm.qmp(|q| q.stop()).is_ok()
    }

    /// Forward the service address into the VM (`on`, after the address
    /// was claimed here) or stop (before it is released): clients then
    /// reconnect to whichever host runs the VM.
    pub fn serve(&self, on: bool) {
        let patience = if on { FORWARD_PATIENCE } else { Duration::ZERO };
        if let Err(e) = self.vm.forward(on, patience) {
            tracing::warn!("VM: {e}");
        }
    }

    /// Its device state (the VM must be paused).
    pub fn device_state(&self) -> Result<Vec<u8>, String> {
        self.vm.save_state(&self.dir).map_err(|e| e.to_string())
    }

    /// Load a migrated device state, then run.
    pub fn resume_from(&self, state: &[u8]) -> Result<(), RunnerError> {
        self.vm
            .load_state(state, &self.dir)
            .and_then(|_| self.vm.qmp(|q| q.cont()))
            .map_err(vm_err)?;
        // Running here now (the address was claimed): clients reconnect here.
        self.serve(true);
        self.announce();
        Ok(())
    }

    /// The VM runs elsewhere now: quit this QEMU and drop its sockets
    /// (the runner ends without dropping its state).
    pub fn retire(&self) {
        self.vm.shutdown(Duration::from_secs(3));
        self.remove_sockets();
    }

    /// Let them run again.
    pub fn resume(&self) {
        if let Err(e) = self.vm.qmp(|q| q.cont()) {
            tracing::warn!("VM: cont: {e}");
        }
        self.announce();
    }

    /// Tell the network where the VM's NIC is (after it moved here, or
    /// resumed after an abort): a failure only delays its clients.
    fn announce(&self) {
        if let Err(e) = self.vm.announce() {
            tracing::warn!("VM: announce-self: {e}");
        }
    }

    /// What `pagefleet status` shows about it.
    pub fn status(&self) -> VmStatus {
        let w = self.vm.console.workload();
        let state = match self.vm.exited() {
            Some(st) => format!("exited ({st})"),
            None => self
                .vm
                .qmp(|q| q.status())
                .map(|s| s.status)
                .unwrap_or_else(|e| format!("unknown ({e})")),
        };
        VmStatus {
            qemu_pid: self.vm.pid,
            operator_qmp: self.operator_qmp.clone(),
            state,
            ops_per_sec: w.ops_per_sec,
            errors: w.errors,
            ops: w.ops,
            report_unix_secs: w.history.last().map(|h| h.0).unwrap_or(0.0),
            done: w.done,
            console: self.vm.console.tail(10),
            accel: format!("{} ({})", self.vm.accel.accel.as_str(), self.vm.accel.why),
            ready: w.ready,
            nic: self.vm.nic.clone(),
        }
    }
}
