//! Guests: what they run, how one is started, what a runner reports.

use crate::migration::MigrationProgress;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A guest spec a host refuses to start, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvalidSpec(pub String);

impl std::fmt::Display for InvalidSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for InvalidSpec {}

impl From<String> for InvalidSpec {
    fn from(s: String) -> InvalidSpec {
        InvalidSpec(s)
    }
}

impl From<&str> for InvalidSpec {
    fn from(s: &str) -> InvalidSpec {
        InvalidSpec(s.to_string())
    }
}

/// Whole-page pseudo-random prefill content: a `shared` fraction of the
/// pages (spread over the memory) the same on every guest filled this way,
/// the rest this guest's own (`seed`). Paper 002's controlled sharing.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ContentFill {
    /// Seed of this guest's own pages.
    pub seed: u64,
    /// Fraction of pages with the common content, 0 to 1.
    pub shared: f64,
}

/// A built-in workload and its parameters. This is all a caller can ask a
/// host to run: there is no command line in it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum Workload {
    /// Page-granular accesses over the memory.
    Synthetic {
        /// uniform, zipf[:θ], seq or hotcold[:frac:prob].
        dist: String,
        /// Fraction of operations that write.
        write_frac: f64,
        /// Write every page once first.
        #[serde(default)]
        prefill: bool,
        /// Operations per second, all threads together (none: as fast as possible).
        #[serde(default)]
        rate: Option<f64>,
        /// Fraction of the pages the accesses fall on (the first ones).
        span: f64,
        /// Prefill whole pages with pseudo-random content, a `shared`
        /// fraction of them the same on every guest (controlled sharing for
        /// sharing-aware migration).
        #[serde(default)]
        fill: Option<ContentFill>,
    },
    /// A memcached-protocol key-value server whose table lives in the memory.
    Kv {
        /// Address it listens on.
        listen: String,
        /// When full, refuse stores instead of evicting the least recently
        /// used items (memcached's `-M`).
        #[serde(default)]
        no_evict: bool,
    },
    /// A QEMU virtual machine whose RAM is the guest memory. Files are
    /// paths on the host running it, which starts QEMU only on images
    /// under the directories its operator allowed (`pagefleetd
    /// --vm-images`); there is no free-form QEMU argument.
    Vm {
        /// The guest kernel, booted directly (None: the VM boots through
        /// its firmware from its first disk, as any QEMU VM).
        #[serde(default)]
        kernel: Option<String>,
        /// Its initramfs (only with a kernel).
        #[serde(default)]
        initrd: Option<String>,
        /// Kernel command line (after `console=ttyS0`; only with a kernel:
        /// a disk's boot loader has its own).
        #[serde(default)]
        append: String,
        /// Disk images, virtio-blk drives `disk0`, `disk1`, ... in this
        /// order; the first is the boot disk when there is no kernel.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        disks: Vec<VmDisk>,
        /// The older form of one disk (`disks[0]`, raw): read, never
        /// written (see [`Workload::vm_disks`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        disk: Option<String>,
        /// The older form's read-only flag.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        disk_readonly: bool,
        /// The VM's service address (IP:PORT), like kv's `listen`: TCP
        /// connections to it reach the guest's `guest_port` (one NIC on
        /// QEMU's user-mode network, no connection out of the guest). It
        /// follows the VM when it migrates.
        #[serde(default)]
        listen: Option<String>,
        /// The guest's port behind `listen`.
        #[serde(default = "default_guest_port")]
        guest_port: u16,
        /// Virtual CPUs.
        #[serde(default = "default_smp")]
        smp: u32,
        /// The VM's own NIC on its host's VM bridge, with its MAC and
        /// address (instead of `listen`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        nic: Option<crate::net::VmNic>,
        /// One line of `key=value` words the guest reads at boot (QEMU
        /// firmware configuration file `opt/org.pagefleet/guest`, after
        /// the `host=`, `ip=` and `gw=` the runner writes).
        #[serde(default, skip_serializing_if = "String::is_empty")]
        guest_config: String,
        /// The machine QEMU emulates (pc: i440FX, the default; q35).
        #[serde(default, skip_serializing_if = "VmMachine::is_default")]
        machine: VmMachine,
        /// The firmware that boots it: SeaBIOS (the default) or UEFI with
        /// the VM's own variable store.
        #[serde(default, skip_serializing_if = "VmFirmware::is_bios")]
        firmware: VmFirmware,
    },
    /// The S-memV sort experiment: records fill the last `sort_frac` of the
    /// memory; it scans them (unless `warm` is false) until asked to sort.
    Sortjob {
        /// Share of the memory the records fill.
        sort_frac: f64,
        /// Scan the records before sorting (builds the access history).
        warm: bool,
        /// Seed of the records.
        seed: u64,
    },
}

