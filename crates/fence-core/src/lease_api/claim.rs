//! `POST /v1/leases/{job}/claim`'s body.

use std::time::Duration;

use serde::Serialize;

use super::{BodyError, Fields};
use crate::{Owner, Ttl, secret::LeaseKey};

/// `POST /v1/leases/{job}/claim`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ClaimRequest {
    /// Who claims.
    pub owner: Owner,
    /// The secret that will prove this claim's lease is the caller's (a fresh one per claim).
    pub lease_key: LeaseKey,
    /// How long the lease should last (`ttl_ms`; 30 s when left out).
    #[serde(rename = "ttl_ms")]
    pub ttl: Ttl,
    /// The lock-delay of this claim's lease (`lock_delay_ms`, 0 to [`Ttl::MAX`]): if the
    /// lease *expires* (is not released, completed or revoked), nobody can claim the job
    /// until this long after its end. Left out: the server's default (`--lock-delay`, off
    /// unless set). Contract section 12.
    #[serde(rename = "lock_delay_ms", skip_serializing_if = "Option::is_none")]
    #[serde(serialize_with = "millis_opt")]
    pub lock_delay: Option<Duration>,
}

fn millis_opt<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        None => s.serialize_none(),
    }
}

impl ClaimRequest {
    /// Parses a request body, strictly.
    ///
    /// # Errors
    /// When it is not a JSON object of exactly these fields with valid values.
    pub fn from_json(bytes: &[u8]) -> Result<Self, BodyError> {
        Self::from_fields(&Fields::parse(
            bytes,
            &["owner", "lease_key", "ttl_ms", "lock_delay_ms"],
        )?)
    }

    /// The claim's fields of a parsed body (also a semaphore claim's).
    pub(super) fn from_fields(f: &Fields) -> Result<Self, BodyError> {
        let lock_delay = match f.u64("lock_delay_ms")? {
            Some(ms) if ms > Ttl::MAX.as_millis() => {
                return Err(BodyError::new(
                    "lock_delay_ms",
                    format!(
                        "must be an integer from 0 to {} (milliseconds), got {ms}",
                        Ttl::MAX.as_millis()
                    ),
                ));
            }
            ms => ms.map(Duration::from_millis),
        };
        Ok(Self {
            owner: f.owner()?,
            lease_key: f.lease_key()?,
            ttl: f.ttl()?,
            lock_delay,
        })
    }
}
