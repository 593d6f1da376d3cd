//! `pagefleet run <workload>`: a native guest on a pagefleet region.

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use pagefleet_api::{self as api, GuestSpec};
use pagefleet_common::units;
use pagefleet_guests::synthetic;
use pagefleet_region::{Policy, Secret};
use pagefleet_runner::local;
use std::path::Path;

#[derive(Args, Clone)]
#[command(args_conflicts_with_subcommands = false)]
pub struct RunArgs {
    #[command(subcommand)]
    pub workload: Option<Workload>,
    /// Make the memory mergeable by KSM (prctl PR_SET_MEMORY_MERGE; kept
    /// across fork and exec): `pagefleet run --merge -- CMD ARGS` runs CMD
    /// enrolled; with a workload, the workload's own memory is enrolled.
    #[arg(long, global = true)]
    pub merge: bool,
    /// The command to run (after `--`), instead of a workload.
    #[arg(last = true)]
    pub command: Vec<String>,
    /// Guest memory size (e.g. 2GiB). Default: 256MiB.
    #[arg(long, global = true, value_parser = units::parse_size)]
    pub size: Option<u64>,
    /// Pages allowed resident locally: a size (1GiB) or a percentage of --size (50%).
    /// Default: all of it.
    #[arg(long, global = true)]
    pub budget: Option<String>,
    /// Memory servers, comma-separated HOST:PORT.
    #[arg(long, global = true, value_delimiter = ',')]
    pub servers: Vec<String>,
    /// Copies of every remote page, on different memory servers (1 or 2).
    /// With 2 a server's death loses nothing: its pages are read from
    /// their mirrors and copied again to another server in the background.
    #[arg(long, global = true, default_value_t = 1)]
    pub replicas: usize,
    /// Victim choice: clock (reference bits read and re-armed by the victim
    /// hand as it passes; a chunk gives up its pages unused since the last
    /// look: the fewest page-ins, ~3x aging's minor faults) or aging (max
    /// 8-bit age per chunk, kept by the budgeted sampling hand, whole chunks
    /// evicted: few minor faults, victims a little better than FIFO). On the
    /// kv bench clock is ahead at a 50% budget and well ahead at 25%.
    #[arg(long, global = true, default_value_t = Policy::default())]
    pub policy: Policy,
    /// Pages per chunk (power of two, 1..64): the unit of eviction and placement.
    #[arg(long, global = true, default_value_t = 16)]
    pub chunk: usize,
    /// What a remote fault brings in besides its page: adaptive (a
    /// read-ahead window that grows while faults are sequential and is one
    /// page for random access) or chunk (the rest of the faulting chunk).
    #[arg(long, global = true, default_value = "adaptive")]
    pub prefetch: pagefleet_region::Prefetch,
    /// Worker threads.
    #[arg(long, global = true, default_value_t = 2)]
    pub threads: usize,
    /// Stop after this many seconds (0: until interrupted). Default:
    /// services (kv, vm) run until interrupted (Ctrl-C, SIGTERM); synthetic
    /// runs 10 s; sort runs to its end.
    #[arg(long, global = true)]
    pub duration: Option<u64>,
    /// Plain anonymous memory instead of a pagefleet region (the all-local baseline).
    #[arg(long, global = true)]
    pub plain: bool,
    /// CPU share of one core the access sampling may cost (`pagefleet run`
    /// also takes 0: no sampling, reference bits are read only when
    /// victims are chosen; hosted guests sample, split migration places
    /// chunks by their history).
    /// While it runs, SIGUSR1 stops the sampling hand and SIGUSR2 restarts it.
    #[arg(long, global = true, default_value_t = 0.01)]
    pub sample_budget: f64,
    /// How long the pager polls for a faulting page's reply before it
    /// sleeps, in µs, while the host has idle CPUs (never under load): on a
    /// virtual machine an idle CPU halts and waking it costs tens of µs.
    /// 0: never poll. Default: 200.
    #[arg(long, global = true, value_name = "US",
          value_parser = clap::value_parser!(u64).range(0..=pagefleet_api::guest::MAX_REPLY_SPIN_US))]
    pub reply_spin: Option<u64>,
    /// Print one JSON object with the outcome and the runtime's counters.
    #[arg(long, global = true)]
    pub json: bool,
    /// Hosted guests (`pagefleet guest start`): a service address that
    /// moves with the guest (added to the host daemon's service device, and
    /// on the destination after a migration). kv: listen on it.
    #[arg(long, global = true)]
    pub service_ip: Option<String>,
}