/// A disk image's format. Detected once, from the image's header, when
/// the guest starts on its first host, then carried in the guest's spec:
/// never probed again (a guest that writes a qcow2 header into its raw
/// disk must not turn it into a qcow2 image on the next host).
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DiskFormat {
    /// Bytes as the guest sees them.
    Raw,
    /// QEMU's copy-on-write format (version 2 or 3, no backing file).
    Qcow2,
}

impl DiskFormat {
    /// The format's name, as QEMU's `format=` spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            DiskFormat::Raw => "raw",
            DiskFormat::Qcow2 => "qcow2",
        }
    }
}

impl std::str::FromStr for DiskFormat {
    type Err = InvalidSpec;
    fn from_str(s: &str) -> Result<Self, InvalidSpec> {
        match s {
            "raw" => Ok(DiskFormat::Raw),
            "qcow2" => Ok(DiskFormat::Qcow2),
            _ => Err(InvalidSpec(format!("disk format {s:?}: raw or qcow2"))),
        }
    }
}

/// One disk of a VM.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct VmDisk {
    /// The image (an absolute path on the host running the VM). Writable
    /// unless `readonly`: the guest's writes land in the image, and a
    /// migration hands it over as QEMU's shared-storage migration does
    /// (the destination must see the same file).
    pub path: String,
    /// Its format (None: detected from its header when the guest starts,
    /// then recorded here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<DiskFormat>,
    /// Attached read-only (several VMs may share one image).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub readonly: bool,
    /// A qcow2 overlay (an absolute path) the guest writes instead of
    /// `path`, which is then its read-only base, never written (several
    /// VMs may share it, each with its own overlay). The host that first
    /// starts the guest creates the overlay when it is missing; a
    /// migration hands it over as it does a writable image (the
    /// destination must see the same file).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overlay: Option<String>,
}

/// The machine type of a VM (QEMU's `-machine`; libvirt's
/// `<os><type machine=...>`).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum VmMachine {
    /// i440FX with PIIX (QEMU's `pc`).
    #[default]
    Pc,
    /// Q35 with ICH9 and PCI Express (QEMU's `q35`).
    Q35,
}

impl VmMachine {
    /// QEMU's name for it.
    pub fn as_str(self) -> &'static str {
        match self {
            VmMachine::Pc => "pc",
            VmMachine::Q35 => "q35",
        }
    }

    fn is_default(&self) -> bool {
        *self == VmMachine::Pc
    }
}

/// A VM's firmware (libvirt's `<os firmware=...>`, `<loader>`, `<nvram>`).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum VmFirmware {
    /// SeaBIOS, QEMU's default: no state of its own.
    #[default]
    Bios,
    /// UEFI (the host's OVMF, without Secure Boot). Its variables (boot
    /// entries, settings the guest writes) are the VM's: `nvram`, an
    /// absolute path under the host's `--vm-images`, made from OVMF's
    /// template when the VM first starts and handed over by a migration
    /// as a writable disk is (the destination must see the same file).
    Uefi {
        /// The VM's variable store.
        nvram: String,
    },
}

impl VmFirmware {
    fn is_bios(&self) -> bool {
        *self == VmFirmware::Bios
    }
}

impl std::str::FromStr for VmMachine {
    type Err = String;
    fn from_str(s: &str) -> Result<VmMachine, String> {
        match s {
            "pc" => Ok(VmMachine::Pc),
            "q35" => Ok(VmMachine::Q35),
            _ => Err(format!("machine {s:?}: pc or q35")),
        }
    }
}

/// Disks a VM may have.
pub const MAX_VM_DISKS: usize = 8;

