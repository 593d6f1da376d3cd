//! Starting QEMU on a region's memfd and taking the shim's hand-over.

use crate::accel::{Accel, Choice};
use crate::console::Console;
use crate::process::{qemu_binary, Process};
use crate::qmp::Qmp;
use crate::VmError;
use pagefleet_api::DiskFormat;
use pagefleet_region::{Foreign, Unmapper};
use pagefleet_uffd::handoff::{self, agent, Hello};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What to boot: typed fields only (no free-form QEMU arguments).
#[derive(Clone, Debug)]
pub struct VmSpec {
    /// The guest kernel (`-kernel`); None: the firmware (SeaBIOS) boots
    /// the first disk.
    pub kernel: Option<PathBuf>,
    /// Its initramfs (`-initrd`, only with a kernel).
    pub initrd: Option<PathBuf>,
    /// Kernel command line after pagefleet's own (`console=ttyS0 ...`;
    /// only with a kernel).
    pub append: String,
    /// Disk images, virtio-blk drives `disk0`, `disk1`, ... Writable
    /// unless read-only: writes land in the image (no throw-away overlay —
    /// it would not follow the VM to another QEMU), and at a migration
    /// QEMU inactivates them on the source before the destination's QEMU
    /// takes them, as in its shared-storage migration.
    pub disks: Vec<Disk>,
    /// Virtual CPUs.
    pub smp: u32,
    /// The machine QEMU emulates.
    pub machine: pagefleet_api::VmMachine,
    /// RAM bytes (the region's size; a whole number of MiB).
    pub size: u64,
    /// Guest name (QEMU's `-name`, log lines).
    pub name: String,
    /// A TCP service of the guest reachable from the network: one NIC
    /// (virtio-net on QEMU's user-mode network, `restrict=on`: the guest
    /// can open no connection out, not even to this host) and connections
    /// to `listen` forwarded to the guest's 10.0.2.15:`port`. The
    /// forward is added only while the VM runs on this host ([`Vm::forward`]),
    /// so the address can follow it to another host, as a kv guest's
    /// `--listen` does.
    pub forward: Option<Forward>,
    /// The VM's own NIC on a host bridge (a tap made for each QEMU:
    /// [`crate::tap`]); not with `forward`.
    pub nic: Option<Nic>,
    /// The line the guest reads at boot from QEMU's firmware
    /// configuration, file [`GUEST_CONFIG_FW_CFG`] (empty: no such file).
    pub guest_config: String,
    /// A second QMP socket for the host's operator tools (the I/O
    /// guarantee's QMP backend throttles the VM's `disk0` through it); the
    /// runner keeps the first one to itself.
    pub operator_qmp: Option<PathBuf>,
    /// SeaBIOS or UEFI with the VM's variable store.
    pub firmware: crate::firmware::Firmware,
}

/// One disk of a VM, its format known (detected once:
/// [`pagefleet_common::disk_image`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Disk {
    /// The image.
    pub path: PathBuf,
    /// How QEMU reads it (always given to QEMU: never probed by it).
    pub format: DiskFormat,
    /// Attached `readonly=on` (several VMs may share it).
    pub readonly: bool,
    /// The qcow2 overlay the guest writes instead (`path` is then its
    /// read-only base): see [`crate::overlay`].
    pub overlay: Option<PathBuf>,
}

impl Disk {
    /// The disk an API spec names, its format detected from its header
    /// when the spec does not say (and a qcow2 image's header checked:
    /// [`pagefleet_common::disk_image::check`]).
    pub fn resolve(d: &pagefleet_api::VmDisk) -> Result<Disk, VmError> {
        let path = PathBuf::from(&d.path);
        let format =
            pagefleet_common::disk_image::check(&path, d.format).map_err(VmError::Invalid)?;
        let overlay = d.overlay.as_ref().map(PathBuf::from);
        // A missing overlay is made when the guest first starts
        // (crate::overlay::ensure); one that exists must be over this base.
        if let Some(o) = overlay.as_ref().filter(|o| o.exists()) {
            pagefleet_common::disk_image::check_overlay(o, &path).map_err(VmError::Invalid)?;
        }
        Ok(Disk {
            path,
            format,
            readonly: d.readonly,
            overlay,
        })
    }
}

