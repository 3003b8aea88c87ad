//! Job ids and owners: 1 to 256 bytes of visible ASCII (`docs/protocol.md` section 1).

use std::{borrow::Borrow, fmt, str::FromStr};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The longest job id or owner, in bytes.
pub const MAX_ID_LEN: usize = 256;

/// Why a job id or owner was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ParseIdError {
    /// The value was empty.
    Empty {
        /// `"job id"` or `"owner"`.
        what: &'static str,
    },
    /// The value was longer than 256 bytes.
    TooLong {
        /// `"job id"` or `"owner"`.
        what: &'static str,
        /// Its length in bytes.
        len: usize,
    },
    /// The value held a byte outside visible ASCII (0x21 to 0x7E).
    InvalidByte {
        /// `"job id"` or `"owner"`.
        what: &'static str,
        /// The offending byte.
        byte: u8,
        /// Its offset.
        at: usize,
    },
}

impl fmt::Display for ParseIdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Empty { what } => write!(
                f,
                "{what} is empty; it must be 1 to 256 bytes of visible ASCII"
            ),
            Self::TooLong { what, len } => {
                write!(
                    f,
                    "{what} is {len} bytes long; at most {MAX_ID_LEN} are allowed"
                )
            }
            Self::InvalidByte { what, byte, at } => write!(
                f,
                "{what} has byte 0x{byte:02X} at offset {at}; only visible ASCII (0x21 to 0x7E) is allowed"
            ),
        }
    }
}

impl std::error::Error for ParseIdError {}

fn validate(what: &'static str, bytes: &[u8]) -> Result<(), ParseIdError> {
    if bytes.is_empty() {
        return Err(ParseIdError::Empty { what });
    }
    if bytes.len() > MAX_ID_LEN {
        return Err(ParseIdError::TooLong {
            what,
            len: bytes.len(),
        });
    }
    match bytes.iter().position(|b| !(0x21..=0x7E).contains(b)) {
        Some(at) => Err(ParseIdError::InvalidByte {
            what,
            byte: bytes[at],
            at,
        }),
        None => Ok(()),
    }
}

macro_rules! visible_ascii_id {
    ($(#[$meta:meta])* $name:ident, $what:literal) => {
        $(#[$meta])*
        #[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(Box<str>);

        impl $name {
            /// Validates `value`.
            ///
            /// # Errors
            /// When it is empty, longer than 256 bytes, or holds anything but visible ASCII.
            pub fn new(value: impl Into<String>) -> Result<Self, ParseIdError> {
                let value = value.into();
                validate($what, value.as_bytes())?;
                Ok(Self(value.into_boxed_str()))
            }

            /// Validates raw bytes, for instance a header value.
            ///
            /// # Errors
            /// As [`Self::new`].
            pub fn from_bytes(bytes: &[u8]) -> Result<Self, ParseIdError> {
                validate($what, bytes)?;
                // Visible ASCII is valid UTF-8.
                let s = std::str::from_utf8(bytes).expect("visible ASCII is UTF-8");
                Ok(Self(s.into()))
            }

            /// The value as a string slice.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl FromStr for $name {
            type Err = ParseIdError;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Self::new(s)
            }
        }

        impl TryFrom<String> for $name {
            type Error = ParseIdError;
            fn try_from(s: String) -> Result<Self, Self::Error> {
                Self::new(s)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&*self.0, f)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(&self.0)
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                Self::new(s).map_err(serde::de::Error::custom)
            }
        }
    };
}

visible_ascii_id!(
    /// A job id: 1 to 256 bytes of visible ASCII (0x21 to 0x7E).
    ///
    /// ```
    /// # use fence_core::JobId;
    /// assert!("invoice-42".parse::<JobId>().is_ok());
    /// assert!("has space".parse::<JobId>().is_err());
    /// ```
    JobId,
    "job id"
);

visible_ascii_id!(
    /// The name a worker claims under: 1 to 256 bytes of visible ASCII, unique per
    /// process incarnation.
    Owner,
    "owner"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_id_edges() {
        let long = "a".repeat(256);
        let too_long = "a".repeat(257);
        let cases: &[(&str, Result<(), &str>)] = &[
            ("", Err("job id is empty")),
            ("a", Ok(())),
            ("0", Ok(())),
            ("!", Ok(())),
            ("~", Ok(())),
            (&long, Ok(())),
            (&too_long, Err("257 bytes long")),
            ("has space", Err("byte 0x20 at offset 3")),
            (" lead", Err("byte 0x20 at offset 0")),
            ("tab\t", Err("byte 0x09")),
            ("del\x7f", Err("byte 0x7F")),
            ("ünï", Err("byte 0xC3 at offset 0")),
            ("nul\0", Err("byte 0x00")),
            ("new\nline", Err("byte 0x0A")),
        ];
        for (input, want) in cases {
            let got = JobId::new(*input);
            match (want, got) {
                (Ok(()), Ok(id)) => assert_eq!(id.as_str(), *input),
                (Err(msg), Err(e)) => {
                    assert!(e.to_string().contains(msg), "{input:?}: {e} lacks {msg:?}")
                }
                (want, got) => panic!("{input:?}: want {want:?}, got {got:?}"),
            }
        }
    }

    #[test]
    fn owner_uses_its_own_name_in_errors() {
        let e = Owner::new("").unwrap_err();
        assert_eq!(
            e.to_string(),
            "owner is empty; it must be 1 to 256 bytes of visible ASCII"
        );
        assert!(Owner::from_bytes(&[0xff]).is_err());
        assert_eq!(Owner::from_bytes(b"w-1").unwrap().as_str(), "w-1");
    }

    #[test]
    fn serde_validates() {
        let ok: JobId = serde_json::from_str("\"j\"").unwrap();
        assert_eq!(ok.as_str(), "j");
        assert!(serde_json::from_str::<JobId>("\"\"").is_err());
        assert!(serde_json::from_str::<Owner>("\"a b\"").is_err());
        assert_eq!(serde_json::to_string(&ok).unwrap(), "\"j\"");
    }
}
