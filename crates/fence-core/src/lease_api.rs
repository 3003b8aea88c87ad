//! The lease server's HTTP API as types: paths, request and answer bodies, lease states.
//!
//! Servers parse request bodies with [`ClaimRequest::from_json`] and friends, which refuse
//! anything but the contract's fields and name the field that is wrong; clients serialise the
//! same types with serde, so both ends agree on every field by construction.
//!
//! ```
//! use fence_core::{Ttl, lease_api::{Action, ClaimRequest, lease_path}};
//!
//! let job = "invoice-42".parse()?;
//! assert_eq!(lease_path(&job, Some(Action::Claim)), "/v1/leases/invoice-42/claim");
//! let body = ClaimRequest { owner: "worker-a".parse()?, ttl: Ttl::from_millis(10_000)? };
//! let json = serde_json::to_vec(&body)?;
//! assert_eq!(ClaimRequest::from_json(&json)?, body);
//! let err = ClaimRequest::from_json(br#"{"owner": "w", "ttl_ms": 99}"#).unwrap_err();
//! assert_eq!(err.to_string(), "ttl_ms: ttl of 99 ms is below the minimum of 100 ms");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::{Generation, JobId, Owner, Ttl};

/// The largest request body a lease server reads, in bytes.
pub const MAX_REQUEST_BODY: usize = 16 * 1024;

/// An operation on a held lease, and the last segment of its path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// `POST /v1/leases/{job}/claim`.
    Claim,
    /// `POST /v1/leases/{job}/renew`.
    Renew,
    /// `POST /v1/leases/{job}/release`.
    Release,
    /// `POST /v1/leases/{job}/complete`.
    Complete,
}

impl Action {
    /// The action a path segment names.
    pub fn parse(segment: &str) -> Option<Self> {
        match segment {
            "claim" => Some(Self::Claim),
            "renew" => Some(Self::Renew),
            "release" => Some(Self::Release),
            "complete" => Some(Self::Complete),
            _ => None,
        }
    }

    /// The path segment: `claim`, `renew`, `release` or `complete`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Claim => "claim",
            Self::Renew => "renew",
            Self::Release => "release",
            Self::Complete => "complete",
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The path of a lease operation, `/v1/leases/{job}` plus `/claim`, `/renew`, `/release` or
/// `/complete` (none for the job's record), with the job id percent-encoded.
pub fn lease_path(job: &JobId, action: Option<Action>) -> String {
    let mut path = String::from("/v1/leases/");
    for b in job.as_str().bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            path.push(char::from(b));
        } else {
            path.push_str(&format!("%{b:02X}"));
        }
    }
    if let Some(action) = action {
        path.push('/');
        path.push_str(action.as_str());
    }
    path
}

/// A request body the server refuses: `field: what is wrong`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct BodyError {
    /// The field, or `body` for the body as a whole.
    pub field: String,
    /// What is wrong with it.
    pub reason: String,
}

impl BodyError {
    fn new(field: impl Into<String>, reason: impl fmt::Display) -> Self {
        Self {
            field: field.into(),
            reason: reason.to_string(),
        }
    }
}

/// A JSON object holding only the fields a request may have.
struct Fields(Map<String, Value>);

impl Fields {
    fn parse(bytes: &[u8], allowed: &[&str]) -> Result<Self, BodyError> {
        let value: Value = serde_json::from_slice(bytes)
            .map_err(|e| BodyError::new("body", format!("not valid JSON: {e}")))?;
        let Value::Object(map) = value else {
            return Err(BodyError::new("body", "must be a JSON object"));
        };
        if let Some(unknown) = map.keys().find(|k| !allowed.contains(&k.as_str())) {
            return Err(BodyError::new(
                unknown.as_str(),
                format!("unknown field; allowed: {}", allowed.join(", ")),
            ));
        }
        Ok(Self(map))
    }

    fn owner(&self) -> Result<Owner, BodyError> {
        match self.0.get("owner") {
            None => Err(BodyError::new("owner", "missing")),
            Some(Value::String(s)) => {
                Owner::new(s.as_str()).map_err(|e| BodyError::new("owner", e))
            }
            Some(_) => Err(BodyError::new("owner", "must be a string")),
        }
    }

    fn u64(&self, field: &str) -> Result<Option<u64>, BodyError> {
        match self.0.get(field) {
            None => Ok(None),
            Some(Value::Number(n)) => n.as_u64().map(Some).ok_or_else(|| {
                BodyError::new(
                    field,
                    format!("must be an integer from 0 to 18446744073709551615, got {n}"),
                )
            }),
            Some(_) => Err(BodyError::new(field, "must be an integer")),
        }
    }

    fn generation(&self) -> Result<Generation, BodyError> {
        self.u64("generation")?
            .map(Generation::new)
            .ok_or_else(|| BodyError::new("generation", "missing"))
    }

    fn ttl(&self) -> Result<Ttl, BodyError> {
        match self.u64("ttl_ms")? {
            None => Ok(Ttl::DEFAULT),
            Some(ms) => Ttl::from_millis(ms).map_err(|e| BodyError::new("ttl_ms", e)),
        }
    }
}

/// `POST /v1/leases/{job}/claim`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ClaimRequest {
    /// Who claims.
    pub owner: Owner,
    /// How long the lease should last (`ttl_ms`; 30 s when left out).
    #[serde(rename = "ttl_ms")]
    pub ttl: Ttl,
}

