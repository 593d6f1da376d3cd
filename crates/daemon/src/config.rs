//! pagefleetd configuration: a TOML file (`--config`), overridden by flags;
//! both are one type, [`FileConfig`].
//!
//! ```toml
//! name = "rack1-h3"         # this host's name in reports (default: hostname)
//! advertise = "10.0.0.3"    # the IP other hosts reach this one at (default: see crate::advertise)
//! log = "info"
//! log_format = "plain"      # or "json": one JSON object per line (journald, a log shipper)
//! secret_file = "/etc/pagefleet/secret"
//! tls_dir = "/etc/pagefleet/tls"  # this host's certificates (pagefleet cert issue)
//! stop_drain_secs = 0       # on SIGTERM while lending pages to running guests: move them within this (0: refuse)
//!
//! [memserver]
//! lend = "4GiB"
//! listen = "0.0.0.0:7070"
//! metrics = "127.0.0.1:7071" # the HTTP API (default loopback), or "off"
//! public_metrics = false     # GET /metrics without a signature
//! public_health = false      # GET /healthz and /readyz without a signature (a load balancer)
//! max_conns = 512
//! io_timeout_secs = 30
//! handshake_timeout_secs = 5
//! gc_grace_secs = 600        # free regions no live guest or client owns after this idle time (0: never)
//!
//! [guests]                   # the guest host service (off unless memory is set)
//! memory = "8GiB"            # sum of guest budgets this host accepts
//! runner = "/usr/bin/pagefleet-runner"
//! dir = "/run/pagefleet/guests"
//! service_dev = "eth0"
//!
//! [registry]
//! join = "10.0.0.1:7071"      # one host's HTTP address, the same everywhere: announce here, learn the others
//! peers = ["10.0.0.2:7071", "10.0.0.3:7071"]   # or: the other hosts' HTTP addresses
//! etcd = "etcd://10.0.0.1:2379,10.0.0.2:2379"  # or: etcd as the registry (instead of peers)
//!
//! [ksm]                      # same-page merging controller (root; off unless mode is set)
//! mode = "adaptive"          # or "ksmtuned" (Debian's algorithm), "off"
//! cpu_budget = "10%"         # adaptive: ksmd's share of one core
//! pressure_below = "20%"     # adaptive: MemAvailable share that counts as pressure
//! interval_scale = 1.0       # ksmtuned: factor on its 60 s interval
//!
//! [ioqos]                    # I/O guarantee on a shared device (root; off unless device is set)
//! device = "/dev/sdb"        # path or MAJ:MIN
//! tenants = "vm1=machine/vm1:min=20MiB,vm2=qmp:/run/vm2.qmp@drive0:min=10MiB:weight=2"
//! policy = "guarantee"       # or "paper" (Algorithm 1 of paper 004), "observe"
//! model = "2000,200MiB"      # MAX_IOPS,MAX_BYTES_PER_S; default: calibrate with direct reads
//! interval = 1.0             # guarantee: seconds between decisions
//! border = "90%"             # paper: border, rate, cap_time, cap_interval
//! rate = 0.5
//! cap_time = 60.0
//! cap_interval = 5.0
//! ```

use crate::error::{Context, Result};
use pagefleet_common::units;
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How pagefleetd writes its log lines (to stderr: the journal under
/// systemd).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Text; coloured only on a terminal.
    #[default]
    Plain,
    /// One JSON object per line: time, level, target, message and fields.
    Json,
}

