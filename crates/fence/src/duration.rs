//! Durations on the command line: `500ms`, `10s`, `1.5s`, `1m30s`, `2h`, `7d`.

use std::time::Duration;

/// Parses a command-line duration in humantime's syntax (`500ms`, `10s`, `1.5s`, `1m30s`,
/// `2h`, `7d`). A unit is required: `--ttl 30` could mean seconds or milliseconds to a
/// reader, so it is refused with the fix in the message; so is a negative duration.
///
/// # Errors
/// A message naming what is wrong, for clap to print.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if let Some(rest) = s.strip_prefix('-') {
        return Err(format!(
            "{s:?}: a duration cannot be negative; write how long, like {}",
            if rest.is_empty() { "5s" } else { rest }
        ));
    }
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return Err(format!(
            "{s:?} has no unit; write {s}s for seconds or {s}ms for milliseconds (units: ms, s, m, h, d, w, months, y)"
        ));
    }
    let d = humantime::parse_duration(s).map_err(|e| {
        format!("{s:?} is not a duration ({e}); write it like 500ms, 1.5s, 2m or 1h30m")
    })?;
    // Every duration is added to a clock reading somewhere: past this, the sum would not fit
    // one, and no wait, grace or retention is meant to outlast it.
    if d > MAX_DURATION {
        return Err(format!(
            "{s:?} is longer than any flag takes (at most 100 years)"
        ));
    }
    Ok(d)
}

/// The longest duration any flag takes: 100 years (humantime's, of 365.25 days).
const MAX_DURATION: Duration = Duration::from_secs(100 * 31_557_600);

/// A timeout flag: a duration from 1 ms to 24 h. Zero would mean "never wait" to some
/// readers and "wait forever" to others; neither is what a deadline is for.
///
/// # Errors
/// As [`parse_duration`], and for a value outside 1 ms to 24 h.
pub fn parse_timeout(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d < Duration::from_millis(1) || d > Duration::from_secs(24 * 3600) {
        return Err(format!(
            "{s:?}: a timeout must be from 1ms to 24h (a deadline on every wait)"
        ));
    }
    Ok(d)
}

/// `fence run --max-duration`: 1 s to 365 days. Longer is no limit at all, and a limit
/// shorter than a second would stop a command before it could do anything.
///
/// # Errors
/// As [`parse_duration`], and for a value outside 1 s to 365 d.
pub fn parse_max_duration(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d < Duration::from_secs(1) || d > Duration::from_secs(365 * 86_400) {
        return Err(format!("{s:?}: --max-duration must be from 1s to 365d"));
    }
    Ok(d)
}

/// A `--forget-after` duration: 1 s to 10 years.
///
/// # Errors
/// As [`parse_duration`], and outside that range.
pub fn parse_forget_after(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    // Ten of humantime's years (365.25 days), so that `10y` itself is taken.
    if d < Duration::from_secs(1) || d > Duration::from_secs(10 * 31_557_600) {
        return Err(format!("{s:?}: --forget-after must be from 1s to 10 years"));
    }
    Ok(d)
}

/// `--lock-delay`: 0 to 24 h (the longest lease).
///
/// # Errors
/// As [`parse_duration`], and outside that range.
pub fn parse_lock_delay(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d > fence_core::Ttl::MAX.as_duration() {
        return Err(format!("{s:?}: --lock-delay must be from 0s to 24h"));
    }
    Ok(d)
}

/// `--progress-within`: 10 ms to 24 h.
///
/// # Errors
/// As [`parse_duration`], and outside that range.
pub fn parse_progress_within(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d < Duration::from_millis(10) || d > Duration::from_secs(86_400) {
        return Err(format!("{s:?}: --progress-within must be from 10ms to 24h"));
    }
    Ok(d)
}

/// `--max-claim-wait`: 1 ms to 60 s, the most the protocol lets a claim ask.
///
/// # Errors
/// As [`parse_duration`], and outside that range.
pub fn parse_claim_wait(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d < Duration::from_millis(1) || d > Duration::from_secs(60) {
        return Err(format!("{s:?}: --max-claim-wait must be from 1ms to 60s"));
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bound the message names is the one taken: `10y` (humantime's years) is in it.
    #[test]
    fn forget_after_takes_ten_years_as_written() {
        assert_eq!(
            parse_forget_after("10y"),
            Ok(Duration::from_secs(10 * 31_557_600))
        );
        assert!(parse_forget_after("3652d").is_ok());
        assert!(parse_forget_after("3653d").is_err());
        assert!(parse_forget_after("999ms").is_err());
    }

    /// `fence run --wait 300000000000y` panicked adding the wait to the clock.
    #[test]
    fn absurdly_long_durations_are_refused_not_added_to_a_clock() {
        assert!(parse_duration("300000000000y").is_err());
        assert!(parse_duration("101y").is_err());
        assert_eq!(parse_duration("100y"), Ok(MAX_DURATION));
        for ok in ["1ms", "365d", "50y"] {
            let d = parse_duration(ok).unwrap();
            assert!(tokio::time::Instant::now().checked_add(d).is_some(), "{ok}");
        }
    }

    #[test]
    fn timeouts_are_never_zero_or_unbounded() {
        assert_eq!(parse_timeout("1ms"), Ok(Duration::from_millis(1)));
        assert_eq!(parse_timeout("24h"), Ok(Duration::from_secs(86_400)));
        for bad in ["0", "0s", "500us", "25h", "ten", ""] {
            assert!(parse_timeout(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn units_fractions_compounds_and_errors() {
        let ms = Duration::from_millis;
        for (text, want) in [
            ("500ms", ms(500)),
            ("10s", ms(10_000)),
            ("1.5s", ms(1_500)),
            ("2m", ms(120_000)),
            ("1m30s", ms(90_000)),
            ("1h", ms(3_600_000)),
            ("7d", ms(7 * 86_400_000)),
        ] {
            assert_eq!(parse_duration(text), Ok(want), "{text}");
        }
        for bad in [
            "",
            "ms",
            "-1s",
            "10 parsecs",
            "3x",
            "99999999999999999999s",
            "99999999999999999999",
            "30",
            "0.5",
            "-5s",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
        let unitless = parse_duration("30").unwrap_err();
        assert!(
            unitless.contains("30s") && unitless.contains("30ms"),
            "{unitless}"
        );
        let negative = parse_duration("-5s").unwrap_err();
        assert!(negative.contains("cannot be negative"), "{negative}");
    }
}
