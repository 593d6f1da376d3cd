//! Same-page merging control (paper 001): the kernel's KSM knobs and
//! counters, ksmtuned's algorithm for an honest comparison, an adaptive
//! controller that scans while merging pays within a CPU budget, and
//! enrolment of processes.

pub mod adaptive;
pub mod control;
pub mod enroll;
pub mod sysfs;
pub mod tuned;

/// A share written as a percentage or a fraction: "10%" or "0.1" -> 0.1 (0 < share <= 1).
pub fn parse_share(what: &str, s: &str) -> anyhow::Result<f64> {
    let v = if let Some(p) = s.strip_suffix('%') {
        p.trim().parse::<f64>().map(|v| v / 100.0)
    } else {
        s.trim().parse::<f64>()
    };
    match v {
        Ok(v) if v > 0.0 && v <= 1.0 => Ok(v),
        Ok(_) => anyhow::bail!("{what} must be above 0 and at most 100% (got {s})"),
        Err(_) => {
            anyhow::bail!("{what} must be a percentage like 10% or a fraction like 0.1 (got {s})")
        }
    }
}