impl Workload {
    /// A VM's disks in drive order: the older one-disk form (raw, as it
    /// was always attached) first, then `disks`. Empty for other
    /// workloads.
    pub fn vm_disks(&self) -> Vec<VmDisk> {
        let Workload::Vm {
            disks,
            disk,
            disk_readonly,
            ..
        } = self
        else {
            return Vec::new();
        };
        let mut all: Vec<VmDisk> = disk
            .iter()
            .map(|p| VmDisk {
                path: p.clone(),
                format: Some(DiskFormat::Raw),
                readonly: *disk_readonly,
                overlay: None,
            })
            .collect();
        all.extend(disks.iter().cloned());
        all
    }

    /// The workload's kind as a word (synthetic, kv, sortjob).
    pub fn kind(&self) -> &'static str {
        match self {
            Workload::Synthetic { .. } => "synthetic",
            Workload::Kv { .. } => "kv",
            Workload::Sortjob { .. } => "sortjob",
            Workload::Vm { .. } => "vm",
        }
    }

    /// Range checks a host does before it starts anything.
    pub fn validate(&self) -> Result<(), InvalidSpec> {
        let frac = |name: &str, v: f64| {
            if (0.0..=1.0).contains(&v) {
                Ok(())
            } else {
                Err(InvalidSpec(format!(
                    "{name} must be between 0 and 1, not {v}"
                )))
            }
        };
        match self {
            Workload::Synthetic {
                write_frac,
                rate,
                span,
                dist,
                fill,
                ..
            } => {
                frac("write_frac", *write_frac)?;
                frac("span", *span)?;
                if let Some(f) = fill {
                    frac("fill shared", f.shared)?;
                }
                if rate.is_some_and(|r| !(r >= 0.0 && r.is_finite())) {
                    return Err("rate must be a non-negative number".into());
                }
                if dist.is_empty() || dist.len() > 64 {
                    return Err("dist: uniform, zipf[:θ], seq or hotcold[:frac:prob]".into());
                }
                Ok(())
            }
            Workload::Kv { listen, .. } => listen
                .parse::<std::net::SocketAddr>()
                .map(|_| ())
                .map_err(|_| InvalidSpec(format!("listen {listen:?} is not IP:PORT"))),
            w @ Workload::Vm {
                kernel,
                initrd,
                append,
                smp,
                listen,
                guest_port,
                nic,
                guest_config,
                firmware,
                ..
            } => {
                if listen.is_some() && nic.is_some() {
                    return Err("listen and nic: a VM has its service address through QEMU's user-mode network or its own NIC on the host's bridge, not both".into());
                }
                if let Some(n) = nic {
                    n.validate().map_err(InvalidSpec)?;
                }
                crate::net::check_guest_config(guest_config).map_err(InvalidSpec)?;
                if let Some(l) = listen {
                    let ok = l
                        .parse::<std::net::SocketAddrV4>()
                        .is_ok_and(|a| a.port() != 0);
                    if !ok || *guest_port == 0 {
                        return Err(InvalidSpec(format!(
                            "listen {l:?} is not IPv4:PORT with a port (or guest_port is 0)"
                        )));
                    }
                }
                let disks = w.vm_disks();
                if kernel.is_none() {
                    if disks.is_empty() {
                        return Err("a VM needs a kernel or a disk to boot from".into());
                    }
                    if initrd.is_some() || !append.is_empty() {
                        return Err("initrd and append go with a kernel (a disk's boot loader has its own command line)".into());
                    }
                }
                if disks.len() > MAX_VM_DISKS {
                    return Err(InvalidSpec(format!(
                        "{} disks: at most {MAX_VM_DISKS}",
                        disks.len()
                    )));
                }
                for d in &disks {
                    if d.overlay.is_some() && d.readonly {
                        return Err(InvalidSpec(format!(
                            "disk {}: an overlay is the disk's writable part; give overlay or readonly, not both",
                            d.path
                        )));
                    }
                    if d.overlay.as_ref() == Some(&d.path) {
                        return Err(InvalidSpec(format!(
                            "disk {}: its overlay must be another file",
                            d.path
                        )));
                    }
                }
                let nvram = match firmware {
                    VmFirmware::Uefi { nvram } => Some(nvram),
                    VmFirmware::Bios => None,
                };
                let files = [
                    ("kernel", kernel.as_ref()),
                    ("initrd", initrd.as_ref()),
                    ("nvram", nvram),
                ]
                .into_iter()
                .flat_map(|(w, p)| p.map(|p| (w, p)))
                .chain(disks.iter().map(|d| ("disk", &d.path)))
                .chain(
                    disks
                        .iter()
                        .flat_map(|d| d.overlay.as_ref().map(|o| ("overlay", o))),
                );
                for (what, p) in files {
                    if !p.starts_with('/')
                        || p.len() > 4096
                        || p.split('/').any(|c| c == "..")
                        || p.contains(',')
                    {
                        return Err(InvalidSpec(format!(
                            "{what} {p:?}: an absolute path without '..' or ','"
                        )));
                    }
                }
                if !(1..=64).contains(smp) {
                    return Err(InvalidSpec(format!("smp {smp}: 1 to 64")));
                }
                if append.len() > 2048 || append.chars().any(|c| c.is_control()) {
                    return Err("append: printable text up to 2048 bytes".into());
                }
                Ok(())
            }
            Workload::Sortjob { sort_frac, .. } => {
                if *sort_frac > 0.0 && *sort_frac <= 1.0 {
                    Ok(())
                } else {
                    Err(InvalidSpec(format!(
                        "sort_frac must be in (0, 1], not {sort_frac}"
                    )))
                }
            }
        }
    }
}

