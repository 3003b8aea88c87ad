//! An idempotency record belongs to its attempt (issue 30; docs/protocol.md section 3):
//! a `begin` whose outcome is unknown does not block its key, and a newer holder's request
//! with the same (derived) key is not held up by an older holder's record.

use std::{
    convert::Infallible,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use fence_core::{Generation, JobId};
use fence_sink::{
    Attempt, Begin, FenceLayer, Finish, GenerationStore, IdempotencyConfig, IdempotencyStore,
    MemoryStore, OutcomeUnknown, RequestBody, StoreError, Verdict,
};
use http::{Request, Response, StatusCode};
use tower::{Layer, ServiceExt, service_fn};

/// A memory store whose `begin`, while `slow` is set, writes its record and then takes
/// longer than any store timeout to say so.
#[derive(Clone, Default)]
struct SlowBegin {
    inner: MemoryStore,
    slow: Arc<AtomicBool>,
}

impl GenerationStore for SlowBegin {
    async fn observe(&self, job: &JobId, token: Generation) -> Result<Verdict, StoreError> {
        self.inner.observe(job, token).await
    }

    async fn highest(&self, job: &JobId) -> Result<Generation, StoreError> {
        self.inner.highest(job).await
    }
}

impl IdempotencyStore for SlowBegin {
    async fn begin(&self, attempt: Attempt<'_>, for_: Duration) -> Result<Begin, StoreError> {
        let begun = self.inner.begin(attempt, for_).await;
        if self.slow.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_secs(3600)).await;
        }
        begun
    }

    async fn finish(&self, attempt: Attempt<'_>, outcome: Finish) -> Result<(), StoreError> {
        self.inner.finish(attempt, outcome).await
    }

    async fn purge_expired(&self) -> Result<usize, StoreError> {
        self.inner.purge_expired().await
    }
}

/// A keyed POST of `job` with `token` and `body`, to a service that counts its calls and
/// answers 200 (or, with `unknown`, marks its answer as of unknown outcome, as the proxy
/// does after an upstream failure).
async fn send<St: GenerationStore + IdempotencyStore>(
    layer: &FenceLayer<St>,
    calls: &Arc<AtomicUsize>,
    token: u64,
    body: &str,
    unknown: bool,
) -> StatusCode {
    let calls = calls.clone();
    let inner = service_fn(move |_req: Request<RequestBody<String>>| {
        calls.fetch_add(1, Ordering::SeqCst);
        async move {
            let mut response = Response::new(String::new());
            if unknown {
                *response.status_mut() = StatusCode::BAD_GATEWAY;
                response.extensions_mut().insert(OutcomeUnknown);
            }
            Ok::<_, Infallible>(response)
        }
    });
    let req = Request::post("/charges")
        .header("x-fencing-job", "job")
        .header("x-fencing-token", token.to_string())
        .header("idempotency-key", "fence-derived-charge")
        .body(body.to_owned())
        .unwrap();
    layer.layer(inner).oneshot(req).await.unwrap().status()
}

