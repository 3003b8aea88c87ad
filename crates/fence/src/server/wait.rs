//! Waiting claims: `claim?wait=D` holds the request until the job can be claimed.
//!
//! Contract section 11: `POST /v1/leases/{job}/claim?wait=DURATION` holds the request while
//! the job is held, until it can be claimed or the wait ends.
//!
//! A waiting claim first tries once, like any claim: a job that is free is taken at once, and
//! the holder's own retry (same owner and key, after a lost answer) gets its lease back
//! instead of queueing behind strangers. Then waiters on one job queue on a fair semaphore
//! of one permit, so they are served first come, first served; the one at the head tries
//! again when a release, completion or revocation wakes it, or a granted renewal or claim
//! (which may have brought the lease's end forward) on this server (on another
//! server sharing the store when the store says so: [`LeaseStore::changes`], PostgreSQL's
//! `LISTEN`), or when the lease it saw is due to expire; nobody else asks the store while
//! waiting. On a shared store the head also looks every [`POLL`] (every
//! [`FED_POLL`] when the store says what other servers change, as a backstop), less often
//! with many jobs waited for ([`POLL_SPREAD`]). Entries are
//! removed when the last waiter of a job leaves, also when a waiter
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

/// How often the head waiter looks again without being woken, on a shared store that does
/// not say what other servers change.
const POLL: Duration = Duration::from_millis(250);

/// The same on a shared store that says what other servers let go ([`LeaseStore::changes`]):
/// only a backstop, since a lost session of the store's says it may have missed some.
const FED_POLL: Duration = Duration::from_secs(2);

/// With many jobs waited for, each head looks this much less often per job, so that the
/// looks of all of them together come to at most 100 a second: 1,000 jobs waited for on a
/// shared store without its changes heard (at start, after its session was lost) each look
/// every 10 s instead of 4,000 claim statements a second taking the pool from every other
/// request. A lease's end, a release here and a change heard still wake the head at once.
const POLL_SPREAD: Duration = Duration::from_millis(10);

#[derive(Debug)]
struct Queue {
    head: Semaphore,
    changed: Notify,
}

/// How many claims may wait at once: in all, and per client (an auth-file client, or every
/// caller together on a server without one).
#[derive(Debug, Clone, Copy)]
pub struct WaitLimits {
    /// Waiting claims over every client.
    pub total: usize,
    /// Waiting claims of one client.
    pub per_client: usize,
    /// The longest one claim is held: a longer `wait` (the protocol allows 60 s) is
    /// served as this (`--max-claim-wait`).
    pub longest: Duration,
}

impl Default for WaitLimits {
    /// 10,000 in all, 1,000 per client, each held up to 60 s.
    fn default() -> Self {
        Self {
            total: 10_000,
            per_client: 1_000,
            longest: MAX_WAIT,
        }
    }
}

impl WaitLimits {
    /// These limits, lowered where they would let waiting claims hold more than half of a
    /// listener's connection seats: `total` to half of `max_connections`, `per_client` to
    /// half of `per_peer` (each at least 1). A waiting claim keeps its connection busy for
    /// its whole wait, and a busy connection is never closed for room: waiting claims on
    /// every seat would leave each newcomer (a new `fence run`, a health probe) in the lobby
    /// until its first-request deadline closed it unanswered. (Without an auth file the
    /// server counts a client per address.) A lowering is logged: at info when it is the
    /// defaults', at warn when flags asked for these (`--max-waiting-claims`).
    #[must_use]
    pub fn within_seats(self, max_connections: usize, per_peer: usize) -> Self {
        let within = Self {
            total: self.total.min((max_connections / 2).max(1)),
            per_client: self.per_client.min((per_peer / 2).max(1)),
            ..self
        };
        let (total, per_client) = (within.total, within.per_client);
        if (total, per_client) != (self.total, self.per_client) {
            let defaults = Self::default();
            let message = "waiting claims held to half the connection seats (--max-connections, --max-connections-per-peer): a waiting claim keeps its connection busy, and busy connections are never closed for newcomers";
            if (self.total, self.per_client) == (defaults.total, defaults.per_client) {
                tracing::info!(
                    max_waiting_claims = total,
                    max_waiting_claims_per_client = per_client,
                    max_connections,
                    max_connections_per_peer = per_peer,
                    "{message}"
                );
            } else {
                tracing::warn!(
                    max_waiting_claims = total,
                    max_waiting_claims_per_client = per_client,
                    max_connections,
                    max_connections_per_peer = per_peer,
                    "{message}"
                );
            }
        }
        within
    }
}

/// A claim that may not wait: the server holds as many waiting claims as it may.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum TooMany {
    /// In all.
    Total(usize),
    /// Of this client.
    Client(usize),
}