#[derive(Subcommand, Clone)]
pub enum Workload {
    /// Page-granular accesses: uniform, zipf[:θ], seq, hotcold[:frac:prob].
    Synthetic {
        /// The access distribution: uniform, zipf[:θ] (zipf:0.99), seq, hotcold[:frac:prob].
        #[arg(long, default_value = "zipf:0.99")]
        dist: synthetic::Dist,
        /// Fraction of operations that write.
        #[arg(long, default_value_t = 0.3)]
        write_frac: f64,
        /// Write every page once before measuring.
        #[arg(long)]
        prefill: bool,
        /// Operations per second, all threads together (default: as fast as
        /// possible; 0: idle after the prefill).
        #[arg(long)]
        rate: Option<f64>,
        /// Fraction of the pages the accesses fall on (the first ones).
        #[arg(long, default_value_t = 1.0)]
        span: f64,
        /// Prefill every page whole with pseudo-random bytes of this seed
        /// (implies --prefill; without it a page holds one word).
        #[arg(long)]
        fill_seed: Option<u64>,
        /// With --fill-seed: this fraction of the pages, spread over the
        /// memory, get content that is the same on every guest filled this
        /// way (controlled sharing, e.g. for `pagefleet bench dedup`).
        #[arg(long, default_value_t = 0.0, requires = "fill_seed")]
        fill_shared: f64,
    },
    /// Generate and sort fixed-size 100-byte records filling the memory (the S-memV sort experiment).
    Sort {
        /// Seed of the generated records.
        #[arg(long, default_value_t = 42)]
        seed: u64,
    },
    /// The S-memV sort experiment as a hosted guest (pagefleet guest start
    /// ... -- sortjob): records fill the last --sort-frac of the memory,
    /// other data the rest; it scans its records until asked to sort (control op `sort`).
    Sortjob {
        /// Share of the memory the records fill.
        #[arg(long, default_value_t = 0.5)]
        sort_frac: f64,
        /// Do not scan the records before sorting (the split then has no
        /// access history of the sort).
        #[arg(long)]
        no_warm: bool,
        /// Seed of the generated records.
        #[arg(long, default_value_t = 42)]
        seed: u64,
    },
    /// A memcached-protocol key-value server whose table lives in the memory.
    Kv {
        /// Address the memcached-protocol server listens on.
        #[arg(long, default_value = "127.0.0.1:11211")]
        listen: String,
        /// When the memory is full, refuse stores (SERVER_ERROR out of
        /// memory) instead of evicting the least recently used items of
        /// the same size class, memcached's default (memcached -M).
        #[arg(long)]
        no_evict: bool,
    },
    /// A QEMU (TCG) virtual machine whose RAM (--size) is the guest memory,
    /// booting a kernel (--kernel, --initrd, --append) or, without
    /// --kernel, through its firmware from its first --disk, as any QEMU
    /// VM. `make vm` builds a test image (target/vm): a kernel and an
    /// initramfs running vmwork, a memory workload that checks every value
    /// it reads, set on the kernel command line: vmwork_mb=N vmwork_secs=S
    /// (0: until stopped) vmwork_write=PCT vmwork_span=PCT (share of its
    /// pages it works on) vmwork_seed=N; and target/vm/boot.qcow2, a disk
    /// whose boot loader starts the same (`vm --disk
    /// target/vm/boot.qcow2`). `pagefleet run vm` ends when vmwork is done,
    /// QEMU exits or --duration passes (0: no limit); a wrong value read
    /// makes it fail.
    Vm {
        /// Guest kernel (bzImage); without it the VM boots from --disk.
        #[arg(long)]
        kernel: Option<std::path::PathBuf>,
        /// Its initramfs.
        #[arg(long, requires = "kernel")]
        initrd: Option<std::path::PathBuf>,
        /// Kernel command line, after console=ttyS0.
        #[arg(long, default_value = "", requires = "kernel")]
        append: String,
        /// A disk image, PATH[,format=raw|qcow2][,readonly|,overlay=FILE];
        /// repeat for more (virtio-blk drives disk0, disk1, ...; without
        /// --kernel the first is booted). The format is read from the
        /// image's header when not given (other formats, and qcow2 images
        /// that name a backing or data file, are refused), then kept with
        /// the guest. The guest's writes land in the image, or with
        /// overlay=FILE in that qcow2 overlay (made over PATH when the
        /// guest first starts; PATH stays read-only, one base for many
        /// VMs). A migration hands the written file to the destination's
        /// QEMU, which must see the same file (shared storage, as for
        /// QEMU's own migration).
        #[arg(long, value_parser = parse_disk)]
        disk: Vec<DiskArg>,
        /// Attach every --disk read-only (several VMs may then share one image).
        #[arg(long, requires = "disk")]
        disk_readonly: bool,
        /// The VM's service address: TCP connections to IP:PORT reach the
        /// guest's --guest-port (one NIC on QEMU's user-mode network; the
        /// guest can open no connection out). Like kv's --listen, it
        /// follows the VM when it migrates.
        #[arg(long)]
        listen: Option<String>,
        /// The guest's port behind --listen.
        #[arg(long, default_value_t = 11211, requires = "listen")]
        guest_port: u16,
        /// The VM's own NIC, bridge[,mac=M][,ip=A.B.C.D/N][,gw=A.B.C.D]:
        /// virtio-net on a tap in the host's VM bridge (pagefleetd
        /// --vm-bridge; --bridge for `pagefleet run`). The MAC (default:
        /// 52:54:00 and a hash of the guest's name) and the address stay
        /// the VM's on every host it moves to; QEMU announces it from the
        /// new host. The guest reads ip= and gw= at boot (see
        /// --guest-config); target/vm/debian.qcow2 sets them up.
        #[arg(long, value_parser = api::VmNic::parse_arg, conflicts_with = "listen")]
        nic: Option<api::VmNic>,
        /// The bridge --nic joins, for `pagefleet run` (a hosted VM's is
        /// its host's --vm-bridge).
        #[arg(long, requires = "nic")]
        bridge: Option<String>,
        /// key=value words the guest reads at boot from QEMU's firmware
        /// configuration (file opt/org.pagefleet/guest, after host=NAME
        /// and --nic's ip= and gw=); the Debian image reads
        /// memcached_mb=N. Printable ASCII, up to 1024 bytes.
        #[arg(long, default_value = "")]
        guest_config: String,
        /// Virtual CPUs.
        #[arg(long, default_value_t = 1)]
        smp: u32,
        /// The machine QEMU emulates: pc (i440FX) or q35.
        #[arg(long, default_value = "pc")]
        machine: api::VmMachine,
        /// The firmware: bios (SeaBIOS) or uefi (the host's OVMF, no Secure
        /// Boot; give --nvram).
        #[arg(long, default_value = "bios", value_parser = ["bios", "uefi"])]
        firmware: String,
        /// With --firmware uefi: the VM's UEFI variable store (boot entries
        /// and settings the guest writes), a file under the host's
        /// --vm-images, made from OVMF's template when the VM first starts
        /// and moved with the VM as a writable disk is.
        #[arg(long)]
        nvram: Option<std::path::PathBuf>,
    },
}

