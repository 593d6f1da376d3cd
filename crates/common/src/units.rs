//! Human sizes: "4GiB", "512MiB", "1.5G", "4096", "64k".

/// A size or share that does not parse, and what would.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct UnitError(pub String);

/// Parse a size in bytes. Binary units (KiB, MiB, GiB, TiB, and the short
/// K/M/G/T, case-insensitive) are powers of 1024; KB/MB/GB/TB are powers of 1000.
pub fn parse_size(s: &str) -> Result<u64, UnitError> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit = unit.trim().to_ascii_lowercase();
    let mult: f64 = match unit.as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024.0 * 1024.0,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tib" => 1024.0f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => {
            return Err(UnitError(format!(
                "unknown size unit {unit:?} in {s:?}; use e.g. 4GiB, 512MiB, 64KiB or bytes"
            )))
        }
    };
    let v: f64 = num.parse().map_err(|_| {
        UnitError(format!(
            "{s:?} is not a size; use e.g. 4GiB, 512MiB, 64KiB or bytes"
        ))
    })?;
    if !v.is_finite() || v < 0.0 || v * mult > u64::MAX as f64 {
        return Err(UnitError(format!("size {s:?} is out of range")));
    }
    Ok((v * mult).round() as u64)
}

/// A share written as a percentage or a fraction: "10%" or "0.1" -> 0.1
/// (0 < share <= 1). `what` names the setting in the error.
pub fn parse_share(what: &str, s: &str) -> Result<f64, UnitError> {
    let v = if let Some(p) = s.strip_suffix('%') {
        p.trim().parse::<f64>().map(|v| v / 100.0)
    } else {
        s.trim().parse::<f64>()
    };
    match v {
        Ok(v) if v > 0.0 && v <= 1.0 => Ok(v),
        Ok(_) => Err(UnitError(format!(
            "{what} must be above 0 and at most 100% (got {s})"
        ))),
        Err(_) => Err(UnitError(format!(
            "{what} must be a percentage like 10% or a fraction like 0.1 (got {s})"
        ))),
    }
}

/// Format bytes with a binary unit.
pub fn fmt_size(b: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", U[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn sizes() {
        assert_eq!(parse_size("4GiB").unwrap(), 4 << 30);
        assert_eq!(parse_size("512mib").unwrap(), 512 << 20);
        assert_eq!(parse_size("1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("2MB").unwrap(), 2_000_000);
        assert!(parse_size("4 parsecs").is_err());
        assert!(parse_size("").is_err());
        assert_eq!(fmt_size(3 << 29), "1.50 GiB");
        assert_eq!(parse_share("x", "10%"), Ok(0.1));
        assert_eq!(parse_share("x", "0.25"), Ok(0.25));
        assert!(parse_share("x", "150%").is_err());
        assert!(parse_share("x", "lots")
            .unwrap_err()
            .0
            .contains("percentage"));
    }
}
