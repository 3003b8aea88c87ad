//! Regressions found in review of the per-job gate: a withdrawn pending bump must not stay
//! behind while another token's bump runs, and a waiter superseded by a newer token gets its
//! 409 at once instead of waiting out the drain limit.

use std::{convert::Infallible, sync::Arc, time::Duration};

use fence_core::{Generation, JobId};
use fence_sink::{
    Attempt, Begin, FenceLayer, Finish, GenerationStore, IdempotencyStore, MemoryStore,
    RequestBody, StoreError, Verdict,
};
use http::{Request, Response, StatusCode};
use tokio::sync::{Notify, mpsc};
use tower::{Layer, ServiceExt, service_fn, util::BoxCloneSyncService};

/// A memory store whose `observe` waits for a go-ahead when `gated` is set, whose `highest`
/// does when `reads_gated` is, and which panics on the token `panic_at` (0: never).
#[derive(Clone, Default)]
struct Gated {
    inner: MemoryStore,
    gated: Arc<std::sync::atomic::AtomicBool>,
    reads_gated: Arc<std::sync::atomic::AtomicBool>,
    go: Arc<Notify>,
    panic_at: Arc<std::sync::atomic::AtomicU64>,
}

impl GenerationStore for Gated {
    async fn observe(&self, job: &JobId, token: Generation) -> Result<Verdict, StoreError> {
        if self.panic_at.load(std::sync::atomic::Ordering::SeqCst) == token.get() {
            panic!("the store failed badly on token {token}");
        }
        if self.gated.load(std::sync::atomic::Ordering::SeqCst) {
            self.go.notified().await;
        }
        self.inner.observe(job, token).await
    }
    async fn highest(&self, job: &JobId) -> Result<Generation, StoreError> {
        if self.reads_gated.load(std::sync::atomic::Ordering::SeqCst) {
            self.go.notified().await;
        }
        self.inner.highest(job).await
    }
}

impl IdempotencyStore for Gated {
    async fn begin(&self, attempt: Attempt<'_>, d: Duration) -> Result<Begin, StoreError> {
        self.inner.begin(attempt, d).await
    }
    async fn finish(&self, attempt: Attempt<'_>, o: Finish) -> Result<(), StoreError> {
        self.inner.finish(attempt, o).await
    }
    async fn purge_expired(&self) -> Result<usize, StoreError> {
        self.inner.purge_expired().await
    }
}

fn post(token: u64) -> Request<String> {
    Request::post("/")
        .header("x-fencing-job", "j")
        .header("x-fencing-token", token)
        .body(String::new())
        .unwrap()
}

#[tokio::test]
async fn a_withdrawn_higher_bump_does_not_outlive_the_running_one() {
    let store = Gated::default();
    let layer = FenceLayer::new(store.clone()).drain_timeout(Duration::from_millis(200));
    let svc = layer.layer(service_fn(|_r: Request<RequestBody<String>>| async {
        Ok::<_, Infallible>(Response::new(String::new()))
    }));
    assert_eq!(svc.clone().oneshot(post(5)).await.unwrap().status(), 200);
    store.gated.store(true, std::sync::atomic::Ordering::SeqCst);
    let six = tokio::spawn(svc.clone().oneshot(post(6))); // its durable write now waits
    tokio::time::sleep(Duration::from_millis(20)).await;
    let seven = tokio::spawn(svc.clone().oneshot(post(7))); // pending 7 behind the bump of 6
    tokio::time::sleep(Duration::from_millis(20)).await;
    seven.abort(); // its client goes away
    let _ = seven.await;
    store
        .gated
        .store(false, std::sync::atomic::Ordering::SeqCst);
    store.go.notify_waiters();
    assert_eq!(six.await.unwrap().unwrap().status(), 200);
    // highest is 6 and nobody waits with 7: a token-6 request goes through.
    assert_eq!(
        svc.clone().oneshot(post(6)).await.unwrap().status(),
        200,
        "the abandoned 7 must not fence 6 out"
    );
}

