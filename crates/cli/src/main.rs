//! pagefleet — the command-line interface (thin: every capability lives in its crate).

use anyhow::{bail, Result};
use clap::{Args, Parser, Subcommand};
use pagefleet_bench::{memserver, paging};
use pagefleet_client::{ConnectOptions, Conn};
use pagefleet_daemon::units;
use pagefleet_proto::auth::Secret;
use std::path::PathBuf;

mod run;

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
    /// Run the main demo on an embedded default (today: the memory-server benchmark).
    Demo(BenchOpts),
    /// Run a native guest (synthetic, sort, kv) on a region paging to memory servers.
    ///
    /// Example: pagefleet run synthetic --size 2GiB --budget 50% --servers 127.0.0.1:7070
    Run(run::RunArgs),
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Memory server page-out/page-in throughput and 4 KiB round trips,
    /// against raw loopback TCP and memcached, plus server RSS at 1 GiB stored.
    Memserver(BenchOpts),
    /// The paging runtime: a kv guest under zipf load, all-local vs pagefleet
    /// (budgets, policies, chunk sizes, servers) vs swap file and zram in a
    /// memory cgroup; single-fault latency vs raw uffd + raw TCP.
    Paging(BenchOpts),
    /// The raw-TCP baseline server used by `bench memserver` (internal).
    #[command(hide = true)]
    RawServer,
}

#[derive(Args, Clone)]
struct BenchOpts {
    /// Print one JSON object with every result and the goals (the table goes to stderr).
    #[arg(long)]
    json: bool,
    /// Small dataset and one repetition: a smoke run, not for the record.
    #[arg(long)]
    quick: bool,
    /// Directory for the results JSON and the PNG plot.
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
    /// Bytes moved per throughput measurement (e.g. 512MiB).
    #[arg(long, value_parser = units::parse_size)]
    dataset: Option<u64>,
    /// Repetitions per measurement (the median is reported).
    #[arg(long)]
    reps: Option<usize>,
    /// Skip the memcached peer.
    #[arg(long)]
    no_memcached: bool,
    /// bench paging: run only the configurations whose name contains this
    /// (all-local always runs, as the reference).
    #[arg(long)]
    only: Option<String>,
}

#[derive(Subcommand)]
enum MemserverCmd {
    /// Capacity, use and regions of a memory server.
    Stat {
        /// Server address, HOST:PORT.
        #[arg(long, default_value = "127.0.0.1:7070")]
        server: String,
        #[arg(long)]
        json: bool,
    },
    /// Authenticate and measure a few round trips.
    Ping {
        #[arg(long, default_value = "127.0.0.1:7070")]
        server: String,
        #[arg(long, default_value_t = 5)]
        count: u32,
    },
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("pagefleet: error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Bench(BenchCmd::Memserver(o)) | Cmd::Demo(o) => bench_memserver(o),
        Cmd::Bench(BenchCmd::RawServer) => memserver::raw_server_main(),
        Cmd::Bench(BenchCmd::Paging(o)) => bench_paging(o),
        Cmd::Run(a) => run::run(a, cli.secret_file.as_deref()),
        Cmd::Memserver(m) => {
            let secret = Secret::resolve(cli.secret_file.as_deref())?;
            let opts = ConnectOptions { name: "pagefleet-cli".into(), ..Default::default() };
            match m {
                MemserverCmd::Stat { server, json } => {
                    let mut c = Conn::connect(&server, &secret, &opts)?;
                    let s = c.stat(true)?;
                    if json {
                        let v = serde_json::json!({
                            "server": server, "server_id": format!("{:016x}", s.server_id),
                            "capacity_bytes": s.capacity_pages * 4096, "used_bytes": s.used_pages * 4096,
                            "capacity_pages": s.capacity_pages, "used_pages": s.used_pages,
                            "connections": s.connections, "region_count": s.region_count,
                            "regions": s.regions.iter().map(|(r, n)| serde_json::json!({"region": format!("{r:#x}"), "pages": n})).collect::<Vec<_>>(),
                            "truncated": s.truncated,
                        });
                        println!("{}", serde_json::to_string_pretty(&v)?);
                    } else {
                        println!("server      {server} (id {:016x})", s.server_id);
                        println!(
                            "capacity    {}   used {} ({:.1}%)   free {}",
                            units::fmt_size(s.capacity_pages * 4096),
                            units::fmt_size(s.used_pages * 4096),
                            s.used_pages as f64 * 100.0 / s.capacity_pages.max(1) as f64,
                            units::fmt_size((s.capacity_pages - s.used_pages.min(s.capacity_pages)) * 4096)
                        );
                        println!("connections {}   regions {}", s.connections, s.region_count);
                        for (r, n) in &s.regions {
                            println!("  region {r:#018x}  {:>10} pages  {}", n, units::fmt_size(n * 4096));
                        }
                        if s.truncated {
                            println!("  ... (more regions not listed)");
                        }
                    }
                }
                MemserverCmd::Ping { server, count } => {
                    let mut c = Conn::connect(&server, &secret, &opts)?;
                    println!("connected to {server}: server id {:016x}, {} free of {}", c.info.server_id,
                        units::fmt_size((c.info.capacity_pages - c.info.used_pages.min(c.info.capacity_pages)) * 4096),
                        units::fmt_size(c.info.capacity_pages * 4096));
                    for i in 0..count {
                        println!("ping {i}: {:.1} us", c.ping()?.as_secs_f64() * 1e6);
                    }
                }
            }
            Ok(())
        }
    }
}

fn bench_memserver(o: BenchOpts) -> Result<()> {
    let mut opts = if o.quick { memserver::Opts::quick(o.out.clone()) } else { memserver::Opts::full(o.out.clone()) };
    if let Some(d) = o.dataset {
        if d < 16 << 20 {
            bail!("--dataset must be at least 16MiB");
        }
        opts.dataset = d;
    }
    if let Some(r) = o.reps {
        opts.reps = r.max(1);
    }
    opts.memcached = !o.no_memcached;
    let mut log = |m: &str| eprintln!("  .. {m}");
    let report = memserver::run(&opts, &mut log)?;
    if o.json {
        memserver::print_table(&report, &mut std::io::stderr())?;
        println!("{}", serde_json::to_string(&report)?);
    } else {
        memserver::print_table(&report, &mut std::io::stdout())?;
    }
    Ok(())
}

fn bench_paging(o: BenchOpts) -> Result<()> {
    let mut opts = if o.quick { paging::Opts::quick(o.out.clone()) } else { paging::Opts::full(o.out.clone()) };
    if let Some(d) = o.dataset {
        if d < 32 << 20 {
            bail!("--dataset (the guest memory size) must be at least 32MiB");
        }
        opts.size = d;
    }
    if let Some(r) = o.reps {
        opts.measure_secs = r.max(1) as u64;
    }
    opts.only = o.only.clone();
    let mut log = |m: &str| eprintln!("  .. {m}");
    let report = paging::run(&opts, &mut log)?;
    if o.json {
        paging::print_table(&report, &mut std::io::stderr())?;
        println!("{}", serde_json::to_string(&report)?);
    } else {
        paging::print_table(&report, &mut std::io::stdout())?;
    }
    Ok(())
}