/// The daemon's settings as given: the TOML file (`--config`; see the
/// module doc) and the command line are this one type — each setting is
/// written once, with its TOML key (serde) and its flag (clap); a key
/// without a flag is `#[arg(skip)]`. [`merge`] overlays the flags on the
/// file and resolves defaults into [`Settings`].
#[derive(Debug, Default, Clone, Deserialize, clap::Args)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// The IP address other hosts reach this one at. Default: the --listen
    /// address, or when that is 0.0.0.0 this host's address on the route to
    /// the join host (or the first peer, or etcd).
    #[arg(long, value_name = "IP")]
    pub advertise: Option<String>,
    /// This host's name in reports and placement (default: the hostname).
    #[arg(long)]
    pub name: Option<String>,
    /// Log filter (error, warn, info, debug, trace; or RUST_LOG syntax; default info).
    #[arg(long, env = "PAGEFLEET_LOG")]
    pub log: Option<String>,
    /// plain (text; coloured only on a terminal) or json (one object per
    /// line, for journald or a log shipper).
    #[arg(long, value_enum)]
    pub log_format: Option<LogFormat>,
    /// Cluster secret file (default: $PAGEFLEET_SECRET_FILE, else
    /// /etc/pagefleet/secret as root, else ~/.config/pagefleet/secret).
    /// $PAGEFLEET_SECRET, if set, is the secret itself.
    #[arg(long)]
    pub secret_file: Option<PathBuf>,
    /// This host's TLS identity: a directory `pagefleet cert issue` wrote
    /// (default: $PAGEFLEET_TLS_DIR). With one, every port (memory server,
    /// migrations, HTTP API, NBD) takes only TLS with a certificate the
    /// cluster CA signed from peers not on loopback, and this host's
    /// runners and clients speak TLS to such peers. Without: plaintext.
    #[arg(long)]
    pub tls_dir: Option<PathBuf>,
    /// A stop (SIGTERM, SIGINT) while this host's memory server holds pages
    /// of running guests would lose them (guests running here do not stop:
    /// the next daemon adopts their runners): by default it is refused (the
    /// daemon logs what it holds and keeps running; `pagefleet host drain
    /// HOST` empties it, a second signal within a minute stops anyway).
    /// With this many seconds the daemon first moves those pages to other
    /// memory servers (cordoned meanwhile), then stops; if that fails or
    /// takes longer it keeps running. Set the unit's TimeoutStopSec above it.
    #[arg(long = "stop-drain", value_name = "SECS")]
    pub stop_drain_secs: Option<u64>,
    /// `[memserver]`: lending memory.
    #[command(flatten)]
    #[serde(default)]
    pub memserver: MemserverSection,
    /// `[guests]`: the guest host service.
    #[command(flatten)]
    #[serde(default)]
    pub guests: GuestsSection,
    /// `[registry]`: the other hosts.
    #[command(flatten)]
    #[serde(default)]
    pub registry: RegistrySection,
    /// `[ksm]`: the same-page merging controller.
    #[command(flatten)]
    #[serde(default)]
    pub ksm: KsmSection,
    /// `[ioqos]`: the I/O guarantee controller.
    #[command(flatten)]
    #[serde(default)]
    pub ioqos: IoqosSection,
}

/// `[ioqos]`.
#[derive(Debug, Default, Clone, Deserialize, clap::Args)]
#[command(next_help_heading = "I/O controller")]
#[serde(deny_unknown_fields)]
pub struct IoqosSection {
    /// Run the I/O guarantee controller on this shared block device (root);
    /// with --ioqos-tenants. Its state shows in `pagefleet ioqos status`;
    /// every cap is removed when pagefleetd stops.
    #[arg(long = "ioqos-device")]
    pub device: Option<String>,
    /// The device's tenants: NAME=CGROUP|qmp:SOCKET@DRIVE[:min=RATE][:min-iops=N][:weight=W],...
    #[arg(long = "ioqos-tenants")]
    pub tenants: Option<String>,
    /// guarantee (default), paper or observe.
    #[arg(long = "ioqos-policy")]
    pub policy: Option<String>,
    /// MAX_IOPS,MAX_BYTES_PER_S (default: calibrate with direct reads).
    #[arg(skip)]
    pub model: Option<String>,
    /// Seconds the calibration reads.
    #[arg(skip)]
    pub calibrate_secs: Option<f64>,
    /// guarantee: seconds between decisions.
    #[arg(skip)]
    pub interval: Option<f64>,
    /// paper: the share of the device that counts as busy.
    #[arg(skip)]
    pub border: Option<String>,
    /// paper: the capped tenant gets rate x its current value.
    #[arg(skip)]
    pub rate: Option<f64>,
    /// paper: how long a cap lasts, seconds.
    #[arg(skip)]
    pub cap_time: Option<f64>,
    /// paper: seconds between decisions.
    #[arg(skip)]
    pub cap_interval: Option<f64>,
}

/// `[ksm]`.
#[derive(Debug, Default, Clone, Deserialize, clap::Args)]
#[command(next_help_heading = "KSM controller")]
#[serde(deny_unknown_fields)]
pub struct KsmSection {
    /// Run the same-page-merging controller: adaptive, ksmtuned or off
    /// (default off; root). Its state shows in `pagefleet ksm status`; the
    /// host's KSM settings are put back when pagefleetd stops (SIGTERM/SIGINT).
    #[arg(long = "ksm")]
    pub mode: Option<String>,
    /// ksmd's CPU budget for the adaptive controller (default 10%).
    #[arg(long = "ksm-cpu-budget")]
    pub cpu_budget: Option<String>,
    /// adaptive: the MemAvailable share that counts as pressure.
    #[arg(skip)]
    pub pressure_below: Option<String>,
    /// ksmtuned: factor on its 60 s interval.
    #[arg(skip)]
    pub interval_scale: Option<f64>,
}

