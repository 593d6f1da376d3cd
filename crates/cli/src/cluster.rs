//! Cluster commands: `status`, `guest start|stop`, `migrate`, `gather`,
//! `evacuate`. They talk to pagefleetd's signed HTTP API; the registry
//! (`GET /cluster` on any host started with `--peers`) gives every host's
//! memory and guests.

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use pagefleet_api::migration::Failure;
use pagefleet_api::{
    ClusterHost, ClusterView, EvacuationEvent, EvacuationOrder, GuestState, GuestStatus,
    HostReport, MigrationOrder, MigrationProgress, ProgressEvent, Report, StartGuest,
};
use pagefleet_common::http::Client;
use pagefleet_common::units;
use pagefleet_proto::auth::Secret;
use std::io::Write;
use std::path::Path;
use std::time::Duration;

#[derive(Args, Clone)]
pub struct Registry {
    /// A pagefleetd HTTP address whose registry knows the cluster (its
    /// --peers); default $PAGEFLEET_REGISTRY, else 127.0.0.1:7071.
    #[arg(long, env = "PAGEFLEET_REGISTRY", default_value = "127.0.0.1:7071")]
    pub registry: String,
}

/// The signed API client, with the cluster secret.
pub fn client(secret_file: Option<&Path>) -> Result<Client> {
    Ok(Client::new(Secret::resolve(secret_file)?))
}

/// Every host: from the registry, or from an explicit list of daemons.
pub fn hosts(c: &Client, registry: &str, explicit: &[String]) -> Result<Vec<ClusterHost>> {
    if explicit.is_empty() {
        let v: ClusterView = c.get(registry, "/cluster").with_context(|| {
            format!("asking the registry at {registry} (set --registry or $PAGEFLEET_REGISTRY)")
        })?;
        return Ok(v.hosts);
    }
    Ok(explicit
        .iter()
        .map(|h| match c.get::<HostReport>(h, "/host") {
            Ok(r) => ClusterHost {
                http: h.clone(),
                host: Some(r),
                guests: c.get(h, "/guests").unwrap_or_default(),
                error: None,
                claimed: None,
            },
            Err(e) => ClusterHost {
                http: h.clone(),
                host: None,
                guests: vec![],
                error: Some(e.to_string()),
                claimed: None,
            },
        })
        .collect())
}

/// `pagefleet dashboard`: a login link to the dashboard of host `on` (by
/// default the registry's daemon), after checking that it answers.
pub fn dashboard_link(
    c: &Client,
    secret: &Secret,
    registry: &str,
    on: Option<&str>,
) -> Result<String> {
    let http = match on {
        None => registry.to_string(),
        Some(key) => {
            let hs = hosts(c, registry, &[])?;
            let h = &hs[find_host(&hs, key)?];
            if let Some(e) = &h.error {
                bail!("host {key} does not answer: {e}");
            }
            h.http.clone()
        }
    };
    let r: HostReport = c
        .get(&http, "/host")
        .with_context(|| format!("asking pagefleetd at {http}"))?;
    let loopback = http
        .parse::<std::net::SocketAddr>()
        .is_ok_and(|a| a.ip().is_loopback());
    // A host with a TLS identity takes only HTTPS from other machines.
    let scheme = if r.tls.is_some() && !loopback {
        "https"
    } else {
        "http"
    };
    Ok(format!(
        "{scheme}://{http}{}?{}",
        pagefleet_common::httpauth::UI_LOGIN_PATH,
        pagefleet_common::httpauth::ui_login_query(secret)
    ))
}

/// `pagefleet status --json`: one entry per host.
#[derive(serde::Serialize)]
struct StatusJson<'a> {
    host: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    report: Option<&'a HostReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    guests: Option<&'a [GuestStatus]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<&'a str>,
}

