//! Migrations driven by the source host's daemon (`POST /migrations`):
//! placement over this daemon's registry view, the destination runner
//! started on the main host (`POST /incoming` there), then the runner's
//! migration relayed as [`ProgressEvent`]s. The migration belongs to the
//! daemon, not to the caller: it goes on when the caller goes away, and
//! `POST /guests/NAME/cancel` stops it. Evacuations (`POST /evacuations`)
//! move a host's lent pages away and migrate its guests off it.

use crate::app::App;
use crate::guests::{Guests, Refusal};
use pagefleet_api::migration::Failure;
use pagefleet_api::{
    ClusterHost, ControlRequest, EvacuationEvent, EvacuationOrder, IncomingReply, IncomingRequest,
    MigrateRequest, MigrationOrder, Placed, ProgressEvent, SubHost,
};
use pagefleet_migrate::placement::{self, HostInfo};
use std::time::Duration;

/// A host by name, HTTP address or memory-server address.
/// The host `key` names (name, HTTP or memory-server address) in `hs`;
/// one that does not answer is named with since when; one removed says so.
fn find_host(app: &App, hs: &[ClusterHost], key: &str) -> Result<usize, String> {
    match hs
        .iter()
        .position(|h| h.name() == key || h.http == key || h.memserver() == Some(key))
    {
        Some(i) => match &hs[i].error {
            Some(e) => Err(format!("host {key:?} cannot be used: {e}")),
            None => Ok(i),
        },
        None => Err(match app.peers.removed(key) {
            Some(r) => format!(
                "host {key:?} ({}) was removed from the registry at {} (pagefleet host remove)",
                r.http,
                crate::registry::utc(r.at)
            ),
            None if app.etcd.is_some() => format!("no host {key:?} in the registry (etcd)"),
            None => format!("no host {key:?} in this host's registry (its --peers)"),
        }),
    }
}

fn info(h: &ClusterHost) -> HostInfo {
    HostInfo::from(h)
}

/// Memory a migration took in the etcd registry: the main host's guest
/// memory and each sub-host's lending, each by transaction, so two
/// migrations racing for the same memory cannot both get it. Given back
/// when the migration ends (the hosts' own reports count it from then on).
#[derive(Default)]
struct Promises(Vec<(String, pagefleet_registry::Pool, u64)>);

impl Promises {
    /// Take every `want` or none (what was taken before a refusal is given back).
    fn take(
        app: &App,
        want: Vec<(String, pagefleet_registry::Pool, u64)>,
    ) -> Result<Promises, Refusal> {
        let mut got = Promises::default();
        let Some(etcd) = &app.etcd else {
            return Ok(got);
        };
        for (name, pool, bytes) in want {
            let what = match pool {
                pagefleet_registry::Pool::Guest => "free memory",
                pagefleet_registry::Pool::Lend => "memory to lend",
            };
            match etcd.claim_pool(&name, pool, bytes) {
                Ok(true) => got.0.push((name, pool, bytes)),
                Ok(false) => {
                    got.release(app);
                    return Err(Refusal::new(
                        409,
                        format!(
                            "{name}'s {what} was promised to another migration meanwhile: try again"
                        ),
                    ));
                }
                Err(e) => {
                    got.release(app);
                    return Err(Refusal::new(503, format!("the registry: {e}")));
                }
            }
        }
        Ok(got)
    }

    /// Give everything back.
    fn release(&mut self, app: &App) {
        let Some(etcd) = &app.etcd else { return };
        for (name, pool, bytes) in self.0.drain(..) {
            if let Err(e) = etcd.release_pool(&name, pool, bytes) {
                tracing::warn!("releasing a claim on {name}: {e}");
            }
        }
    }
}