/// `[guests]`.
#[derive(Debug, Default, Clone, Deserialize, clap::Args)]
#[command(next_help_heading = "Guest host")]
#[serde(deny_unknown_fields)]
pub struct GuestsSection {
    /// Run guests here: the memory their budgets may add up to (e.g. 8GiB).
    #[arg(long = "guest-memory", value_name = "SIZE")]
    pub memory: Option<Size>,
    /// The binary that runs guests (default: `pagefleet-runner` beside pagefleetd).
    #[arg(long)]
    pub runner: Option<PathBuf>,
    /// Where guests' control sockets and logs go (default /run/pagefleet/guests-PORT).
    #[arg(long = "guest-dir")]
    pub dir: Option<PathBuf>,
    /// Network device guests' service addresses are added to (default eth0).
    #[arg(long)]
    pub service_dev: Option<String>,
    /// Directories VM guests' kernels, initramfs and disk images may come
    /// from, comma-separated (default: none, so no VM guests here). A
    /// request naming a file elsewhere is refused.
    #[arg(long, value_delimiter = ',')]
    pub vm_images: Option<Vec<PathBuf>>,
    /// The bridge VM guests' own NICs join (`vm --nic bridge`): the runner
    /// adds a tap for each such VM to it. Connect it to the network the
    /// VMs' addresses belong to (default: none, so VMs here have no NIC
    /// of their own).
    #[arg(long)]
    pub vm_bridge: Option<String>,
    /// Keep no content index of this host's guests: migrations into this
    /// host then receive every page as data (sharing-aware migration off).
    /// By default a scanner hashes running guests' memory at low priority
    /// within a quarter of one CPU, and incoming runners fill pages whose
    /// content is already here (`GET /host` shows the index).
    #[arg(long = "no-dedup", num_args = 0, default_missing_value = "false")]
    pub dedup: Option<bool>,
}

/// `[registry]`.
#[derive(Debug, Default, Clone, Deserialize, clap::Args)]
#[command(next_help_heading = "Registry")]
#[serde(deny_unknown_fields)]
pub struct RegistrySection {
    /// The other hosts' pagefleetd HTTP addresses (registry), comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub peers: Option<Vec<String>>,
    /// One host's pagefleetd HTTP address, the same on every host (the
    /// first one set up, say): this host announces itself there every 5 s
    /// and learns every other host from it, so no host lists the others.
    /// The join host itself may be given it too.
    #[arg(long, value_name = "HOST:PORT")]
    pub join: Option<String>,
    /// An etcd cluster as the registry instead of --peers:
    /// etcd://HOST:2379[,HOST:2379...]. This host then keeps a lease-bound
    /// heartbeat there (its report and guests, every 2 s, expiring 10 s
    /// after the last), and `GET /cluster` and placement read etcd.
    #[arg(long = "registry", value_name = "etcd://HOST:PORT,...")]
    pub etcd: Option<String>,
}

/// `[memserver]`.
#[derive(Debug, Default, Clone, Deserialize, clap::Args)]
#[command(next_help_heading = "Memory server")]
#[serde(deny_unknown_fields)]
pub struct MemserverSection {
    /// Memory to lend (e.g. 4GiB, 512MiB). The server never holds more pages
    /// than this; its own overhead beyond it is small and bounded.
    #[arg(long, value_name = "SIZE")]
    pub lend: Option<Size>,
    /// Address for the memory-server protocol (default 127.0.0.1:7070). Port
    /// 0 picks a free port; the bound address is printed on stdout as `listening ADDR`.
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<String>,
    /// The HTTP API's address (metrics, host report, guests, migrations,
    /// registry), or `off`. Default: 127.0.0.1 with the --listen port + 1
    /// (a free port when listening on port 0). Give this host's cluster
    /// address so peers and CLIs elsewhere reach it; every request must be
    /// signed with the cluster secret (the pagefleet CLI does).
    #[arg(long, visible_alias = "http", value_name = "ADDR|off")]
    pub metrics: Option<String>,
    /// Serve `GET /metrics` without a signature (for a Prometheus scraper);
    /// every other route still requires the cluster secret.
    #[arg(long, num_args = 0, default_missing_value = "true")]
    pub public_metrics: Option<bool>,
    /// Serve `GET /healthz` (the daemon answers) and `GET /readyz` (it
    /// serves and is not stopping, draining or restarting) without a
    /// signature, for a load balancer's probes; they tell nothing else.
    #[arg(long, num_args = 0, default_missing_value = "true")]
    pub public_health: Option<bool>,
    /// Most simultaneous authenticated client sessions (default 512).
    /// Connections waiting to authenticate do not count: they have their
    /// own cap and deadline (see --handshake-timeout).
    #[arg(long, value_name = "N")]
    pub max_conns: Option<u32>,
    /// Drop a client whose request or reply frame is not complete after
    /// this many seconds (default 30). Idle between frames is fine.
    #[arg(long = "io-timeout", value_name = "SECS")]
    pub io_timeout_secs: Option<u64>,
    /// Drop a connection that has not proved the cluster secret after this
    /// many seconds (default 5).
    #[arg(long = "handshake-timeout", value_name = "SECS")]
    pub handshake_timeout_secs: Option<u64>,
    /// Free regions on this host's memory server that no guest in the
    /// registry and no connected client owns, once idle this many seconds
    /// (default 600; 0: never). Checked every minute (every grace period when shorter); nothing is freed
    /// while any host of the registry cannot be asked. `pagefleet gc`
    /// collects on demand.
    #[arg(long = "gc-grace", value_name = "SECS")]
    pub gc_grace_secs: Option<u64>,
}

