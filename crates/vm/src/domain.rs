//! A libvirt domain definition (`virsh dumpxml`) as a pagefleet VM.
//!
//! Operators' VMs are often defined as libvirt domains. [`from_xml`] maps
//! what pagefleet runs — memory, vCPUs, machine, a direct kernel, file
//! disks on virtio (one qcow2 overlay over a base), one bridged virtio NIC
//! with its MAC, SeaBIOS or UEFI with its variable store — and refuses
//! every element that would change what the guest sees or keeps if it were
//! dropped (a passed-through device, a shared directory, Secure Boot, a
//! SATA disk the guest mounts by its device name, ...), naming the element.
//! Devices that only serve a person at a screen or a host-side tool
//! (graphics, video, sound, input, the memory balloon, controllers QEMU
//! adds by itself, guest-agent channels) are left out and listed, so the
//! caller can show what was dropped.
//!
//! The parser is roxmltree with DTDs refused (no entity expansion), on a
//! file the CLI reads (at most [`MAX_XML`] bytes); the daemon never sees
//! XML, only the typed spec this produces.
//!
//! pagefleet's own settings for the guest — its address and its
//! settings line — go in the domain's metadata, where libvirt keeps an
//! application's data:
//!
//! ```xml
//! <metadata>
//!   <pagefleet:guest xmlns:pagefleet="urn:pagefleet:guest:1"
//!       ip="10.200.77.151/24" gw="10.200.77.1" config="memcached_mb=96"/>
//! </metadata>
//! ```

use pagefleet_api::{DiskFormat, MacAddr, VmDisk, VmMachine, VmNic, Workload};
use roxmltree::Node;

/// Most bytes of a domain definition.
pub const MAX_XML: usize = 1 << 20;

/// The namespace of pagefleet's element in a domain's `<metadata>`.
pub const METADATA_NS: &str = "urn:pagefleet:guest:1";

/// A domain mapped to a VM.
#[derive(Clone, Debug, PartialEq)]
pub struct Mapped {
    /// The domain's `<name>`.
    pub name: String,
    /// Its memory, bytes (`<memory>`).
    pub size: u64,
    /// The VM (a `Workload::Vm`).
    pub workload: Workload,
    /// What was left out and why, one line each (`devices/graphics
    /// (vnc): ...`).
    pub left_out: Vec<String>,
}

impl Mapped {
    /// What the VM has, in one line: vCPUs, machine, boot, disks, NIC.
    pub fn summary(&self) -> String {
        let Workload::Vm {
            kernel,
            disks,
            nic,
            smp,
            machine,
            firmware,
            ..
        } = &self.workload
        else {
            return String::new();
        };
        let mut parts = vec![
            format!("{smp} vCPU{}", if *smp == 1 { "" } else { "s" }),
            format!("machine {}", machine.as_str()),
            match firmware {
                pagefleet_api::VmFirmware::Bios => "SeaBIOS".into(),
                pagefleet_api::VmFirmware::Uefi { nvram } => format!("UEFI (variables {nvram})"),
            },
            match kernel {
                Some(k) => format!("kernel {k}"),
                None => "boots its first disk".into(),
            },
        ];
        for d in disks {
            parts.push(format!(
                "disk {} ({}{}{})",
                d.path,
                d.format
                    .map(|f| f.as_str())
                    .unwrap_or("format from its header"),
                if d.readonly { ", read-only" } else { "" },
                d.overlay
                    .as_ref()
                    .map(|o| format!(", read-only base of overlay {o}"))
                    .unwrap_or_default()
            ));
        }
        if let Some(n) = nic {
            parts.push(format!(
                "NIC {}{}",
                n.mac
                    .map(|m| m.to_string())
                    .unwrap_or_else(|| "(MAC from the guest's name)".into()),
                n.ip.map(|ip| format!(" address {ip}")).unwrap_or_default()
            ));
        }
        parts.join(", ")
    }
}

/// Why a domain cannot be mapped.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum DomainError {
    /// Not well-formed XML, or not a domain.
    #[error("domain XML: {0}")]
    Xml(String),
    /// An element pagefleet does not run.
    #[error("domain XML: {element}: {why}")]
    Unsupported {
        /// The element, as a path with what identifies it
        /// (`devices/disk[2] (vdb)`).
        element: String,
        /// Why, and what to do instead.
        why: String,
    },
}

fn unsupported(element: impl Into<String>, why: impl Into<String>) -> DomainError {
    DomainError::Unsupported {
        element: element.into(),
        why: why.into(),
    }
}

/// Top-level elements with no effect on what pagefleet runs.
const IGNORED_TOP: &[&str] = &[
    "uuid",
    "title",
    "description",
    "genid",
    "clock",
    "on_poweroff",
    "on_crash",
    "pm",
    "features",
    "seclabel",
    "resource",
];

