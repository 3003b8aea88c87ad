//! Several processes' layers on one PostgreSQL store (docs/protocol.md section 5, "Several
//! sinks"): a newer generation's retry of a step that another process is still running waits
//! for it, and is then replayed its answer; the step runs once.
#![cfg(feature = "postgres")]

use std::{
    convert::Infallible,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use fence_sink::{
    FenceLayer, Fenced, RequestBody,
    postgres::{PgStore, PgTables},
};
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use tower::{Layer, ServiceExt, service_fn};

/// One process's layer on `store`, in front of a service that counts the steps it runs;
/// token 1's step runs until `running` gets a permit.
fn process(
    store: PgStore,
    steps: Arc<AtomicUsize>,
    running: Arc<tokio::sync::Semaphore>,
) -> impl Fn(u64) -> tokio::task::JoinHandle<(StatusCode, String)> {
    let layer = FenceLayer::new(store)
        .longest_request(Duration::from_secs(2))
        .unknown_outcome_hold(Duration::from_secs(1));
    move |token: u64| {
        let (steps, running) = (steps.clone(), running.clone());
        let inner = service_fn(move |req: Request<RequestBody<String>>| {
            let (steps, running) = (steps.clone(), running.clone());
            async move {
                let token = req.extensions().get::<Fenced>().map(|f| f.token.get());
                steps.fetch_add(1, Ordering::SeqCst);
                if token == Some(1) {
                    let _ = running.acquire().await;
                }
                Ok::<_, Infallible>(Response::new(format!("charged by {token:?}")))
            }
        });
        let svc = layer.layer(inner);
        let req = Request::post("/charges")
            .header("x-fencing-job", "invoice-7")
            .header("x-fencing-token", token.to_string())
            .header("idempotency-key", "charge")
            .body("42 EUR".to_owned())
            .unwrap();
        tokio::spawn(async move {
            let answer = svc.oneshot(req).await.unwrap();
            let status = answer.status();
            let body = answer.into_body().collect().await.unwrap().to_bytes();
            (status, String::from_utf8_lossy(&body).into_owned())
        })
    }
}

#[tokio::test]
async fn a_newer_generation_waits_for_a_step_another_process_is_running() {
    let url = fence_storage::postgres::test_database_url();
    let tables = PgTables::new("fence_test", &format!("layers_{:016x}", fastrand::u64(..)))
        .expect("valid names");
    let a = PgStore::connect(&url, tables.clone()).await.unwrap();
    a.migrate().await.unwrap();
    let b = PgStore::connect(&url, tables).await.unwrap();
    let (steps, running) = (Arc::default(), Arc::new(tokio::sync::Semaphore::new(0)));
    let (first, second) = (
        process(a, Arc::clone(&steps), running.clone()),
        process(b, Arc::clone(&steps), running.clone()),
    );
    // Generation 1 runs the step through process A, and takes its time.
    let older = first(1);
    let started = tokio::time::Instant::now();
    while steps.load(Ordering::SeqCst) == 0 {
        assert!(started.elapsed() < Duration::from_secs(10), "never ran");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The next holder retries the same step through process B meanwhile: B's fence has
    // nothing of A's in flight to drain, so the record must say the step is running.
    let (status, body) = second(2).await.unwrap();
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert!(body.contains("idempotency-in-flight"), "{body}");
    assert_eq!(
        steps.load(Ordering::SeqCst),
        1,
        "the step ran a second time while the first run was still going"
    );
    // The first run ends: the retry is replayed its answer.
    running.add_permits(1);
    assert_eq!(older.await.unwrap().0, StatusCode::OK);
    let (status, body) = second(2).await.unwrap();
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::OK, "charged by Some(1)")
    );
    assert_eq!(steps.load(Ordering::SeqCst), 1);
}