impl ClaimRequest {
    /// Parses a request body, strictly.
    ///
    /// # Errors
    /// When it is not a JSON object of exactly these fields with valid values.
    pub fn from_json(bytes: &[u8]) -> Result<Self, BodyError> {
        let f = Fields::parse(bytes, &["owner", "ttl_ms"])?;
        Ok(Self {
            owner: f.owner()?,
            ttl: f.ttl()?,
        })
    }
}

/// `POST /v1/leases/{job}/renew`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RenewRequest {
    /// The holder.
    pub owner: Owner,
    /// The generation it holds.
    pub generation: Generation,
    /// How long the lease should last from now (`ttl_ms`; 30 s when left out).
    #[serde(rename = "ttl_ms")]
    pub ttl: Ttl,
}

impl RenewRequest {
    /// Parses a request body, strictly.
    ///
    /// # Errors
    /// When it is not a JSON object of exactly these fields with valid values.
    pub fn from_json(bytes: &[u8]) -> Result<Self, BodyError> {
        let f = Fields::parse(bytes, &["owner", "generation", "ttl_ms"])?;
        Ok(Self {
            owner: f.owner()?,
            generation: f.generation()?,
            ttl: f.ttl()?,
        })
    }
}

/// `POST /v1/leases/{job}/release` and `/complete`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FinishRequest {
    /// The holder.
    pub owner: Owner,
    /// The generation it holds.
    pub generation: Generation,
}

impl FinishRequest {
    /// Parses a request body, strictly.
    ///
    /// # Errors
    /// When it is not a JSON object of exactly these fields with valid values.
    pub fn from_json(bytes: &[u8]) -> Result<Self, BodyError> {
        let f = Fields::parse(bytes, &["owner", "generation"])?;
        Ok(Self {
            owner: f.owner()?,
            generation: f.generation()?,
        })
    }
}

/// A granted lease: the answer to a successful claim or renewal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseBody {
    /// The job.
    pub job: JobId,
    /// The holder.
    pub owner: Owner,
    /// The generation: the fencing token.
    pub generation: Generation,
    /// The duration granted.
    pub ttl_ms: u64,
    /// When it expires on the server's clock, in ms since the Unix epoch.
    pub expires_at_ms: u64,
    /// The signed token string, when the server signs tokens (contract section 6).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

/// The state of a job's lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum LeaseState {
    /// Never claimed, or released: nobody holds it.
    Free,
    /// An unexpired lease.
    Held,
    /// The lease ran out and nobody has claimed since.
    Expired,
    /// Completed; it can never be claimed again.
    Completed,
}

impl LeaseState {
    /// The contract's name: `free`, `held`, `expired` or `completed`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Free => "free",
            Self::Held => "held",
            Self::Expired => "expired",
            Self::Completed => "completed",
        }
    }
}

impl fmt::Display for LeaseState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A job's lease record: the answer to release, complete and status.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordBody {
    /// The job.
    pub job: JobId,
    /// The holder, last holder or completer; null when free.
    pub owner: Option<Owner>,
    /// The generation of the last claim.
    pub generation: Generation,
    /// The state.
    pub state: LeaseState,
    /// How long the lease has left (0 unless held).
    pub expires_in_ms: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_percent_encode_the_job() {
        let job: JobId = "a/b%c?d#e f".replace(' ', "+").parse().unwrap();
        assert_eq!(
            lease_path(&job, Some(Action::Claim)),
            "/v1/leases/a%2Fb%25c%3Fd%23e%2Bf/claim"
        );
        assert_eq!(
            lease_path(&"x~_.-9".parse().unwrap(), None),
            "/v1/leases/x~_.-9"
        );
    }

    #[test]
    fn requests_round_trip_and_bad_ones_name_the_field() {
        let renew = RenewRequest {
            owner: "w".parse().unwrap(),
            generation: Generation::new(u64::MAX),
            ttl: Ttl::MIN,
        };
        let json = serde_json::to_string(&renew).unwrap();
        assert_eq!(
            json,
            r#"{"owner":"w","generation":18446744073709551615,"ttl_ms":100}"#
        );
        assert_eq!(RenewRequest::from_json(json.as_bytes()).unwrap(), renew);
        let claim = ClaimRequest::from_json(br#"{"owner": "w"}"#).unwrap();
        assert_eq!(claim.ttl, Ttl::DEFAULT, "ttl_ms defaults to 30 s");
        for (body, want) in [
            (&b"[]"[..], "body: must be a JSON object"),
            (br#"{"generation": 1}"#, "owner: missing"),
            (
                br#"{"owner": "w", "generation": -1}"#,
                "generation: must be an integer from 0",
            ),
            (
                br#"{"owner": "w", "generation": 1, "ttl_ms": 5}"#,
                "ttl_ms: unknown field",
            ),
        ] {
            let e = FinishRequest::from_json(body).unwrap_err();
            assert!(e.to_string().starts_with(want), "{e} lacks {want}");
        }
    }

    #[test]
    fn states_are_lower_case_words() {
        for (state, word) in [
            (LeaseState::Free, "free"),
            (LeaseState::Held, "held"),
            (LeaseState::Expired, "expired"),
            (LeaseState::Completed, "completed"),
        ] {
            assert_eq!(serde_json::to_value(state).unwrap(), word);
            assert_eq!(state.as_str(), word);
            assert_eq!(
                serde_json::from_value::<LeaseState>(word.into()).unwrap(),
                state
            );
        }
        assert!(serde_json::from_value::<LeaseState>("Held".into()).is_err());
    }
}