/// Everything a runner needs to run a guest, besides its memory: the
/// workload and the paging runtime's settings. A migration carries it to
/// the destination runner.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct GuestSpec {
    /// What the guest runs.
    pub workload: Workload,
    /// Worker threads.
    #[serde(default = "default_threads")]
    pub threads: usize,
    /// Victim choice (clock by default).
    #[serde(default)]
    pub policy: crate::Policy,
    /// Pages per chunk (power of two, 1..64).
    #[serde(default = "default_chunk")]
    pub chunk: usize,
    /// What a remote fault brings in besides its page.
    #[serde(default)]
    pub prefetch: crate::Prefetch,
    /// Memory servers the region pages to.
    #[serde(default)]
    pub servers: Vec<String>,
    /// Copies of every remote page, on different servers: 1 or 2 (a
    /// server's death then loses nothing; its pages are re-replicated).
    #[serde(default = "default_replicas")]
    pub replicas: usize,
    /// CPU share of one core the access sampling may cost.
    #[serde(default = "default_sample_budget")]
    pub sample_budget: f64,
    /// How long the pager polls for a faulting page's reply before it
    /// sleeps, µs, while its host has idle CPUs (0: never; none: the
    /// runtime's default).
    #[serde(default)]
    pub reply_spin_us: Option<u64>,
    /// A service address that moves with the guest.
    #[serde(default)]
    pub service_ip: Option<String>,
}

fn default_smp() -> u32 {
    1
}

fn default_guest_port() -> u16 {
    11211
}

fn default_threads() -> usize {
    2
}
fn default_chunk() -> usize {
    16
}
fn default_replicas() -> usize {
    1
}
/// Longest poll for a reply a guest may ask for (µs).
pub const MAX_REPLY_SPIN_US: u64 = 10_000;

fn default_sample_budget() -> f64 {
    0.01
}

impl GuestSpec {
    /// A spec with the runtime's defaults.
    pub fn new(workload: Workload) -> GuestSpec {
        GuestSpec {
            workload,
            threads: default_threads(),
            policy: Default::default(),
            chunk: default_chunk(),
            prefetch: Default::default(),
            servers: vec![],
            replicas: default_replicas(),
            sample_budget: default_sample_budget(),
            reply_spin_us: None,
            service_ip: None,
        }
    }

    /// Range checks a host does before it starts anything.
    pub fn validate(&self) -> Result<(), InvalidSpec> {
        self.workload.validate()?;
        if !(1..=256).contains(&self.threads) {
            return Err("threads must be 1..256".into());
        }
        if !self.chunk.is_power_of_two() || self.chunk > 64 {
            return Err("chunk must be a power of two, 1..64 pages".into());
        }
        if !(1..=2).contains(&self.replicas) {
            return Err(format!("replicas {}: use 1 or 2", self.replicas).into());
        }
        if self.replicas > 1 && !self.servers.is_empty() && self.servers.len() < self.replicas {
            return Err(format!(
                "{} replicas need at least {} memory servers ({} given)",
                self.replicas,
                self.replicas,
                self.servers.len()
            )
            .into());
        }
        if !(self.sample_budget > 0.0 && self.sample_budget <= 1.0) {
            return Err("sample_budget must be in (0, 1]".into());
        }
        if self.reply_spin_us.is_some_and(|us| us > MAX_REPLY_SPIN_US) {
            return Err(format!(
                "reply_spin_us must be at most {MAX_REPLY_SPIN_US} (a poll that long only burns CPU)"
            )
            .into());
        }
        if let Some(ip) = &self.service_ip {
            ip.parse::<std::net::Ipv4Addr>()
                .map_err(|_| InvalidSpec(format!("service_ip {ip:?} is not an IPv4 address")))?;
        }
        for s in &self.servers {
            if s.is_empty() || s.len() > 256 || s.contains(char::is_whitespace) {
                return Err(format!("memory server {s:?} is not HOST:PORT").into());
            }
        }
        Ok(())
    }
}

