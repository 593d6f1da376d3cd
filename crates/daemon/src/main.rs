//! pagefleetd — the pagefleet host daemon.

use anyhow::{bail, Context, Result};
use clap::Parser;
use pagefleet_daemon::config::{self, FileConfig, Flags};
use pagefleet_common::http::Client;
use pagefleet_common::httpauth::Verifier;
use pagefleet_common::units;
use pagefleet_daemon::api::{self, App};
use pagefleet_daemon::guests::{GuestConfig, Guests};
use pagefleet_daemon::http::{self, Gate};
use pagefleet_daemon::MemServer;
use pagefleet_memserver::{metrics, ServerConfig};
use pagefleet_proto::auth::Secret;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

/// The pagefleet host daemon. Services:
///
///   memory server   lends this host's spare memory to remote regions
///                   (guests paging to it, remote block devices built on it)
///   guest host      starts and stops guests (runners) within --guest-memory,
///                   receives incoming migrations, sends guests away
///   registry        GET /cluster: every host's report and guests (--peers)
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
///     pagefleetd --lend 2GiB --guest-memory 8GiB --listen 10.0.0.1:7070 \
///                --peers 10.0.0.2:7071,10.0.0.3:7071
///
/// Clients authenticate with the cluster secret: a file holding at least 16
/// bytes, created (mode 0600) on first start if missing. Copy the same file to
/// every host of the cluster.
///
/// Settings can also come from a TOML file (`--config`, see
/// packaging/pagefleetd.toml); flags override it.
#[derive(Parser, Debug)]
#[command(version, verbatim_doc_comment)]
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
    /// Cluster secret file (default: $PAGEFLEET_SECRET_FILE, else
    /// /etc/pagefleet/secret as root, else ~/.config/pagefleet/secret).
    /// $PAGEFLEET_SECRET, if set, is the secret itself.
    #[arg(long)]
    secret_file: Option<PathBuf>,
    /// Most simultaneous client connections (default 512).
    #[arg(long)]
    max_conns: Option<u32>,
    /// Drop a client stalled mid-frame (or not reading replies) this long, in seconds (default 30).
    #[arg(long)]
    io_timeout: Option<u64>,
    /// Run guests here: the memory their budgets may add up to (e.g. 8GiB).
    #[arg(long, value_parser = units::parse_size)]
    guest_memory: Option<u64>,
    /// The `pagefleet` binary that runs guests (default: beside pagefleetd).
    #[arg(long)]
    runner: Option<PathBuf>,
    /// Where guests' control sockets and logs go (default /run/pagefleet/guests-PORT).
    #[arg(long)]
    guest_dir: Option<PathBuf>,
    /// Network device guests' service addresses are added to (default eth0).
    #[arg(long)]
    service_dev: Option<String>,
    /// The other hosts' pagefleetd HTTP addresses (registry), comma-separated.
    #[arg(long, value_delimiter = ',')]
    peers: Option<Vec<String>>,
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
}