/// A layer on `store` (a clone shares its state) with a drain limit of an hour, in front of a service that answers 200.
fn answering(
    store: Gated,
) -> impl tower::Service<
    Request<String>,
    Response = Response<fence_sink::ResponseBody<String>>,
    Error = Infallible,
    Future: Send,
> + Clone {
    FenceLayer::new(store)
        .drain_timeout(Duration::from_secs(3600))
        .layer(service_fn(|_r: Request<RequestBody<String>>| async {
            Ok::<_, Infallible>(Response::new(String::new()))
        }))
}

/// While a newer token's durable write runs, a token between the highest and it learns that
/// a newer token is waiting; a token below the highest is told the highest.
#[tokio::test]
async fn a_token_behind_a_running_bump_is_told_which_token_waits() {
    let store = Gated::default();
    let svc = answering(store.clone());
    assert_eq!(svc.clone().oneshot(post(5)).await.unwrap().status(), 200);
    store.gated.store(true, std::sync::atomic::Ordering::SeqCst);
    let seven = tokio::spawn(svc.clone().oneshot(post(7))); // its durable write now waits
    tokio::time::sleep(Duration::from_millis(20)).await;
    let detail = |resp: Response<fence_sink::ResponseBody<String>>| async move {
        assert_eq!(resp.status(), StatusCode::CONFLICT);
        let body = http_body_util::BodyExt::collect(resp.into_body())
            .await
            .unwrap()
            .to_bytes();
        let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
        problem["detail"].as_str().unwrap().to_owned()
    };
    let six = detail(svc.clone().oneshot(post(6)).await.unwrap()).await;
    assert!(
        six.contains("older than token 7, which a newer lease holder has presented"),
        "{six}"
    );
    let four = detail(svc.clone().oneshot(post(4)).await.unwrap()).await;
    assert!(four.contains("below generation 5"), "{four}");
    store
        .gated
        .store(false, std::sync::atomic::Ordering::SeqCst);
    store.go.notify_waiters();
    assert_eq!(seven.await.unwrap().unwrap().status(), 200);
}

#[tokio::test]
async fn a_bump_whose_store_panics_does_not_wedge_the_job() {
    let store = Gated::default();
    let svc = answering(store.clone());
    assert_eq!(svc.clone().oneshot(post(5)).await.unwrap().status(), 200);
    store.panic_at.store(6, std::sync::atomic::Ordering::SeqCst);
    let six = tokio::spawn(svc.clone().oneshot(post(6)));
    assert!(
        six.await.unwrap_err().is_panic(),
        "the store's panic reaches the caller"
    );
    // Without the bump's marks undone, 7 would wait for the running bump of 6 for an hour.
    let seven = tokio::time::timeout(Duration::from_secs(5), svc.clone().oneshot(post(7)))
        .await
        .expect("7 was not held up by the bump that panicked");
    assert_eq!(seven.unwrap().status(), 200);
}

#[tokio::test]
async fn a_superseded_waiter_gets_409_at_once() {
    let (inner, mut started, release) = holding(|_, token| token == "5");
    let svc = FenceLayer::new(MemoryStore::new())
        .drain_timeout(Duration::from_secs(30))
        .layer(inner);
    let five = tokio::spawn(svc.clone().oneshot(post(5)));
    assert_eq!(started.recv().await.unwrap(), "5");
    let six = tokio::spawn(svc.clone().oneshot(post(6))); // waits for 5 to drain
    tokio::time::sleep(Duration::from_millis(20)).await;
    let seven = tokio::spawn(svc.clone().oneshot(post(7))); // supersedes 6
    let answer = tokio::time::timeout(Duration::from_secs(2), six)
        .await
        .expect("6 answered before the drain limit");
    assert_eq!(answer.unwrap().unwrap().status(), StatusCode::CONFLICT);
    release.notify_waiters();
    assert_eq!(five.await.unwrap().unwrap().status(), 200);
    assert_eq!(seven.await.unwrap().unwrap().status(), 200);
}

