//! Releasing and completing through a store that fails for a while: the call is tried again
//! until the store could end the lease on its own, and an attempt applied before its answer
//! was lost counts as done, not as a lost lease.

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use fence_core::{Generation, JobId, lease_api::ListQuery};
use fence_lease::{
    FinishError, LeaseClient, LeaseOp, LeaseRecord, LeaseState, LeaseStore, ListPage,
    MemoryLeaseStore, Outcome, StoreError, Ttl,
};
use tokio::time::Instant;

/// A store whose next `failures` releases and completions fail: applied first and their
/// answer lost (`applied`), or failed before they reached it.
#[derive(Debug, Clone, Default)]
struct FailsFinish {
    inner: MemoryLeaseStore,
    failures: Arc<AtomicUsize>,
    applied: bool,
    attempts: Arc<AtomicUsize>,
    /// Releases and completions never answer.
    hangs: bool,
    /// Renewals never answer (the lease is lost at its deadline).
    stalls_renewals: bool,
    /// Releases and completions take this long.
    latency: Duration,
    /// A failure is busy (a 408 over HTTP): nothing applied.
    busy: bool,
}

impl FailsFinish {
    fn new(failures: usize, applied: bool) -> Self {
        Self {
            failures: Arc::new(AtomicUsize::new(failures)),
            applied,
            ..Self::default()
        }
    }
}

impl LeaseStore for FailsFinish {
    async fn claim_slot(
        &self,
        resource: &JobId,
        owner: &fence_core::Owner,
        key: &fence_core::secret::LeaseKey,
        terms: fence_lease::ClaimTerms,
        slots: u32,
    ) -> Result<fence_lease::SlotClaim, StoreError> {
        self.inner
            .claim_slot(resource, owner, key, terms, slots)
            .await
    }

    async fn apply(&self, job: &JobId, op: LeaseOp) -> Result<Outcome, StoreError> {
        if self.stalls_renewals && matches!(op, LeaseOp::Renew { .. }) {
            std::future::pending::<()>().await;
        }
        if !matches!(op, LeaseOp::Release { .. } | LeaseOp::Complete { .. }) {
            return self.inner.apply(job, op).await;
        }
        self.attempts.fetch_add(1, Ordering::SeqCst);
        if self.hangs {
            std::future::pending::<()>().await;
        }
        tokio::time::sleep(self.latency).await;
        let failing = self
            .failures
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if !failing {
            return self.inner.apply(job, op).await;
        }
        if self.applied {
            self.inner.apply(job, op).await?;
            return Err(StoreError::Unavailable {
                status: 503,
                detail: "the answer was lost after the decision".into(),
                retry_after: None,
            });
        }
        if self.busy {
            return Err(StoreError::Busy(
                "408: the body did not arrive in time".into(),
            ));
        }
        Err(StoreError::Io("connection refused".into()))
    }

    async fn get(&self, job: &JobId) -> Result<Option<LeaseRecord>, StoreError> {
        self.inner.get(job).await
    }

    async fn list(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        self.inner.list(query).await
    }
}

fn job() -> JobId {
    "nightly-report".parse().unwrap()
}

/// A client of 1 s leases: with renewals stalled, its lease is lost within a second.
fn one_second_client(store: &FailsFinish) -> LeaseClient<FailsFinish> {
    LeaseClient::new(store.clone())
        .owner("worker".parse().unwrap())
        .ttl(Ttl::new(Duration::from_secs(1)).unwrap())
}

fn client(store: &FailsFinish) -> LeaseClient<FailsFinish> {
    LeaseClient::new(store.clone())
        .owner("worker".parse().unwrap())
        .ttl(Ttl::new(Duration::from_secs(30)).unwrap())
}

async fn state_of(store: &FailsFinish) -> LeaseState {
    store.inner.get(&job()).await.unwrap().unwrap().state
}

/// A completion whose first two attempts never reached the store completes on the third.
#[tokio::test(start_paused = true)]
async fn a_completion_is_tried_again_through_a_passing_failure() {
    let store = FailsFinish::new(2, false);
    let lease = client(&store).claim(job()).await.unwrap();
    let record = lease
        .complete()
        .await
        .expect("completed on the third attempt");
    assert_eq!(record.state, LeaseState::Completed);
    assert_eq!(store.attempts.load(Ordering::SeqCst), 3);
    assert_eq!(state_of(&store).await, LeaseState::Completed);
}

