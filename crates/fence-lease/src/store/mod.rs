//! The lease store: one atomic decision per call, on the store's own clock; several backends.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use fence_lease::{LeaseStore, MemoryLeaseStore, Outcome, Ttl};
//!
//! let store = MemoryLeaseStore::new();
//! let (job, a, b) = ("job-1".parse()?, "worker-a".parse()?, "worker-b".parse()?);
//! let (key_a, key_b) = (fence_lease::new_lease_key()?, fence_lease::new_lease_key()?);
//! let Outcome::Granted(grant) = store.claim(&job, &a, &key_a, Ttl::DEFAULT).await? else { panic!() };
//! assert_eq!(grant.generation.get(), 1);
//! assert!(matches!(store.claim(&job, &b, &key_b, Ttl::DEFAULT).await?, Outcome::Held { .. }));
//! # Ok(()) }
//! ```

mod bearer;
mod error;
mod http;
mod memory;
#[cfg(feature = "postgres")]
mod postgres;
pub(crate) mod rules;
mod signing;
mod sled;
mod slots;

use std::{future::Future, time::Duration};

use fence_core::{
    Generation, JobId, Owner, Ttl,
    lease_api::{LeaseState, ListQuery},
    secret::LeaseKey,
};

#[cfg(feature = "postgres")]
pub use self::postgres::{PgLeaseStore, PgTable};
pub(crate) use self::slots::{
    check_slot_claim, decide_slot, refused_before_sending, slot_prefix, slot_records,
};
pub use self::{
    bearer::{BearerToken, TokenError},
    error::StoreError,
    http::{HttpLeaseStore, HttpOptions, UrlError},
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
        /// The secret that will prove the lease is the caller's; a holder that claims again
        /// with the same key gets its lease back, with another key it is refused.
        key: LeaseKey,
        /// For how long.
        ttl: Ttl,
        /// If this lease *expires* (is not released, completed or revoked), nobody can claim
        /// the job for this long after its end (contract section 12). `None`: the store's
        /// default, which is none for the memory, sled and PostgreSQL stores and the lease
        /// server's `--lock-delay` over HTTP.
        lock_delay: Option<Duration>,
    },
    /// Extend the lease while `owner` and `generation` still match and the job is not
    /// completed (also after expiry, if nobody has claimed since).
    Renew {
        /// The holder.
        owner: Owner,
        /// Its generation.
        generation: Generation,
        /// The key it claimed with.
        key: LeaseKey,
        /// For how long from now.
        ttl: Ttl,
    },
    /// Free the job under the same condition as a renewal; the generation stays.
    Release {
        /// The holder.
        owner: Owner,
        /// Its generation.
        generation: Generation,
        /// The key it claimed with.
        key: LeaseKey,
    },
    /// Mark the job completed under the same condition as a renewal; it can never be
    /// claimed again. A semaphore's slot is released instead (contract section 15).
    Complete {
        /// The holder.
        owner: Owner,
        /// Its generation.
        generation: Generation,
        /// The key it claimed with.
        key: LeaseKey,
    },
    /// Save `data` as the job's checkpoint under the same condition as a renewal (owner,
    /// generation and key still hold it, not completed); the next claim returns it with this
    /// generation (contract section 14). The store keeps it as given: the size limit is the
    /// caller's to enforce.
    Checkpoint {
        /// The holder.
        owner: Owner,
        /// Its generation.
        generation: Generation,
        /// The key it claimed with.
        key: LeaseKey,
        /// The checkpoint.
        data: String,
    },
    /// An operator's: end the current lease at once and raise the generation by one, so
    /// nobody holds it and every token of the ended lease is below the job's generation
    /// (contract section 11). Any state but completed; the job must have a record.
    Revoke,
}

impl LeaseOp {
    /// Who asks (nobody for a revoke, which no holder asks for).
    pub fn owner(&self) -> Option<&Owner> {
        match self {
            Self::Claim { owner, .. }
            | Self::Renew { owner, .. }
            | Self::Release { owner, .. }
            | Self::Complete { owner, .. }
            | Self::Checkpoint { owner, .. } => Some(owner),
            Self::Revoke => None,
        }
    }

