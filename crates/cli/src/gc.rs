//! `pagefleet memserver regions|drop` and `pagefleet gc`: what memory
//! servers hold, per region, and freeing what no one owns any more.

use crate::cluster::{age, find_host, hosts};
use anyhow::{bail, Context, Result};
use pagefleet_api::{ClusterHost, DropRegion, Dropped, GcReport, GcRequest, MemRegion};
use pagefleet_common::http::Client;
use pagefleet_common::units;
use std::collections::HashSet;

fn lenders<'a>(hs: &'a [ClusterHost], on: Option<&str>) -> Result<Vec<&'a ClusterHost>> {
    if let Some(key) = on {
        let h = &hs[find_host(hs, key)?];
        if h.memserver().is_none() {
            bail!("host {} lends no memory", h.name());
        }
        return Ok(vec![h]);
    }
    Ok(hs.iter().filter(|h| h.memserver().is_some()).collect())
}

/// Per region of each memory server (or the one `on` names): pages,
/// owner, age, idle time, connected clients, and whether a guest in the
/// registry owns it.
pub fn regions(c: &Client, registry: &str, on: Option<&str>, json: bool) -> Result<()> {
    let hs = hosts(c, registry, &[])?;
    let live: HashSet<&str> = hs
        .iter()
        .flat_map(|h| &h.guests)
        .filter(|g| g.state != pagefleet_api::GuestState::Failed)
        .map(|g| g.region_id.as_str())
        .collect();
    let mut all = Vec::new();
    for h in lenders(&hs, on)? {
        let rs: Vec<MemRegion> = c
            .get(&h.http, "/memserver/regions")
            .with_context(|| format!("asking {} for its regions", h.name()))?;
        all.push((h, rs));
    }
    if json {
        let v: Vec<_> = all
            .iter()
            .map(|(h, rs)| {
                serde_json::json!({"host": h.name(), "server": h.memserver(), "regions": rs.iter().map(|r| {
                    let mut v = serde_json::to_value(r).unwrap_or_default();
                    v["guest_live"] = live.contains(r.region.as_str()).into();
                    v
                }).collect::<Vec<_>>()})
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    for (h, rs) in &all {
        println!(
            "{} ({}): {} regions",
            h.name(),
            h.memserver().unwrap_or_default(),
            rs.len()
        );
        if rs.is_empty() {
            continue;
        }
        println!(
            "  {:<18} {:>10} {:>7} {:>7} {:>8}  {:<6} owner",
            "region", "stored", "age", "idle", "clients", "guest"
        );
        for r in rs {
            println!(
                "  {:<18} {:>10} {:>7} {:>7} {:>8}  {:<6} {}",
                r.region,
                units::fmt_size(pagefleet_units::bytes_of(r.pages)),
                age(r.age_secs),
                age(r.idle_secs),
                r.sessions,
                if live.contains(r.region.as_str()) {
                    "live"
                } else {
                    "-"
                },
                r.owner
            );
        }
    }
    Ok(())
}

/// Free one region on the memory server of host `on`.
pub fn drop_region(c: &Client, registry: &str, on: &str, region: &str) -> Result<()> {
    let hs = hosts(c, registry, &[])?;
    let h = lenders(&hs, Some(on))?[0];
    let id = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok();
    let Some(want) = id(region) else {
        bail!("{region:?} is not a region id (hex, as `pagefleet memserver regions` lists them)");
    };
    if hs
        .iter()
        .flat_map(|h| &h.guests)
        .any(|g| id(&g.region_id) == Some(want))
    {
        bail!(
            "region {region} belongs to a running guest: stop the guest instead (pagefleet guest stop)"
        );
    }
    let d: Dropped = c.post(
        &h.http,
        "/memserver/drop",
        &DropRegion {
            region: region.to_string(),
        },
    )?;
    println!(
        "freed region {} on {}: {} pages ({})",
        d.region,
        h.name(),
        d.pages,
        units::fmt_size(pagefleet_units::bytes_of(d.pages))
    );
    Ok(())
}

/// Collect orphaned regions on every memory server of the cluster.
pub fn gc(
    c: &Client,
    registry: &str,
    grace_secs: f64,
    dry_run: bool,
    unreachable_gone: bool,
    json: bool,
) -> Result<()> {
    let hs = hosts(c, registry, &[])?;
    let unreachable: Vec<&ClusterHost> = hs.iter().filter(|h| h.error.is_some()).collect();
    if let Some(h) = unreachable.first() {
        if !unreachable_gone {
            bail!(
                "cannot ask host {} ({}): a guest there may own pages elsewhere, so nothing is collected. \
                 If it is gone for good, `pagefleet host remove {}` takes it out of the registry, \
                 or `pagefleet gc --unreachable-gone` collects what the hosts that answer can vouch for",
                h.http,
                h.error.as_deref().unwrap_or_default(),
                h.http
            );
        }
        for h in &unreachable {
            eprintln!(
                "taking {} as gone: {}",
                h.http,
                h.error.as_deref().unwrap_or_default()
            );
        }
    }
    let req = GcRequest {
        grace_secs,
        dry_run,
        unreachable_gone,
    };
    let mut reports = Vec::new();
    for h in lenders(&hs, None)?
        .into_iter()
        .filter(|h| h.error.is_none())
    {
        let r: GcReport = c
            .post(&h.http, "/gc", &req)
            .with_context(|| format!("collecting on {}", h.name()))?;
        reports.push((h.name().to_string(), r));
    }
    if json {
        let v: Vec<_> = reports
            .iter()
            .map(|(h, r)| serde_json::json!({"host": h, "report": r}))
            .collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    for (h, r) in &reports {
        println!(
            "{h} ({}): {} {} pages ({}) of {} orphaned regions; kept {}",
            r.server,
            if r.dry_run { "would free" } else { "freed" },
            r.pages_freed,
            units::fmt_size(pagefleet_units::bytes_of(r.pages_freed)),
            r.freed.len(),
            r.kept
        );
        for f in &r.freed {
            println!(
                "  region {} ({} pages, owner {:?}, idle {})",
                f.region,
                f.pages,
                f.owner,
                age(f.idle_secs)
            );
        }
    }
    Ok(())
}