#[tokio::test]
async fn clones_with_other_limits_still_share_one_fence() {
    let base = FenceLayer::new(MemoryStore::new());
    let ok = || {
        service_fn(|_r: Request<RequestBody<String>>| async {
            Ok::<_, Infallible>(Response::new(String::new()))
        })
    };
    let route_a = base
        .clone()
        .drain_timeout(Duration::from_secs(1))
        .max_cached_jobs(10)
        .layer(ok());
    let route_b = base.layer(ok());
    assert_eq!(
        route_a.clone().oneshot(post(5)).await.unwrap().status(),
        200
    );
    assert_eq!(
        route_b.clone().oneshot(post(6)).await.unwrap().status(),
        200
    );
    assert_eq!(
        route_a.oneshot(post(5)).await.unwrap().status(),
        409,
        "route a sees the 6 accepted on route b"
    );
}

/// A service that sends each request's token to the returned channel as it starts, and
/// holds the requests `hold(job, token)` picks until the returned `Notify` wakes them.
fn holding(hold: fn(&str, &str) -> bool) -> (Held, mpsc::UnboundedReceiver<String>, Arc<Notify>) {
    let (started_tx, started) = mpsc::unbounded_channel();
    let release = Arc::new(Notify::new());
    let svc = {
        let release = release.clone();
        service_fn(move |r: Request<RequestBody<String>>| {
            let (release, started_tx) = (release.clone(), started_tx.clone());
            async move {
                let job = r.headers()["x-fencing-job"].to_str().unwrap().to_owned();
                let token = r.headers()["x-fencing-token"].to_str().unwrap().to_owned();
                let _ = started_tx.send(token.clone());
                if hold(&job, &token) {
                    release.notified().await;
                }
                Ok::<_, Infallible>(Response::new(String::new()))
            }
        })
    };
    (BoxCloneSyncService::new(svc), started, release)
}

/// The service [`holding`] makes.
type Held = BoxCloneSyncService<Request<RequestBody<String>>, Response<String>, Infallible>;

fn post_job(job: &str, token: u64) -> Request<String> {
    Request::post("/")
        .header("x-fencing-job", job)
        .header("x-fencing-token", token)
        .body(String::new())
        .unwrap()
}