    /// The generation it acts on (none for a claim or a revoke).
    pub fn generation(&self) -> Option<Generation> {
        match self {
            Self::Claim { .. } | Self::Revoke => None,
            Self::Renew { generation, .. }
            | Self::Release { generation, .. }
            | Self::Complete { generation, .. }
            | Self::Checkpoint { generation, .. } => Some(*generation),
        }
    }

    /// An error when no store may decide it for `job`, whoever asks: a checkpoint larger
    /// than any store keeps ([`MAX_CHECKPOINT_BYTES`](fence_core::lease_api::MAX_CHECKPOINT_BYTES)),
    /// or a plain claim of a job id holding `#` (only a semaphore claim takes a slot).
    pub(crate) fn check(&self, job: &JobId) -> Result<(), StoreError> {
        let most = fence_core::lease_api::MAX_CHECKPOINT_BYTES;
        match self {
            Self::Checkpoint { data, .. } if data.len() > most => {
                Err(StoreError::Protocol(format!(
                    "a checkpoint of {} bytes is more than any store keeps ({most})",
                    data.len()
                )))
            }
            Self::Claim { .. } if fence_core::lease_api::reserved(job) => {
                Err(StoreError::Reserved {
                    job: job.clone(),
                    reason: "job ids holding '#' are semaphore slots, taken only by a claim of their semaphore (POST /v1/semaphores/{resource}/claim)",
                })
            }
            _ => Ok(()),
        }
    }

    /// The lease key it carries (none for a revoke).
    pub fn key(&self) -> Option<&LeaseKey> {
        match self {
            Self::Claim { key, .. }
            | Self::Renew { key, .. }
            | Self::Release { key, .. }
            | Self::Complete { key, .. }
            | Self::Checkpoint { key, .. } => Some(key),
            Self::Revoke => None,
        }
    }
}

/// What a claim asks for besides who claims: how long the lease lasts, and its lock-delay
/// (`None`: the store's default; see [`LeaseOp::Claim`]). A [`Ttl`] alone is terms without
/// a lock-delay of their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimTerms {
    /// How long the lease lasts.
    pub ttl: Ttl,
    /// How long nobody can claim the job after the lease *expires*.
    pub lock_delay: Option<Duration>,
}

impl From<Ttl> for ClaimTerms {
    fn from(ttl: Ttl) -> Self {
        Self {
            ttl,
            lock_delay: None,
        }
    }
}

impl ClaimTerms {
    /// The claim of `owner` with `key` on these terms.
    pub fn op(&self, owner: &Owner, key: &LeaseKey) -> LeaseOp {
        LeaseOp::Claim {
            owner: owner.clone(),
            key: key.clone(),
            ttl: self.ttl,
            lock_delay: self.lock_delay,
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
        /// The holder's generation.
        generation: Generation,
        /// How long its lease has left; with `lock_delay`, how long until the job can be
        /// claimed.
        expires_in: Duration,
        /// The lease expired and its lock-delay runs: nobody can claim the job for
        /// `expires_in` (contract section 12). `owner` and `generation` are the expired
        /// lease's.
        lock_delay: bool,
    },
    /// A claim found the job completed: it can never be claimed again.
    Completed {
        /// Who completed it.
        owner: Option<Owner>,
        /// The generation it was completed under.
        generation: Generation,
    },
    /// A revoke succeeded: the lease ended and the generation went up by one.
    Revoked(Revocation),
    /// A revoke named a job the store has no record of (never claimed, or forgotten).
    Unknown,
    /// A semaphore claim named another number of slots than `slots`, the one in force while
    /// any slot has a holder, held or expired, or was revoked before its lease would have
    /// ended (contract section 15); nothing changed.
    SemaphoreSize {
        /// The number of slots in force.
        slots: u32,
    },
    /// A renewal, release or completion by the owner and generation that hold the job, but
    /// with another lease key; nothing changed.
    KeyMismatch,
    /// A renewal, release or completion by an owner and generation that no longer hold the
    /// job; nothing changed.
    Lost {
        /// The current owner (`None`: nobody).
        owner: Option<Owner>,
        /// The current generation.
        generation: Generation,
    },
}

/// What a semaphore claim decided ([`LeaseStore::claim_slot`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotClaim {
    /// The slot the outcome is about: the one granted; when every slot is taken
    /// ([`Outcome::Held`]), the one that frees first; `None` when the claim was refused as a
    /// whole ([`Outcome::SemaphoreSize`]). Its job id is
    /// [`slot_job`](fence_core::lease_api::slot_job)`(resource, slot)`.
    pub slot: Option<u32>,
    /// `Granted`, `Held` (every slot taken: the holder of the slot that frees first, and
    /// when), `SemaphoreSize`, or `Completed` when that slot was completed by an older build.
    pub outcome: Outcome,
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