#[tokio::test(start_paused = true)]
async fn a_begin_that_timed_out_does_not_block_its_key() {
    let store = SlowBegin::default();
    let layer = FenceLayer::new(store.clone())
        .idempotency(IdempotencyConfig::default().store_timeout(Duration::from_millis(100)));
    let calls = Arc::default();
    store.slow.store(true, Ordering::SeqCst);
    assert_eq!(
        send(&layer, &calls, 1, "pay 5", false).await,
        StatusCode::SERVICE_UNAVAILABLE
    );
    store.slow.store(false, Ordering::SeqCst);
    // The record was written, but nothing ran: the retry runs at once (not 409 in flight
    // until the record's 5-minute timeout).
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert_eq!(
        send(&layer, &calls, 1, "pay 5", false).await,
        StatusCode::OK
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn a_newer_holder_with_the_same_key_runs_once_the_older_unknown_outcome_is_held_out() {
    let hold = Duration::from_secs(2);
    let layer = FenceLayer::new(MemoryStore::new())
        .unknown_outcome_hold(hold)
        .drain_timeout(Duration::from_secs(10));
    let calls = Arc::default();
    // The old holder's request fails upstream with an unknown outcome: its record stays in
    // flight, its slot is held.
    assert_eq!(
        send(&layer, &calls, 7, "amount=10 (holder 7)", true).await,
        StatusCode::BAD_GATEWAY
    );
    // The newer holder, same derived key, another body: it waits out the hold, then runs
    // (the older record is taken over, not 422 until its in-flight timeout).
    let started = tokio::time::Instant::now();
    assert_eq!(
        send(&layer, &calls, 8, "amount=10 (holder 8)", false).await,
        StatusCode::OK
    );
    assert!(started.elapsed() >= hold, "it passed inside the hold");
    assert!(started.elapsed() < hold + Duration::from_secs(1));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    // Its own retry is answered from its record.
    assert_eq!(
        send(&layer, &calls, 8, "amount=10 (holder 8)", false).await,
        StatusCode::OK
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2, "the retry ran again");
}

/// A body whose frames come from a channel: the client sends them when the test says.
struct Trickle(tokio::sync::mpsc::Receiver<bytes::Bytes>);

impl http_body::Body for Trickle {
    type Data = bytes::Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, Infallible>>> {
        self.0
            .poll_recv(cx)
            .map(|frame| frame.map(|b| Ok(http_body::Frame::data(b))))
    }
}

/// The newer holder waits only for what reached the service: an older holder's buffered
/// request (it has an Idempotency-Key) whose body is still arriving holds nobody up, and
/// once a newer token was raised it is refused when its body is in, never passed on
/// (issue 31).
#[tokio::test(start_paused = true)]
async fn a_half_sent_buffered_body_holds_no_newer_holder_up() {
    let layer = FenceLayer::new(MemoryStore::new()).drain_timeout(Duration::from_secs(10));
    let calls: Arc<AtomicUsize> = Arc::default();
    let service = |calls: Arc<AtomicUsize>| {
        service_fn(move |_req: Request<RequestBody<Trickle>>| {
            calls.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, Infallible>(Response::new(String::new())) }
        })
    };
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(bytes::Bytes::from_static(b"amount="))
        .await
        .unwrap();
    let old = Request::post("/charges")
        .header("x-fencing-job", "job")
        .header("x-fencing-token", "7")
        .header("idempotency-key", "old-1")
        .body(Trickle(rx))
        .unwrap();
    let old = tokio::spawn(layer.layer(service(calls.clone())).oneshot(old));
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    // The newer holder passes at once: nothing of the old request reached the service.
    let started = tokio::time::Instant::now();
    assert_eq!(
        send(&layer, &calls, 8, "amount=5", false).await,
        StatusCode::OK
    );
    assert_eq!(started.elapsed(), Duration::ZERO, "the newer holder waited");
    // The old body completes: the request is stale now, and never reaches the service.
    tx.send(bytes::Bytes::from_static(b"10")).await.unwrap();
    drop(tx);
    let answer = old.await.unwrap().unwrap();
    assert_eq!(answer.status(), StatusCode::CONFLICT);
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "the stale request was passed on"
    );
}

/// With `scope_headers(authorization)`, one tenant's stored answer is never replayed to
/// another: the same key and body under another `Authorization` is 422. Without it (the
/// default, for derived keys across holders) the answer is replayed (issue 31).
#[tokio::test]
async fn answers_scoped_by_a_header_are_not_replayed_to_another_value() {
    let call = |layer: FenceLayer<MemoryStore>, auth: &'static str| async move {
        let inner = service_fn(move |_req: Request<RequestBody<String>>| async move {
            Ok::<_, Infallible>(Response::new(format!("answer for {auth}")))
        });
        let req = Request::post("/statements")
            .header("x-fencing-job", "job")
            .header("x-fencing-token", "1")
            .header("idempotency-key", "k")
            .header("authorization", auth)
            .body(String::new())
            .unwrap();
        let resp = layer.layer(inner).oneshot(req).await.unwrap();
        let status = resp.status();
        let body = http_body_util::BodyExt::collect(resp.into_body())
            .await
            .unwrap();
        (
            status,
            String::from_utf8_lossy(&body.to_bytes()).into_owned(),
        )
    };
    let scoped = FenceLayer::new(MemoryStore::new())
        .idempotency(IdempotencyConfig::default().scope_headers([http::header::AUTHORIZATION]));
    assert_eq!(call(scoped.clone(), "Bearer a").await.0, StatusCode::OK);
    let (status, body) = call(scoped.clone(), "Bearer b").await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert!(!body.contains("answer for Bearer a"), "{body}");
    let (status, body) = call(scoped, "Bearer a").await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::OK, "answer for Bearer a")
    );
    // The default shares the answer across credentials (a derived key's use).
    let open = FenceLayer::new(MemoryStore::new());
    assert_eq!(call(open.clone(), "Bearer a").await.0, StatusCode::OK);
    let (_, body) = call(open, "Bearer b").await;
    assert_eq!(body, "answer for Bearer a");
}