/// A host address forwarded into the VM (see [`VmSpec::forward`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Forward {
    /// Where clients connect (an address of the host running the VM).
    pub listen: std::net::SocketAddr,
    /// The guest's port.
    pub port: u16,
}

/// A VM's NIC on a host bridge: virtio-net on a tap, with a MAC that
/// stays the VM's wherever it runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Nic {
    /// The bridge its tap joins (the host's `--vm-bridge`).
    pub bridge: String,
    /// Its MAC.
    pub mac: pagefleet_api::MacAddr,
}

/// The firmware-configuration file the guest's settings line is in
/// (`/sys/firmware/qemu_fw_cfg/by_name/opt/org.pagefleet/guest/raw` in a
/// Linux guest with `qemu_fw_cfg` loaded). The `opt/` prefix and a
/// reverse domain name are QEMU's rule for files a user adds.
pub const GUEST_CONFIG_FW_CFG: &str = "opt/org.pagefleet/guest";

/// The guest's address on QEMU's user-mode network.
pub const GUEST_IP: &str = "10.0.2.15";

impl VmSpec {
    /// Checks before anything starts.
    pub fn validate(&self) -> Result<(), VmError> {
        if self.size == 0 || !self.size.is_multiple_of(1 << 20) {
            return Err(VmError::Invalid(format!(
                "VM memory must be a whole number of MiB (got {} bytes)",
                self.size
            )));
        }
        if !(1..=64).contains(&self.smp) {
            return Err(VmError::Invalid(format!("--smp {}: 1 to 64", self.smp)));
        }
        if self.kernel.is_none() {
            if self.disks.is_empty() {
                return Err(VmError::Invalid(
                    "a VM needs --kernel or a --disk to boot from".into(),
                ));
            }
            if self.initrd.is_some() || !self.append.is_empty() {
                return Err(VmError::Invalid(
                    "--initrd and --append go with --kernel (a disk's boot loader has its own command line)".into(),
                ));
            }
        }
        if self.disks.len() > pagefleet_api::MAX_VM_DISKS {
            return Err(VmError::Invalid(format!(
                "{} disks: at most {}",
                self.disks.len(),
                pagefleet_api::MAX_VM_DISKS
            )));
        }
        let files = [
            ("kernel", self.kernel.as_ref()),
            ("initrd", self.initrd.as_ref()),
        ]
        .into_iter()
        .flat_map(|(w, p)| p.map(|p| (w, p)))
        .chain(self.disks.iter().map(|d| ("disk", &d.path)))
        .chain(
            self.disks
                .iter()
                .flat_map(|d| d.overlay.as_ref().map(|o| ("overlay", o))),
        )
        .chain(match &self.firmware {
            crate::firmware::Firmware::Uefi { code, vars } => {
                vec![("UEFI firmware", code), ("UEFI variable store", vars)]
            }
            crate::firmware::Firmware::Bios => Vec::new(),
        });
        for (what, p) in files {
            if !p.is_file() {
                return Err(VmError::Invalid(format!(
                    "{what} {} is not a file",
                    p.display()
                )));
            }
            // QEMU's option syntax separates with commas.
            if p.to_str().is_none_or(|s| s.contains(',')) {
                return Err(VmError::Invalid(format!(
                    "{what} {}: a UTF-8 path without ','",
                    p.display()
                )));
            }
        }
        if self.forward.is_some() && self.nic.is_some() {
            return Err(VmError::Invalid(
                "--listen and --nic: a VM has a user-mode NIC with a forwarded service address or its own NIC on the bridge, not both".into(),
            ));
        }
        if let Some(n) = &self.nic {
            if !n.mac.is_unicast() {
                return Err(VmError::Invalid(format!("NIC MAC {}: not unicast", n.mac)));
            }
        }
        pagefleet_api::net::check_guest_config(&self.guest_config).map_err(VmError::Invalid)?;
        self.firmware.check()?;
        if let Some(f) = &self.forward {
            if f.port == 0 || f.listen.port() == 0 || !f.listen.is_ipv4() {
                return Err(VmError::Invalid(format!(
                    "--listen {} to guest port {}: an IPv4 address with a port, and a port",
                    f.listen, f.port
                )));
            }
        }
        // The append line is one argument to QEMU; keep it printable.
        if self.append.chars().any(|c| c.is_control()) || self.append.len() > 2048 {
            return Err(VmError::Invalid(
                "--append: printable text up to 2048 bytes".into(),
            ));
        }
        Ok(())
    }
}