fn main() {
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
    let file = match &args.config {
        Some(p) => FileConfig::load(p)?,
        None => FileConfig::default(),
    };
    let a = config::merge(
        file,
        Flags {
            lend: args.lend,
            listen: args.listen,
            metrics: args.metrics,
            public_metrics: args.public_metrics.then_some(true),
            secret_file: args.secret_file,
            max_conns: args.max_conns,
            io_timeout_secs: args.io_timeout,
            log: args.log,
            guest_memory: args.guest_memory,
            runner: args.runner,
            guest_dir: args.guest_dir,
            service_dev: args.service_dev,
            peers: args.peers,
            name: args.name,
            ksm: args.ksm,
            ksm_cpu_budget: args.ksm_cpu_budget,
            ioqos_device: args.ioqos_device,
            ioqos_tenants: args.ioqos_tenants,
            ioqos_policy: args.ioqos_policy,
        },
    )?;
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&a.log).context("bad --log filter")?,
        )
        .with_writer(std::io::stderr)
        .init();
    if a.lend.is_none() && a.guest_memory.is_none() && a.ksm.is_none() && a.ioqos.is_none() {
        bail!("nothing to do: lend memory with --lend SIZE (e.g. --lend 4GiB), run guests with --guest-memory SIZE, control KSM with --ksm adaptive and/or guarantee I/O with --ioqos-device DEV --ioqos-tenants SPEC; see --help");
    }
    // SIGTERM/SIGINT end the daemon cleanly (the KSM controller puts the host's settings back).
    let stop = pagefleet_common::signal::stop_flag();
    let ksm = match &a.ksm {
        Some(spec) => {
            let opts = spec.options(
                Some(PathBuf::from(pagefleet_ksm::control::DEFAULT_STATE)),
                false,
                None,
            )?;
            pagefleet_ksm::sysfs::available()?;
            tracing::info!("KSM controller: {}", spec.mode);
            Some(std::thread::spawn(move || {
                if let Err(e) = pagefleet_ksm::control::run(&opts, stop, |_| {}) {
                    tracing::error!("KSM controller stopped: {e:#}");
                }
            }))
        }
        None => None,
    };
    let ioqos = match &a.ioqos {
        Some(spec) => {
            let opts = spec.options(
                Some(PathBuf::from(pagefleet_ioqos::control::DEFAULT_STATE)),
                None,
            )?;
            tracing::info!(
                "I/O controller: {} on {} ({} tenants)",
                spec.policy,
                spec.device,
                opts.tenants.len()
            );
            Some(std::thread::spawn(move || {
                if let Err(e) = pagefleet_ioqos::control::run(&opts, stop, |_| {}) {
                    tracing::error!("I/O controller stopped: {e:#}");
                }
            }))
        }
        None => None,
    };
    if a.lend.is_some_and(|l| l < 4096) {
        bail!("--lend is less than one 4 KiB page");
    }
    let (secret, created) = Secret::load_or_create(a.secret_file.as_deref())?;
    if created {
        let p = a.secret_file.clone().unwrap_or_else(Secret::default_path);
        tracing::info!(
            "created a new cluster secret at {}; copy it to every host of the cluster",
            p.display()
        );
    }
    let cfg = ServerConfig {
        max_conns: a.max_conns,
        io_timeout: a.io_timeout,
    };
    let ms = match a.lend {
        Some(lend) => Some(MemServer::start(&a.listen, lend, secret.clone(), cfg)?),
        None => None,
    };
    let listen_addr: std::net::SocketAddr = match &ms {
        Some(m) => m.addr,
        None => a
            .listen
            .parse()
            .with_context(|| format!("--listen {} is not IP:PORT", a.listen))?,
    };
    let http_listen = match a.metrics.as_deref() {
        Some("off") => None,
        Some(m) => Some(m.to_string()),
        // Loopback unless configured: the API is for this host's CLI until
        // the operator opens it to the cluster's addresses.
        None if listen_addr.port() == 0 || a.listen.ends_with(":0") => {
            Some("127.0.0.1:0".to_string())
        }
        None => Some(format!("127.0.0.1:{}", listen_addr.port().wrapping_add(1))),
    };
    let guests = match a.guest_memory {
        Some(mem) => {
            if http_listen.is_none() {
                bail!("the guest host service needs the HTTP endpoint: drop --metrics off");
            }
            let runner = match a.runner.clone() {
                Some(r) => r,
                None => std::env::current_exe()?.with_file_name("pagefleet"),
            };
            let port = listen_addr.port();
            let dir = a
                .guest_dir
                .clone()
                .unwrap_or_else(|| PathBuf::from(format!("/run/pagefleet/guests-{port}")));
            Some(Guests::new(GuestConfig {
                memory: mem,
                runner,
                dir,
                service_dev: a.service_dev.clone(),
                ip: listen_addr.ip().to_string(),
                secret: secret.clone(),
            })?)
        }
        None => None,
    };
    let haddr = match http_listen {
        Some(h) => {
            let self_http = Arc::new(std::sync::OnceLock::<String>::new());
            let st = ms.as_ref().map(|m| (m.state.clone(), m.addr));
            let (g, me, name) = (guests.clone(), self_http.clone(), a.name.clone());
            let report = move || {
                let mut r = pagefleet_daemon::host_report(st.as_ref().map(|(s, a)| (&**s, *a)));
                r.http = me.get().cloned();
                if let Some(n) = &name {
                    r.hostname = n.clone();
                }
                if let Some(g) = &g {
                    r.guest_memory = g.cfg.memory;
                    r.guest_free = g.free_bytes();
                    r.guests = g.count() as u64;
                }
                r
            };
            let (st, g) = (ms.as_ref().map(|m| m.state.clone()), guests.clone());
            let metrics_text = move || {
                let mut b = st.as_ref().map(|s| metrics::render(s)).unwrap_or_default();
                if let Some(g) = &g {
                    b.push_str(&g.metrics());
                }
                b
            };
            let app = Arc::new(App {
                guests: guests.clone(),
                report: Box::new(report),
                metrics: Box::new(metrics_text),
                peers: a.peers.clone(),
                client: Client::new(secret.clone()),
            });
            let gate = Gate {
                verifier: Verifier::new(secret.clone()),
                public_metrics: a.public_metrics,
            };
            let addr = http::serve(&h, api::router(app), gate)?;
            let _ = self_http.set(addr.to_string());
            Some(addr)
        }
        None => None,
    };
    if let Some(m) = &ms {
        tracing::info!(
            "memory server lending {} on {}{}",
            units::fmt_size(m.state.store.stats(0).capacity_pages * 4096),
            m.addr,
            haddr
                .map(|m| format!(", metrics on http://{m}/metrics"))
                .unwrap_or_default()
        );
    }
    if let Some(g) = a.guest_memory {
        tracing::info!("guest host service: {} for guests", units::fmt_size(g));
    }
    let mut out = std::io::stdout().lock();
    if let Some(m) = &ms {
        writeln!(out, "listening {}", m.addr)?;
    }
    if let Some(m) = haddr {
        writeln!(out, "metrics {m}")?;
    }
    out.flush()?;
    drop(out);
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    tracing::info!("stopping");
    if let Some(k) = ksm {
        let _ = k.join();
    }
    if let Some(q) = ioqos {
        let _ = q.join();
    }
    Ok(())
}

