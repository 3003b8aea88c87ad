//! A bearer secret for a lease server with an auth file, kept out of every printout.

use std::fmt;

/// A bearer secret for `Authorization: Bearer`; never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct BearerToken(Box<str>);

impl BearerToken {
    /// A token: 16 to 256 visible ASCII characters (surrounding white space, such as the
    /// newline at the end of a file, is trimmed).
    ///
    /// # Errors
    /// When it is shorter, longer, or holds anything else; the error never repeats it.
    pub fn new(token: impl AsRef<str>) -> Result<Self, TokenError> {
        let token = token.as_ref().trim();
        if !(16..=256).contains(&token.len()) {
            return Err(TokenError::Length(token.len()));
        }
        if !token.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
            return Err(TokenError::Character);
        }
        Ok(Self(token.into()))
    }

    /// The token itself. Never log it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for BearerToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("BearerToken(<redacted>)")
    }
}

/// Why a bearer token was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TokenError {
    /// Fewer than 16 or more than 256 characters.
    #[error("a bearer token must be 16 to 256 characters, this one has {0}")]
    Length(usize),
    /// A character outside visible ASCII.
    #[error("a bearer token must be visible ASCII (no spaces)")]
    Character,
}