/// Passes that collapse idle gates and evict jobs (every 256 gates made, and past capacity)
/// run while one job has a request in flight and a bump waiting behind it: they must leave
/// that job's gate alone (a *new* request of the newer token still waits for the old one,
/// which it would not on a gate rebuilt from the store), and every cached job keeps its
/// highest generation.
#[tokio::test]
async fn collapsing_and_evicting_passes_leave_busy_jobs_alone() {
    let (inner, mut started, release) = holding(|job, token| job == "busy" && token == "5");
    let layer = FenceLayer::new(MemoryStore::new())
        .max_cached_jobs(100)
        .drain_timeout(Duration::from_secs(30));
    let svc = layer.layer(inner);
    let five = tokio::spawn(svc.clone().oneshot(post_job("busy", 5)));
    assert_eq!(started.recv().await.unwrap(), "5");
    let six = tokio::spawn(svc.clone().oneshot(post_job("busy", 6))); // waits for 5
    tokio::time::sleep(Duration::from_millis(20)).await;
    for i in 0..500u64 {
        let job = format!("other-{i}");
        let status = svc
            .clone()
            .oneshot(post_job(&job, 3))
            .await
            .unwrap()
            .status();
        assert_eq!(status, 200, "{job}");
    }
    // The bound, exactly: a 101st job evicts idle ones down to 94 (capacity less a
    // sixteenth, so the scan is paid once per several inserts); "busy" and 500 others make
    // 100, then 94 + 7 x 57 more, then one: 95.
    assert_eq!(layer.cached_jobs(), 95, "the cache kept its bound");
    // Jobs still cached answer from their collapsed entries: 2 is stale, 3 passes.
    for i in 480..500u64 {
        let job = format!("other-{i}");
        let stale = svc.clone().oneshot(post_job(&job, 2)).await.unwrap();
        assert_eq!(stale.status(), StatusCode::CONFLICT, "{job}");
    }
    assert!(!six.is_finished(), "the bump of 6 still waits for 5");
    // A second request of 6 arrives now: the job's gate must be the one that counts 5 in
    // flight. Had a pass evicted or collapsed it, a gate rebuilt from the store (highest 6,
    // nothing in flight) would let it through while 5 still runs.
    let another_six = tokio::spawn(svc.clone().oneshot(post_job("busy", 6)));
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        !another_six.is_finished(),
        "a newer token passed while an older request of its job was in flight"
    );
    assert_eq!(
        svc.clone()
            .oneshot(post_job("busy", 4))
            .await
            .unwrap()
            .status(),
        StatusCode::CONFLICT,
        "the busy job kept its pending bump"
    );
    release.notify_waiters();
    assert_eq!(five.await.unwrap().unwrap().status(), 200);
    assert_eq!(six.await.unwrap().unwrap().status(), 200);
    assert_eq!(another_six.await.unwrap().unwrap().status(), 200);
    assert_eq!(
        svc.oneshot(post_job("busy", 5)).await.unwrap().status(),
        StatusCode::CONFLICT
    );
}

/// A memory store that says it is shared, as PostgreSQL is: several sinks (processes) write
/// to it, so a highest cached by one of them may be out of date.
#[derive(Clone, Default)]
struct Shared(MemoryStore);

impl GenerationStore for Shared {
    async fn observe(&self, job: &JobId, token: Generation) -> Result<Verdict, StoreError> {
        self.0.observe(job, token).await
    }
    async fn highest(&self, job: &JobId) -> Result<Generation, StoreError> {
        self.0.highest(job).await
    }
    fn is_shared(&self) -> bool {
        true
    }
}

impl IdempotencyStore for Shared {
    async fn begin(&self, attempt: Attempt<'_>, d: Duration) -> Result<Begin, StoreError> {
        self.0.begin(attempt, d).await
    }
    async fn finish(&self, attempt: Attempt<'_>, o: Finish) -> Result<(), StoreError> {
        self.0.finish(attempt, o).await
    }
    async fn purge_expired(&self) -> Result<usize, StoreError> {
        self.0.purge_expired().await
    }
}

/// Two sinks on one shared store: after sink B accepts 6, sink A, whose memory still says 5,
/// must not let 5 through from memory; the store has the last word on every request.
#[tokio::test]
async fn a_sink_on_a_shared_store_never_answers_from_an_outdated_memory() {
    let store = Shared::default();
    let ok = || {
        service_fn(|_: Request<RequestBody<String>>| async {
            Ok::<_, Infallible>(Response::new(String::new()))
        })
    };
    let a = FenceLayer::new(store.clone()).layer(ok());
    let b = FenceLayer::new(store).layer(ok());
    assert_eq!(a.clone().oneshot(post(5)).await.unwrap().status(), 200);
    assert_eq!(a.clone().oneshot(post(5)).await.unwrap().status(), 200);
    assert_eq!(b.clone().oneshot(post(6)).await.unwrap().status(), 200);
    assert_eq!(
        a.clone().oneshot(post(5)).await.unwrap().status(),
        StatusCode::CONFLICT,
        "sink A let a stale token through from memory"
    );
    // And A has learnt: 6 passes there, 5 stays refused.
    assert_eq!(a.clone().oneshot(post(6)).await.unwrap().status(), 200);
    assert_eq!(
        a.oneshot(post(5)).await.unwrap().status(),
        StatusCode::CONFLICT
    );
}

