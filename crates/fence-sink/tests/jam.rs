//! A fence nobody can jam (contract v2, section 3): a newer token raises `highest` at once,
//! a body that does not arrive is cut at the body deadline, a request of unknown outcome is
//! held for a bounded time, and the bytes held in memory have a cap.

mod common;

use std::{
    convert::Infallible,
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use common::Partial;
use fence_core::{Generation, JobId};
use fence_sink::{
    Attempt, Begin, BodyTimeout, FenceLayer, Finish, GenerationStore, IdempotencyStore,
    MemoryStore, OutcomeUnknown, RequestBody, StoreError, Verdict,
};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, combinators::UnsyncBoxBody};
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt};

type In = UnsyncBoxBody<Bytes, std::io::Error>;

fn stalled() -> In {
    UnsyncBoxBody::new(Partial::stalls_after(b"ab"))
}

fn full(text: &'static str) -> In {
    UnsyncBoxBody::new(
        http_body_util::Full::new(Bytes::from_static(text.as_bytes())).map_err(|e| match e {}),
    )
}

fn request(path: &str, token: u64, key: Option<&str>, body: In) -> Request<In> {
    let mut builder = Request::post(path)
        .header("x-fencing-job", "j")
        .header("x-fencing-token", token);
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    builder.body(body).unwrap()
}

/// What the service saw, in order: "start 7 /x", "body error 7", "done 7".
type Log = Arc<Mutex<Vec<String>>>;

/// The service: reads the whole body, then answers 201 with a 20-byte body; on `/lost` it
/// answers 502 marked [`OutcomeUnknown`], as a proxy whose upstream timed out does.
#[derive(Clone)]
struct App {
    log: Log,
}

type Out = http_body_util::Full<Bytes>;

impl Service<Request<RequestBody<In>>> for App {
    type Response = Response<Out>;
    type Error = Infallible;
    type Future =
        Pin<Box<dyn std::future::Future<Output = Result<Response<Out>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<RequestBody<In>>) -> Self::Future {
        let log = self.log.clone();
        Box::pin(async move {
            let token = req.headers()["x-fencing-token"]
                .to_str()
                .unwrap()
                .to_owned();
            let path = req.uri().path().to_owned();
            log.lock().unwrap().push(format!("start {token} {path}"));
            if let Err(e) = req.into_body().collect().await {
                let timed_out = e.downcast_ref::<BodyTimeout>().is_some();
                log.lock()
                    .unwrap()
                    .push(format!("body error {token} (timeout: {timed_out})"));
                let mut r = Response::new(Out::new(Bytes::new()));
                *r.status_mut() = StatusCode::BAD_REQUEST;
                return Ok(r);
            }
            log.lock().unwrap().push(format!("done {token}"));
            let mut r = Response::new(Out::new(Bytes::from_static(b"twenty bytes answer.")));
            if path == "/lost" {
                *r.status_mut() = StatusCode::BAD_GATEWAY;
                r.extensions_mut().insert(OutcomeUnknown);
            } else {
                *r.status_mut() = StatusCode::CREATED;
            }
            Ok(r)
        })
    }
}

fn service(log: Log) -> App {
    App { log }
}

fn log_of(log: &Log) -> Vec<String> {
    log.lock().unwrap().clone()
}

async fn send<St: GenerationStore + IdempotencyStore>(
    svc: &fence_sink::Fence<App, St>,
    req: Request<In>,
) -> (StatusCode, String, http::HeaderMap) {
    let response = svc.clone().oneshot(req).await.unwrap();
    let (head, body) = response.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    (
        head.status,
        String::from_utf8_lossy(&body).into_owned(),
        head.headers,
    )
}

async fn settle() {
    tokio::time::sleep(Duration::from_millis(1)).await;
}

