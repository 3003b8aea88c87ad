//! The `wait` of a claim (`POST /v1/leases/{job}/claim?wait=D`): its exact grammar.

/// The longest a claim may wait (`?wait=`), in milliseconds.
pub const MAX_WAIT_MS: u64 = 60_000;

/// The `wait` of a claim, exactly as the server accepts it: whole milliseconds with `ms`
/// (0 to 60000), or whole seconds with `s` or no unit (0 to 60), no leading zeros, nothing
/// else. `docs/openapi.json` carries the same pattern.
pub const WAIT_PATTERN: &str =
    "^((0|[1-9][0-9]{0,3}|[1-5][0-9]{4}|60000)ms|(0|[1-9]|[1-5][0-9]|60)s?)$";

/// Parses the `wait` of a claim ([`WAIT_PATTERN`]).
///
/// # Errors
/// A message naming the value and the syntax, or the limit it is above.
pub fn parse_wait(value: &str) -> Result<std::time::Duration, String> {
    let (digits, unit_ms) = if let Some(d) = value.strip_suffix("ms") {
        (d, 1)
    } else if let Some(d) = value.strip_suffix('s') {
        (d, 1_000)
    } else {
        (value, 1_000)
    };
    let canonical = !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
        && !(digits.len() > 1 && digits.starts_with('0'));
    if !canonical {
        return Err(format!(
            "{value:?} is not a wait: write whole milliseconds or seconds without leading zeros, like 500ms, 10s or 10 (seconds)"
        ));
    }
    let ms = digits
        .parse::<u64>()
        .map_or(u64::MAX, |n| n.saturating_mul(unit_ms));
    if ms > MAX_WAIT_MS {
        return Err(format!(
            "{value} is longer than the most a claim may wait, 60s"
        ));
    }
    Ok(std::time::Duration::from_millis(ms))
}
