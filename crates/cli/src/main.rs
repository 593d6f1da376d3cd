//! pagefleet — the command-line interface (thin: every capability lives in its crate).

use anyhow::{bail, Result};
use clap::{Args, Parser, Subcommand};
use pagefleet_bench as bench;
use pagefleet_client::{Conn, ConnectOptions};
use pagefleet_common::units;
use pagefleet_proto::auth::Secret;
use std::path::PathBuf;

mod cert;
mod cluster;
mod gc;
mod run;
mod top;

/// pagefleet pools spare memory across hosts: memory servers lend it, guests
/// page to it, and (as milestones land) large guests split-migrate onto it.
///
/// Start a memory server with `pagefleetd --lend 4GiB`, then e.g.
///   pagefleet memserver stat --server 127.0.0.1:7070
///   pagefleet bench memserver
#[derive(Parser)]
#[command(version, verbatim_doc_comment)]
struct Cli {
    /// Cluster secret file (default: $PAGEFLEET_SECRET_FILE, else
    /// /etc/pagefleet/secret as root, else ~/.config/pagefleet/secret).
    #[arg(long, global = true)]
    secret_file: Option<PathBuf>,
    /// This client's TLS identity (a directory `pagefleet cert issue`
    /// wrote). With one, connections to hosts not on loopback use TLS;
    /// hosts that run with --tls-dir refuse such connections without it.
    #[arg(long, global = true, env = "PAGEFLEET_TLS_DIR")]
    tls_dir: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Benchmarks: each compares pagefleet with baselines and peers in one run.
    #[command(subcommand)]
    Bench(BenchCmd),
    /// Talk to a memory server.
    #[command(subcommand)]
    Memserver(MemserverCmd),
    /// The cluster CA and certificates for TLS on every port.
    #[command(subcommand)]
    Cert(cert::CertCmd),
    /// The main demo (root; a few minutes): a 4-host testbed, a kv guest under
    /// client load split-migrates onto a host with memory for half of it plus
    /// a sub-host, pages there, and is gathered back; prints the reports and
    /// writes a throughput-over-time plot.
    Demo(DemoOpts),
    /// Run a native guest (synthetic, sort, kv) on a region paging to memory servers.
    ///
    /// Example: pagefleet run synthetic --size 2GiB --budget 50% --servers 127.0.0.1:7070
    Run(Box<run::RunArgs>),
    /// Hosts and guests as placement sees them: each host's memory (total,
    /// available, lent, free for guests) and where each guest's pages are
    /// (local / per sub-host), from the registry or from the hosts named.
    Status {
        /// Ask these pagefleetd HTTP addresses (HOST:PORT, the --metrics
        /// address) instead of the registry, comma-separated.
        #[arg(long, value_delimiter = ',')]
        hosts: Vec<String>,
        #[command(flatten)]
        reg: cluster::Registry,
        /// Print one JSON entry per host.
        #[arg(long)]
        json: bool,
    },
    /// The bearer token a Prometheus scrapes every pagefleetd's /metrics
    /// with, from the cluster secret (every host accepts it; it opens
    /// nothing but GET /metrics). In prometheus.yml, per scrape job:
    ///
    ///   authorization: { credentials_file: /etc/prometheus/pagefleet.token }
    ///
    /// Example: pagefleet scrape-token > /etc/prometheus/pagefleet.token
    ScrapeToken,
    /// A link that opens a host's web dashboard (`/ui/`): hosts and their
    /// memory, guests and where their pages are, fault rates, migrations
    /// in progress with a progress bar, finished ones with their reports,
    /// memory servers — live. The link works once, within a minute, and
    /// only for this cluster; the browser then holds a session for 12
    /// hours (an HttpOnly cookie). The dashboard only reads.
    ///
    /// Example: pagefleet dashboard --on h1
    Dashboard {
        /// The host whose daemon serves the page (name or address); by
        /// default the registry's daemon.
        #[arg(long)]
        on: Option<String>,
        #[command(flatten)]
        reg: cluster::Registry,
    },
    /// The cluster in the terminal, refreshed in place (like virt-top):
    /// hosts and their memory, guests with ops, pages in and out per second
    /// and the last interval's fault p99, migrations in progress.
    ///
    /// Example: pagefleet top --hosts 10.0.0.1:7071,10.0.0.2:7071
    Top(top::TopArgs),
    /// Start or stop guests on the cluster's hosts.
    #[command(subcommand)]
    Guest(cluster::GuestCmd),
    /// A host's lifecycle: cordon, drain (cordon and empty it), uncordon,
    /// restart (in place, for an upgrade), remove (a dead host).
    ///
    /// Example: pagefleet host drain h3
    #[command(subcommand)]
    Host(cluster::HostCmd),
    /// Free pages on memory servers that nothing owns any more: regions no
    /// guest in the registry runs, no connected client uses, idle for the
    /// grace period (a source that crashed mid-migration, a runner killed
    /// with SIGKILL). Refused while any host cannot be asked. pagefleetd
    /// also does this every minute (--gc-grace, default 600 s).
    ///
    /// Example: pagefleet gc --dry-run
    Gc {
        /// Keep regions idle less than this many seconds.
        #[arg(long, default_value_t = 60.0)]
        grace: f64,
        /// Only list what would be freed.
        #[arg(long)]
        dry_run: bool,
        /// The hosts that cannot be asked are gone for good: collect what no
        /// guest of the hosts that answer owns (a guest on a host taken as
        /// gone loses its pages here). `pagefleet host remove` is the
        /// lasting way.
        #[arg(long)]
        unreachable_gone: bool,
        #[command(flatten)]
        reg: cluster::Registry,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Live-migrate a guest (S-memV split migration): hot pages and their
    /// access history to a main host, the rest straight to sub-hosts' memory
    /// servers; it then runs on the main host, paging with the sub-hosts.
    ///
    /// Example: pagefleet migrate db              (placement chooses)
    ///          pagefleet migrate db --to h2 --sub h3
    Migrate(cluster::MigrateArgs),
    /// Integrated migration: bring a split guest back onto one host. The
    /// main host streams its pages while the destination pulls the rest from
    /// every sub-host in parallel; pages paged in meanwhile are neither lost
    /// nor sent twice (the main host's copy always wins).
    ///
    /// Example: pagefleet gather db --to h1
    Gather(cluster::GatherArgs),
    /// Empty a host for maintenance: guests' pages on its memory server move
    /// to another one (the guests keep running), and guests running there
    /// migrate away (their pages on sub-hosts stay put).
    ///
    /// Example: pagefleet evacuate h3
    Evacuate(cluster::EvacuateArgs),
    /// A multi-host lab on this machine: network namespaces joined through a
    /// bridge, links shaped with tc tbf, one pagefleetd per host (root only).
    #[command(subcommand)]
    Testbed(TestbedCmd),
    /// DMPS: several memory servers as one remote block device (NBD).
    #[command(subcommand)]
    Blockdev(BlockdevCmd),
    /// Same-page merging (KSM): a controller better than ksmtuned, status, enrolment.
    #[command(subcommand)]
    Ksm(pagefleet_ksm::cli::Command),
    /// I/O guarantee on a shared block device: every tenant keeps its minimum.
    #[command(subcommand)]
    Ioqos(pagefleet_ioqos::cli::Command),
    /// A shell completion script on stdout.
    ///
    /// Example: pagefleet completions bash > /etc/bash_completion.d/pagefleet
    Completions {
        /// bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
    },
    /// Write the manual pages, pagefleet(1) and one per subcommand
    /// (pagefleet-guest-start(1), ...), into a directory (`make install`
    /// installs them).
    Man {
        /// The directory (created if missing).
        out: PathBuf,
    },
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Memory server page-out/page-in throughput and 4 KiB round trips,
    /// against raw loopback TCP and memcached, plus server RSS at 1 GiB stored.
    Memserver(Bench<bench::memserver::Args>),
    /// The paging runtime: a kv guest under zipf load, all-local vs pagefleet
    /// (budgets, policies, chunk sizes, servers) vs swap file and zram in a
    /// memory cgroup; single-fault latency vs raw uffd + raw TCP.
    Paging(Bench<bench::paging::Args>),
    /// Split migration (S-memV Figs. 8-12) on a testbed: migration time and
    /// downtime onto a host with enough memory, a split main host + sub-host,
    /// and a memory-limited host with swap; idle and rewriting guests; 10 and
    /// 1 Gbit links; sort time after migration (with/without access history);
    /// kv throughput across the migration. Root only.
    Migration(Bench<bench::migration::Args>),
    /// The same QEMU VM migrated five ways on a testbed: QEMU pre-copy,
    /// QEMU post-copy, QEMU pre-copy into a half-size memory cgroup with
    /// SSD-like swap, pagefleet split (half the memory + a sub-host) and
    /// pagefleet to a host with enough memory; migration time, downtime,
    /// bytes, in-guest ops/s before, during and after. Root; `make vm` first.
    VmMigration(Bench<bench::vm_migration::Args>),
    /// Sharing-aware migration (paper 002, Fig. 4) on a testbed: a guest
    /// whose memory is 0-83% identical to a guest on the destination,
    /// migrated with every page sent and sharing-aware, side by side; bytes
    /// and pages sent, time, downtime, hashing CPU on both ends; 10 and 1
    /// Gbit links; region checksums compared on every run. Root.
    Dedup(Bench<bench::dedup::Args>),
    /// The etcd registry at scale, simulated: 1000 hosts and 10 000 guests
    /// registered in a real etcd; placement latency (read, choose, claim
    /// by transaction, release), etcd writes per migration, etcd CPU.
    Registry(Bench<bench::registry::Args>),
    /// How costs grow with the size of the work, a curve per sweep, every
    /// point checked: the etcd registry at 1 000–50 000 simulated hosts
    /// (placement p99, a daemon's mirror), one memory server lending
    /// 1–16 GiB (RSS over --lend, throughput), one kv guest paging to 1–8
    /// servers (ops/s, threads, fds), 1–16 kv guests sharing two servers
    /// (aggregate against all local, fairness), guests of 0.5–8 GiB migrated
    /// idle and rewriting to enough-memory and split destinations (s/GiB,
    /// round-1 link use, downtime, CPU per GiB; checksums compared). Root.
    Scale(Bench<bench::scale::Args>),
    /// In-place restarts of a host's pagefleetd (`pagefleet host restart`)
    /// under value-checking kv loads on a 3-host testbed: two kv guests on
    /// the host, a third elsewhere paging to its memory server; each
    /// guest's longest kv operation per restart, time to answer, wrong
    /// values, guests lost. Root.
    Restart(Bench<bench::restart::Args>),
    /// What the web dashboard's live updates cost: viewers holding a
    /// host's /ui/api/events open on a 3-host testbed (none, one, ten);
    /// each pagefleetd's CPU share per phase, snapshots each viewer got,
    /// the page's first load. Root.
    Dashboard(Bench<bench::dashboard::Args>),
    /// Strangers against a pagefleetd on loopback: slow-body and slow-head
    /// connections holding the HTTP API's slots while a signed client
    /// works (success rate, p99, pagefleetd's RSS and its return), the
    /// same with slow and stalled TLS handshakes on a `--tls-dir` host, then a
    /// connection flood on the memory server while sessions start (the
    /// share that get in). Example: pagefleet bench strangers --json
    Strangers(Bench<bench::strangers::Args>),
    /// A memory server that hangs (SIGSTOP, 90 s) under a `--replicas 2`
    /// kv guest over three servers, one killed first, 10 runs in a row:
    /// time until the clients' rate is back to half, resident memory
    /// against the budget at every 100 ms sample, pages left on servers
    /// after the guest, wrong values. Example: pagefleet bench hang --json
    Hang(Bench<bench::hang::Args>),
    /// A cluster's life in minutes, checked (issue 21): kv guests with two
    /// replicas under value-checking clients on a 4-host testbed while
    /// budgets change, guests migrate, hosts are evacuated and memory
    /// servers are killed -9 and restarted, in a loop; RSS, fds and threads
    /// of every process over time (flat?) and the bytes lost (0?). Root.
    /// Example: pagefleet bench soak --minutes 30
    Soak(Bench<bench::soak::Args>),
    /// The DMPS block device over NBD against nbdkit's memory plugin, the
    /// two-hop peer (nbdkit nbd -> nbdkit memory), the floor (a forwarder
    /// doing only the two hops) and qemu-nbd on tmpfs: fio sequential/random
    /// read/write, 4-128 KiB, queue depth 1 and 16, IOPS and MB/s; the
    /// mirror drill (a server killed under load, every acknowledged write
    /// read back); with --vm a guest swapping to it, to a disk image and to
    /// zram. Example: pagefleet bench blockdev --quick --json
    Blockdev(Bench<bench::blockdev::Args>),
    /// KSM policies (paper 001) on kv tenants holding the same dataset plus
    /// private data under host memory pressure: off, kernel defaults, Debian's
    /// ksmtuned (x0.5, x1, x2 interval), the kernel's scan-time advisor,
    /// pagefleet adaptive; memory saved over time, ksmd CPU, throughput.
    /// The tenants' memory does not fit unmerged (a memory cgroup and a
    /// swap file), so merging sooner means less paging and more throughput.
    /// Root; about 2 hours (7 runs of 900 s: the kernel advisor needs
    /// ~750 s to merge).
    Ksm(Bench<bench::ksm::Args>),
    /// I/O guarantee (paper 004): fio tenants (64 KiB random direct writes)
    /// in blkio cgroups on a shared device, one raising its parallelism
    /// (ramp), 12 tenants with 3 bursty (many), a 4 KiB burst (burst4k);
    /// no control, static caps, BFQ weights, paper's Algorithm 1, guarantee.
    /// Devices: a slow FIFO disk (FUSE, like the paper's array) and this
    /// machine's disk (loop over a file, ramp only). Root; about 35 minutes
    /// (--quick: one 30 s scenario).
    Ioqos(Bench<bench::ioqos::Args>),
    /// The DMPS export's floor used by `bench blockdev` (internal): an NBD
    /// forwarder on 127.0.0.1:PORT to a raw page store in a process of its
    /// own (--store: be that store).
    #[command(hide = true)]
    NbdFloor {
        #[arg(long, default_value_t = 0)]
        port: u16,
        #[arg(long)]
        size: u64,
        #[arg(long)]
        store: bool,
    },
    /// The raw-TCP baseline server used by `bench memserver` (internal).
    #[command(hide = true)]
    RawServer,
    /// The kv guest over the floor pager used by `bench paging` (internal).
    #[command(hide = true)]
    KvFloorGuest {
        #[arg(long)]
        size: u64,
        #[arg(long)]
        budget_pages: u64,
        #[arg(long)]
        store: String,
        #[arg(long, value_enum, default_value = "fifo")]
        policy: bench::kv_floor::FloorPolicy,
    },
}

/// A benchmark's own flags and those every benchmark takes.
#[derive(Args, Clone)]
struct Bench<A: Args> {
    #[command(flatten)]
    common: bench::Common,
    #[command(flatten)]
    args: A,
}

#[derive(Subcommand)]
enum BlockdevCmd {
    /// Export the memory servers as one NBD device until interrupted (its
    /// blocks are deleted on exit). Layout linear (DMPS eq. 1: the servers'
    /// spaces concatenated) or stripe; --mirror keeps every block on two
    /// servers and reads from either.
    ///
    /// Example: pagefleet blockdev serve --servers 127.0.0.1:7070,127.0.0.1:7080 --size 1GiB --listen 127.0.0.1:10809
    ///          qemu-img info nbd://127.0.0.1:10809
    Serve {
        /// The memory servers whose memory makes up the device, comma-separated HOST:PORT.
        #[arg(long, value_delimiter = ',', required = true)]
        servers: Vec<String>,
        /// The device's size (e.g. 1GiB; a multiple of 4 KiB). It must fit
        /// in the servers' free memory (half of it with --mirror).
        #[arg(long, value_parser = units::parse_size, required_unless_present = "export")]
        size: Option<u64>,
        /// Several exports from one server, each a device of its own:
        /// NAME=SIZE, repeated (e.g. --export swap=1GiB --export scratch=256MiB);
        /// laid out alike, together within the servers' free memory. The
        /// first is what a client gets that names none. With --size, the
        /// --name export comes first.
        #[arg(long = "export", value_name = "NAME=SIZE")]
        export: Vec<pagefleet_blockdev::ExportSpec>,
        /// linear: the servers' spaces one after another (DMPS); stripe:
        /// --stripe-unit pieces dealt round-robin over the servers.
        #[arg(long, default_value = "linear", value_parser = ["linear", "stripe"])]
        layout: String,
        /// Stripe unit (a multiple of 4 KiB).
        #[arg(long, default_value = "128KiB", value_parser = units::parse_size)]
        stripe_unit: u64,
        /// Keep every block on two servers (reads go to either; the device
        /// survives one server's death but holds half as much).
        #[arg(long)]
        mirror: bool,
        /// Where NBD clients connect: 127.0.0.1:PORT or unix:PATH (mode 0600).
        /// NBD has no authentication of its own, so the export never
        /// listens where strangers could reach it.
        #[arg(long, default_value = "127.0.0.1:10809")]
        listen: String,
        /// Export name (clients may also ask for "").
        #[arg(long, default_value = "pagefleet")]
        name: String,
    },
}

fn blockdev(c: BlockdevCmd, secret_file: Option<&std::path::Path>) -> Result<()> {
    let BlockdevCmd::Serve {
        servers,
        size,
        layout,
        stripe_unit,
        mirror,
        listen,
        name,
        export,
    } = c;
    init_log("warn");
    let mut exports = Vec::new();
    if let Some(size) = size {
        exports.push(pagefleet_blockdev::ExportSpec { name, size });
    }
    exports.extend(export);
    let o = pagefleet_blockdev::Options {
        servers,
        exports,
        stripe: (layout == "stripe").then_some(stripe_unit),
        mirror,
        listen,
    };
    Ok(pagefleet_blockdev::serve_until_signal(
        &o,
        Secret::resolve(secret_file)?,
    )?)
}

/// Log to stderr at `$PAGEFLEET_LOG`, else at `default`.
pub(crate) fn init_log(default: &str) {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(
            std::env::var("PAGEFLEET_LOG").unwrap_or_else(|_| default.into()),
        ))
        .with_writer(std::io::stderr)
        // Colour only for a person at a terminal: a log file (a runner's,
        // the KSM controller's in a bench, systemd's) gets plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

#[derive(Args, Clone)]
struct DemoOpts {
    /// Guest size.
    #[arg(long, default_value = "1GiB", value_parser = units::parse_size)]
    size: u64,
    /// Seconds of each phase (before, after the split x2, after the gather).
    #[arg(long, default_value_t = 6)]
    phase: u64,
    /// Directory for demo.json and demo.png.
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
    /// Migrate a QEMU VM instead of the kv guest: the Debian VM (`make
    /// vm`: target/vm/debian.qcow2) running memcached on its own address on
    /// the lab's network, under the same client load; with --vm-image
    /// vmwork, the test image's checked memory workload (plot demo-vm.png).
    #[arg(long)]
    vm: bool,
    /// Which VM --vm migrates: debian or vmwork.
    #[arg(long, default_value = "debian", requires = "vm", value_parser = ["debian", "vmwork"])]
    vm_image: String,
    /// Forward h1's web dashboard to this address on this machine and
    /// print a login link for it, to watch the migrations live; `off`: don't.
    #[arg(long, default_value = "127.0.0.1:7080")]
    dashboard: String,
}

fn demo(o: DemoOpts) -> Result<()> {
    use pagefleet_lab::demo;
    if o.size < 64 << 20 {
        bail!("--size must be at least 64MiB");
    }
    let dir = std::env::current_exe()?
        .parent()
        .and_then(|p| p.parent())
        .map(|p| p.join("vm"))
        .unwrap_or_default();
    let vm = if o.vm && o.vm_image == "vmwork" {
        let (k, i) = (dir.join("vmlinuz"), dir.join("initrd.gz"));
        if !k.is_file() || !i.is_file() {
            bail!("no VM image in {}: run `make vm`", dir.display());
        }
        Some((k, i))
    } else {
        None
    };
    let debian = if o.vm && o.vm_image == "debian" {
        let img = dir.join("debian.qcow2");
        if !img.is_file() {
            bail!("no Debian VM image at {}: run `make vm`", img.display());
        }
        Some(img)
    } else {
        None
    };
    let opts = demo::Opts {
        size: o.size / (64 << 10) * (64 << 10),
        out_dir: o.out,
        phase_secs: o.phase.max(2),
        vm,
        debian,
        dashboard: (o.dashboard != "off").then_some(o.dashboard),
    };
    let mut log = |m: &str| eprintln!("  .. {m}");
    let r = demo::run(&opts, &mut log)?;
    demo::print(&r, &mut std::io::stdout())?;
    Ok(())
}

#[derive(Subcommand)]
enum TestbedCmd {
    /// Create the hosts (removing any earlier lab with the same prefix first).
    Up {
        /// How many hosts (h1..hN).
        #[arg(long, default_value_t = 3)]
        hosts: usize,
        /// Link rate: 10gbit, 1gbit or none.
        #[arg(long, default_value = "10gbit")]
        link: pagefleet_testbed::Link,
        /// Memory each host's pagefleetd lends.
        #[arg(long, default_value = "1GiB", value_parser = units::parse_size)]
        lend: u64,
        /// Memory each host gives guests (h1,h2,...; the last value repeats;
        /// 0: no guests there). Placement sees this as the host's memory.
        #[arg(long, value_delimiter = ',', value_parser = units::parse_size, default_value = "2GiB")]
        guest_memory: Vec<u64>,
        /// Name prefix of the lab's namespaces (lets labs coexist).
        #[arg(long, default_value = "pf")]
        prefix: String,
        /// Third octet of the lab subnet 10.200.X.0/24.
        #[arg(long, default_value_t = 77)]
        subnet: u8,
        /// Run an etcd member on each of the first N hosts and make it the
        /// daemons' registry (--registry etcd://...) instead of --peers.
        #[arg(long, default_value_t = 0)]
        etcd: usize,
        /// TLS everywhere: a lab CA, a certificate per host (pagefleetd
        /// --tls-dir) and one for commands run with `testbed exec`.
        #[arg(long)]
        tls: bool,
        /// Directories VM guests' images may come from (pagefleetd
        /// --vm-images on every host that gives guests memory); without
        /// it the hosts refuse `guest start ... -- vm` (HTTP 403). `make vm`
        /// builds one in target/vm.
        #[arg(long, value_delimiter = ',')]
        vm_images: Vec<std::path::PathBuf>,
    },
    /// Remove the lab: daemons, namespaces, state. Safe to run twice.
    Down {
        /// Name prefix of the lab's namespaces.
        #[arg(long, default_value = "pf")]
        prefix: String,
    },
    /// Show the lab's hosts.
    Status {
        /// Name prefix of the lab's namespaces.
        #[arg(long, default_value = "pf")]
        prefix: String,
        /// Print the lab as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Open a host's web dashboard from this machine: a local port leads
    /// into the host's namespace, and a login link through it is printed
    /// (Enter prints a fresh one; each works once, within a minute). Runs
    /// until Ctrl-C.
    ///
    /// Example: pagefleet testbed dashboard --on h1 --listen 127.0.0.1:7080
    Dashboard {
        /// The host whose daemon serves the page.
        #[arg(long, default_value = "h1")]
        on: String,
        /// The local address to listen on.
        #[arg(long, default_value = "127.0.0.1:7080")]
        listen: String,
        /// Name prefix of the lab's namespaces.
        #[arg(long, default_value = "pf")]
        prefix: String,
    },
    /// Run a command inside a host (h1, h2, ...).
    Exec {
        /// The host (h1, h2, ...).
        host: String,
        /// Name prefix of the lab's namespaces.
        #[arg(long, default_value = "pf")]
        prefix: String,
        /// The command and its arguments.
        #[arg(trailing_var_arg = true, required = true)]
        cmd: Vec<String>,
    },
}

const TESTBED_DIR: &str = "/run/pagefleet/testbed";

fn testbed(t: TestbedCmd) -> Result<()> {
    use pagefleet_testbed::{down_prefix, Lab, Options};
    let dir = PathBuf::from(TESTBED_DIR);
    match t {
        TestbedCmd::Up {
            hosts,
            link,
            lend,
            guest_memory,
            prefix,
            subnet,
            etcd,
            tls,
            vm_images,
        } => {
            let me = std::env::current_exe()?;
            let d = me.parent().unwrap().join("pagefleetd");
            let mut o = Options::new(hosts, link, d);
            o.lend = lend;
            o.guest_memory = guest_memory;
            o.prefix = prefix;
            o.subnet_octet = subnet;
            o.etcd = etcd;
            o.tls = tls;
            o.dir = dir;
            o.vm_images = vm_images
                .iter()
                .map(|p| {
                    std::fs::canonicalize(p)
                        .map_err(|e| anyhow::anyhow!("--vm-images {}: {e}", p.display()))
                })
                .collect::<Result<_>>()?;
            let lab = Lab::up(&o)?;
            println!(
                "testbed {:?} up: {} hosts on {}, links {}",
                lab.prefix,
                lab.hosts.len(),
                lab.subnet,
                lab.link.name()
            );
            for h in &lab.hosts {
                println!(
                    "  {}  netns {}  memory server {}  http {}  guest memory {}",
                    h.name,
                    h.netns,
                    h.addr,
                    h.http(),
                    if h.guest_memory > 0 {
                        units::fmt_size(h.guest_memory)
                    } else {
                        "-".into()
                    }
                );
            }
            println!(
                "secret: {}   (pagefleet --secret-file {} memserver stat --server ADDR)",
                lab.secret_file.display(),
                lab.secret_file.display()
            );
            if let Some(t) = &lab.admin_tls {
                println!(
                    "TLS: every port takes only TLS between hosts; `testbed exec` presents {} \
                     (host identities beside it)",
                    t.display()
                );
            }
            let p = if lab.prefix == "pf" {
                String::new()
            } else {
                format!(" --prefix {}", lab.prefix)
            };
            println!("run in a host: pagefleet testbed exec{p} h1 -- CMD ...   (e.g. pagefleet status)   remove: pagefleet testbed down{p}");
        }
        TestbedCmd::Down { prefix } => {
            down_prefix(&dir, &prefix)?;
            println!("testbed {prefix:?} is down");
        }
        TestbedCmd::Status { prefix, json } => {
            let lab = Lab::load(&dir, &prefix)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&lab)?);
            } else {
                println!(
                    "testbed {:?}: {} hosts on {}, links {}",
                    lab.prefix,
                    lab.hosts.len(),
                    lab.subnet,
                    lab.link.name()
                );
                let me = std::env::current_exe()?;
                for (i, h) in lab.hosts.iter().enumerate() {
                    let alive = pagefleet_common::sys::process::alive(h.pid as i32);
                    // Ask the host's daemon from inside its own namespace.
                    let out = lab
                        .exec(i, &me)
                        .args(["status", "--json", "--hosts", &format!("{}:7071", h.ip)])
                        .output()?;
                    #[derive(serde::Deserialize)]
                    struct Entry {
                        report: Option<pagefleet_api::HostReport>,
                    }
                    let mem = serde_json::from_slice::<Vec<Entry>>(&out.stdout)
                        .ok()
                        .and_then(|v| v.into_iter().next())
                        .and_then(|e| e.report)
                        .map(|r| {
                            format!(
                                "lends {} ({} used), host memory available {}",
                                units::fmt_size(r.lend_capacity),
                                units::fmt_size(r.lend_used),
                                units::fmt_size(r.mem_available)
                            )
                        })
                        .unwrap_or_else(|| "no report".into());
                    println!(
                        "  {}  {}  pagefleetd pid {} {}  {}",
                        h.name,
                        h.addr,
                        h.pid,
                        if alive { "running" } else { "NOT RUNNING" },
                        mem
                    );
                }
            }
        }
        TestbedCmd::Dashboard { on, listen, prefix } => {
            let lab = Lab::load(&dir, &prefix)?;
            let i = lab
                .hosts
                .iter()
                .position(|h| h.name == on)
                .ok_or_else(|| anyhow::anyhow!("no host {on:?} in testbed {prefix:?}"))?;
            let (f, link) = pagefleet_lab::forward::dashboard(&lab, i, &listen)?;
            println!("{link}");
            eprintln!(
                "{} leads to {}'s dashboard; open the link within a minute (it works once). Enter: a fresh link. Ctrl-C: stop.",
                f.local, on
            );
            let stop = pagefleet_common::signal::stop_flag();
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                for l in std::io::stdin().lines() {
                    if l.is_err() || tx.send(()).is_err() {
                        break;
                    }
                }
            });
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if rx
                    .recv_timeout(std::time::Duration::from_millis(200))
                    .is_ok()
                {
                    println!("{}", pagefleet_lab::forward::login_link(&lab, &f)?);
                }
            }
        }
        TestbedCmd::Exec { host, prefix, cmd } => {
            let lab = Lab::load(&dir, &prefix)?;
            let i = lab
                .hosts
                .iter()
                .position(|h| h.name == host)
                .ok_or_else(|| anyhow::anyhow!("no host {host:?} in testbed {prefix:?}"))?;
            let st = lab.exec(i, &cmd[0]).args(&cmd[1..]).status()?;
            std::process::exit(st.code().unwrap_or(1));
        }
    }
    Ok(())
}