fn job() -> JobId {
    "j".parse().unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_stalled_idempotent_body_delays_the_newer_holder_by_the_body_deadline_at_most() {
    let log = Log::default();
    let store = Arc::new(MemoryStore::new());
    let layer = FenceLayer::from_arc(store.clone())
        .body_timeout(Duration::from_secs(1))
        .drain_timeout(Duration::from_secs(10));
    let svc = layer.layer(service(log.clone()));
    assert_eq!(
        send(&svc, request("/", 7, None, full("x"))).await.0,
        StatusCode::CREATED
    );

    let stuck = tokio::spawn({
        let svc = svc.clone();
        async move { send(&svc, request("/", 7, Some("k1"), stalled())).await }
    });
    settle().await;
    let started = Instant::now();
    let newer = tokio::spawn({
        let svc = svc.clone();
        async move { send(&svc, request("/", 8, None, full("y"))).await }
    });
    settle().await;
    assert_eq!(
        store.highest(&job()).await.unwrap(),
        Generation::new(8),
        "raised at once"
    );
    let (status, text, _) = send(&svc, request("/", 7, None, full("z"))).await;
    assert_eq!(
        status,
        StatusCode::CONFLICT,
        "the old holder cannot start anything: {text}"
    );

    let (status, text, _) = newer.await.unwrap();
    assert_eq!(status, StatusCode::CREATED, "{text}");
    let waited = started.elapsed();
    assert!(waited <= Duration::from_millis(1_010), "waited {waited:?}");
    let (status, text, _) = stuck.await.unwrap();
    assert_eq!(status, StatusCode::REQUEST_TIMEOUT, "{text}");
    assert!(text.contains("urn:fence:body-timeout"), "{text}");
    assert_eq!(
        log_of(&log),
        ["start 7 /", "done 7", "start 8 /", "done 8"],
        "the stalled request never reached the service"
    );
}

#[tokio::test(start_paused = true)]
async fn a_stalled_streamed_body_ends_at_the_deadline_and_lets_the_newer_holder_in() {
    let log = Log::default();
    let layer = FenceLayer::new(MemoryStore::new())
        .body_timeout(Duration::from_secs(1))
        .drain_timeout(Duration::from_secs(10));
    let svc = layer.layer(service(log.clone()));
    let stuck = tokio::spawn({
        let svc = svc.clone();
        async move { send(&svc, request("/", 7, None, stalled())).await }
    });
    settle().await;
    let started = Instant::now();
    let (status, _, _) = send(&svc, request("/", 8, None, full("y"))).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(started.elapsed() <= Duration::from_millis(1_010));
    let (status, text, _) = stuck.await.unwrap();
    assert_eq!(status, StatusCode::REQUEST_TIMEOUT, "{text}");
    assert_eq!(
        log_of(&log),
        [
            "start 7 /",
            "body error 7 (timeout: true)",
            "start 8 /",
            "done 8"
        ],
        "the service saw the head and part of the body, then the timeout; 8 only after"
    );
}

#[tokio::test(start_paused = true)]
async fn an_unknown_outcome_holds_the_job_for_the_hold_time() {
    let log = Log::default();
    let layer = FenceLayer::new(MemoryStore::new())
        .unknown_outcome_hold(Duration::from_secs(2))
        .drain_timeout(Duration::from_secs(10));
    let svc = layer.layer(service(log.clone()));
    let (status, _, _) = send(&svc, request("/lost", 7, None, full("x"))).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    let started = Instant::now();
    let (status, _, _) = send(&svc, request("/", 8, None, full("y"))).await;
    assert_eq!(status, StatusCode::CREATED);
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(2) && waited <= Duration::from_millis(2_010),
        "a newer generation passes only once the hold is over: {waited:?}"
    );

    // A drain limit shorter than the hold: 503, and the job stays raised.
    let layer = FenceLayer::new(MemoryStore::new())
        .unknown_outcome_hold(Duration::from_secs(2))
        .drain_timeout(Duration::from_millis(500));
    let svc = layer.layer(service(log.clone()));
    send(&svc, request("/lost", 7, None, full("x"))).await;
    let (status, text, _) = send(&svc, request("/", 8, None, full("y"))).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{text}");
    let (status, _, _) = send(&svc, request("/", 7, None, full("x"))).await;
    assert_eq!(status, StatusCode::CONFLICT);

    // Without a hold, at once.
    let layer = FenceLayer::new(MemoryStore::new()).unknown_outcome_hold(Duration::ZERO);
    let svc = layer.layer(service(log));
    send(&svc, request("/lost", 7, None, full("x"))).await;
    let started = Instant::now();
    assert_eq!(
        send(&svc, request("/", 8, None, full("y"))).await.0,
        StatusCode::CREATED
    );
    assert!(started.elapsed() < Duration::from_millis(10));
}