pub fn status(c: &Client, registry: &str, explicit: &[String], json_out: bool) -> Result<()> {
    let hs = hosts(c, registry, explicit)?;
    if json_out {
        let v: Vec<StatusJson> = hs
            .iter()
            .map(|h| StatusJson {
                host: &h.http,
                report: h.host.as_ref(),
                guests: h.host.as_ref().map(|_| h.guests.as_slice()),
                error: h
                    .host
                    .is_none()
                    .then_some(h.error.as_deref().unwrap_or("no report")),
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "{:<10} {:<20} {:<20} {:>10} {:>10} {:>10} {:>10} {:>10} {:>6} {:>4}",
        "host",
        "http",
        "memory server",
        "mem total",
        "available",
        "lends",
        "lent used",
        "guest free",
        "guests",
        "tls"
    );
    for h in &hs {
        match &h.host {
            Some(r) => println!(
                "{:<10} {:<20} {:<20} {:>10} {:>10} {:>10} {:>10} {:>10} {:>6} {:>4}{}",
                r.hostname,
                h.http,
                r.memserver.as_deref().unwrap_or("-"),
                units::fmt_size(r.mem_total),
                units::fmt_size(r.mem_available),
                units::fmt_size(r.lend_capacity),
                units::fmt_size(r.lend_used),
                if r.guest_memory > 0 {
                    units::fmt_size(r.guest_free)
                } else {
                    "-".into()
                },
                r.guests,
                if r.tls.is_some() { "yes" } else { "no" },
                if r.cordoned { "  cordoned" } else { "" }
            ),
            None => println!(
                "{:<10} {:<20} unreachable: {}",
                "?",
                h.http,
                h.error.as_deref().unwrap_or("no report")
            ),
        }
    }
    // Sharing-aware migration: what each host could fill from its own guests.
    for h in &hs {
        if let Some((r, d)) = h
            .host
            .as_ref()
            .and_then(|r| r.dedup.as_ref().map(|d| (r, d)))
        {
            if d.pages_indexed > 0 || d.lookups > 0 {
                println!(
                    "{:<10} content index: {} pages of {} guests ({:.0} B a page), {} lookups, hit rate {:.2}",
                    r.hostname, d.pages_indexed, d.sources, d.bytes_per_page, d.lookups, d.hit_rate
                );
            }
        }
    }
    let guests: Vec<(&ClusterHost, &GuestStatus)> = hs
        .iter()
        .flat_map(|h| h.guests.iter().map(move |g| (h, g)))
        .collect();
    if !guests.is_empty() {
        println!();
        println!(
            "{:<12} {:<10} {:<10} {:>10} {:>10} {:>10}  pages",
            "guest", "host", "state", "size", "budget", "ops"
        );
        let name_of = |addr: &str| {
            hs.iter()
                .find(|h| h.memserver() == Some(addr))
                .map(|h| h.name().to_string())
                .unwrap_or(addr.to_string())
        };
        for (h, g) in guests {
            let pages = match &g.failure {
                Some(f) => Some(format!(
                    "failed {} ago ({}): {}",
                    ago(f.at_unix),
                    f.exit,
                    f.reason.chars().take(160).collect::<String>()
                )),
                None => g.pages.as_ref().map(|p| {
                    let mut w = format!("local {}", p.local);
                    for (addr, n) in &p.remote {
                        w.push_str(&format!(", {} {n}", name_of(addr)));
                    }
                    w
                }),
            };
            println!(
                "{:<12} {:<10} {:<10} {:>10} {:>10} {:>10}  {}",
                g.name,
                h.name(),
                format!("{:?}", g.state).to_lowercase(),
                units::fmt_size(g.size),
                units::fmt_size(pagefleet_units::bytes_of(g.budget_pages)),
                g.ops,
                pages.unwrap_or_else(|| "-".into())
            );
        }
    }
    if hs.iter().any(|h| h.host.is_none()) {
        bail!("some hosts did not answer");
    }
    Ok(())
}

pub(crate) fn find_host(hs: &[ClusterHost], key: &str) -> Result<usize> {
    hs.iter()
        .position(|h| h.name() == key || h.http == key || h.memserver() == Some(key))
        .ok_or_else(|| anyhow::anyhow!("no host {key:?} in the cluster (see pagefleet status)"))
}

/// The host running guest `name` (else the one keeping its failed record).
fn find_guest(hs: &[ClusterHost], name: &str) -> Result<(usize, GuestStatus)> {
    let running = |g: &GuestStatus| g.state.is_live();
    let failed = |g: &GuestStatus| g.state == GuestState::Failed;
    for wanted in [&running as &dyn Fn(&GuestStatus) -> bool, &failed] {
        for (i, h) in hs.iter().enumerate() {
            if let Some(g) = h.guests.iter().find(|g| g.name == name && wanted(g)) {
                return Ok((i, g.clone()));
            }
        }
    }
    bail!("no guest {name:?} runs in the cluster (see pagefleet status)")
}

#[derive(Subcommand)]
pub enum GuestCmd {
    /// Start a guest on a host: the workload and its flags as for `pagefleet
    /// run` (synthetic, kv, sortjob or vm), e.g.
    ///
    ///   pagefleet guest start db --on h1 --size 1GiB -- kv --listen 10.200.77.201:11211
    ///
    ///   pagefleet guest start web1 --on h1 --size 2GiB --budget 1GiB -- vm --kernel /srv/images/vmlinuz --initrd /srv/images/initrd.img --disk /srv/images/web1.img
    ///
    /// (VM files must lie under the host's `pagefleetd --vm-images` directories.)
    ///
    /// Or from a libvirt domain definition (`virsh dumpxml DOMAIN > web1.xml`):
    /// memory, vCPUs, machine, disks, the NIC and its MAC are taken from it;
    /// what would change the guest if dropped is refused by name, and what
    /// only serves a screen or a host tool (graphics, balloon, ...) is listed
    /// as left out:
    ///
    ///   pagefleet guest start web1 --on h1 --budget 50% --domain-xml web1.xml
    Start {
        /// The guest's name (1-32 letters, digits, - or _).
        name: String,
        /// The host (name, HTTP or memory-server address).
        #[arg(long)]
        on: String,
        /// Guest memory (e.g. 1GiB); may also be given after `--`, as for
        /// `pagefleet run`.
        #[arg(long, value_parser = units::parse_size, conflicts_with = "domain_xml")]
        size: Option<u64>,
        /// Start the VM a libvirt domain definition describes (instead of
        /// a workload after `--`). pagefleet's own settings for it go in
        /// its metadata: <pagefleet:guest xmlns:pagefleet="urn:pagefleet:guest:1"
        /// ip="A.B.C.D/N" gw="A.B.C.D" config="key=value ..."/>.
        #[arg(long, value_name = "FILE")]
        domain_xml: Option<std::path::PathBuf>,
        /// Pages resident locally: a size (1GiB) or a percentage of --size
        /// (50%), as for `pagefleet run`; default all of it.
        #[arg(long)]
        budget: Option<String>,
        #[command(flatten)]
        reg: Registry,
        /// The workload and its `pagefleet run` flags (synthetic, kv, sortjob
        /// or vm). Every flag is honoured or refused: a hosted guest runs
        /// until `guest stop`, so --duration and --json are refused.
        #[arg(
            trailing_var_arg = true,
            required_unless_present = "domain_xml",
            conflicts_with = "domain_xml"
        )]
        args: Vec<String>,
    },
    /// One guest in detail: where it runs, where its pages are, and what
    /// paging costs it (pager CPU per page in and out, fault service time,
    /// evictions that sent nothing, waits for page-out).
    Status {
        /// The guest's name.
        name: String,
        /// Print its status as JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        reg: Registry,
    },
    /// Stop a guest (its pages on memory servers are deleted).
    Stop {
        /// The guest's name.
        name: String,
        #[command(flatten)]
        reg: Registry,
    },
    /// Clear a failed guest's record. A guest whose runner ended on its own
    /// or was killed stays listed as `failed` (with the reason, the time and
    /// its log, kept as GUESTDIR/NAME.log) until this; its pages on memory
    /// servers are collected as orphans (`pagefleet gc`).
    ///
    ///   pagefleet guest rm db
    Rm {
        /// The guest's name.
        name: String,
        #[command(flatten)]
        reg: Registry,
    },
}