/// A service that panics after admission may have sent its effect on its way (a call to a
/// payment API, then a panic on its answer): the request is held in flight for the
/// unknown-outcome hold, as after any unknown outcome, not let go at the panic. Whether the
/// runtime catches the panic (a spawned task) or a layer outside the fence does (answering
/// 500, as tower-http's `CatchPanicLayer`), which drops the fence's future only after the
/// unwinding is over; with or without an `Idempotency-Key`.
#[tokio::test(start_paused = true)]
async fn a_service_that_panicked_after_admission_holds_the_next_token_out() {
    use std::{future::Future, panic::AssertUnwindSafe, task::Poll};
    let hold = Duration::from_secs(3);
    let layer = FenceLayer::new(MemoryStore::new())
        .unknown_outcome_hold(hold)
        .drain_timeout(Duration::from_secs(10));
    let post = |token: u64, keyed: bool| {
        let mut request = Request::post("/charges")
            .header("x-fencing-job", "job")
            .header("x-fencing-token", token.to_string());
        if keyed {
            request = request.header("idempotency-key", format!("charge-{token}"));
        }
        request.body("pay 5".to_owned()).unwrap()
    };
    let panicking = layer.layer(service_fn(|_req: Request<RequestBody<String>>| async {
        tokio::task::yield_now().await;
        if true {
            panic!("the handler failed after its effect was sent");
        }
        Ok::<_, Infallible>(Response::new(String::new()))
    }));
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let next = layer.layer(service_fn(move |_req: Request<RequestBody<String>>| {
        counted.fetch_add(1, Ordering::SeqCst);
        async { Ok::<_, Infallible>(Response::new(String::new())) }
    }));
    let mut token = 4;
    for (caught_outside, keyed) in [(false, false), (true, false), (false, true), (true, true)] {
        let call = panicking.clone().oneshot(post(token, keyed));
        if caught_outside {
            let mut call = Box::pin(call);
            let caught = std::future::poll_fn(|cx| {
                match std::panic::catch_unwind(AssertUnwindSafe(|| call.as_mut().poll(cx))) {
                    Ok(Poll::Pending) => Poll::Pending,
                    Ok(Poll::Ready(_)) => Poll::Ready(false),
                    Err(_) => Poll::Ready(true),
                }
            })
            .await;
            assert!(caught, "the service panicked");
            drop(call); // after the unwinding, as a catch-panic layer drops it
        } else {
            let crashed = tokio::spawn(call).await;
            assert!(crashed.expect_err("the service panicked").is_panic());
        }
        let started = tokio::time::Instant::now();
        let answer = next.clone().oneshot(post(token + 1, keyed)).await.unwrap();
        assert_eq!(answer.status(), StatusCode::OK);
        assert!(
            started.elapsed() >= hold,
            "token {} passed {:?} after token {token}'s service panicked (caught outside the fence: {caught_outside}, keyed: {keyed}), inside the {hold:?} hold",
            token + 1,
            started.elapsed()
        );
        token += 2;
    }
    assert_eq!(calls.load(Ordering::SeqCst), 4);
}

