//! The worker's side of a lease: claim, keep renewing, and know the moment it is lost.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use fence_lease::{LeaseClient, MemoryLeaseStore, Ttl};
//!
//! let client = LeaseClient::new(MemoryLeaseStore::new()).ttl(Ttl::from_millis(10_000)?);
//! let lease = client.claim("invoice-42".parse()?).await?;
//! let token = lease.token().expect("held"); // send it with every effect
//! assert_eq!(token.get(), 1);
//! tokio::select! {
//!     _ = lease.lost() => { /* stop producing effects at once */ }
//!     _ = async { /* the job's work */ } => {}
//! }
//! lease.complete().await?;
//! # Ok(()) }
//! ```
//!
//! # The local deadline
//! The worker takes `t_send = Instant::now()` before it sends a claim or renew. When the
//! store grants TTL `T`, the worker believes it holds the lease until `t_send + T - margin`,
//! on its own monotonic clock. Time in flight and in the store only shortens that view, and
//! no offset between the worker's and the store's wall clocks enters the arithmetic; the
//! margin (default 10% of `T`, at least 50 ms) covers a worker clock that runs slow.
//!
//! When the deadline passes before a renewal succeeds, or a renewal answers `Lost`, the lease
//! is lost, once and for all: [`Lease::lost`] resolves, [`Lease::token`] returns `None` and
//! [`FencingLayer`](crate::FencingLayer) refuses to send. The three read one flag.

use std::{
    fmt,
    sync::{
        Arc, OnceLock,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use fence_core::{FencingToken, Generation, JobId, Owner};
use tokio::{task::JoinHandle, time::Instant};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use crate::{
    ClaimOutcome, FencingLayer, FinishOutcome, LeaseRecord, LeaseStore, RenewOutcome, StoreError,
    Ttl, default_owner,
};

/// Claims leases from a store for one owner.
#[derive(Debug)]
pub struct LeaseClient<S> {
    store: Arc<S>,
    owner: Owner,
    ttl: Ttl,
    renew_every: Option<Duration>,
    margin: Option<Duration>,
}

impl<S> Clone for LeaseClient<S> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            owner: self.owner.clone(),
            ttl: self.ttl,
            renew_every: self.renew_every,
            margin: self.margin,
        }
    }
}

impl<S: LeaseStore> LeaseClient<S> {
    /// A client of `store` under a fresh [`default_owner`], with a 30 s TTL.
    pub fn new(store: S) -> Self {
        Self::from_arc(Arc::new(store))
    }

    /// A client of a shared store.
    pub fn from_arc(store: Arc<S>) -> Self {
        Self {
            store,
            owner: default_owner(),
            ttl: Ttl::DEFAULT,
            renew_every: None,
            margin: None,
        }
    }

    /// Claims under `owner` instead of the default name.
    pub fn owner(mut self, owner: Owner) -> Self {
        self.owner = owner;
        self
    }

    /// Asks for leases of `ttl`.
    pub fn ttl(mut self, ttl: Ttl) -> Self {
        self.ttl = ttl;
        self
    }

    /// Renews every `every` instead of every `ttl / 3`.
    pub fn renew_every(mut self, every: Duration) -> Self {
        self.renew_every = Some(every);
        self
    }

    /// Gives up `margin` before the lease's end instead of 10% of the TTL (at least 50 ms).
    pub fn safety_margin(mut self, margin: Duration) -> Self {
        self.margin = Some(margin);
        self
    }

    /// The owner this client claims under.
    pub fn owner_id(&self) -> &Owner {
        &self.owner
    }

    /// The store.
    pub fn store(&self) -> &Arc<S> {
        &self.store
    }

    fn timing(&self, ttl: Ttl) -> Result<Timing, ClaimError> {
        let ttl_d = ttl.as_duration();
        let margin = self
            .margin
            .unwrap_or_else(|| (ttl_d / 10).max(Duration::from_millis(50)));
        if margin >= ttl_d {
            return Err(ClaimError::Config(format!(
                "safety margin {margin:?} is not shorter than the ttl {ttl_d:?}"
            )));
        }
        let renew_every = self.renew_every.unwrap_or(ttl_d / 3);
        if renew_every.is_zero() || renew_every >= ttl_d - margin {
            return Err(ClaimError::Config(format!(
                "renewal interval {renew_every:?} must be above zero and shorter than ttl minus margin ({:?})",
                ttl_d - margin
            )));
        }
        Ok(Timing {
            ttl,
            margin,
            renew_every,
        })
    }

