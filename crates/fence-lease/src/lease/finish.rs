//! Releasing and completing a lease, retried through a store's passing failure.
//!
//! A release or completion that fails in the store (no answer, a timeout, a 503) is tried
//! again, with the same owner, generation and key, until the store could end the lease on its
//! own (a minute at most): a passing blip at the end of a job must not leave it to expire and
//! run again. A retry may find its earlier attempt applied after all; the store then refuses
//! the retry, and the refusal says so: at this generation, nobody holds the job (released), or
//! this owner holds it completed (only a completion can leave owner and generation in place
//! and refuse them).

use std::time::Duration;

use fence_core::{Generation, Owner, lease_api::LeaseState};
use tokio::time::Instant;

use super::{Lease, LeaseView, LossReason};
use crate::{Backoff, LeaseRecord, LeaseStore, Outcome, StoreError};

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
    /// The store refused this lease's key; nothing changed.
    #[error("the store refused the lease key")]
    KeyMismatch,
    /// The store failed, and kept failing until it could end the lease on its own; the
    /// outcome is unknown.
    #[error("the lease store failed")]
    Store(#[from] StoreError),
    /// The lease is lost locally (past its deadline, superseded, finished): nothing was sent.
    #[error("the lease is lost: {0}")]
    LostLocally(LossReason),
}

/// The first pause between attempts, and the longest.
const RETRY_PAUSES: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(1));

/// The longest a release or completion is retried, whatever the lease has left: a caller
/// (`fence run` at the end of a job) is not kept for hours by a long lease.
const RETRY_WINDOW: Duration = Duration::from_secs(60);

/// The least time an attempt is given: one sent when the store could already have ended the
/// lease (a lease lost long ago, then completed) is still sent, once, and may still be taken;
/// and one sent a few milliseconds before the window ends is not cut at once (it would be
/// reported failed although it most likely landed).
const LATE_ATTEMPT: Duration = Duration::from_secs(10);

impl<S: LeaseStore> Lease<S> {
    /// A view to hand to observers that must not end the lease.
    pub fn view(&self) -> LeaseView {
        self.view.clone()
    }

    /// Marks the job completed. The layer stops sending at once, whatever the store answers.
    /// A store that fails (unreachable, timing out, unavailable) is asked again until it
    /// could end the lease on its own (the lease's earliest expiry at the store), for a
    /// minute at most; an attempt still unanswered then (a store that hangs) is abandoned,
    /// its outcome unknown (each attempt has 10 s at least, so one sent at the window's
    /// end may run that much past it). Sent even when the lease is already lost here (past its local
    /// deadline, say): the store takes it only while this owner, generation and key still
    /// hold the job, that is, when nobody claimed it since. A caller that must not complete
    /// a job whose lease it lost checks [`LeaseView::is_lost`] first (`fence run` does). A
    /// semaphore slot's completion frees the slot, so for a slot it is refused once the lease
    /// is lost here, as [`release`](Self::release) is.
    ///
    /// # Errors
    /// [`FinishError::Lost`] when the store no longer records this owner and generation;
    /// [`FinishError::Store`] when it failed until then.
    pub async fn complete(self) -> Result<LeaseRecord, FinishError> {
        self.finish(true).await
    }

    /// Frees the job for another claim. The layer stops sending at once. Retried as
    /// [`complete`](Self::complete) is.
    ///
    /// Not sent once the lease is lost here (its local deadline passed, no progress, the
    /// store refused a renewal): the lease is left to expire, so that the lock-delay applies.
    /// A write this holder sent before the loss may still land, and a release the store
    /// would take (nobody claimed the job since) lets the next holder start beside it at
    /// once. A completion is still sent (nobody can claim a completed job), but for a
    /// semaphore slot's: the store frees a slot it is asked to complete, so that one is
    /// refused alike.
    ///
    /// # Errors
    /// [`FinishError::LostLocally`], nothing sent, when the lease is lost here; otherwise as
    /// [`complete`](Self::complete).
    pub async fn release(self) -> Result<LeaseRecord, FinishError> {
        self.finish(false).await
    }

    async fn finish(self, complete: bool) -> Result<LeaseRecord, FinishError> {
        self.keeper.abort();
        let shared = &self.view.shared;
        // A slot's completion frees the slot like a release (`#` is reserved for slot jobs):
        // refused alike.
        let frees = !complete || shared.job.as_str().contains('#');
        if frees && shared.token().is_none() {
            let reason = shared
                .reason
                .get()
                .cloned()
                .unwrap_or(LossReason::DeadlinePassed);
            shared.lose(LossReason::Finished);
            return Err(FinishError::LostLocally(reason));
        }
        shared.lose(LossReason::Finished);
        // No renewal is sent from now on: past this moment the store may end the lease (and
        // let another owner claim the job) without us, so retrying is pointless; and a
        // minute at most.
        let until = self
            .view
            .earliest_store_expiry()
            .min(Instant::now() + RETRY_WINDOW);
        let (job, owner, generation, key) = (
            &shared.job,
            &shared.owner,
            shared.token.generation(),
            &shared.key,
        );
        let mut pauses = Backoff::new(RETRY_PAUSES.0, RETRY_PAUSES.1);
        // Whether an attempt failed in a way that may have applied it.
        let mut unsure = false;
        let outcome = loop {
            // Each attempt ends by `until` too: a store that hangs (a black-holed connection)
            // does not keep the caller past it. Its outcome is then unknown.
            let now = Instant::now();
            let attempt_until = until.max(now + LATE_ATTEMPT);
            let attempt = async {
                if complete {
                    self.store.complete(job, owner, generation, key).await
                } else {
                    self.store.release(job, owner, generation, key).await
                }
            };
            let attempt = tokio::time::timeout_at(attempt_until, attempt)
                .await
                .unwrap_or_else(|_| Err(StoreError::Timeout(attempt_until - now)));
            match attempt {
                // The answer lost (it may have been applied), or nothing applied (busy: the
                // server's own 408, an in-process store's queue, which leaves no doubt behind).
                Err(e) if e.answer_lost() || matches!(e, StoreError::Busy(_)) => {
                    let pause = pauses.next_pause();
                    if Instant::now() + pause >= until {
                        return Err(FinishError::Store(e));
                    }
                    if e.answer_lost() {
                        tracing::warn!(
                            job = %job,
                            error = %fence_storage::error_chain(&e),
                            "releasing or completing the lease failed; trying again"
                        );
                        unsure = true;
                    }
                    tokio::time::sleep(pause).await;
                }
                Err(e) => return Err(FinishError::Store(e)),
                Ok(outcome) => break outcome,
            }
        };
        match outcome {
            Outcome::Done(record) => Ok(record),
            // An earlier attempt was applied: released (nobody holds this generation), or
            // completed (this owner and generation stand, refused only as completed).
            Outcome::Lost {
                owner: now_held,
                generation: now,
            } if unsure && now == generation && now_held.as_ref().is_none_or(|o| o == owner) => {
                let state = if now_held.is_some() {
                    LeaseState::Completed
                } else {
                    LeaseState::Free
                };
                Ok(LeaseRecord {
                    job: job.clone(),
                    owner: now_held,
                    generation,
                    state,
                    expires_in: Duration::ZERO,
                })
            }
            Outcome::Lost { owner, generation } => Err(FinishError::Lost { owner, generation }),
            Outcome::KeyMismatch => Err(FinishError::KeyMismatch),
            other => Err(FinishError::Store(StoreError::Protocol(format!(
                "the store answered a release or completion with {other:?}"
            )))),
        }
    }
}
