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
    /// Jobs held by live handles of this owner (shared by clones).
    held: Arc<std::sync::Mutex<std::collections::HashSet<JobId>>>,
}

impl<S> Clone for LeaseClient<S> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            owner: self.owner.clone(),
            ttl: self.ttl,
            renew_every: self.renew_every,
            margin: self.margin,
            held: self.held.clone(),
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
            held: Arc::default(),
        }
    }

    /// Claims under `owner` instead of the default name.
    pub fn owner(mut self, owner: Owner) -> Self {
        self.owner = owner;
        self.held = Arc::default(); // another owner: another set of held jobs
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
        let timing = Timing {
            ttl,
            margin: self.margin,
            renew_every: self.renew_every,
        };
        let ttl_d = ttl.as_duration();
        let margin = timing.margin(ttl);
        if margin >= ttl_d {
            return Err(ClaimError::Config(format!(
                "safety margin {margin:?} is not shorter than the ttl {ttl_d:?}"
            )));
        }
        // The configured interval must fit the TTL asked for; a shorter grant later falls
        // back to a third of it (see `Timing::renew_every`).
        let renew_every = self.renew_every.unwrap_or(ttl_d / 3);
        if renew_every.is_zero() || renew_every >= ttl_d - margin {
            return Err(ClaimError::Config(format!(
                "renewal interval {renew_every:?} must be above zero and shorter than ttl minus margin ({:?})",
                ttl_d - margin
            )));
        }
        Ok(timing)
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
        // A second claim by this owner would get the same lease back (the contract's retry
        // rule): two tasks would then both hold one job. Refuse it here.
        let held = HeldMark::take(&self.held, &job)?;
        let t_send = Instant::now();
        let budget = timing.ttl.as_duration() - timing.margin(timing.ttl);
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
        let header = token_header(token, grant.token.as_deref())?;
        let shared = Arc::new(Shared {
            job,
            owner: self.owner.clone(),
            token,
            header,
            base: t_send,
            deadline_nanos: AtomicU64::new(0),
            lost: CancellationToken::new(),
            reason: OnceLock::new(),
        });
        shared.set_deadline(deadline);
        tracing::debug!(job = %shared.job, token = %token, "lease claimed");
        let first_renewal = t_send + timing.renew_every(grant.ttl);
        let keeper = tokio::spawn(keep(
            shared.clone(),
            self.store.clone(),
            timing,
            first_renewal,
        ));
        Ok(Lease {
            view: LeaseView { shared },
            store: self.store.clone(),
            keeper,
            _held: held,
        })
    }
}

/// The header value for a grant: the store's signed token string, exactly as given, after
/// checking it names the granted generation; or the decimal token.
fn token_header(
    token: FencingToken,
    signed: Option<&str>,
) -> Result<http::HeaderValue, ClaimError> {
    let Some(signed) = signed else {
        return Ok(http::HeaderValue::from(token.get()));
    };
    let generation = signed.split_once('.').map_or(signed, |(g, _)| g);
    if generation != token.to_string() {
        return Err(ClaimError::Store(StoreError::Protocol(format!(
            "the store granted generation {token} but signed token {signed:?}"
        ))));
    }
    http::HeaderValue::from_str(signed).map_err(|_| {
        ClaimError::Store(StoreError::Protocol(format!(
            "the signed token {signed:?} is not a valid header value"
        )))
    })
}

/// The client's timing settings, applied to each grant: a store may grant less than it was
/// asked for, and the margin and the renewal interval then follow the grant.
#[derive(Debug, Clone, Copy)]
struct Timing {
    /// The TTL asked for.
    ttl: Ttl,
    /// Set by [`LeaseClient::safety_margin`]; else 10% of the grant, at least 50 ms.
    margin: Option<Duration>,
    /// Set by [`LeaseClient::renew_every`]; else a third of the grant.
    renew_every: Option<Duration>,
}

impl Timing {
    fn margin(&self, granted: Ttl) -> Duration {
        self.margin
            .unwrap_or_else(|| (granted.as_duration() / 10).max(Duration::from_millis(50)))
    }

