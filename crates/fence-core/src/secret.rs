//! Lease keys and secret hashes: secrets that are compared in constant time and never shown.
//!
//! A [`LeaseKey`] is made by the worker for each claim and proves, on renew, release and
//! complete, that the caller is the holder: owner and generation alone are public. Servers
//! keep only its [`SecretHash`]. Neither type prints its value: `Debug` says `<redacted>`.
//!
//! ```
//! use fence_core::secret::{LeaseKey, SecretHash};
//!
//! let key = LeaseKey::from_random(&[7; 32]);
//! assert_eq!(key.expose().len(), 43);
//! assert_eq!(format!("{key:?}"), "LeaseKey(<redacted>)");
//! assert_eq!(key.hash(), SecretHash::of(key.expose().as_bytes()));
//! assert!("too-short".parse::<LeaseKey>().is_err());
//! ```

use std::{fmt, str::FromStr};

use base64::{Engine, engine::general_purpose::URL_SAFE_NO_PAD};
use serde::{Serialize, Serializer};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// The SHA-256 of a secret. Equality is decided in constant time.
#[derive(Clone, Copy)]
pub struct SecretHash([u8; 32]);

impl SecretHash {
    /// The hash of `secret`.
    pub fn of(secret: &[u8]) -> Self {
        Self(Sha256::digest(secret).into())
    }

    /// A hash as stored.
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The hash's bytes, to store.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl PartialEq for SecretHash {
    fn eq(&self, other: &Self) -> bool {
        self.0.ct_eq(&other.0).into()
    }
}

impl Eq for SecretHash {}

impl fmt::Debug for SecretHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SecretHash(<redacted>)")
    }
}

/// A lease key: 22 to 128 base64url characters (`A-Z a-z 0-9 - _`), at least 128 random bits
/// when made by [`from_random`](Self::from_random).
#[derive(Clone, PartialEq, Eq)]
pub struct LeaseKey(Box<str>);

/// Why a lease key was refused. It never repeats the key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LeaseKeyError {
    /// Fewer than 22 or more than 128 characters.
    #[error("must be 22 to 128 base64url characters, got {len}")]
    Length {
        /// How many characters it had.
        len: usize,
    },
    /// A character outside `A-Z a-z 0-9 - _`.
    #[error("must be base64url (A-Z a-z 0-9 - _); character {at} is not")]
    Character {
        /// Its offset.
        at: usize,
    },
}

impl LeaseKey {
    /// The shortest key: 22 characters, 132 bits of base64url.
    pub const MIN_LEN: usize = 22;
    /// The longest key.
    pub const MAX_LEN: usize = 128;

    /// Checks a key as received.
    ///
    /// # Errors
    /// When it is not 22 to 128 base64url characters.
    pub fn new(key: &str) -> Result<Self, LeaseKeyError> {
        if !(Self::MIN_LEN..=Self::MAX_LEN).contains(&key.len()) {
            return Err(LeaseKeyError::Length {
                len: key.chars().count(),
            });
        }
        if let Some(at) = key
            .bytes()
            .position(|b| !(b.is_ascii_alphanumeric() || b == b'-' || b == b'_'))
        {
            return Err(LeaseKeyError::Character { at });
        }
        Ok(Self(key.into()))
    }

    /// The key of 32 random bytes (the caller draws them from the OS): 43 characters.
    pub fn from_random(bytes: &[u8; 32]) -> Self {
        Self(URL_SAFE_NO_PAD.encode(bytes).into_boxed_str())
    }

    /// The key itself, to send to the server. Never log it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// What a server keeps of it.
    pub fn hash(&self) -> SecretHash {
        SecretHash::of(self.0.as_bytes())
    }
}

impl FromStr for LeaseKey {
    type Err = LeaseKeyError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

impl fmt::Debug for LeaseKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LeaseKey(<redacted>)")
    }
}

impl Serialize for LeaseKey {
    /// As the string the server expects in a request body.
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_checked_without_repeating_them() {
        let ok = "A".repeat(22);
        assert!(LeaseKey::new(&ok).is_ok());
        assert!(LeaseKey::new(&"a-_9".repeat(32)).is_ok(), "128 characters");
        for (bad, want) in [
            ("", "got 0"),
            (&"a".repeat(21)[..], "got 21"),
            (&"a".repeat(129)[..], "got 129"),
            ("aaaaaaaaaaaaaaaaaaaaa=", "character 21"),
            ("aaaaaaaaaaaaaaaaaaaa+/", "character 20"),
            ("secretsecretsecret sec", "character 18"),
        ] {
            let e = LeaseKey::new(bad).unwrap_err().to_string();
            assert!(e.contains(want), "{bad:?}: {e}");
            assert!(
                bad.is_empty() || !e.contains(bad),
                "the error repeats the key: {e}"
            );
        }
    }

    #[test]
    fn hashes_compare_and_nothing_prints() {
        let a = LeaseKey::from_random(&[1; 32]);
        let b = LeaseKey::from_random(&[2; 32]);
        assert_ne!(a, b);
        assert_eq!(a.hash(), a.clone().hash());
        assert_ne!(a.hash(), b.hash());
        assert!(!format!("{a:?} {:?}", a.hash()).contains(a.expose()));
        assert_eq!(
            serde_json::to_string(&a).unwrap(),
            format!("\"{}\"", a.expose())
        );
    }
}