/// Place the guest and start its destination runner: what to tell the
/// source runner, where things went, and the memory it was promised.
fn place(app: &App, o: &MigrationOrder) -> Result<(Placed, MigrateRequest, Promises), Refusal> {
    let bad = |m: String| Refusal {
        status: 400,
        message: m,
    };
    // This host is the first of the view, with its guests' status.
    let view = app.placement_view();
    let hs = &view.hosts;
    // An unreadable registry is the error, not "no host" or "no memory".
    if let Some(e) = hs
        .iter()
        .find(|h| h.http == "etcd")
        .and_then(|h| h.error.as_ref())
    {
        return Err(Refusal::new(503, format!("cannot place the guest: {e}")));
    }
    let src = 0;
    let st = hs[src]
        .guests
        .iter()
        .find(|x| x.name == o.guest && x.state != pagefleet_api::GuestState::Incoming)
        .ok_or_else(|| Refusal {
            status: 404,
            message: format!("no guest {:?} runs here", o.guest),
        })?;
    match st.state {
        pagefleet_api::GuestState::Migrating => {
            return Err(Refusal::new(
                409,
                format!("{} is already migrating", o.guest),
            ))
        }
        pagefleet_api::GuestState::Starting => {
            return Err(Refusal::new(
                409,
                format!("{}'s runner does not answer yet", o.guest),
            ))
        }
        pagefleet_api::GuestState::Failed => {
            let why = st
                .failure
                .as_ref()
                .map(|f| format!("{} ({})", f.reason, f.exit));
            return Err(Refusal::new(
                409,
                format!(
                    "{} failed and cannot migrate: {}",
                    o.guest,
                    why.unwrap_or_default()
                ),
            ));
        }
        _ => {}
    }
    let size_pages = pagefleet_units::pages_in(st.size);
    let pages = st.pages.clone().unwrap_or_default();
    // Pages already on memory servers stay there: only resident ones need room.
    let data_pages = pages.local;
    let to =
        o.to.as_deref()
            .map(|t| find_host(app, hs, t))
            .transpose()
            .map_err(bad)?;
    let subs = o
        .subs
        .as_ref()
        .map(|s| {
            s.iter()
                .map(|x| find_host(app, hs, x))
                .collect::<Result<Vec<_>, _>>()
        })
        .transpose()
        .map_err(bad)?;
    let infos: Vec<HostInfo> = hs.iter().map(info).collect();
    let choice = if o.gather {
        // Every page with data, wherever it is, goes to one host.
        let remote: u64 = pages.remote.values().sum();
        placement::choose_whole(&infos, src, size_pages, data_pages + remote, to)
    } else {
        let replicas = st.paging.as_ref().map_or(1, |p| p.replicas.max(1));
        placement::choose(
            &infos,
            src,
            size_pages,
            data_pages,
            to,
            subs.as_deref(),
            replicas,
        )
    }
    .map_err(|m| Refusal {
        status: 409,
        message: m.to_string(),
    })?;
    let main = &hs[choice.main];
    let mut sub_hosts = Vec::new();
    for (h, n) in &choice.subs {
        let addr = hs[*h]
            .memserver()
            .ok_or_else(|| bad(format!("{} lends no memory", hs[*h].name())))?;
        sub_hosts.push(SubHost {
            addr: addr.to_string(),
            pages: *n,
        });
    }
    // With etcd as the registry the memory is taken by transactions: a
    // migration racing for the same memory is refused here.
    let mut want = vec![(
        main.name().to_string(),
        pagefleet_registry::Pool::Guest,
        pagefleet_units::bytes_of(choice.main_pages),
    )];
    want.extend(choice.subs.iter().map(|(h, n)| {
        (
            hs[*h].name().to_string(),
            pagefleet_registry::Pool::Lend,
            pagefleet_units::bytes_of(*n),
        )
    }));
    let mut promises = Promises::take(app, want)?;
    let inc = IncomingRequest {
        name: o.guest.clone(),
        budget_pages: choice.main_pages,
        cgroup: o.dest_cgroup.clone(),
    };
    let reply: IncomingReply = app
        .client
        .timeout(Duration::from_secs(30))
        .post(&main.http, "/incoming", &inc)
        .map_err(|e| {
            promises.release(app);
            Refusal {
                status: 502,
                message: format!("starting the destination runner on {}: {e}", main.name()),
            }
        })?;
    let mut addr = reply.migrate_addr;
    if addr.starts_with("0.0.0.0:") {
        // The daemon there listens on every address: use the one we reached it on.
        let ip = main
            .http
            .rsplit_once(':')
            .map(|x| x.0)
            .unwrap_or("127.0.0.1");
        addr = format!("{ip}:{}", addr.rsplit(':').next().unwrap_or("0"));
    }
    let placed = Placed {
        guest: o.guest.clone(),
        source: hs[src].name().to_string(),
        main: main.name().to_string(),
        main_pages: choice.main_pages,
        subs: choice
            .subs
            .iter()
            .map(|(h, n)| (hs[*h].name().to_string(), *n))
            .collect(),
    };
    let req = MigrateRequest {
        to: addr,
        subs: sub_hosts,
        main_pages: Some(choice.main_pages),
        verify: o.verify,
        gather: o.gather,
        policy: o.policy,
        chunk: o.chunk,
        max_rounds: o.max_rounds,
        stop_pages: o.stop_pages,
        max_downtime_ms: o.max_downtime_ms,
        timeout_secs: o.timeout_secs,
        no_dedup: o.no_dedup,
        dedup_always: o.dedup_always,
    };
    Ok((placed, req, promises))
}