impl VmSpec {
    /// QEMU's command line for this spec with RAM backend `ram` (an
    /// `-object` value with id `pf-ram`), QMP on `qmp`, accelerator
    /// `accel` and, for [`VmSpec::nic`], the tap QEMU inherits as
    /// descriptor `tap` (no `-incoming`).
    pub fn qemu_args(
        &self,
        ram: &str,
        qmp: &Path,
        accel: Accel,
        tap: Option<std::os::fd::RawFd>,
    ) -> Vec<std::ffi::OsString> {
        let mib = self.size >> 20;
        let mut a: Vec<std::ffi::OsString> = Vec::new();
        let mut push = |s: &str| a.push(s.into());
        push("-name");
        push(&format!("pagefleet-{}", self.name));
        push("-machine");
        push(&format!("{},memory-backend=pf-ram", self.machine.as_str()));
        for s in ["-accel", accel.as_str(), "-smp"] {
            push(s);
        }
        push(&self.smp.to_string());
        push("-m");
        push(&format!("{mib}M"));
        push("-object");
        push(ram);
        for s in [
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-no-reboot",
            "-serial",
            "stdio",
            "-qmp",
        ] {
            push(s);
        }
        push(&format!("unix:{},server=on,wait=off", qmp.display()));
        if let Some(o) = &self.operator_qmp {
            push("-qmp");
            push(&format!("unix:{},server=on,wait=off", o.display()));
        }
        for f in self.firmware.args() {
            push(&f);
        }
        if let Some(k) = &self.kernel {
            push("-append");
            push(&format!("console=ttyS0 panic=-1 {}", self.append));
            a.push("-kernel".into());
            a.push(k.clone().into());
            if let Some(i) = &self.initrd {
                a.push("-initrd".into());
                a.push(i.clone().into());
            }
        }
        for (i, d) in self.disks.iter().enumerate() {
            // The drive (its block backend is `diskN`: what QMP names,
            // e.g. the I/O guarantee's throttle) and its virtio-blk
            // device; without a kernel the firmware boots disk0.
            a.push("-drive".into());
            a.push(
                match &d.overlay {
                    // The base named here, with its format: QEMU never
                    // follows the name inside the overlay (crate::overlay).
                    Some(o) => format!(
                        "file={},if=none,format=qcow2,id=disk{i},backing.driver={},backing.file.driver=file,backing.file.filename={}",
                        o.display(),
                        d.format.as_str(),
                        d.path.display()
                    ),
                    None => format!(
                        "file={},if=none,format={},id=disk{i}{}",
                        d.path.display(),
                        d.format.as_str(),
                        if d.readonly { ",readonly=on" } else { "" }
                    ),
                }
                .into(),
            );
            a.push("-device".into());
            a.push(
                format!(
                    "virtio-blk-pci,drive=disk{i},id=vd{i}{}",
                    if i == 0 && self.kernel.is_none() {
                        ",bootindex=0"
                    } else {
                        ""
                    }
                )
                .into(),
            );
        }
        if self.forward.is_some() {
            a.push("-netdev".into());
            a.push("user,id=net0,restrict=on,net=10.0.2.0/24".into());
            a.push("-device".into());
            // No option ROM: the VM boots its kernel directly.
            a.push("virtio-net-pci,netdev=net0,romfile=".into());
        }
        if let (Some(n), Some(fd)) = (&self.nic, tap) {
            // vhost off: the data path stays in QEMU, as on TCG it must.
            a.push("-netdev".into());
            a.push(format!("tap,id=net0,fd={fd}").into());
            a.push("-device".into());
            // No option ROM: SeaBIOS boots the disk, not the network.
            a.push(format!("virtio-net-pci,netdev=net0,mac={},romfile=", n.mac).into());
        }
        if !self.guest_config.is_empty() {
            a.push("-fw_cfg".into());
            // QEMU's option syntax: a ',' in a value is written ",,".
            a.push(
                format!(
                    "name={GUEST_CONFIG_FW_CFG},string={}",
                    self.guest_config.replace(',', ",,")
                )
                .into(),
            );
        }
        a
    }
}

