//! Where a block of the virtual device lives (DMPS Server Translator).
//!
//! - `Linear`: the servers' spaces concatenated, DMPS eq. (1):
//!   s_v = s_r + Σ_{i<n} S_i — block b is on the first server n whose
//!   cumulative size exceeds b, at b minus the sizes before it.
//! - `Stripe`: units of `unit` blocks dealt round-robin over the servers.
//! - Mirror (either layout): every block also on the next server.

use pagefleet_common::units::fmt_size;

/// One copy of a block: (server index, block number on that server).
pub type Place = (usize, u64);

/// How blocks are spread over the servers.
#[derive(Clone, Debug, PartialEq)]
pub enum Layout {
    /// Blocks each server holds, in order (S_0, S_1, ...).
    Linear {
        /// Blocks each server holds, in order.
        sizes: Vec<u64>,
    },
    /// Units dealt round-robin.
    Stripe {
        /// How many servers.
        servers: usize,
        /// Blocks per unit.
        unit: u64,
    },
}

/// Block number to (server, block there).
#[derive(Clone, Debug)]
pub struct Translator {
    /// The layout.
    pub layout: Layout,
    /// Every block also on the next server.
    pub mirror: bool,
    /// Blocks of the virtual device.
    pub blocks: u64,
    servers: usize,
}

/// A device shape the servers cannot hold.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum LayoutError {
    /// Not 1 to 16 servers.
    #[error("a device needs 1 to 16 memory servers (DMPS), got {0}")]
    Servers(usize),
    /// A mirror with one server.
    #[error("mirroring needs at least 2 servers")]
    MirrorServers,
    #[error(
        "the device needs {} but the memory servers have {} free in all{}: the largest device that fits is {} (--size {}KiB)",
        fmt_size(pagefleet_units::bytes_of(*need)),
        fmt_size(pagefleet_units::bytes_of(*free)),
        if *mirror { " (each block is stored twice with --mirror)" } else { "" },
        fmt_size(pagefleet_units::bytes_of(*fits)),
        fits * 4
    )]
    /// The servers lack room.
    TooSmall {
        /// Blocks the device needs.
        need: u64,
        /// Blocks free on the servers in all.
        free: u64,
        /// The largest device, in blocks, these servers can hold.
        fits: u64,
        /// Whether every block is stored twice.
        mirror: bool,
    },
    /// A zero stripe unit.
    #[error("stripe unit must be at least one block")]
    Unit,
}

impl Translator {
    /// `capacity[i]`: blocks server i can hold. Linear fills servers in
    /// order (each up to its capacity, mirror copies included).
    pub fn new(
        capacity: &[u64],
        blocks: u64,
        stripe_unit: Option<u64>,
        mirror: bool,
    ) -> Result<Translator, LayoutError> {
        let n = capacity.len();
        if n == 0 || n > 16 {
            return Err(LayoutError::Servers(n));
        }
        if mirror && n < 2 {
            return Err(LayoutError::MirrorServers);
        }
        let copies = if mirror { 2 } else { 1 };
        let layout = match stripe_unit {
            Some(0) => return Err(LayoutError::Unit),
            Some(unit) => {
                // Every server holds about blocks/n of each copy.
                let per = blocks.div_ceil(unit).div_ceil(n as u64) * unit * copies;
                if capacity.iter().any(|c| *c < per) {
                    // The smallest server bounds every server's share.
                    let min = capacity.iter().copied().min().unwrap_or(0);
                    let units_per_server = min / copies / unit;
                    return Err(LayoutError::TooSmall {
                        need: blocks,
                        free: capacity.iter().sum(),
                        fits: units_per_server * unit * n as u64,
                        mirror,
                    });
                }
                Layout::Stripe { servers: n, unit }
            }
            None => {
                // With a mirror, each server also holds its predecessor's
                // blocks: give each half its capacity.
                let mut sizes = Vec::new();
                let mut left = blocks;
                for &c in capacity {
                    let s = (c / copies).min(left);
                    sizes.push(s);
                    left -= s;
                }
                if left > 0 {
                    let fits: u64 = capacity.iter().map(|c| c / copies).sum();
                    return Err(LayoutError::TooSmall {
                        need: blocks,
                        free: capacity.iter().sum(),
                        fits,
                        mirror,
                    });
                }
                Layout::Linear { sizes }
            }
        };
        Ok(Translator {
            layout,
            mirror,
            blocks,
            servers: n,
        })
    }

