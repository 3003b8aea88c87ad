//! Waiting claims: `claim?wait=D` holds the request until the job can be claimed.
//!
//! Contract section 11: `POST /v1/leases/{job}/claim?wait=DURATION` holds the request while
//! the job is held, until it can be claimed or the wait ends.
//!
//! A waiting claim first tries once, like any claim: a job that is free is taken at once, and
//! the holder's own retry (same owner and key, after a lost answer) gets its lease back
//! instead of queueing behind strangers. Then waiters on one job queue on a fair semaphore
//! of one permit, so they are served first come, first served; the one at the head tries
//! again when a release or completion on this server wakes it, when the lease it saw was due
//! to expire, and at least every [`POLL`] (another server on the same database may have let
//! the job go). Entries are removed when the last waiter of a job leaves, also when a waiter
//! goes away mid-wait (its client disconnected).

use std::{sync::Arc, time::Duration};

use dashmap::DashMap;
use fence_core::JobId;
use fence_lease::{LeaseOp, LeaseStore, Outcome, StoreError};
use tokio::{
    sync::{Notify, Semaphore},
    time::Instant,
};

/// The longest `wait` a claim may ask for.
pub(super) const MAX_WAIT: Duration = Duration::from_secs(60);

/// How often the head waiter looks again without being woken.
const POLL: Duration = Duration::from_millis(250);

#[derive(Debug)]
struct Queue {
    head: Semaphore,
    changed: Notify,
}

/// The jobs with claims waiting on them.
#[derive(Debug, Default)]
pub(super) struct Waiters {
    jobs: DashMap<JobId, Arc<Queue>>,
}

/// One waiter's place: when it goes (answered, or its request dropped mid-wait), the last
/// waiter of a job takes the job's entry away.
struct Waiting<'a> {
    waiters: &'a Waiters,
    job: &'a JobId,
    queue: Option<Arc<Queue>>,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        metrics::gauge!("fence_lease_waiting_claims").decrement(1);
        drop(self.queue.take());
        self.waiters
            .jobs
            .remove_if(self.job, |_, q| Arc::strong_count(q) == 1);
    }
}

impl Waiters {
    /// Wakes the waiters of `job`: it was released or completed here.
    pub(super) fn changed(&self, job: &JobId) {
        if let Some(queue) = self.jobs.get(job) {
            queue.changed.notify_waiters();
        }
    }

    /// Claims `job` with `op`, waiting up to `wait` while it is held by someone else. The
    /// answer is the store's last one: granted, completed, or still held when the wait ended.
    pub(super) async fn claim<S: LeaseStore>(
        &self,
        store: &S,
        job: &JobId,
        op: LeaseOp,
        wait: Duration,
    ) -> Result<Outcome, StoreError> {
        let deadline = Instant::now() + wait;
        let first = store.apply(job, op.clone()).await?;
        if !matches!(first, Outcome::Held { .. }) {
            return Ok(first);
        }
        let queue = self
            .jobs
            .entry(job.clone())
            .or_insert_with(|| {
                Arc::new(Queue {
                    head: Semaphore::new(1),
                    changed: Notify::new(),
                })
            })
            .clone();
        metrics::gauge!("fence_lease_waiting_claims").increment(1);
        let waiting = Waiting {
            waiters: self,
            job,
            queue: Some(queue),
        };
        let queue = waiting.queue.as_deref().expect("set above");
        Self::queued(queue, store, job, op, deadline).await
    }

    async fn queued<S: LeaseStore>(
        queue: &Queue,
        store: &S,
        job: &JobId,
        op: LeaseOp,
        deadline: Instant,
    ) -> Result<Outcome, StoreError> {
        // Behind earlier waiters; when the wait ends in the queue, one last try decides.
        let Ok(Ok(_head)) = tokio::time::timeout_at(deadline, queue.head.acquire()).await else {
            return store.apply(job, op).await;
        };
        loop {
            let woken = queue.changed.notified();
            tokio::pin!(woken);
            woken.as_mut().enable(); // registered before the try: no release is missed
            let outcome = store.apply(job, op.clone()).await?;
            let Outcome::Held { expires_in, .. } = &outcome else {
                return Ok(outcome);
            };
            let now = Instant::now();
            if now >= deadline {
                return Ok(outcome);
            }
            let next = (now + (*expires_in + Duration::from_millis(5)).min(POLL)).min(deadline);
            tokio::select! {
                () = tokio::time::sleep_until(next) => {}
                () = &mut woken => {}
            }
        }
    }
}