/// The trailing `-- WORKLOAD FLAGS` of `guest start`, parsed as `pagefleet run` would.
#[derive(Parser)]
#[command(name = "pagefleet guest start NAME --on HOST --size SIZE --")]
struct HostedRun {
    #[command(flatten)]
    run: crate::run::RunArgs,
}

pub fn guest(c: &Client, g: GuestCmd) -> Result<()> {
    match g {
        GuestCmd::Start {
            name,
            on,
            size: _,
            budget,
            reg,
            args: _,
            domain_xml: Some(file),
        } => {
            let text = read_bounded(&file, pagefleet_vm::domain::MAX_XML)?;
            let m = pagefleet_vm::domain::from_xml(&text)
                .with_context(|| format!("{}", file.display()))?;
            println!(
                "{}: domain {}, {} memory, {}",
                file.display(),
                m.name,
                units::fmt_size(m.size),
                m.summary()
            );
            if m.name != name {
                println!("  started as guest {name} (the domain is named {})", m.name);
            }
            for l in &m.left_out {
                println!("  left out: {l}");
            }
            let budget_pages = crate::run::budget_pages(budget.as_deref(), m.size)?;
            let spec = pagefleet_api::GuestSpec::new(m.workload);
            spec.validate()?;
            start_on(
                c,
                &reg,
                &on,
                &name,
                m.size,
                budget.is_some().then_some(budget_pages),
                spec,
            )?;
        }
        GuestCmd::Start {
            name,
            on,
            size,
            budget,
            reg,
            args,
            domain_xml: None,
        } => {
            let parsed = HostedRun::try_parse_from(
                std::iter::once("pagefleet guest start --".to_string()).chain(args),
            )
            .map_err(|e| anyhow::anyhow!("the guest's workload: {e}"))?;
            let spec = crate::run::guest_spec(&parsed.run)?;
            // Given before or after `--`: once, or the same both times.
            fn one<T: PartialEq + std::fmt::Debug>(
                flag: &str,
                a: Option<T>,
                b: Option<T>,
            ) -> Result<Option<T>> {
                match (a, b) {
                    (Some(x), Some(y)) if x != y => {
                        bail!("{flag} given twice ({x:?} before --, {y:?} after): give it once")
                    }
                    (a, b) => Ok(a.or(b)),
                }
            }
            let size = one("--size", size, parsed.run.size)?.ok_or_else(|| {
                anyhow::anyhow!("--size: how much memory guest {name} has (e.g. --size 1GiB)")
            })?;
            let budget = one("--budget", budget, parsed.run.budget.clone())?;
            let budget_pages = crate::run::budget_pages(budget.as_deref(), size)?;
            start_on(
                c,
                &reg,
                &on,
                &name,
                size,
                budget.is_some().then_some(budget_pages),
                spec,
            )?;
        }
        GuestCmd::Status { name, json, reg } => {
            let hs = hosts(c, &reg.registry, &[])?;
            let (i, g) = find_guest(&hs, &name)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&g)?);
                return Ok(());
            }
            println!(
                "guest {} on {}: {}, {} memory, budget {}, {} ops, up {:.0} s",
                g.name,
                hs[i].name(),
                format!("{:?}", g.state).to_lowercase(),
                units::fmt_size(g.size),
                units::fmt_size(pagefleet_units::bytes_of(g.budget_pages)),
                g.ops,
                g.uptime_secs
            );
            if let Some(f) = &g.failure {
                println!(
                    "  failed {} ago ({}): {}\n  log: {}\n  (`pagefleet guest rm {}` clears this record; its pages on memory servers are collected by gc)",
                    ago(f.at_unix),
                    f.exit,
                    f.reason,
                    f.log,
                    g.name
                );
                println!("  last seen:");
            }
            println!(
                "  pages: {} resident, {} on memory servers; {} paged in, {} sent out",
                g.resident_pages, g.remote_pages, g.page_ins, g.page_outs
            );
            if let Some(p) = &g.pages {
                for (addr, n) in &p.remote {
                    println!("    {n} on {addr}");
                }
            }
            if let Some(v) = &g.vm {
                println!("  VM: QEMU pid {} {}, on {}", v.qemu_pid, v.state, v.accel);
                if let Some(n) = &v.nic {
                    println!("  NIC: {n}");
                }
                match &v.ready {
                    Some(r) => println!("  guest ready: {r}"),
                    None => {
                        if let Some(last) = v.console.last() {
                            println!("  console: {last}");
                        }
                    }
                }
            }
            if let Some(p) = &g.paging {
                println!(
                    "  paging costs: {:.1} us pager CPU per page in, {:.1} us per page out; \
                     faults served in {:.0} us (p50), {:.0} us (p99)",
                    p.cpu_per_page_in_us, p.cpu_per_page_out_us, p.fault_p50_us, p.fault_p99_us
                );
                println!(
                    "  evictions that sent nothing (clean pages): {}; page-outs with faults waiting: {} ({:.1} ms)",
                    p.clean_drops, p.direct_reclaims, p.direct_reclaim_ms
                );
                if p.replicas > 1 || p.servers_down > 0 {
                    println!(
                        "  replicas: {}; pages with a copy missing: {}; memory servers down now: {} ({} failures, {} revived); pages re-replicated: {}; hedged reads: {}",
                        p.replicas, p.degraded_pages, p.servers_down, p.server_failures, p.servers_revived, p.rereplicated_pages, p.hedged_reads
                    );
                }
            }
        }
        GuestCmd::Stop { name, reg } => {
            let on = guest_op(c, &reg, &name, "stop")?;
            println!("guest {name} stopped on {on}");
        }
        GuestCmd::Rm { name, reg } => {
            let on = guest_op(c, &reg, &name, "rm")?;
            println!("guest {name}'s failed record removed on {on}");
        }
    }
    Ok(())
}