/// The jobs with claims waiting on them, and how many wait per client.
#[derive(Debug, Default)]
pub(super) struct Waiters {
    jobs: DashMap<JobId, Arc<Queue>>,
    limits: WaitLimits,
    total: std::sync::atomic::AtomicUsize,
    clients: DashMap<String, usize>,
    /// Whether what other servers let go wakes the waiters ([`Waiters::set_fed`]).
    fed: std::sync::atomic::AtomicBool,
    /// True once the server stops: no claim waits any more (`ServerOptions::stopping`).
    stopping: Option<tokio::sync::watch::Receiver<bool>>,
}

/// Resolves once `stopping` turns true; never without one (or once its sender is gone
/// without saying so).
async fn stopped(stopping: Option<&tokio::sync::watch::Receiver<bool>>) {
    if let Some(mut stopping) = stopping.cloned()
        && stopping.wait_for(|stop| *stop).await.is_ok()
    {
        return;
    }
    std::future::pending().await
}

/// A client's place among the waiting claims, given back when the claim is answered or goes.
pub(super) struct Slot<'a> {
    waiters: &'a Waiters,
    client: String,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        use std::sync::atomic::Ordering::Relaxed;
        self.waiters.total.fetch_sub(1, Relaxed);
        self.waiters.clients.remove_if_mut(&self.client, |_, n| {
            *n -= 1;
            *n == 0
        });
    }
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
    /// Waiters bounded by `limits`, answered at once when `stopping` turns true.
    pub(super) fn new(
        limits: WaitLimits,
        stopping: Option<tokio::sync::watch::Receiver<bool>>,
    ) -> Self {
        Self {
            limits,
            stopping,
            ..Self::default()
        }
    }

    fn is_stopping(&self) -> bool {
        self.stopping.as_ref().is_some_and(|s| *s.borrow())
    }

    /// A place for one more waiting claim of `client`, unless that would pass a limit.
    pub(super) fn slot(&self, client: &str) -> Result<Slot<'_>, TooMany> {
        use std::sync::atomic::Ordering::Relaxed;
        let mut count = self.clients.entry(client.to_owned()).or_insert(0);
        if *count >= self.limits.per_client {
            let held = *count;
            drop(count);
            self.clients.remove_if(client, |_, n| *n == 0);
            return Err(TooMany::Client(held));
        }
        if self.total.fetch_add(1, Relaxed) >= self.limits.total {
            self.total.fetch_sub(1, Relaxed);
            let empty = *count == 0;
            drop(count);
            if empty {
                self.clients.remove_if(client, |_, n| *n == 0);
            }
            return Err(TooMany::Total(self.limits.total));
        }
        *count += 1;
        Ok(Slot {
            waiters: self,
            client: client.to_owned(),
        })
    }

    /// Says whether the store's changes wake these waiters now ([`LeaseStore::changes`], its
    /// session listening): a shared store is then looked at only every [`FED_POLL`], else
    /// every [`POLL`]. Waiters asleep are woken by the caller to choose again.
    pub(super) fn set_fed(&self, fed: bool) {
        self.fed.store(fed, std::sync::atomic::Ordering::Relaxed);
    }

    /// Wakes the waiters of `job`: it was released, completed or revoked, here or by
    /// another server, or a renewal or claim was granted here (its end may be earlier).
    pub(super) fn changed(&self, job: &JobId) {
        if let Some(queue) = self.jobs.get(job) {
            queue.changed.notify_waiters();
        }
    }

    /// Wakes the head waiter of every job: changes may have gone unheard.
    pub(super) fn changed_all(&self) {
        for queue in &self.jobs {
            queue.changed.notify_waiters();
        }
    }

    /// Claims `job` with `op` for `client`, waiting up to `wait` while it is held by someone
    /// else. The answer is the store's last one: granted, completed, or still held when the
    /// wait ended; or, when the claim would have to wait past a limit, [`TooMany`].
    pub(super) async fn claim<S: LeaseStore>(
        &self,
        store: &S,
        job: &JobId,
        op: LeaseOp,
        (wait, client): (Duration, &str),
    ) -> Result<Result<Outcome, TooMany>, StoreError> {
        let deadline = Instant::now() + wait;
        let first = store.apply(job, op.clone()).await?;
        // A stopping server holds no claim: it answers with the job still held.
        if !matches!(first, Outcome::Held { .. }) || self.is_stopping() {
            return Ok(Ok(first));
        }
        // Only a claim that must wait takes a place.
        let _place = match self.slot(client) {
            Ok(place) => place,
            Err(too_many) => return Ok(Err(too_many)),
        };
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
        self.queued(queue, store, job, op, deadline).await.map(Ok)
    }

    /// How long the head waiter may sleep unprompted now: on a store only this process
    /// decides on, until the lease it saw ends; on a shared one, [`POLL`], or [`FED_POLL`]
    /// while the store's changes are heard (read at every turn: `set_fed` may flip), or
    /// [`POLL_SPREAD`] for each job waited for when that is longer.
    fn poll<S: LeaseStore>(&self, store: &S) -> Duration {
        let every = match (
            store.is_shared(),
            self.fed.load(std::sync::atomic::Ordering::Relaxed),
        ) {
            (false, _) => return MAX_WAIT,
            (true, false) => POLL,
            (true, true) => FED_POLL,
        };
        let jobs = u32::try_from(self.jobs.len()).unwrap_or(u32::MAX);
        every.max(POLL_SPREAD.saturating_mul(jobs))
    }

    async fn queued<S: LeaseStore>(
        &self,
        queue: &Queue,
        store: &S,
        job: &JobId,
        op: LeaseOp,
        deadline: Instant,
    ) -> Result<Outcome, StoreError> {
        // Behind earlier waiters; when the wait ends in the queue, one last try decides.
        let head = tokio::select! {
            head = tokio::time::timeout_at(deadline, queue.head.acquire()) => head,
            () = stopped(self.stopping.as_ref()) => return store.apply(job, op).await,
        };
        let Ok(Ok(_head)) = head else {
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
            // Just past the lease's end on the store's clock (whole ms): the try then finds
            // it expired, or says how little is left.
            let poll = self.poll(store);
            let next = (now + (*expires_in + Duration::from_millis(1)).min(poll)).min(deadline);
            tokio::select! {
                () = tokio::time::sleep_until(next) => {}
                () = &mut woken => {}
                // The server stops: one last try answers.
                () = stopped(self.stopping.as_ref()) => return store.apply(job, op).await,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

    use fence_core::{Owner, Ttl, secret::LeaseKey};
    use fence_lease::{LeaseRecord, ListPage, MemoryLeaseStore};
    use fence_storage::clock::TokioClock;

    use super::*;

    /// A store on tokio's clock that counts its calls, shared or not as asked.
    struct Counting {
        inner: MemoryLeaseStore,
        calls: AtomicUsize,
        shared: bool,
    }

    impl LeaseStore for Counting {
        async fn claim_slot(
            &self,
            resource: &fence_core::JobId,
            owner: &fence_core::Owner,
            key: &fence_core::secret::LeaseKey,
            terms: fence_lease::ClaimTerms,
            slots: u32,
        ) -> Result<fence_lease::SlotClaim, fence_lease::StoreError> {
            self.inner
                .claim_slot(resource, owner, key, terms, slots)
                .await
        }

        async fn apply(&self, job: &JobId, op: LeaseOp) -> Result<Outcome, StoreError> {
            self.calls.fetch_add(1, Relaxed);
            self.inner.apply(job, op).await
        }
        async fn get(&self, job: &JobId) -> Result<Option<LeaseRecord>, StoreError> {
            self.inner.get(job).await
        }
        async fn list(
            &self,
            query: &fence_core::lease_api::ListQuery,
        ) -> Result<ListPage, StoreError> {
            self.inner.list(query).await
        }
        fn is_shared(&self) -> bool {
            self.shared
        }
    }

    fn claim(owner: &str) -> LeaseOp {
        LeaseOp::Claim {
            owner: owner.parse().map(|o: Owner| o).unwrap(),
            key: LeaseKey::from_random(&[3; 32]),
            ttl: Ttl::from_millis(10_000).unwrap(),
            lock_delay: None,
        }
    }

    /// Waiting claims never get more than half the seats: in all, half the connection cap;
    /// per client, half the cap of one address. Limits below that stay as asked.
    #[test]
    fn waiting_claims_are_held_to_half_the_seats() {
        let asked = WaitLimits::default();
        let within = asked.within_seats(480, 240);
        assert_eq!((within.total, within.per_client), (240, 120));
        assert_eq!(within.longest, asked.longest);
        let small = WaitLimits {
            total: 5,
            per_client: 2,
            ..asked
        };
        let kept = small.within_seats(480, 240);
        assert_eq!((kept.total, kept.per_client), (5, 2));
        let tiny = asked.within_seats(1, 1);
        assert_eq!((tiny.total, tiny.per_client), (1, 1), "at least one");
    }

    /// Waiters ask the store when woken or when the lease they saw ends, not on a timer:
    /// ten waiters on a job held for 10 s, for 5 s, cost one try each and nothing more
    /// (the poll of a shared store, 250 ms, would have cost 20 more).
    #[tokio::test(start_paused = true)]
    async fn waiting_claims_cost_no_store_call_per_tick() {
        for shared in [false, true] {
            let store = Arc::new(Counting {
                inner: MemoryLeaseStore::with_clock(Arc::new(TokioClock::new(0, 0))),
                calls: AtomicUsize::new(0),
                shared,
            });
            let job: JobId = "busy".parse().unwrap();
            store.apply(&job, claim("holder")).await.unwrap();
            let waiters = Arc::new(Waiters::new(WaitLimits::default(), None));
            let tasks: Vec<_> = (0..10)
                .map(|i| {
                    let (store, waiters, job) = (store.clone(), waiters.clone(), job.clone());
                    tokio::spawn(async move {
                        let wait = (Duration::from_secs(5), "c");
                        let op = claim(&format!("w{i}"));
                        waiters.claim(&*store, &job, op, wait).await
                    })
                })
                .collect();
            for t in tasks {
                let outcome = t.await.unwrap().unwrap().unwrap();
                assert!(matches!(outcome, Outcome::Held { .. }), "{outcome:?}");
            }
            let calls = store.calls.load(Relaxed);
            // The holder's claim; each waiter's first try, and one last when its wait ends;
            // the head of the queue's try when it got there.
            let unpolled = 1 + 2 * 10 + 1;
            if shared {
                assert!(
                    calls > unpolled + 10,
                    "a shared store is polled: {calls} calls"
                );
            } else {
                assert_eq!(
                    calls, unpolled,
                    "not polled when no other server can change it"
                );
            }
        }
    }

    /// Many jobs waited for on a shared store whose changes are not heard: the heads' looks
    /// together stay near 100 a second, not 4 a second per job (4,000 claim statements a
    /// second for 1,000 jobs, which took the pool from every other request).
    #[tokio::test(start_paused = true)]
    async fn many_jobs_waited_for_share_one_polling_budget() {
        let store = Arc::new(Counting {
            inner: MemoryLeaseStore::with_clock(Arc::new(TokioClock::new(0, 0))),
            calls: AtomicUsize::new(0),
            shared: true,
        });
        let jobs: Vec<JobId> = (0..1_000)
            .map(|i| format!("j{i}").parse().unwrap())
            .collect();
        for job in &jobs {
            store.apply(job, claim("holder")).await.unwrap();
        }
        let waiters = Arc::new(Waiters::new(WaitLimits::default(), None));
        let tasks: Vec<_> = jobs
            .iter()
            .map(|job| {
                let (store, waiters, job) = (store.clone(), waiters.clone(), job.clone());
                tokio::spawn(async move {
                    // Within the holders' 10 s leases.
                    let wait = (Duration::from_secs(9), "c");
                    waiters.claim(&*store, &job, claim("w"), wait).await
                })
            })
            .collect();
        for t in tasks {
            let outcome = t.await.unwrap().unwrap().unwrap();
            assert!(matches!(outcome, Outcome::Held { .. }), "{outcome:?}");
        }
        // The holders' claims, then per waiter its first try, the head's first, its last;
        // and the looks over 9 s: 100 a second would be 900 (4 a second per job: 36,000).
        let calls = store.calls.load(Relaxed) - 1_000 - 3 * 1_000;
        assert!(calls <= 1_200, "{calls} looks in 9 s");
    }

    /// A server that begins to stop answers its waiting claims at once, the job still held
    /// (the head of the queue and those behind it), and takes no new one to wait: a stop
    /// does not wait out a minute-long claim, nor leave its client without an answer.
    #[tokio::test(start_paused = true)]
    async fn a_stopping_server_answers_its_waiting_claims_at_once() {
        let store = Arc::new(MemoryLeaseStore::with_clock(Arc::new(TokioClock::new(
            0, 0,
        ))));
        let job: JobId = "busy".parse().unwrap();
        store.apply(&job, claim("holder")).await.unwrap();
        let (stop, stopping) = tokio::sync::watch::channel(false);
        let waiters = Arc::new(Waiters::new(WaitLimits::default(), Some(stopping)));
        let started = Instant::now();
        let tasks: Vec<_> = (0..3)
            .map(|i| {
                let (store, waiters, job) = (store.clone(), waiters.clone(), job.clone());
                tokio::spawn(async move {
                    let wait = (Duration::from_secs(9), "c");
                    waiters
                        .claim(&*store, &job, claim(&format!("w{i}")), wait)
                        .await
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_secs(1)).await;
        stop.send_replace(true);
        for t in tasks {
            let outcome = t.await.unwrap().unwrap().unwrap();
            assert!(matches!(outcome, Outcome::Held { .. }), "{outcome:?}");
        }
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
        let late = waiters.claim(&*store, &job, claim("late"), (Duration::from_secs(9), "c"));
        let outcome = late.await.unwrap().unwrap();
        assert!(matches!(outcome, Outcome::Held { .. }), "{outcome:?}");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "a new claim waited"
        );
    }
}