/// What the layer reports to operators (`in_flight()`, `job()`; the proxy's metrics and
/// admin endpoint) counts the admitted requests still running, the ones of the current
/// generation and the older ones a bump waits for, and reads a job it does not hold in
/// memory from the store.
#[tokio::test(start_paused = true)]
async fn the_layer_reports_running_requests_and_reads_uncached_jobs_from_the_store() {
    let (inner, mut started, release) = holding(|_, token| token == "3");
    let store = MemoryStore::new();
    let layer = FenceLayer::new(store.clone()).drain_timeout(Duration::from_secs(30));
    let svc = layer.layer(inner);
    let job: JobId = "busy".parse().unwrap();
    assert_eq!(layer.in_flight(), 0);

    let three = tokio::spawn(svc.clone().oneshot(post_job("busy", 3)));
    assert_eq!(started.recv().await.unwrap(), "3");
    let fence = layer.job(&job).await.unwrap();
    assert_eq!((fence.highest, fence.in_flight), (Generation::new(3), 1));
    assert_eq!(
        layer.in_flight(),
        1,
        "one request of the current generation"
    );

    // 4 waits for 3 to finish: 3 is now an older request draining, still running.
    let four = tokio::spawn(svc.clone().oneshot(post_job("busy", 4)));
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(!four.is_finished(), "4 waits for 3");
    assert_eq!(layer.in_flight(), 1, "one older request draining");
    assert_eq!(layer.job(&job).await.unwrap().in_flight, 1);

    release.notify_waiters();
    assert_eq!(three.await.unwrap().unwrap().status(), 200);
    assert_eq!(four.await.unwrap().unwrap().status(), 200);
    assert_eq!(layer.in_flight(), 0, "nothing runs any more");
    let fence = layer.job(&job).await.unwrap();
    assert_eq!((fence.highest, fence.in_flight), (Generation::new(4), 0));

    // A layer that never saw the job (a restart on the same store) reads it from the store.
    let fresh = FenceLayer::new(store);
    assert_eq!(fresh.cached_jobs(), 0);
    let fence = fresh.job(&job).await.unwrap();
    assert_eq!((fence.highest, fence.in_flight), (Generation::new(4), 0));
    let unknown = fresh.job(&"never-seen".parse().unwrap()).await.unwrap();
    assert_eq!((unknown.highest, unknown.in_flight), (Generation::ZERO, 0));
}

/// A job whose first request is still reading its highest generation from the store is
/// not reported as highest 0: `job()` reads the store itself rather than the gate that is
/// not loaded yet.
#[tokio::test(start_paused = true)]
async fn a_job_being_loaded_is_reported_from_the_store() {
    let store = Gated::default();
    let job: JobId = "slow".parse().unwrap();
    store.inner.observe(&job, Generation::new(3)).await.unwrap();
    let layer = FenceLayer::new(store.clone());
    let svc = layer.layer(service_fn(|_r: Request<RequestBody<String>>| async {
        Ok::<_, Infallible>(Response::new(String::new()))
    }));
    store
        .reads_gated
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let request = tokio::spawn(svc.oneshot(post_job("slow", 3)));
    tokio::time::sleep(Duration::from_millis(10)).await; // the gate exists, loading
    let peek = tokio::spawn({
        let (layer, job) = (layer.clone(), job.clone());
        async move { layer.job(&job).await }
    });
    tokio::time::sleep(Duration::from_millis(10)).await;
    store
        .reads_gated
        .store(false, std::sync::atomic::Ordering::SeqCst);
    store.go.notify_waiters();
    let fence = peek.await.unwrap().unwrap();
    assert_eq!(fence.highest, Generation::new(3), "read from the store");
    assert_eq!(request.await.unwrap().unwrap().status(), 200);
}
