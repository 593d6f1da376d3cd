//! Cluster commands: `status`, `guest start|stop`, `migrate`. They talk to
//! pagefleetd's HTTP endpoints; the registry (`GET /cluster` on any host
//! started with `--peers`) gives every host's memory and guests.

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use pagefleet_daemon::{http, units};
use pagefleet_migrate::placement::{self, HostInfo};
use pagefleet_migrate::Report;
use serde_json::{json, Value};
use std::io::Write;
use std::time::Duration;

#[derive(Args, Clone)]
pub struct Registry {
    /// A pagefleetd HTTP address whose registry knows the cluster (its
    /// --peers); default $PAGEFLEET_REGISTRY, else 127.0.0.1:7071.
    #[arg(long, env = "PAGEFLEET_REGISTRY", default_value = "127.0.0.1:7071")]
    pub registry: String,
}

/// One host as the registry reports it.
#[derive(Clone, Debug)]
pub struct Host {
    pub http: String,
    pub report: Option<pagefleet_daemon::HostReport>,
    pub guests: Vec<Value>,
    pub error: Option<String>,
}

impl Host {
    pub fn name(&self) -> &str {
        self.report
            .as_ref()
            .map(|r| r.hostname.as_str())
            .unwrap_or(&self.http)
    }
}

fn parse_host(v: &Value) -> Host {
    Host {
        http: v["http"].as_str().unwrap_or("").to_string(),
        report: serde_json::from_value(v["host"].clone()).ok(),
        guests: v["guests"].as_array().cloned().unwrap_or_default(),
        error: v["error"].as_str().map(String::from),
    }
}

/// Every host: from the registry, or from an explicit list of daemons.
pub fn hosts(registry: &str, explicit: &[String]) -> Result<Vec<Host>> {
    let t = Duration::from_secs(5);
    if explicit.is_empty() {
        let body = http::get(registry, "/cluster", t).with_context(|| {
            format!("asking the registry at {registry} (set --registry or $PAGEFLEET_REGISTRY)")
        })?;
        let v: Value = serde_json::from_str(&body)?;
        return Ok(v["hosts"]
            .as_array()
            .map(|a| a.iter().map(parse_host).collect())
            .unwrap_or_default());
    }
    Ok(explicit
        .iter()
        .map(|h| match http::get(h, "/host", t) {
            Ok(b) => Host {
                http: h.clone(),
                report: serde_json::from_str(&b).ok(),
                guests: http::get(h, "/guests", t)
                    .ok()
                    .and_then(|g| serde_json::from_str(&g).ok())
                    .unwrap_or_default(),
                error: None,
            },
            Err(e) => Host {
                http: h.clone(),
                report: None,
                guests: vec![],
                error: Some(format!("{e:#}")),
            },
        })
        .collect())
}

pub fn status(registry: &str, explicit: &[String], json_out: bool) -> Result<()> {
    let hs = hosts(registry, explicit)?;
    if json_out {
        let v: Vec<Value> = hs
            .iter()
            .map(|h| match (&h.report, &h.error) {
                (Some(r), _) => json!({"host": h.http, "report": r, "guests": h.guests}),
                (None, e) => json!({"host": h.http, "error": e}),
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "{:<10} {:<20} {:<20} {:>10} {:>10} {:>10} {:>10} {:>10} {:>6}",
        "host",
        "http",
        "memory server",
        "mem total",
        "available",
        "lends",
        "lent used",
        "guest free",
        "guests"
    );
    for h in &hs {
        match &h.report {
            Some(r) => println!(
                "{:<10} {:<20} {:<20} {:>10} {:>10} {:>10} {:>10} {:>10} {:>6}",
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
                r.guests
            ),
            None => println!(
                "{:<10} {:<20} unreachable: {}",
                "?",
                h.http,
                h.error.as_deref().unwrap_or("no report")
            ),
        }
    }
    let guests: Vec<(&Host, &Value)> = hs
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
                .find(|h| h.report.as_ref().and_then(|r| r.memserver.as_deref()) == Some(addr))
                .map(|h| h.name().to_string())
                .unwrap_or(addr.to_string())
        };
        for (h, g) in guests {
            let p = &g["pages"];
            let mut where_ = format!("local {}", p["local"].as_u64().unwrap_or(0));
            if let Some(m) = p["remote"].as_object() {
                for (addr, n) in m {
                    where_.push_str(&format!(", {} {}", name_of(addr), n.as_u64().unwrap_or(0)));
                }
            }
            println!(
                "{:<12} {:<10} {:<10} {:>10} {:>10} {:>10}  {}",
                g["name"].as_str().unwrap_or("?"),
                h.name(),
                g["state"].as_str().unwrap_or("?"),
                g["size"].as_u64().map(units::fmt_size).unwrap_or_default(),
                g["budget_pages"]
                    .as_u64()
                    .map(|b| units::fmt_size(b * 4096))
                    .unwrap_or_default(),
                g["ops"].as_u64().unwrap_or(0),
                if p.is_null() { "-".to_string() } else { where_ }
            );
        }
    }
    if hs.iter().any(|h| h.report.is_none()) {
        bail!("some hosts did not answer");
    }
    Ok(())
}

