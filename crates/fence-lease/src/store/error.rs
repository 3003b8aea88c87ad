//! Why a lease store could not decide: the one error every store and the HTTP client share.

use std::time::Duration;

use fence_core::JobId;

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
    /// A remote store, or a gateway in front of it, answered 502, 503 or 504: it could not
    /// decide, or not confirm its decision in time, so whether the request took effect may
    /// be unknown. Retry with backoff, after `retry_after` when given: a claim asked again
    /// with the same owner and lease key gets the same lease back.
    #[error("the lease server is unavailable ({status}): {detail}")]
    Unavailable {
        /// The HTTP status.
        status: u16,
        /// The server's detail, or the start of a gateway's body.
        detail: String,
        /// The answer's `Retry-After` in seconds, when it had one.
        retry_after: Option<Duration>,
    },
    /// A claim that had to wait found the lease server's waiting places full (429
    /// `urn:fence:too-many-waiters`, contract section 11): the job was held when asked, and
    /// nothing changed. Not a failure of the server: claim again after `retry_after`, as
    /// [`LeaseStore::claim_waiting`](crate::LeaseStore::claim_waiting) of `HttpLeaseStore`
    /// does within its wait, answering this only when the wait ended with the job still held.
    #[error("the lease server's waiting places are full (429): {detail}")]
    TooManyWaiters {
        /// The server's detail.
        detail: String,
        /// The answer's `Retry-After` in seconds, when it had one.
        retry_after: Option<Duration>,
    },
    /// The store had no turn for the request in time: requests queued before it in this
    /// process (a burst of semaphore claims of one resource, contract section 15); or the
    /// lease server answered its own 408 (`urn:fence:body-timeout`: the request did not
    /// arrive whole in time; a gateway's 408 is [`Unavailable`](Self::Unavailable)). Nothing
    /// reached the storage and nothing was decided: ask again after a pause.
    #[error("the lease store is busy, nothing was decided: {0}")]
    Busy(String),
    /// The operation is not allowed on this job id, whoever asks: a plain claim of a
    /// semaphore's slot (contract section 15).
    #[error("job {job} cannot be claimed this way: {reason}")]
    Reserved {
        /// The job.
        job: JobId,
        /// Why.
        reason: &'static str,
    },
    /// A remote store refused the request as asked (a 4xx problem other than the
    /// authentication refusals, 408, 409 and 429): a malformed request, a job at its last
    /// generation, a plain claim of a semaphore's slot. Also a semaphore claim no store would
    /// take (a resource with `#`, slots out of range), refused before it is decided or sent
    /// (by `LeaseClient`, by any store; `HttpLeaseStore` called directly adds "refused
    /// before sending"). The same request asked again gets the same answer.
    #[error("the request was refused ({status}): {detail}")]
    Refused {
        /// The HTTP status.
        status: u16,
        /// The server's detail.
        detail: String,
    },
    /// A remote store refused the caller: no valid bearer secret (401), or one that does
    /// not cover the job (403).
    #[error("the lease server refused this client: {detail}")]
    Denied {
        /// The HTTP status.
        status: u16,
        /// The server's detail.
        detail: String,
    },
}

impl StoreError {
    /// Whether the answer to a call was lost (an I/O error, a timeout, a 502, 503 or 504):
    /// the store may have decided it, and the same call with the same lease key gets that
    /// decision back.
    pub fn answer_lost(&self) -> bool {
        matches!(
            self,
            Self::Io(_) | Self::Timeout(_) | Self::Unavailable { .. }
        )
    }

    /// Whether asking again the same way can only get the same answer: the request is
    /// malformed or not allowed for this job id, the caller is not let in, or a stored
    /// record is corrupt. A caller that retries store failures stops at these.
    pub fn is_permanent(&self) -> bool {
        matches!(
            self,
            Self::Refused { .. }
                | Self::Denied { .. }
                | Self::Reserved { .. }
                | Self::GenerationExhausted(_)
                | Self::Corrupt { .. }
        )
    }

    /// Wraps an I/O failure, keeping it as the source.
    pub fn io(e: impl Into<fence_storage::BoxError>) -> Self {
        Self::Io(e.into())
    }
}