/// What the command line said: the same type as the file (each setting
/// once, with its TOML key and its flag), `None` where not given.
pub type Flags = FileConfig;

/// The daemon's effective settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// Memory to lend.
    pub lend: Option<u64>,
    /// The memory-server address.
    pub listen: String,
    /// The HTTP API address, or off.
    pub metrics: Option<String>,
    /// `GET /metrics` without a signature.
    pub public_metrics: bool,
    /// GET /healthz and /readyz without a signature.
    pub public_health: bool,
    /// The cluster secret file.
    pub secret_file: Option<PathBuf>,
    /// This host's TLS identity directory (none: `$PAGEFLEET_TLS_DIR`, else
    /// plaintext only).
    pub tls_dir: Option<PathBuf>,
    /// Most simultaneous client connections.
    pub max_conns: u32,
    /// Drop a client stalled this long.
    pub io_timeout: Duration,
    /// Drop a connection not authenticated after this long.
    pub handshake_timeout: Duration,
    /// Log filter (error, warn, info, debug, trace; or RUST_LOG syntax).
    pub log: String,
    /// How log lines are written.
    pub log_format: LogFormat,
    /// Memory this host gives guests (guest host service on).
    pub guest_memory: Option<u64>,
    /// The binary that runs guests (default: `pagefleet-runner` beside pagefleetd).
    pub runner: Option<PathBuf>,
    /// Where guests' control sockets and logs go.
    pub guest_dir: Option<PathBuf>,
    /// Network device guests' service addresses go on (None: eth0, the
    /// default, which need not exist on a host whose guests take no
    /// service address).
    pub service_dev: Option<String>,
    /// The other hosts' HTTP API addresses.
    pub peers: Vec<String>,
    /// The host to announce this one to and learn the others from.
    pub join: Option<String>,
    /// The IP address other hosts reach this one at (None: see
    /// [`crate::advertise`]).
    pub advertise: Option<std::net::IpAddr>,
    /// This host's name in reports (default: the hostname).
    pub name: Option<String>,
    /// The KSM controller to run (None: none).
    pub ksm: Option<pagefleet_ksm::control::Spec>,
    /// The I/O guarantee controller to run (None: none).
    pub ioqos: Option<pagefleet_ioqos::control::Spec>,
    /// Directories VM guests' files may come from (none: no VMs here).
    pub vm_images: Vec<PathBuf>,
    /// The bridge VM guests' own NICs join (None: VMs here have none).
    pub vm_bridge: Option<String>,
    /// Keep a content index of the guests' memory (sharing-aware migration).
    pub dedup: bool,
    /// Free regions on this host's memory server that no live guest or
    /// connected client owns once idle this long (None: never).
    pub gc_grace: Option<Duration>,
    /// etcd endpoints of the registry (None: the embedded peers registry).
    pub etcd: Option<Vec<String>>,
    /// A stop (SIGTERM, SIGINT) while guests run here or this host's
    /// memory server holds pages of running guests: drain the host within
    /// this long first, then stop (None: refuse the stop; a second signal
    /// within a minute stops anyway).
    pub stop_drain: Option<Duration>,
}

