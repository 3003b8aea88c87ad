//! The worker's client of a lease store: claims a job and hands back a kept [`Lease`].
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use fence_lease::{LeaseClient, MemoryLeaseStore, Ttl};
//!
//! let client = LeaseClient::new(MemoryLeaseStore::new()).ttl(Ttl::from_millis(10_000)?);
//! let lease = client.claim("invoice-42".parse()?).await?;
//! assert_eq!(lease.token().expect("held").get(), 1);
//! lease.complete().await?;
//! # Ok(()) }
//! ```

mod error;
mod unsettled;

pub use error::ClaimError;
use error::granted;

use std::{sync::Arc, time::Duration};

use fence_core::{Generation, JobId, Owner, Ttl, secret::LeaseKey};
use tokio::time::Instant;

use crate::{
    LeaseStore, Outcome, SlotClaim, StoreError, default_owner,
    lease::{Granted, HeldJobs, HeldMark, Lease, Timing, token_header},
};

/// Claims leases from a store for one owner.
#[derive(Debug)]
pub struct LeaseClient<S> {
    store: Arc<S>,
    owner: Owner,
    ttl: Ttl,
    lock_delay: Option<Duration>,
    renew_every: Option<Duration>,
    margin: Option<Duration>,
    progress_within: Option<Duration>,
    /// Jobs held by live handles of this owner (shared by clones).
    held: HeldJobs,
    /// Keys of claims whose answers were lost, for the next claim of their jobs.
    unsettled: Arc<unsettled::Unsettled>,
}

