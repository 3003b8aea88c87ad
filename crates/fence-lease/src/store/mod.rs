//! The lease store: one atomic verb per decision, typed outcomes, several backends.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use fence_lease::{ClaimOutcome, LeaseStore, MemoryLeaseStore, Ttl};
//!
//! let store = MemoryLeaseStore::new();
//! let (job, a, b) = ("job-1".parse()?, "worker-a".parse()?, "worker-b".parse()?);
//! let ClaimOutcome::Granted(grant) = store.claim(&job, &a, Ttl::DEFAULT).await? else { panic!() };
//! assert_eq!(grant.generation.get(), 1);
//! assert!(matches!(store.claim(&job, &b, Ttl::DEFAULT).await?, ClaimOutcome::Held { .. }));
//! # Ok(()) }
//! ```

mod http;
mod memory;
#[cfg(feature = "postgres")]
mod postgres;
mod rules;
mod signing;
mod sled;

use std::{future::Future, time::Duration};

use fence_core::{Generation, JobId, Owner};

#[cfg(feature = "postgres")]
pub use self::postgres::{PgLeaseStore, PgTable};
pub use self::{
    http::HttpLeaseStore, memory::MemoryLeaseStore, signing::SigningLeaseStore,
    sled::SledLeaseStore,
};

use crate::Ttl;

/// A boxed error source.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Shared storage of leases. Every method is one atomic decision made on the store's own
/// clock; there is no get-then-set.
pub trait LeaseStore: Send + Sync + 'static {
    /// Claims `job` for `owner`: granted with generation + 1 when the job is free or its
    /// lease expired; the same generation, extended, when `owner` already holds it.
    fn claim(
        &self,
        job: &JobId,
        owner: &Owner,
        ttl: Ttl,
    ) -> impl Future<Output = Result<ClaimOutcome, StoreError>> + Send;

    /// Extends the lease while `owner` and `generation` still match and the job is not
    /// completed (also after expiry, if nobody has claimed since).
    fn renew(
        &self,
        job: &JobId,
        owner: &Owner,
        generation: Generation,
        ttl: Ttl,
    ) -> impl Future<Output = Result<RenewOutcome, StoreError>> + Send;

    /// Frees the job under the same condition as [`renew`](Self::renew); the generation stays.
    fn release(
        &self,
        job: &JobId,
        owner: &Owner,
        generation: Generation,
    ) -> impl Future<Output = Result<FinishOutcome, StoreError>> + Send;

    /// Marks the job completed under the same condition as [`renew`](Self::renew); it can
    /// never be claimed again.
    fn complete(
        &self,
        job: &JobId,
        owner: &Owner,
        generation: Generation,
    ) -> impl Future<Output = Result<FinishOutcome, StoreError>> + Send;

    /// The job's record as of now, `None` if it was never claimed.
    fn get(
        &self,
        job: &JobId,
    ) -> impl Future<Output = Result<Option<LeaseRecord>, StoreError>> + Send;
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

/// The outcome of [`LeaseStore::claim`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClaimOutcome {
    /// The caller holds the lease.
    Granted(Grant),
    /// Another owner holds an unexpired lease.
    Held {
        /// The holder.
        owner: Owner,
        /// How long its lease has left.
        expires_in: Duration,
    },
    /// The job is completed and can never be claimed again.
    Completed {
        /// Who completed it.
        owner: Option<Owner>,
        /// The generation it was completed under.
        generation: Generation,
    },
}

/// The outcome of [`LeaseStore::renew`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RenewOutcome {
    /// The lease was extended.
    Renewed(Grant),
    /// The caller no longer holds the lease.
    Lost {
        /// The current owner (`None`: nobody).
        owner: Option<Owner>,
        /// The current generation.
        generation: Generation,
    },
}

/// The outcome of [`LeaseStore::release`] and [`LeaseStore::complete`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum FinishOutcome {
    /// Done; the record as it now stands.
    Done(LeaseRecord),
    /// The caller no longer holds the lease; nothing changed.
    Lost {
        /// The current owner (`None`: nobody).
        owner: Option<Owner>,
        /// The current generation.
        generation: Generation,
    },
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

/// The state of a job's lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LeaseState {
    /// Never claimed, or released.
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

/// Why a lease store could not decide.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// Reading or writing the backing storage failed.
    #[error("lease store I/O failed")]
    Io(#[source] BoxError),
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