/// Device elements left out: they serve a screen, a host-side tool or are
/// what QEMU adds by itself.
const LEFT_OUT_DEVICES: &[(&str, &str)] = &[
    ("emulator", "the host's QEMU runs the VM"),
    (
        "controller",
        "QEMU's own controllers serve the virtio devices",
    ),
    ("input", "no display: the VM has its serial console"),
    ("graphics", "no display: the VM has its serial console"),
    ("video", "no display: the VM has its serial console"),
    ("sound", "no sound device"),
    ("audio", "no sound device"),
    (
        "memballoon",
        "no balloon: the VM's memory is paged under its budget",
    ),
    ("channel", "no guest-agent channel"),
    (
        "serial",
        "the VM's serial console is pagefleet's, logged on its host",
    ),
    (
        "console",
        "the VM's serial console is pagefleet's, logged on its host",
    ),
    ("rng", "no virtio-rng device"),
    ("hub", "no USB"),
    ("redirdev", "no USB redirection"),
    ("redirfilter", "no USB redirection"),
];

/// `<memory unit=...>N</memory>` in bytes.
fn memory_bytes(n: Node) -> Result<u64, DomainError> {
    let el = n.tag_name().name();
    let text = n.text().unwrap_or("").trim();
    let v: u64 = text
        .parse()
        .map_err(|_| DomainError::Xml(format!("{el}: {text:?} is not a number")))?;
    let unit = n.attribute("unit").unwrap_or("KiB");
    let mult: u64 = match unit {
        "b" | "bytes" => 1,
        "KB" => 1000,
        "k" | "KiB" => 1 << 10,
        "MB" => 1000 * 1000,
        "M" | "MiB" => 1 << 20,
        "GB" => 1000 * 1000 * 1000,
        "G" | "GiB" => 1 << 30,
        "TB" => 1000 * 1000 * 1000 * 1000,
        "T" | "TiB" => 1 << 40,
        _ => return Err(DomainError::Xml(format!("{el}: unit {unit:?}"))),
    };
    v.checked_mul(mult)
        .ok_or_else(|| DomainError::Xml(format!("{el}: {v} {unit} is too large")))
}

fn elements<'a, 'i>(n: Node<'a, 'i>) -> impl Iterator<Item = Node<'a, 'i>> {
    n.children().filter(|c| c.is_element())
}

/// Map a libvirt domain definition.
pub fn from_xml(text: &str) -> Result<Mapped, DomainError> {
    if text.len() > MAX_XML {
        return Err(DomainError::Xml(format!(
            "{} bytes: at most {MAX_XML}",
            text.len()
        )));
    }
    let doc = roxmltree::Document::parse_with_options(
        text,
        roxmltree::ParsingOptions {
            allow_dtd: false,
            ..Default::default()
        },
    )
    .map_err(|e| DomainError::Xml(e.to_string()))?;
    let root = doc.root_element();
    if root.tag_name().name() != "domain" {
        return Err(DomainError::Xml(format!(
            "the root element is <{}>, not <domain>",
            root.tag_name().name()
        )));
    }
    match root.attribute("type") {
        Some("kvm") | Some("qemu") | None => {}
        Some(t) => {
            return Err(unsupported(
                format!("domain type='{t}'"),
                "pagefleet runs QEMU VMs (type='kvm' or 'qemu')",
            ))
        }
    }
    let mut m = Mapping::default();
    for n in elements(root) {
        let tag = n.tag_name().name();
        match tag {
            "name" => m.name = n.text().unwrap_or("").trim().to_string(),
            "memory" => m.size = Some(memory_bytes(n)?),
            "currentMemory" => m.current = Some(memory_bytes(n)?),
            "vcpu" => {
                let t = n.text().unwrap_or("").trim();
                let v: u32 = t
                    .parse()
                    .map_err(|_| DomainError::Xml(format!("vcpu: {t:?} is not a number")))?;
                if let Some(c) = n.attribute("current") {
                    if c.parse::<u32>() != Ok(v) {
                        return Err(unsupported(
                            format!("vcpu current='{c}'"),
                            "vCPU hot-plug: give the vCPUs the VM runs with",
                        ));
                    }
                }
                if n.attribute("cpuset").is_some() {
                    m.left_out
                        .push("vcpu cpuset: pagefleet does not pin vCPUs".into());
                }
                m.smp = v;
            }
            "os" => m.os(n)?,
            "devices" => m.devices(n)?,
            "metadata" => m.metadata(n)?,
            "cpu" => m.left_out.push(format!(
                "cpu{}: QEMU's default CPU model for its accelerator",
                n.attribute("mode")
                    .map(|x| format!(" mode='{x}'"))
                    .unwrap_or_default()
            )),
            "on_reboot" => {
                if n.text().map(str::trim) != Some("destroy") {
                    m.left_out.push(
                        "on_reboot: a reboot ends the VM (QEMU runs -no-reboot); its host reports it failed"
                            .into(),
                    );
                }
            }
            t if IGNORED_TOP.contains(&t) => {}
            "maxMemory" => {
                return Err(unsupported(
                    "maxMemory",
                    "memory hot-plug: give the VM's <memory> only",
                ))
            }
            "memoryBacking" | "numatune" | "memtune" => {
                return Err(unsupported(
                    tag,
                    "a pagefleet VM's memory is its region (paged under its budget, split and gathered): remove it",
                ))
            }
            t => {
                return Err(unsupported(
                    t,
                    "not something pagefleet runs (it maps name, memory, vcpu, os, devices and metadata)",
                ))
            }
        }
    }
    m.finish()
}

