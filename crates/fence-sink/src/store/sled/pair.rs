//! Two durations in 16 bytes, as a sled store's records for the processes after keep them.

use std::time::Duration;

use crate::store::{clamped, ms};

/// `a` then `b`, ms, 8 bytes big-endian each, each capped at the layer's longest setting
/// (100 years), so that what is read back above it is damage.
pub(super) fn encode(a: Duration, b: Duration) -> [u8; 16] {
    let mut v = [0u8; 16];
    v[..8].copy_from_slice(&ms(clamped(a)).to_be_bytes());
    v[8..].copy_from_slice(&ms(clamped(b)).to_be_bytes());
    v
}

/// The two durations of the first 16 bytes (a newer build may append more); `None` when
/// shorter, or one above the cap.
pub(super) fn decode(v: &[u8]) -> Option<(Duration, Duration)> {
    let (a, rest) = v.split_first_chunk::<8>()?;
    let (b, _) = rest.split_first_chunk::<8>()?;
    let cap = ms(clamped(Duration::MAX));
    let millis = |b: [u8; 8]| {
        let m = u64::from_be_bytes(b);
        (m <= cap).then(|| Duration::from_millis(m))
    };
    Some((millis(*a)?, millis(*b)?))
}