    /// Claims `job` and starts a keeper task that renews it in the background.
    ///
    /// Must be called within a tokio runtime.
    ///
    /// # Errors
    /// [`ClaimError::Held`] while another owner holds it, [`ClaimError::Completed`] once the
    /// job is completed, [`ClaimError::Store`] when the store fails or does not answer before
    /// the lease would have been useless, [`ClaimError::Config`] for a margin or renewal
    /// interval that does not fit the TTL.
    pub async fn claim(&self, job: JobId) -> Result<Lease<S>, ClaimError> {
        let timing = self.timing(self.ttl)?;
        let t_send = Instant::now();
        let budget = timing.ttl.as_duration() - timing.margin;
        let outcome = tokio::time::timeout(budget, self.store.claim(&job, &self.owner, self.ttl))
            .await
            .map_err(|_| ClaimError::Store(StoreError::Timeout(budget)))??;
        let grant = match outcome {
            ClaimOutcome::Granted(grant) => grant,
            ClaimOutcome::Held { owner, expires_in } => {
                return Err(ClaimError::Held {
                    job,
                    owner,
                    expires_in,
                });
            }
            ClaimOutcome::Completed { owner, generation } => {
                return Err(ClaimError::Completed {
                    job,
                    owner,
                    generation,
                });
            }
        };
        let token = grant.generation.token().ok_or_else(|| {
            ClaimError::Store(StoreError::Protocol(
                "the store granted generation 0".into(),
            ))
        })?;
        let deadline = timing.deadline(t_send, grant.ttl);
        if Instant::now() >= deadline {
            return Err(ClaimError::Store(StoreError::Timeout(budget)));
        }
        let shared = Arc::new(Shared {
            job,
            owner: self.owner.clone(),
            token,
            base: t_send,
            deadline_nanos: AtomicU64::new(0),
            lost: CancellationToken::new(),
            reason: OnceLock::new(),
        });
        shared.set_deadline(deadline);
        tracing::debug!(job = %shared.job, token = %token, "lease claimed");
        let keeper = tokio::spawn(keep(shared.clone(), self.store.clone(), timing, t_send));
        Ok(Lease {
            view: LeaseView { shared },
            store: self.store.clone(),
            keeper,
        })
    }
}

#[derive(Debug, Clone, Copy)]
struct Timing {
    ttl: Ttl,
    margin: Duration,
    renew_every: Duration,
}

impl Timing {
    /// `t_send + granted - margin`; a grant shorter than the margin gives no time at all.
    fn deadline(&self, t_send: Instant, granted: Ttl) -> Instant {
        t_send + granted.as_duration().saturating_sub(self.margin)
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
    /// The store failed.
    #[error("claim failed")]
    Store(#[from] StoreError),
    /// The client's timing does not fit the TTL.
    #[error("invalid lease timing: {0}")]
    Config(String),
}

/// Why a lease was lost.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LossReason {
    /// The local deadline passed before a renewal succeeded.
    DeadlinePassed,
    /// The store answered that another owner or generation holds the job.
    Superseded {
        /// The current owner.
        owner: Option<Owner>,
        /// The current generation.
        generation: Generation,
    },
    /// The handle was released, completed or dropped.
    Finished,
}

impl fmt::Display for LossReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::DeadlinePassed => {
                f.write_str("the local deadline passed before a renewal succeeded")
            }
            Self::Superseded {
                owner: Some(o),
                generation,
            } => {
                write!(f, "the store says {o} holds generation {generation}")
            }
            Self::Superseded {
                owner: None,
                generation,
            } => {
                write!(
                    f,
                    "the store says nobody holds it (generation {generation})"
                )
            }
            Self::Finished => f.write_str("the lease was released, completed or dropped"),
        }
    }
}

#[derive(Debug)]
struct Shared {
    job: JobId,
    owner: Owner,
    token: FencingToken,
    base: Instant,
    deadline_nanos: AtomicU64,
    lost: CancellationToken,
    reason: OnceLock<LossReason>,
}

impl Shared {
    fn deadline(&self) -> Instant {
        self.base + Duration::from_nanos(self.deadline_nanos.load(Ordering::Acquire))
    }

    fn set_deadline(&self, deadline: Instant) {
        let nanos = u64::try_from(deadline.saturating_duration_since(self.base).as_nanos())
            .unwrap_or(u64::MAX);
        self.deadline_nanos.store(nanos, Ordering::Release);
    }

    /// The one place a lease is declared lost. Final: nothing un-loses it.
    fn lose(&self, reason: LossReason) {
        if self.reason.set(reason.clone()).is_ok() {
            tracing::warn!(job = %self.job, token = %self.token, %reason, "lease lost");
        }
        self.lost.cancel();
    }

    fn token(&self) -> Option<FencingToken> {
        if self.lost.is_cancelled() {
            return None;
        }
        if Instant::now() >= self.deadline() {
            self.lose(LossReason::DeadlinePassed);
            return None;
        }
        Some(self.token)
    }
}

/// A read-only view of a lease: what [`FencingLayer`] and other observers hold.
#[derive(Debug, Clone)]
pub struct LeaseView {
    shared: Arc<Shared>,
}

impl LeaseView {
    /// The job.
    pub fn job(&self) -> &JobId {
        &self.shared.job
    }

    /// The owner.
    pub fn owner(&self) -> &Owner {
        &self.shared.owner
    }

    /// The generation this lease was granted.
    pub fn generation(&self) -> Generation {
        self.shared.token.generation()
    }

    /// The fencing token, while the lease is held; `None` from the moment it is lost.
    pub fn token(&self) -> Option<FencingToken> {
        self.shared.token()
    }

