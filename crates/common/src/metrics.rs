//! Prometheus text exposition (format 0.0.4), the one way pagefleet writes
//! its series: a family's `# HELP` and `# TYPE` once, then its samples;
//! label values and help text escaped as the format requires; histograms
//! with cumulative `_bucket{le=…}` series, `_sum` and `_count`.
//!
//! The conventions (<https://prometheus.io/docs/practices/naming/>) are
//! checked where a family is declared, in debug builds and by
//! [`check_name`] in tests: names in snake case with the `pagefleet_`
//! prefix (or a standard `process_` one), base units (`_bytes`,
//! `_seconds`, never `_us` or `_ms`), counters ending in `_total` and
//! nothing else in `_total`. `promtool check metrics` on a live host's
//! `/metrics` is the outside check (`crates/systest/tests/metrics.rs`).
//!
//! Ownership: an [`Exposition`] is a `String` being written by one thread.
//! Histograms are counted where they are observed (the pager's
//! `region::Histogram`) and written here from a [`HistogramSnapshot`]
//! ([`fold`] maps finer buckets onto the exported bounds).

pub use pagefleet_api::HistogramSnapshot;
use std::fmt::Write;

/// What a family is (its `# TYPE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Only ever goes up (resets when the process restarts); name ends in `_total`.
    Counter,
    /// Goes up and down.
    Gauge,
    /// Observations in buckets (`_bucket`, `_sum`, `_count`).
    Histogram,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// Suffixes of units that are not base units: a series is in bytes and
/// seconds, so that dashboards and `rate()` need no conversion.
const NON_BASE_UNITS: [&str; 8] = [
    "_us",
    "_ms",
    "_ns",
    "_micros",
    "_millis",
    "_microseconds",
    "_milliseconds",
    "_kib",
];

/// Why a family's name breaks the conventions, if it does.
pub fn check_name(name: &str, kind: Kind) -> Result<(), String> {
    let valid = name
        .bytes()
        .enumerate()
        .all(|(i, b)| b.is_ascii_lowercase() || b == b'_' || (i > 0 && b.is_ascii_digit()));
    if name.is_empty() || !valid {
        return Err(format!("{name:?}: not snake case ([a-z_][a-z0-9_]*)"));
    }
    if !name.starts_with("pagefleet_") && !name.starts_with("process_") {
        return Err(format!("{name:?}: not under pagefleet_ (or process_)"));
    }
    let stem = name.strip_suffix("_total").unwrap_or(name);
    if let Some(u) = NON_BASE_UNITS.iter().find(|u| stem.ends_with(*u)) {
        return Err(format!("{name:?}: {u} is not a base unit (bytes, seconds)"));
    }
    match (kind, name.ends_with("_total")) {
        (Kind::Counter, false) => Err(format!("{name:?}: a counter's name ends in _total")),
        (Kind::Gauge | Kind::Histogram, true) => {
            Err(format!("{name:?}: only a counter's name ends in _total"))
        }
        _ => Ok(()),
    }
}

/// Label names: `[a-zA-Z_][a-zA-Z0-9_]*`, not reserved (`__…`), not `le`
/// (the histogram's own).
fn label_name_ok(l: &str) -> bool {
    !l.is_empty()
        && !l.starts_with("__")
        && l != "le"
        && l.bytes()
            .enumerate()
            .all(|(i, b)| b.is_ascii_alphabetic() || b == b'_' || (i > 0 && b.is_ascii_digit()))
}

/// One label: name and value.
pub type Label<'a> = (&'a str, &'a str);

/// A sample's value: counts (`u64`, `usize`, …) and measures (`f64`).
pub trait Value {
    /// As the float the format carries (counts above 2^53 round).
    fn as_f64(&self) -> f64;
}

macro_rules! value_as {
    ($($t:ty),*) => {$(
        impl Value for $t {
            fn as_f64(&self) -> f64 {
                *self as f64
            }
        }
    )*};
}
value_as!(u64, u32, usize, i64, i32, f64);