/// Ask host `on` to start guest `name`.
fn start_on(
    c: &Client,
    reg: &Registry,
    on: &str,
    name: &str,
    size: u64,
    budget_pages: Option<u64>,
    spec: pagefleet_api::GuestSpec,
) -> Result<()> {
    let hs = hosts(c, &reg.registry, &[])?;
    let h = &hs[find_host(&hs, on)?];
    let req = StartGuest {
        name: name.to_string(),
        size,
        budget_pages,
        spec,
    };
    c.timeout(Duration::from_secs(30))
        .post::<_, pagefleet_api::Ok>(&h.http, "/guests", &req)?;
    println!("guest {name} started on {}", h.name());
    Ok(())
}

/// A file of at most `max` bytes, as text.
fn read_bounded(path: &std::path::Path, max: usize) -> Result<String> {
    use std::io::Read;
    let f = std::fs::File::open(path).with_context(|| format!("{}", path.display()))?;
    let mut text = String::new();
    f.take(max as u64 + 1)
        .read_to_string(&mut text)
        .with_context(|| format!("{}: not UTF-8 text", path.display()))?;
    if text.len() > max {
        bail!("{}: over {max} bytes", path.display());
    }
    Ok(text)
}

/// `POST /guests/NAME/OP` (no body) on the host running guest `name`, or
/// keeping its failed record; that host's name.
fn guest_op(c: &Client, reg: &Registry, name: &str, op: &str) -> Result<String> {
    let hs = hosts(c, &reg.registry, &[])?;
    let (i, _) = find_guest(&hs, name)?;
    c.timeout(Duration::from_secs(30))
        .post::<_, pagefleet_api::Ok>(
            &hs[i].http,
            &format!("/guests/{name}/{op}"),
            &serde_json::Map::new(),
        )?;
    Ok(hs[i].name().to_string())
}

