//! Several processes' layers on one PostgreSQL store (docs/protocol.md section 5, "Several
//! sinks"): a newer generation's retry of a step that another process is still running waits
//! for it, and is then replayed its answer; the step runs once. And a layer that forgets
//! gives the SQL fence on its tables the window its tokens end within.
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

/// A library layer that forgets on PostgreSQL gives the SQL fence its window before it
/// forgets anything: a token claiming a lease longer than the layer's longest (an hour here)
/// is refused by SQL too, as by the layer. Before, only the proxy announced it; a layer's
/// first forget recorded the 24 h default, and such a token, of a job the layer forgot,
/// passed the SQL fence as the job's first.
#[tokio::test]
async fn a_forgetting_layer_gives_the_sql_fence_its_longest_lease() {
    let url = fence_storage::postgres::test_database_url();
    let prefix = format!("forget_{:016x}", fastrand::u64(..));
    let tables = PgTables::new("fence_test", &prefix).expect("valid names");
    let store = PgStore::connect(&url, tables).await.unwrap();
    store.migrate().await.unwrap();
    let (su, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    let signer = fence_core::signing::TokenSigner::from_seed([7; 32]);
    let layer = FenceLayer::new(store)
        .require_signatures(fence_core::signing::TokenVerifier::new([
            signer.verify_key()
        ]))
        .clock_skew(Duration::from_secs(1))
        .forget_after(Duration::from_secs(3_700), Duration::from_secs(3_600))
        .unwrap();
    let _upkeep = layer.spawn_maintenance();
    let now: i64 = su
        .query_one(&format!("SELECT {}", fence_storage::postgres::NOW_MS), &[])
        .await
        .unwrap()
        .get(0);
    let observe = format!("SELECT fence_test.{prefix}_observe('never-seen', 1, $1)");
    let two_hours = now + 2 * 3_600_000;
    // The first forgetting pass runs at once (its interval's first tick).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let refused = loop {
        match su.query_one(&observe, &[&two_hours]).await {
            Err(e) => break e,
            Ok(_) => {
                // Taken: undo it and look again, within the deadline.
                su.execute(
                    &format!(
                        "DELETE FROM fence_test.{prefix}_generations WHERE job = 'never-seen'"
                    ),
                    &[],
                )
                .await
                .unwrap();
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the SQL fence still takes a token two hours long"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let code = refused.as_db_error().map(|d| d.code().code().to_owned());
    assert_eq!(code.as_deref(), Some("ZF403"), "{refused}");
    // Within the hour (and the skew): taken.
    let within = su.query_one(&observe, &[&(now + 3_600_000)]).await.unwrap();
    assert!(within.get::<_, bool>(0));
}
