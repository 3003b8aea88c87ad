//! The lease client and its keeper against stores that stall, fail and grant less than
//! asked, on paused time: the lost signal always fires before the store's expiry.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use fence_core::{FencingToken, Generation, JobId, Owner, lease_api::ListQuery};
use fence_lease::{
    ClaimError, Clock, FinishError, Lease, LeaseClient, LeaseLost, LeaseOp, LeaseRecord,
    LeaseState, LeaseStore, ListPage, LossReason, ManualClock, MemoryLeaseStore, Outcome,
    StoreError, TokioClock, Ttl,
};
use fence_storage::BoxError;
use tokio::time::Instant;
use tower::{Service, ServiceExt, service_fn};

/// A store whose answers take `latency` each way and whose renewals can be stalled, as
/// if the worker (or its network to the store) were paused.
#[derive(Debug, Clone)]
struct Stallable {
    inner: MemoryLeaseStore,
    latency: Duration,
    stalled: Arc<AtomicBool>,
    failing: Arc<AtomicBool>,
    /// Renewals asked for.
    renewals: Arc<AtomicUsize>,
    /// Grants at most this, whatever was asked (a server-side cap).
    max_ttl: Ttl,
    /// Reports grants of this long instead of what the store granted (something between the
    /// worker and the store that inflates them).
    reports: Option<Ttl>,
}

impl Stallable {
    fn new(clock: Arc<dyn Clock>, latency: Duration) -> Self {
        Self {
            inner: MemoryLeaseStore::with_clock(clock),
            latency,
            stalled: Arc::default(),
            failing: Arc::default(),
            renewals: Arc::default(),
            max_ttl: Ttl::MAX,
            reports: None,
        }
    }
}

impl LeaseStore for Stallable {
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
        let op = match op {
            LeaseOp::Claim {
                owner,
                key,
                ttl,
                lock_delay,
            } => LeaseOp::Claim {
                owner,
                key,
                ttl: ttl.min(self.max_ttl),
                lock_delay,
            },
            LeaseOp::Renew {
                owner,
                generation,
                key,
                ttl,
            } => {
                self.renewals.fetch_add(1, Ordering::SeqCst);
                if self.stalled.load(Ordering::SeqCst) {
                    std::future::pending::<()>().await;
                }
                if self.failing.load(Ordering::SeqCst) {
                    return Err(StoreError::io("connection refused"));
                }
                LeaseOp::Renew {
                    owner,
                    generation,
                    key,
                    ttl: ttl.min(self.max_ttl),
                }
            }
            other => return self.inner.apply(job, other).await,
        };
        tokio::time::sleep(self.latency).await;
        let mut out = self.inner.apply(job, op).await;
        if let (Ok(Outcome::Granted(grant)), Some(reports)) = (&mut out, self.reports) {
            grant.ttl = reports;
        }
        tokio::time::sleep(self.latency).await;
        out
    }

    async fn get(&self, job: &JobId) -> Result<Option<LeaseRecord>, StoreError> {
        self.inner.get(job).await
    }

    async fn list(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        self.inner.list(query).await
    }
}

