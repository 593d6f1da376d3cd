//! Choosing hosts for a split migration (S-memV): the main host is the one
//! with the most free guest memory (or the one named); the pages it cannot
//! keep go to the fewest sub-hosts whose memory servers can hold them
//! (largest free first), or to the ones named.

/// A host as placement sees it.
#[derive(Clone, Debug)]
pub struct HostInfo {
    /// The host's name.
    pub name: String,
    /// The host's pagefleetd HTTP address.
    pub http: String,
    /// Its memory server, if it lends memory.
    pub memserver: Option<String>,
    /// Guest memory still free there, bytes.
    pub guest_free: u64,
    /// Memory its memory server can still take, bytes.
    pub lend_free: u64,
    /// Cordoned: nothing new is placed here (not chosen, refused when named).
    pub cordoned: bool,
}

impl From<&pagefleet_api::ClusterHost> for HostInfo {
    /// A host as the registry reports it (a host that did not answer has
    /// no free memory).
    fn from(h: &pagefleet_api::ClusterHost) -> HostInfo {
        let r = h.host.as_ref();
        HostInfo {
            name: h.name().to_string(),
            http: h.http.clone(),
            memserver: r.and_then(|r| r.memserver.clone()),
            guest_free: r.map_or(0, |r| r.guest_free),
            lend_free: r.map_or(0, |r| r.lend_capacity.saturating_sub(r.lend_used)),
            cordoned: r.is_some_and(|r| r.cordoned),
        }
    }
}

/// A host the user named that is cordoned.
fn cordoned(h: &HostInfo, role: &str) -> PlacementError {
    PlacementError::new(format!(
        "{} is cordoned (`pagefleet host uncordon {}` lets placement use it again): it cannot be {role}",
        h.name, h.name
    ))
}

/// Placement's answer.
#[derive(Clone, Debug, PartialEq)]
pub struct Choice {
    /// The main host (index into the hosts).
    pub main: usize,
    /// The guest's budget on the main host.
    pub main_pages: u64,
    /// (host, pages it may take).
    pub subs: Vec<(usize, u64)>,
}

/// Why placement found no home for a guest (for the person who asked).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct PlacementError(pub String);

impl PlacementError {
    fn new(m: String) -> PlacementError {
        PlacementError(m)
    }
}

impl From<&str> for PlacementError {
    fn from(m: &str) -> PlacementError {
        PlacementError(m.to_string())
    }
}

impl From<String> for PlacementError {
    fn from(m: String) -> PlacementError {
        PlacementError(m)
    }
}