#[derive(Default)]
struct Mapping {
    name: String,
    size: Option<u64>,
    current: Option<u64>,
    smp: u32,
    machine: VmMachine,
    kernel: Option<String>,
    initrd: Option<String>,
    append: String,
    disks: Vec<VmDisk>,
    nic: Option<VmNic>,
    /// The interface element, for messages.
    nic_at: Option<String>,
    guest_config: String,
    left_out: Vec<String>,
    /// `os firmware='efi'` or a pflash `loader`.
    uefi: bool,
    /// `os/nvram`: the VM's UEFI variable store.
    nvram: Option<String>,
}

impl Mapping {
    fn os(&mut self, os: Node) -> Result<(), DomainError> {
        match os.attribute("firmware") {
            None | Some("bios") => {}
            Some("efi") => self.uefi = true,
            Some(f) => {
                return Err(unsupported(
                    format!("os firmware='{f}'"),
                    "the firmware is bios (SeaBIOS) or efi (OVMF)",
                ))
            }
        }
        for n in elements(os) {
            let tag = n.tag_name().name();
            let text = || n.text().unwrap_or("").trim().to_string();
            match tag {
                "type" => {
                    if let Some(a) = n.attribute("arch") {
                        if a != "x86_64" {
                            return Err(unsupported(
                                format!("os/type arch='{a}'"),
                                "pagefleet runs x86_64 VMs",
                            ));
                        }
                    }
                    if text() != "hvm" {
                        return Err(unsupported(
                            format!("os/type {}", text()),
                            "pagefleet runs full virtual machines (hvm)",
                        ));
                    }
                    if let Some(mt) = n.attribute("machine") {
                        self.machine = if mt == "pc" || mt.starts_with("pc-i440fx") {
                            VmMachine::Pc
                        } else if mt == "q35" || mt.starts_with("pc-q35") {
                            VmMachine::Q35
                        } else {
                            return Err(unsupported(
                                format!("os/type machine='{mt}'"),
                                "the machine is pc (i440FX) or q35",
                            ));
                        };
                        if mt.contains('-') {
                            self.left_out.push(format!(
                                "os/type machine='{mt}': this host QEMU's current {} machine",
                                self.machine.as_str()
                            ));
                        }
                    }
                }
                "loader" => {
                    if n.attribute("secure") == Some("yes") {
                        return Err(unsupported(
                            "os/loader secure='yes'".to_string(),
                            "Secure Boot is not supported: the VM boots through OVMF without it",
                        ));
                    }
                    match n.attribute("type") {
                        Some("pflash") => self.uefi = true,
                        t => {
                            return Err(unsupported(
                                format!("os/loader type='{}'", t.unwrap_or("")),
                                "a UEFI loader is pflash (OVMF); without a loader the VM boots through SeaBIOS",
                            ))
                        }
                    }
                    self.left_out.push(format!(
                        "os/loader {}: this host's OVMF ({})",
                        text(),
                        crate::firmware::ovmf_code().display()
                    ));
                }
                "nvram" => {
                    if text().is_empty() {
                        return Err(unsupported(
                            "os/nvram".to_string(),
                            "the VM's UEFI variable store needs a path (<nvram>/path/NAME_VARS.fd</nvram>)",
                        ));
                    }
                    self.nvram = Some(text());
                }
                "firmware" => {
                    let secure = elements(n).any(|f| {
                        f.attribute("name") == Some("secure-boot")
                            && f.attribute("enabled") == Some("yes")
                    });
                    if secure {
                        return Err(unsupported(
                            "os/firmware/feature secure-boot".to_string(),
                            "Secure Boot is not supported: the VM boots through OVMF without it",
                        ));
                    }
                }
                "kernel" => self.kernel = Some(text()),
                "initrd" => self.initrd = Some(text()),
                "cmdline" => self.append = text(),
                "boot" => match n.attribute("dev") {
                    Some("hd") => {}
                    d => {
                        return Err(unsupported(
                            format!("os/boot dev='{}'", d.unwrap_or("")),
                            "the VM boots from its first disk (dev='hd') or a direct kernel",
                        ))
                    }
                },
                "bootmenu" | "bios" | "smbios" | "acpi" => {}
                t => {
                    return Err(unsupported(
                        format!("os/{t}"),
                        "not something pagefleet runs",
                    ))
                }
            }
        }
        Ok(())
    }