/// A completion applied before its answer was lost: the retry is refused as "not held", and
/// that refusal (this owner, this generation, completed) is the completion, not a loss.
#[tokio::test(start_paused = true)]
async fn a_completion_whose_answer_was_lost_is_done_not_lost() {
    let store = FailsFinish::new(1, true);
    let lease = client(&store).claim(job()).await.unwrap();
    let record = lease
        .complete()
        .await
        .expect("the first attempt completed it");
    assert_eq!(record.state, LeaseState::Completed);
    assert_eq!(record.generation, Generation::new(1));
    assert_eq!(record.owner, Some("worker".parse().unwrap()));
    assert_eq!(state_of(&store).await, LeaseState::Completed);
}

/// The same for a release: nobody holds the generation any more.
#[tokio::test(start_paused = true)]
async fn a_release_whose_answer_was_lost_is_done_not_lost() {
    let store = FailsFinish::new(1, true);
    let lease = client(&store).claim(job()).await.unwrap();
    let record = lease
        .release()
        .await
        .expect("the first attempt released it");
    assert_eq!((record.state, record.owner), (LeaseState::Free, None));
    assert_eq!(state_of(&store).await, LeaseState::Free);
}

/// A store that keeps failing is asked until it could end the lease on its own, no longer:
/// the failure is then the caller's, with the job left to expire.
#[tokio::test(start_paused = true)]
async fn a_store_that_keeps_failing_is_given_up_on_at_the_lease_s_end() {
    let store = FailsFinish::new(usize::MAX, false);
    let lease = client(&store).claim(job()).await.unwrap();
    let store_end = lease.view().earliest_store_expiry();
    let started = Instant::now();
    let finished = lease.complete().await;
    assert!(
        matches!(finished, Err(FinishError::Store(StoreError::Io(_)))),
        "{finished:?}"
    );
    assert!(Instant::now() <= store_end, "tried past the lease's end");
    assert!(
        started.elapsed() >= Duration::from_secs(25),
        "gave up after {:?}, long before the lease's end",
        started.elapsed()
    );
    assert!(store.attempts.load(Ordering::SeqCst) > 10);
    assert_eq!(state_of(&store).await, LeaseState::Held);
}

/// A refusal is final: another holder's generation is a lost lease, asked once.
#[tokio::test(start_paused = true)]
async fn a_refusal_is_not_retried() {
    let store = FailsFinish::new(0, false);
    let lease = client(&store).claim(job()).await.unwrap();
    store.inner.apply(&job(), LeaseOp::Revoke).await.unwrap();
    let finished = lease.complete().await;
    assert!(
        matches!(
            finished,
            Err(FinishError::Lost { generation, .. }) if generation == Generation::new(2)
        ),
        "{finished:?}"
    );
    assert_eq!(store.attempts.load(Ordering::SeqCst), 1);
}

/// A long lease is not retried for its whole life: a minute at most, so a caller at the end of
/// a job (fence run) is not held for hours by a server that is down.
#[tokio::test(start_paused = true)]
async fn a_long_lease_is_retried_for_a_minute_at_most() {
    let store = FailsFinish::new(usize::MAX, false);
    let lease = LeaseClient::new(store.clone())
        .owner("worker".parse().unwrap())
        .ttl(Ttl::new(Duration::from_secs(3_600)).unwrap())
        .claim(job())
        .await
        .unwrap();
    let started = Instant::now();
    assert!(lease.release().await.is_err());
    let took = started.elapsed();
    assert!(
        (Duration::from_secs(55)..=Duration::from_secs(60)).contains(&took),
        "gave up after {took:?}"
    );
}