/// How long ago a Unix time was, as `gc` shows ages ("12s", "3m", "2.0h").
pub(crate) fn ago(at_unix: u64) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(at_unix);
    age(now.saturating_sub(at_unix) as f64)
}

#[derive(Args)]
pub struct MigrateArgs {
    /// The guest to move.
    pub guest: String,
    /// The main host (default: the one with the most free guest memory).
    #[arg(long)]
    pub to: Option<String>,
    /// Sub-hosts for the pages the main host cannot keep (default: the fewest that fit).
    #[arg(long, value_delimiter = ',')]
    pub sub: Option<Vec<String>>,
    /// The guest's paging policy on the main host (default: as on the source).
    #[arg(long)]
    pub policy: Option<pagefleet_region::Policy>,
    /// Pages per chunk on the main host (default: as on the source).
    #[arg(long)]
    pub chunk: Option<usize>,
    /// Compare region checksums at stop time and at resume.
    #[arg(long)]
    pub verify: bool,
    /// Most pre-copy rounds before stop-and-copy.
    #[arg(long)]
    pub max_rounds: Option<u64>,
    /// Stop and copy once a round leaves at most this many changed pages.
    #[arg(long)]
    pub stop_pages: Option<u64>,
    /// Stop and copy once the changed pages would take at most this many
    /// milliseconds to send at the last round's rate (default 50): higher
    /// means fewer rounds and a longer pause.
    #[arg(long)]
    pub max_downtime: Option<u64>,
    /// Give the migration up (and roll it back) when the destination says
    /// nothing for this many seconds.
    #[arg(long, default_value_t = 30)]
    pub timeout: u64,
    /// Send every page as data. By default the migration is sharing-aware:
    /// the source sends a page's keyed hash first and its data only if the
    /// main host does not already hold that content (another guest's
    /// memory there); the report shows what that saved. Where sending every
    /// page measures faster than asking (a fast link, busy CPUs), the
    /// migration sends instead; see --dedup-always.
    #[arg(long)]
    pub no_dedup: bool,
    /// Ask about every page even where sending every page measures faster:
    /// fewer bytes on the link, more time (for a link billed by the byte).
    #[arg(long, conflicts_with = "no_dedup")]
    pub dedup_always: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Start the destination runner inside this (cgroup v1) memory cgroup on
    /// the main host, e.g. to compare with a destination whose memory is
    /// limited and backed by swap.
    #[arg(long)]
    pub dest_cgroup: Option<String>,
    #[command(flatten)]
    pub reg: Registry,
    /// Integrated migration (set by `pagefleet gather`).
    #[arg(skip)]
    pub gather: bool,
}

#[derive(Args)]
pub struct GatherArgs {
    /// The guest to bring together.
    pub guest: String,
    /// The host that takes the whole guest (default: the one with the most
    /// free guest memory, if the guest fits there).
    #[arg(long)]
    pub to: Option<String>,
    /// Compare region checksums at stop time and at resume.
    #[arg(long)]
    pub verify: bool,
    /// Send every page as data (see `pagefleet migrate --help`).
    #[arg(long)]
    pub no_dedup: bool,
    /// Ask about every page even where sending measures faster (see
    /// `pagefleet migrate --help`).
    #[arg(long, conflicts_with = "no_dedup")]
    pub dedup_always: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub reg: Registry,
}

/// Ctrl-C during a migration: the first asks the source host to cancel
/// (the migration is the daemon's, not this command's), a second one
/// leaves at once.
static INTERRUPTS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

extern "C" fn on_interrupt(_: libc::c_int) {
    if INTERRUPTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) >= 1 {
        pagefleet_common::sys::process::exit_now(130);
    }
}

fn catch_interrupts() {
    // The handler only touches an atomic and calls _exit.
    pagefleet_common::sys::signal::set_handler(libc::SIGINT, on_interrupt);
}

