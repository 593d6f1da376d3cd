//! Percentiles and medians of measurements.

/// p-th percentile (0..=100) of samples (sorted in place).
pub fn percentile(samples: &mut [f64], p: f64) -> f64 {
    if samples.is_empty() {
        return f64::NAN;
    }
    samples.sort_by(f64::total_cmp);
    let idx = ((p / 100.0) * (samples.len() - 1) as f64).round() as usize;
    samples[idx.min(samples.len() - 1)]
}

pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    percentile(&mut s, 50.0)
}