/// `POST /guests`: start a guest on this host.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StartGuest {
    /// 1-32 letters, digits, - or _, starting with a letter or digit.
    pub name: String,
    /// Guest memory, bytes.
    pub size: u64,
    /// Pages resident here (default: all of them).
    #[serde(default)]
    pub budget_pages: Option<u64>,
    /// What it runs.
    pub spec: GuestSpec,
}

/// Whether `n` can name a guest: 1-32 letters, digits, - or _, starting
/// with a letter or digit.
pub fn valid_name(n: &str) -> bool {
    n.as_bytes().first().is_some_and(u8::is_ascii_alphanumeric)
        && n.len() <= 32
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// Where a guest is in its life.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum GuestState {
    /// Its runner is starting.
    Starting,
    /// A runner waiting for an incoming migration.
    Incoming,
    /// Running.
    Running,
    /// Running and migrating away.
    Migrating,
    /// Its runner ended on its own or was killed: the record stays, with
    /// the reason (`GuestStatus::failure`), until `pagefleet guest rm`.
    /// Its pages on memory servers are nobody's: gc collects them.
    Failed,
}

impl GuestState {
    /// A runner that is (or is about to be) this guest: not a failed record
    /// and not a runner waiting for an incoming migration.
    pub fn is_live(self) -> bool {
        !matches!(self, GuestState::Incoming | GuestState::Failed)
    }
}

/// Why, when and how a guest's runner ended on its own.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct GuestFailure {
    /// What the runner said last (its log's last lines), or what killed it.
    pub reason: String,
    /// Its exit status, e.g. `exit status 75` or `killed by signal 9 (SIGKILL)`.
    pub exit: String,
    /// When it ended, seconds since the Unix epoch.
    pub at_unix: u64,
    /// Its log, kept (the next runner of this name writes a new one).
    pub log: String,
}

/// Where a guest's pages are.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct PageLocations {
    /// Resident on the host it runs on.
    pub local: u64,
    /// Never written (read as zeros).
    pub zero: u64,
    /// On memory servers, by address.
    pub remote: BTreeMap<String, u64>,
}

/// A guest as its runner reports it (`GET /guests`, control op `status`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct GuestStatus {
    /// Its name.
    pub name: String,
    /// Where it is in its life.
    pub state: GuestState,
    /// The runner's process id.
    #[serde(default)]
    pub pid: u32,
    /// What it runs (absent while starting or waiting for a migration).
    #[serde(default)]
    pub workload: Option<GuestSpec>,
    /// Guest memory, bytes.
    #[serde(default)]
    pub size: u64,
    /// Pages allowed resident here.
    #[serde(default)]
    pub budget_pages: u64,
    /// Pages resident here.
    #[serde(default)]
    pub resident_pages: u64,
    /// Pages on memory servers.
    #[serde(default)]
    pub remote_pages: u64,
    /// Pages brought in from memory servers so far.
    #[serde(default)]
    pub page_ins: u64,
    /// Pages sent out to memory servers so far.
    #[serde(default)]
    pub page_outs: u64,
    /// Operations the workload has done.
    #[serde(default)]
    pub ops: u64,
    /// Whether the workload has finished setting up.
    #[serde(default)]
    pub ready: bool,
    /// Seconds since it started here.
    #[serde(default)]
    pub uptime_secs: f64,
    /// Its region id (hex).
    #[serde(default)]
    pub region_id: String,
    /// Where its pages are.
    #[serde(default)]
    pub pages: Option<PageLocations>,
    /// What paging costs it (absent for guests without a region).
    #[serde(default)]
    pub paging: Option<PagingCosts>,
    /// A migration's progress, while one runs.
    #[serde(default)]
    pub migration: Option<MigrationProgress>,
    /// A VM guest: its QEMU and what its in-guest workload reports.
    #[serde(default)]
    pub vm: Option<VmStatus>,
    /// A failed guest: why, when and how its runner ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<GuestFailure>,
}

