//! A histogram's contents, as a runner reports them to its daemon and the
//! daemon exposes them to Prometheus (`pagefleet_common::metrics`).

use serde::{Deserialize, Serialize};

/// A histogram's contents at one moment: what a runner reports to its
/// daemon, and what `pagefleet_common::metrics::Family::histogram` writes.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct HistogramSnapshot {
    /// Upper bounds (inclusive), ascending.
    pub bounds: Vec<f64>,
    /// Observations per bucket (not cumulative): `counts[i]` is in
    /// `(bounds[i-1], bounds[i]]`.
    pub counts: Vec<u64>,
    /// All observations, the ones above the last bound too.
    pub count: u64,
    /// Their sum.
    pub sum: f64,
}

impl HistogramSnapshot {
    /// The bound at or below which a share `q` (0..=1) of the observations
    /// lie, as `histogram_quantile` would estimate it (linear within the
    /// bucket); `None` when empty.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.count == 0 {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * self.count as f64;
        let mut cum = 0u64;
        for (i, (b, c)) in self.bounds.iter().zip(&self.counts).enumerate() {
            if (cum + c) as f64 >= rank && *c > 0 {
                let lo = if i == 0 { 0.0 } else { self.bounds[i - 1] };
                return Some(lo + (b - lo) * ((rank - cum as f64) / *c as f64).clamp(0.0, 1.0));
            }
            cum += c;
        }
        self.bounds.last().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_within_a_bucket() {
        let s = HistogramSnapshot {
            bounds: vec![1.0, 2.0, 4.0],
            counts: vec![0, 10, 10],
            count: 20,
            sum: 0.0,
        };
        assert_eq!(s.quantile(0.5), Some(2.0));
        assert_eq!(s.quantile(0.25), Some(1.5));
        assert_eq!(s.quantile(0.75), Some(3.0));
        assert_eq!(HistogramSnapshot::default().quantile(0.5), None);
    }
}