fn find_host(hs: &[Host], key: &str) -> Result<usize> {
    hs.iter()
        .position(|h| {
            h.name() == key
                || h.http == key
                || h.report.as_ref().and_then(|r| r.memserver.as_deref()) == Some(key)
        })
        .ok_or_else(|| anyhow::anyhow!("no host {key:?} in the cluster (see pagefleet status)"))
}

fn find_guest(hs: &[Host], name: &str) -> Result<(usize, Value)> {
    for (i, h) in hs.iter().enumerate() {
        if let Some(g) = h
            .guests
            .iter()
            .find(|g| g["name"].as_str() == Some(name) && g["state"].as_str() != Some("incoming"))
        {
            return Ok((i, g.clone()));
        }
    }
    bail!("no guest {name:?} runs in the cluster (see pagefleet status)")
}

#[derive(Subcommand)]
pub enum GuestCmd {
    /// Start a guest on a host: `pagefleet guest start db --on h1 --size 1GiB -- kv --listen 10.200.77.201:11211`
    Start {
        name: String,
        /// The host (name, HTTP or memory-server address).
        #[arg(long)]
        on: String,
        #[arg(long, value_parser = units::parse_size)]
        size: u64,
        /// Pages resident locally (a size); default all of it.
        #[arg(long, value_parser = units::parse_size)]
        budget: Option<u64>,
        #[command(flatten)]
        reg: Registry,
        /// The workload and its `pagefleet run` flags (synthetic or kv).
        #[arg(trailing_var_arg = true, required = true)]
        args: Vec<String>,
    },
    /// Stop a guest (its pages on memory servers are deleted).
    Stop {
        name: String,
        #[command(flatten)]
        reg: Registry,
    },
}

pub fn guest(c: GuestCmd) -> Result<()> {
    match c {
        GuestCmd::Start {
            name,
            on,
            size,
            budget,
            reg,
            args,
        } => {
            let hs = hosts(&reg.registry, &[])?;
            let h = &hs[find_host(&hs, &on)?];
            let mut body = json!({"name": name, "size": size, "args": args});
            if let Some(b) = budget {
                body["budget_pages"] = json!(b / 4096);
            }
            http::post(&h.http, "/guests", &body, Duration::from_secs(30))?;
            println!("guest {name} started on {}", h.name());
        }
        GuestCmd::Stop { name, reg } => {
            let hs = hosts(&reg.registry, &[])?;
            let (i, _) = find_guest(&hs, &name)?;
            http::post(
                &hs[i].http,
                &format!("/guests/{name}/stop"),
                &json!({}),
                Duration::from_secs(30),
            )?;
            println!("guest {name} stopped on {}", hs[i].name());
        }
    }
    Ok(())
}

#[derive(Args)]
pub struct MigrateArgs {
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
    pub guest: String,
    /// The host that takes the whole guest (default: the one with the most
    /// free guest memory, if the guest fits there).
    #[arg(long)]
    pub to: Option<String>,
    /// Compare region checksums at stop time and at resume.
    #[arg(long)]
    pub verify: bool,
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub reg: Registry,
}

fn info(h: &Host) -> HostInfo {
    let r = h.report.as_ref();
    HostInfo {
        name: h.name().to_string(),
        http: h.http.clone(),
        memserver: r.and_then(|r| r.memserver.clone()),
        guest_free: r.map(|r| r.guest_free).unwrap_or(0),
        lend_free: r
            .map(|r| r.lend_capacity.saturating_sub(r.lend_used))
            .unwrap_or(0),
    }
}