/// A request still running when its record's configured in-flight timeout (5 minutes by
/// default) passes keeps its key: a retry of the same token (which the gate lets through
/// beside it) gets 409 in flight for as long as the request may run (`longest_request`,
/// here 10 minutes, plus the body deadline and the hold), not a second run of the step.
#[tokio::test(start_paused = true)]
async fn a_retry_does_not_run_beside_a_request_still_within_its_longest() {
    let clock = fence_storage::clock::ManualClock::new(1_700_000_000_000);
    let layer = FenceLayer::new(MemoryStore::with_clock(Arc::new(clock.clone())))
        .longest_request(Duration::from_secs(600));
    let calls = Arc::new(AtomicUsize::new(0));
    let (release, released) = tokio::sync::watch::channel(false);
    let counted = calls.clone();
    // The first call runs until released; any other answers at once.
    let service = layer.layer(service_fn(move |_req: Request<RequestBody<String>>| {
        let first = counted.fetch_add(1, Ordering::SeqCst) == 0;
        let mut released = released.clone();
        async move {
            if first {
                let _ = released.wait_for(|r| *r).await;
            }
            Ok::<_, Infallible>(Response::new(String::new()))
        }
    }));
    let charge = || {
        Request::post("/charges")
            .header("x-fencing-job", "job")
            .header("x-fencing-token", "3")
            .header("idempotency-key", "charge-1")
            .body("pay 5".to_owned())
            .unwrap()
    };
    let first = tokio::spawn(service.clone().oneshot(charge()));
    while calls.load(Ordering::SeqCst) == 0 {
        tokio::task::yield_now().await;
    }
    // Past the configured 5 minutes, within the 10 the request may take.
    clock.advance(Duration::from_secs(301));
    let retry = service.clone().oneshot(charge()).await.unwrap();
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "the step ran twice at once"
    );
    assert_eq!(retry.status(), StatusCode::CONFLICT);

    release.send(true).unwrap();
    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::OK);
    // Once it answered, the retry is replayed its answer.
    let replay = service.oneshot(charge()).await.unwrap();
    assert_eq!(replay.status(), StatusCode::OK);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// A service whose own check (the SQL fence inside its transaction) refused an older token