    /// How long after a grant was asked for to renew it: the configured interval while it
    /// fits the grant (shorter than the grant minus the margin), else a third of the grant.
    fn renew_every(&self, granted: Ttl) -> Duration {
        let granted_d = granted.as_duration();
        let fits = granted_d.saturating_sub(self.margin(granted));
        self.renew_every
            .filter(|every| *every < fits)
            .unwrap_or(granted_d / 3)
    }

    /// `t_send + granted - margin`; a grant shorter than the margin gives no time at all.
    fn deadline(&self, t_send: Instant, granted: Ttl) -> Instant {
        t_send + granted.as_duration().saturating_sub(self.margin(granted))
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
    /// What `X-Fencing-Token` carries: the server's signed string, or the decimal token.
    header: http::HeaderValue,
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
            if reason == LossReason::Finished {
                tracing::debug!(job = %self.job, token = %self.token, "lease handle finished");
            } else {
                tracing::warn!(job = %self.job, token = %self.token, %reason, "lease lost");
            }
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

    /// The token as `X-Fencing-Token` carries it (the server's signed string when it signs),
    /// while the lease is held; `None` from the moment it is lost.
    pub fn token_string(&self) -> Option<String> {
        self.token_header()
            .and_then(|h| h.to_str().ok().map(str::to_owned))
    }

    /// [`token_string`](Self::token_string) as a header value.
    pub fn token_header(&self) -> Option<http::HeaderValue> {
        self.shared.token().map(|_| self.shared.header.clone())
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
    _held: HeldMark,
}

/// A job marked as held by a live handle of its client; unmarked when dropped.
#[derive(Debug)]
struct HeldMark {
    set: Arc<std::sync::Mutex<std::collections::HashSet<JobId>>>,
    job: JobId,
}

impl HeldMark {
    fn take(
        set: &Arc<std::sync::Mutex<std::collections::HashSet<JobId>>>,
        job: &JobId,
    ) -> Result<Self, ClaimError> {
        if !set
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(job.clone())
        {
            return Err(ClaimError::AlreadyHeld { job: job.clone() });
        }
        Ok(Self {
            set: set.clone(),
            job: job.clone(),
        })
    }
}

impl Drop for HeldMark {
    fn drop(&mut self) {
        self.set
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.job);
    }
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
    first_renewal: Instant,
) {
    let retry_every = (timing.renew_every(timing.ttl) / 4)
        .clamp(Duration::from_millis(10), Duration::from_secs(1));
    let mut next = first_renewal;
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
                next = t_send + timing.renew_every(grant.ttl);
                tracing::debug!(job = %job, token = %shared.token, expires_at_ms = grant.expires_at_ms, "lease renewed");
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;

    use tower::{Service, ServiceExt, service_fn};

    use super::*;
    use crate::{BoxError, Clock, LeaseLost, ManualClock, MemoryLeaseStore, TokioClock};

    /// A store whose answers take `latency` each way and whose renewals can be stalled, as
    /// if the worker (or its network to the store) were paused.
    #[derive(Debug, Clone)]
    struct Stallable {
        inner: MemoryLeaseStore,
        latency: Duration,
        stalled: Arc<AtomicBool>,
        failing: Arc<AtomicBool>,
        /// Grants at most this, whatever was asked (a server-side cap).
        max_ttl: Ttl,
    }

    impl Stallable {
        fn new(clock: Arc<dyn Clock>, latency: Duration) -> Self {
            Self {
                inner: MemoryLeaseStore::with_clock(clock),
                latency,
                stalled: Arc::default(),
                failing: Arc::default(),
                max_ttl: Ttl::MAX,
            }
        }
    }

    impl LeaseStore for Stallable {
        async fn claim(
            &self,
            job: &JobId,
            owner: &Owner,
            ttl: Ttl,
        ) -> Result<ClaimOutcome, StoreError> {
            tokio::time::sleep(self.latency).await;
            let out = self.inner.claim(job, owner, ttl.min(self.max_ttl)).await;
            tokio::time::sleep(self.latency).await;
            out
        }
        async fn renew(
            &self,
            job: &JobId,
            owner: &Owner,
            g: Generation,
            ttl: Ttl,
        ) -> Result<RenewOutcome, StoreError> {
            if self.stalled.load(Ordering::SeqCst) {
                std::future::pending::<()>().await;
            }
            if self.failing.load(Ordering::SeqCst) {
                return Err(StoreError::Io("connection refused".into()));
            }
            tokio::time::sleep(self.latency).await;
            let out = self.inner.renew(job, owner, g, ttl.min(self.max_ttl)).await;
            tokio::time::sleep(self.latency).await;
            out
        }
        async fn release(
            &self,
            job: &JobId,
            owner: &Owner,
            g: Generation,
        ) -> Result<FinishOutcome, StoreError> {
            self.inner.release(job, owner, g).await
        }
        async fn complete(
            &self,
            job: &JobId,
            owner: &Owner,
            g: Generation,
        ) -> Result<FinishOutcome, StoreError> {
            self.inner.complete(job, owner, g).await
        }
        async fn get(&self, job: &JobId) -> Result<Option<LeaseRecord>, StoreError> {
            self.inner.get(job).await
        }
    }

    /// Stalls the worker's renewals, waits for the lease to be lost and returns the store's
    /// record then, after checking the store still saw the lease held: loss came first.
    async fn stall_until_lost(
        store: &Stallable,
        lease: &Lease<Stallable>,
        what: &str,
    ) -> crate::LeaseRecord {
        store.stalled.store(true, Ordering::SeqCst);
        lease.lost().await;
        let record = store.inner.get(&job()).await.unwrap().unwrap();
        assert_eq!(
            record.state,
            crate::LeaseState::Held,
            "{what}: store expired first"
        );
        record
    }

    fn job() -> JobId {
        "job-7".parse().unwrap()
    }

    type Echo = tower::util::ServiceFn<
        fn(
            http::Request<()>,
        ) -> std::future::Ready<Result<http::Request<()>, std::convert::Infallible>>,
    >;

    fn echo() -> Echo {
        service_fn(|req| std::future::ready(Ok(req)))
    }

    async fn send(svc: &mut crate::Fencing<Echo>) -> Result<http::Request<()>, BoxError> {
        svc.ready().await?.call(http::Request::new(())).await
    }

    /// The seed's worked example, verbatim: A claims generation 7 and pauses; after expiry B
    /// claims 8; A's completion and renewal are rejected and A's layer refuses to send.
    #[tokio::test(start_paused = true)]
    async fn worked_example() {
        let clock = Arc::new(TokioClock::new(1_700_000_000_000, 0));
        let store = Stallable::new(clock, Duration::from_millis(5));
        let ttl = Ttl::from_millis(10_000).unwrap();
        let a = LeaseClient::new(store.clone())
            .owner("worker-a".parse().unwrap())
            .ttl(ttl);
        let b = LeaseClient::new(store.clone())
            .owner("worker-b".parse().unwrap())
            .ttl(ttl);
        for _ in 0..6 {
            a.claim(job()).await.unwrap().release().await.unwrap();
        }
        let lease_a = a.claim(job()).await.unwrap();
        assert_eq!(lease_a.generation(), Generation::new(7));
        let mut http_a = crate::Fencing::new(echo(), lease_a.view());
        let sent = send(&mut http_a).await.unwrap();
        assert_eq!(sent.headers()["x-fencing-job"], "job-7");
        assert_eq!(sent.headers()["x-fencing-token"], "7");

        // A pauses: none of its renewals reach the store from now on.
        store.stalled.store(true, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_secs(11)).await;
        assert!(lease_a.is_lost());

        let lease_b = b.claim(job()).await.unwrap();
        assert_eq!(lease_b.generation(), Generation::new(8));

        // A wakes up.
        let renewal = store
            .inner
            .renew(&job(), a.owner_id(), Generation::new(7), ttl)
            .await
            .unwrap();
        assert_eq!(
            renewal,
            RenewOutcome::Lost {
                owner: Some(b.owner_id().clone()),
                generation: Generation::new(8)
            }
        );
        let err = send(&mut http_a).await.unwrap_err();
        let lost = err.downcast_ref::<LeaseLost>().expect("a LeaseLost error");
        assert_eq!(
            (lost.generation, &lost.reason),
            (Generation::new(7), &LossReason::DeadlinePassed)
        );
        match lease_a.complete().await.unwrap_err() {
            FinishError::Lost { owner, generation } => {
                assert_eq!(
                    (owner.as_ref(), generation),
                    (Some(b.owner_id()), Generation::new(8))
                );
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(lease_b.token().unwrap().get(), 8);
    }

    /// The lost signal fires no later than the store-side expiry, for TTLs from 100 ms to
    /// 1 h and store clocks up to an hour ahead of or behind the worker, with latency on the
    /// way to the store and back.
    #[tokio::test(start_paused = true)]
    async fn lost_fires_before_store_expiry_whatever_the_ttl_and_clock_offset() {
        const HOUR: i64 = 3_600_000;
        for ttl_ms in [100, 250, 1_000, 30_000, 600_000, 3_600_000] {
            for offset in [-HOUR, -1, 0, 1, HOUR] {
                let clock = Arc::new(TokioClock::new(1_700_000_000_000, offset));
                let latency = Duration::from_millis(ttl_ms / 20);
                let store = Stallable::new(clock.clone(), latency);
                let ttl = Ttl::from_millis(ttl_ms).unwrap();
                let lease = LeaseClient::new(store.clone())
                    .ttl(ttl)
                    .claim(job())
                    .await
                    .unwrap();
                // Let a few renewals succeed, then stall the worker.
                tokio::time::sleep(ttl.as_duration() * 2).await;
                assert!(!lease.is_lost(), "ttl {ttl_ms}: renewals should keep it");
                let record =
                    stall_until_lost(&store, &lease, &format!("ttl {ttl_ms} offset {offset}"))
                        .await;
                // Lost at t_send + ttl - margin; the store expires at t_send + latency + ttl.
                let ahead = u64::try_from(record.expires_in.as_millis()).unwrap();
                let want = (ttl_ms / 10).max(50) + ttl_ms / 20;
                assert!(
                    ahead >= want,
                    "ttl {ttl_ms} offset {offset}: lost only {ahead} ms before expiry (want {want})"
                );
                assert_eq!(lease.token(), None);
                assert_eq!(lease.loss_reason(), Some(LossReason::DeadlinePassed));
            }
        }
    }

    /// A store that grants less than was asked (a server-side cap) gets renewals on the
    /// grant's schedule, and loss still fires before its expiry.
    #[tokio::test(start_paused = true)]
    async fn a_grant_shorter_than_asked_is_renewed_in_time_and_lost_before_it_ends() {
        let clock = Arc::new(TokioClock::new(1_700_000_000_000, 0));
        let mut store = Stallable::new(clock, Duration::from_millis(5));
        store.max_ttl = Ttl::from_millis(1_000).unwrap();
        let lease = LeaseClient::new(store.clone())
            .ttl(Ttl::from_millis(60_000).unwrap())
            .claim(job())
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(20)).await;
        assert!(
            !lease.is_lost(),
            "lost a 1 s grant renewed on a 60 s schedule: {:?}",
            lease.loss_reason()
        );
        let record = stall_until_lost(&store, &lease, "1 s grant").await;
        assert!(
            record.expires_in >= Duration::from_millis(100),
            "{record:?}"
        );
    }

    /// A renewal answered `Lost` loses the lease at once, before the local deadline.
    #[tokio::test(start_paused = true)]
    async fn superseded_renewal_loses_at_once() {
        let clock = Arc::new(ManualClock::new(1_700_000_000_000));
        let store = MemoryLeaseStore::with_clock(clock.clone());
        let ttl = Ttl::from_millis(3_000).unwrap();
        let lease = LeaseClient::new(store.clone())
            .ttl(ttl)
            .claim(job())
            .await
            .unwrap();
        // The store's clock jumps past expiry (the worker's does not) and B claims.
        clock.advance(Duration::from_secs(4));
        let b: Owner = "b".parse().unwrap();
        assert!(matches!(
            store.claim(&job(), &b, ttl).await.unwrap(),
            ClaimOutcome::Granted(_)
        ));
        assert!(lease.token().is_some(), "the worker cannot know yet");
        lease.lost().await;
        assert_eq!(
            lease.loss_reason(),
            Some(LossReason::Superseded {
                owner: Some(b),
                generation: Generation::new(2)
            })
        );
        assert!(
            Instant::now() < lease.deadline(),
            "lost by the store's answer, before the deadline"
        );
    }

    /// Store errors are retried until the local deadline, which they never extend.
    #[tokio::test(start_paused = true)]
    async fn failing_renewals_count_toward_the_deadline() {
        let store = Stallable::new(Arc::new(TokioClock::new(0, 0)), Duration::ZERO);
        store.failing.store(true, Ordering::SeqCst);
        let start = Instant::now();
        let lease = LeaseClient::new(store)
            .ttl(Ttl::from_millis(1_000).unwrap())
            .claim(job())
            .await
            .unwrap();
        lease.lost().await;
        assert_eq!(
            start.elapsed(),
            Duration::from_millis(900),
            "deadline = sent + ttl - 10%"
        );
        assert_eq!(lease.loss_reason(), Some(LossReason::DeadlinePassed));
    }

    /// A store that fails for a while is survived when a retry succeeds before the deadline.
    #[tokio::test(start_paused = true)]
    async fn a_retry_that_succeeds_in_time_keeps_the_lease() {
        let store = Stallable::new(Arc::new(TokioClock::new(0, 0)), Duration::ZERO);
        let lease = LeaseClient::new(store.clone())
            .ttl(Ttl::from_millis(1_000).unwrap())
            .claim(job())
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(5)).await;
        store.failing.store(true, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(500)).await;
        store.failing.store(false, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(lease.token().map(FencingToken::get), Some(1));
        lease.release().await.unwrap();
    }

    #[tokio::test]
    async fn finishing_or_dropping_stops_the_layer_at_once() {
        let client = LeaseClient::new(MemoryLeaseStore::new());
        let lease = client.claim(job()).await.unwrap();
        let view = lease.view();
        let mut svc = crate::Fencing::new(echo(), view.clone());
        assert!(send(&mut svc).await.is_ok());
        lease.release().await.unwrap();
        assert!(send(&mut svc).await.unwrap_err().is::<LeaseLost>());
        assert_eq!(view.loss_reason(), Some(LossReason::Finished));

        let lease = client.claim(job()).await.unwrap();
        let view = lease.view();
        drop(lease);
        assert!(view.is_lost());
    }

    #[tokio::test]
    async fn one_client_cannot_hold_one_job_twice() {
        let client = LeaseClient::new(MemoryLeaseStore::new());
        let first = client.claim(job()).await.unwrap();
        let shared = client.clone();
        assert!(matches!(
            shared.claim(job()).await,
            Err(ClaimError::AlreadyHeld { .. })
        ));
        first.release().await.unwrap();
        let again = shared.claim(job()).await.unwrap();
        assert_eq!(again.generation(), Generation::new(2));
    }

    #[tokio::test]
    async fn timing_that_cannot_work_is_refused() {
        let ttl = Ttl::from_millis(100).unwrap();
        let base = LeaseClient::new(MemoryLeaseStore::new()).ttl(ttl);
        let too_wide = base.clone().safety_margin(Duration::from_millis(100));
        let e = too_wide.claim(job()).await.unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid lease timing: safety margin 100ms is not shorter than the ttl 100ms"
        );
        let too_slow = base.clone().renew_every(Duration::from_millis(60));
        assert!(matches!(
            too_slow.claim(job()).await,
            Err(ClaimError::Config(_))
        ));
        // The default at 100 ms: margin 50 ms, renewal every 33 ms.
        assert!(base.claim(job()).await.is_ok());
    }
}