/// The shim library: `PAGEFLEET_VMSHIM`, else next to the running
/// executable (cargo puts both in `target/<profile>/`; test binaries sit
/// one level down, in `deps/`), else where `make install` and the Debian
/// package put it: `lib/pagefleet/` beside the executable's `bin/`
/// (`/usr/local/lib/pagefleet/`, `/usr/lib/pagefleet/`).
fn shim_path() -> Result<PathBuf, VmError> {
    if let Some(p) = std::env::var_os("PAGEFLEET_VMSHIM") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().map_err(|e| VmError::io("current executable", e))?;
    let bin = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    let up = bin.parent().map(Path::to_path_buf).unwrap_or_default();
    let candidates = [
        bin.join(SHIM_FILE),
        up.join(SHIM_FILE),
        up.join("lib/pagefleet").join(SHIM_FILE),
    ];
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .ok_or_else(|| {
            VmError::Invalid(format!(
                "{SHIM_FILE} not found: looked at {} (cargo build --release --workspace builds it; make install puts it in lib/pagefleet/; or set PAGEFLEET_VMSHIM)",
                candidates
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })
}

/// The VM shim's file name.
const SHIM_FILE: &str = "libpagefleet_vmshim.so";

/// The shim's agent inside QEMU, as the region's [`Unmapper`].
struct Agent(Mutex<UnixStream>);

impl Unmapper for Agent {
    fn unmap(&self, off: u64, len: u64) -> std::io::Result<()> {
        let mut s = self.0.lock().unwrap_or_else(|e| e.into_inner());
        s.write_all(&agent::Request::Zap { off, len }.encode())?;
        let mut r = [0u8; agent::REPLY_LEN];
        s.read_exact(&mut r)?;
        agent::parse_reply(r)
    }
}

/// A running QEMU whose RAM a region pages.
pub struct Vm {
    child: Process,
    /// Its QMP session (after [`Vm::release`]).
    qmp: Mutex<Option<Qmp>>,
    qmp_path: PathBuf,
    /// Its serial console.
    pub console: Arc<Console>,
    agent: Arc<Agent>,
    /// QEMU's pid.
    pub pid: u32,
    forward: Option<Forward>,
    /// Its NIC on a bridge, as status shows it: MAC, tap, bridge
    /// (announced after it moves).
    pub nic: Option<String>,
    /// The accelerator it runs on, and why.
    pub accel: Choice,
}

impl Vm {
    /// Start QEMU with its RAM on `memfd` (of `spec.size` bytes), sockets in
    /// `dir` (private to the runner). `incoming`: wait for a migration's
    /// device state instead of booting (`-incoming defer`). Returns once
    /// the shim handed the RAM's userfaultfd over: QEMU waits in that
    /// `mmap` until [`Vm::release`], so the caller can start the pager on
    /// the returned mapping first.
    pub fn start(
        spec: &VmSpec,
        memfd: &OwnedFd,
        dir: &Path,
        incoming: bool,
    ) -> Result<(Vm, Foreign), VmError> {
        spec.validate()?;
        let shim = shim_path()?;
        let sock_path = dir.join("shim.sock");
        let qmp_path = dir.join("qmp.sock");
        let _ = std::fs::remove_file(&sock_path);
        let _ = std::fs::remove_file(&qmp_path);
        let listener = UnixListener::bind(&sock_path)
            .map_err(|e| VmError::io(sock_path.display().to_string(), e))?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&sock_path, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| VmError::io("shim socket permissions", e))?;
        let st = pagefleet_common::sys::mapping::stat(std::os::fd::AsFd::as_fd(memfd))
            .map_err(|e| VmError::io("fstat memfd", e))?;
        let mem_path = format!("/proc/{}/fd/{}", std::process::id(), memfd.as_raw_fd());
        let accel = crate::accel::choose(spec.kernel.as_deref());
        tracing::info!("VM {}: {} ({})", spec.name, accel.accel.as_str(), accel.why);
        let mut cmd = Command::new(qemu_binary());
        // The tap lives in QEMU (it inherits the descriptor); this copy is
        // closed when `start` returns.
        let tap = spec
            .nic
            .as_ref()
            .map(|n| crate::tap::Tap::on_bridge(&n.bridge))
            .transpose()?;
        let nic = spec.nic.as_ref().zip(tap.as_ref()).map(|(n, t)| {
            t.pass_to(&mut cmd);
            format!("{} on tap {} in bridge {}", n.mac, t.name, n.bridge)
        });
        if let Some(n) = &nic {
            tracing::info!("VM {}: NIC {n}", spec.name);
        }
        cmd.args(spec.qemu_args(
            &format!(
                "memory-backend-file,id=pf-ram,size={}M,mem-path={mem_path},share=on",
                spec.size >> 20
            ),
            &qmp_path,
            accel.accel,
            tap.as_ref().map(|t| t.raw_fd()),
        ));
        if incoming {
            // Paused after the device state is in: the runner says `cont`.
            cmd.args(["-incoming", "defer", "-S"]);
        }
        cmd.env("LD_PRELOAD", &shim)
            .env("PAGEFLEET_VM_RAM", format!("{}:{}", st.st_dev, st.st_ino))
            .env("PAGEFLEET_VM_SOCKET", &sock_path);
        let console = Arc::new(Console::default());
        let child = Process::spawn(cmd, &console, &spec.name, true)?;
        drop(tap);
        let pid = child.pid;
        let stream = match accept_shim(&listener, &child) {
            Ok(s) => s,
            Err(e) => {
                child.kill();
                return Err(VmError::Qemu(format!(
                    "{e}{}",
                    crate::process::last_words(&console)
                )));
            }
        };
        let _ = std::fs::remove_file(&sock_path);
        let mut buf = [0u8; 64];
        let got = handoff::recv_fd(&stream, &mut buf)
            .map_err(|e| VmError::io("receiving the shim's userfaultfd", e))?;
        let Some((n, uffd)) = got else {
            child.kill();
            return Err(VmError::Qemu(
                "the shim closed its socket before handing over".into(),
            ));
        };
        let hello = match Hello::decode(&buf[..n])
            .ok_or_else(|| format!("a hand-over message of {n} bytes that is not a hello"))
        {
            Ok(h) => match h.check(spec.size, pid as u64) {
                Ok(()) => h,
                Err(e) => {
                    child.kill();
                    return Err(VmError::Qemu(format!("the VM shim's hand-over: {e}")));
                }
            },
            Err(e) => {
                child.kill();
                return Err(VmError::Qemu(format!("the VM shim's hand-over: {e}")));
            }
        };
        let agent = Arc::new(Agent(Mutex::new(stream)));
        let foreign = Foreign::new(
            hello.base,
            hello.len,
            pid as i32,
            hello.features,
            uffd,
            Box::new(AgentRef(agent.clone())),
        );
        Ok((
            Vm {
                child,
                qmp: Mutex::new(None),
                qmp_path,
                console,
                agent,
                pid,
                forward: spec.forward.clone(),
                nic,
                accel,
            },
            foreign,
        ))
    }

    /// Let QEMU go on from its RAM `mmap`. Faults it takes on its RAM
    /// wait in the userfaultfd until a pager serves them.
    pub fn release(&self) -> Result<(), VmError> {
        let mut s = self.agent.0.lock().unwrap_or_else(|e| e.into_inner());
        s.write_all(&agent::Request::Ack.encode())
            .map_err(|e| VmError::io("releasing QEMU", e))
    }

    /// Open QMP (once QEMU's main loop runs: after [`Vm::release`], with a
    /// pager serving its faults).
    pub fn connect_qmp(&self) -> Result<(), VmError> {
        let q = Qmp::connect(&self.qmp_path, Duration::from_secs(30))?;
        *self.qmp.lock().unwrap_or_else(|e| e.into_inner()) = Some(q);
        Ok(())
    }

    /// Run `f` on the QMP session.
    pub fn qmp<T>(&self, f: impl FnOnce(&mut Qmp) -> Result<T, VmError>) -> Result<T, VmError> {
        let mut g = self.qmp.lock().unwrap_or_else(|e| e.into_inner());
        let q = g
            .as_mut()
            .ok_or_else(|| VmError::Qmp("not connected yet".into()))?;
        f(q).map_err(|e| self.child.explain(e, &self.console))
    }

    /// Add (`on`) or remove the forward of [`VmSpec::forward`] (nothing
    /// when there is none). Adding retries for up to `patience` while the
    /// address is not bindable yet (it is moving from another host).
    /// Removing also hangs up the connections accepted on it (`hangup.rs`).
    pub fn forward(&self, on: bool, patience: Duration) -> Result<(), VmError> {
        let Some(f) = &self.forward else {
            return Ok(());
        };
        let rule = format!("tcp:{}:{}", f.listen.ip(), f.listen.port());
        let cmd = if on {
            format!("hostfwd_add net0 {rule}-{GUEST_IP}:{}", f.port)
        } else {
            format!("hostfwd_remove net0 {rule}")
        };
        let t0 = std::time::Instant::now();
        loop {
            // HMP answers with an empty string on success, else the reason.
            let out: String = self.qmp(|q| {
                q.execute(
                    "human-monitor-command",
                    Some(serde_json::json!({ "command-line": cmd })),
                )
            })?;
            let out = out.trim();
            if !on {
                if let std::net::SocketAddr::V4(a) = f.listen {
                    match crate::hangup::hang_up(self.pid, a) {
                        Ok(n) => tracing::info!("VM: hung up {n} connections on {a}"),
                        Err(e) => tracing::warn!("VM: hanging up connections on {a}: {e}"),
                    }
                }
            }
            if out.is_empty() || (!on && out.contains("not found")) {
                return Ok(());
            }
            if t0.elapsed() >= patience {
                return Err(VmError::Qemu(format!("{cmd}: {out}")));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Announce the VM's NIC from this host (QMP `announce-self`: QEMU
    /// sends RARP frames with the VM's MAC, so bridges learn where it is
    /// now, and asks a virtio-net guest to send its own gratuitous ARP)
    /// — after it moved here or resumed. Nothing when it has no bridge
    /// NIC.
    pub fn announce(&self) -> Result<(), VmError> {
        if self.nic.is_none() {
            return Ok(());
        }
        // Three rounds, 50 ms apart, starting at once: the VM's clients
        // on other hosts follow within the first round; the later ones
        // cover a frame lost on a busy bridge.
        self.qmp(|q| {
            q.execute::<serde_json::Value>(
                "announce-self",
                Some(serde_json::json!({"initial": 1, "max": 50, "rounds": 3, "step": 50})),
            )
        })
        .map(|_| ())
    }

    /// QEMU's exit status, if it has exited.
    pub fn exited(&self) -> Option<std::process::ExitStatus> {
        self.child.exited()
    }

    /// Stop QEMU: `quit` over QMP, then a kill after `grace`.
    pub fn shutdown(&self, grace: Duration) {
        self.child.stop(grace, || {
            let _ = self.qmp(|q| q.execute::<serde_json::Value>("quit", None));
        });
    }
}

impl Vm {
    /// A stopped VM's device state: QEMU's own migration into a Unix
    /// socket of `dir`, with `x-ignore-shared` so the RAM (the region,
    /// which pagefleet moves) is left out. ~1 MB; the VM stays stopped.
    pub fn save_state(&self, dir: &Path) -> Result<Vec<u8>, VmError> {
        let path = dir.join("state-out.sock");
        let _ = std::fs::remove_file(&path);
        let l =
            UnixListener::bind(&path).map_err(|e| VmError::io(path.display().to_string(), e))?;
        self.qmp(|q| {
            q.set_capabilities(&[("x-ignore-shared", true)])?;
            q.execute::<serde_json::Value>(
                "migrate",
                Some(serde_json::json!({ "uri": format!("unix:{}", path.display()) })),
            )
        })?;
        let reader = std::thread::spawn(move || -> std::io::Result<Vec<u8>> {
            let (mut s, _) = l.accept()?;
            let mut v = Vec::new();
            s.read_to_end(&mut v)?;
            Ok(v)
        });
        let t0 = Instant::now();
        loop {
            let info = self.qmp(|q| q.query_migrate())?;
            match info.status.as_deref() {
                Some("completed") => break,
                Some("failed") | Some("cancelled") => {
                    let _ = std::fs::remove_file(&path);
                    return Err(VmError::Qemu(format!(
                        "saving the device state failed: {}",
                        info.error_desc.unwrap_or_default()
                    )));
                }
                _ if t0.elapsed() > Duration::from_secs(60) => {
                    let _ = self.qmp(|q| q.execute::<serde_json::Value>("migrate_cancel", None));
                    return Err(VmError::Qemu(
                        "saving the device state took over 60 s".into(),
                    ));
                }
                _ => std::thread::sleep(Duration::from_millis(1)),
            }
        }
        let _ = std::fs::remove_file(&path);
        reader
            .join()
            .map_err(|_| VmError::Qemu("device state reader panicked".into()))?
            .map_err(|e| VmError::io("reading the device state", e))
    }

    /// Load a device state [`Vm::save_state`] produced into this VM
    /// (started `incoming`); it stays paused until `cont`.
    pub fn load_state(&self, state: &[u8], dir: &Path) -> Result<(), VmError> {
        let path = dir.join("state-in.sock");
        let _ = std::fs::remove_file(&path);
        self.qmp(|q| {
            q.set_capabilities(&[("x-ignore-shared", true)])?;
            q.execute::<serde_json::Value>(
                "migrate-incoming",
                Some(serde_json::json!({ "uri": format!("unix:{}", path.display()) })),
            )
        })?;
        let t0 = Instant::now();
        let mut s = loop {
            match UnixStream::connect(&path) {
                Ok(s) => break s,
                Err(_) if t0.elapsed() < Duration::from_secs(10) => {
                    std::thread::sleep(Duration::from_millis(1))
                }
                Err(e) => return Err(VmError::io("QEMU's incoming socket", e)),
            }
        };
        s.write_all(state)
            .and_then(|_| s.shutdown(std::net::Shutdown::Write))
            .map_err(|e| VmError::io("writing the device state", e))?;
        loop {
            if let Some(st) = self.exited() {
                return Err(VmError::Qemu(format!(
                    "exited ({st}) loading the device state: {}",
                    self.console.tail(3).join(" | ")
                )));
            }
            let st = self.qmp(|q| q.status())?;
            if st.status != "inmigrate" {
                break;
            }
            if t0.elapsed() > Duration::from_secs(60) {
                return Err(VmError::Qemu(
                    "loading the device state took over 60 s".into(),
                ));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let _ = std::fs::remove_file(&path);
        Ok(())
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        if self.exited().is_none() {
            self.shutdown(Duration::from_secs(2));
        }
    }
}

/// The agent shared between the region (unmaps) and the VM (the ack).
struct AgentRef(Arc<Agent>);

impl Unmapper for AgentRef {
    fn unmap(&self, off: u64, len: u64) -> std::io::Result<()> {
        self.0.unmap(off, len)
    }
}

/// Wait for the shim's connection while QEMU starts (it exits on a bad
/// command line or a missing file: reported instead of a timeout).
fn accept_shim(l: &UnixListener, child: &Process) -> Result<UnixStream, VmError> {
    l.set_nonblocking(true)
        .map_err(|e| VmError::io("shim socket", e))?;
    let t0 = Instant::now();
    loop {
        match l.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false)
                    .map_err(|e| VmError::io("shim socket", e))?;
                return Ok(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(VmError::io("accepting the shim", e)),
        }
        if let Some(st) = child.exited() {
            return Err(VmError::Qemu(format!(
                "exited ({st}) before mapping its RAM"
            )));
        }
        if t0.elapsed() > Duration::from_secs(30) {
            return Err(VmError::Qemu(
                "did not map its RAM within 30 s (is the shim loaded?)".into(),
            ));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}