fn bar(p: &MigrationProgress) -> String {
    let total = p.round_pages.max(1);
    let sent = p.round_sent.min(total);
    let w = 30;
    let fill = (sent * w / total) as usize;
    format!(
        "\r[{}{}] {:<14} main {:>8.1} MiB  subs {:>8.1} MiB ",
        "#".repeat(fill),
        " ".repeat(w as usize - fill),
        p.phase,
        p.bytes_main as f64 / 1048576.0,
        p.bytes_subs as f64 / 1048576.0
    )
}

/// Run a migration through the source host's daemon; returns its report.
pub fn migrate(c: &Client, a: &MigrateArgs, progress: bool) -> Result<Report> {
    let hs = hosts(c, &a.reg.registry, &[])?;
    let (src, g) = find_guest(&hs, &a.guest)?;
    if g.state == GuestState::Migrating {
        bail!("{} is already migrating", a.guest);
    }
    let source = &hs[src];
    let order = MigrationOrder {
        guest: a.guest.clone(),
        to: a.to.clone(),
        subs: a.sub.clone(),
        gather: a.gather,
        verify: a.verify,
        policy: a.policy,
        chunk: a.chunk,
        max_rounds: a.max_rounds,
        stop_pages: a.stop_pages,
        max_downtime_ms: a.max_downtime,
        timeout_secs: Some(a.timeout),
        dest_cgroup: a.dest_cgroup.clone(),
        no_dedup: a.no_dedup,
        dedup_always: a.dedup_always,
    };
    catch_interrupts();
    let mut report = None;
    let mut failure: Option<Failure> = None;
    let mut cancelled = false;
    let mut drew = false;
    let cancel_path = format!("/guests/{}/cancel", a.guest);
    c.post_stream(
        &source.http,
        "/migrations",
        &order,
        Duration::from_secs(120),
        |ev: ProgressEvent| {
            if !cancelled && INTERRUPTS.load(std::sync::atomic::Ordering::Relaxed) > 0 {
                cancelled = true;
                eprintln!(
                    "\ninterrupted: asking {} to cancel the migration",
                    source.name()
                );
                if let Err(e) = c.post::<_, pagefleet_api::Ok>(
                    &source.http,
                    &cancel_path,
                    &serde_json::Map::new(),
                ) {
                    eprintln!("cannot cancel: {e}");
                }
            }
            match ev {
                ProgressEvent::Placed(p) => eprintln!(
                    "migrating {} from {} to {} ({} pages resident there){}",
                    p.guest,
                    p.source,
                    p.main,
                    p.main_pages,
                    if p.subs.is_empty() {
                        String::new()
                    } else {
                        format!(
                            ", sub-hosts {}",
                            p.subs
                                .iter()
                                .map(|s| s.0.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        )
                    }
                ),
                ProgressEvent::Progress(p) => {
                    if progress {
                        eprint!("{}", bar(&p));
                        drew = true;
                        let _ = std::io::stderr().flush();
                    }
                }
                ProgressEvent::Report(r) => report = Some(*r),
                ProgressEvent::Failed(f) => failure = Some(f),
            }
            true
        },
    )?;
    if drew {
        eprintln!();
    }
    match (report, failure) {
        (Some(r), _) => Ok(r),
        (None, Some(f)) => {
            for step in &f.rolled_back {
                eprintln!("  rolled back: {step}");
            }
            if f.in_doubt {
                bail!("{}", f.message)
            }
            bail!(
                "migration {} and was rolled back ({} still runs on {}): {}",
                if cancelled { "cancelled" } else { "failed" },
                a.guest,
                source.name(),
                f.message
            )
        }
        (None, None) => bail!("the source host ended the migration without a report"),
    }
}

pub fn gather_cmd(c: &Client, g: GatherArgs) -> Result<()> {
    migrate_cmd(
        c,
        MigrateArgs {
            guest: g.guest,
            to: g.to,
            sub: None,
            policy: None,
            chunk: None,
            verify: g.verify,
            max_rounds: None,
            stop_pages: None,
            max_downtime: None,
            timeout: 30,
            json: g.json,
            dest_cgroup: None,
            no_dedup: g.no_dedup,
            dedup_always: g.dedup_always,
            reg: g.reg,
            gather: true,
        },
    )
}

pub fn migrate_cmd(c: &Client, a: MigrateArgs) -> Result<()> {
    let r = migrate(c, &a, !a.json)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        r.print();
    }
    Ok(())
}

#[derive(Args)]
pub struct EvacuateArgs {
    /// The host to empty (name, HTTP or memory-server address).
    pub host: String,
    /// Where its memory server's pages go (default: for each guest, the host
    /// lending the most free memory that is neither this one nor the guest's).
    #[arg(long)]
    pub to: Option<String>,
    #[command(flatten)]
    pub reg: Registry,
}