/// A VM guest's QEMU and its in-guest workload (vmwork's console reports).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct VmStatus {
    /// QEMU's process id.
    pub qemu_pid: u32,
    /// Its QMP socket for the host's operator tools (`pagefleet ioqos`'s
    /// `qmp:SOCKET@disk0`), when the VM is hosted.
    #[serde(default)]
    pub operator_qmp: Option<String>,
    /// QEMU's run state (running, paused, ...), or how it exited.
    pub state: String,
    /// The in-guest workload's operations per second (last report).
    pub ops_per_sec: f64,
    /// Wrong values it read (must be 0).
    pub errors: u64,
    /// Operations so far, as of its last report.
    #[serde(default)]
    pub ops: u64,
    /// When that report arrived (Unix seconds): with `ops`, a timeline
    /// that does not depend on when status is asked.
    #[serde(default)]
    pub report_unix_secs: f64,
    /// It finished and verified every page.
    pub done: bool,
    /// The last console lines.
    pub console: Vec<String>,
    /// The accelerator QEMU runs on (kvm, tcg) and why it was chosen.
    #[serde(default)]
    pub accel: String,
    /// What the guest said when it came up (`pagefleet-guest: ready
    /// host=... ip=...` on its console, seen by this host's QEMU; None:
    /// not said here, e.g. the VM booted on another host).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready: Option<String>,
    /// Its own NIC: MAC, tap and bridge (None: no NIC on a bridge).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nic: Option<String>,
}

impl GuestStatus {
    /// A guest known only from the host's bookkeeping (its runner did not answer).
    pub fn placeholder(name: &str, state: GuestState, budget_pages: u64, pid: u32) -> GuestStatus {
        GuestStatus {
            name: name.into(),
            state,
            pid,
            workload: None,
            size: 0,
            budget_pages,
            resident_pages: 0,
            remote_pages: 0,
            page_ins: 0,
            page_outs: 0,
            ops: 0,
            ready: false,
            uptime_secs: 0.0,
            region_id: String::new(),
            pages: None,
            paging: None,
            migration: None,
            vm: None,
            failure: None,
        }
    }
}

/// What paging costs a guest, measured by its runtime since it started here.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct PagingCosts {
    /// Pager CPU per page brought in, µs (guest host side).
    pub cpu_per_page_in_us: f64,
    /// Pager CPU per page evicted, sent or dropped, µs.
    pub cpu_per_page_out_us: f64,
    /// Fault service time (fault read to page installed), median, µs.
    pub fault_p50_us: f64,
    /// Its 99th percentile, µs.
    pub fault_p99_us: f64,
    /// Evictions that were local drops (clean pages).
    pub clean_drops: u64,
    /// Page-out batches that ran with the guest over its budget (faults waited).
    pub direct_reclaims: u64,
    /// Their total time, ms.
    pub direct_reclaim_ms: f64,
    /// Copies of every remote page (1 or 2).
    #[serde(default)]
    pub replicas: usize,
    /// Remote pages with fewer copies than that (a server died;
    /// re-replication is restoring them).
    #[serde(default)]
    pub degraded_pages: u64,
    /// Memory servers down now: found dead or hung (their pages served by
    /// mirrors) and not answering since.
    #[serde(default)]
    pub servers_down: u64,
    /// Times a memory server was found dead or hung.
    #[serde(default)]
    pub server_failures: u64,
    /// Times a server that was down answered again and was used again.
    #[serde(default)]
    pub servers_revived: u64,
    /// Faulting pages asked of a mirror because their server missed its
    /// deadline (hedged reads).
    #[serde(default)]
    pub hedged_reads: u64,
    /// Pages re-replication copied.
    #[serde(default)]
    pub rereplicated_pages: u64,
    /// Fault service times (fault read to page installed), seconds.
    #[serde(default)]
    pub fault_seconds: crate::HistogramSnapshot,
    /// Faults by what served them.
    #[serde(default)]
    pub faults: FaultCounts,
    /// Pages read-ahead brought (besides the faulting pages).
    #[serde(default)]
    pub prefetched_pages: u64,
    /// Read-ahead pages used after they came.
    #[serde(default)]
    pub prefetch_hits: u64,
    /// Read-ahead pages evicted with no use seen (an upper bound: a read
    /// of a mapped page shows only once the sampler has unmapped it).
    #[serde(default)]
    pub prefetch_misses: u64,
}

