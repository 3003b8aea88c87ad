//! A held lease: its keeper renews it, and it knows the moment it can no longer be trusted.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use fence_lease::{LeaseClient, MemoryLeaseStore};
//!
//! let lease = LeaseClient::new(MemoryLeaseStore::new()).claim("invoice-42".parse()?).await?;
//! tokio::select! {
//!     _ = lease.lost() => return Ok(()), // stop producing effects at once; never complete
//!     _ = async {
//!         // Each effect sends the token as it is then (a signed one changes at each renewal),
//!         // or goes through `lease.fencing_layer()`; `None` once lost: send nothing more.
//!         let Some(_token) = lease.token_string() else { return };
//!     } => {}
//! }
//! if !lease.is_lost() { lease.complete().await?; } // the store would take it after a loss
//! # Ok(()) }
//! ```
//!
//! # The local deadline
//! The worker takes `t_send = Instant::now()` before it sends a claim or renew. When the store
//! grants TTL `T`, the worker believes it holds the lease until `t_send + T - margin`, on its
//! own monotonic clock. Time in flight and in the store only shortens that view, and no offset
//! between the worker's and the store's wall clocks enters the arithmetic; the margin (default
//! 10% of `T`, at least 50 ms) covers a worker clock that runs slow. When the deadline passes
//! before a renewal succeeds, or a renewal answers `Lost`, the lease is lost, once and for all:
//! [`Lease::lost`] resolves, [`Lease::token`] returns `None` and
//! [`FencingLayer`](crate::FencingLayer) refuses to send. The three read one flag.

use std::{
    collections::HashSet,
    fmt,
    sync::{
        Arc, Mutex, OnceLock,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use fence_core::{
    FencingToken, Generation, JobId, Owner, Ttl, lease_api::Checkpoint, secret::LeaseKey,
};
use tokio::{sync::watch, task::JoinHandle, time::Instant};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use crate::{Backoff, LeaseStore, Outcome, StoreError};

mod checkpoint;
pub use checkpoint::Checkpointer;
mod finish;
pub use finish::FinishError;
mod timing;

pub(crate) use timing::Timing;
pub use timing::TimingError;

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
    /// The store refused this lease's key: something else holds the job under our owner
    /// and generation, so this handle cannot be sure of anything.
    KeyRefused,
    /// The worker reported no progress ([`LeaseView::progress`]) for longer than the client's
    /// [`progress_within`](crate::LeaseClient::progress_within): the keeper stopped renewing.
    NoProgress {
        /// The interval that passed without progress.
        within: Duration,
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
            Self::KeyRefused => f.write_str("the store refused this lease's key"),
            Self::NoProgress { within } => write!(
                f,
                "the worker reported no progress for {within:?}; renewals stopped"
            ),
            Self::Finished => f.write_str("the lease was released, completed or dropped"),
        }
    }
}

#[derive(Debug)]
struct Shared {
    job: JobId,
    owner: Owner,
    /// The secret this lease was claimed with; renew, release and complete need it.
    key: LeaseKey,
    token: FencingToken,
    /// What `X-Fencing-Token` carries: the server's latest signed string (each renewal signs
    /// a new one), or the decimal token.
    header: watch::Sender<http::HeaderValue>,
    base: Instant,
    deadline_nanos: AtomicU64,
    /// The last granted renewal's (or the claim's) send time plus its TTL, in nanoseconds
    /// since `base`: the store cannot end the lease before (it counts from receiving it).
    store_end_nanos: AtomicU64,
    /// When the worker last reported progress (the grant's arrival counts), in nanoseconds
    /// since `base`.
    progress_nanos: AtomicU64,
    lost: CancellationToken,
    reason: OnceLock<LossReason>,
}

impl Shared {
    fn deadline(&self) -> Instant {
        self.base + Duration::from_nanos(self.deadline_nanos.load(Ordering::Acquire))
    }

    fn last_progress(&self) -> Instant {
        self.base + Duration::from_nanos(self.progress_nanos.load(Ordering::Acquire))
    }