#[tokio::test]
async fn buffered_bytes_have_a_cap_and_past_it_nothing_is_passed_on() {
    let log = Log::default();
    let layer = FenceLayer::new(MemoryStore::new()).max_buffered_bytes(16);
    let svc = layer.layer(service(log.clone()));
    let (status, text, headers) = send(
        &svc,
        request("/", 1, Some("big"), full("seventeen bytes!!")),
    )
    .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{text}");
    assert!(text.contains("urn:fence:overloaded"), "{text}");
    assert!(headers.contains_key(http::header::RETRY_AFTER));
    assert!(log_of(&log).is_empty(), "nothing passed on");

    // A small request fits; its 20-byte answer does not, so it is passed through unstored
    // and a retry is told it cannot be replayed rather than run twice.
    let (status, text, _) = send(&svc, request("/", 1, Some("small"), full("tiny"))).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(text, "twenty bytes answer.");
    let (status, text, _) = send(&svc, request("/", 1, Some("small"), full("tiny"))).await;
    assert_eq!(status, StatusCode::CONFLICT, "{text}");
    assert!(text.contains("not-replayable"), "{text}");
    assert_eq!(layer.buffered_bytes(), 0, "every byte given back");
}

/// One client stalling many keyed bodies holds at most its share of the buffered bytes (a
/// quarter), so another client's keyed request still fits; the first client's requests past
/// its share are refused at once, saying so, and nothing of them is passed on.
#[tokio::test(start_paused = true)]
async fn one_client_stalling_keyed_bodies_cannot_take_every_buffered_byte() {
    let log = Log::default();
    let layer = FenceLayer::new(MemoryStore::new()).max_buffered_bytes(16);
    let svc = layer.layer(service(log.clone()));
    let from = |peer: &str, mut req: Request<In>| {
        req.extensions_mut()
            .insert(fence_sink::PeerAddr(peer.parse().unwrap()));
        req
    };
    let mut stalled_requests = Vec::new();
    for i in 0..8 {
        let req = from(
            "10.0.0.1:4000",
            request("/", 1, Some(&format!("a{i}")), stalled()),
        );
        let svc = svc.clone();
        stalled_requests.push(tokio::spawn(async move { send(&svc, req).await }));
    }
    settle().await;
    let (status, text, _) = send(
        &svc,
        from("10.0.0.2:4000", request("/", 1, Some("b"), full("tiny"))),
    )
    .await;
    assert_eq!(
        status,
        StatusCode::CREATED,
        "the other client was starved: {text}"
    );
    // Of the first client's eight, two fit its 4 bytes; the six others were refused.
    let mut refused = 0;
    for request in stalled_requests {
        if request.is_finished() {
            let (status, text, _) = request.await.unwrap();
            assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{text}");
            assert!(text.contains("this client's share"), "{text}");
            refused += 1;
        }
    }
    assert_eq!(refused, 6);
    assert_eq!(
        log_of(&log)
            .iter()
            .filter(|l| l.starts_with("start"))
            .count(),
        1
    );
}