    /// How many servers.
    pub fn servers(&self) -> usize {
        self.servers
    }

    /// Blocks each server holds when every block is written (copies
    /// included): what another device on the same servers must leave.
    pub fn blocks_per_server(&self) -> Vec<u64> {
        let mut per = vec![0u64; self.servers];
        for copy in self.runs(0, self.blocks, u64::MAX) {
            for (_, s, _, n) in copy {
                per[s] += n;
            }
        }
        per
    }

    /// The primary copy of block `b`.
    pub fn primary(&self, b: u64) -> Place {
        match &self.layout {
            Layout::Linear { sizes } => {
                let mut base = 0;
                for (i, s) in sizes.iter().enumerate() {
                    if b < base + s {
                        return (i, b - base);
                    }
                    base += s;
                }
                (sizes.len() - 1, b - (base - sizes[sizes.len() - 1]))
            }
            Layout::Stripe { servers, unit } => {
                let k = b / unit;
                (
                    (k % *servers as u64) as usize,
                    (k / *servers as u64) * unit + b % unit,
                )
            }
        }
    }

    /// Every copy of block `b` (primary first). The mirror copy is on the
    /// next server, in a second area after that server's primaries.
    pub fn places(&self, b: u64) -> Places {
        let p = self.primary(b);
        if !self.mirror {
            return Places { at: [p, p], n: 1 };
        }
        let next = (p.0 + 1) % self.servers;
        // Mirror blocks live at a high offset so they never meet primaries.
        let m = (next, MIRROR_BASE + (p.0 as u64) * MIRROR_STRIDE + p.1);
        Places { at: [p, m], n: 2 }
    }

    /// Split `count` blocks from `first` into runs that are contiguous on
    /// one server (the unit a request to a memory server can carry):
    /// (first virtual block, server, first server block, count) per copy.
    pub fn runs(&self, first: u64, count: u64, max: u64) -> Vec<Vec<(u64, usize, u64, u64)>> {
        let copies = if self.mirror { 2 } else { 1 };
        let mut out: Vec<Vec<(u64, usize, u64, u64)>> = vec![Vec::new(); copies];
        let mut b = first;
        while b < first + count {
            let places = self.places(b);
            for (c, &(s, sb)) in places.iter().enumerate() {
                let runs = &mut out[c];
                match runs.last_mut() {
                    Some(r) if r.1 == s && r.2 + r.3 == sb && r.0 + r.3 == b && r.3 < max => {
                        r.3 += 1
                    }
                    _ => runs.push((b, s, sb, 1)),
                }
            }
            b += 1;
        }
        out
    }
}

/// The copies of one block, primary first: one or two places, held
/// inline (every block of every request is placed: no allocation).
#[derive(Clone, Copy, Debug)]
pub struct Places {
    at: [Place; 2],
    n: usize,
}

impl std::ops::Deref for Places {
    type Target = [Place];
    fn deref(&self) -> &[Place] {
        &self.at[..self.n]
    }
}

