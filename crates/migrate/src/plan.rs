//! Placement of a region's chunks for a split migration (S-memV): the
//! hottest chunks (by access history) go to the main host up to its memory,
//! the rest to sub-hosts in order, filling each before the next. With two
//! replicas every sub-host chunk also gets a mirror: another sub-host, the
//! one with the most room left.

use pagefleet_region::{Location, Snapshot};

/// Per chunk: `MAIN`, or `SUB0 + j` for sub-host j.
pub const MAIN: u8 = 0;
/// Sub-host 0 (sub-host j is SUB0 + j).
pub const SUB0: u8 = 1;

/// Where every chunk of a guest goes.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Pages per chunk.
    pub chunk_pages: usize,
    /// Per chunk: MAIN or SUB0 + j.
    pub target: Vec<u8>,
    /// Per chunk on a sub-host, with two replicas: the sub-host index of
    /// its second copy (empty with one replica).
    pub mirror: Vec<Option<u8>>,
    /// Pages with data planned for the main host and for each sub-host.
    pub main_pages: u64,
    /// Pages with data for each sub-host (first copies and mirrors).
    pub sub_pages: Vec<u64>,
}

impl Plan {
    /// The sub-host index holding chunk `c`'s second copy, if any.
    pub fn mirror_of(&self, c: usize) -> Option<usize> {
        self.mirror.get(c).copied().flatten().map(usize::from)
    }
}

/// The guest does not fit where it was asked to go.
#[derive(Debug, thiserror::Error)]
#[error("not enough memory for the guest: {need} pages to place, main host takes {main}, sub-hosts {subs} more{}", if *.replicas > 1 { " (every sub-host page twice, on two sub-hosts)" } else { "" })]
pub struct PlanError {
    /// Copies of every sub-host page.
    pub replicas: usize,
    /// Pages to place.
    pub need: u64,
    /// Pages the main host takes.
    pub main: u64,
    /// Pages the sub-hosts take.
    pub subs: u64,
}

/// Hotness of a chunk from its pages' history bytes: the aging value
/// dominates (max age), the clock bits (bit 7) break ties by count.
pub fn hotness(hist: &[u8]) -> u32 {
    let max = hist.iter().copied().max().unwrap_or(0) as u32;
    let refs = hist.iter().filter(|h| **h & 0x80 != 0).count() as u32;
    max * 128 + refs
}

