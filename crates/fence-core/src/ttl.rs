//! Lease durations, validated to the contract's range of 100 ms to 24 h.

use std::{fmt, time::Duration};

/// A lease's time to live: 100 ms to 24 h.
///
/// ```
/// # use fence_core::Ttl;
/// # use std::time::Duration;
/// assert_eq!(Ttl::from_millis(30_000)?.as_duration(), Duration::from_secs(30));
/// assert!(Ttl::from_millis(99).is_err());
/// # Ok::<(), fence_core::TtlError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Ttl(Duration);

impl Ttl {
    /// The shortest lease: 100 ms.
    pub const MIN: Self = Self(Duration::from_millis(100));
    /// The longest lease: 24 h.
    pub const MAX: Self = Self(Duration::from_secs(86_400));
    /// The default when a caller names none: 30 s.
    pub const DEFAULT: Self = Self(Duration::from_secs(30));

    /// Validates a duration. Sub-millisecond parts are dropped: the wire counts milliseconds.
    ///
    /// # Errors
    /// When it is below 100 ms or above 24 h.
    pub fn new(d: Duration) -> Result<Self, TtlError> {
        Self::from_millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }

    /// Validates a number of milliseconds.
    ///
    /// # Errors
    /// When it is below 100 or above 86,400,000.
    pub fn from_millis(ms: u64) -> Result<Self, TtlError> {
        if ms < Self::MIN.as_millis() {
            Err(TtlError::TooShort { ms })
        } else if ms > Self::MAX.as_millis() {
            Err(TtlError::TooLong { ms })
        } else {
            Ok(Self(Duration::from_millis(ms)))
        }
    }

    /// The duration.
    pub const fn as_duration(self) -> Duration {
        self.0
    }

    /// Whole milliseconds.
    pub const fn as_millis(self) -> u64 {
        self.0.as_secs() * 1000 + self.0.subsec_millis() as u64
    }
}

impl Default for Ttl {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl fmt::Display for Ttl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}ms", self.as_millis())
    }
}

impl serde::Serialize for Ttl {
    /// Whole milliseconds, as the wire's `ttl_ms`.
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.as_millis())
    }
}

impl<'de> serde::Deserialize<'de> for Ttl {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let ms = u64::deserialize(d)?;
        Self::from_millis(ms).map_err(serde::de::Error::custom)
    }
}

/// A lease duration out of range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TtlError {
    /// Below 100 ms.
    #[error("ttl of {ms} ms is below the minimum of 100 ms")]
    TooShort {
        /// What was asked for.
        ms: u64,
    },
    /// Above 24 h.
    #[error("ttl of {ms} ms is above the maximum of 86400000 ms (24 h)")]
    TooLong {
        /// What was asked for.
        ms: u64,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn range_edges() {
        for (ms, ok) in [
            (0, false),
            (99, false),
            (100, true),
            (86_400_000, true),
            (86_400_001, false),
            (u64::MAX, false),
        ] {
            assert_eq!(Ttl::from_millis(ms).is_ok(), ok, "{ms}");
        }
        assert_eq!(
            Ttl::new(Duration::from_micros(99_999)),
            Err(TtlError::TooShort { ms: 99 })
        );
        assert_eq!(
            Ttl::new(Duration::MAX).unwrap_err().to_string(),
            "ttl of 18446744073709551615 ms is above the maximum of 86400000 ms (24 h)"
        );
    }
}