/// answers in the fence's words; that refusal is not kept under the key: the newer holder's
/// request with the same derived key runs the step instead of being replayed "stale token,
/// stop work on the job" for a step that never ran.
#[tokio::test]
async fn a_refusal_in_the_fences_words_is_not_replayed_to_the_next_holder() {
    let layer = FenceLayer::new(MemoryStore::new());
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let service = layer.layer(service_fn(move |req: Request<RequestBody<String>>| {
        counted.fetch_add(1, Ordering::SeqCst);
        let token = req.headers()["x-fencing-token"].to_str().unwrap().to_owned();
        async move {
            let response = if token == "1" {
                Response::builder()
                    .status(StatusCode::CONFLICT)
                    .header("content-type", "application/problem+json")
                    .body(r#"{"type":"urn:fence:stale-token","title":"Stale fencing token","status":409,"detail":"the SQL fence refused generation 1"}"#.to_owned())
                    .unwrap()
            } else {
                Response::new("charged".to_owned())
            };
            Ok::<_, Infallible>(response)
        }
    }));
    let charge = |token: &str| {
        Request::post("/charges")
            .header("x-fencing-job", "job")
            .header("x-fencing-token", token)
            .header("idempotency-key", "fence-derived-charge")
            .body("pay 5".to_owned())
            .unwrap()
    };
    let refused = service.clone().oneshot(charge("1")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::CONFLICT);
    let next = service.oneshot(charge("2")).await.unwrap();
    assert!(
        next.headers().get("idempotent-replayed").is_none(),
        "holder 2 was replayed holder 1's refusal"
    );
    assert_eq!(next.status(), StatusCode::OK);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// A 2xx answer whose body happens to be a problem in the fence's words is the service's
/// own success, not a refusal: it is kept under its key, and a retry with the key is
/// replayed it instead of running the step a second time.
#[tokio::test]
async fn a_success_with_a_fence_problem_body_is_kept() {
    let layer = FenceLayer::new(MemoryStore::new());
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let service = layer.layer(service_fn(move |_req: Request<RequestBody<String>>| {
        counted.fetch_add(1, Ordering::SeqCst);
        async move {
            Ok::<_, Infallible>(
                Response::builder()
                    .status(StatusCode::OK)
                    .header("content-type", "application/problem+json")
                    .body(r#"{"type":"urn:fence:stale-token","title":"Stale fencing token","status":409,"detail":"relayed from a downstream call after the local write committed"}"#.to_owned())
                    .unwrap(),
            )
        }
    }));
    let charge = || {
        Request::post("/charges")
            .header("x-fencing-job", "job")
            .header("x-fencing-token", "1")
            .header("idempotency-key", "charge-1")
            .body("pay 5".to_owned())
            .unwrap()
    };
    let first = service.clone().oneshot(charge()).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    let retry = service.oneshot(charge()).await.unwrap();
    assert_eq!(retry.status(), StatusCode::OK);
    assert_eq!(
        retry
            .headers()
            .get("idempotent-replayed")
            .map(|v| v.as_bytes()),
        Some(&b"true"[..]),
        "the retry was not replayed the kept answer"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the step ran twice");
}

/// With `run_to_completion` (the proxy's setting), a service's panic is its request's end:
/// the request is not handed to a task of its own to be polled again, which would panic a
/// second time ("`async fn` resumed after panicking"), outside any catch of the first.
#[tokio::test(start_paused = true)]
async fn a_panic_under_run_to_completion_panics_once() {
    static AGAIN: AtomicUsize = AtomicUsize::new(0);
    let before = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if info.to_string().contains("resumed after panicking") {
            AGAIN.fetch_add(1, Ordering::SeqCst);
        }
        before(info);
    }));
    let layer = FenceLayer::new(MemoryStore::new()).run_to_completion();
    let panicking = layer.layer(service_fn(|_req: Request<RequestBody<String>>| async {
        tokio::task::yield_now().await;
        if true {
            panic!("the handler failed");
        }
        Ok::<_, Infallible>(Response::new(String::new()))
    }));
    let request = Request::post("/charges")
        .header("x-fencing-job", "job")
        .header("x-fencing-token", "1")
        .body("pay 5".to_owned())
        .unwrap();
    let crashed = tokio::spawn(panicking.oneshot(request)).await;
    assert!(crashed.expect_err("the service panicked").is_panic());
    tokio::time::sleep(Duration::from_millis(10)).await; // a detached task would run now
    assert_eq!(
        AGAIN.load(Ordering::SeqCst),
        0,
        "the request was polled again"
    );
}

/// A request the service answered is finished when its caller goes away while the answer is
/// still being read to be kept (the layer's default, without `run_to_completion`): its
/// record is completed, so neither a retry nor a newer holder with the same key runs the
/// step a second time (it was left in flight, and a newer holder took it over and ran it).
#[tokio::test(start_paused = true)]
async fn an_answered_request_whose_caller_went_away_is_still_recorded() {
    let layer = FenceLayer::new(MemoryStore::new()).drain_timeout(Duration::from_secs(10));
    let calls: Arc<AtomicUsize> = Arc::default();
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let answer = Arc::new(std::sync::Mutex::new(Some(rx)));
    let service = {
        let calls = calls.clone();
        service_fn(move |_req: Request<RequestBody<String>>| {
            calls.fetch_add(1, Ordering::SeqCst);
            // The first call's answer comes when the test says; any later one at once.
            let rx = answer.lock().unwrap().take().unwrap_or_else(|| {
                let (_, rx) = tokio::sync::mpsc::channel(1);
                rx
            });
            async move { Ok::<_, Infallible>(Response::new(Trickle(rx))) }
        })
    };
    let request = |token: u64| {
        Request::post("/charges")
            .header("x-fencing-job", "job")
            .header("x-fencing-token", token.to_string())
            .header("idempotency-key", "fence-derived-charge")
            .body("pay 5".to_owned())
            .unwrap()
    };
    let first = tokio::spawn(layer.layer(service.clone()).oneshot(request(7)));
    while calls.load(Ordering::SeqCst) == 0 {
        tokio::task::yield_now().await;
    }
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    // The charge is made; its caller goes away while its answer is read to be kept.
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled());
    // (The receiver is gone if the cancellation dropped the answer with the request.)
    let _ = tx.send(bytes::Bytes::from_static(b"charged")).await;
    drop(tx);
    tokio::time::sleep(Duration::from_millis(10)).await;
    let retry = layer
        .layer(service.clone())
        .oneshot(request(7))
        .await
        .unwrap();
    assert_eq!(retry.status(), StatusCode::OK, "the retry was not replayed");
    assert_eq!(retry.headers().get("idempotent-replayed").unwrap(), "true");
    let newer = layer.layer(service).oneshot(request(8)).await.unwrap();
    assert_eq!(newer.status(), StatusCode::OK);
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the step ran again");
}