/// A guest's page faults by what served them, since it started here.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct FaultCounts {
    /// The page was on a memory server: the fault waited for it.
    pub remote: u64,
    /// First touch: filled with zeros here.
    pub zero: u64,
    /// The page was resident; the sampler had unmapped it to see its use
    /// and the kernel mapped it back (no pager work).
    pub minor: u64,
    /// First write to a write-protected resident page (a kept copy went
    /// stale, or a migration round tracks changes).
    pub write_protect: u64,
}

impl FaultCounts {
    /// Each count with its name (the `kind` label of the fault series).
    pub fn by_kind(&self) -> [(&'static str, u64); 4] {
        [
            ("remote", self.remote),
            ("zero", self.zero),
            ("minor", self.minor),
            ("write_protect", self.write_protect),
        ]
    }
}

/// What a sort job reports (control op `sort`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct SortResult {
    /// Seconds the sort took.
    pub sort_secs: f64,
    /// Whether the records came out sorted.
    pub sorted: bool,
    /// Records sorted.
    pub records: u64,
    /// Pages brought in during the sort.
    pub page_ins: u64,
    /// Pages sent out during the sort.
    pub page_outs: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_start_request_cannot_carry_a_command() {
        let smuggled = r#"{"name":"x","size":4096,"args":["run","--merge","--","id"],
                          "spec":{"workload":{"kind":"kv","listen":"127.0.0.1:1"}}}"#;
        assert!(serde_json::from_str::<StartGuest>(smuggled).is_err());
        let cmd = r#"{"name":"x","size":4096,
                     "spec":{"workload":{"kind":"kv","listen":"127.0.0.1:1","command":["id"]}}}"#;
        assert!(serde_json::from_str::<StartGuest>(cmd).is_err());
        let kind = r#"{"name":"x","size":4096,"spec":{"workload":{"kind":"exec","argv":["id"]}}}"#;
        assert!(serde_json::from_str::<StartGuest>(kind).is_err());
        let ok =
            r#"{"name":"x","size":4096,"spec":{"workload":{"kind":"kv","listen":"127.0.0.1:1"}}}"#;
        let s: StartGuest = serde_json::from_str(ok).unwrap();
        assert_eq!(s.spec.threads, 2);
        assert!(s.spec.validate().is_ok());
    }

    #[test]
    fn specs_are_range_checked() {
        let mut s = GuestSpec::new(Workload::Kv {
            listen: "nonsense".into(),
            no_evict: false,
        });
        assert!(s.validate().is_err());
        s.workload = Workload::Kv {
            listen: "127.0.0.1:11211".into(),
            no_evict: false,
        };
        s.chunk = 3;
        assert!(s.validate().is_err());
        s.chunk = 16;
        // A policy outside the list does not even parse (the type is the check).
        let mut v = serde_json::to_value(&s).unwrap();
        v["policy"] = "lru; rm -rf /".into();
        assert!(serde_json::from_value::<GuestSpec>(v.clone()).is_err());
        v["policy"] = "aging".into();
        let back: GuestSpec = serde_json::from_value(v).unwrap();
        assert_eq!(back.policy, crate::Policy::Aging);
        assert!(back.validate().is_ok());
        // A poll for replies is bounded: a long one only burns CPU.
        s.reply_spin_us = Some(MAX_REPLY_SPIN_US);
        assert!(s.validate().is_ok());
        s.reply_spin_us = Some(MAX_REPLY_SPIN_US + 1);
        assert!(s.validate().is_err());
        // Older clients send no reply_spin_us: the runtime's default.
        let v = serde_json::to_value(GuestSpec::new(Workload::Kv {
            listen: "127.0.0.1:11211".into(),
            no_evict: false,
        }))
        .unwrap();
        let mut m = v.as_object().unwrap().clone();
        m.remove("reply_spin_us");
        let back: GuestSpec = serde_json::from_value(serde_json::Value::Object(m)).unwrap();
        assert_eq!(back.reply_spin_us, None);
    }
}
