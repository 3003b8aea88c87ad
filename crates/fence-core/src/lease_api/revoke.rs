//! `POST /v1/leases/{job}/revoke`'s body.

use serde::Serialize;
use serde_json::Value;

use super::{BodyError, Fields};

/// The longest `reason` a revoke may give, in characters (as JSON Schema's `maxLength`
/// counts them).
pub const MAX_REASON_LEN: usize = 512;

/// `POST /v1/leases/{job}/revoke`: an operator ends the current lease at once.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct RevokeRequest {
    /// Why, for the server's log (at most [`MAX_REASON_LEN`] characters, no control
    /// characters).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl RevokeRequest {
    /// Parses a request body, strictly; an empty body is a revoke without a reason.
    ///
    /// # Errors
    /// When it is not a JSON object with at most a valid `reason`.
    pub fn from_json(bytes: &[u8]) -> Result<Self, BodyError> {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(Self::default());
        }
        let f = Fields::parse(bytes, &["reason"])?;
        let reason = match f.0.get("reason") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if s.chars().count() > MAX_REASON_LEN => {
                return Err(BodyError::new(
                    "reason",
                    format!("longer than {MAX_REASON_LEN} characters"),
                ));
            }
            Some(Value::String(s)) if s.chars().any(char::is_control) => {
                return Err(BodyError::new("reason", "must not hold control characters"));
            }
            Some(Value::String(s)) => Some(s.clone()),
            Some(_) => return Err(BodyError::new("reason", "must be a string")),
        };
        Ok(Self { reason })
    }
}
