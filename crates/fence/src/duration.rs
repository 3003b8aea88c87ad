//! Durations on the command line: `500ms`, `10s`, `2m`, `1h` (a bare number is seconds).

use std::time::Duration;

/// Parses `500ms`, `10s`, `2m`, `1h` or a bare number of seconds.
///
/// # Errors
/// A message naming what is wrong, for clap to print.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = s.split_at(split);
    if digits.is_empty() {
        return Err(format!(
            "{s:?} is not a duration; write it like 500ms, 10s, 2m or 1h"
        ));
    }
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{s:?}: the number is too large"))?;
    let unit_ms: u64 = match unit {
        "ms" => 1,
        "" | "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        other => return Err(format!("{s:?}: unknown unit {other:?}; use ms, s, m or h")),
    };
    n.checked_mul(unit_ms)
        .map(Duration::from_millis)
        .ok_or_else(|| format!("{s:?}: the duration is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_and_errors() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("7"), Ok(Duration::from_secs(7)));
        for bad in [
            "",
            "ms",
            "-1s",
            "1.5s",
            "10 s",
            "3d",
            "99999999999999999999s",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }
}