    /// Whether the lease is lost (checking the local deadline too).
    pub fn is_lost(&self) -> bool {
        self.token().is_none()
    }

    /// Why it was lost, once it is.
    pub fn loss_reason(&self) -> Option<LossReason> {
        self.shared.reason.get().cloned()
    }

    /// The local deadline: the lease is lost at this instant unless renewed before.
    pub fn deadline(&self) -> Instant {
        self.shared.deadline()
    }

    /// Resolves when the lease is lost.
    pub fn lost(&self) -> WaitForCancellationFutureOwned {
        self.shared.lost.clone().cancelled_owned()
    }

    /// A token cancelled when the lease is lost. Cancelling it yourself does not lose the lease.
    pub fn cancellation_token(&self) -> CancellationToken {
        self.shared.lost.child_token()
    }
}

/// A held lease. A keeper task renews it until it is completed, released, dropped or lost.
///
/// Dropping the handle stops renewal and marks the lease lost locally; the store lets it
/// expire.
#[derive(Debug)]
pub struct Lease<S> {
    view: LeaseView,
    store: Arc<S>,
    keeper: JoinHandle<()>,
}

impl<S> std::ops::Deref for Lease<S> {
    type Target = LeaseView;
    fn deref(&self) -> &LeaseView {
        &self.view
    }
}

impl<S> Drop for Lease<S> {
    fn drop(&mut self) {
        self.keeper.abort();
        self.view.shared.lose(LossReason::Finished);
    }
}

/// Why a release or completion was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FinishError {
    /// The store says the caller no longer holds the lease: nothing changed.
    #[error("the lease was lost: current owner {owner:?}, generation {generation}")]
    Lost {
        /// The current owner.
        owner: Option<Owner>,
        /// The current generation.
        generation: Generation,
    },
    /// The store failed; the outcome is unknown.
    #[error("the lease store failed")]
    Store(#[from] StoreError),
}

impl<S: LeaseStore> Lease<S> {
    /// A view to hand to observers that must not end the lease.
    pub fn view(&self) -> LeaseView {
        self.view.clone()
    }

    /// A [`FencingLayer`] that stamps this lease on outgoing requests.
    pub fn fencing_layer(&self) -> FencingLayer {
        FencingLayer::new(self.view())
    }

    /// Marks the job completed. The layer stops sending at once, whatever the store answers.
    ///
    /// # Errors
    /// [`FinishError::Lost`] when the store no longer records this owner and generation.
    pub async fn complete(self) -> Result<LeaseRecord, FinishError> {
        self.finish(true).await
    }

    /// Frees the job for another claim. The layer stops sending at once.
    ///
    /// # Errors
    /// As [`complete`](Self::complete).
    pub async fn release(self) -> Result<LeaseRecord, FinishError> {
        self.finish(false).await
    }

    async fn finish(self, complete: bool) -> Result<LeaseRecord, FinishError> {
        self.keeper.abort();
        let shared = &self.view.shared;
        shared.lose(LossReason::Finished);
        let (job, owner, generation) = (&shared.job, &shared.owner, shared.token.generation());
        let outcome = if complete {
            self.store.complete(job, owner, generation).await?
        } else {
            self.store.release(job, owner, generation).await?
        };
        match outcome {
            FinishOutcome::Done(record) => Ok(record),
            FinishOutcome::Lost { owner, generation } => {
                Err(FinishError::Lost { owner, generation })
            }
        }
    }
}

/// Renews until lost. The deadline bounds every wait, so loss fires on time even while a
/// renewal hangs.
async fn keep<S: LeaseStore>(
    shared: Arc<Shared>,
    store: Arc<S>,
    timing: Timing,
    granted_at: Instant,
) {
    let retry_every =
        (timing.renew_every / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
    let mut next = granted_at + timing.renew_every;
    let (job, owner, generation) = (&shared.job, &shared.owner, shared.token.generation());
    loop {
        let deadline = shared.deadline();
        tokio::select! {
            () = shared.lost.cancelled() => return,
            () = tokio::time::sleep_until(next.min(deadline)) => {}
        }
        if Instant::now() >= deadline {
            return shared.lose(LossReason::DeadlinePassed);
        }
        let t_send = Instant::now();
        let renewal = tokio::select! {
            () = shared.lost.cancelled() => return,
            r = tokio::time::timeout_at(deadline, store.renew(job, owner, generation, timing.ttl)) => r,
        };
        match renewal {
            Err(_elapsed) => return shared.lose(LossReason::DeadlinePassed),
            Ok(Ok(RenewOutcome::Renewed(grant))) => {
                // Loss is final: a renewal that answers after the deadline changes nothing.
                if shared.token().is_none() {
                    return;
                }
                shared.set_deadline(timing.deadline(t_send, grant.ttl));
                next = t_send + timing.renew_every;
            }
            Ok(Ok(RenewOutcome::Lost { owner, generation })) => {
                return shared.lose(LossReason::Superseded { owner, generation });
            }
            Ok(Err(error)) => {
                tracing::warn!(job = %job, %error, "lease renewal failed; retrying until the local deadline");
                next = Instant::now() + retry_every;
            }
        }
    }
}