/// One `--disk PATH[,format=F][,readonly|,overlay=FILE]`.
#[derive(Clone, Debug)]
pub struct DiskArg {
    path: std::path::PathBuf,
    format: Option<api::DiskFormat>,
    readonly: bool,
    overlay: Option<std::path::PathBuf>,
}

fn parse_disk(s: &str) -> Result<DiskArg, String> {
    let mut parts = s.split(',');
    let path = parts
        .next()
        .filter(|p| !p.is_empty())
        .ok_or("a disk needs a path")?;
    let mut d = DiskArg {
        path: path.into(),
        format: None,
        readonly: false,
        overlay: None,
    };
    for p in parts {
        match p.split_once('=') {
            Some(("format", f)) => {
                d.format = Some(f.parse().map_err(|e: api::guest::InvalidSpec| e.0)?)
            }
            Some(("overlay", o)) if !o.is_empty() => d.overlay = Some(o.into()),
            None if p == "readonly" => d.readonly = true,
            _ => {
                return Err(format!(
                    "{p:?}: after the path, format=raw|qcow2, readonly or overlay=FILE"
                ))
            }
        }
    }
    if d.readonly && d.overlay.is_some() {
        return Err("readonly or overlay=FILE: an overlay is the disk's writable part".into());
    }
    Ok(d)
}

/// A path as given, made absolute against this directory (a hosted guest's
/// files are named on the host that runs it).
fn absolute(p: &Path) -> Result<String> {
    let p = if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir()?.join(p)
    };
    p.to_str()
        .map(str::to_string)
        .with_context(|| format!("{} is not UTF-8", p.display()))
}