impl<S> Clone for LeaseClient<S> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            owner: self.owner.clone(),
            ttl: self.ttl,
            lock_delay: self.lock_delay,
            renew_every: self.renew_every,
            progress_within: self.progress_within,
            margin: self.margin,
            held: self.held.clone(),
            unsettled: self.unsettled.clone(),
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
            lock_delay: None,
            renew_every: None,
            progress_within: None,
            margin: None,
            held: Arc::default(),
            unsettled: Arc::default(),
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

    /// Claims with a lock-delay of `delay` instead of the store's default: if a lease of this
    /// client *expires* (its holder stalled or died, rather than released or completed it),
    /// nobody can claim the job until `delay` after the lease's end (contract section 12).
    /// For effects the fence cannot reach; longer than [`Ttl::MAX`] counts as [`Ttl::MAX`].
    pub fn lock_delay(mut self, delay: Duration) -> Self {
        self.lock_delay = Some(delay.min(Ttl::MAX.as_duration()));
        self
    }

    /// Binds renewals to progress: the keeper renews a lease only while the worker called
    /// [`progress`](crate::LeaseView::progress) within `within` (the grant counts as the first
    /// call, at its arrival: a claim that waited keeps its whole interval). A worker that
    /// hangs or live-locks, still alive but no longer advancing, then
    /// loses its lease ([`LossReason::NoProgress`](crate::LossReason::NoProgress)) the moment
    /// progress is due (`within` after the last report), not at the next renewal; it is not
    /// renewed meanwhile, and the lease expires at the store. Off by
    /// default: without it the keeper renews for as long as the process lives. Choose
    /// `within` longer than the longest step between two reports (at most 24 h: longer
    /// counts as 24 h).
    pub fn progress_within(mut self, within: Duration) -> Self {
        self.progress_within = Some(within.min(Ttl::MAX.as_duration()));
        self
    }

    /// Renews every `every` instead of every `ttl / 3` (or halfway to the local deadline, when
    /// a fixed margin leaves less of a shorter grant).
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

    /// Claims `job` and starts a keeper task that renews it in the background.
    ///
    /// When a claim's answer is lost (an I/O error, a timeout, a 502, 503 or 504) or its
    /// future is dropped before it settles (the caller's own timeout, a cancelled task), it
    /// may have been granted: the next claim of the job by this client or its clones, within
    /// the TTL, asks with the same lease key, so that grant comes back rather than the job
    /// being reported held, by this owner, until it expires. A grant this client will not use
    /// (no longer than the safety margin, come after the local deadline, or not renewed after
    /// a long wait) is released in the background.
    ///
    /// Must be called within a tokio runtime.
    ///
    /// # Errors
    /// [`ClaimError::Held`] while another owner holds it, [`ClaimError::Completed`] once the
    /// job is completed, [`ClaimError::Store`] when the store fails or does not answer before
    /// the lease would have been useless, [`ClaimError::Timing`] for a margin or renewal
    /// interval that does not fit the TTL.
    pub async fn claim(&self, job: JobId) -> Result<Lease<S>, ClaimError> {
        self.claim_waiting(job, Duration::ZERO).await
    }

    /// [`claim`](Self::claim), waiting up to `wait` while another owner holds the job: the
    /// lease comes the moment the job frees (released, expired, revoked), ahead of later
    /// waiters when the store is a lease server (its waiting claims, contract section 11);
    /// other stores are polled. [`ClaimError::Held`] only once the wait is over.
    ///
    /// The lease's local deadline still runs from when the claim was sent, so a claim that
    /// waited long is renewed once at once, and the lease's deadline runs from that renewal.
    ///
    /// # Errors
    /// As [`claim`](Self::claim); and, from a lease server whose waiting places stayed full
    /// (429 too-many-waiters) until the wait ended with the job still held,
    /// [`ClaimError::Store`] of [`StoreError::TooManyWaiters`]: held, as
    /// [`ClaimError::Held`] would say, but the claim never got to wait in line.
    pub async fn claim_waiting(&self, job: JobId, wait: Duration) -> Result<Lease<S>, ClaimError> {
        let timing = Timing::new(self.ttl, self.margin, self.renew_every)?
            .with_progress(self.progress_within)?;
        // A second claim by this owner would get the same lease back (the contract's retry
        // rule): two tasks would then both hold one job. Refuse it here.
        let held = HeldMark::take(&self.held, &job)
            .ok_or_else(|| ClaimError::AlreadyHeld { job: job.clone() })?;
        // The key of an earlier claim of this job whose answer was lost: if it was granted,
        // this claim gets that lease back instead of being told the job is held (by us).
        let key = match self.unsettled.take(&job) {
            Some(key) => key,
            None => crate::new_lease_key().map_err(|e| ClaimError::Store(StoreError::io(e)))?,
        };
        // Kept for the next claim of the job unless this claim settles: its answer lost or its
        // caller gone mid-claim (a timeout, a cancelled task), a lease it won may be held, and
        // that claim asked with this key gets it back.
        let mut pending = unsettled::Pending::new(
            self.unsettled.clone(),
            job.clone(),
            key.clone(),
            self.ttl.as_duration(),
        );
        let t_send = Instant::now();
        let budget = timing.ttl.as_duration() - timing.margin(timing.ttl);
        let terms = crate::ClaimTerms {
            ttl: self.ttl,
            lock_delay: self.lock_delay,
        };
        let claim = async {
            if wait.is_zero() {
                self.store.apply(&job, terms.op(&self.owner, &key)).await
            } else {
                let store = &self.store;
                store
                    .claim_waiting(&job, &self.owner, &key, terms, wait)
                    .await
            }
        };
        let limit = budget.saturating_add(wait);
        let outcome = tokio::time::timeout(limit, claim)
            .await
            .unwrap_or(Err(StoreError::Timeout(limit)));
        if outcome.as_ref().is_err_and(|e| !e.answer_lost()) {
            pending.settle(); // refused before any decision
        }
        let grant = granted(&job, outcome?).inspect_err(|_| pending.settle())?;
        let lease = self
            .after_grant(job, key, grant, t_send, timing, held)
            .await;
        // Granted: the key is the lease's now, or, for a grant abandoned, not to be reused (a
        // release of it may land after a claim that got the grant back with it).
        pending.settle();
        lease
    }

    /// Claims a slot of the semaphore `resource` with `slots` slots (contract section 15)
    /// and starts its keeper: the lease is the slot's, on job `resource#k`, its fencing job;
    /// renewals, release and checkpoints go to that job like any lease's. At most `slots`
    /// leases of the resource exist at once; the number of slots is fixed while any slot has
    /// a holder, or was revoked before its lease would have ended. Waits up to `wait` while every slot is taken, asking again as slots are due
    /// to free (every 10 ms to 500 ms, with jitter); within `wait`, a claim whose answer was lost (an I/O
    /// error, a timeout, or a 502, 503 or 504 after its `Retry-After`) is asked again with
    /// the same lease key, so a grant that was lost comes back as that slot, not a second one.
    ///
    /// # Errors
    /// [`ClaimError::Held`] naming the slot that frees first when every slot is still taken
    /// after `wait` (or [`ClaimError::LockDelay`] when that slot's delay runs),
    /// [`ClaimError::SemaphoreSize`] while slots are held under another number of slots;
    /// otherwise as [`claim`](Self::claim).
    pub async fn claim_slot(
        &self,
        resource: JobId,
        slots: u32,
        wait: Duration,
    ) -> Result<Lease<S>, ClaimError> {
        crate::store::check_slot_claim(&resource, slots)?;
        let timing = Timing::new(self.ttl, self.margin, self.renew_every)?
            .with_progress(self.progress_within)?;
        let key = crate::new_lease_key().map_err(|e| ClaimError::Store(StoreError::io(e)))?;
        let t_send = Instant::now();
        let budget = timing.ttl.as_duration() - timing.margin(timing.ttl);
        let terms = crate::ClaimTerms {
            ttl: self.ttl,
            lock_delay: self.lock_delay,
        };
        let end = crate::later(t_send, wait);
        let claim = async {
            let mut backoff = crate::Backoff::new(MIN_SLOT_POLL, MAX_SLOT_POLL);
            // An answer lost on the way (it may have been a grant), until a later answer
            // settles it.
            let mut lost = None;
            loop {
                let asked = self
                    .store
                    .claim_slot(&resource, &self.owner, &key, terms, slots)
                    .await;
                let now = Instant::now();
                let again_in = match &asked {
                    // Every slot taken: ask again, at the latest when the first frees, and
                    // not at once (a refusal that does not say when reads as "now").
                    Ok(SlotClaim {
                        outcome: Outcome::Held { expires_in, .. },
                        ..
                    }) => Some(backoff.next_pause().min(*expires_in).max(MIN_SLOT_POLL)),
                    // The answer was lost, and it may have been a grant: ask again with the
                    // same key, which gets that slot back rather than a second one.
                    Err(StoreError::Io(_) | StoreError::Timeout(_)) => {
                        Some(backoff.next_pause().min(MAX_SLOT_POLL))
                    }
                    // An in-process store with claims queued before this one: nothing was
                    // decided, ask again.
                    Err(StoreError::Busy(_)) => Some(backoff.next_pause().min(MAX_SLOT_POLL)),
                    // The same from a 502, 503 or 504, after its `Retry-After` when longer.
                    Err(StoreError::Unavailable { retry_after, .. }) => {
                        Some(backoff.next_pause().max(retry_after.unwrap_or_default()))
                    }
                    _ => None,
                };
                match again_in {
                    Some(pause) if now < end => {
                        if matches!(
                            asked,
                            Err(StoreError::Io(_)
                                | StoreError::Timeout(_)
                                | StoreError::Unavailable { .. })
                        ) {
                            // The first loss stands: a later 503 may be the server's "busy".
                            lost = lost.or(asked.err());
                        } else if asked.is_ok() {
                            lost = None; // answered: the key's slot, if any, came back
                        }
                        tokio::time::sleep(pause.min(end - now)).await;
                    }
                    // A claim that ends busy after an answer lost says the loss: the lost
                    // one may have been granted, which "nothing was decided" would hide
                    // (over HTTP, busy is a 503).
                    _ => {
                        return match (asked, lost) {
                            (
                                Err(StoreError::Busy(_) | StoreError::Unavailable { .. }),
                                Some(lost),
                            ) => Err(lost),
                            (asked, _) => asked,
                        };
                    }
                }
            }
        };
        let limit = budget.saturating_add(wait);
        let claim = tokio::time::timeout(limit, claim)
            .await
            .map_err(|_| ClaimError::Store(StoreError::Timeout(limit)))??;
        if let Outcome::SemaphoreSize { slots: in_force } = claim.outcome {
            return Err(ClaimError::SemaphoreSize {
                resource,
                asked: slots,
                in_force,
            });
        }
        let Some(slot) = claim.slot else {
            return Err(ClaimError::Store(StoreError::Protocol(format!(
                "a semaphore claim was answered with {:?} and no slot",
                claim.outcome
            ))));
        };
        let job = fence_core::lease_api::slot_job(&resource, slot);
        let grant = granted(&job, claim.outcome)?;
        let Some(held) = HeldMark::take(&self.held, &job) else {
            // Not ours to keep twice: give the slot just granted back rather than let it
            // stand idle until it expires.
            let release = self
                .store
                .release(&job, &self.owner, grant.generation, &key);
            let _ = tokio::time::timeout(budget, release).await;
            return Err(ClaimError::AlreadyHeld { job });
        };
        self.after_grant(job, key, grant, t_send, timing, held)
            .await
    }

    /// The lease of a claim granted `grant` (asked for at `t_send`); after a long wait it is
    /// renewed first, so its local deadline runs from a known send.
    async fn after_grant(
        &self,
        job: JobId,
        key: LeaseKey,
        mut grant: crate::Grant,
        t_send: Instant,
        timing: Timing,
        held: HeldMark,
    ) -> Result<Lease<S>, ClaimError> {
        let budget = timing.ttl.as_duration() - timing.margin(timing.ttl);
        // Granted after a long wait: how long the lease has left on the server is unknown
        // here (only that it started after t_send), so renew now and count from this send.
        // "Long" against the grant's own time (a store may grant less than was asked): a
        // capped grant that came at once is not renewed at once.
        let generation = grant.generation;
        let renewed = async {
            let deadline = timing.deadline(t_send, timing.counted(grant.ttl));
            let left = deadline.saturating_duration_since(Instant::now());
            if left >= deadline.saturating_duration_since(t_send) * 2 / 3 {
                return Ok((grant, t_send));
            }
            let t_send = Instant::now();
            let renew = self
                .store
                .renew(&job, &self.owner, grant.generation, &key, self.ttl);
            match tokio::time::timeout(budget, renew).await {
                Ok(Ok(Outcome::Granted(mut g))) => {
                    // The checkpoint comes with the claim, not the renewal.
                    g.checkpoint = grant.checkpoint.take();
                    Ok((g, t_send))
                }
                Ok(Ok(other)) => Err(ClaimError::Store(StoreError::Protocol(format!(
                    "the renewal right after a waiting claim was answered with {other:?}"
                )))),
                Ok(Err(e)) => Err(ClaimError::Store(e)),
                Err(_) => Err(ClaimError::Store(StoreError::Timeout(budget))),
            }
        }
        .await;
        // Not renewed, or of no use: given back rather than left to expire.
        renewed
            .and_then(|(grant, t_send)| {
                self.start(job.clone(), key.clone(), grant, t_send, timing, held)
            })
            .inspect_err(|_| self.abandon(&job, generation, &key, budget))
    }

    /// Gives back, in the background within `within`, a grant this client will not use (too
    /// short, come too late, or not renewed after a wait), so its job does not stand idle
    /// until it expires. Safe: no request ever carried its token. Its key is not kept for the
    /// next claim of the job: that claim, asked with it, would get the grant back, and a
    /// release still on its way (or one that timed out here and lands late) would then free
    /// the job under it. A release that fails leaves the grant to expire.
    fn abandon(&self, job: &JobId, generation: Generation, key: &LeaseKey, within: Duration) {
        let (store, job, owner, key) = (
            self.store.clone(),
            job.clone(),
            self.owner.clone(),
            key.clone(),
        );
        tokio::spawn(async move {
            let release = store.release(&job, &owner, generation, &key);
            let _ = tokio::time::timeout(within, release).await;
        });
    }

    /// Takes over a lease this owner claimed elsewhere (`fence claim` in another process, a
    /// worker that restarted), given its generation and lease key: renews it at once and, when
    /// granted, starts a keeper as [`claim`](Self::claim) does. The local deadline runs from
    /// that renewal's send.
    ///
    /// # Errors
    /// [`ClaimError::NotHeld`] when the store has moved on (another owner or generation) or the
    /// key is not the lease's; otherwise as [`claim`](Self::claim).
    pub async fn resume(
        &self,
        job: JobId,
        generation: Generation,
        key: LeaseKey,
    ) -> Result<Lease<S>, ClaimError> {
        let timing = Timing::new(self.ttl, self.margin, self.renew_every)?
            .with_progress(self.progress_within)?;
        let held = HeldMark::take(&self.held, &job)
            .ok_or_else(|| ClaimError::AlreadyHeld { job: job.clone() })?;
        let t_send = Instant::now();
        let budget = timing.ttl.as_duration() - timing.margin(timing.ttl);
        let renew = self
            .store
            .renew(&job, &self.owner, generation, &key, self.ttl);
        let not_held = |why: String| ClaimError::NotHeld {
            job: job.clone(),
            generation,
            why,
        };
        let grant = match tokio::time::timeout(budget, renew).await {
            Ok(Ok(Outcome::Granted(grant))) => grant,
            Ok(Ok(Outcome::Lost {
                owner,
                generation: now,
            })) => {
                let holder = owner.map_or_else(|| "nobody".to_owned(), |o| o.to_string());
                return Err(not_held(format!(
                    "it is at generation {now}, held by {holder}"
                )));
            }
            Ok(Ok(Outcome::KeyMismatch)) => {
                return Err(not_held(
                    "the lease key is not the one it was claimed with".into(),
                ));
            }
            Ok(Ok(Outcome::Completed { generation: g, .. })) => {
                return Err(not_held(format!("it was completed at generation {g}")));
            }
            Ok(Ok(Outcome::Unknown)) => {
                return Err(not_held(
                    "the store has no record of the job (never claimed, or forgotten)".into(),
                ));
            }
            Ok(Ok(other)) => {
                return Err(ClaimError::Store(StoreError::Protocol(format!(
                    "a renewal was answered with {other:?}"
                ))));
            }
            Ok(Err(e)) => return Err(ClaimError::Store(e)),
            Err(_) => return Err(ClaimError::Store(StoreError::Timeout(budget))),
        };
        self.start(job, key, grant, t_send, timing, held)
    }

    /// The lease of `grant` (asked for at `t_send`), its keeper started; an error when the
    /// grant came too late to be of use.
    fn start(
        &self,
        job: JobId,
        key: LeaseKey,
        grant: crate::Grant,
        t_send: Instant,
        timing: Timing,
        held: HeldMark,
    ) -> Result<Lease<S>, ClaimError> {
        let mut grant = grant;
        grant.ttl = timing.counted(grant.ttl);
        let token = grant.generation.token().ok_or_else(|| {
            ClaimError::Store(StoreError::Protocol(
                "the store granted generation 0".into(),
            ))
        })?;
        if timing.leaves_no_time(grant.ttl) {
            return Err(ClaimError::GrantTooShort {
                job,
                granted: grant.ttl.as_duration(),
                margin: timing.margin(grant.ttl),
            });
        }
        if Instant::now() >= timing.deadline(t_send, grant.ttl) {
            let budget = timing.ttl.as_duration() - timing.margin(timing.ttl);
            return Err(ClaimError::Store(StoreError::Timeout(budget)));
        }
        let header = token_header(token, grant.token.as_deref())?;
        let granted = Granted {
            job,
            owner: self.owner.clone(),
            key,
            token,
            header,
            t_send,
            ttl: grant.ttl,
            checkpoint: grant.checkpoint,
        };
        Ok(Lease::start(self.store.clone(), granted, timing, held))
    }
}

/// The shortest pause between two semaphore claims of one [`LeaseClient::claim_slot`].
const MIN_SLOT_POLL: Duration = Duration::from_millis(10);

/// The longest pause between two semaphore claims of one [`LeaseClient::claim_slot`].
const MAX_SLOT_POLL: Duration = Duration::from_millis(500);
