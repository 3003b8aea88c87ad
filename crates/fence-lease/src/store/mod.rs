//! The lease store: one atomic decision per call, on the store's own clock; several backends.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use fence_lease::{LeaseStore, MemoryLeaseStore, Outcome, Ttl};
//!
//! let store = MemoryLeaseStore::new();
//! let (job, a, b) = ("job-1".parse()?, "worker-a".parse()?, "worker-b".parse()?);
//! let Outcome::Granted(grant) = store.claim(&job, &a, Ttl::DEFAULT).await? else { panic!() };
//! assert_eq!(grant.generation.get(), 1);
//! assert!(matches!(store.claim(&job, &b, Ttl::DEFAULT).await?, Outcome::Held { .. }));
//! # Ok(()) }
//! ```

mod http;
mod memory;
#[cfg(feature = "postgres")]
mod postgres;
pub(crate) mod rules;
mod signing;
mod sled;

use std::{future::Future, time::Duration};

use fence_core::{Generation, JobId, Owner, Ttl, lease_api::LeaseState};

#[cfg(feature = "postgres")]
pub use self::postgres::{PgLeaseStore, PgTable};
pub use self::{
    http::{HttpLeaseStore, UrlError},
    memory::MemoryLeaseStore,
    signing::SigningLeaseStore,
    sled::SledLeaseStore,
};

/// One decision a lease store makes atomically, on its own clock.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LeaseOp {
    /// Claim the job: granted with generation + 1 when it is free or its lease expired; the
    /// same generation, extended, when `owner` already holds it.
    Claim {
        /// Who claims.
        owner: Owner,
        /// For how long.
        ttl: Ttl,
    },
    /// Extend the lease while `owner` and `generation` still match and the job is not
    /// completed (also after expiry, if nobody has claimed since).
    Renew {
        /// The holder.
        owner: Owner,
        /// Its generation.
        generation: Generation,
        /// For how long from now.
        ttl: Ttl,
    },
    /// Free the job under the same condition as a renewal; the generation stays.
    Release {
        /// The holder.
        owner: Owner,
        /// Its generation.
        generation: Generation,
    },
    /// Mark the job completed under the same condition as a renewal; it can never be
    /// claimed again.
    Complete {
        /// The holder.
        owner: Owner,
        /// Its generation.
        generation: Generation,
    },
}

impl LeaseOp {
    /// Who asks.
    pub fn owner(&self) -> &Owner {
        match self {
            Self::Claim { owner, .. }
            | Self::Renew { owner, .. }
            | Self::Release { owner, .. }
            | Self::Complete { owner, .. } => owner,
        }
    }
}

/// What a lease store decided.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// A claim or renewal succeeded: the caller holds the lease.
    Granted(Grant),
    /// A release or completion succeeded; the record as it now stands.
    Done(LeaseRecord),
    /// A claim found another owner holding an unexpired lease.
    Held {
        /// The holder.
        owner: Owner,
        /// How long its lease has left.
        expires_in: Duration,
    },
    /// A claim found the job completed: it can never be claimed again.
    Completed {
        /// Who completed it.
        owner: Option<Owner>,
        /// The generation it was completed under.
        generation: Generation,
    },
    /// A renewal, release or completion by an owner and generation that no longer hold the
    /// job; nothing changed.
    Lost {
        /// The current owner (`None`: nobody).
        owner: Option<Owner>,
        /// The current generation.
        generation: Generation,
    },
}

/// Shared storage of leases. Every call is one atomic decision made on the store's own
/// clock; there is no get-then-set. A backend implements [`apply`](Self::apply) and
/// [`get`](Self::get); `claim`, `renew`, `release` and `complete` are shorthands for `apply`.
pub trait LeaseStore: Send + Sync + 'static {
    /// Decides `op` for `job`.
    fn apply(
        &self,
        job: &JobId,
        op: LeaseOp,
    ) -> impl Future<Output = Result<Outcome, StoreError>> + Send;

    /// The job's record as of now, `None` if it was never claimed.
    fn get(
        &self,
        job: &JobId,
    ) -> impl Future<Output = Result<Option<LeaseRecord>, StoreError>> + Send;

    /// [`LeaseOp::Claim`].
    fn claim(
        &self,
        job: &JobId,
        owner: &Owner,
        ttl: Ttl,
    ) -> impl Future<Output = Result<Outcome, StoreError>> + Send {
        self.apply(
            job,
            LeaseOp::Claim {
                owner: owner.clone(),
                ttl,
            },
        )
    }

    /// [`LeaseOp::Renew`].
    fn renew(
        &self,
        job: &JobId,
        owner: &Owner,
        generation: Generation,
        ttl: Ttl,
    ) -> impl Future<Output = Result<Outcome, StoreError>> + Send {
        self.apply(
            job,
            LeaseOp::Renew {
                owner: owner.clone(),
                generation,
                ttl,
            },
        )
    }

    /// [`LeaseOp::Release`].
    fn release(
        &self,
        job: &JobId,
        owner: &Owner,
        generation: Generation,
    ) -> impl Future<Output = Result<Outcome, StoreError>> + Send {
        let owner = owner.clone();
        self.apply(job, LeaseOp::Release { owner, generation })
    }

    /// [`LeaseOp::Complete`].
    fn complete(
        &self,
        job: &JobId,
        owner: &Owner,
        generation: Generation,
    ) -> impl Future<Output = Result<Outcome, StoreError>> + Send {
        let owner = owner.clone();
        self.apply(job, LeaseOp::Complete { owner, generation })
    }
}

/// A granted lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// The generation: the fencing token of this lease.
    pub generation: Generation,
    /// The duration the store granted.
    pub ttl: Ttl,
    /// When the lease expires on the store's clock, in ms since the Unix epoch.
    pub expires_at_ms: u64,
    /// The signed token string (`<generation>.<signature>`) when the store signs tokens
    /// (contract section 6); the lease client sends it exactly as given.
    pub token: Option<String>,
}

/// A job's lease as the store sees it now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseRecord {
    /// The job.
    pub job: JobId,
    /// The holder (`Held`), the last holder (`Expired`), the completer (`Completed`), or
    /// nobody (`Free`).
    pub owner: Option<Owner>,
    /// The generation of the last claim (0: never claimed).
    pub generation: Generation,
    /// The state.
    pub state: LeaseState,
    /// How long the lease has left (zero unless `Held`).
    pub expires_in: Duration,
}

/// Why a lease store could not decide.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// Reading or writing the backing storage failed.
    #[error("lease store I/O failed")]
    Io(#[source] fence_storage::BoxError),
    /// A stored record could not be decoded.
    #[error("stored lease of job {job} is corrupt: {reason}")]
    Corrupt {
        /// The job.
        job: JobId,
        /// What is wrong.
        reason: &'static str,
    },
    /// The job's generation reached 2^64-1; it cannot be claimed again.
    #[error("job {0} has reached generation 18446744073709551615 and cannot be claimed again")]
    GenerationExhausted(JobId),
    /// The store did not answer in time.
    #[error("lease store did not answer within {0:?}")]
    Timeout(Duration),
    /// A remote store answered something this client does not understand.
    #[error("lease store answered unexpectedly: {0}")]
    Protocol(String),
}

impl StoreError {
    /// Wraps an I/O failure, keeping it as the source.
    pub fn io(e: impl Into<fence_storage::BoxError>) -> Self {
        Self::Io(e.into())
    }
}