/// Replays count against the client's share too: a client that retries its own keys and
/// never reads the answers holds at most one replay beyond its share, and the rest of the
/// budget stays for other clients' keyed requests, answered and kept.
#[tokio::test(start_paused = true)]
async fn a_client_reading_no_replays_holds_at_most_its_share() {
    let log = Log::default();
    // 64 bytes, a share of 16: one 20-byte answer is more than a share.
    let layer = FenceLayer::new(MemoryStore::new()).max_buffered_bytes(64);
    let svc = layer.layer(service(log.clone()));
    let from = |peer: &str, mut req: Request<In>| {
        req.extensions_mut()
            .insert(fence_sink::PeerAddr(peer.parse().unwrap()));
        req
    };
    let (status, _, _) = send(
        &svc,
        from("10.0.0.1:4000", request("/", 1, Some("a"), full("x"))),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED);
    let mut unread = Vec::new();
    let mut refused = 0;
    for _ in 0..3 {
        let replay = svc
            .clone()
            .oneshot(from("10.0.0.1:4000", request("/", 1, Some("a"), full("x"))))
            .await
            .unwrap();
        if replay.status() == StatusCode::SERVICE_UNAVAILABLE {
            let body = replay.into_body().collect().await.unwrap().to_bytes();
            let text = String::from_utf8_lossy(&body);
            assert!(text.contains("this client's share"), "{text}");
            refused += 1;
        } else {
            assert_eq!(replay.headers()["idempotent-replayed"], "true");
            unread.push(replay);
        }
    }
    assert_eq!((unread.len(), refused), (1, 2));
    // Another client's keyed request is answered, and its answer kept (replayed on retry).
    let (status, _, _) = send(
        &svc,
        from("10.0.0.2:4000", request("/", 1, Some("b"), full("y"))),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED);
    let (status, _, headers) = send(
        &svc,
        from("10.0.0.2:4000", request("/", 1, Some("b"), full("y"))),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(headers.contains_key("idempotent-replayed"));
    drop(unread);
    assert_eq!(layer.buffered_bytes(), 0, "every byte given back");
}

/// Answers being kept count against the client's share too: one client whose keyed requests
/// all answer at once and who reads none of the answers holds one answer beyond its share,
/// not the whole budget (the others are passed on unkept).
#[tokio::test(start_paused = true)]
async fn a_client_reading_no_answers_holds_at_most_one_beyond_its_share() {
    // 64 bytes, a share of 16: one 20-byte answer is more than a share.
    let layer = FenceLayer::new(MemoryStore::new()).max_buffered_bytes(64);
    let all_read = Arc::new(tokio::sync::Barrier::new(4));
    let svc = layer.layer(tower::service_fn({
        let all_read = all_read.clone();
        move |req: Request<RequestBody<In>>| {
            let all_read = all_read.clone();
            async move {
                req.into_body().collect().await.unwrap();
                // Every request's body is read before any answers.
                all_read.wait().await;
                Ok::<_, std::convert::Infallible>(Response::new(http_body_util::Full::new(
                    Bytes::from_static(b"twenty bytes answer."),
                )))
            }
        }
    }));
    let mut calls = Vec::new();
    for key in ["a", "b", "c", "d"] {
        let mut req = request("/", 1, Some(key), full("x"));
        req.extensions_mut()
            .insert(fence_sink::PeerAddr("10.0.0.1:4000".parse().unwrap()));
        calls.push(tokio::spawn(svc.clone().oneshot(req)));
    }
    let mut unread = Vec::new();
    for call in calls {
        let answer = call.await.unwrap().unwrap();
        assert_eq!(answer.status(), StatusCode::OK);
        unread.push(answer);
    }
    assert!(
        layer.buffered_bytes() <= 20,
        "one client's unread answers hold {} bytes",
        layer.buffered_bytes()
    );
    drop(unread);
    assert_eq!(layer.buffered_bytes(), 0, "every byte given back");
}

/// An answer that does not fit its client's share while it is kept (docs/protocol.md,
/// "Answers kept: the memory budget") still reaches its client whole, but is recorded as not
/// replayable: a retry of its key gets 409 `idempotency-not-replayable`, and the service,
/// which has acted, never runs the request again. Kept answers are replayed.
#[tokio::test(start_paused = true)]
async fn an_answer_past_the_clients_share_is_passed_on_whole_and_never_run_again() {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    // 64 bytes, a share of 16: one client's four 20-byte answers cannot all be kept.
    let layer = FenceLayer::new(MemoryStore::new()).max_buffered_bytes(64);
    let all_read = Arc::new(tokio::sync::Barrier::new(4));
    let calls = Arc::new(AtomicUsize::new(0));
    let svc = layer.layer(tower::service_fn({
        let (all_read, calls) = (all_read.clone(), calls.clone());
        move |req: Request<RequestBody<In>>| {
            let (all_read, calls) = (all_read.clone(), calls.clone());
            async move {
                let n = calls.fetch_add(1, SeqCst);
                req.into_body().collect().await.unwrap();
                if n < 4 {
                    all_read.wait().await; // every first body is read before any answers
                }
                Ok::<_, std::convert::Infallible>(Response::new(http_body_util::Full::new(
                    Bytes::from_static(b"twenty bytes answer."),
                )))
            }
        }
    }));
    let from = |key: &str| {
        let mut req = request("/", 1, Some(key), full("x"));
        req.extensions_mut()
            .insert(fence_sink::PeerAddr("10.0.0.1:4000".parse().unwrap()));
        req
    };
    let keys = ["a", "b", "c", "d"];
    let firsts: Vec<_> = keys
        .iter()
        .map(|key| tokio::spawn(svc.clone().oneshot(from(key))))
        .collect();
    let mut unread = Vec::new();
    for first in firsts {
        unread.push(first.await.unwrap().unwrap());
    }
    // Read together, as a client with its answers in flight at once would.
    for answer in unread {
        assert_eq!(answer.status(), StatusCode::OK);
        let body = answer.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"twenty bytes answer.", "passed on whole");
    }
    let (mut replayed, mut not_replayable) = (0, 0);
    for key in keys {
        let (head, body) = svc.clone().oneshot(from(key)).await.unwrap().into_parts();
        let body = body.collect().await.unwrap().to_bytes();
        let (status, body) = (head.status, String::from_utf8_lossy(&body).into_owned());
        if head.headers.contains_key("idempotent-replayed") {
            replayed += 1;
        } else {
            assert_eq!(status, StatusCode::CONFLICT, "{body}");
            assert!(body.contains("idempotency-not-replayable"), "{body}");
            not_replayable += 1;
        }
    }
    assert_eq!(calls.load(SeqCst), 4, "a retry ran the service again");
    assert!(replayed >= 1, "the answers that fit are kept");
    assert!(
        not_replayable >= 1,
        "every answer fit: the case is not tested"
    );
}