    /// A page of records in job id order, as `query` asks. A backend may return fewer than
    /// the limit (it bounds how many records one call reads) with `next` set: a page is
    /// complete only when `next` is `None`.
    fn list(&self, query: &ListQuery) -> impl Future<Output = Result<ListPage, StoreError>> + Send;

    /// Deletes up to `limit` jobs that are free, expired or completed and have not changed
    /// for `idle_for` (the store's clock), raising the store's durable floor to their highest
    /// generation first, so a job claimed again starts above every generation it had
    /// (contract section 8). Returns how many were deleted; fewer than `limit` means none
    /// is left for now. A store that cannot forget deletes none (the default).
    fn forget_idle(
        &self,
        idle_for: std::time::Duration,
        limit: usize,
    ) -> impl Future<Output = Result<usize, StoreError>> + Send {
        let _ = (idle_for, limit);
        async { Ok(0) }
    }

    /// Whether other processes decide on this store too (a database several servers share):
    /// then a job may change without this process seeing the call, and a waiting claim
    /// looks again now and then instead of only when woken. Default: false.
    fn is_shared(&self) -> bool {
        false
    }

    /// On a shared store, the jobs other processes let go (released, completed, revoked), as
    /// they do it: [`Notice::Payload`](fence_storage::Notice) carries the job id, `Missed`
    /// says some may have gone unheard (look at every job again) and that changes are heard
    /// from now on, `Lost` that none is heard until the next `Missed`. A waiting claim is
    /// woken by them instead of its next look. `None` (the default): the store cannot
    /// tell, or no other process decides on it.
    fn changes(&self) -> Option<tokio::sync::broadcast::Receiver<fence_storage::Notice>> {
        None
    }

    /// A semaphore claim (contract section 15): one of `slots` slots of `resource`, each a
    /// lease of its own on job `resource#k`, atomically with the resource's number of slots.
    /// Refused as a whole ([`Outcome::SemaphoreSize`]) while a slot is taken under another
    /// number; gives a holder that claims again with its key its own slot back; else claims
    /// the lowest-numbered claimable slot by the plain claim rule. `resource` must pass
    /// [`check_resource`](fence_core::lease_api::check_resource) and `slots` be 1 to
    /// [`MAX_SLOTS`](fence_core::lease_api::MAX_SLOTS). No default: a wrapper that forgot
    /// to pass it on would refuse semaphores only in production.
    fn claim_slot(
        &self,
        resource: &JobId,
        owner: &Owner,
        key: &LeaseKey,
        terms: ClaimTerms,
        slots: u32,
    ) -> impl Future<Output = Result<SlotClaim, StoreError>> + Send;

    /// [`LeaseOp::Claim`].
    fn claim(
        &self,
        job: &JobId,
        owner: &Owner,
        key: &LeaseKey,
        ttl: Ttl,
    ) -> impl Future<Output = Result<Outcome, StoreError>> + Send {
        self.apply(job, ClaimTerms::from(ttl).op(owner, key))
    }

    /// [`LeaseOp::Claim`], waiting up to `wait` while another owner holds the job: returns
    /// as soon as the claim is granted, the job is completed, or the wait is over (then
    /// `Held`, as without waiting). This default polls, backing off from 10 ms to 500 ms and
    /// never past the wait's end; [`HttpLeaseStore`] lets the server wait instead, which
    /// hands the job over the moment it frees, first come first served (contract section 11).
    fn claim_waiting(
        &self,
        job: &JobId,
        owner: &Owner,
        key: &LeaseKey,
        terms: ClaimTerms,
        wait: Duration,
    ) -> impl Future<Output = Result<Outcome, StoreError>> + Send {
        async move {
            let end = crate::later(tokio::time::Instant::now(), wait);
            let mut pause = Duration::from_millis(10);
            loop {
                let outcome = self.apply(job, terms.op(owner, key)).await?;
                let now = tokio::time::Instant::now();
                let Outcome::Held { expires_in, .. } = &outcome else {
                    return Ok(outcome);
                };
                if now >= end {
                    return Ok(outcome);
                }
                tokio::time::sleep(pause.min(*expires_in).min(end - now)).await;
                pause = (pause * 2).min(Duration::from_millis(500));
            }
        }
    }