#[derive(Subcommand)]
enum MemserverCmd {
    /// Capacity, use and regions of a memory server.
    Stat {
        /// Server address, HOST:PORT.
        #[arg(long, default_value = "127.0.0.1:7070")]
        server: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Authenticate and measure a few round trips.
    Ping {
        /// Server address, HOST:PORT.
        #[arg(long, default_value = "127.0.0.1:7070")]
        server: String,
        /// Round trips to measure.
        #[arg(long, default_value_t = 5)]
        count: u32,
    },
    /// What each memory server of the cluster holds, per region: pages,
    /// the client that created it, its age and idle time, connected
    /// clients, and whether a running guest owns it.
    ///
    /// Example: pagefleet memserver regions --on h3
    Regions {
        /// Only this host (name or address); default every host that lends.
        #[arg(long)]
        on: Option<String>,
        #[command(flatten)]
        reg: cluster::Registry,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Free one region's pages on a host's memory server (refused for a
    /// running guest's region: stop the guest instead).
    ///
    /// Example: pagefleet memserver drop 5f3a9c0e12 --on h3
    Drop {
        /// The region id, as `pagefleet memserver regions` lists it.
        region: String,
        /// The host holding it (name or address).
        #[arg(long)]
        on: String,
        #[command(flatten)]
        reg: cluster::Registry,
    },
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!(
            "pagefleet: error: {}",
            pagefleet_common::report::describe(e.as_ref())
        );
        std::process::exit(1);
    }
}

/// A hosted runner: its job comes from pagefleetd on stdin.
fn run(cli: Cli) -> Result<()> {
    let sf = cli.secret_file.as_deref();
    if !matches!(
        cli.cmd,
        Cmd::Cert(_) | Cmd::Completions { .. } | Cmd::Man { .. }
    ) {
        pagefleet_tls::init_process_identity(cli.tls_dir.as_deref())
            .map_err(|e| anyhow::anyhow!("--tls-dir: {e}"))?;
    }
    match cli.cmd {
        Cmd::Cert(c) => cert::main(c),
        Cmd::Bench(BenchCmd::Memserver(b)) => bench::main(&b.common, &b.args),
        Cmd::Bench(BenchCmd::Paging(b)) => bench::main(&b.common, &b.args),
        Cmd::Bench(BenchCmd::Migration(b)) => bench::main(&b.common, &b.args),
        Cmd::Bench(BenchCmd::VmMigration(b)) => bench::main(&b.common, &b.args),
        Cmd::Bench(BenchCmd::Blockdev(b)) => bench::main(&b.common, &b.args),
        Cmd::Bench(BenchCmd::Dedup(b)) => bench::main(&b.common, &b.args),
        Cmd::Bench(BenchCmd::Registry(b)) => bench::main(&b.common, &b.args),
        Cmd::Bench(BenchCmd::Scale(b)) => bench::main(&b.common, &b.args),
        Cmd::Bench(BenchCmd::Restart(b)) => bench::main(&b.common, &b.args),
        Cmd::Bench(BenchCmd::Dashboard(b)) => bench::main(&b.common, &b.args),
        Cmd::Bench(BenchCmd::Strangers(b)) => bench::main(&b.common, &b.args),
        Cmd::Bench(BenchCmd::Hang(b)) => bench::main(&b.common, &b.args),
        Cmd::Bench(BenchCmd::Soak(b)) => bench::main(&b.common, &b.args),
        Cmd::Bench(BenchCmd::Ksm(b)) => bench::main(&b.common, &b.args),
        Cmd::Bench(BenchCmd::Ioqos(b)) => bench::main(&b.common, &b.args),
        Cmd::Bench(BenchCmd::RawServer) => bench::memserver::raw_server_main(),
        Cmd::Bench(BenchCmd::NbdFloor { port, size, store }) => {
            bench::blockdev::floor::main(port, size, store)
        }
        Cmd::Bench(BenchCmd::KvFloorGuest {
            size,
            budget_pages,
            store,
            policy,
        }) => bench::kv_floor::guest_main(size, budget_pages, &store, policy),
        Cmd::Demo(o) => demo(o),
        Cmd::Run(a) => run::run(*a, cli.secret_file.as_deref()),
        Cmd::Testbed(t) => testbed(t),
        Cmd::Blockdev(b) => blockdev(b, cli.secret_file.as_deref()),
        Cmd::Ksm(k) => {
            init_log("info");
            Ok(pagefleet_ksm::cli::main(k)?)
        }
        Cmd::Ioqos(c) => {
            init_log("info");
            Ok(pagefleet_ioqos::cli::main(c)?)
        }
        Cmd::Completions { shell } => {
            use clap::CommandFactory;
            // Into a buffer: clap_complete panics on a write error (a
            // closed pipe); ours is an error message.
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "pagefleet", &mut script);
            std::io::Write::write_all(&mut std::io::stdout().lock(), &script)
                .map_err(|e| anyhow::anyhow!("writing the completion script: {e}"))
        }
        Cmd::Man { out } => {
            use clap::CommandFactory;
            std::fs::create_dir_all(&out)
                .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", out.display()))?;
            clap_mangen::generate_to(Cli::command().name("pagefleet"), &out)
                .map_err(|e| anyhow::anyhow!("writing manual pages into {}: {e}", out.display()))
        }
        Cmd::Status { hosts, reg, json } => {
            cluster::status(&cluster::client(sf)?, &reg.registry, &hosts, json)
        }
        Cmd::Guest(g) => cluster::guest(&cluster::client(sf)?, g),
        Cmd::Top(t) => top::main(&cluster::client(sf)?, &t),
        Cmd::Dashboard { on, reg } => {
            let secret = Secret::resolve(sf)?;
            let link = cluster::dashboard_link(
                &pagefleet_common::http::Client::new(secret.clone()),
                &secret,
                &reg.registry,
                on.as_deref(),
            )?;
            println!("{link}");
            eprintln!("open it within a minute (it works once); the dashboard session then lasts 12 hours");
            Ok(())
        }
        Cmd::ScrapeToken => {
            let secret = Secret::resolve(sf)?;
            println!("{}", pagefleet_common::httpauth::scrape_token(&secret));
            Ok(())
        }
        Cmd::Gc {
            grace,
            dry_run,
            unreachable_gone,
            reg,
            json,
        } => gc::gc(
            &cluster::client(sf)?,
            &reg.registry,
            grace,
            dry_run,
            unreachable_gone,
            json,
        ),

        Cmd::Migrate(m) => cluster::migrate_cmd(&cluster::client(sf)?, m),
        Cmd::Gather(g) => cluster::gather_cmd(&cluster::client(sf)?, g),
        Cmd::Evacuate(e) => cluster::evacuate(&cluster::client(sf)?, e),
        Cmd::Host(h) => cluster::host(&cluster::client(sf)?, h),
        Cmd::Memserver(m) => {
            let secret = Secret::resolve(cli.secret_file.as_deref())?;
            let opts = ConnectOptions {
                name: "pagefleet-cli".into(),
                ..Default::default()
            };
            match m {
                MemserverCmd::Stat { server, json } => {
                    let mut c = Conn::connect(&server, &secret, &opts)?;
                    let s = c.stat(true)?;
                    if json {
                        let v = serde_json::json!({
                            "server": server, "server_id": format!("{:016x}", s.server_id),
                            "capacity_bytes": pagefleet_units::bytes_of(s.capacity_pages), "used_bytes": pagefleet_units::bytes_of(s.used_pages),
                            "capacity_pages": s.capacity_pages, "used_pages": s.used_pages,
                            "connections": s.connections, "region_count": s.region_count,
                            "regions": s.regions.iter().map(|(r, n)| serde_json::json!({"region": format!("{r:#x}"), "pages": n})).collect::<Vec<_>>(),
                            "truncated": s.truncated,
                            "tls": c.is_tls(),
                        });
                        println!("{}", serde_json::to_string_pretty(&v)?);
                    } else {
                        println!("server      {server} (id {:016x})", s.server_id);
                        println!(
                            "capacity    {}   used {} ({:.1}%)   free {}",
                            units::fmt_size(pagefleet_units::bytes_of(s.capacity_pages)),
                            units::fmt_size(pagefleet_units::bytes_of(s.used_pages)),
                            s.used_pages as f64 * 100.0 / s.capacity_pages.max(1) as f64,
                            units::fmt_size(pagefleet_units::bytes_of(
                                s.capacity_pages - s.used_pages.min(s.capacity_pages)
                            ))
                        );
                        println!("connections {}   regions {}", s.connections, s.region_count);
                        println!(
                            "this link   {}",
                            if c.is_tls() {
                                "TLS (certificates checked both ways)"
                            } else {
                                "plaintext (loopback, or no --tls-dir)"
                            }
                        );
                        for (r, n) in &s.regions {
                            println!(
                                "  region {r:#018x}  {:>10} pages  {}",
                                n,
                                units::fmt_size(pagefleet_units::bytes_of(*n))
                            );
                        }
                        if s.truncated {
                            println!("  ... (more regions not listed)");
                        }
                    }
                }
                MemserverCmd::Ping { server, count } => {
                    let mut c = Conn::connect(&server, &secret, &opts)?;
                    println!(
                        "connected to {server}: server id {:016x}, {} free of {}",
                        c.info.server_id,
                        units::fmt_size(pagefleet_units::bytes_of(
                            c.info.capacity_pages - c.info.used_pages.min(c.info.capacity_pages)
                        )),
                        units::fmt_size(pagefleet_units::bytes_of(c.info.capacity_pages))
                    );
                    for i in 0..count {
                        println!("ping {i}: {:.1} us", c.ping()?.as_secs_f64() * 1e6);
                    }
                }
                MemserverCmd::Regions { on, reg, json } => {
                    gc::regions(&cluster::client(sf)?, &reg.registry, on.as_deref(), json)?
                }
                MemserverCmd::Drop { region, on, reg } => {
                    gc::drop_region(&cluster::client(sf)?, &reg.registry, &on, &region)?
                }
            }
            Ok(())
        }
    }
}