impl FileConfig {
    /// Read and parse the file at `path`.
    pub fn load(path: &Path) -> Result<FileConfig> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read config {}", path.display()))?;
        Ok(FileConfig::parse(&text).with_context(|| format!("in config {}", path.display()))?)
    }
    /// Parse TOML text.
    pub fn parse(text: &str) -> Result<FileConfig> {
        Ok(toml::from_str(text)?)
    }
}

/// A size in bytes: `4GiB`, `512MiB`, `64KiB` or plain bytes, in a flag or
/// the file (a TOML string or integer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Size(pub u64);

impl std::str::FromStr for Size {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Size, String> {
        units::parse_size(s).map(Size).map_err(|e| e.to_string())
    }
}

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Size, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Bytes(u64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Bytes(b) => Ok(Size(b)),
            Raw::Text(t) => t.parse().map_err(serde::de::Error::custom),
        }
    }
}

/// `over`'s settings where it has them, else `self`'s, field by field.
macro_rules! overlay {
    ($base:expr, $over:expr, [$($field:ident),* $(,)?]) => {{
        let (base, over) = ($base, $over);
        Self {
            $($field: over.$field.or(base.$field),)*
        }
    }};
}

impl MemserverSection {
    fn overlay(self, over: Self) -> Self {
        overlay!(
            self,
            over,
            [
                lend,
                listen,
                metrics,
                public_metrics,
                public_health,
                max_conns,
                io_timeout_secs,
                handshake_timeout_secs,
                gc_grace_secs
            ]
        )
    }
}

impl GuestsSection {
    fn overlay(self, over: Self) -> Self {
        overlay!(
            self,
            over,
            [
                memory,
                runner,
                dir,
                service_dev,
                vm_images,
                vm_bridge,
                dedup
            ]
        )
    }
}

impl RegistrySection {
    fn overlay(self, over: Self) -> Self {
        overlay!(self, over, [peers, join, etcd])
    }
}

impl KsmSection {
    fn overlay(self, over: Self) -> Self {
        overlay!(
            self,
            over,
            [mode, cpu_budget, pressure_below, interval_scale]
        )
    }
}

impl IoqosSection {
    fn overlay(self, over: Self) -> Self {
        overlay!(
            self,
            over,
            [
                device,
                tenants,
                policy,
                model,
                calibrate_secs,
                interval,
                border,
                rate,
                cap_time,
                cap_interval
            ]
        )
    }
}

impl FileConfig {
    /// `over`'s settings where it has them (the flags), else `self`'s (the
    /// file).
    pub fn overlay(self, over: FileConfig) -> FileConfig {
        FileConfig {
            advertise: over.advertise.or(self.advertise),
            name: over.name.or(self.name),
            log: over.log.or(self.log),
            log_format: over.log_format.or(self.log_format),
            secret_file: over.secret_file.or(self.secret_file),
            tls_dir: over.tls_dir.or(self.tls_dir),
            stop_drain_secs: over.stop_drain_secs.or(self.stop_drain_secs),
            memserver: self.memserver.overlay(over.memserver),
            guests: self.guests.overlay(over.guests),
            registry: self.registry.overlay(over.registry),
            ksm: self.ksm.overlay(over.ksm),
            ioqos: self.ioqos.overlay(over.ioqos),
        }
    }
}