    /// [`LeaseOp::Renew`].
    fn renew(
        &self,
        job: &JobId,
        owner: &Owner,
        generation: Generation,
        key: &LeaseKey,
        ttl: Ttl,
    ) -> impl Future<Output = Result<Outcome, StoreError>> + Send {
        let (owner, key) = (owner.clone(), key.clone());
        let op = LeaseOp::Renew {
            owner,
            generation,
            key,
            ttl,
        };
        self.apply(job, op)
    }

    /// [`LeaseOp::Release`].
    fn release(
        &self,
        job: &JobId,
        owner: &Owner,
        generation: Generation,
        key: &LeaseKey,
    ) -> impl Future<Output = Result<Outcome, StoreError>> + Send {
        let (owner, key) = (owner.clone(), key.clone());
        self.apply(
            job,
            LeaseOp::Release {
                owner,
                generation,
                key,
            },
        )
    }

    /// [`LeaseOp::Complete`].
    fn complete(
        &self,
        job: &JobId,
        owner: &Owner,
        generation: Generation,
        key: &LeaseKey,
    ) -> impl Future<Output = Result<Outcome, StoreError>> + Send {
        let (owner, key) = (owner.clone(), key.clone());
        self.apply(
            job,
            LeaseOp::Complete {
                owner,
                generation,
                key,
            },
        )
    }
}

/// A page of [`LeaseStore::list`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ListPage {
    /// The records, in job id order.
    pub leases: Vec<LeaseRecord>,
    /// Where the next page starts (`after`), if there may be one.
    pub next: Option<JobId>,
}

/// How many records a backend reads at most for one page, matches or not: a page over a
/// state few jobs are in comes back short, with `next`, rather than scanning everything.
pub(crate) const MAX_LIST_SCAN: usize = 10_000;

/// A page built by scanning `records` (in job order, starting after `query.after`): the ones
/// `query` selects, at most its limit of them, reading at most [`MAX_LIST_SCAN`].
pub(crate) fn page(
    query: &ListQuery,
    records: impl Iterator<Item = Result<LeaseRecord, StoreError>>,
) -> Result<ListPage, StoreError> {
    let limit = query.limit();
    let mut page = ListPage::default();
    let mut last = None;
    for (scanned, record) in records.enumerate() {
        let record = record?;
        if scanned >= MAX_LIST_SCAN || page.leases.len() == limit {
            page.next = last;
            return Ok(page);
        }
        last = Some(record.job.clone());
        if query.state.is_none_or(|s| s == record.state) {
            page.leases.push(record);
        }
    }
    Ok(page)
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
    /// The signed token string (`<generation>.<expires_at_ms>.<signature>`) when the store
    /// signs tokens
    /// (contract section 6); the lease client sends it exactly as given.
    pub token: Option<String>,
    /// A claim's grant: the job's last checkpoint and the generation that saved it
    /// (contract section 14). `None` for renewals and jobs without one.
    pub checkpoint: Option<fence_core::lease_api::Checkpoint>,
}

/// What a revoke did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Revocation {
    /// The record as it now stands: free, at the raised generation.
    pub record: LeaseRecord,
    /// When the revoked lease would have expired (the revoke's time if it already had), on
    /// the store's clock, in ms since the Unix epoch: until then a token of the revoked
    /// lease may still pass a sink that was not told. The revoke's own token ends then too.
    /// `None` only from a remote store that signs no tokens (the answer does not say).
    pub expires_at_ms: Option<u64>,
    /// The signed token of the raised generation when the store signs tokens, for pushing
    /// to sinks (`POST /v1/fence/{job}`).
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