/// A store other processes share whose calls stall once `stuck` is set (a SQL writer holds
/// the job's row), counting the calls running at once; with `slow_raises`, a raise is written
/// and then answered only after that long (a disk that confirms late).
#[derive(Clone, Default)]
struct Stuck {
    inner: MemoryStore,
    stuck: Arc<std::sync::atomic::AtomicBool>,
    running: Arc<std::sync::atomic::AtomicUsize>,
    most: Arc<std::sync::atomic::AtomicUsize>,
    /// Milliseconds; 0: answered at once.
    slow_raises: Arc<std::sync::atomic::AtomicU64>,
    /// Whether other processes share it (then every request asks it).
    shared: bool,
}

impl Stuck {
    async fn call<T>(&self, f: impl std::future::Future<Output = T>) -> T {
        use std::sync::atomic::Ordering::SeqCst;
        if self.stuck.load(SeqCst) {
            let now = self.running.fetch_add(1, SeqCst) + 1;
            self.most.fetch_max(now, SeqCst);
            std::future::pending::<()>().await;
        }
        f.await
    }
}

impl GenerationStore for Stuck {
    async fn observe(&self, job: &JobId, token: Generation) -> Result<Verdict, StoreError> {
        self.call(self.inner.observe(job, token)).await
    }

    async fn raise(
        &self,
        job: &JobId,
        token: Generation,
        older_running: bool,
    ) -> Result<Verdict, StoreError> {
        let raised = self.call(self.inner.raise(job, token, older_running)).await;
        let late = self.slow_raises.load(std::sync::atomic::Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(late)).await;
        raised
    }

    async fn highest(&self, job: &JobId) -> Result<Generation, StoreError> {
        self.inner.highest(job).await
    }

    fn is_shared(&self) -> bool {
        self.shared
    }
}

