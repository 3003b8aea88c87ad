//! Generations and fencing tokens (`docs/protocol.md` section 1).

use std::{fmt, num::NonZeroU64, str::FromStr};

use serde::{Deserialize, Serialize};

/// How many times a job has been claimed. A job never claimed has generation 0; every
/// successful claim adds exactly 1; a generation never decreases.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Generation(u64);

impl Generation {
    /// The generation of a job that was never claimed.
    pub const ZERO: Self = Self(0);

    /// The last generation, 2^64-1: a job there cannot be claimed again by anyone but its
    /// holder retrying, and stores never forget it (its floor would start every job there).
    pub const LAST: Self = Self(u64::MAX);

    /// Wraps a raw value.
    pub const fn new(value: u64) -> Self {
        Self(value)
    }

    /// The raw value.
    pub const fn get(self) -> u64 {
        self.0
    }

    /// The generation the next claim gets, or `None` when the counter is exhausted at 2^64-1.
    pub const fn next(self) -> Option<Self> {
        match self.0.checked_add(1) {
            Some(v) => Some(Self(v)),
            None => None,
        }
    }

    /// The fencing token of this generation, or `None` for generation 0 (never claimed).
    pub const fn token(self) -> Option<FencingToken> {
        match NonZeroU64::new(self.0) {
            Some(v) => Some(FencingToken(v)),
            None => None,
        }
    }
}

impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl From<FencingToken> for Generation {
    fn from(t: FencingToken) -> Self {
        Self(t.0.get())
    }
}

/// A generation as a lease holder sends it: decimal ASCII, 1 to 20 digits, no sign, no
/// leading zeros, value 1 to 2^64-1.
///
/// ```
/// # use fence_core::FencingToken;
/// assert_eq!("18446744073709551615".parse::<FencingToken>().unwrap().get(), u64::MAX);
/// for bad in ["", "0", "01", "+1", "-1", " 1", "18446744073709551616"] {
///     assert!(bad.parse::<FencingToken>().is_err(), "{bad:?}");
/// }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(NonZeroU64);

impl FencingToken {
    /// Wraps a raw value; `None` for 0.
    pub const fn new(value: u64) -> Option<Self> {
        Generation(value).token()
    }

    /// The raw value.
    pub const fn get(self) -> u64 {
        self.0.get()
    }

    /// The generation this token names.
    pub const fn generation(self) -> Generation {
        Generation(self.0.get())
    }

    /// Parses the wire syntax from raw bytes (a header value).
    ///
    /// # Errors
    /// When the bytes are not 1 to 20 decimal digits without sign or leading zero, or the
    /// value is 0 or above 2^64-1.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, ParseTokenError> {
        if bytes.is_empty() {
            return Err(ParseTokenError::Empty);
        }
        if let Some(at) = bytes.iter().position(|b| !b.is_ascii_digit()) {
            return Err(ParseTokenError::NotADigit {
                byte: bytes[at],
                at,
            });
        }
        if bytes.len() > 20 {
            return Err(ParseTokenError::TooLong { len: bytes.len() });
        }
        if bytes[0] == b'0' {
            return Err(if bytes.len() == 1 {
                ParseTokenError::Zero
            } else {
                ParseTokenError::LeadingZero
            });
        }
        let mut value: u64 = 0;
        for &b in bytes {
            value = value
                .checked_mul(10)
                .and_then(|v| v.checked_add(u64::from(b - b'0')))
                .ok_or(ParseTokenError::Overflow)?;
        }
        Self::new(value).ok_or(ParseTokenError::Zero)
    }
}

impl FromStr for FencingToken {
    type Err = ParseTokenError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::from_bytes(s.as_bytes())
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl Serialize for FencingToken {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.get())
    }
}

impl<'de> Deserialize<'de> for FencingToken {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = u64::deserialize(d)?;
        Self::new(v).ok_or_else(|| serde::de::Error::custom("a fencing token is at least 1"))
    }
}