/// Mirror copies: server block MIRROR_BASE + source_server * MIRROR_STRIDE + block.
pub const MIRROR_BASE: u64 = 1 << 48;
/// Offset of a server's mirror copies (a second area after its primaries).
pub const MIRROR_STRIDE: u64 = 1 << 40;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn linear_is_dmps_equation_one() {
        let t = Translator::new(&[100, 50, 200], 300, None, false).unwrap();
        assert_eq!(
            t.layout,
            Layout::Linear {
                sizes: vec![100, 50, 150]
            }
        );
        assert_eq!(t.primary(0), (0, 0));
        assert_eq!(t.primary(99), (0, 99));
        assert_eq!(t.primary(100), (1, 0));
        assert_eq!(t.primary(149), (1, 49));
        assert_eq!(t.primary(150), (2, 0));
        assert_eq!(t.primary(299), (2, 149));
    }

    #[test]
    fn stripe_deals_units_round_robin() {
        let t = Translator::new(&[1000, 1000], 100, Some(4), false).unwrap();
        assert_eq!(t.primary(0), (0, 0));
        assert_eq!(t.primary(3), (0, 3));
        assert_eq!(t.primary(4), (1, 0));
        assert_eq!(t.primary(8), (0, 4));
        assert_eq!(t.primary(13), (1, 5));
    }

    #[test]
    fn bad_shapes_are_refused() {
        assert_eq!(
            Translator::new(&[], 1, None, false).unwrap_err(),
            LayoutError::Servers(0)
        );
        assert_eq!(
            Translator::new(&[10; 17], 1, None, false).unwrap_err(),
            LayoutError::Servers(17)
        );
        assert_eq!(
            Translator::new(&[10], 1, None, true).unwrap_err(),
            LayoutError::MirrorServers
        );
        assert!(matches!(
            Translator::new(&[10, 10], 30, None, false),
            Err(LayoutError::TooSmall { .. })
        ));
        let e = Translator::new(&[10, 10], 20, None, true).unwrap_err();
        assert_eq!(
            e,
            LayoutError::TooSmall {
                need: 20,
                free: 20,
                fits: 10,
                mirror: true
            }
        );
        // Bytes, the largest size that fits, and why it is halved.
        let m = e.to_string();
        assert!(m.contains("80.00 KiB") && m.contains("40.00 KiB"), "{m}");
        assert!(m.contains("--size 40KiB") && m.contains("--mirror"), "{m}");
        let e = Translator::new(&[10, 6], 16, Some(4), false).unwrap_err();
        assert!(matches!(e, LayoutError::TooSmall { fits: 8, .. }), "{e:?}");
        assert_eq!(
            Translator::new(&[10, 10], 4, Some(0), false).unwrap_err(),
            LayoutError::Unit
        );
    }

    #[test]
    fn runs_stay_on_one_server_and_below_max() {
        let t = Translator::new(&[100, 100], 200, None, false).unwrap();
        let r = t.runs(90, 20, 32);
        assert_eq!(r[0], vec![(90, 0, 90, 10), (100, 1, 0, 10)]);
        let r = t.runs(0, 70, 32);
        assert_eq!(r[0], vec![(0, 0, 0, 32), (32, 0, 32, 32), (64, 0, 64, 6)]);
    }

    proptest! {
        /// No two virtual blocks (or copies) ever share a server block.
        #[test]
        fn places_are_distinct(n in 1usize..6, unit in 1u64..9, stripe: bool, mirror: bool, blocks in 1u64..300) {
            prop_assume!(!mirror || n >= 2);
            let cap = vec![blocks * 2 + 64; n];
            let t = Translator::new(&cap, blocks, stripe.then_some(unit), mirror).unwrap();
            let mut seen = std::collections::HashSet::new();
            for b in 0..blocks {
                let ps = t.places(b);
                prop_assert_eq!(ps.len(), if mirror { 2 } else { 1 });
                if mirror {
                    prop_assert_ne!(ps[0].0, ps[1].0, "mirror copies on one server");
                }
                for &p in ps.iter() {
                    prop_assert!(p.0 < n);
                    prop_assert!(seen.insert(p), "block {} collides at {:?}", b, p);
                }
            }
        }
    }
}
