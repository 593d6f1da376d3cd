//! No page left behind: what this host's memory server holds per region,
//! freeing one, and collecting orphans — regions no guest in the registry
//! owns and no connected client uses, idle past a grace period (a source
//! that crashed mid-migration, a runner killed with SIGKILL).

use pagefleet_api::{ClusterView, Dropped, GcReport, GcRequest, MemRegion};
use pagefleet_memserver::{RegionInfo, ServerState};
use std::collections::HashSet;
use std::time::Duration;

fn mem_region(r: &RegionInfo) -> MemRegion {
    MemRegion {
        region: format!("{:#x}", r.region),
        pages: r.pages,
        owner: r.owner.clone(),
        age_secs: r.age_secs,
        idle_secs: r.idle_secs,
        sessions: r.sessions,
    }
}

/// Every region the server holds.
pub fn regions(st: &ServerState) -> Vec<MemRegion> {
    st.store.regions_info().iter().map(mem_region).collect()
}

/// A region id as guests show it (hex, 0x optional).
pub fn parse_region(s: &str) -> Result<u64, String> {
    u64::from_str_radix(s.trim_start_matches("0x"), 16).map_err(|_| {
        format!("{s:?} is not a region id (hex, as `pagefleet memserver regions` lists them)")
    })
}

/// Free one region's pages.
pub fn drop_region(st: &ServerState, region: &str) -> Result<Dropped, String> {
    let id = parse_region(region)?;
    let pages = st.store.delete(id, None);
    tracing::info!("dropped region {id:x} on request: {pages} pages");
    Ok(Dropped {
        region: format!("{id:#x}"),
        pages,
    })
}

/// Collect the orphans of `st` (the memory server at `server`) given the
/// registry's `view`. Refused if any host of the view could not be asked
/// (a guest there might own pages here), unless the request says such
/// hosts are gone.
pub fn collect(
    st: &ServerState,
    server: &str,
    view: &ClusterView,
    req: &GcRequest,
) -> Result<GcReport, String> {
    if let Some(h) = view.hosts.iter().find(|h| h.error.is_some()) {
        if !req.unreachable_gone {
            return Err(format!(
                "cannot ask host {} ({}): a guest there may own pages here, so nothing is collected (if it is gone for good: `pagefleet host remove`, or `pagefleet gc --unreachable-gone`)",
                h.http,
                h.error.as_deref().unwrap_or_default()
            ));
        }
        tracing::warn!(
            "gc: host {} cannot be asked and is taken as gone (--unreachable-gone)",
            h.http
        );
    }
    if !(req.grace_secs >= 0.0 && req.grace_secs.is_finite()) {
        return Err(format!(
            "grace of {} s: give a number of seconds ≥ 0",
            req.grace_secs
        ));
    }
    // A guest whose region id is not known (starting, waiting for its
    // migration, or its runner slow to answer) could own any region.
    if let Some(g) = view
        .hosts
        .iter()
        .flat_map(|h| &h.guests)
        .filter(|g| g.state != pagefleet_api::GuestState::Failed)
        .find(|g| parse_region(&g.region_id).is_err())
    {
        return Err(format!(
            "guest {} has no known region yet ({:?}): nothing is collected until it has",
            g.name, g.state
        ));
    }
    // A failed guest's pages are nobody's: its runner is gone.
    let live: HashSet<u64> = view
        .hosts
        .iter()
        .flat_map(|h| &h.guests)
        .filter(|g| g.state != pagefleet_api::GuestState::Failed)
        .filter_map(|g| parse_region(&g.region_id).ok())
        .collect();
    let grace = Duration::from_secs_f64(req.grace_secs);
    let mut rep = GcReport {
        server: server.to_string(),
        dry_run: req.dry_run,
        ..Default::default()
    };
    for r in st.store.regions_info() {
        let orphan =
            !live.contains(&r.region) && r.sessions == 0 && r.idle_secs >= grace.as_secs_f64();
        if !orphan {
            rep.kept += 1;
            continue;
        }
        let freed = if req.dry_run {
            Some(r.pages)
        } else {
            // Checked again under the store's lock: a client that
            // attached since the listing keeps its region.
            st.store.delete_orphan(r.region, grace)
        };
        match freed {
            Some(pages) => {
                if !req.dry_run {
                    tracing::info!(
                        "collected orphaned region {:x} ({} pages, owner {:?}, idle {:.0} s)",
                        r.region,
                        pages,
                        r.owner,
                        r.idle_secs
                    );
                }
                rep.pages_freed += pages;
                let mut m = mem_region(&r);
                m.pages = pages;
                rep.freed.push(m);
            }
            None => rep.kept += 1,
        }
    }
    Ok(rep)
}
