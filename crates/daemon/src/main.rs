//! pagefleetd — the pagefleet host daemon.

use anyhow::{Context, Result};
use clap::Parser;
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
    #[command(flatten)]
    flags: Flags,
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
    let flags = args.flags;
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