/// `size_pages`: the guest's size; `data_pages`: pages holding data (what
/// must be placed somewhere). `to` / `subs`: hosts the user named.
pub fn choose(
    hosts: &[HostInfo],
    source: usize,
    size_pages: u64,
    data_pages: u64,
    to: Option<usize>,
    subs: Option<&[usize]>,
    replicas: usize,
) -> Result<Choice, PlacementError> {
    // With two replicas every page beyond the main host is stored twice,
    // on two sub-hosts.
    let copies = replicas.clamp(1, 2) as u64;
    let main = match to {
        Some(m) if m == source => {
            return Err(PlacementError::new(format!(
                "{} already runs the guest",
                hosts[m].name
            )))
        }
        Some(m) if hosts[m].cordoned => return Err(cordoned(&hosts[m], "the main host")),
        Some(m) => m,
        None => (0..hosts.len())
            .filter(|&h| h != source && !hosts[h].cordoned)
            .max_by_key(|&h| (hosts[h].guest_free, std::cmp::Reverse(h)))
            .ok_or("no other host to migrate to (every other host is cordoned or there is none)")?,
    };
    let main_free = pagefleet_units::pages_in(hosts[main].guest_free);
    // A budget below two chunks of 64 pages cannot page.
    if main_free < 128 {
        return Err(PlacementError::new(format!(
            "{} has no free guest memory",
            hosts[main].name
        )));
    }
    let main_pages = size_pages.min(main_free);
    // The migration fills a smaller main host only to its pager's low
    // watermark (see region::paging_slack): the rest needs room elsewhere.
    // (The chunk size is not known here: assume the largest, 64 pages.)
    let keep = if main_pages < size_pages {
        main_pages - pagefleet_region::paging_slack(main_pages, 64).min(main_pages)
    } else {
        main_pages
    };
    let rest = data_pages.saturating_sub(keep);
    let need = rest * copies;
    let cap = |h: usize| {
        if hosts[h].memserver.is_some() && !hosts[h].cordoned {
            pagefleet_units::pages_in(hosts[h].lend_free)
        } else {
            0
        }
    };
    let chosen: Vec<usize> = match subs {
        Some(s) => {
            for &h in s {
                if h == main || h == source {
                    return Err(PlacementError::new(format!("{} cannot be a sub-host of this migration (it is the source or the main host)", hosts[h].name)));
                }
                if hosts[h].memserver.is_none() {
                    return Err(PlacementError::new(format!(
                        "{} lends no memory (no memory server)",
                        hosts[h].name
                    )));
                }
                if hosts[h].cordoned {
                    return Err(cordoned(&hosts[h], "a sub-host"));
                }
            }
            s.to_vec()
        }
        // The whole guest fits: no sub-host needed.
        None if main_pages >= size_pages => Vec::new(),
        None => {
            let mut c: Vec<usize> = (0..hosts.len())
                .filter(|&h| h != source && h != main && cap(h) > 0)
                .collect();
            c.sort_by_key(|&h| (std::cmp::Reverse(cap(h)), h));
            let mut got = 0;
            let mut out = Vec::new();
            // At least one sub-host even when the data fits now: the guest
            // may grow into pages it has not touched yet, which must have
            // somewhere to go.
            for h in c {
                if got >= need && out.len() >= copies as usize {
                    break;
                }
                got += cap(h);
                out.push(h);
            }
            out
        }
    };
    let total: u64 = chosen.iter().map(|&h| cap(h)).sum();
    if main_pages < size_pages && chosen.is_empty() {
        return Err(PlacementError::new(format!(
            "{} keeps {} of the guest's {} pages and no other host lends memory for the rest",
            hosts[main].name, main_pages, size_pages
        )));
    }
    if total < need || (copies > 1 && rest > 0 && chosen.len() < 2) {
        return Err(PlacementError::new(format!(
            "not enough memory: {} pages to place beyond the main host {} ({} pages free){}, sub-hosts ({}) can take {}",
            rest,
            hosts[main].name,
            main_free,
            if copies > 1 { ", each twice on two sub-hosts" } else { "" },
            chosen.len(),
            total
        )));
    }
    Ok(Choice {
        main,
        main_pages,
        subs: chosen.into_iter().map(|h| (h, cap(h))).collect(),
    })
}