    fn devices(&mut self, devs: Node) -> Result<(), DomainError> {
        let mut disk_no = 0;
        for n in elements(devs) {
            let tag = n.tag_name().name();
            match tag {
                "disk" => {
                    disk_no += 1;
                    self.disk(n, disk_no)?
                }
                "interface" => self.interface(n)?,
                t => {
                    if let Some((_, why)) = LEFT_OUT_DEVICES.iter().find(|(d, _)| *d == t) {
                        let kind = n
                            .attribute("type")
                            .map(|x| format!(" ({x})"))
                            .unwrap_or_default();
                        let line = format!("devices/{t}{kind}: {why}");
                        if !self.left_out.contains(&line) {
                            self.left_out.push(line);
                        }
                    } else {
                        return Err(unsupported(
                            format!("devices/{t}"),
                            match t {
                                "hostdev" => "a passed-through host device cannot move with the VM",
                                "filesystem" => "a directory shared from the host does not follow the VM to another host",
                                "memory" => "memory hot-plug (DIMMs): give the VM's <memory> only",
                                _ => "pagefleet VMs have virtio disks, one virtio NIC and a serial console",
                            },
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    fn disk(&mut self, d: Node, no: usize) -> Result<(), DomainError> {
        let target = d
            .children()
            .find(|c| c.has_tag_name("target"))
            .and_then(|t| t.attribute("dev"))
            .unwrap_or("?");
        let at = format!("devices/disk[{no}] ({target})");
        let device = d.attribute("device").unwrap_or("disk");
        if device != "disk" {
            return Err(unsupported(
                format!("{at} device='{device}'"),
                "a VM's disks are disk images (no CD-ROM, floppy or LUN)",
            ));
        }
        let ty = d.attribute("type").unwrap_or("file");
        if ty != "file" {
            return Err(unsupported(
                format!("{at} type='{ty}'"),
                "a disk is an image file (type='file') on storage every host that may run the VM sees",
            ));
        }
        let mut disk = VmDisk {
            path: String::new(),
            format: None,
            readonly: false,
            overlay: None,
        };
        // A <backingStore> one level deep: (its image, its format).
        let mut backing: Option<(String, Option<DiskFormat>)> = None;
        for n in elements(d) {
            let tag = n.tag_name().name();
            match tag {
                "driver" => {
                    disk.format = match n.attribute("type") {
                        None => None,
                        Some("raw") => Some(DiskFormat::Raw),
                        Some("qcow2") => Some(DiskFormat::Qcow2),
                        Some(f) => {
                            return Err(unsupported(
                                format!("{at}/driver type='{f}'"),
                                "disk images are raw or qcow2 (qemu-img convert -O qcow2)",
                            ))
                        }
                    };
                    if n.attribute("cache").is_some() || n.attribute("io").is_some() {
                        self.left_out.push(format!(
                            "{at}/driver cache/io: QEMU's defaults"
                        ));
                    }
                }
                "source" => {
                    disk.path = n
                        .attribute("file")
                        .ok_or_else(|| {
                            unsupported(format!("{at}/source"), "a disk needs file='/path/image'")
                        })?
                        .to_string()
                }
                "target" => match n.attribute("bus") {
                    Some("virtio") | None => {}
                    Some(b) => {
                        return Err(unsupported(
                            format!("{at}/target bus='{b}'"),
                            "disks are attached as virtio-blk (the guest sees /dev/vdX); a guest that mounts by UUID or LABEL boots the same with bus='virtio'",
                        ))
                    }
                },
                "readonly" => disk.readonly = true,
                "shareable" => {}
                "transient" => {
                    return Err(unsupported(
                        format!("{at}/transient"),
                        "writes to a throw-away overlay would be lost when the VM moves: give a writable image or <readonly/>",
                    ))
                }
                "backingStore" => {
                    // Empty: libvirt's way of saying "no backing image".
                    if elements(n).next().is_none() {
                        continue;
                    }
                    let mut file = None;
                    let mut format = None;
                    for b in elements(n) {
                        match b.tag_name().name() {
                            "source" => file = b.attribute("file").map(str::to_string),
                            "format" => {
                                format = match b.attribute("type") {
                                    Some("raw") => Some(DiskFormat::Raw),
                                    Some("qcow2") => Some(DiskFormat::Qcow2),
                                    f => {
                                        return Err(unsupported(
                                            format!("{at}/backingStore/format type='{}'", f.unwrap_or("")),
                                            "a base image is raw or qcow2",
                                        ))
                                    }
                                }
                            }
                            "backingStore" if elements(b).next().is_some() => {
                                return Err(unsupported(
                                    format!("{at}/backingStore/backingStore"),
                                    "a backing chain deeper than one base: give the base as a whole image (qemu-img convert -O qcow2) under one overlay",
                                ))
                            }
                            _ => {}
                        }
                    }
                    let file = file.ok_or_else(|| {
                        unsupported(
                            format!("{at}/backingStore"),
                            "a base image needs <source file='/path/image'/>",
                        )
                    })?;
                    if n.attribute("type").is_some_and(|t| t != "file") {
                        return Err(unsupported(
                            format!("{at}/backingStore type"),
                            "a base image is an image file (type='file')",
                        ));
                    }
                    backing = Some((file, format));
                }
                "boot" => {
                    if no != 1 {
                        self.left_out.push(format!(
                            "{at}/boot: the firmware boots the first disk"
                        ));
                    }
                }
                "iotune" => self.left_out.push(format!(
                    "{at}/iotune: no throttle (pagefleet ioqos guarantees disk I/O through the operator QMP socket)"
                )),
                "address" | "alias" | "serial" | "wwn" | "vendor" | "product" | "geometry"
                | "blockio" => {}
                t => {
                    return Err(unsupported(
                        format!("{at}/{t}"),
                        "not something pagefleet attaches",
                    ))
                }
            }
        }
        if disk.path.is_empty() {
            return Err(unsupported(at.clone(), "a disk with no <source file=...>"));
        }
        // An overlay over a base: the base is the disk's image, read-only,
        // and the overlay (a qcow2 file) takes the writes.
        if let Some((base, format)) = backing {
            if disk.format == Some(DiskFormat::Raw) {
                return Err(unsupported(
                    format!("{at}/driver type='raw'"),
                    "a disk over a <backingStore> is a qcow2 overlay",
                ));
            }
            if disk.readonly {
                return Err(unsupported(
                    format!("{at}/readonly"),
                    "a disk over a <backingStore> is the overlay the VM writes; drop <readonly/> or the backing store",
                ));
            }
            disk.overlay = Some(std::mem::replace(&mut disk.path, base));
            disk.format = format;
        }
        self.disks.push(disk);
        Ok(())
    }

    fn interface(&mut self, i: Node) -> Result<(), DomainError> {
        let ty = i.attribute("type").unwrap_or("");
        let at = format!("devices/interface type='{ty}'");
        if let Some(prev) = &self.nic_at {
            return Err(unsupported(
                at,
                format!("a pagefleet VM has one NIC (the first was {prev})"),
            ));
        }
        if ty != "bridge" {
            return Err(unsupported(
                at,
                "the VM's NIC joins its host's VM bridge (pagefleetd --vm-bridge): use type='bridge'",
            ));
        }
        let mut nic = VmNic::default();
        let mut model = None;
        for n in elements(i) {
            let tag = n.tag_name().name();
            match tag {
                "mac" => {
                    let a = n.attribute("address").unwrap_or("");
                    let mac: MacAddr = a.parse().map_err(|e: String| {
                        unsupported(format!("{at}/mac"), e)
                    })?;
                    nic.mac = Some(mac);
                }
                "model" => model = n.attribute("type").map(str::to_string),
                "source" => {
                    if let Some(b) = n.attribute("bridge") {
                        self.left_out.push(format!(
                            "{at}/source bridge='{b}': the NIC joins the bridge of the host the VM runs on (pagefleetd --vm-bridge)"
                        ));
                    }
                }
                "bandwidth" => self
                    .left_out
                    .push(format!("{at}/bandwidth: no NIC rate limit")),
                "target" | "alias" | "address" | "link" | "mtu" => {}
                t => {
                    return Err(unsupported(
                        format!("{at}/{t}"),
                        "not something pagefleet sets up (a tap on the host's VM bridge, no VLAN or virtual port)",
                    ))
                }
            }
        }
        match model.as_deref() {
            Some("virtio") => {}
            m => {
                return Err(unsupported(
                    format!(
                        "{at}/model type='{}'",
                        m.unwrap_or("(none: libvirt's default)")
                    ),
                    "the NIC is virtio-net: <model type='virtio'/>",
                ))
            }
        }
        // The metadata (which may come first) gave its address.
        if let Some(m) = self.nic.take() {
            nic.ip = m.ip;
            nic.gw = m.gw;
        }
        self.nic = Some(nic);
        self.nic_at = Some(at);
        Ok(())
    }

    fn metadata(&mut self, md: Node) -> Result<(), DomainError> {
        for n in elements(md) {
            if n.tag_name().namespace() != Some(METADATA_NS) {
                continue; // another application's
            }
            if n.tag_name().name() != "guest" {
                return Err(unsupported(
                    format!("metadata/{}", n.tag_name().name()),
                    format!("pagefleet's metadata element is <guest xmlns='{METADATA_NS}'>"),
                ));
            }
            for a in n.attributes() {
                match a.name() {
                    "ip" => {
                        let ip = a
                            .value()
                            .parse()
                            .map_err(|e: String| unsupported("metadata/guest ip", e))?;
                        self.nic.get_or_insert_with(VmNic::default).ip = Some(ip);
                    }
                    "gw" => {
                        let gw = a
                            .value()
                            .parse()
                            .map_err(|_| unsupported("metadata/guest gw", "an IPv4 address"))?;
                        self.nic.get_or_insert_with(VmNic::default).gw = Some(gw);
                    }
                    "config" => self.guest_config = a.value().to_string(),
                    o => {
                        return Err(unsupported(
                            format!("metadata/guest {o}"),
                            "pagefleet's guest metadata has ip, gw and config",
                        ))
                    }
                }
            }
        }
        Ok(())
    }

    fn finish(mut self) -> Result<Mapped, DomainError> {
        let size = self
            .size
            .ok_or_else(|| DomainError::Xml("no <memory>".into()))?;
        if size == 0 || size % (1 << 20) != 0 {
            return Err(unsupported(
                "memory",
                format!("{size} bytes: a whole number of MiB"),
            ));
        }
        if let Some(c) = self.current {
            if c != size {
                self.left_out.push(format!(
                    "currentMemory ({} MiB): the VM has all of its memory ({} MiB), paged under its budget",
                    c >> 20,
                    size >> 20
                ));
            }
        }
        if self.name.is_empty() {
            return Err(DomainError::Xml("no <name>".into()));
        }
        // ip/gw in the metadata with no interface: no NIC to put them on.
        if self.nic.is_some() && self.nic_at.is_none() {
            return Err(unsupported(
                "metadata/guest ip",
                "an address for a VM with no <interface type='bridge'>",
            ));
        }
        if let Some(n) = &self.nic {
            n.validate()
                .map_err(|e| unsupported(self.nic_at.clone().unwrap_or_default(), e))?;
        }
        let w = Workload::Vm {
            kernel: self.kernel,
            initrd: self.initrd,
            append: self.append,
            disks: self.disks,
            disk: None,
            disk_readonly: false,
            listen: None,
            guest_port: 11211,
            smp: self.smp.max(1),
            nic: self.nic,
            guest_config: self.guest_config,
            machine: self.machine,
            firmware: match (self.uefi, self.nvram) {
                (true, Some(nvram)) => pagefleet_api::VmFirmware::Uefi { nvram },
                (true, None) => {
                    return Err(unsupported(
                        "os/nvram".to_string(),
                        "a UEFI VM needs its variable store's path (<nvram>/path/NAME_VARS.fd</nvram>): it moves with the VM",
                    ))
                }
                (false, Some(_)) => {
                    return Err(unsupported(
                        "os/nvram".to_string(),
                        "a variable store goes with UEFI firmware (os firmware='efi' or a pflash loader)",
                    ))
                }
                (false, None) => pagefleet_api::VmFirmware::Bios,
            },
        };
        w.validate().map_err(|e| DomainError::Xml(e.0))?;
        Ok(Mapped {
            name: self.name,
            size,
            workload: w,
            left_out: self.left_out,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WEB1: &str = r#"<domain type='kvm'>
  <name>web1</name>
  <uuid>1aabde38-c406-49b2-ac43-07ae96b5d07c</uuid>
  <memory unit='KiB'>2097152</memory>
  <currentMemory unit='KiB'>1048576</currentMemory>
  <vcpu placement='static'>2</vcpu>
  <metadata>
    <other:x xmlns:other="http://example.org/other">kept by libvirt, not ours</other:x>
    <pagefleet:guest xmlns:pagefleet="urn:pagefleet:guest:1" ip="10.200.77.151/24" gw="10.200.77.1" config="memcached_mb=96"/>
  </metadata>
  <os>
    <type arch='x86_64' machine='pc-q35-7.2'>hvm</type>
    <boot dev='hd'/>
  </os>
  <features><acpi/><apic/></features>
  <cpu mode='host-passthrough'/>
  <clock offset='utc'/>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>restart</on_reboot>
  <devices>
    <emulator>/usr/bin/qemu-system-x86_64</emulator>
    <disk type='file' device='disk'>
      <driver name='qemu' type='qcow2'/>
      <source file='/srv/images/web1.qcow2'/>
      <target dev='vda' bus='virtio'/>
    </disk>
    <disk type='file' device='disk'>
      <driver name='qemu' type='raw'/>
      <source file='/srv/images/seed.img'/>
      <target dev='vdb' bus='virtio'/>
      <readonly/>
    </disk>
    <interface type='bridge'>
      <mac address='52:54:00:aa:bb:cc'/>
      <source bridge='br0'/>
      <model type='virtio'/>
    </interface>
    <serial type='pty'><target port='0'/></serial>
    <console type='pty'><target type='serial' port='0'/></console>
    <graphics type='vnc' port='-1'/>
    <video><model type='virtio'/></video>
    <memballoon model='virtio'/>
  </devices>
</domain>"#;

    #[test]
    fn a_domain_maps_to_a_vm_and_lists_what_it_leaves_out() {
        let m = from_xml(WEB1).unwrap();
        assert_eq!(m.name, "web1");
        assert_eq!(m.size, 2 << 30);
        let Workload::Vm {
            disks,
            nic,
            smp,
            machine,
            guest_config,
            kernel,
            ..
        } = &m.workload
        else {
            panic!("not a VM")
        };
        assert_eq!(*smp, 2);
        assert_eq!(*machine, VmMachine::Q35);
        assert_eq!(kernel, &None);
        assert_eq!(disks.len(), 2);
        assert_eq!(disks[0].format, Some(DiskFormat::Qcow2));
        assert!(!disks[0].readonly && disks[1].readonly);
        let nic = nic.as_ref().unwrap();
        assert_eq!(nic.mac.unwrap().to_string(), "52:54:00:aa:bb:cc");
        assert_eq!(nic.ip.unwrap().to_string(), "10.200.77.151/24");
        assert_eq!(guest_config, "memcached_mb=96");
        let out = m.left_out.join("\n");
        for what in [
            "currentMemory",
            "devices/graphics (vnc)",
            "devices/video",
            "devices/memballoon",
            "source bridge='br0'",
            "cpu mode='host-passthrough'",
            "on_reboot",
        ] {
            assert!(out.contains(what), "{what} not listed: {out}");
        }
    }

    fn refused(xml: &str) -> String {
        match from_xml(xml) {
            Err(DomainError::Unsupported { element, .. }) => element,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn what_would_change_the_guest_is_refused_by_name() {
        let with = |old: &str, new: &str| {
            assert!(WEB1.contains(old), "{old}");
            WEB1.replacen(old, new, 1)
        };
        let hostdev = with(
            "<memballoon model='virtio'/>",
            "<hostdev mode='subsystem' type='pci'/>",
        );
        assert_eq!(refused(&hostdev), "devices/hostdev");
        let sata = with(
            "<target dev='vda' bus='virtio'/>",
            "<target dev='sda' bus='sata'/>",
        );
        assert_eq!(refused(&sata), "devices/disk[1] (sda)/target bus='sata'");
        let cdrom = with(
            "<disk type='file' device='disk'>\n      <driver name='qemu' type='raw'/>",
            "<disk type='file' device='cdrom'>\n      <driver name='qemu' type='raw'/>",
        );
        assert_eq!(refused(&cdrom), "devices/disk[2] (vdb) device='cdrom'");
        let uefi = with(
            "<boot dev='hd'/>",
            "<loader readonly='yes' type='pflash'>/usr/share/OVMF/OVMF_CODE.fd</loader>",
        );
        assert_eq!(refused(&uefi), "os/nvram");
        let secure = with(
            "<boot dev='hd'/>",
            "<loader readonly='yes' secure='yes' type='pflash'>/usr/share/OVMF/OVMF_CODE.secboot.fd</loader>",
        );
        assert_eq!(refused(&secure), "os/loader secure='yes'");
        let rom = with(
            "<boot dev='hd'/>",
            "<loader type='rom'>/usr/share/seabios/bios.bin</loader>",
        );
        assert_eq!(refused(&rom), "os/loader type='rom'");
        let nat = with("<interface type='bridge'>", "<interface type='network'>");
        assert_eq!(refused(&nat), "devices/interface type='network'");
        let e1000 = with(
            "<model type='virtio'/>\n    </interface>",
            "<model type='e1000'/>\n    </interface>",
        );
        assert_eq!(
            refused(&e1000),
            "devices/interface type='bridge'/model type='e1000'"
        );
        let fs = with("<memballoon model='virtio'/>", "<filesystem type='mount'/>");
        assert_eq!(refused(&fs), "devices/filesystem");
        let hugepages = with(
            "<features>",
            "<memoryBacking><hugepages/></memoryBacking><features>",
        );
        assert_eq!(refused(&hugepages), "memoryBacking");
        let vlan = with("<source bridge='br0'/>", "<vlan><tag id='42'/></vlan>");
        assert_eq!(refused(&vlan), "devices/interface type='bridge'/vlan");
        let xen = with("<domain type='kvm'>", "<domain type='xen'>");
        assert_eq!(refused(&xen), "domain type='xen'");
        let arm = with("arch='x86_64'", "arch='aarch64'");
        assert_eq!(refused(&arm), "os/type arch='aarch64'");
        let netboot = with("<boot dev='hd'/>", "<boot dev='network'/>");
        assert_eq!(refused(&netboot), "os/boot dev='network'");
    }

    #[test]
    fn a_uefi_domain_keeps_its_variable_store() {
        let efi = WEB1.replacen(
            "<os>",
            "<os firmware='efi'>",
            1,
        )
        .replacen(
            "<boot dev='hd'/>",
            "<firmware><feature enabled='no' name='secure-boot'/></firmware><loader readonly='yes' type='pflash'>/usr/share/OVMF/OVMF_CODE_4M.fd</loader><nvram template='/usr/share/OVMF/OVMF_VARS_4M.fd'>/srv/vms/web1_VARS.fd</nvram><boot dev='hd'/>",
            1,
        );
        let m = from_xml(&efi).unwrap();
        let Workload::Vm { firmware, .. } = &m.workload else {
            panic!("not a VM")
        };
        assert_eq!(
            firmware,
            &pagefleet_api::VmFirmware::Uefi {
                nvram: "/srv/vms/web1_VARS.fd".into()
            }
        );
        assert!(
            m.left_out.iter().any(|l| l.starts_with("os/loader")),
            "{:?}",
            m.left_out
        );
        // firmware='efi' without a store: refused, naming the element.
        let bare = WEB1.replacen("<os>", "<os firmware='efi'>", 1);
        assert_eq!(refused(&bare), "os/nvram");
        let secure = efi.replace(
            "enabled='no' name='secure-boot'",
            "enabled='yes' name='secure-boot'",
        );
        assert_eq!(refused(&secure), "os/firmware/feature secure-boot");
    }

    #[test]
    fn a_disk_over_a_backing_store_is_an_overlay_over_its_base() {
        let one = |store: &str| {
            WEB1.replacen(
                "<source file='/srv/images/web1.qcow2'/>",
                &format!("<source file='/srv/vms/web1.qcow2'/>{store}"),
                1,
            )
        };
        let base = "<backingStore type='file'><format type='raw'/><source file='/srv/images/debian.img'/><backingStore/></backingStore>";
        let m = from_xml(&one(base)).unwrap();
        let Workload::Vm { disks, .. } = &m.workload else {
            panic!("not a VM")
        };
        assert_eq!(disks[0].path, "/srv/images/debian.img");
        assert_eq!(disks[0].format, Some(DiskFormat::Raw));
        assert_eq!(disks[0].overlay.as_deref(), Some("/srv/vms/web1.qcow2"));
        assert!(!disks[0].readonly);
        // libvirt's empty <backingStore/> says "no base".
        let m = from_xml(&one("<backingStore/>")).unwrap();
        let Workload::Vm { disks, .. } = &m.workload else {
            panic!("not a VM")
        };
        assert_eq!(disks[0].overlay, None);
        // A chain deeper than one base, and a base with no file.
        let deep = "<backingStore type='file'><format type='qcow2'/><source file='/srv/images/mid.qcow2'/><backingStore type='file'><source file='/srv/images/root.img'/></backingStore></backingStore>";
        assert_eq!(
            refused(&one(deep)),
            "devices/disk[1] (vda)/backingStore/backingStore"
        );
        let nofile = "<backingStore type='file'><format type='raw'/></backingStore>";
        assert_eq!(refused(&one(nofile)), "devices/disk[1] (vda)/backingStore");
    }

    #[test]
    fn malformed_or_hostile_xml_is_an_error_not_a_guess() {
        assert!(matches!(from_xml("<domain>"), Err(DomainError::Xml(_))));
        assert!(matches!(from_xml("<vm/>"), Err(DomainError::Xml(_))));
        // No DTD, so no entity expansion.
        let bomb = r#"<?xml version="1.0"?><!DOCTYPE d [<!ENTITY a "aaaa"><!ENTITY b "&a;&a;&a;">]><domain><name>&b;</name></domain>"#;
        assert!(matches!(from_xml(bomb), Err(DomainError::Xml(_))));
        assert!(matches!(
            from_xml(&"x".repeat(MAX_XML + 1)),
            Err(DomainError::Xml(_))
        ));
        // Memory in odd units, and not whole MiB.
        let odd = WEB1.replace(
            "<memory unit='KiB'>2097152</memory>",
            "<memory unit='KiB'>2097153</memory>",
        );
        assert_eq!(refused(&odd), "memory");
        let gib = WEB1.replace(
            "<memory unit='KiB'>2097152</memory>",
            "<memory unit='GiB'>3</memory>",
        );
        assert_eq!(from_xml(&gib).unwrap().size, 3 << 30);
        // A relative disk path is refused by the spec's own checks.
        let rel = WEB1.replace("/srv/images/web1.qcow2", "web1.qcow2");
        assert!(matches!(from_xml(&rel), Err(DomainError::Xml(_))));
    }
}
