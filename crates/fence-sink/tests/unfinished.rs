//! An idempotency record whose completion failed is completed in the background while its request stays in flight, so a newer holder's request with the same key replays the answer instead of running the step again.

use std::{
    convert::Infallible,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use fence_core::{Generation, JobId};
use fence_sink::{
    Attempt, Begin, FenceLayer, Finish, GenerationStore, IdempotencyStore, MemoryStore,
    RequestBody, StoreError, Verdict,
};
use http::{Request, Response};
use http_body_util::BodyExt;
use tower::{Layer, ServiceExt, service_fn};

/// A memory store whose first `failures` completions fail, as a store that is briefly away.
#[derive(Clone)]
struct FailsToFinish {
    inner: MemoryStore,
    failures: Arc<AtomicUsize>,
}

impl GenerationStore for FailsToFinish {
    async fn observe(&self, job: &JobId, token: Generation) -> Result<Verdict, StoreError> {
        self.inner.observe(job, token).await
    }
    async fn highest(&self, job: &JobId) -> Result<Generation, StoreError> {
        self.inner.highest(job).await
    }
}

impl IdempotencyStore for FailsToFinish {
    async fn begin(&self, attempt: Attempt<'_>, d: Duration) -> Result<Begin, StoreError> {
        self.inner.begin(attempt, d).await
    }
    async fn finish(&self, attempt: Attempt<'_>, outcome: Finish) -> Result<(), StoreError> {
        let left = self.failures.load(Ordering::SeqCst);
        if left > 0 {
            self.failures.store(left - 1, Ordering::SeqCst);
            return Err(StoreError::io(std::io::Error::other("the store is away")));
        }
        self.inner.finish(attempt, outcome).await
    }
    async fn purge_expired(&self) -> Result<usize, StoreError> {
        self.inner.purge_expired().await
    }
}

fn pay(token: u64) -> Request<String> {
    Request::post("/pay")
        .header("x-fencing-job", "job-1")
        .header("x-fencing-token", token.to_string())
        .header("idempotency-key", "step-1")
        .body("pay 5".to_owned())
        .unwrap()
}

/// The step ran under token 7 but its answer could not be recorded at once: a newer
/// holder's retry of that step (token 8, same key) waits until the record is completed, then
/// gets 7's answer replayed. The step ran once.
#[tokio::test(start_paused = true)]
async fn a_newer_holder_replays_a_step_whose_record_was_completed_late() {
    let runs = Arc::new(AtomicUsize::new(0));
    let store = FailsToFinish {
        inner: MemoryStore::new(),
        failures: Arc::new(AtomicUsize::new(3)),
    };
    let app = {
        let runs = runs.clone();
        service_fn(move |_: Request<RequestBody<String>>| {
            let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
            async move { Ok::<_, Infallible>(Response::new(format!("paid, run {n}"))) }
        })
    };
    let svc = FenceLayer::new(store.clone())
        .drain_timeout(Duration::from_secs(60))
        .layer(app);
    let first = svc.clone().oneshot(pay(7)).await.unwrap();
    assert_eq!(first.status(), 200);
    let body = first.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "paid, run 1");
    let retried = svc.oneshot(pay(8)).await.unwrap();
    assert_eq!(retried.status(), 200);
    assert_eq!(
        retried
            .headers()
            .get("idempotent-replayed")
            .map(|v| v.as_bytes()),
        Some(&b"true"[..]),
        "{:?}",
        retried.headers()
    );
    let body = retried.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "paid, run 1");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the step ran twice");
    assert_eq!(store.failures.load(Ordering::SeqCst), 0);
}