/// Empty a host for maintenance: the registry's daemon moves the pages
/// guests keep on its memory server to another memory server (the guests
/// keep running and paging), then migrates the guests running there away
/// (their sub-host pages stay where they are).
pub fn evacuate(c: &Client, a: EvacuateArgs) -> Result<()> {
    let order = EvacuationOrder {
        host: a.host.clone(),
        to: a.to.clone(),
        pages_only: false,
    };
    let mut end = None;
    c.post_stream(
        &a.reg.registry,
        "/evacuations",
        &order,
        Duration::from_secs(3600),
        |ev: EvacuationEvent| {
            match ev {
                EvacuationEvent::Migration(m) => match *m {
                    ProgressEvent::Placed(p) => eprintln!(
                        "  {} -> {} ({} pages resident there)",
                        p.source, p.main, p.main_pages
                    ),
                    ProgressEvent::Progress(p) => {
                        eprint!("{}", bar(&p));
                        let _ = std::io::stderr().flush();
                    }
                    ProgressEvent::Report(r) => {
                        eprintln!();
                        r.print();
                    }
                    ProgressEvent::Failed(f) => eprintln!("\n  migration failed: {}", f.message),
                },
                EvacuationEvent::PagesMoved {
                    guest,
                    pages,
                    from,
                    to,
                } => println!("{guest}: {pages} pages moved from {from} to {to}"),
                EvacuationEvent::Migrating { guest } => eprintln!("migrating {guest} away"),
                e @ (EvacuationEvent::Done { .. } | EvacuationEvent::Failed { .. }) => {
                    end = Some(e)
                }
            }
            true
        },
    )?;
    match end {
        Some(EvacuationEvent::Done { host, moved_any }) => {
            if !moved_any {
                println!("{host} holds no guest and no guest pages");
            }
            Ok(())
        }
        Some(EvacuationEvent::Failed { message }) => bail!("evacuating {}: {message}", a.host),
        _ => bail!("the registry ended the evacuation without a result"),
    }
}

/// `pagefleet host`: a host's part in placement.
#[derive(Subcommand)]
pub enum HostCmd {
    /// Keep placement off a host: no migration, gather, evacuation or
    /// placement puts a guest or a page there until `host uncordon` (what
    /// is there stays and keeps working). Lasts until uncordoned (an
    /// in-place restart keeps it; a stop and start of pagefleetd does not).
    ///
    ///   pagefleet host cordon h3
    Cordon {
        /// The host (name, HTTP or memory-server address).
        host: String,
        #[command(flatten)]
        reg: Registry,
    },
    /// Let placement use a cordoned host again.
    Uncordon {
        /// The host (name, HTTP or memory-server address).
        host: String,
        #[command(flatten)]
        reg: Registry,
    },
    /// Cordon a host, then empty it (as `pagefleet evacuate`): guests'
    /// pages on its memory server move to other memory servers and its
    /// guests migrate away. It stays cordoned (placement keeps off it)
    /// until `host uncordon`; if the evacuation fails it stays cordoned and
    /// the command says what is left.
    ///
    ///   pagefleet host drain h3
    Drain(EvacuateArgs),
    /// Take a dead host out of the cluster for good: every daemon's
    /// registry stops asking it (and with etcd its records and its etcd
    /// member go), so gc and placement no longer wait for it; its guests
    /// and the pages it held are lost. Refused while the host answers
    /// (drain it and stop its daemon first). Also remove it from the other
    /// hosts' --peers (config) before they restart. A host that comes back
    /// rejoins through its own --peers / etcd.
    ///
    ///   pagefleet host remove h3         (or its HTTP address, as status lists it)
    Remove {
        /// The host: its name, or its HTTP address (a host that never
        /// answered is known by its address only).
        host: String,
        #[command(flatten)]
        reg: Registry,
    },
    /// Restart a host's pagefleetd in place, e.g. after installing a new
    /// version: it execs the binary at the path it was started from, in
    /// the same process, handing over its memory server (pages, server id,
    /// listening socket), its HTTP socket and its cordon. Guests running
    /// there keep running (their runners are adopted), guests elsewhere
    /// paging to it reconnect to the same pages; connections made
    /// meanwhile wait instead of being refused. Refused while a guest
    /// there is starting or migrating, or a migration it runs is under
    /// way. Waits until the new daemon answers and says how long that took.
    /// (SIGUSR2 to pagefleetd does the same; `systemctl reload` only reads
    /// its configuration again.)
    ///
    ///   pagefleet host restart h1
    Restart {
        /// The host (name, HTTP or memory-server address).
        host: String,
        /// Give up waiting for the new daemon after this many seconds.
        #[arg(long, default_value_t = 60)]
        timeout: u64,
        #[command(flatten)]
        reg: Registry,
    },
}

