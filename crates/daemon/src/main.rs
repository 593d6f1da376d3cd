//! pagefleetd — the pagefleet host daemon.

use anyhow::{bail, Context, Result};
use clap::Parser;
use pagefleet_daemon::config::{self, FileConfig, Flags};
use pagefleet_daemon::{http, units, MemServer};
use pagefleet_memserver::{metrics, ServerConfig};
use pagefleet_proto::auth::Secret;
use std::io::Write;
use std::path::PathBuf;

/// The pagefleet host daemon. Today it runs the memory-server service: it
/// lends this host's spare memory to remote regions (guests paging to it,
/// remote block devices built on it).
///
/// Example: lend 4 GiB on loopback, metrics on port 7071:
///
///     pagefleetd --lend 4GiB --listen 127.0.0.1:7070
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
    /// Prometheus metrics address (`GET /metrics`), or `off`. Default: the
    /// listen address with port + 1 (or a free port when listening on port 0).
    #[arg(long)]
    metrics: Option<String>,
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
    /// Log filter (error, warn, info, debug, trace; or RUST_LOG syntax; default info).
    #[arg(long, env = "PAGEFLEET_LOG")]
    log: Option<String>,
}

fn main() {
    if let Err(e) = run() {
        eprintln!("pagefleetd: error: {e:#}");
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
            secret_file: args.secret_file,
            max_conns: args.max_conns,
            io_timeout_secs: args.io_timeout,
            log: args.log,
        },
    )?;
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_new(&a.log).context("bad --log filter")?)
        .with_writer(std::io::stderr)
        .init();
    let Some(lend) = a.lend else {
        bail!("nothing to do: enable the memory server with --lend SIZE (e.g. --lend 4GiB) or `lend` under [memserver] in --config; see --help");
    };
    if lend < 4096 {
        bail!("--lend {lend} is less than one 4 KiB page");
    }
    let (secret, created) = Secret::load_or_create(a.secret_file.as_deref())?;
    if created {
        let p = a.secret_file.clone().unwrap_or_else(Secret::default_path);
        tracing::info!("created a new cluster secret at {}; copy it to every host of the cluster", p.display());
    }
    let cfg = ServerConfig { max_conns: a.max_conns, io_timeout: a.io_timeout };
    let ms = MemServer::start(&a.listen, lend, secret, cfg)?;
    let metrics_listen = match a.metrics.as_deref() {
        Some("off") => None,
        Some(m) => Some(m.to_string()),
        None if ms.addr.port() == 0 => None,
        None if a.listen.ends_with(":0") => Some(format!("{}:0", ms.addr.ip())),
        None => Some(format!("{}:{}", ms.addr.ip(), ms.addr.port().wrapping_add(1))),
    };
    let maddr = match metrics_listen {
        Some(m) => {
            let st = ms.state.clone();
            let st2 = ms.state.clone();
            let addr = ms.addr;
            let host = std::sync::Arc::new(move || {
                serde_json::to_string(&pagefleet_daemon::HostReport::collect(Some((&st2, addr)))).unwrap_or_default()
            });
            Some(http::start(&m, std::sync::Arc::new(move || metrics::render(&st)), host)?)
        }
        None => None,
    };
    tracing::info!(
        "memory server lending {} on {}{}",
        units::fmt_size(lend / 4096 * 4096),
        ms.addr,
        maddr.map(|m| format!(", metrics on http://{m}/metrics")).unwrap_or_default()
    );
    let mut out = std::io::stdout().lock();
    writeln!(out, "listening {}", ms.addr)?;
    if let Some(m) = maddr {
        writeln!(out, "metrics {m}")?;
    }
    out.flush()?;
    drop(out);
    loop {
        std::thread::park();
    }
}