/// Relay guest `name`'s migration (the runner's event stream) to `emit`
/// until it ends. When `emit` returns false the caller is gone: with
/// `leave_cancels` the runner's socket is shut (the runner cancels), else
/// the relay keeps draining so the migration completes.
pub fn relay(
    g: &Guests,
    name: &str,
    req: MigrateRequest,
    leave_cancels: bool,
    mut emit: impl FnMut(&ProgressEvent) -> bool,
) {
    let to = req.to.clone();
    let s = match g.migrate_stream(name, &ControlRequest::Migrate(req)) {
        Ok(s) => s,
        Err(r) => {
            tracing::warn!("guest {name}: migration to {to} not started: {}", r.message);
            g.migration_ended(name, Err(&r.message));
            emit(&failed(r.message));
            return;
        }
    };
    tracing::info!("guest {name}: migrating to {to}");
    let shut = s.try_clone();
    let mut listening = true;
    // A stream that ends without a report or a failure is a failure too.
    let mut ended = false;
    let path = std::path::PathBuf::from(format!("guest {name}"));
    let r = pagefleet_common::control::read_lines::<ProgressEvent>(&path, s, |ev| {
        match &ev {
            ProgressEvent::Report(r) => {
                tracing::info!(
                    "guest {name}: migrated to {} in {:.1} s ({} rounds, {:.0} ms downtime, sub-hosts: {})",
                    r.main_host,
                    r.total_secs,
                    r.rounds,
                    r.downtime_ms,
                    if r.sub_hosts.is_empty() {
                        "none".to_string()
                    } else {
                        r.sub_hosts.join(", ")
                    }
                );
                // The guest runs elsewhere now: its memory here is free at
                // once (the runner exits right after).
                g.forget(name);
                g.migration_ended(name, Ok(r.as_ref()));
                ended = true;
            }
            ProgressEvent::Failed(f) => {
                tracing::warn!(
                    "guest {name}: migration to {to} failed{}: {}",
                    if f.rolled_back.is_empty() {
                        ""
                    } else {
                        " (rolled back)"
                    },
                    f.message
                );
                g.migration_ended(name, Err(&f.message));
                ended = true;
            }
            _ => {}
        }
        if listening && !emit(&ev) {
            listening = false;
            if leave_cancels {
                return false;
            }
        }
        true
    });
    if !ended {
        let why = match &r {
            Err(e) => e.to_string(),
            Ok(_) => "the runner's progress stream ended without a report".to_string(),
        };
        g.migration_ended(name, Err(&why));
    }
    if let Err(e) = r {
        if listening {
            emit(&failed(e.to_string()));
        }
    }
    if let Ok(s) = shut {
        let _ = s.shutdown(std::net::Shutdown::Both);
    }
}

fn failed(message: String) -> ProgressEvent {
    ProgressEvent::Failed(Failure {
        message,
        in_doubt: false,
        rolled_back: vec![],
    })
}

/// Carry out `order` on this (the source) host, emitting its events.
pub fn migrate(app: &App, order: MigrationOrder, mut emit: impl FnMut(&ProgressEvent) -> bool) {
    let Some(g) = app.guests.as_ref() else {
        emit(&failed("this host runs no guests".into()));
        return;
    };
    match place(app, &order) {
        Err(r) => {
            // Asked for and not done: a failed migration for the tallies.
            tracing::warn!("guest {}: migration not placed: {}", order.guest, r.message);
            g.migration_ended(&order.guest, Err(&r.message));
            emit(&failed(r.message));
        }
        Ok((placed, req, mut promises)) => {
            let listening = emit(&ProgressEvent::Placed(placed));
            let mut listening_now = listening;
            relay(g, &order.guest, req, false, |ev| {
                if listening_now {
                    listening_now = emit(ev);
                }
                listening_now
            });
            // Done or rolled back: the hosts' own reports count the
            // guest from now on (or never will).
            promises.release(app);
        }
    }
}