/// Guest memory when --size is not given.
pub const DEFAULT_SIZE: u64 = 256 << 20;

/// How long synthetic runs when --duration is not given (services run
/// until interrupted).
const SYNTHETIC_SECS: u64 = 10;

/// A `--budget` (a size, 1GiB, or a percentage of the guest's memory, 50%)
/// in pages of a guest of `size` bytes; all of it when not given.
pub fn budget_pages(spec: Option<&str>, size: u64) -> Result<u64> {
    let pages = pagefleet_units::pages_for(size);
    Ok(match spec {
        None => pages,
        Some(s) if s.ends_with('%') => {
            let pct: f64 = s
                .trim_end_matches('%')
                .parse()
                .with_context(|| format!("bad --budget {s}"))?;
            if !(0.0..=100.0).contains(&pct) {
                bail!("--budget percentage must be 0..100");
            }
            ((pages as f64) * pct / 100.0) as u64
        }
        Some(s) => pagefleet_units::pages_in(units::parse_size(s).map_err(anyhow::Error::msg)?),
    })
}

/// A VM workload's typed form (paths made absolute, checked), hosted or
/// local.
fn vm_workload(w: &Workload) -> Result<api::Workload> {
    let w = match w {
        Workload::Vm {
            kernel,
            initrd,
            append,
            disk,
            disk_readonly,
            smp,
            listen,
            guest_port,
            nic,
            bridge: _,
            guest_config,
            machine,
            firmware,
            nvram,
        } => api::Workload::Vm {
            kernel: kernel.as_deref().map(absolute).transpose()?,
            initrd: initrd.as_deref().map(absolute).transpose()?,
            append: append.clone(),
            disks: disk
                .iter()
                .map(|d| {
                    Ok(api::VmDisk {
                        path: absolute(&d.path)?,
                        format: d.format,
                        readonly: (d.readonly || *disk_readonly) && d.overlay.is_none(),
                        overlay: d.overlay.as_deref().map(absolute).transpose()?,
                    })
                })
                .collect::<Result<_>>()?,
            disk: None,
            disk_readonly: false,
            smp: *smp,
            listen: listen.clone(),
            guest_port: *guest_port,
            nic: nic.clone(),
            guest_config: guest_config.clone(),
            machine: *machine,
            firmware: match (firmware.as_str(), nvram) {
                ("uefi", Some(n)) => api::VmFirmware::Uefi {
                    nvram: absolute(n)?,
                },
                ("uefi", None) => bail!(
                    "--firmware uefi needs --nvram FILE: the VM's UEFI variable store, which moves with it"
                ),
                (_, Some(_)) => bail!("--nvram goes with --firmware uefi"),
                _ => api::VmFirmware::Bios,
            },
        },
        _ => bail!("not a VM workload"),
    };
    w.validate()?;
    Ok(w)
}

/// A hosted guest's typed spec from `run`-style flags (`pagefleet guest
/// start NAME ... -- WORKLOAD FLAGS`): what the host daemon may start.
pub fn guest_spec(a: &RunArgs) -> Result<GuestSpec> {
    if a.merge || !a.command.is_empty() {
        bail!("a hosted guest runs a built-in workload; --merge and commands after -- are for `pagefleet run` on this machine only");
    }
    if a.plain {
        bail!("--plain guests cannot be hosted (they have no region to migrate)");
    }
    if a.duration.is_some() {
        bail!(
            "--duration: a hosted guest runs until `pagefleet guest stop NAME`; give no --duration"
        );
    }
    if a.json {
        bail!(
            "--json: a hosted guest prints nothing; `pagefleet guest status NAME --json` shows it"
        );
    }
    let workload = match &a.workload {
        Some(Workload::Synthetic {
            dist,
            write_frac,
            prefill,
            rate,
            span,
            fill_seed,
            fill_shared,
        }) => api::Workload::Synthetic {
            dist: dist.to_string(),
            write_frac: *write_frac,
            prefill: *prefill,
            rate: *rate,
            span: *span,
            fill: fill_seed.map(|seed| api::ContentFill {
                seed,
                shared: *fill_shared,
            }),
        },
        Some(Workload::Kv { listen, no_evict }) => api::Workload::Kv {
            listen: listen.clone(),
            no_evict: *no_evict,
        },
        Some(Workload::Sortjob {
            sort_frac,
            no_warm,
            seed,
        }) => api::Workload::Sortjob {
            sort_frac: *sort_frac,
            warm: !no_warm,
            seed: *seed,
        },
        Some(w @ Workload::Vm { bridge, .. }) => {
            if bridge.is_some() {
                bail!("--bridge is for `pagefleet run`: a hosted VM's NIC joins its host's bridge (pagefleetd --vm-bridge)");
            }
            vm_workload(w)?
        }
        Some(Workload::Sort { .. }) => {
            bail!("sort runs to completion; it cannot run hosted (use sortjob)")
        }
        None => bail!("name the guest's workload: synthetic, kv, sortjob or vm"),
    };
    let spec = GuestSpec {
        workload,
        threads: a.threads,
        policy: a.policy,
        chunk: a.chunk,
        prefetch: a.prefetch,
        servers: a.servers.clone(),
        replicas: a.replicas,
        sample_budget: a.sample_budget,
        reply_spin_us: a.reply_spin,
        service_ip: a.service_ip.clone(),
    };
    spec.validate()?;
    Ok(spec)
}