/// Integrated migration: one host takes the whole guest (memory for all of
/// it, so it never pages again).
pub fn choose_whole(
    hosts: &[HostInfo],
    source: usize,
    size_pages: u64,
    data_pages: u64,
    to: Option<usize>,
) -> Result<Choice, PlacementError> {
    let _ = data_pages;
    let fits = |h: usize| pagefleet_units::pages_in(hosts[h].guest_free) >= size_pages;
    let main = match to {
        Some(m) if m == source => {
            return Err(PlacementError::new(format!(
                "{} already runs the guest (its main part); gather it onto another host",
                hosts[m].name
            )))
        }
        Some(m) if hosts[m].cordoned => {
            return Err(cordoned(&hosts[m], "the host that takes the guest"))
        }
        Some(m) if !fits(m) => {
            return Err(PlacementError::new(format!(
                "{} has {} pages of guest memory free, the guest needs {}",
                hosts[m].name,
                pagefleet_units::pages_in(hosts[m].guest_free),
                size_pages
            )))
        }
        Some(m) => m,
        None => (0..hosts.len())
            .filter(|&h| h != source && fits(h) && !hosts[h].cordoned)
            .max_by_key(|&h| (hosts[h].guest_free, std::cmp::Reverse(h)))
            .ok_or_else(|| format!("no host has room for all {size_pages} pages of the guest"))?,
    };
    Ok(Choice {
        main,
        main_pages: size_pages,
        subs: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(name: &str, guest_free_pages: u64, lend_free_pages: Option<u64>) -> HostInfo {
        HostInfo {
            name: name.into(),
            http: format!("{name}:7071"),
            memserver: lend_free_pages.map(|_| format!("{name}:7070")),
            cordoned: false,
            guest_free: pagefleet_units::bytes_of(guest_free_pages),
            lend_free: pagefleet_units::bytes_of(lend_free_pages.unwrap_or(0)),
        }
    }

    #[test]
    fn main_host_has_most_free_memory_and_fewest_subs_fit() {
        let hosts = [
            h("src", 0, Some(0)),
            h("a", 1000, Some(100)),
            h("b", 4000, Some(100)),
            h("c", 10, Some(3000)),
            h("d", 10, Some(2000)),
        ];
        let c = choose(&hosts, 0, 8000, 6000, None, None, 1).unwrap();
        assert_eq!(c.main, 2);
        assert_eq!(c.main_pages, 4000);
        // 2000 pages left: c alone (3000) fits.
        assert_eq!(c.subs, vec![(3, 3000)]);
        let c = choose(&hosts, 0, 8000, 8000, None, None, 1).unwrap();
        assert_eq!(c.subs.iter().map(|s| s.0).collect::<Vec<_>>(), vec![3, 4]);
    }

    #[test]
    fn a_main_host_smaller_than_the_guest_always_gets_a_sub_host() {
        // The data fits the main host, but not the guest's full size.
        let hosts = [
            h("src", 0, Some(0)),
            h("a", 5000, Some(0)),
            h("b", 0, Some(100)),
            h("c", 0, Some(300)),
        ];
        let c = choose(&hosts, 0, 8000, 4000, None, None, 1).unwrap();
        assert_eq!((c.main, c.main_pages), (1, 5000));
        assert_eq!(c.subs, vec![(3, 300)]);
        let lonely = [h("src", 0, None), h("a", 5000, None)];
        assert!(choose(&lonely, 0, 8000, 4000, None, None, 1)
            .unwrap_err()
            .0
            .contains("no other host lends"));
    }

    #[test]
    fn two_replicas_take_twice_the_room_on_at_least_two_sub_hosts() {
        let hosts = [
            h("src", 0, Some(0)),
            h("a", 4000, Some(0)),
            h("c", 10, Some(3000)),
            h("d", 10, Some(2000)),
            h("e", 10, Some(100)),
        ];
        // 2000 pages beyond the main host: 4000 copies, c alone would do
        // with one replica, c + d with two.
        let c = choose(&hosts, 0, 8000, 6000, None, None, 2).unwrap();
        assert_eq!(c.subs.iter().map(|s| s.0).collect::<Vec<_>>(), vec![2, 3]);
        // 4000 pages beyond: 8000 copies do not fit in 5100.
        let e = choose(&hosts, 0, 8000, 8000, None, None, 2).unwrap_err();
        assert!(e.0.contains("twice"), "{}", e.0);
        // One sub-host named: no second copy possible.
        let e = choose(&hosts, 0, 8000, 6000, None, Some(&[2]), 2).unwrap_err();
        assert!(e.0.contains("twice"), "{}", e.0);
    }

    #[test]
    fn whole_guest_fits_no_subs() {
        let hosts = [h("src", 0, None), h("a", 9000, Some(100))];
        let c = choose(&hosts, 0, 8000, 8000, None, None, 1).unwrap();
        assert_eq!((c.main, c.main_pages, c.subs.len()), (1, 8000, 0));
    }

    #[test]
    fn gather_needs_one_host_for_everything() {
        let hosts = [h("src", 0, Some(0)), h("a", 1000, None), h("b", 5000, None)];
        let c = choose_whole(&hosts, 0, 4500, 4000, None).unwrap();
        assert_eq!((c.main, c.main_pages, c.subs.len()), (2, 4500, 0));
        assert!(choose_whole(&hosts, 0, 6000, 4000, None).is_err());
        assert!(choose_whole(&hosts, 0, 4500, 4000, Some(1))
            .unwrap_err()
            .0
            .contains("free"));
        assert!(choose_whole(&hosts, 0, 9000, 9000, None).is_err());
    }

    #[test]
    fn named_hosts_are_checked() {
        let hosts = [
            h("src", 0, Some(10)),
            h("a", 1000, Some(100)),
            h("b", 10, None),
            h("c", 0, Some(5000)),
        ];
        assert!(choose(&hosts, 0, 4000, 4000, Some(0), None, 1)
            .unwrap_err()
            .0
            .contains("already runs"));
        assert!(choose(&hosts, 0, 4000, 4000, Some(1), Some(&[2]), 1)
            .unwrap_err()
            .0
            .contains("lends no memory"));
        assert!(choose(&hosts, 0, 4000, 4000, Some(1), Some(&[1]), 1)
            .unwrap_err()
            .0
            .contains("cannot be a sub-host"));
        let c = choose(&hosts, 0, 4000, 4000, Some(1), Some(&[3]), 1).unwrap();
        assert_eq!(c.subs, vec![(3, 5000)]);
        assert!(choose(&hosts, 0, 40000, 40000, None, None, 1)
            .unwrap_err()
            .0
            .contains("not enough memory"));
    }
}
