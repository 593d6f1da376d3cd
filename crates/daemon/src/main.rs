//! pagefleetd — the pagefleet host daemon.

use anyhow::{Context, Result};
use clap::Parser;
use pagefleet_common::units;
use pagefleet_daemon::config::{self, FileConfig, Flags};
use std::path::PathBuf;

/// The pagefleet host daemon. Services:
///
///   memory server   lends this host's spare memory to remote regions
///                   (guests paging to it, remote block devices built on it)
///   guest host      starts and stops guests (runners) within --guest-memory,
///                   receives incoming migrations, sends guests away
///   registry        GET /cluster: every host's report and guests (--join,
///                   --peers or --registry etcd://...)
///   KSM controller  same-page merging tuned to what it saves (--ksm adaptive)
///   I/O controller  every tenant of a shared disk keeps its minimum
///                   (--ioqos-device DEV --ioqos-tenants SPEC)
///   HTTP API        /metrics (Prometheus), /host, /guests, /cluster,
///                   /incoming; signed with the cluster secret; loopback
///                   unless --metrics ADDR says otherwise
///
/// Example: lend 4 GiB on loopback, metrics on port 7071:
///
///     pagefleetd --lend 4GiB --listen 127.0.0.1:7070
///
/// A host of a cluster that also runs guests:
///
///     pagefleetd --lend 2GiB --guest-memory 8GiB --listen 0.0.0.0:7070 \
///                --metrics 0.0.0.0:7071 --join 10.0.0.1:7071
///
/// (every host the same: each announces itself to 10.0.0.1 and learns the
/// others there; or list them with --peers, or use etcd with --registry).
///
/// Clients authenticate with the cluster secret: a file holding at least 16
/// bytes, created (mode 0600) on first start if missing. Copy the same file to
/// every host of the cluster.
///
/// Settings can also come from a TOML file (`--config`, see
/// packaging/pagefleetd.toml); flags override it.
#[derive(Parser, Debug)]
#[command(name = "pagefleetd", version, verbatim_doc_comment)]
struct Args {
    /// TOML configuration file; flags given on the command line override it.
    #[arg(long, env = "PAGEFLEETD_CONFIG")]
    config: Option<PathBuf>,
    /// Memory to lend (e.g. 4GiB, 512MiB). The server never holds more pages
    /// than this; its own overhead beyond it is small and bounded.
    #[arg(long, value_parser = units::parse_size)]
    lend: Option<u64>,
    /// Address for the memory-server protocol (default 127.0.0.1:7070). Port
    /// 0 picks a free port; the bound address is printed on stdout as `listening ADDR`.
    #[arg(long)]
    listen: Option<String>,
    /// The HTTP API's address (metrics, host report, guests, migrations,
    /// registry), or `off`. Default: 127.0.0.1 with the --listen port + 1
    /// (a free port when listening on port 0). Give this host's cluster
    /// address so peers and CLIs elsewhere reach it; every request must be
    /// signed with the cluster secret (the pagefleet CLI does).
    #[arg(long, visible_alias = "http")]
    metrics: Option<String>,
    /// Serve `GET /metrics` without a signature (for a Prometheus scraper);
    /// every other route still requires the cluster secret.
    #[arg(long)]
    public_metrics: bool,
    /// Serve `GET /healthz` (the daemon answers) and `GET /readyz` (it
    /// serves and is not stopping, draining or restarting) without a
    /// signature, for a load balancer's probes; they tell nothing else.
    #[arg(long)]
    public_health: bool,
    /// Cluster secret file (default: $PAGEFLEET_SECRET_FILE, else
    /// /etc/pagefleet/secret as root, else ~/.config/pagefleet/secret).
    /// $PAGEFLEET_SECRET, if set, is the secret itself.
    #[arg(long)]
    secret_file: Option<PathBuf>,
    /// This host's TLS identity: a directory `pagefleet cert issue` wrote
    /// (default: $PAGEFLEET_TLS_DIR). With one, every port (memory server,
    /// migrations, HTTP API, NBD) takes only TLS with a certificate the
    /// cluster CA signed from peers not on loopback, and this host's
    /// runners and clients speak TLS to such peers. Without: plaintext.
    #[arg(long)]
    tls_dir: Option<PathBuf>,
    /// Most simultaneous authenticated client sessions (default 512).
    /// Connections waiting to authenticate do not count: they have their
    /// own cap and deadline (see --handshake-timeout).
    #[arg(long)]
    max_conns: Option<u32>,
    /// Drop a client whose request or reply frame is not complete after
    /// this many seconds (default 30). Idle between frames is fine.
    #[arg(long)]
    io_timeout: Option<u64>,
    /// Drop a connection that has not proved the cluster secret after this
    /// many seconds (default 5).
    #[arg(long)]
    handshake_timeout: Option<u64>,
    /// Run guests here: the memory their budgets may add up to (e.g. 8GiB).
    #[arg(long, value_parser = units::parse_size)]
    guest_memory: Option<u64>,
    /// The binary that runs guests (default: `pagefleet-runner` beside pagefleetd).
    #[arg(long)]
    runner: Option<PathBuf>,
    /// Where guests' control sockets and logs go (default /run/pagefleet/guests-PORT).
    #[arg(long)]
    guest_dir: Option<PathBuf>,
    /// Network device guests' service addresses are added to (default eth0).
    #[arg(long)]
    service_dev: Option<String>,
    /// Directories VM guests' kernels, initramfs and disk images may come
    /// from, comma-separated (default: none, so no VM guests here). A
    /// request naming a file elsewhere is refused.
    #[arg(long, value_delimiter = ',')]
    vm_images: Option<Vec<PathBuf>>,
    /// Keep no content index of this host's guests: migrations into this
    /// host then receive every page as data (sharing-aware migration off).
    /// By default a scanner hashes running guests' memory at low priority
    /// within a quarter of one CPU, and incoming runners fill pages whose
    /// content is already here (`GET /host` shows the index).
    #[arg(long)]
    no_dedup: bool,
    /// Free regions on this host's memory server that no guest in the
    /// registry and no connected client owns, once idle this many seconds
    /// (default 600; 0: never). Checked every minute (every grace period when shorter); nothing is freed
    /// while any host of the registry cannot be asked. `pagefleet gc`
    /// collects on demand.
    #[arg(long)]
    gc_grace: Option<u64>,
    /// A stop (SIGTERM, SIGINT) while this host's memory server holds pages
    /// of running guests would lose them (guests running here do not stop:
    /// the next daemon adopts their runners): by default it is refused (the
    /// daemon logs what it holds and keeps running; `pagefleet host drain
    /// HOST` empties it, a second signal within a minute stops anyway).
    /// With this many seconds the daemon first moves those pages to other
    /// memory servers (cordoned meanwhile), then stops; if that fails or
    /// takes longer it keeps running. Set the unit's TimeoutStopSec above it.
    #[arg(long, value_name = "SECS")]
    stop_drain: Option<u64>,
    /// The other hosts' pagefleetd HTTP addresses (registry), comma-separated.
    #[arg(long, value_delimiter = ',')]
    peers: Option<Vec<String>>,
    /// One host's pagefleetd HTTP address, the same on every host (the
    /// first one set up, say): this host announces itself there every 5 s
    /// and learns every other host from it, so no host lists the others.
    /// The join host itself may be given it too.
    #[arg(long, value_name = "HOST:PORT")]
    join: Option<String>,
    /// The IP address other hosts reach this one at. Default: the --listen
    /// address, or when that is 0.0.0.0 this host's address on the route to
    /// the join host (or the first peer, or etcd).
    #[arg(long, value_name = "IP")]
    advertise: Option<String>,
    /// An etcd cluster as the registry instead of --peers:
    /// etcd://HOST:2379[,HOST:2379...]. This host then keeps a lease-bound
    /// heartbeat there (its report and guests, every 2 s, expiring 10 s
    /// after the last), and `GET /cluster` and placement read etcd.
    #[arg(long)]
    registry: Option<String>,
    /// This host's name in reports and placement (default: the hostname).
    #[arg(long)]
    name: Option<String>,
    /// Run the same-page-merging controller: adaptive, ksmtuned or off
    /// (default off; root). Its state shows in `pagefleet ksm status`; the
    /// host's KSM settings are put back when pagefleetd stops (SIGTERM/SIGINT).
    #[arg(long)]
    ksm: Option<String>,
    /// ksmd's CPU budget for the adaptive controller (default 10%).
    #[arg(long)]
    ksm_cpu_budget: Option<String>,
    /// Run the I/O guarantee controller on this shared block device (root);
    /// with --ioqos-tenants. Its state shows in `pagefleet ioqos status`;
    /// every cap is removed when pagefleetd stops.
    #[arg(long)]
    ioqos_device: Option<String>,
    /// The device's tenants: NAME=CGROUP|qmp:SOCKET@DRIVE[:min=RATE][:min-iops=N][:weight=W],...
    #[arg(long)]
    ioqos_tenants: Option<String>,
    /// guarantee (default), paper or observe.
    #[arg(long)]
    ioqos_policy: Option<String>,
    /// Log filter (error, warn, info, debug, trace; or RUST_LOG syntax; default info).
    #[arg(long, env = "PAGEFLEET_LOG")]
    log: Option<String>,
    /// plain (text; coloured only on a terminal) or json (one object per
    /// line, for journald or a log shipper).
    #[arg(long, value_enum)]
    log_format: Option<config::LogFormat>,
    /// Print this manual page, pagefleetd(8), in roff and exit (`make
    /// install` installs it).
    #[arg(long, hide = true)]
    man: bool,
}