/// Stalls the worker's renewals, waits for the lease to be lost and returns the store's
/// record then, after checking the store still saw the lease held: loss came first.
async fn stall_until_lost(store: &Stallable, lease: &Lease<Stallable>, what: &str) -> LeaseRecord {
    store.stalled.store(true, Ordering::SeqCst);
    lease.lost().await;
    let record = store.inner.get(&job()).await.unwrap().unwrap();
    assert_eq!(
        record.state,
        LeaseState::Held,
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

async fn send(svc: &mut fence_lease::Fencing<Echo>) -> Result<http::Request<()>, BoxError> {
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
    let mut http_a = fence_lease::Fencing::new(echo(), lease_a.view());
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
        .renew(
            &job(),
            a.owner_id(),
            Generation::new(7),
            &fence_lease::new_lease_key().unwrap(),
            ttl,
        )
        .await
        .unwrap();
    assert_eq!(
        renewal,
        Outcome::Lost {
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
            let lease = claim_with_ttl(&store, ttl).await;
            // Let a few renewals succeed, then stall the worker.
            tokio::time::sleep(ttl.as_duration() * 2).await;
            assert!(!lease.is_lost(), "ttl {ttl_ms}: renewals should keep it");
            let record =
                stall_until_lost(&store, &lease, &format!("ttl {ttl_ms} offset {offset}")).await;
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
    let lease = claim_with_ttl(&store, Ttl::from_millis(60_000).unwrap()).await;
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

/// A grant reported longer than was asked (10 min for 3 s: a store's or a proxy's bug) is
/// counted as what was asked: renewals come on the 3 s schedule, and loss fires before the
/// store, which holds the lease only 3 s, lets it go. Believed, the grant put the deadline
/// 9 min away with no renewal due for minutes, and the store expired the lease first.
#[tokio::test(start_paused = true)]
async fn a_grant_longer_than_asked_counts_only_what_was_asked() {
    let clock = Arc::new(TokioClock::new(1_700_000_000_000, 0));
    let mut store = Stallable::new(clock, Duration::from_millis(5));
    store.reports = Some(Ttl::from_millis(600_000).unwrap());
    let lease = claim_with_ttl(&store, Ttl::from_millis(3_000).unwrap()).await;
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert!(!lease.is_lost(), "{:?}", lease.loss_reason());
    stall_until_lost(&store, &lease, "a grant reported at 10 min").await;
}

/// Failed renewals of a grant the store cut short (1 s for 60 s asked) are retried at the
/// grant's pace, several times before its deadline: paced from the TTL asked for, the one
/// retry came after the deadline most of the time, and the lease was lost to one failure.
#[tokio::test(start_paused = true)]
async fn failed_renewals_of_a_capped_grant_are_retried_before_its_deadline() {
    let mut store = Stallable::new(Arc::new(TokioClock::new(0, 0)), Duration::ZERO);
    store.max_ttl = Ttl::from_millis(1_000).unwrap();
    let lease = claim_with_ttl(&store, Ttl::from_millis(60_000).unwrap()).await;
    store.failing.store(true, Ordering::SeqCst);
    store.renewals.store(0, Ordering::SeqCst);
    lease.lost().await;
    let attempts = store.renewals.load(Ordering::SeqCst);
    assert!(
        attempts >= 3,
        "{attempts} renewals asked for before the loss"
    );
    assert_eq!(lease.loss_reason(), Some(LossReason::DeadlinePassed));
    lease.release().await.ok();

    // A renewal late in the lease (renew_every 2.5 s of a 3 s grant, deadline at 2.7 s): its
    // retries come within the 200 ms left, not a pace (625 ms) later.
    let store = Stallable::new(Arc::new(TokioClock::new(0, 0)), Duration::ZERO);
    let lease = LeaseClient::new(store.clone())
        .ttl(Ttl::from_millis(3_000).unwrap())
        .renew_every(Duration::from_millis(2_500))
        .claim(job())
        .await
        .unwrap();
    store.failing.store(true, Ordering::SeqCst);
    lease.lost().await;
    let attempts = store.renewals.load(Ordering::SeqCst);
    assert!(
        attempts >= 3,
        "{attempts} renewals asked for before the loss"
    );
}

/// A renewal that hangs (a black-holed connection) is abandoned after a renewal interval
/// and asked again, not left to take the whole window until the deadline.
#[tokio::test(start_paused = true)]
async fn a_hung_renewal_is_abandoned_and_asked_again() {
    let store = Stallable::new(Arc::new(TokioClock::new(0, 0)), Duration::from_millis(5));
    let ttl = Ttl::from_millis(3_000).unwrap(); // renewals every second, deadline at 2.7 s
    let lease = claim_with_ttl(&store, ttl).await;
    store.stalled.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    assert_eq!(
        store.renewals.load(Ordering::SeqCst),
        1,
        "the first renewal hangs"
    );
    store.stalled.store(false, Ordering::SeqCst); // the rest are answered
    tokio::time::sleep(ttl.as_duration() * 2).await;
    assert!(
        !lease.is_lost(),
        "lost to one hung renewal: {:?}",
        lease.loss_reason()
    );
    lease.release().await.unwrap();
}

/// A store slower than a renewal interval tuned short (renewals every 100 ms, answers in
/// 250 ms) still renews: each attempt may take half the time left, not only the interval
/// (cut at the interval and sent again, no renewal ever landed and the lease was lost).
#[tokio::test(start_paused = true)]
async fn a_store_slower_than_a_short_renewal_interval_still_renews() {
    let store = Stallable::new(Arc::new(TokioClock::new(0, 0)), Duration::from_millis(250));
    let lease = LeaseClient::new(store.clone())
        .ttl(Ttl::from_millis(3_000).unwrap())
        .renew_every(Duration::from_millis(100))
        .claim(job())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert!(!lease.is_lost(), "{:?}", lease.loss_reason());
    lease.release().await.unwrap();
}

/// A grant the store cut short (1 s for 60 s asked) that came at once is not renewed at
/// once: only a claim that waited long is.
#[tokio::test(start_paused = true)]
async fn a_capped_grant_that_came_at_once_is_not_renewed_at_once() {
    let mut store = Stallable::new(Arc::new(TokioClock::new(0, 0)), Duration::from_millis(5));
    store.max_ttl = Ttl::from_millis(1_000).unwrap();
    let lease = claim_with_ttl(&store, Ttl::from_millis(60_000).unwrap()).await;
    assert_eq!(store.renewals.load(Ordering::SeqCst), 0, "renewed at once");
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(
        store.renewals.load(Ordering::SeqCst),
        1,
        "renewed on schedule"
    );
    assert!(!lease.is_lost());
}

/// A fixed safety margin that takes most of a grant the store cut short: the keeper renews
/// within what the margin leaves (not on a third of the grant, after the local deadline),
/// and a grant no longer than the margin is refused by name, not as a timeout.
#[tokio::test(start_paused = true)]
async fn a_fixed_margin_and_a_capped_grant_still_renew_before_the_deadline() {
    let clock = Arc::new(TokioClock::new(1_700_000_000_000, 0));
    let mut store = Stallable::new(clock, Duration::from_millis(5));
    store.max_ttl = Ttl::from_millis(20_000).unwrap();
    let client = LeaseClient::new(store.clone())
        .ttl(Ttl::from_millis(60_000).unwrap())
        .safety_margin(Duration::from_secs(15));
    let lease = client.claim(job()).await.unwrap();
    let first = lease.deadline();
    // The deadline is 5 s after the claim; a third of the grant would be 6.7 s.
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert!(
        !lease.is_lost(),
        "lost a 20 s grant with a 15 s margin: {:?}",
        lease.loss_reason()
    );
    assert!(lease.deadline() > first, "never renewed");
    lease.release().await.unwrap();

    store.max_ttl = Ttl::from_millis(10_000).unwrap();
    let client = LeaseClient::new(store.clone())
        .ttl(Ttl::from_millis(60_000).unwrap())
        .safety_margin(Duration::from_secs(15));
    match client.claim(job()).await {
        Err(ClaimError::GrantTooShort {
            granted, margin, ..
        }) => assert_eq!(
            (granted, margin),
            (Duration::from_secs(10), Duration::from_secs(15))
        ),
        other => panic!("{:?}", other.map(|l| l.generation())),
    }
}

/// A renewal answered `Lost` loses the lease at once, before the local deadline.
#[tokio::test(start_paused = true)]
async fn superseded_renewal_loses_at_once() {
    let clock = Arc::new(ManualClock::new(1_700_000_000_000));
    let store = MemoryLeaseStore::with_clock(clock.clone());
    let ttl = Ttl::from_millis(3_000).unwrap();
    let lease = claim_with_ttl(&store, ttl).await;
    // The store's clock jumps past expiry (the worker's does not) and B claims.
    clock.advance(Duration::from_secs(4));
    let b: Owner = "b".parse().unwrap();
    assert!(matches!(
        store
            .claim(&job(), &b, &fence_lease::new_lease_key().unwrap(), ttl)
            .await
            .unwrap(),
        Outcome::Granted(_)
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
    let lease = claim_with_ttl(&store, Ttl::from_millis(1_000).unwrap()).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    // Renewals every 333 ms, failed ones retried every 42-83 ms (jittered), deadline 900 ms
    // after the last good renewal was sent: a failure of 400 ms is always survived (at worst
    // 333 + 400 + 83 = 816 ms). With 500 ms the worst case, 916 ms, passed the deadline in
    // about one run in thirty: the lease was rightly lost, and the test flaked.
    store.failing.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(400)).await;
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
    let mut svc = fence_lease::Fencing::new(echo(), view.clone());
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
        Err(ClaimError::Timing(_))
    ));
    // The default at 100 ms: margin 50 ms, renewal every 33 ms.
    assert!(base.claim(job()).await.is_ok());
}

/// A claim that waits while another owner holds the job gets the lease when that lease
/// expires; because its local deadline still runs from when the claim was sent (long ago),
/// it renews at once, so the lease it returns is alive and keeps its full margin.
#[tokio::test(start_paused = true)]
async fn a_claim_that_waited_renews_at_once_and_holds_a_live_lease() {
    let clock = Arc::new(TokioClock::new(1_700_000_000_000, 0));
    let store = Arc::new(MemoryLeaseStore::with_clock(clock));
    let ttl = Ttl::from_millis(1_000).unwrap();
    // A claims, then crashes: no renewal, no release.
    let key = fence_lease::new_lease_key().unwrap();
    let a: Owner = "a".parse().unwrap();
    let held = store.claim(&job(), &a, &key, ttl).await.unwrap();
    assert!(matches!(held, Outcome::Granted(_)));
    let b = LeaseClient::from_arc(store.clone())
        .owner("b".parse().unwrap())
        .ttl(ttl);
    // Without waiting: held.
    assert!(matches!(b.claim(job()).await, Err(ClaimError::Held { .. })));
    // B waits for A's lease to run out.
    let started = Instant::now();
    let lease = b
        .claim_waiting(job(), Duration::from_secs(10))
        .await
        .unwrap();
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(900), "{waited:?}");
    assert!(waited < Duration::from_secs(3), "{waited:?}");
    assert_eq!(lease.generation(), Generation::new(2));
    assert!(
        !lease.is_lost(),
        "the lease is alive when it is handed over"
    );
    // Its deadline runs from the renewal: it survives most of a TTL from now.
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(!lease.is_lost());
    let record = store.get(&job()).await.unwrap().unwrap();
    assert_eq!(record.state, LeaseState::Held);
    // A wait that ends while the job is held: Held, after the wait.
    let c = LeaseClient::from_arc(store.clone()).owner("c".parse().unwrap());
    let started = Instant::now();
    let refused = c.claim_waiting(job(), Duration::from_millis(300)).await;
    assert!(
        matches!(refused, Err(ClaimError::Held { .. })),
        "{refused:?}"
    );
    assert!(started.elapsed() >= Duration::from_millis(300));
}

/// A client on `store` claims [`job`] with `ttl`: the lease.
async fn claim_with_ttl<S: LeaseStore + Clone>(store: &S, ttl: Ttl) -> Lease<S> {
    LeaseClient::new(store.clone())
        .ttl(ttl)
        .claim(job())
        .await
        .unwrap()
}

/// A store with no record of any job (it forgot them): renewals are answered "unknown job".
#[derive(Debug, Clone, Default)]
struct Forgotten(MemoryLeaseStore);

impl LeaseStore for Forgotten {
    async fn claim_slot(
        &self,
        resource: &fence_core::JobId,
        owner: &fence_core::Owner,
        key: &fence_core::secret::LeaseKey,
        terms: fence_lease::ClaimTerms,
        slots: u32,
    ) -> Result<fence_lease::SlotClaim, fence_lease::StoreError> {
        self.0.claim_slot(resource, owner, key, terms, slots).await
    }

    async fn apply(&self, _job: &JobId, _op: LeaseOp) -> Result<Outcome, StoreError> {
        Ok(Outcome::Unknown)
    }

    async fn get(&self, _job: &JobId) -> Result<Option<LeaseRecord>, StoreError> {
        Ok(None)
    }

    async fn list(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        self.0.list(query).await
    }
}

/// A store that decides the first claim and then loses its answer (a 503 after the write, a
/// gateway's 502, a cut connection).
#[derive(Debug, Clone, Default)]
struct LosesFirstClaimAnswer {
    inner: MemoryLeaseStore,
    lost: Arc<AtomicBool>,
}

impl LeaseStore for LosesFirstClaimAnswer {
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
        let claim = matches!(op, LeaseOp::Claim { .. });
        let outcome = self.inner.apply(job, op).await?;
        if claim && !self.lost.swap(true, Ordering::SeqCst) {
            return Err(StoreError::Unavailable {
                status: 503,
                detail: "the answer was lost after the decision".into(),
                retry_after: None,
            });
        }
        Ok(outcome)
    }

    async fn get(&self, job: &JobId) -> Result<Option<LeaseRecord>, StoreError> {
        self.inner.get(job).await
    }

    async fn list(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        self.inner.list(query).await
    }
}

/// A claim whose answer was lost may have been granted: the client's next claim of the job
/// asks with the same lease key and gets that lease back, instead of being told for a whole
/// TTL that the job is held by this very owner.
#[tokio::test]
async fn a_claim_after_one_whose_answer_was_lost_gets_that_lease_back() {
    let store = LosesFirstClaimAnswer::default();
    let client = LeaseClient::new(store.clone()).owner("worker".parse().unwrap());
    let first = client.claim(job()).await.map(|l| l.generation());
    assert!(
        matches!(
            first,
            Err(ClaimError::Store(StoreError::Unavailable { .. }))
        ),
        "{first:?}"
    );
    let lease = client
        .claim(job())
        .await
        .expect("the lost grant, asked again");
    assert_eq!(lease.generation(), Generation::new(1));
    lease.release().await.unwrap();
    // Settled: the next claim is a claim like any other.
    let next = client.claim(job()).await.unwrap();
    assert_eq!(next.generation(), Generation::new(2));
}

/// A store that decides the first claim and then never answers (a hung connection).
#[derive(Debug, Clone, Default)]
struct HangsAfterFirstClaim {
    inner: MemoryLeaseStore,
    hung: Arc<AtomicBool>,
}

impl LeaseStore for HangsAfterFirstClaim {
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
        let claim = matches!(op, LeaseOp::Claim { .. });
        let outcome = self.inner.apply(job, op).await?;
        if claim && !self.hung.swap(true, Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        Ok(outcome)
    }

    async fn get(&self, job: &JobId) -> Result<Option<LeaseRecord>, StoreError> {
        self.inner.get(job).await
    }

    async fn list(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        self.inner.list(query).await
    }
}

/// A claim its caller gave up on (its own timeout dropped the future) may have been granted:
/// the next claim of the job gets that lease back, not "held by this very owner" for a TTL.
#[tokio::test(start_paused = true)]
async fn a_claim_after_one_its_caller_dropped_gets_that_lease_back() {
    let store = HangsAfterFirstClaim::default();
    let client = LeaseClient::new(store.clone()).owner("worker".parse().unwrap());
    let first = tokio::time::timeout(Duration::from_secs(1), client.claim(job())).await;
    assert!(first.is_err(), "the first claim's answer never comes");
    let lease = client
        .claim(job())
        .await
        .expect("the grant its dropped claim won, asked again");
    assert_eq!(lease.generation(), Generation::new(1));
    lease.release().await.unwrap();
}

/// A grant too short to hold is given back at once, not left standing until it expires: the
/// next worker claims the job without waiting.
#[tokio::test(start_paused = true)]
async fn a_grant_too_short_to_hold_is_released_for_the_next_worker() {
    let clock = Arc::new(TokioClock::new(1_700_000_000_000, 0));
    let mut store = Stallable::new(clock, Duration::from_millis(5));
    store.max_ttl = Ttl::from_millis(10_000).unwrap();
    let cautious = LeaseClient::new(store.clone())
        .owner("cautious".parse().unwrap())
        .ttl(Ttl::from_millis(60_000).unwrap())
        .safety_margin(Duration::from_secs(15));
    let refused = cautious.claim(job()).await.map(|l| l.generation());
    assert!(
        matches!(refused, Err(ClaimError::GrantTooShort { .. })),
        "{refused:?}"
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    let next = LeaseClient::new(store.clone())
        .owner("next".parse().unwrap())
        .ttl(Ttl::from_millis(10_000).unwrap())
        .claim(job())
        .await
        .expect("the job, given back by the client that could not hold it");
    assert_eq!(next.generation(), Generation::new(2));
}

/// A store whose first claim is granted for 1 s whatever was asked and answered 400 ms late
/// (so the client renews it at once), whose first renewal fails, and whose releases take
/// 50 ms to land.
#[derive(Debug, Clone, Default)]
struct ShortFirstGrantSlowRelease {
    inner: MemoryLeaseStore,
    claimed: Arc<AtomicBool>,
    renewed: Arc<AtomicBool>,
}

impl LeaseStore for ShortFirstGrantSlowRelease {
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

    async fn apply(&self, job: &JobId, mut op: LeaseOp) -> Result<Outcome, StoreError> {
        match &mut op {
            LeaseOp::Claim { ttl, .. } if !self.claimed.swap(true, Ordering::SeqCst) => {
                *ttl = Ttl::from_millis(1_000).unwrap();
                tokio::time::sleep(Duration::from_millis(400)).await;
            }
            LeaseOp::Renew { .. } if !self.renewed.swap(true, Ordering::SeqCst) => {
                return Err(StoreError::io("connection refused"));
            }
            LeaseOp::Release { .. } => tokio::time::sleep(Duration::from_millis(50)).await,
            _ => {}
        }
        self.inner.apply(job, op).await
    }

    async fn get(&self, job: &JobId) -> Result<Option<LeaseRecord>, StoreError> {
        self.inner.get(job).await
    }

    async fn list(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        self.inner.list(query).await
    }
}

/// A grant given back in the background (here: granted too short, and its renewal failed) is
/// not handed to the client's next claim while the
/// release is on its way: that claim would get the grant back, and the release landing after
/// it would free the job under a lease the client believes it holds.
#[tokio::test(start_paused = true)]
async fn a_claim_right_after_an_abandoned_grant_is_not_freed_under_it() {
    let store = ShortFirstGrantSlowRelease::default();
    let client = LeaseClient::new(store.clone())
        .owner("worker".parse().unwrap())
        .ttl(Ttl::from_millis(60_000).unwrap());
    // Granted, but not renewed: the grant is given back in the background.
    let refused = client.claim(job()).await.map(|l| l.generation());
    assert!(
        matches!(refused, Err(ClaimError::Store(StoreError::Io(_)))),
        "{refused:?}"
    );
    // Asked again at once, until granted (the job is held until the release lands).
    let started = Instant::now();
    let lease = loop {
        match client.claim(job()).await {
            Ok(lease) => break lease,
            Err(ClaimError::Held { .. }) => {
                assert!(started.elapsed() < Duration::from_secs(5), "never granted");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(e) => panic!("{e:?}"),
        }
    };
    tokio::time::sleep(Duration::from_millis(200)).await; // any release in flight has landed
    let record = store.inner.get(&job()).await.unwrap().unwrap();
    assert_eq!(
        (record.state, record.owner, record.generation),
        (
            LeaseState::Held,
            Some("worker".parse().unwrap()),
            lease.generation()
        ),
        "the job was freed under the lease the client holds"
    );
    assert!(!lease.is_lost());
}

/// Resuming a lease the store no longer knows of says it is not held (what `fence
/// keepalive` turns into exit 75), not that the store broke the protocol.
#[tokio::test]
async fn resuming_a_forgotten_job_says_it_is_not_held() {
    let client = LeaseClient::new(Forgotten::default()).owner("script".parse().unwrap());
    let key = fence_lease::LeaseKey::new("an-old-lease-key-0123456789abcdef").unwrap();
    let err = client
        .resume(job(), Generation::new(4), key)
        .await
        .map(|_| ())
        .unwrap_err();
    assert!(
        matches!(&err, ClaimError::NotHeld { why, .. } if why.contains("no record")),
        "{err:?}"
    );
}

/// With `progress_within`, a worker that keeps reporting progress keeps its lease through
/// many renewals; once it stops (hung, live-locked), the lease is lost with `NoProgress` when
/// progress is due, the keeper renews no more, and the lease is not released:
/// the store lets it expire, the next claim gets the next generation.
#[tokio::test(start_paused = true)]
async fn a_worker_that_stops_reporting_progress_loses_its_lease_and_it_expires() {
    let clock = Arc::new(TokioClock::new(1_700_000_000_000, 0));
    let store = Stallable::new(clock, Duration::from_millis(5));
    let ttl = Ttl::from_millis(3_000).unwrap(); // renewals every second
    let a = LeaseClient::new(store.clone())
        .owner("worker-a".parse().unwrap())
        .ttl(ttl)
        .progress_within(Duration::from_secs(2));
    let lease = a.claim(job()).await.unwrap();
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        lease.progress();
    }
    assert!(
        !lease.is_lost(),
        "10 s of steady progress: {:?}",
        lease.loss_reason()
    );
    let stopped = Instant::now();
    tokio::time::timeout(Duration::from_secs(10), lease.lost())
        .await
        .expect("lost within 10 s of the last progress");
    assert_eq!(
        lease.loss_reason(),
        Some(LossReason::NoProgress {
            within: Duration::from_secs(2)
        })
    );
    let after = stopped.elapsed();
    assert!(
        after >= Duration::from_secs(2) && after <= Duration::from_secs(3),
        "lost {after:?} after the last progress"
    );
    // Not released: still held at the store until its TTL runs out, then the next generation.
    let record = store.inner.get(&job()).await.unwrap().unwrap();
    assert_eq!(record.state, LeaseState::Held);
    tokio::time::sleep(ttl.as_duration()).await;
    let b = LeaseClient::new(store.clone()).owner("worker-b".parse().unwrap());
    assert_eq!(
        b.claim(job()).await.unwrap().generation().get(),
        lease.generation().get() + 1
    );

    // Without progress_within, progress() does nothing and nothing is required of it.
    let c = LeaseClient::new(store.clone())
        .owner("worker-c".parse().unwrap())
        .ttl(ttl);
    let free = c.claim("unbound".parse().unwrap()).await.unwrap();
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert!(!free.is_lost());
    assert!(matches!(
        LeaseClient::new(store)
            .progress_within(Duration::ZERO)
            .claim(job())
            .await,
        Err(ClaimError::Timing(_))
    ));
}

/// A hung worker is noticed when its progress is due, not at the next renewal: with a one
/// hour lease (renewed every 20 minutes) and progress due within 2 s, the lease is lost 2 s
/// after the last progress, and not renewed meanwhile.
#[tokio::test(start_paused = true)]
async fn no_progress_is_noticed_when_due_not_at_the_next_renewal() {
    let clock = Arc::new(TokioClock::new(1_700_000_000_000, 0));
    let store = Arc::new(MemoryLeaseStore::with_clock(clock));
    let lease = LeaseClient::from_arc(store.clone())
        .owner("hung".parse().unwrap())
        .ttl(Ttl::from_millis(3_600_000).unwrap())
        .progress_within(Duration::from_secs(2))
        .claim(job())
        .await
        .unwrap();
    let granted = Instant::now();
    tokio::time::sleep(Duration::from_secs(1)).await;
    lease.progress();
    let reported = Instant::now();
    tokio::time::timeout(Duration::from_secs(60), lease.lost())
        .await
        .expect("lost within a minute, not at the renewal 20 minutes on");
    assert_eq!(
        lease.loss_reason(),
        Some(LossReason::NoProgress {
            within: Duration::from_secs(2)
        })
    );
    assert_eq!(reported.elapsed(), Duration::from_secs(2), "lost when due");
    assert_eq!(granted.elapsed(), Duration::from_secs(3));
}

/// The progress interval of a lease granted after a wait runs from the grant, not from when
/// the claim was sent: a worker that waited most of the interval for the job is not judged
/// hung before it could report anything.
#[tokio::test(start_paused = true)]
async fn a_claim_that_waited_has_its_whole_progress_interval_after_the_grant() {
    let clock = Arc::new(TokioClock::new(1_700_000_000_000, 0));
    let store = Arc::new(MemoryLeaseStore::with_clock(clock));
    let a: Owner = "a".parse().unwrap();
    let key = fence_lease::new_lease_key().unwrap();
    let held = store
        .claim(&job(), &a, &key, Ttl::from_millis(8_000).unwrap())
        .await
        .unwrap();
    assert!(matches!(held, Outcome::Granted(_)));
    let b = LeaseClient::from_arc(store.clone())
        .owner("b".parse().unwrap())
        .ttl(Ttl::from_millis(30_000).unwrap())
        .progress_within(Duration::from_secs(9));
    let started = Instant::now();
    let lease = b
        .claim_waiting(job(), Duration::from_secs(20))
        .await
        .unwrap();
    assert!(started.elapsed() >= Duration::from_secs(8));
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(
        !lease.is_lost(),
        "lost 5 s after the grant, with 9 s to report progress: {:?}",
        lease.loss_reason()
    );
    // Without progress, it is lost within the next interval all the same.
    tokio::time::timeout(Duration::from_secs(15), lease.lost())
        .await
        .expect("lost once no progress came for 9 s");
    assert_eq!(
        lease.loss_reason(),
        Some(LossReason::NoProgress {
            within: Duration::from_secs(9)
        })
    );
}

/// A store that decides every semaphore claim but loses the answer to the first one, as a
/// connection cut after the server granted.
#[derive(Debug, Default)]
struct LosesFirstSlotAnswer {
    inner: MemoryLeaseStore,
    lost_one: AtomicBool,
    /// The lost answer is a 503 with `Retry-After` (this long) instead of a cut connection.
    unavailable_for: Option<Duration>,
    /// Every claim after the lost one finds the store busy (claims queued before it)...
    busy_after: bool,
    /// ... as a 503, as a server answers it over HTTP.
    busy_as_503: bool,
}

impl LeaseStore for LosesFirstSlotAnswer {
    async fn apply(&self, job: &JobId, op: LeaseOp) -> Result<Outcome, StoreError> {
        self.inner.apply(job, op).await
    }

    async fn get(&self, job: &JobId) -> Result<Option<LeaseRecord>, StoreError> {
        self.inner.get(job).await
    }

    async fn list(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        self.inner.list(query).await
    }

    async fn claim_slot(
        &self,
        resource: &JobId,
        owner: &Owner,
        key: &fence_core::secret::LeaseKey,
        terms: fence_lease::ClaimTerms,
        slots: u32,
    ) -> Result<fence_lease::SlotClaim, StoreError> {
        if self.busy_after && self.lost_one.load(Ordering::SeqCst) {
            return Err(if self.busy_as_503 {
                StoreError::Unavailable {
                    status: 503,
                    detail: "claims queued before it: nothing was decided".into(),
                    retry_after: Some(Duration::from_millis(50)),
                }
            } else {
                StoreError::Busy("claims queued before this one".into())
            });
        }
        let decided = self
            .inner
            .claim_slot(resource, owner, key, terms, slots)
            .await?;
        if !self.lost_one.swap(true, Ordering::SeqCst) {
            return Err(match self.unavailable_for {
                None => StoreError::io(BoxError::from("connection reset")),
                Some(after) => StoreError::Unavailable {
                    status: 503,
                    detail: "the disk did not confirm the write within 5s".into(),
                    retry_after: Some(after),
                },
            });
        }
        Ok(decided)
    }
}

/// A semaphore claim whose grant was lost on the way back is asked again with the same
/// lease key while the wait lasts: the client holds the slot the store granted, and no
/// second slot stands idle until it expires.
#[tokio::test]
async fn a_lost_slot_grant_is_asked_again_for_the_same_slot() {
    let store = Arc::new(LosesFirstSlotAnswer::default());
    let client = LeaseClient::from_arc(store.clone()).owner("w".parse().unwrap());
    let resource: JobId = "pool".parse().unwrap();
    let lease = client
        .claim_slot(resource, 2, Duration::from_secs(1))
        .await
        .expect("the slot, after the lost answer");
    assert!(store.lost_one.load(Ordering::SeqCst), "no answer was lost");
    assert_eq!(lease.job().as_str(), "pool#1");
    assert_eq!(lease.generation(), Generation::new(1));
    let second = store.get(&"pool#2".parse().unwrap()).await.unwrap();
    assert_eq!(second, None, "a second slot was taken: {second:?}");
    // Without a wait, the lost answer is the caller's to handle.
    let store = Arc::new(LosesFirstSlotAnswer::default());
    let client = LeaseClient::from_arc(store).owner("w".parse().unwrap());
    let lost = client
        .claim_slot("pool".parse().unwrap(), 2, Duration::ZERO)
        .await;
    assert!(
        matches!(lost, Err(ClaimError::Store(StoreError::Io(_)))),
        "{lost:?}"
    );
    // Lost as a 503 (the server decided, then could not confirm in time): asked again
    // after its Retry-After, for the same slot.
    let after = Duration::from_millis(300);
    let store = Arc::new(LosesFirstSlotAnswer {
        unavailable_for: Some(after),
        ..LosesFirstSlotAnswer::default()
    });
    let client = LeaseClient::from_arc(store.clone()).owner("w".parse().unwrap());
    let began = std::time::Instant::now();
    let lease = client
        .claim_slot("pool".parse().unwrap(), 2, Duration::from_secs(5))
        .await
        .expect("the slot, after the 503");
    assert!(
        began.elapsed() >= after,
        "asked again after {:?}",
        began.elapsed()
    );
    assert_eq!(lease.job().as_str(), "pool#1");
    let second = store.get(&"pool#2".parse().unwrap()).await.unwrap();
    assert_eq!(second, None, "a second slot was taken: {second:?}");
    // Lost, then busy until the wait ends: the loss is what the caller hears (the slot may
    // be held), not "busy", which says nothing was decided.
    for busy_as_503 in [false, true] {
        let store = Arc::new(LosesFirstSlotAnswer {
            busy_after: true,
            busy_as_503,
            ..LosesFirstSlotAnswer::default()
        });
        let client = LeaseClient::from_arc(store).owner("w".parse().unwrap());
        let lost = client
            .claim_slot("pool".parse().unwrap(), 2, Duration::from_millis(300))
            .await;
        assert!(
            matches!(lost, Err(ClaimError::Store(StoreError::Io(_)))),
            "busy as a 503: {busy_as_503}: {lost:?}"
        );
    }
}

/// A semaphore whose every slot is taken, answering without saying when one frees (a
/// lease-held or lock-delay refusal without `expires_in_ms` / `claimable_in_ms` reads as 0):
/// counts the claims, and after 1000 fails them so a client that never pauses stops.
#[derive(Debug, Default)]
struct FullWithoutExpiry {
    claims: AtomicUsize,
}

impl LeaseStore for FullWithoutExpiry {
    async fn apply(&self, _job: &JobId, _op: LeaseOp) -> Result<Outcome, StoreError> {
        Ok(Outcome::Unknown)
    }

    async fn get(&self, _job: &JobId) -> Result<Option<LeaseRecord>, StoreError> {
        Ok(None)
    }

    async fn list(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        MemoryLeaseStore::new().list(query).await
    }

    async fn claim_slot(
        &self,
        _resource: &JobId,
        _owner: &Owner,
        _key: &fence_core::secret::LeaseKey,
        _terms: fence_lease::ClaimTerms,
        _slots: u32,
    ) -> Result<fence_lease::SlotClaim, StoreError> {
        if self.claims.fetch_add(1, Ordering::SeqCst) >= 1_000 {
            return Err(StoreError::Protocol("asked 1000 times".into()));
        }
        Ok(fence_lease::SlotClaim {
            slot: Some(1),
            outcome: Outcome::Held {
                owner: "other".parse().unwrap(),
                generation: Generation::new(1),
                expires_in: Duration::ZERO,
                lock_delay: false,
            },
        })
    }
}

/// A full semaphore that does not say when a slot frees is asked again every 10 ms at
/// most, not in a tight loop for the whole wait.
#[tokio::test(start_paused = true)]
async fn a_full_semaphore_without_an_expiry_is_not_asked_in_a_tight_loop() {
    let store = Arc::new(FullWithoutExpiry::default());
    let client = LeaseClient::from_arc(store.clone()).owner("w".parse().unwrap());
    let refused = client
        .claim_slot("pool".parse().unwrap(), 2, Duration::from_secs(1))
        .await
        .map(|l| l.generation());
    let claims = store.claims.load(Ordering::SeqCst);
    assert!(claims <= 101, "{claims} claims in a 1 s wait");
    assert!(
        matches!(refused, Err(ClaimError::Held { .. })),
        "{refused:?}"
    );
}

/// A wait of `Duration::MAX` (a caller's "for ever") used to panic on `Instant + wait`
/// (overflow) before the store was even asked: on a free job, a free semaphore slot, and a
/// job that frees while the claim waits.
#[tokio::test(start_paused = true)]
async fn a_wait_of_duration_max_claims_rather_than_panics() {
    let clock = Arc::new(TokioClock::new(1_700_000_000_000, 0));
    let store = MemoryLeaseStore::with_clock(clock);
    let a = LeaseClient::new(store.clone()).owner("worker-a".parse().unwrap());
    let b = LeaseClient::new(store.clone()).owner("worker-b".parse().unwrap());
    let lease = a.claim_waiting(job(), Duration::MAX).await.unwrap();
    let slot = a
        .claim_slot("pool".parse().unwrap(), 2, Duration::MAX)
        .await
        .unwrap();
    slot.release().await.unwrap();
    let waiting = tokio::spawn(async move { b.claim_waiting(job(), Duration::MAX).await });
    tokio::time::sleep(Duration::from_secs(1)).await;
    lease.release().await.unwrap();
    let taken = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("the waiting claim got the job once it was released")
        .unwrap()
        .unwrap();
    taken.release().await.unwrap();
}

/// An `HttpOptions` timeout of `Duration::MAX` (no timeout) used to panic on
/// `Instant + timeout` in every call, and on `timeout + wait` in a waiting claim. Two
/// servers that refuse connections: each call fails, promptly, as an I/O error.
#[tokio::test]
async fn an_http_timeout_of_duration_max_does_not_panic() {
    let closed = || {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", listener.local_addr().unwrap()) // closed once dropped
    };
    let urls = format!("{},{}", closed(), closed());
    let options = fence_lease::HttpOptions {
        timeout: Duration::MAX,
        ..fence_lease::HttpOptions::default()
    };
    let store = fence_lease::HttpLeaseStore::with_options(&urls, options).unwrap();
    let client = LeaseClient::new(store);
    for wait in [Duration::ZERO, Duration::from_secs(5), Duration::MAX] {
        let claimed =
            tokio::time::timeout(Duration::from_secs(60), client.claim_waiting(job(), wait))
                .await
                .expect("refused connections end the call");
        assert!(
            matches!(claimed, Err(ClaimError::Store(StoreError::Io(_)))),
            "{wait:?}: {claimed:?}"
        );
    }
}