impl IdempotencyStore for Stuck {
    async fn begin(&self, attempt: Attempt<'_>, in_flight: Duration) -> Result<Begin, StoreError> {
        self.inner.begin(attempt, in_flight).await
    }

    async fn finish(&self, attempt: Attempt<'_>, outcome: Finish) -> Result<(), StoreError> {
        self.inner.finish(attempt, outcome).await
    }

    async fn purge_expired(&self) -> Result<usize, StoreError> {
        self.inner.purge_expired().await
    }
}

/// A job whose store calls stall (a writer holds its row in a shared store) takes at most
/// four of the store's connections, its newer token's raise included: the rest stay free for
/// other jobs (docs/protocol.md section 11).
#[tokio::test(start_paused = true)]
async fn a_stalled_job_holds_at_most_four_store_calls_its_raise_included() {
    let store = Stuck {
        shared: true,
        ..Stuck::default()
    };
    let layer = FenceLayer::new(store.clone()).without_idempotency();
    let svc = layer.layer(service(Log::default()));
    assert!(
        send(&svc, request("/", 5, None, full("")))
            .await
            .0
            .is_success()
    );
    store.stuck.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut waiting = Vec::new();
    for token in [5, 5, 5, 5, 5, 6] {
        let svc = svc.clone();
        waiting.push(tokio::spawn(async move {
            send(&svc, request("/", token, None, full(""))).await.0
        }));
        settle().await;
    }
    assert_eq!(
        store.most.load(std::sync::atomic::Ordering::SeqCst),
        4,
        "calls of the stalled job running at once"
    );
    for w in waiting {
        assert_eq!(w.await.unwrap(), StatusCode::SERVICE_UNAVAILABLE);
    }
}

/// A raise that timed out may still have been written: a holder of the newer token exists, so
/// the older token is refused from then on, not admitted from memory as if nothing happened
/// (a restart would count from that raise and not wait for what the older token still ran).
/// The store is one process's: its stamp still covers the older token, which the gate would
/// admit without asking it.
#[tokio::test(start_paused = true)]
async fn after_a_raise_that_timed_out_the_older_token_is_refused() {
    let store = Stuck::default();
    let layer = FenceLayer::new(store.clone())
        .without_idempotency()
        .store_timeout(Duration::from_secs(1));
    let svc = layer.layer(service(Log::default()));
    assert!(
        send(&svc, request("/", 5, None, full("")))
            .await
            .0
            .is_success()
    );
    // The disk now confirms raises late: written, answered after the store timeout.
    store
        .slow_raises
        .store(2_000, std::sync::atomic::Ordering::SeqCst);
    let (status, body, _) = send(&svc, request("/", 6, None, full(""))).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(
        store.inner.highest(&job()).await.unwrap(),
        Generation::new(6)
    );
    let (status, body, _) = send(&svc, request("/", 5, None, full(""))).await;
    assert_eq!(
        status,
        StatusCode::CONFLICT,
        "the older token was admitted after its raise timed out: {body}"
    );
    // The disk answers in time again. Many other jobs come and go meanwhile (a pass folds
    // quiet gates away every 256 new ones): this job's gate is not folded with what it knows.
    store
        .slow_raises
        .store(0, std::sync::atomic::Ordering::SeqCst);
    for other in 0..300 {
        let mut req = request("/", 1, None, full(""));
        let job = format!("other-{other}").parse().unwrap();
        req.headers_mut().insert("x-fencing-job", job);
        assert!(send(&svc, req).await.0.is_success());
    }
    let (status, body, _) = send(&svc, request("/", 5, None, full(""))).await;
    assert_eq!(
        status,
        StatusCode::CONFLICT,
        "admitted again once its gate was folded: {body}"
    );
    // The newer holder's retry writes its token, and goes on.
    assert!(
        send(&svc, request("/", 6, None, full("")))
            .await
            .0
            .is_success()
    );
    let (status, _, _) = send(&svc, request("/", 5, None, full(""))).await;
    assert_eq!(status, StatusCode::CONFLICT);
}