fn main() {
    pagefleet_common::heap::one_arena();
    // Waiting handshakes, sessions and HTTP connections each hold one.
    pagefleet_common::fds::raise_fd_limit(1 << 16);
    if let Err(e) = run() {
        eprintln!(
            "pagefleetd: error: {}",
            pagefleet_common::report::describe(e.as_ref())
        );
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let args = Args::parse();
    if args.man {
        use clap::CommandFactory;
        let page = clap_mangen::Man::new(Args::command()).section("8");
        page.render(&mut std::io::stdout().lock())
            .context("writing the manual page")?;
        return Ok(());
    }
    let file = match &args.config {
        Some(p) => FileConfig::load(p)?,
        None => FileConfig::default(),
    };
    let flags = Flags {
        lend: args.lend,
        listen: args.listen,
        metrics: args.metrics,
        public_metrics: args.public_metrics.then_some(true),
        public_health: args.public_health.then_some(true),
        secret_file: args.secret_file,
        tls_dir: args.tls_dir,
        max_conns: args.max_conns,
        io_timeout_secs: args.io_timeout,
        handshake_timeout_secs: args.handshake_timeout,
        log: args.log,
        log_format: args.log_format,
        guest_memory: args.guest_memory,
        runner: args.runner,
        guest_dir: args.guest_dir,
        service_dev: args.service_dev,
        peers: args.peers,
        join: args.join,
        advertise: args.advertise,
        name: args.name,
        ksm: args.ksm,
        ksm_cpu_budget: args.ksm_cpu_budget,
        ioqos_device: args.ioqos_device,
        ioqos_tenants: args.ioqos_tenants,
        ioqos_policy: args.ioqos_policy,
        vm_images: args.vm_images,
        dedup: args.no_dedup.then_some(false),
        gc_grace_secs: args.gc_grace,
        stop_drain_secs: args.stop_drain,
        registry: args.registry,
    };
    let a = config::merge(file, flags.clone())?;
    // A reload (SIGHUP) reads the same file again; the flags still win.
    let path = args.config.clone();
    let reread = move || -> std::result::Result<config::Settings, String> {
        let file = match &path {
            Some(p) => FileConfig::load(p).map_err(|e| format!("{e:#}"))?,
            None => FileConfig::default(),
        };
        config::merge(file, flags.clone()).map_err(|e| format!("{e:#}"))
    };
    let filter = tracing_subscriber::EnvFilter::try_new(&a.log).context("bad --log filter")?;
    // The filter behind a handle a reload sets.
    let set_log: pagefleet_daemon::reload::SetLog = match a.log_format {
        config::LogFormat::Plain => {
            let b = tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_writer(std::io::stderr)
                // Colour only for a person at a terminal: a log file (a
                // runner's, the KSM controller's in a bench, systemd's) gets
                // plain text.
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .with_filter_reloading();
            let h = b.reload_handle();
            b.init();
            Box::new(move |f| set_filter(&h, f))
        }
        config::LogFormat::Json => {
            let b = tracing_subscriber::fmt()
                .json()
                .with_env_filter(filter)
                .with_writer(std::io::stderr)
                .with_filter_reloading();
            let h = b.reload_handle();
            b.init();
            Box::new(move |f| set_filter(&h, f))
        }
    };
    let reloader = pagefleet_daemon::reload::Reloader {
        reread: Box::new(reread),
        set_log,
    };
    Ok(pagefleet_daemon::service::run(a, reloader)?)
}

/// Set the log filter behind `h` to `f` (RUST_LOG syntax).
fn set_filter<S>(
    h: &tracing_subscriber::reload::Handle<tracing_subscriber::EnvFilter, S>,
    f: &str,
) -> std::result::Result<(), String> {
    let filter = tracing_subscriber::EnvFilter::try_new(f)
        .map_err(|e| format!("bad log filter {f:?}: {e}"))?;
    h.reload(filter).map_err(|e| e.to_string())
}