/// A store that takes the request and never answers (a black-holed connection) does not
/// keep the caller past the lease's end, or a minute with a long lease: the attempt is
/// abandoned, its outcome unknown.
#[tokio::test(start_paused = true)]
async fn a_store_that_hangs_is_given_up_on_in_time() {
    for (ttl, within) in [(30, 30), (3_600, 60)] {
        let store = FailsFinish {
            hangs: true,
            ..FailsFinish::default()
        };
        let lease = LeaseClient::new(store.clone())
            .owner("worker".parse().unwrap())
            .ttl(Ttl::new(Duration::from_secs(ttl)).unwrap())
            .claim(job())
            .await
            .unwrap();
        let started = Instant::now();
        let finished = tokio::time::timeout(Duration::from_secs(600), lease.complete())
            .await
            .expect("still waiting for a store that hangs after 10 minutes");
        assert!(
            matches!(finished, Err(FinishError::Store(StoreError::Timeout(_)))),
            "{finished:?}"
        );
        assert!(
            started.elapsed() <= Duration::from_secs(within),
            "ttl {ttl} s: gave up after {:?}",
            started.elapsed()
        );
        assert_eq!(store.attempts.load(Ordering::SeqCst), 1);
    }
}

/// A completion sent after the store could have ended the lease (the lease was lost long
/// ago) is still sent and given time to answer: the store takes it while nobody claimed.
#[tokio::test(start_paused = true)]
async fn a_completion_after_the_lease_s_end_is_still_sent() {
    let store = FailsFinish {
        stalls_renewals: true,
        latency: Duration::from_millis(100),
        ..FailsFinish::default()
    };
    let lease = LeaseClient::new(store.clone())
        .owner("worker".parse().unwrap())
        .ttl(Ttl::new(Duration::from_secs(1)).unwrap())
        .claim(job())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(lease.is_lost());
    assert!(lease.view().earliest_store_expiry() < Instant::now());
    // The store's clock is the system's: for it, the lease has not ended.
    let record = lease.complete().await.expect("completed");
    assert_eq!(record.state, LeaseState::Completed);
}

/// A release answered busy (a 408 over HTTP: the request did not arrive whole, nothing was
/// applied) is tried again; it used to be final, and the job stayed held until its TTL ran
/// out.
#[tokio::test(start_paused = true)]
async fn a_busy_release_is_tried_again() {
    let store = FailsFinish {
        busy: true,
        ..FailsFinish::new(2, false)
    };
    let lease = client(&store).claim(job()).await.unwrap();
    let record = lease
        .release()
        .await
        .expect("released on the third attempt");
    assert_eq!(record.state, LeaseState::Free);
    assert_eq!(store.attempts.load(Ordering::SeqCst), 3);
}

/// A release once the lease is lost here (its local deadline passed while renewals got no
/// answer) is not sent: the store would take it (nobody claimed the job since) and let the
/// next holder start at once, beside a write this holder sent before the loss, where the
/// lock-delay exists to keep it out. The lease is left to expire.
#[tokio::test(start_paused = true)]
async fn a_release_after_a_local_loss_is_not_sent() {
    let store = FailsFinish {
        stalls_renewals: true,
        ..FailsFinish::default()
    };
    let lease = one_second_client(&store).claim(job()).await.unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(lease.is_lost());
    let refused = lease.release().await;
    assert!(
        matches!(
            refused,
            Err(FinishError::LostLocally(
                fence_lease::LossReason::DeadlinePassed
            ))
        ),
        "{refused:?}"
    );
    assert_eq!(store.attempts.load(Ordering::SeqCst), 0, "nothing was sent");
    // The store's clock is the system's: for it, the lease still holds, left to expire.
    assert_eq!(state_of(&store).await, LeaseState::Held);
}

/// A semaphore slot's completion frees the slot (the store releases it), so once the lease
/// is lost here it is refused like a release: the next holder would get the slot at once,
/// beside the stalled holder's write.
#[tokio::test(start_paused = true)]
async fn a_slots_completion_after_a_local_loss_is_not_sent() {
    let store = FailsFinish {
        stalls_renewals: true,
        ..FailsFinish::default()
    };
    let lease = one_second_client(&store)
        .claim_slot("pool".parse().unwrap(), 2, Duration::ZERO)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(lease.is_lost());
    let refused = lease.complete().await;
    assert!(
        matches!(refused, Err(FinishError::LostLocally(_))),
        "{refused:?}"
    );
    assert_eq!(store.attempts.load(Ordering::SeqCst), 0, "nothing was sent");
}