/// Plan where every chunk goes. Pages that are on a memory server already
/// stay there (only their location travels) and need no room; pages never
/// touched need none either.
pub fn plan(
    s: &Snapshot,
    main_cap: u64,
    sub_caps: &[u64],
    replicas: usize,
) -> Result<Plan, PlanError> {
    let cp = s.chunk_pages;
    let chunks = s.location.len() / cp;
    let weight: Vec<u64> = (0..chunks)
        .map(|c| {
            s.location[c * cp..(c + 1) * cp]
                .iter()
                .filter(|l| **l == Location::Local)
                .count() as u64
        })
        .collect();
    let mut order: Vec<usize> = (0..chunks).collect();
    // Hottest first; equal hotness keeps address order (stable sort).
    order.sort_by_key(|&c| std::cmp::Reverse(hotness(&s.history[c * cp..(c + 1) * cp])));
    let need: u64 = weight.iter().sum();
    let mut target = vec![MAIN; chunks];
    let mut mirror = if replicas > 1 {
        vec![None; chunks]
    } else {
        Vec::new()
    };
    let mut main_pages = 0u64;
    let mut sub_pages = vec![0u64; sub_caps.len()];
    let room = |used: &[u64], k: usize| sub_caps[k].saturating_sub(used[k]);
    let err = || PlanError {
        replicas,
        need,
        main: main_cap,
        subs: sub_caps.iter().sum(),
    };
    let mut j = 0;
    for c in order {
        let w = weight[c];
        if main_pages + w <= main_cap {
            main_pages += w;
            target[c] = MAIN;
            continue;
        }
        while j < sub_caps.len() && room(&sub_pages, j) < w {
            j += 1;
        }
        if j == sub_caps.len() {
            return Err(err());
        }
        sub_pages[j] += w;
        target[c] = SUB0 + j as u8;
        if replicas > 1 {
            let k = (0..sub_caps.len())
                .filter(|&k| k != j && room(&sub_pages, k) >= w)
                .max_by_key(|&k| room(&sub_pages, k))
                .ok_or_else(err)?;
            sub_pages[k] += w;
            mirror[c] = Some(k as u8);
        }
    }
    Ok(Plan {
        chunk_pages: cp,
        target,
        mirror,
        main_pages,
        sub_pages,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(loc: Vec<Location>, hist: Vec<u8>, cp: usize) -> Snapshot {
        Snapshot {
            region_id: 1,
            chunk_pages: cp,
            servers: vec![],
            location: loc,
            history: hist,
        }
    }

    #[test]
    fn hottest_chunks_go_to_the_main_host() {
        // 4 chunks of 2 pages, all local; chunk 2 hottest, then 0.
        let loc = vec![Location::Local; 8];
        let hist = vec![0x80, 0, 0, 0, 0x80, 0x80, 0, 0];
        let p = plan(&snap(loc, hist, 2), 4, &[2, 10], 1).unwrap();
        assert_eq!(p.target, vec![MAIN, SUB0, MAIN, SUB0 + 1]);
        assert_eq!(p.main_pages, 4);
        assert_eq!(p.sub_pages, vec![2, 2]);
    }

    #[test]
    fn zero_and_remote_pages_need_no_room() {
        let loc = vec![
            Location::Zero,
            Location::Zero,
            Location::Remote(0, None),
            Location::Local,
        ];
        let p = plan(&snap(loc, vec![0; 4], 2), 1, &[], 1).unwrap();
        assert_eq!(p.target, vec![MAIN, MAIN]);
        assert_eq!(p.main_pages, 1);
    }

    #[test]
    fn too_little_memory_is_an_error() {
        let loc = vec![Location::Local; 8];
        let e = plan(&snap(loc, vec![0; 8], 2), 2, &[2], 1).unwrap_err();
        assert_eq!((e.need, e.main, e.subs), (8, 2, 2));
    }

    #[test]
    fn two_replicas_put_every_sub_host_chunk_on_two_sub_hosts() {
        // 6 chunks of 2 pages: 2 stay on the main host, 4 go to sub-hosts twice.
        let loc = vec![Location::Local; 12];
        let hist = vec![0x80, 0x80, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        let p = plan(&snap(loc.clone(), hist.clone(), 2), 4, &[6, 6, 6], 2).unwrap();
        assert_eq!(p.main_pages, 4);
        assert_eq!(p.sub_pages.iter().sum::<u64>(), 16, "8 pages, each twice");
        for c in 0..6 {
            match p.target[c] {
                MAIN => assert_eq!(p.mirror_of(c), None),
                t => {
                    let k = p.mirror_of(c).expect("a mirror");
                    assert_ne!(
                        k,
                        (t - SUB0) as usize,
                        "chunk {c} mirrored on its own sub-host"
                    );
                }
            }
        }
        assert!(p.sub_pages.iter().all(|n| *n <= 6), "{:?}", p.sub_pages);
        // One sub-host cannot hold the second copies.
        let e = plan(&snap(loc, hist, 2), 4, &[100], 2).unwrap_err();
        assert_eq!(e.replicas, 2);
        assert!(e.to_string().contains("twice"), "{e}");
    }

    #[test]
    fn aging_max_dominates_clock_count() {
        assert!(hotness(&[0xC0, 0]) > hotness(&[0x80, 0x80]));
        assert!(hotness(&[0x80, 0x80]) > hotness(&[0x80, 0]));
        assert_eq!(hotness(&[0, 0]), 0);
    }
}