fn bar(p: &Value) -> String {
    let total = p["round_pages"].as_u64().unwrap_or(0).max(1);
    let sent = p["round_sent"].as_u64().unwrap_or(0).min(total);
    let w = 30;
    let fill = (sent * w / total) as usize;
    format!(
        "\r[{}{}] {:<14} main {:>8.1} MiB  subs {:>8.1} MiB ",
        "#".repeat(fill),
        " ".repeat(w as usize - fill),
        p["phase"].as_str().unwrap_or(""),
        p["bytes_main"].as_u64().unwrap_or(0) as f64 / 1048576.0,
        p["bytes_subs"].as_u64().unwrap_or(0) as f64 / 1048576.0
    )
}

/// Run a migration; returns its report.
pub fn migrate(a: &MigrateArgs, progress: bool) -> Result<Report> {
    let hs = hosts(&a.reg.registry, &[])?;
    let (src, g) = find_guest(&hs, &a.guest)?;
    if g["state"].as_str() == Some("migrating") {
        bail!("{} is already migrating", a.guest);
    }
    let size_pages = g["size"].as_u64().unwrap_or(0) / 4096;
    let p = &g["pages"];
    // Pages already on memory servers stay there: only resident ones need room.
    let data_pages = p["local"].as_u64().unwrap_or(0);
    let to = a.to.as_deref().map(|t| find_host(&hs, t)).transpose()?;
    let subs = a
        .sub
        .as_ref()
        .map(|s| {
            s.iter()
                .map(|x| find_host(&hs, x))
                .collect::<Result<Vec<_>>>()
        })
        .transpose()?;
    let infos: Vec<HostInfo> = hs.iter().map(info).collect();
    let c = if a.gather {
        // Every page with data, wherever it is, goes to one host.
        let remote: u64 = p["remote"]
            .as_object()
            .map(|m| m.values().filter_map(|v| v.as_u64()).sum())
            .unwrap_or(0);
        placement::choose_whole(&infos, src, size_pages, data_pages + remote, to)
            .map_err(anyhow::Error::msg)?
    } else {
        placement::choose(&infos, src, size_pages, data_pages, to, subs.as_deref())
            .map_err(anyhow::Error::msg)?
    };
    let main = &hs[c.main];
    eprintln!(
        "migrating {} from {} to {} ({} pages resident there){}",
        a.guest,
        hs[src].name(),
        main.name(),
        c.main_pages,
        if c.subs.is_empty() {
            String::new()
        } else {
            format!(
                ", sub-hosts {}",
                c.subs
                    .iter()
                    .map(|(h, _)| hs[*h].name())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        }
    );
    let mut inc_req = json!({"name": a.guest, "budget_pages": c.main_pages});
    if let Some(cg) = &a.dest_cgroup {
        inc_req["cgroup"] = json!(cg);
    }
    let inc = http::post(&main.http, "/incoming", &inc_req, Duration::from_secs(30))?;
    let mut addr = inc["migrate_addr"]
        .as_str()
        .context("no migrate_addr from the main host")?
        .to_string();
    if addr.starts_with("0.0.0.0:") {
        // The daemon listens on every address: use the one we reached it on.
        let ip = main
            .http
            .rsplit_once(':')
            .map(|x| x.0)
            .unwrap_or("127.0.0.1");
        addr = format!("{ip}:{}", addr.rsplit(':').next().unwrap_or("0"));
    }
    let mut req = json!({
        "to": addr,
        "subs": c.subs.iter().map(|(h, pages)| json!({"addr": hs[*h].report.as_ref().and_then(|r| r.memserver.clone()), "pages": pages})).collect::<Vec<_>>(),
        "main_pages": c.main_pages,
        "verify": a.verify,
        "gather": a.gather,
    });
    if let Some(p) = a.policy {
        req["policy"] = json!(format!("{p:?}").to_lowercase());
    }
    if let Some(c) = a.chunk {
        req["chunk"] = json!(c);
    }
    if let Some(n) = a.max_rounds {
        req["max_rounds"] = json!(n);
    }
    if let Some(n) = a.stop_pages {
        req["stop_pages"] = json!(n);
    }
    let mut report = None;
    let mut err = None;
    let mut in_doubt = false;
    http::post_stream(
        &hs[src].http,
        &format!("/guests/{}/migrate", a.guest),
        &req,
        Duration::from_secs(120),
        |v| {
            if let Some(p) = v.get("progress") {
                if progress {
                    eprint!("{}", bar(p));
                    let _ = std::io::stderr().flush();
                }
            } else if let Some(r) = v.get("report") {
                report = serde_json::from_value::<Report>(r.clone()).ok();
            } else if let Some(e) = v.get("error") {
                err = Some(e.as_str().unwrap_or("").to_string());
                in_doubt = v["in_doubt"].as_bool().unwrap_or(false);
            }
        },
    )?;
    if progress {
        eprintln!();
    }
    match (report, err) {
        (Some(r), _) => Ok(r),
        (None, Some(e)) if in_doubt => bail!("{e}"),
        (None, Some(e)) => bail!(
            "migration failed and was rolled back ({} still runs on {}): {e}",
            a.guest,
            hs[src].name()
        ),
        (None, None) => bail!("the source host ended the migration without a report"),
    }
}

pub fn gather_cmd(g: GatherArgs) -> Result<()> {
    migrate_cmd(MigrateArgs {
        guest: g.guest,
        to: g.to,
        sub: None,
        policy: None,
        chunk: None,
        verify: g.verify,
        max_rounds: None,
        stop_pages: None,
        json: g.json,
        dest_cgroup: None,
        reg: g.reg,
        gather: true,
    })
}

pub fn migrate_cmd(a: MigrateArgs) -> Result<()> {
    let r = migrate(&a, !a.json)?;
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

/// Empty a host for maintenance: pages guests keep on its memory server move
/// to another memory server (the guests keep running and paging), and guests
/// running there migrate away (their sub-host pages stay where they are).
pub fn evacuate(a: EvacuateArgs) -> Result<()> {
    let hs = hosts(&a.reg.registry, &[])?;
    let x = find_host(&hs, &a.host)?;
    let to = a.to.as_deref().map(|t| find_host(&hs, t)).transpose()?;
    let xms = hs[x].report.as_ref().and_then(|r| r.memserver.clone());
    let mut lend_free: Vec<u64> = hs.iter().map(|h| info(h).lend_free / 4096).collect();
    let mut moved_any = false;
    if let Some(xms) = &xms {
        for (gh, h) in hs.iter().enumerate() {
            for g in &h.guests {
                let n = g["pages"]["remote"][xms].as_u64().unwrap_or(0);
                if n == 0 {
                    continue;
                }
                let name = g["name"].as_str().unwrap_or("");
                let target = match to {
                    Some(t) => t,
                    None => (0..hs.len())
                        .filter(|&t| {
                            t != x
                                && t != gh
                                && hs[t].report.as_ref().is_some_and(|r| r.memserver.is_some())
                                && lend_free[t] >= n
                        })
                        .max_by_key(|&t| lend_free[t])
                        .ok_or_else(|| {
                            anyhow::anyhow!("no memory server can take {n} pages of {name}")
                        })?,
                };
                let tms = hs[target]
                    .report
                    .as_ref()
                    .and_then(|r| r.memserver.clone())
                    .context("the target host lends no memory")?;
                eprintln!(
                    "moving {n} pages of {name} from {} to {}",
                    hs[x].name(),
                    hs[target].name()
                );
                let r = http::post(
                    &h.http,
                    &format!("/guests/{name}/evacuate"),
                    &json!({"from": xms, "to": tms}),
                    Duration::from_secs(3600),
                )?;
                if let Some(e) = r["error"].as_str() {
                    bail!("{name}: {e}");
                }
                lend_free[target] = lend_free[target].saturating_sub(n);
                println!(
                    "{name}: {} pages moved from {} to {}",
                    r["moved"].as_u64().unwrap_or(0),
                    hs[x].name(),
                    hs[target].name()
                );
                moved_any = true;
            }
        }
    }
    for g in &hs[x].guests {
        let name = g["name"].as_str().unwrap_or("").to_string();
        if g["state"].as_str() == Some("incoming") {
            continue;
        }
        let m = MigrateArgs {
            guest: name.clone(),
            to: None,
            sub: None,
            policy: None,
            chunk: None,
            verify: false,
            max_rounds: None,
            stop_pages: None,
            json: false,
            dest_cgroup: None,
            reg: a.reg.clone(),
            gather: false,
        };
        let r = migrate(&m, true)?;
        r.print();
        moved_any = true;
    }
    if !moved_any {
        println!("{} holds no guest and no guest pages", hs[x].name());
    }
    Ok(())
}