/// Flags win over the file; the file wins over built-in defaults.
pub fn merge(file: FileConfig, flags: Flags) -> Result<Settings> {
    let o = file.overlay(flags);
    let (m, g, reg, k, q) = (o.memserver, o.guests, o.registry, o.ksm, o.ioqos);
    let io = m.io_timeout_secs.unwrap_or(30);
    if io == 0 {
        return Err(crate::Error::Invalid(
            "io_timeout must be at least 1 second".to_string(),
        ));
    }
    let hs = m.handshake_timeout_secs.unwrap_or(5);
    if hs == 0 {
        return Err(crate::Error::Invalid(
            "handshake_timeout must be at least 1 second".to_string(),
        ));
    }
    let ksm = match k.mode.as_deref() {
        None | Some("off") => None,
        Some(mode) => {
            let d = pagefleet_ksm::control::Spec::default();
            let spec = pagefleet_ksm::control::Spec {
                mode: mode.to_string(),
                cpu_budget: k.cpu_budget.unwrap_or(d.cpu_budget.clone()),
                pressure_below: k.pressure_below.unwrap_or(d.pressure_below.clone()),
                interval_scale: k.interval_scale.unwrap_or(d.interval_scale),
                ..d
            };
            // Checked now: a bad value is a startup error, not a silent no-op.
            spec.options(None, false, None).context("[ksm]")?;
            Some(spec)
        }
    };
    let ioqos = match q.device {
        None => {
            if q.tenants.is_some() {
                return Err(crate::Error::Invalid(
                    "[ioqos] tenants given without a device (--ioqos-device)".to_string(),
                ));
            }
            None
        }
        Some(device) => {
            let d = pagefleet_ioqos::control::Spec::default();
            let spec = pagefleet_ioqos::control::Spec {
                device,
                tenants: q
                    .tenants
                    .context("[ioqos] needs tenants (--ioqos-tenants)")?,
                policy: q.policy.unwrap_or(d.policy.clone()),
                model: q.model,
                calibrate_secs: q.calibrate_secs.unwrap_or(d.calibrate_secs),
                interval: q.interval.unwrap_or(d.interval),
                border: q.border.unwrap_or(d.border.clone()),
                rate: q.rate.unwrap_or(d.rate),
                cap_time: q.cap_time.unwrap_or(d.cap_time),
                cap_interval: q.cap_interval.unwrap_or(d.cap_interval),
            };
            // Checked now: a bad value is a startup error, not a silent no-op.
            spec.check().context("[ioqos]")?;
            Some(spec)
        }
    };
    let max_conns = m.max_conns.unwrap_or(512);
    if max_conns == 0 {
        return Err(crate::Error::Invalid(
            "max_conns must be at least 1".to_string(),
        ));
    }
    let etcd = match &reg.etcd {
        Some(s) => Some(
            pagefleet_registry::parse_endpoints(s)
                .map_err(|e| crate::Error::Invalid(e.to_string()))?,
        ),
        None => None,
    };
    let gc = m.gc_grace_secs.unwrap_or(600);
    let join = reg.join;
    if let Some(j) = &join {
        if etcd.is_some() {
            return Err(crate::Error::Invalid(format!(
                "[registry] join = {j:?} is for the embedded registry; with etcd every host finds the others there: drop one"
            )));
        }
        crate::advertise::check_host_port(j).context("[registry] join")?;
    }
    let advertise = match o.advertise {
        Some(a) => Some(a.parse::<std::net::IpAddr>().map_err(|_| {
            crate::Error::Invalid(format!("advertise = {a:?} is not an IP address"))
        })?),
        None => None,
    };
    Ok(Settings {
        lend: m.lend.map(|s| s.0),
        listen: m.listen.unwrap_or_else(|| "127.0.0.1:7070".into()),
        metrics: m.metrics,
        public_metrics: m.public_metrics.unwrap_or(false),
        public_health: m.public_health.unwrap_or(false),
        secret_file: o.secret_file,
        tls_dir: o.tls_dir,
        max_conns,
        io_timeout: Duration::from_secs(io),
        handshake_timeout: Duration::from_secs(hs),
        log: o.log.unwrap_or_else(|| "info".into()),
        log_format: o.log_format.unwrap_or_default(),
        guest_memory: g.memory.map(|s| s.0),
        runner: g.runner,
        guest_dir: g.dir,
        service_dev: g.service_dev,
        peers: reg.peers.unwrap_or_default(),
        join,
        advertise,
        etcd,
        name: o.name,
        ksm,
        ioqos,
        vm_images: g.vm_images.unwrap_or_default(),
        vm_bridge: g.vm_bridge,
        dedup: g.dedup.unwrap_or(true),
        gc_grace: (gc > 0).then(|| Duration::from_secs(gc)),
        stop_drain: o
            .stop_drain_secs
            .filter(|s| *s > 0)
            .map(Duration::from_secs),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The flags parse into `Flags` as the TOML keys would: switches are
    /// `Some` only when given, renamed flags land in their fields.
    #[test]
    fn flags_parse_into_their_fields() {
        #[derive(clap::Parser)]
        struct Cmd {
            #[command(flatten)]
            flags: Flags,
        }
        use clap::Parser;
        let f = Cmd::try_parse_from([
            "pagefleetd",
            "--lend",
            "64MiB",
            "--io-timeout",
            "7",
            "--no-dedup",
            "--public-metrics",
            "--peers",
            "a:1,b:2",
            "--stop-drain",
            "30",
        ])
        .unwrap()
        .flags;
        assert_eq!(f.memserver.lend, Some(Size(64 << 20)));
        assert_eq!(f.memserver.io_timeout_secs, Some(7));
        assert_eq!(f.guests.dedup, Some(false));
        assert_eq!(f.memserver.public_metrics, Some(true));
        assert_eq!(f.memserver.public_health, None);
        assert_eq!(
            f.registry.peers,
            Some(vec!["a:1".to_string(), "b:2".to_string()])
        );
        assert_eq!(f.stop_drain_secs, Some(30));
        let none = Cmd::try_parse_from(["pagefleetd"]).unwrap().flags;
        assert_eq!(
            (
                none.guests.dedup,
                none.memserver.public_metrics,
                none.memserver.lend
            ),
            (None, None, None)
        );
        // A file key without a flag is not a flag.
        assert!(Cmd::try_parse_from(["pagefleetd", "--cap-time", "3"]).is_err());
    }

    /// The shipped sample forms a cluster by changing one address: every
    /// listener on every address, and the join host the only address in it.
    #[test]
    fn the_sample_config_names_one_address_the_join_host() {
        let text = include_str!("../../../packaging/pagefleetd.toml");
        let s = merge(FileConfig::parse(text).unwrap(), Flags::default()).unwrap();
        assert_eq!(s.listen, "0.0.0.0:7070");
        assert_eq!(s.metrics.as_deref(), Some("0.0.0.0:7071"));
        assert_eq!(s.join.as_deref(), Some("10.0.0.1:7071"));
        assert!(s.peers.is_empty() && s.etcd.is_none() && s.advertise.is_none());
        let addresses: Vec<&str> = text
            .lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .flat_map(|l| l.split('"'))
            .filter(|w| {
                w.parse::<std::net::SocketAddr>()
                    .is_ok_and(|a| !a.ip().is_unspecified())
            })
            .collect();
        assert_eq!(addresses, ["10.0.0.1:7071"], "the one address to change");
    }

    #[test]
    fn join_is_host_and_port_and_not_with_etcd() {
        let bad = |t: &str| {
            format!(
                "{:#}",
                merge(FileConfig::parse(t).unwrap(), Flags::default()).unwrap_err()
            )
        };
        assert!(bad("[registry]\njoin = \"10.0.0.1\"\n").contains("HOST:PORT"));
        assert!(
            bad("[registry]\njoin = \"h1:7071\"\netcd = \"etcd://h1:2379\"\n").contains("etcd")
        );
        assert!(bad("advertise = \"h1\"\n").contains("not an IP"));
        let s = merge(
            FileConfig::parse("advertise = \"10.0.0.9\"\n[registry]\njoin = \"h1:7071\"\n")
                .unwrap(),
            Flags {
                registry: RegistrySection {
                    join: Some("h2:7071".into()),
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(
            (s.join.as_deref(), s.advertise),
            (Some("h2:7071"), Some("10.0.0.9".parse().unwrap()))
        );
    }

    #[test]
    fn log_format_and_health_probes_come_from_the_file_or_the_flags() {
        let f = FileConfig::parse("log_format = \"json\"\n[memserver]\npublic_health = true\n")
            .unwrap();
        let s = merge(f, Flags::default()).unwrap();
        assert_eq!(s.log_format, LogFormat::Json);
        assert!(s.public_health && !s.public_metrics);
        let d = merge(FileConfig::default(), Flags::default()).unwrap();
        assert_eq!(d.log_format, LogFormat::Plain);
        assert!(!d.public_health);
        let s = merge(
            FileConfig::parse("log_format = \"json\"\n").unwrap(),
            Flags {
                log_format: Some(LogFormat::Plain),
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(s.log_format, LogFormat::Plain);
        let e = FileConfig::parse("log_format = \"xml\"\n").unwrap_err();
        assert!(format!("{e:#}").contains("plain"), "{e:#}");
    }

    #[test]
    fn flags_override_file_and_file_overrides_defaults() {
        let f = FileConfig::parse(
            "log = \"debug\"\nsecret_file = \"/x/secret\"\n[memserver]\nlend = \"2GiB\"\nlisten = \"0.0.0.0:9000\"\nmax_conns = 7\n",
        )
        .unwrap();
        let s = merge(
            f,
            Flags {
                memserver: MemserverSection {
                    listen: Some("127.0.0.1:1".into()),
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(s.lend, Some(2 << 30));
        assert_eq!(s.listen, "127.0.0.1:1");
        assert_eq!(s.max_conns, 7);
        assert_eq!(s.log, "debug");
        assert_eq!(s.secret_file, Some(PathBuf::from("/x/secret")));
        assert_eq!(s.io_timeout, Duration::from_secs(30));
        let d = merge(FileConfig::default(), Flags::default()).unwrap();
        assert_eq!(
            (d.listen.as_str(), d.max_conns, d.lend),
            ("127.0.0.1:7070", 512, None)
        );
        let g = merge(
            FileConfig::parse("[guests]\nmemory = \"1GiB\"\n[registry]\npeers = [\"a:1\"]\n")
                .unwrap(),
            Flags::default(),
        )
        .unwrap();
        assert_eq!(
            (g.guest_memory, g.peers.clone(), g.service_dev.as_deref()),
            (Some(1 << 30), vec!["a:1".to_string()], None)
        );
    }

    #[test]
    fn the_packaged_config_parses() {
        let f = FileConfig::parse(include_str!("../../../packaging/pagefleetd.toml")).unwrap();
        let s = merge(f, Flags::default()).unwrap();
        assert_eq!(s.lend, Some(4 << 30));
        assert_eq!(s.guest_memory, Some(16 << 30));
    }

    #[test]
    fn bad_config_is_a_clear_error() {
        let e = FileConfig::parse("[memserver]\nlendd = \"1GiB\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("lendd"), "{e}");
        let e = FileConfig::parse("[memserver]\nlend = \"lots\"\n").unwrap_err();
        assert!(format!("{e:#}").contains("lend"), "{e:#}");
        let n = FileConfig::parse("[memserver]\nlend = 4096\n").unwrap();
        assert_eq!(n.memserver.lend, Some(Size(4096)));
        assert!(merge(
            FileConfig::default(),
            Flags {
                memserver: MemserverSection {
                    max_conns: Some(0),
                    ..Default::default()
                },
                ..Default::default()
            }
        )
        .is_err());
        let e = merge(
            FileConfig::parse("[ksm]\nmode = \"turbo\"\n").unwrap(),
            Flags::default(),
        )
        .unwrap_err();
        assert!(format!("{e:#}").contains("unknown --mode turbo"), "{e:#}");
        let e = merge(
            FileConfig::default(),
            Flags {
                ksm: KsmSection {
                    mode: Some("adaptive".into()),
                    cpu_budget: Some("300%".into()),
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .unwrap_err();
        assert!(format!("{e:#}").contains("--cpu-budget"), "{e:#}");
        let k = merge(
            FileConfig::parse("[ksm]\nmode = \"ksmtuned\"\ninterval_scale = 0.5\n").unwrap(),
            Flags::default(),
        )
        .unwrap();
        assert_eq!(
            k.ksm.map(|s| (s.mode, s.interval_scale)),
            Some(("ksmtuned".to_string(), 0.5))
        );
        assert!(merge(
            FileConfig::parse("[ksm]\nmode = \"off\"\n").unwrap(),
            Flags::default()
        )
        .unwrap()
        .ksm
        .is_none());
    }

    #[test]
    fn ioqos_section() {
        // Any block device of this host, by MAJ:MIN (no root needed to parse it).
        let Some(dev) = std::fs::read_dir("/sys/block")
            .into_iter()
            .flatten()
            .flatten()
            .find_map(|e| std::fs::read_to_string(e.path().join("dev")).ok())
            .map(|s| s.trim().to_string())
        else {
            eprintln!("skipped: no block device");
            return;
        };
        let cfg = |rest: &str| {
            FileConfig::parse(&format!("[ioqos]\ndevice = \"{dev}\"\n{rest}")).unwrap()
        };
        let q = merge(
            cfg("tenants = \"a=qmp:/run/vm-a.qmp@drive0:min=10MiB\"\npolicy = \"paper\"\nmodel = \"2000,200MiB\"\ncap_time = 30.0\n"),
            Flags::default(),
        )
        .unwrap()
        .ioqos
        .unwrap();
        assert_eq!((q.policy.as_str(), q.cap_time), ("paper", 30.0));
        let e = merge(
            cfg("tenants = \"a=qmp:/run/vm-a.qmp@drive0\"\npolicy = \"paper\"\nrate = 1.5\n"),
            Flags::default(),
        )
        .unwrap_err();
        assert!(
            format!("{e:#}").contains("rate must be between 0 and 1"),
            "{e:#}"
        );
        let e = merge(
            FileConfig::default(),
            Flags {
                ioqos: IoqosSection {
                    tenants: Some("a=x".into()),
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .unwrap_err();
        assert!(format!("{e:#}").contains("without a device"), "{e:#}");
        let e = merge(
            FileConfig::default(),
            Flags {
                ioqos: IoqosSection {
                    device: Some(dev.clone()),
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .unwrap_err();
        assert!(format!("{e:#}").contains("needs tenants"), "{e:#}");
    }
}