/// Why a fencing token was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ParseTokenError {
    /// No digits at all.
    Empty,
    /// A byte that is not a decimal digit (signs and spaces included).
    NotADigit {
        /// The offending byte.
        byte: u8,
        /// Its offset.
        at: usize,
    },
    /// More than 20 digits.
    TooLong {
        /// How many digits there were.
        len: usize,
    },
    /// A leading zero.
    LeadingZero,
    /// The token 0, which no claim ever hands out.
    Zero,
    /// A value above 2^64-1.
    Overflow,
}

impl fmt::Display for ParseTokenError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Empty => f.write_str("fencing token is empty"),
            Self::NotADigit { byte, at } => write!(
                f,
                "fencing token has byte 0x{byte:02X} at offset {at}; only the digits 0-9 are allowed (no sign, no spaces)"
            ),
            Self::TooLong { len } => {
                write!(f, "fencing token has {len} digits; at most 20 are allowed")
            }
            Self::LeadingZero => f.write_str("fencing token has a leading zero"),
            Self::Zero => f.write_str("fencing token is 0; tokens start at 1"),
            Self::Overflow => f.write_str("fencing token is above 18446744073709551615 (2^64-1)"),
        }
    }
}

impl std::error::Error for ParseTokenError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_edges() {
        use ParseTokenError::*;
        let cases: &[(&str, Result<u64, ParseTokenError>)] = &[
            ("", Err(Empty)),
            ("0", Err(Zero)),
            ("00", Err(LeadingZero)),
            ("01", Err(LeadingZero)),
            ("1", Ok(1)),
            ("7", Ok(7)),
            ("+1", Err(NotADigit { byte: b'+', at: 0 })),
            ("-1", Err(NotADigit { byte: b'-', at: 0 })),
            (" 1", Err(NotADigit { byte: b' ', at: 0 })),
            ("1 ", Err(NotADigit { byte: b' ', at: 1 })),
            ("1.0", Err(NotADigit { byte: b'.', at: 1 })),
            ("0x10", Err(NotADigit { byte: b'x', at: 1 })),
            ("١", Err(NotADigit { byte: 0xD9, at: 0 })),
            ("18446744073709551615", Ok(u64::MAX)),
            ("18446744073709551616", Err(Overflow)),
            ("99999999999999999999", Err(Overflow)),
            ("100000000000000000000", Err(TooLong { len: 21 })),
            ("000000000000000000001", Err(TooLong { len: 21 })),
        ];
        for (input, want) in cases {
            let got = input.parse::<FencingToken>().map(FencingToken::get);
            assert_eq!(&got, want, "input {input:?}");
            if let Ok(v) = got {
                assert_eq!(
                    FencingToken::new(v).unwrap().to_string(),
                    *input,
                    "round trip"
                );
            }
        }
    }

    #[test]
    fn errors_read_well() {
        assert_eq!(
            "-1".parse::<FencingToken>().unwrap_err().to_string(),
            "fencing token has byte 0x2D at offset 0; only the digits 0-9 are allowed (no sign, no spaces)"
        );
    }

    #[test]
    fn generation_arithmetic() {
        assert_eq!(Generation::ZERO.token(), None);
        assert_eq!(Generation::ZERO.next(), Some(Generation::new(1)));
        assert_eq!(Generation::new(u64::MAX).next(), None);
        assert_eq!(
            Generation::new(8).token().unwrap().generation(),
            Generation::new(8)
        );
        assert!(Generation::new(7) < Generation::new(8));
    }

    #[test]
    fn token_json_is_an_integer() {
        let t = FencingToken::new(u64::MAX).unwrap();
        assert_eq!(serde_json::to_string(&t).unwrap(), "18446744073709551615");
        assert_eq!(
            serde_json::from_str::<FencingToken>("18446744073709551615").unwrap(),
            t
        );
        assert!(serde_json::from_str::<FencingToken>("0").is_err());
        assert!(serde_json::from_str::<FencingToken>("-1").is_err());
    }
}
