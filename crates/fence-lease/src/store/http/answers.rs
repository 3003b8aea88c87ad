//! The lease server's answers, read back: grants, records, and refusals as outcomes.

use std::time::Duration;

use fence_core::{
    Generation, Problem, ProblemType, Ttl,
    lease_api::{LeaseBody, RecordBody},
};
use http::StatusCode;

use crate::store::{Grant, LeaseRecord, Outcome, StoreError};

pub(super) fn unexpected(status: StatusCode, body: &[u8]) -> StoreError {
    match serde_json::from_slice::<Problem>(body) {
        Ok(p)
            if matches!(
                p.kind,
                ProblemType::Unauthenticated | ProblemType::Forbidden
            ) =>
        {
            StoreError::Denied {
                status: status.as_u16(),
                detail: p.detail,
            }
        }
        Ok(p) => StoreError::Protocol(format!("{status}: {} ({})", p.detail, p.kind)),
        Err(_) => StoreError::Protocol(format!(
            "{status}: {}",
            String::from_utf8_lossy(&body[..body.len().min(200)])
        )),
    }
}

pub(super) fn decode<T: serde::de::DeserializeOwned>(
    status: StatusCode,
    body: &[u8],
) -> Result<T, StoreError> {
    serde_json::from_slice(body)
        .map_err(|e| StoreError::Protocol(format!("{status} with an unreadable body: {e}")))
}

pub(super) fn grant(status: StatusCode, body: &[u8]) -> Result<Grant, StoreError> {
    let lease: LeaseBody = decode(status, body)?;
    let ttl = Ttl::from_millis(lease.ttl_ms)
        .map_err(|e| StoreError::Protocol(format!("server granted an invalid ttl: {e}")))?;
    Ok(Grant {
        generation: lease.generation,
        ttl,
        expires_at_ms: lease.expires_at_ms,
        token: lease.token,
        checkpoint: lease.checkpoint,
    })
}

pub(super) fn record(status: StatusCode, body: &[u8]) -> Result<LeaseRecord, StoreError> {
    decode(status, body).map(from_body)
}

pub(super) fn from_body(r: RecordBody) -> LeaseRecord {
    LeaseRecord {
        job: r.job,
        owner: r.owner,
        generation: r.generation,
        state: r.state,
        expires_in: Duration::from_millis(r.expires_in_ms),
    }
}

/// The outcome a refusal stands for, by its problem type.
pub(super) fn refused(status: StatusCode, body: &[u8]) -> Result<Outcome, StoreError> {
    let Ok(p) = serde_json::from_slice::<Problem>(body) else {
        return Err(unexpected(status, body));
    };
    let generation = Generation::new(p.generation.unwrap_or(0));
    match p.kind {
        ProblemType::LeaseHeld => Ok(Outcome::Held {
            owner: p
                .owner
                .ok_or_else(|| StoreError::Protocol("lease-held without an owner".into()))?,
            generation,
            expires_in: Duration::from_millis(p.expires_in_ms.unwrap_or(0)),
            lock_delay: false,
        }),
        ProblemType::LockDelay => Ok(Outcome::Held {
            owner: p
                .owner
                .ok_or_else(|| StoreError::Protocol("lock-delay without an owner".into()))?,
            generation,
            expires_in: Duration::from_millis(p.claimable_in_ms.unwrap_or(0)),
            lock_delay: true,
        }),
        ProblemType::JobCompleted => Ok(Outcome::Completed {
            owner: p.owner,
            generation,
        }),
        ProblemType::LeaseLost => Ok(Outcome::Lost {
            owner: p.owner,
            generation,
        }),
        ProblemType::LeaseKeyMismatch => Ok(Outcome::KeyMismatch),
        ProblemType::UnknownJob => Ok(Outcome::Unknown),
        ProblemType::SemaphoreSize => Ok(Outcome::SemaphoreSize {
            slots: p
                .slots
                .ok_or_else(|| StoreError::Protocol("semaphore-size without slots".into()))?,
        }),
        _ => Err(unexpected(status, body)),
    }
}