    /// The local deadline and the earliest end at the store of a grant of `ttl` asked for at
    /// `t_send`.
    fn set_deadline(&self, deadline: Instant, t_send: Instant, ttl: Ttl) {
        let nanos = |at: Instant| {
            u64::try_from(at.saturating_duration_since(self.base).as_nanos()).unwrap_or(u64::MAX)
        };
        self.store_end_nanos
            .store(nanos(t_send + ttl.as_duration()), Ordering::Release);
        self.deadline_nanos
            .store(nanos(deadline), Ordering::Release);
    }

    /// The one place a lease is declared lost. Final: nothing un-loses it.
    fn lose(&self, reason: LossReason) {
        if self.reason.set(reason.clone()).is_ok() {
            if reason == LossReason::Finished {
                tracing::debug!(job = %self.job, generation = self.token.get(), "lease handle finished");
            } else {
                tracing::warn!(job = %self.job, generation = self.token.get(), %reason, "lease lost");
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

/// A read-only view of a lease: what [`FencingLayer`](crate::FencingLayer) and other observers hold.
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
        self.shared
            .token()
            .map(|_| self.shared.header.borrow().clone())
    }

    /// The token strings this lease sends, as they change (a renewal of a signed lease signs
    /// a new one): each change once, until the lease is lost.
    pub fn tokens(&self) -> TokenUpdates {
        TokenUpdates {
            changes: self.shared.header.subscribe(),
            lost: Box::pin(self.shared.lost.clone().cancelled_owned()),
        }
    }

    /// Reports that the worker is making progress. With the client's
    /// [`progress_within`](crate::LeaseClient::progress_within), the keeper renews only while
    /// this was called within that interval (the grant counts as the first report); a worker
    /// that hangs or live-locks then loses its lease like any other loss, and the lease
    /// expires at the store. Without it, this does nothing. Cheap: one atomic store.
    pub fn progress(&self) {
        let shared = &self.shared;
        let nanos = u64::try_from(
            Instant::now()
                .saturating_duration_since(shared.base)
                .as_nanos(),
        )
        .unwrap_or(u64::MAX);
        shared.progress_nanos.fetch_max(nanos, Ordering::AcqRel);
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

    /// The earliest instant the store can end this lease if it is not renewed again: the last
    /// granted claim's or renewal's send time plus its TTL (the store counts from when it received
    /// it, later; a lock-delay adds to it). Between the local [`deadline`](Self::deadline) and this
    /// instant lies the safety margin: what a worker has to stop its effects in once the deadline
    /// passed, before anyone else can hold the job.
    pub fn earliest_store_expiry(&self) -> Instant {
        self.shared.base + Duration::from_nanos(self.shared.store_end_nanos.load(Ordering::Acquire))
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

/// The token strings of a lease as they change: see [`LeaseView::tokens`].
#[derive(Debug)]
pub struct TokenUpdates {
    changes: watch::Receiver<http::HeaderValue>,
    lost: std::pin::Pin<Box<WaitForCancellationFutureOwned>>,
}

impl TokenUpdates {
    /// The next token string, or `None` once the lease is lost (also when a change came
    /// before the loss and was not taken yet: a token the lease no longer backs is never
    /// handed out).
    pub async fn next(&mut self) -> Option<String> {
        tokio::select! {
            // The loss first: a token file would otherwise be rewritten with a token after it.
            biased;
            () = self.lost.as_mut() => None,
            changed = self.changes.changed() => {
                changed.ok()?;
                self.changes.borrow_and_update().to_str().ok().map(str::to_owned)
            }
        }
    }
}

/// The header value for a grant: the store's signed token string, exactly as given, after
/// checking it names the granted generation; or the decimal token.
pub(crate) fn token_header(
    token: FencingToken,
    signed: Option<&str>,
) -> Result<http::HeaderValue, StoreError> {
    let Some(signed) = signed else {
        return Ok(http::HeaderValue::from(token.get()));
    };
    let generation = signed.split_once('.').map_or(signed, |(g, _)| g);
    if generation != token.to_string() {
        return Err(StoreError::Protocol(format!(
            "the store granted generation {token} but signed token {signed:?}"
        )));
    }
    http::HeaderValue::from_str(signed).map_err(|_| {
        StoreError::Protocol(format!(
            "the signed token {signed:?} is not a valid header value"
        ))
    })
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
    /// The checkpoint the claim returned (contract section 14).
    resumed: Option<Checkpoint>,
    _held: HeldMark,
}

/// The jobs held by live handles of one client (shared by its clones).
pub(crate) type HeldJobs = Arc<Mutex<HashSet<JobId>>>;

/// A job marked as held by a live handle of its client; unmarked when dropped.
#[derive(Debug)]
pub(crate) struct HeldMark {
    set: HeldJobs,
    job: JobId,
}

impl HeldMark {
    /// Marks `job`; `None` when a live handle holds it already.
    pub(crate) fn take(set: &HeldJobs, job: &JobId) -> Option<Self> {
        let fresh = set
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(job.clone());
        fresh.then(|| Self {
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

impl<S: LeaseStore> Lease<S> {
    /// A lease granted at `t_send` (when the claim was sent), with its keeper started.
    pub(crate) fn start(store: Arc<S>, granted: Granted, timing: Timing, held: HeldMark) -> Self {
        let Granted {
            job,
            owner,
            key,
            token,
            header,
            t_send,
            ttl,
            checkpoint,
        } = granted;
        let shared = Arc::new(Shared {
            job,
            owner,
            key,
            token,
            header: watch::Sender::new(header),
            base: t_send,
            deadline_nanos: AtomicU64::new(0),
            store_end_nanos: AtomicU64::new(0),
            // The grant counts as progress, at its arrival: a claim that waited for the job
            // (sent long before) still has its whole interval to report from here.
            progress_nanos: AtomicU64::new(
                u64::try_from(Instant::now().saturating_duration_since(t_send).as_nanos())
                    .unwrap_or(u64::MAX),
            ),
            lost: CancellationToken::new(),
            reason: OnceLock::new(),
        });
        shared.set_deadline(timing.deadline(t_send, ttl), t_send, ttl);
        tracing::debug!(job = %shared.job, token = %token, "lease claimed");
        let first_renewal = t_send + timing.renew_every(ttl);
        let keeper = tokio::spawn(keep(
            shared.clone(),
            store.clone(),
            timing,
            first_renewal,
            ttl,
        ));
        Self {
            view: LeaseView { shared },
            store,
            keeper,
            resumed: checkpoint,
            _held: held,
        }
    }
}

/// What a granted claim gave, for [`Lease::start`].
pub(crate) struct Granted {
    pub(crate) job: JobId,
    pub(crate) owner: Owner,
    pub(crate) key: LeaseKey,
    pub(crate) token: FencingToken,
    /// What `X-Fencing-Token` carries.
    pub(crate) header: http::HeaderValue,
    /// When the claim was sent, on this process's monotonic clock.
    pub(crate) t_send: Instant,
    /// The TTL the store granted.
    pub(crate) ttl: Ttl,
    /// The job's last checkpoint, as the claim returned it.
    pub(crate) checkpoint: Option<Checkpoint>,
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

/// Renews until lost. The deadline bounds every wait, so loss fires on time even while a
/// renewal hangs.
async fn keep<S: LeaseStore>(
    shared: Arc<Shared>,
    store: Arc<S>,
    timing: Timing,
    first_renewal: Instant,
    mut granted: Ttl,
) {
    // Failed renewals are retried until the deadline at a steady pace set by the last grant
    // (a growing pause could skip the last chance before the deadline), with jitter, so many
    // workers do not all retry at once when a store comes back; and never later than halfway
    // to the deadline, so a pause drawn long still leaves chances before it.
    let pace = |granted| Backoff::new(timing.retry_pace(granted), timing.retry_pace(granted));
    let mut retries = pace(granted);
    let retry_at = |retries: &mut Backoff, deadline: Instant| {
        let now = Instant::now();
        let half_left = deadline.saturating_duration_since(now) / 2;
        now + retries
            .next_pause()
            .min(half_left.max(Duration::from_millis(10)))
    };
    let mut next = first_renewal;
    let (job, owner, generation, key) = (
        &shared.job,
        &shared.owner,
        shared.token.generation(),
        &shared.key,
    );
    loop {
        let deadline = shared.deadline();
        // Awake when progress is due too, not only at the next renewal: with a long TTL,
        // a hung worker would otherwise be noticed (and stopped) up to a renewal interval
        // late, and renewed meanwhile.
        let due = timing
            .progress_within
            .and_then(|within| shared.last_progress().checked_add(within));
        let wake = due.map_or(next, |due| next.min(due)).min(deadline);
        tokio::select! {
            () = shared.lost.cancelled() => return,
            () = tokio::time::sleep_until(wake) => {}
        }
        let now = Instant::now();
        if now >= deadline {
            return shared.lose(LossReason::DeadlinePassed);
        }
        // A worker that stopped reporting progress is hung or live-locked: no more renewals.
        // The lease is not released: it expires at the store (and any lock-delay follows).
        if let Some(within) = timing.progress_within
            && shared
                .last_progress()
                .checked_add(within)
                .is_some_and(|due| due <= now)
        {
            return shared.lose(LossReason::NoProgress { within });
        }
        if now < next {
            continue; // woken for progress that came meanwhile: not time to renew yet
        }
        let t_send = Instant::now();
        // Each attempt has its own time: a black-holed connection is abandoned and asked
        // again (a renewal is safe to repeat; another server gets its chance). A renewal
        // interval, or half the time left when longer: a store slower than a short interval
        // still gets its answers in, not each attempt cut and sent again.
        let left = deadline.saturating_duration_since(t_send);
        let attempt_end = deadline.min(t_send + timing.renew_every(granted).max(left / 2));
        let renewal = tokio::select! {
            () = shared.lost.cancelled() => return,
            r = tokio::time::timeout_at(attempt_end, store.renew(job, owner, generation, key, timing.ttl)) => r,
        };
        match renewal {
            Err(_elapsed) if Instant::now() >= deadline => {
                return shared.lose(LossReason::DeadlinePassed);
            }
            Err(_elapsed) => {
                tracing::warn!(job = %job, "a lease renewal did not answer in time; asking again");
                next = Instant::now();
            }
            Ok(Ok(Outcome::Granted(grant))) => {
                granted = timing.counted(grant.ttl);
                retries = pace(granted);
                // Loss is final: a renewal that answers after the deadline changes nothing.
                if shared.token().is_none() {
                    return;
                }
                shared.set_deadline(timing.deadline(t_send, granted), t_send, granted);
                next = t_send + timing.renew_every(granted);
                if let Some(signed) = grant.token.as_deref() {
                    match token_header(shared.token, Some(signed)) {
                        Ok(header) => {
                            shared.header.send_if_modified(|current| {
                                let changed = *current != header;
                                *current = header;
                                changed
                            });
                        }
                        Err(error) => {
                            tracing::warn!(job = %job, %error, "a renewal's token is unusable; sending the previous one")
                        }
                    }
                }
                tracing::debug!(job = %job, token = %shared.token, expires_at_ms = grant.expires_at_ms, "lease renewed");
            }
            Ok(Ok(Outcome::Lost { owner, generation })) => {
                return shared.lose(LossReason::Superseded { owner, generation });
            }
            Ok(Ok(Outcome::KeyMismatch)) => return shared.lose(LossReason::KeyRefused),
            Ok(Ok(other)) => {
                let error = StoreError::Protocol(format!("a renewal was answered with {other:?}"));
                tracing::warn!(job = %job, error = %error, "lease renewal failed; retrying until the local deadline");
                next = retry_at(&mut retries, deadline);
            }
            Ok(Err(error)) => {
                tracing::warn!(job = %job, error = %fence_storage::error_chain(&error), "lease renewal failed; retrying until the local deadline");
                next = retry_at(&mut retries, deadline);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::sync::watch;
    use tokio_util::sync::CancellationToken;

    use super::TokenUpdates;

    /// A change not yet taken when the lease is lost is never handed out: the loss wins,
    /// every time (an unbiased select picked the change about half the time).
    #[tokio::test]
    async fn no_token_is_handed_out_after_the_loss() {
        for _ in 0..64 {
            let header = watch::Sender::new(http::HeaderValue::from_static("1.old"));
            let lost = CancellationToken::new();
            let mut updates = TokenUpdates {
                changes: header.subscribe(),
                lost: Box::pin(lost.clone().cancelled_owned()),
            };
            header.send_replace(http::HeaderValue::from_static("1.new"));
            lost.cancel();
            assert_eq!(updates.next().await, None);
        }
    }
}