/// Carry out an evacuation of `order.host`, emitting its events. Runs on
/// any daemon whose registry knows the host: page moves are asked of each
/// guest's own host, migrations of the evacuated host's daemon.
pub fn evacuate(app: &App, order: EvacuationOrder, mut emit: impl FnMut(&EvacuationEvent) -> bool) {
    let fail = |m: String| EvacuationEvent::Failed { message: m };
    let view = app.view();
    let hs = &view.hosts;
    let x = match find_host(app, hs, &order.host) {
        Ok(x) => x,
        Err(m) => {
            emit(&fail(m));
            return;
        }
    };
    let to = match order
        .to
        .as_deref()
        .map(|t| find_host(app, hs, t))
        .transpose()
    {
        Ok(t) => t,
        Err(m) => {
            emit(&fail(m));
            return;
        }
    };
    let mut lend_free: Vec<u64> = hs
        .iter()
        .map(|h| pagefleet_units::pages_in(info(h).lend_free))
        .collect();
    let mut moved_any = false;
    // 1. Pages guests keep on the host's memory server go to another one.
    if let Some(xms) = hs[x].memserver().map(String::from) {
        for (gh, h) in hs.iter().enumerate() {
            for g in &h.guests {
                let n = g
                    .pages
                    .as_ref()
                    .and_then(|p| p.remote.get(&xms).copied())
                    .unwrap_or(0);
                if n == 0 {
                    continue;
                }
                let target = to.or_else(|| {
                    (0..hs.len())
                        .filter(|&t| {
                            t != x
                                && t != gh
                                && hs[t].memserver().is_some()
                                && lend_free[t] >= n
                                && !info(&hs[t]).cordoned
                        })
                        .max_by_key(|&t| lend_free[t])
                });
                let Some(target) = target else {
                    emit(&fail(format!(
                        "no memory server can take the {} of {}",
                        pagefleet_common::units::fmt_size(pagefleet_units::bytes_of(n)),
                        g.name
                    )));
                    return;
                };
                let Some(tms) = hs[target].memserver() else {
                    emit(&fail(format!("{} lends no memory", hs[target].name())));
                    return;
                };
                #[derive(serde::Serialize)]
                struct Evacuate<'a> {
                    from: &'a str,
                    to: &'a str,
                }
                let r: Result<pagefleet_api::control::Moved, _> =
                    app.client.timeout(Duration::from_secs(3600)).post(
                        &h.http,
                        &format!("/guests/{}/evacuate", g.name),
                        &Evacuate {
                            from: &xms,
                            to: tms,
                        },
                    );
                match r {
                    Ok(m) => {
                        lend_free[target] = lend_free[target].saturating_sub(n);
                        moved_any = true;
                        emit(&EvacuationEvent::PagesMoved {
                            guest: g.name.clone(),
                            pages: m.moved,
                            from: hs[x].name().to_string(),
                            to: hs[target].name().to_string(),
                        });
                    }
                    Err(e) => {
                        emit(&fail(format!("moving the pages of {}: {e}", g.name)));
                        return;
                    }
                }
            }
        }
    }
    // 2. Guests running on the host migrate away (placement chooses where).
    for g in &hs[x].guests {
        if order.pages_only || !g.state.is_live() {
            continue;
        }
        emit(&EvacuationEvent::Migrating {
            guest: g.name.clone(),
        });
        let order = MigrationOrder {
            guest: g.name.clone(),
            ..MigrationOrder::default()
        };
        let mut ok = false;
        let r = app.client.post_stream(
            &hs[x].http,
            "/migrations",
            &order,
            Duration::from_secs(120),
            |ev: ProgressEvent| {
                ok |= matches!(ev, ProgressEvent::Report(_));
                emit(&EvacuationEvent::Migration(Box::new(ev)))
            },
        );
        if let Err(e) = r {
            emit(&fail(format!("migrating {}: {e}", g.name)));
            return;
        }
        if !ok {
            emit(&fail(format!("{} did not migrate away", g.name)));
            return;
        }
        moved_any = true;
    }
    emit(&EvacuationEvent::Done {
        host: hs[x].name().to_string(),
        moved_any,
    });
}