impl Value for bool {
    fn as_f64(&self) -> f64 {
        if *self {
            1.0
        } else {
            0.0
        }
    }
}

/// A page of series being written.
#[derive(Default)]
pub struct Exposition {
    out: String,
    names: std::collections::BTreeSet<String>,
}

impl Exposition {
    /// An empty page.
    pub fn new() -> Exposition {
        Exposition::default()
    }

    /// Starts family `name`: its `# HELP` and `# TYPE` lines, then its
    /// samples through the returned writer. A family declared twice is a
    /// programming error (Prometheus refuses the page): debug builds
    /// panic, release builds write the second one's samples under the
    /// first's header.
    pub fn family(&mut self, name: &str, kind: Kind, help: &str) -> Family<'_> {
        debug_assert_eq!(check_name(name, kind), Ok(()));
        let new = self.names.insert(name.to_string());
        debug_assert!(new, "family {name} declared twice");
        if new {
            let _ = writeln!(
                self.out,
                "# HELP {name} {}\n# TYPE {name} {}",
                escape_help(help),
                kind.as_str()
            );
        }
        Family {
            out: &mut self.out,
            name: name.to_string(),
            kind,
        }
    }

    /// A family with one sample and no labels.
    pub fn single(&mut self, name: &str, kind: Kind, help: &str, v: impl Value) {
        self.family(name, kind, help).sample(&[], v);
    }

    /// The page.
    pub fn finish(self) -> String {
        self.out
    }
}

/// Writes one family's samples.
pub struct Family<'a> {
    out: &'a mut String,
    name: String,
    kind: Kind,
}

impl Family<'_> {
    /// One sample with `labels`.
    pub fn sample(&mut self, labels: &[Label], v: impl Value) -> &mut Self {
        debug_assert!(
            self.kind != Kind::Histogram,
            "{}: use histogram()",
            self.name
        );
        line(self.out, &self.name, "", labels, None, v.as_f64());
        self
    }

    /// A histogram's series for `labels`: a bucket per bound (cumulative),
    /// `+Inf`, `_sum` and `_count`.
    pub fn histogram(&mut self, labels: &[Label], h: &HistogramSnapshot) -> &mut Self {
        debug_assert!(
            self.kind == Kind::Histogram,
            "{}: not a histogram",
            self.name
        );
        let mut cum = 0u64;
        for (b, c) in h.bounds.iter().zip(&h.counts) {
            cum += c;
            line(
                self.out,
                &self.name,
                "_bucket",
                labels,
                Some(*b),
                cum as f64,
            );
        }
        let total = h.count.max(cum);
        line(
            self.out,
            &self.name,
            "_bucket",
            labels,
            Some(f64::INFINITY),
            total as f64,
        );
        line(self.out, &self.name, "_sum", labels, None, h.sum);
        line(self.out, &self.name, "_count", labels, None, total as f64);
        self
    }
}

fn line(out: &mut String, name: &str, suffix: &str, labels: &[Label], le: Option<f64>, v: f64) {
    out.push_str(name);
    out.push_str(suffix);
    if !labels.is_empty() || le.is_some() {
        out.push('{');
        let mut first = true;
        for (k, val) in labels {
            debug_assert!(label_name_ok(k), "{name}: label name {k:?}");
            if !first {
                out.push(',');
            }
            first = false;
            out.push_str(k);
            out.push_str("=\"");
            escape_label_into(out, val);
            out.push('"');
        }
        if let Some(le) = le {
            if !first {
                out.push(',');
            }
            out.push_str("le=\"");
            push_value(out, le);
            out.push('"');
        }
        out.push('}');
    }
    out.push(' ');
    push_value(out, v);
    out.push('\n');
}