pub fn run(a: RunArgs, secret_file: Option<&Path>) -> Result<()> {
    if a.merge {
        pagefleet_ksm::enroll::merge_self()?;
    }
    if !a.command.is_empty() {
        if a.workload.is_some() {
            bail!("give either a workload or a command after --, not both");
        }
        use std::os::unix::process::CommandExt;
        let e = std::process::Command::new(&a.command[0])
            .args(&a.command[1..])
            .exec();
        bail!("cannot run {}: {e}", a.command[0]);
    }
    let Some(workload) = a.workload.clone() else {
        bail!("name a workload (synthetic, sort, sortjob, kv, vm) or a command after --; see pagefleet run --help");
    };
    if a.threads == 0 {
        bail!("--threads must be at least 1");
    }
    if a.service_ip.is_some() {
        bail!("--service-ip is for hosted guests (pagefleet guest start)");
    }
    let size = a.size.unwrap_or(DEFAULT_SIZE);
    let budget_pages = budget_pages(a.budget.as_deref(), size)?;
    let duration = a.duration.unwrap_or(match workload {
        Workload::Synthetic { .. } => SYNTHETIC_SECS,
        _ => 0,
    });
    let secret = if a.servers.is_empty() {
        None
    } else {
        Some(Secret::resolve(secret_file)?)
    };
    let w = match workload {
        Workload::Synthetic {
            dist,
            write_frac,
            prefill,
            rate,
            span,
            fill_seed,
            fill_shared,
        } => {
            if !(0.0..=1.0).contains(&fill_shared) {
                bail!("--fill-shared must be between 0 and 1, not {fill_shared}");
            }
            local::Workload::Synthetic {
                dist,
                write_frac,
                prefill,
                rate,
                span,
                fill: fill_seed.map(|seed| synthetic::Fill {
                    seed,
                    shared: fill_shared,
                }),
            }
        }
        Workload::Sort { seed } => local::Workload::Sort { seed },
        Workload::Kv { listen, no_evict } => local::Workload::Kv { listen, no_evict },
        w @ Workload::Vm { .. } => {
            let bridge = match &w {
                Workload::Vm { bridge, nic, .. } => match (nic, bridge) {
                    (Some(_), None) => bail!("--nic: give --bridge BR, the bridge its tap joins (for a hosted VM, its host's pagefleetd --vm-bridge)"),
                    _ => bridge.clone(),
                },
                _ => None,
            };
            local::Workload::Vm(Box::new(
                pagefleet_runner::vm::spec_of(&vm_workload(&w)?, size, "run", None, bridge.as_deref())?
                    .expect("a VM workload has a VM spec"),
            ))
        }
        Workload::Sortjob { .. } => bail!("sortjob runs hosted (pagefleet guest start NAME --on HOST --size SIZE -- sortjob); for a one-shot sort use `pagefleet run sort`"),
    };
    let o = local::LocalRun {
        size,
        budget_pages,
        servers: a.servers.clone(),
        replicas: a.replicas,
        secret,
        policy: a.policy,
        chunk: a.chunk,
        prefetch: a.prefetch,
        sample_budget: a.sample_budget,
        reply_spin_us: a.reply_spin,
        threads: a.threads,
        duration,
        plain: a.plain,
        progress: !a.json,
    };
    let v = local::run(&o, &w)?;
    if a.json {
        println!("{}", serde_json::to_string(&v)?);
    }
    Ok(())
}
