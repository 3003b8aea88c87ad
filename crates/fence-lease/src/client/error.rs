//! Why a claim did not give a lease, and how a claim's outcome becomes a grant or that reason.

use std::time::Duration;

use fence_core::{Generation, JobId, Owner};

use crate::{Outcome, StoreError, lease::TimingError};

/// The grant in a claim's outcome, or why there is none.
pub(super) fn granted(job: &JobId, outcome: Outcome) -> Result<crate::Grant, ClaimError> {
    let job = job.clone();
    match outcome {
        Outcome::Granted(grant) => Ok(grant),
        Outcome::Held {
            owner,
            expires_in,
            lock_delay: false,
            ..
        } => Err(ClaimError::Held {
            job,
            owner,
            expires_in,
        }),
        Outcome::Held {
            owner,
            expires_in,
            lock_delay: true,
            ..
        } => Err(ClaimError::LockDelay {
            job,
            owner,
            claimable_in: expires_in,
        }),
        Outcome::Completed { owner, generation } => Err(ClaimError::Completed {
            job,
            owner,
            generation,
        }),
        other => Err(ClaimError::Store(StoreError::Protocol(format!(
            "a claim was answered with {other:?}"
        )))),
    }
}

/// Why a claim did not give a lease.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClaimError {
    /// Another owner holds an unexpired lease.
    #[error("job {job} is held by {owner} for another {expires_in:?}")]
    Held {
        /// The job.
        job: JobId,
        /// The holder.
        owner: Owner,
        /// How long its lease has left.
        expires_in: Duration,
    },
    /// The job's last lease expired and its lock-delay runs (contract section 12).
    #[error(
        "job {job}: the lease of {owner} expired and its lock-delay lets nobody claim it for another {claimable_in:?}"
    )]
    LockDelay {
        /// The job.
        job: JobId,
        /// The holder whose lease expired.
        owner: Owner,
        /// How long until the job can be claimed.
        claimable_in: Duration,
    },
    /// The job is completed.
    #[error("job {job} is completed (generation {generation})")]
    Completed {
        /// The job.
        job: JobId,
        /// Who completed it.
        owner: Option<Owner>,
        /// Its last generation.
        generation: Generation,
    },
    /// A semaphore claim named another number of slots than the one in force while slots
    /// of the resource have holders (held or expired) or revoked leases not yet ended
    /// (contract section 15).
    #[error(
        "semaphore {resource} has {in_force} slots while any is in force (has a holder, or was revoked before its lease would have ended); this claim asked for {asked}"
    )]
    SemaphoreSize {
        /// The resource.
        resource: JobId,
        /// The number of slots this claim asked for.
        asked: u32,
        /// The number in force.
        in_force: u32,
    },
    /// The store failed.
    #[error("claim failed")]
    Store(#[from] StoreError),
    /// A live handle of this client (same owner) already holds the job; a second claim would
    /// get the same lease and generation back.
    #[error(
        "job {job} is already held by another handle of this client (owner); drop or finish it first"
    )]
    AlreadyHeld {
        /// The job.
        job: JobId,
    },
    /// The client's timing does not fit the TTL.
    #[error(transparent)]
    Timing(#[from] TimingError),
    /// The store granted a lease no longer than the client's safety margin (a server-side
    /// cap, `fence server --max-ttl`, below the TTL asked for): it could not be held for any
    /// time, and is released in the background (no request carried its token).
    #[error(
        "job {job}: the store granted a lease of {granted:?}, not longer than the safety margin {margin:?}, so it could not be held at all; lower the client's safety margin or raise the server's maximum TTL"
    )]
    GrantTooShort {
        /// The job.
        job: JobId,
        /// The TTL granted.
        granted: Duration,
        /// The client's safety margin.
        margin: Duration,
    },
    /// [`LeaseClient::resume`](crate::LeaseClient::resume) of a lease the store no longer has this owner hold.
    #[error("job {job}: the lease of generation {generation} is not held any more: {why}")]
    NotHeld {
        /// The job.
        job: JobId,
        /// The generation that was to be resumed.
        generation: Generation,
        /// What the store said instead.
        why: String,
    },
}