/// A value as the format spells it (`NaN`, `+Inf`, `-Inf`, else Rust's
/// shortest round-trip decimal, which Go's ParseFloat reads back exactly).
fn push_value(out: &mut String, v: f64) {
    if v.is_nan() {
        out.push_str("NaN");
    } else if v == f64::INFINITY {
        out.push_str("+Inf");
    } else if v == f64::NEG_INFINITY {
        out.push_str("-Inf");
    } else {
        let _ = write!(out, "{v}");
    }
}

/// Help text: backslash and newline escaped.
fn escape_help(s: &str) -> String {
    s.replace('\\', "\\\\").replace('\n', "\\n")
}

/// A label value: backslash, double quote and newline escaped.
fn escape_label_into(out: &mut String, s: &str) {
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

/// Bounds for service times, seconds: powers of two from 8 µs to 8.4 s (a
/// fault served over loopback is ~30 µs, over a network ~100 µs, a hung
/// server's hedge deadline milliseconds, a stall seconds). Powers of two,
/// so that the pager's quarter-octave histogram folds into them exactly
/// (every fourth of its bounds is one).
pub const SERVICE_TIME_BOUNDS_S: [f64; 21] = [
    8e-6, 16e-6, 32e-6, 64e-6, 128e-6, 256e-6, 512e-6, 1.024e-3, 2.048e-3, 4.096e-3, 8.192e-3,
    16.384e-3, 32.768e-3, 65.536e-3, 0.131072, 0.262144, 0.524288, 1.048576, 2.097152, 4.194304,
    8.388608,
];

/// Folds counts over finer ascending bounds (`fine_upper`, each bucket's
/// upper bound; the last bucket also holds everything above it) into
/// `bounds`: a fine bucket goes to the first bound at or above its upper
/// bound, or above them all. Exact when every bound is one of the fine
/// upper bounds.
pub fn fold(
    fine_upper: &[f64],
    fine_counts: &[u64],
    bounds: &[f64],
    sum: f64,
) -> HistogramSnapshot {
    let mut counts = vec![0u64; bounds.len()];
    let mut count = 0u64;
    for (u, c) in fine_upper.iter().zip(fine_counts) {
        count += c;
        // Tolerance for bounds written in another unit (µs against s).
        if let Some(i) = bounds.iter().position(|b| *b >= u * (1.0 - 1e-9)) {
            counts[i] += c;
        }
    }
    HistogramSnapshot {
        bounds: bounds.to_vec(),
        counts,
        count,
        sum,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_conventions() {
        assert_eq!(
            check_name("pagefleet_guest_resident_bytes", Kind::Gauge),
            Ok(())
        );
        assert_eq!(
            check_name("pagefleet_guest_page_ins_total", Kind::Counter),
            Ok(())
        );
        assert_eq!(
            check_name("process_cpu_seconds_total", Kind::Counter),
            Ok(())
        );
        assert_eq!(
            check_name("pagefleet_guest_fault_seconds", Kind::Histogram),
            Ok(())
        );
        for (bad, kind) in [
            ("pagefleet_guest_fault_p99_us", Kind::Gauge),
            ("pagefleet_guest_page_in_cpu_us", Kind::Gauge),
            ("pagefleet_wait_ms_total", Kind::Counter),
            ("pagefleet_guest_page_ins", Kind::Counter),
            ("pagefleet_guests_total", Kind::Gauge),
            ("pagefleet_Guest_bytes", Kind::Gauge),
            ("guest_bytes", Kind::Gauge),
            ("pagefleet_guest-bytes", Kind::Gauge),
            ("", Kind::Gauge),
        ] {
            assert!(check_name(bad, kind).is_err(), "{bad} passed");
        }
    }

    #[test]
    fn a_family_is_declared_once_and_its_labels_escaped() {
        let mut e = Exposition::new();
        e.family(
            "pagefleet_guests",
            Kind::Gauge,
            "Guests on this host\nby state (a \\ here).",
        )
        .sample(&[("state", "running")], 2u32)
        .sample(&[("state", "a \"quoted\"\nname\\")], 0u32);
        e.single("pagefleet_up_seconds", Kind::Gauge, "Up.", 1.5);
        let t = e.finish();
        assert_eq!(
            t,
            "# HELP pagefleet_guests Guests on this host\\nby state (a \\\\ here).\n\
             # TYPE pagefleet_guests gauge\n\
             pagefleet_guests{state=\"running\"} 2\n\
             pagefleet_guests{state=\"a \\\"quoted\\\"\\nname\\\\\"} 0\n\
             # HELP pagefleet_up_seconds Up.\n\
             # TYPE pagefleet_up_seconds gauge\n\
             pagefleet_up_seconds 1.5\n"
        );
    }

    #[test]
    fn values_are_spelled_as_the_format_wants() {
        let mut s = String::new();
        for v in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 1e21, 0.1, 3.0] {
            push_value(&mut s, v);
            s.push(' ');
        }
        assert_eq!(s, "NaN +Inf -Inf 1000000000000000000000 0.1 3 ");
    }

    #[test]
    fn a_histogram_is_cumulative_with_inf_sum_and_count() {
        // Observations 0.0005, 0.001 | 0.002 | 0.05, 0.07 | 3.0 (above).
        let s = HistogramSnapshot {
            bounds: vec![0.001, 0.01, 0.1],
            counts: vec![2, 1, 2],
            count: 6,
            sum: 3.1235,
        };
        let mut e = Exposition::new();
        e.family("pagefleet_fault_seconds", Kind::Histogram, "Faults.")
            .histogram(&[("guest", "kv")], &s);
        let t = e.finish();
        assert!(
            t.contains("pagefleet_fault_seconds_bucket{guest=\"kv\",le=\"0.001\"} 2\n"),
            "{t}"
        );
        assert!(
            t.contains("pagefleet_fault_seconds_bucket{guest=\"kv\",le=\"0.01\"} 3\n"),
            "{t}"
        );
        assert!(
            t.contains("pagefleet_fault_seconds_bucket{guest=\"kv\",le=\"0.1\"} 5\n"),
            "{t}"
        );
        assert!(
            t.contains("pagefleet_fault_seconds_bucket{guest=\"kv\",le=\"+Inf\"} 6\n"),
            "{t}"
        );
        assert!(
            t.contains("pagefleet_fault_seconds_count{guest=\"kv\"} 6\n"),
            "{t}"
        );
        assert!(
            t.contains("pagefleet_fault_seconds_sum{guest=\"kv\"} 3.1235"),
            "{t}"
        );
    }

    #[test]
    fn finer_buckets_fold_into_coarser_bounds() {
        // Fine bounds 1,2,3,4,6,8 (the last also everything above).
        let fine = [1.0, 2.0, 3.0, 4.0, 6.0, 8.0];
        let counts = [1, 2, 3, 4, 5, 6];
        let h = fold(&fine, &counts, &[2.0, 4.0], 99.0);
        assert_eq!(h.counts, vec![3, 7]);
        assert_eq!(h.count, 21);
        assert_eq!(h.sum, 99.0);
        // The service-time bounds, in seconds, from powers of two in µs.
        let fine: Vec<f64> = (0..30).map(|k| (1u64 << k) as f64 * 1e-6).collect();
        let h = fold(&fine, &[1; 30], &SERVICE_TIME_BOUNDS_S, 0.0);
        // 1, 2, 4, 8 µs all at or below 8 µs; then one per bound.
        assert_eq!(h.counts[0], 4);
        assert!(h.counts[1..].iter().all(|c| *c == 1), "{:?}", h.counts);
        assert_eq!(h.count, 30);
    }

    #[test]
    fn label_names_are_checked() {
        assert!(label_name_ok("guest"));
        assert!(label_name_ok("server_id"));
        assert!(!label_name_ok("__name__"));
        assert!(!label_name_ok("le"));
        assert!(!label_name_ok("1st"));
        assert!(!label_name_ok("a-b"));
    }
}