/// Ask a host's daemon to restart in place and wait until the next one
/// answers; what it said and how long that took.
fn restart(c: &Client, reg: &Registry, host: &str, timeout: u64) -> Result<()> {
    let hs = hosts(c, &reg.registry, &[])?;
    let h = &hs[find_host(&hs, host)?];
    let t0 = std::time::Instant::now();
    let r: pagefleet_api::Restarting = c
        .post(&h.http, "/host/restart", &serde_json::json!({}))
        .with_context(|| format!("asking {} to restart in place", h.name()))?;
    eprintln!(
        "{}: pagefleetd {} (pid {}) execs {} ({})",
        h.name(),
        r.from_version,
        r.pid,
        r.binary,
        r.to_version
    );
    let until = t0 + std::time::Duration::from_secs(timeout);
    loop {
        std::thread::sleep(std::time::Duration::from_millis(20));
        match c.get::<HostReport>(&h.http, "/host") {
            Ok(now) if now.started_unix > r.started_unix => {
                println!(
                    "{} restarted in place in {:.2} s: pagefleetd {}{}{}",
                    h.name(),
                    t0.elapsed().as_secs_f64(),
                    now.version,
                    if now.memserver.is_some() {
                        format!(", its memory server kept {} pages", pagefleet_units::pages_in(now.lend_used))
                    } else {
                        String::new()
                    },
                    if now.cordoned { ", still cordoned" } else { "" }
                );
                return Ok(());
            }
            _ if std::time::Instant::now() > until => bail!(
                "{} has not answered as a restarted daemon within {timeout} s: see its log (journalctl -u pagefleetd)",
                h.name()
            ),
            _ => {}
        }
    }
}

fn set_cordon(c: &Client, reg: &Registry, host: &str, on: bool) -> Result<String> {
    let hs = hosts(c, &reg.registry, &[])?;
    let h = &hs[find_host(&hs, host)?];
    let _: pagefleet_api::Cordon = c
        .post(
            &h.http,
            "/host/cordon",
            &pagefleet_api::Cordon { cordoned: on },
        )
        .with_context(|| {
            format!(
                "asking {} to {}cordon itself",
                h.name(),
                if on { "" } else { "un" }
            )
        })?;
    Ok(h.name().to_string())
}

/// Cordon, uncordon, drain, remove or restart a host.
pub fn host(c: &Client, cmd: HostCmd) -> Result<()> {
    match cmd {
        HostCmd::Cordon { host, reg } => {
            let n = set_cordon(c, &reg, &host, true)?;
            println!("{n} cordoned: placement puts no new guest or page there (`pagefleet host uncordon {n}` undoes it)");
        }
        HostCmd::Uncordon { host, reg } => {
            let n = set_cordon(c, &reg, &host, false)?;
            println!("{n} uncordoned: placement may use it again");
        }
        HostCmd::Remove { host, reg } => {
            let hs = hosts(c, &reg.registry, &[])?;
            if let Some(h) = hs
                .iter()
                .find(|h| h.host.is_some() && (h.name() == host || h.http == host))
            {
                bail!(
                    "{} answers: a live host is not removed (drain it, `pagefleet host drain {}`, and stop its pagefleetd first)",
                    h.name(),
                    h.name()
                );
            }
            let mut said = Vec::new();
            for h in hs.iter().filter(|h| h.host.is_some()) {
                let r: pagefleet_api::HostRemoved = c
                    .post(
                        &h.http,
                        "/registry/remove",
                        &pagefleet_api::RemoveHost { host: host.clone() },
                    )
                    .with_context(|| format!("asking {} to remove {host}", h.name()))?;
                if r.peer.is_some() || r.registry || r.etcd_member {
                    said.push(format!(
                        "{}{}",
                        h.name(),
                        if r.etcd_member {
                            " (and its etcd member)"
                        } else {
                            ""
                        }
                    ));
                }
            }
            if said.is_empty() {
                bail!("no registry knows a host {host:?} (see pagefleet status)");
            }
            println!("{host} removed from the registry of {}", said.join(", "));
        }
        HostCmd::Restart { host, timeout, reg } => restart(c, &reg, &host, timeout)?,
        HostCmd::Drain(a) => {
            let n = set_cordon(c, &a.reg, &a.host, true)?;
            eprintln!("{n} cordoned; moving everything off it");
            evacuate(c, a).with_context(|| format!("{n} stays cordoned"))?;
            println!("{n} drained: no guest and no guest page left there; it stays cordoned until `pagefleet host uncordon {n}`");
        }
    }
    Ok(())
}

/// A duration for a table: seconds, minutes or hours.
pub(crate) fn age(secs: f64) -> String {
    match secs {
        s if s < 120.0 => format!("{s:.0}s"),
        s if s < 7200.0 => format!("{:.0}m", s / 60.0),
        s => format!("{:.1}h", s / 3600.0),
    }
}
