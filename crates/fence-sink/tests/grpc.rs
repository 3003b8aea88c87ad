//! gRPC calls through the fence (contract section 9): every rejection is a gRPC answer, HTTP
//! 200 with `grpc-status`, `grpc-message`, `fence-problem-type` and `fence-highest`, so a gRPC
//! client reports a status instead of a transport error; and nothing rejected reaches the
//! service.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::{convert::Infallible, pin::Pin, sync::Arc, time::Duration};

use bytes::Bytes;
use common::Partial;
use fence_core::{
    Generation, JobId,
    signing::{TokenSigner, TokenVerifier},
};
use fence_sink::{
    Attempt, Begin, FenceLayer, Finish, GenerationStore, IdempotencyStore, MemoryStore,
    RequestBody, StoreError, Verdict,
};
use http::{HeaderMap, Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, combinators::UnsyncBoxBody};
use tokio::sync::Notify;
use tower::{Layer, Service, ServiceExt, service_fn};

type In = UnsyncBoxBody<Bytes, Infallible>;

fn body(text: &'static str) -> In {
    UnsyncBoxBody::new(http_body_util::Full::new(Bytes::from_static(
        text.as_bytes(),
    )))
}

/// A unary gRPC call to `/ledger.Ledger/Charge` with `metadata` (name, value).
fn call(metadata: &[(&str, &str)], payload: In) -> Request<In> {
    let mut builder = Request::post("http://sink/ledger.Ledger/Charge")
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    for (name, value) in metadata {
        builder = builder.header(*name, *value);
    }
    builder.body(payload).unwrap()
}

fn fenced(job: &str, token: &str) -> Request<In> {
    call(
        &[("x-fencing-job", job), ("x-fencing-token", token)],
        body("\0\0\0\0\0"),
    )
}

/// The ledger: counts calls; `/slow` payloads ("slow") wait for `release`.
#[derive(Clone, Default)]
struct Ledger {
    calls: Arc<AtomicUsize>,
    release: Arc<Notify>,
}

impl Service<Request<RequestBody<In>>> for Ledger {
    type Response = Response<http_body_util::Full<Bytes>>;
    type Error = Infallible;
    type Future =
        Pin<Box<dyn std::future::Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<RequestBody<In>>) -> Self::Future {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let release = self.release.clone();
        Box::pin(async move {
            let Ok(payload) = req.into_body().collect().await.map(|b| b.to_bytes()) else {
                // As tonic does when the request stream fails: a trailers-only INTERNAL.
                let mut response = Response::new(http_body_util::Full::new(Bytes::new()));
                let headers = response.headers_mut();
                headers.insert("content-type", "application/grpc".parse().unwrap());
                headers.insert("grpc-status", "13".parse().unwrap());
                return Ok(response);
            };
            if payload.as_ref() == b"slow" {
                release.notified().await;
            }
            let mut response =
                Response::new(http_body_util::Full::new(Bytes::from_static(b"\0\0\0\0\0")));
            response
                .headers_mut()
                .insert("content-type", "application/grpc".parse().unwrap());
            Ok(response)
        })
    }
}

/// A gRPC answer: HTTP status, headers, and whether it had a body.
struct Answer {
    http: u16,
    headers: HeaderMap,
    body: Bytes,
}

impl Answer {
    async fn of<B: Body<Data = Bytes>>(r: Response<B>) -> Self
    where
        B::Error: std::fmt::Debug,
    {
        let (head, body) = r.into_parts();
        Self {
            http: head.status.as_u16(),
            headers: head.headers,
            body: body.collect().await.unwrap().to_bytes(),
        }
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }

    /// A trailers-only gRPC answer with `code` and problem `urn`.
    fn status(&self, code: u8, urn: &str) {
        assert_eq!(
            self.http, 200,
            "a gRPC answer is HTTP 200: {:?}",
            self.headers
        );
        assert_eq!(self.header("content-type"), Some("application/grpc"));
        assert_eq!(
            self.header("grpc-status"),
            Some(code.to_string().as_str()),
            "{:?}",
            self.headers
        );
        assert_eq!(
            self.header("fence-problem-type"),
            Some(urn),
            "{:?}",
            self.headers
        );
        let message = self.header("grpc-message").expect("grpc-message");
        assert!(!message.is_empty() && message.is_ascii(), "{message}");
        assert!(self.body.is_empty(), "trailers-only: no message body");
    }
}

async fn send<S>(svc: &S, req: Request<In>) -> Answer
where
    S: Service<
            Request<In>,
            Response = Response<fence_sink::ResponseBody<http_body_util::Full<Bytes>>>,
            Error = Infallible,
        > + Clone,
{
    Answer::of(svc.clone().oneshot(req).await.unwrap()).await
}

/// The seed's worked example over gRPC: B's token 8 passes, A's stale 7 gets ABORTED with
/// `fence-highest: 8` and never reaches the ledger.
#[tokio::test]
async fn a_stale_call_is_aborted_with_the_highest_generation() {
    let ledger = Ledger::default();
    let svc = FenceLayer::new(MemoryStore::new()).layer(ledger.clone());
    let ok = send(&svc, fenced("invoice-42", "8")).await;
    assert_eq!(
        (ok.http, ok.header("grpc-status")),
        (200, None),
        "passed through"
    );
    let stale = send(&svc, fenced("invoice-42", "7")).await;
    stale.status(10, "urn:fence:stale-token");
    assert_eq!(stale.header("fence-highest"), Some("8"));
    assert!(stale.header("grpc-message").unwrap().contains("token 7"));
    assert_eq!(
        ledger.calls.load(Ordering::SeqCst),
        1,
        "the stale call never ran"
    );
}

/// Missing and malformed metadata: FAILED_PRECONDITION and INVALID_ARGUMENT, including the
/// binary form of our names, repeated and empty values; never a panic, never the ledger.
#[tokio::test]
async fn missing_and_malformed_metadata() {
    let ledger = Ledger::default();
    let svc = FenceLayer::new(MemoryStore::new()).layer(ledger.clone());
    send(&svc, call(&[], body("")))
        .await
        .status(9, "urn:fence:missing-token");
    for metadata in [
        vec![("x-fencing-job", "j"), ("x-fencing-token", "seven")],
        vec![("x-fencing-job", "j"), ("x-fencing-token", "1.5")],
        vec![("x-fencing-job", "j"), ("x-fencing-token", "")],
        vec![
            ("x-fencing-job", "j"),
            ("x-fencing-token", "7"),
            ("x-fencing-token", "8"),
        ],
        vec![("x-fencing-job", "j"), ("x-fencing-token-bin", "AAc=")],
        vec![
            ("x-fencing-job", "j"),
            ("x-fencing-token", "7"),
            ("x-fencing-token-bin", "AAc="),
        ],
        vec![
            ("x-fencing-job", "j"),
            ("x-fencing-token", "7"),
            ("idempotency-key-bin", "AA=="),
        ],
        vec![("x-fencing-job", "j")],
    ] {
        let answer = send(&svc, call(&metadata, body(""))).await;
        answer.status(3, "urn:fence:malformed-token");
    }
    assert_eq!(ledger.calls.load(Ordering::SeqCst), 0);
}

/// A grpc-message is percent-encoded: a job id with `%` and the detail's text arrive intact.
#[tokio::test]
async fn the_message_is_percent_encoded() {
    let svc = FenceLayer::new(MemoryStore::new()).layer(Ledger::default());
    send(&svc, fenced("100%-done", "8")).await;
    let stale = send(&svc, fenced("100%-done", "7")).await;
    let message = stale.header("grpc-message").unwrap();
    assert!(message.contains("job 100%25-done"), "{message}");
}

/// Signed tokens: unsigned or forged is PERMISSION_DENIED, a lease that ended is ABORTED.
#[tokio::test]
async fn signatures_and_expiry() {
    let signer = TokenSigner::from_seed([7; 32]);
    let layer = FenceLayer::new(MemoryStore::new())
        .require_signatures(TokenVerifier::new([signer.verify_key()]));
    let svc = layer.layer(Ledger::default());
    send(&svc, fenced("j", "5"))
        .await
        .status(7, "urn:fence:invalid-signature");
    let job: JobId = "j".parse().unwrap();
    let ended = signer.sign(&job, Generation::new(5), 1_000);
    send(&svc, fenced("j", &ended))
        .await
        .status(10, "urn:fence:token-expired");
    let good = signer.sign(
        &job,
        Generation::new(5),
        fence_storage::clock::system_now_ms() + 60_000,
    );
    assert_eq!(
        send(&svc, fenced("j", &good)).await.header("grpc-status"),
        None
    );
}

/// Every call fails.
#[derive(Clone)]
struct Broken;

impl GenerationStore for Broken {
    async fn observe(&self, _: &JobId, _: Generation) -> Result<Verdict, StoreError> {
        Err(StoreError::Io("disk on fire".into()))
    }
    async fn highest(&self, _: &JobId) -> Result<Generation, StoreError> {
        Err(StoreError::Io("disk on fire".into()))
    }
}

impl IdempotencyStore for Broken {
    async fn begin(&self, _: Attempt<'_>, _: Duration) -> Result<Begin, StoreError> {
        Err(StoreError::Io("disk on fire".into()))
    }
    async fn finish(&self, _: Attempt<'_>, _: Finish) -> Result<(), StoreError> {
        Err(StoreError::Io("disk on fire".into()))
    }
    async fn purge_expired(&self) -> Result<usize, StoreError> {
        Ok(0)
    }
}

/// A store that fails, and older calls that do not finish: UNAVAILABLE, with Retry-After
/// kept as metadata.
#[tokio::test(start_paused = true)]
async fn store_failure_and_drain_timeout_are_unavailable() {
    let broken = FenceLayer::new(Broken).layer(Ledger::default());
    let answer = send(&broken, fenced("j", "1")).await;
    answer.status(14, "urn:fence:store-unavailable");
    assert!(answer.header("retry-after").is_some());

    let ledger = Ledger::default();
    let svc = FenceLayer::new(MemoryStore::new())
        .drain_timeout(Duration::from_millis(100))
        .layer(ledger.clone());
    let slow = tokio::spawn(svc.clone().oneshot(call(
        &[("x-fencing-job", "j"), ("x-fencing-token", "1")],
        body("slow"),
    )));
    while ledger.calls.load(Ordering::SeqCst) == 0 {
        tokio::task::yield_now().await;
    }
    send(&svc, fenced("j", "2"))
        .await
        .status(14, "urn:fence:drain-timeout");
    ledger.release.notify_waiters();
    assert_eq!(slow.await.unwrap().unwrap().status(), 200);
}

/// Idempotency-Key as metadata: the same key in flight is ABORTED, the same key for another
/// call is FAILED_PRECONDITION.
#[tokio::test]
async fn idempotency_in_flight_and_mismatch() {
    let ledger = Ledger::default();
    let svc = FenceLayer::new(MemoryStore::new()).layer(ledger.clone());
    let keyed = |payload: &'static str| {
        call(
            &[
                ("x-fencing-job", "j"),
                ("x-fencing-token", "1"),
                ("idempotency-key", "charge-1"),
            ],
            body(payload),
        )
    };
    let first = tokio::spawn(svc.clone().oneshot(keyed("slow")));
    while ledger.calls.load(Ordering::SeqCst) == 0 {
        tokio::task::yield_now().await;
    }
    send(&svc, keyed("slow"))
        .await
        .status(10, "urn:fence:idempotency-in-flight");
    ledger.release.notify_waiters();
    assert_eq!(first.await.unwrap().unwrap().status(), 200);
    send(&svc, keyed("other"))
        .await
        .status(9, "urn:fence:idempotency-key-mismatch");
    assert_eq!(ledger.calls.load(Ordering::SeqCst), 1);
}

/// A client stream that stalls past the body deadline: DEADLINE_EXCEEDED.
#[tokio::test(start_paused = true)]
async fn a_stalled_client_stream_is_deadline_exceeded() {
    let svc = FenceLayer::new(MemoryStore::new())
        .body_timeout(Duration::from_millis(200))
        .layer(Ledger::default());
    let stalled = UnsyncBoxBody::new(Partial::<Infallible>::stalls_after(b"\0\0"));
    let answer = send(
        &svc,
        call(&[("x-fencing-job", "j"), ("x-fencing-token", "1")], stalled),
    )
    .await;
    answer.status(4, "urn:fence:body-timeout");
}

/// The same layer still answers plain HTTP with problem+json.
#[tokio::test]
async fn plain_http_is_unchanged() {
    let svc = FenceLayer::new(MemoryStore::new()).layer(service_fn(
        |_: Request<RequestBody<In>>| async {
            Ok::<_, Infallible>(Response::new(http_body_util::Full::new(Bytes::new())))
        },
    ));
    let request = |t: &str| {
        Request::post("/x")
            .header("x-fencing-job", "j")
            .header("x-fencing-token", t)
            .body(body(""))
            .unwrap()
    };
    svc.clone().oneshot(request("8")).await.unwrap();
    let answer = Answer::of(svc.oneshot(request("7")).await.unwrap()).await;
    assert_eq!(answer.http, 409);
    assert_eq!(
        answer.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(answer.header("grpc-status"), None);
}

/// Idempotent replay of a gRPC answer (contract section 9): a retry with the same key gets
/// the stored message *and* its trailers (`grpc-status: 0`), and the ledger ran once; the
/// same holds after the answer went through a store's encoding (sled).
#[tokio::test]
async fn a_replayed_grpc_answer_carries_its_trailers() {
    let dir = tempfile::tempdir().unwrap();
    check_replay(FenceLayer::new(MemoryStore::new())).await;
    check_replay(FenceLayer::new(
        fence_sink::SledStore::open(dir.path()).unwrap(),
    ))
    .await;
}

async fn check_replay<St>(layer: FenceLayer<St>)
where
    St: GenerationStore + IdempotencyStore,
{
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let svc = layer.layer(service_fn(move |_: Request<RequestBody<In>>| {
        counted.fetch_add(1, Ordering::SeqCst);
        async {
            Ok::<_, Infallible>(answer(
                b"\0\0\0\0\x02ok",
                &[("grpc-status", "0"), ("grpc-message", "charged")],
            ))
        }
    }));
    let keyed = || {
        call(
            &[
                ("x-fencing-job", "j"),
                ("x-fencing-token", "1"),
                ("idempotency-key", "charge-1"),
            ],
            body("\0\0\0\0\0"),
        )
    };
    let mut answers = Vec::new();
    for _ in 0..2 {
        let response = svc.clone().oneshot(keyed()).await.unwrap();
        let replayed = response.headers().get("idempotent-replayed").is_some();
        assert!(
            response.headers().get("fence-problem-type").is_none(),
            "{:?}",
            response.headers()
        );
        let collected = response.into_body().collect().await.unwrap();
        let trailers = collected.trailers().cloned();
        answers.push((replayed, collected.to_bytes(), trailers));
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the ledger ran once");
    let (first, second) = (&answers[0], &answers[1]);
    assert!(
        !first.0 && second.0,
        "the second answer is the replay: {answers:?}"
    );
    assert_eq!(first.1, second.1, "the same message");
    let trailers = second.2.as_ref().expect("the replay ends with trailers");
    assert_eq!(trailers.get("grpc-status").unwrap(), "0");
    assert_eq!(trailers.get("grpc-message").unwrap(), "charged");
    assert_eq!(first.2, second.2);
}

/// A gRPC call that failed with its status in the trailers (after headers or messages) is
/// not kept for replay: a retry with the same key runs it again.
#[tokio::test]
async fn a_failed_grpc_answer_is_not_replayed() {
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let svc = FenceLayer::new(MemoryStore::new()).layer(service_fn(
        move |_: Request<RequestBody<In>>| {
            counted.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, Infallible>(answer(b"\0\0\0\0\0", &[("grpc-status", "14")])) }
        },
    ));
    for _ in 0..2 {
        let req = call(
            &[
                ("x-fencing-job", "j"),
                ("x-fencing-token", "1"),
                ("idempotency-key", "retry-me"),
            ],
            body(""),
        );
        let response = svc.clone().oneshot(req).await.unwrap();
        assert!(response.headers().get("idempotent-replayed").is_none());
        let trailers = response
            .into_body()
            .collect()
            .await
            .unwrap()
            .trailers()
            .cloned();
        assert_eq!(trailers.unwrap().get("grpc-status").unwrap(), "14");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 2, "the retry ran again");
}

/// A gRPC error answered in the headers alone (trailers-only: HTTP 200, `grpc-status` in the
/// head, no body) is forgotten like one in the trailers: a retry with the key runs again.
#[tokio::test]
async fn a_trailers_only_grpc_error_is_not_replayed() {
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let svc = FenceLayer::new(MemoryStore::new()).layer(service_fn(
        move |_: Request<RequestBody<In>>| {
            counted.fetch_add(1, Ordering::SeqCst);
            let response = Response::builder()
                .header("content-type", "application/grpc")
                .header("grpc-status", "14")
                .body(http_body_util::Empty::<Bytes>::new())
                .unwrap();
            async { Ok::<_, Infallible>(response) }
        },
    ));
    for _ in 0..2 {
        let metadata = [
            ("x-fencing-job", "j"),
            ("x-fencing-token", "1"),
            ("idempotency-key", "retry-me"),
        ];
        let response = svc
            .clone()
            .oneshot(call(&metadata, body("")))
            .await
            .unwrap();
        assert!(response.headers().get("idempotent-replayed").is_none());
        assert_eq!(response.headers()["grpc-status"], "14");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 2, "the retry ran again");
}

/// gRPC-Web reads HTTP statuses: its rejections stay problem+json.
#[tokio::test]
async fn grpc_web_keeps_http_answers() {
    let svc = FenceLayer::new(MemoryStore::new()).layer(Ledger::default());
    send(&svc, fenced("w", "8")).await;
    let req = Request::post("http://sink/ledger.Ledger/Charge")
        .header("content-type", "application/grpc-web+proto")
        .header("x-fencing-job", "w")
        .header("x-fencing-token", "7")
        .body(body(""))
        .unwrap();
    let answer = send(&svc, req).await;
    assert_eq!(answer.http, 409);
    assert_eq!(answer.header("grpc-status"), None);
}

/// A gRPC answer: one message `message`, then `trailers`.
fn answer(
    message: &'static [u8],
    trailers: &[(&'static str, &'static str)],
) -> Response<impl Body<Data = Bytes, Error = Infallible> + use<>> {
    let mut map = HeaderMap::new();
    for (name, value) in trailers {
        map.insert(*name, value.parse().unwrap());
    }
    let body = http_body_util::Full::new(Bytes::from_static(message))
        .with_trailers(async move { Some(Ok::<_, Infallible>(map)) });
    let mut response = Response::new(body);
    response
        .headers_mut()
        .insert("content-type", "application/grpc".parse().unwrap());
    response
}

/// A keyed call whose answer breaks off after its first message: the service may still be
/// acting (a server stream whose handler writes on), so the job is held for the unknown
/// outcome's hold, as it is without a key, and a newer token waits for it (here it gets
/// drain-timeout) instead of passing at once.
#[tokio::test]
async fn a_keyed_answer_that_breaks_off_holds_the_job() {
    let svc = FenceLayer::new(MemoryStore::new())
        .drain_timeout(Duration::from_millis(200))
        .unknown_outcome_hold(Duration::from_secs(60))
        .layer(service_fn(|_: Request<RequestBody<In>>| async {
            let body = Partial::fails_after(b"\0\0\0\0\x01x", std::io::Error::other("reset"));
            let mut response = Response::new(body);
            response
                .headers_mut()
                .insert("content-type", "application/grpc".parse().unwrap());
            Ok::<_, Infallible>(response)
        }));
    let keyed = call(
        &[
            ("x-fencing-job", "j"),
            ("x-fencing-token", "1"),
            ("idempotency-key", "k"),
        ],
        body("\0\0\0\0\0"),
    );
    let broken = svc.clone().oneshot(keyed).await.unwrap();
    let _ = broken.into_body().collect().await;
    let newer = svc.clone().oneshot(fenced("j", "2")).await.unwrap();
    Answer::of(newer)
        .await
        .status(14, "urn:fence:drain-timeout");
}

/// A keyed call whose answer streams on unkept (larger than what is kept for replay): the
/// service may still be writing it, so a newer token waits until the answer ends, as it does
/// without a key, instead of passing once the answer's head is out.
#[tokio::test]
async fn a_keyed_answer_that_streams_on_holds_the_job_until_it_ends() {
    let (sender, service) = streaming_first(Arc::default());
    let svc = FenceLayer::new(MemoryStore::new())
        .idempotency(fence_sink::IdempotencyConfig::default().max_response_body(4))
        .drain_timeout(Duration::from_millis(200))
        .unknown_outcome_hold(Duration::from_secs(60))
        .layer(service);
    // A first message of more than the 4 bytes kept: the answer streams on unkept.
    sender
        .send(Bytes::from_static(b"\0\0\0\0\x08messages"))
        .unwrap();
    let keyed = call(
        &[
            ("x-fencing-job", "j"),
            ("x-fencing-token", "1"),
            ("idempotency-key", "k"),
        ],
        body("\0\0\0\0\0"),
    );
    let mut streaming = svc.clone().oneshot(keyed).await.unwrap().into_body();
    assert!(streaming.frame().await.is_some(), "the first message");
    Answer::of(svc.clone().oneshot(fenced("j", "2")).await.unwrap())
        .await
        .status(14, "urn:fence:drain-timeout");
    drop(sender); // the service is done: the answer ends
    while streaming.frame().await.is_some() {}
    drop(streaming);
    let passed = Answer::of(svc.clone().oneshot(fenced("j", "2")).await.unwrap()).await;
    assert_eq!(passed.http, 200);
    assert_eq!(
        passed.header("fence-problem-type"),
        None,
        "{:?}",
        passed.headers
    );
}

/// A keyed call whose answer is not kept (its status filtered out) still holds the job while
/// its answer streams, as it does without a key: the handler writing it may be acting.
#[tokio::test]
async fn a_keyed_answer_not_kept_holds_the_job_until_it_ends() {
    let (sender, service) = streaming_first(Arc::default());
    let svc = FenceLayer::new(MemoryStore::new())
        .idempotency(fence_sink::IdempotencyConfig::default().store_statuses(|s| s == 201))
        .drain_timeout(Duration::from_millis(200))
        .layer(service);
    sender
        .send(Bytes::from_static(b"\0\0\0\0\x08messages"))
        .unwrap();
    let keyed = call(
        &[
            ("x-fencing-job", "j"),
            ("x-fencing-token", "1"),
            ("idempotency-key", "k"),
        ],
        body("\0\0\0\0\0"),
    );
    let mut streaming = svc.clone().oneshot(keyed).await.unwrap().into_body();
    assert!(streaming.frame().await.is_some(), "the first message");
    Answer::of(svc.clone().oneshot(fenced("j", "2")).await.unwrap())
        .await
        .status(14, "urn:fence:drain-timeout");
    drop(sender);
    while streaming.frame().await.is_some() {}
    drop(streaming);
    let passed = Answer::of(svc.clone().oneshot(fenced("j", "2")).await.unwrap()).await;
    assert_eq!(passed.http, 200);
}

/// A memory store whose `finish` fails while `failing` is set.
#[derive(Clone, Default)]
struct FailingFinish {
    inner: MemoryStore,
    failing: Arc<std::sync::atomic::AtomicBool>,
}

impl GenerationStore for FailingFinish {
    async fn observe(&self, job: &JobId, token: Generation) -> Result<Verdict, StoreError> {
        self.inner.observe(job, token).await
    }
    async fn highest(&self, job: &JobId) -> Result<Generation, StoreError> {
        self.inner.highest(job).await
    }
}

impl IdempotencyStore for FailingFinish {
    async fn begin(&self, attempt: Attempt<'_>, d: Duration) -> Result<Begin, StoreError> {
        self.inner.begin(attempt, d).await
    }
    async fn finish(&self, attempt: Attempt<'_>, outcome: Finish) -> Result<(), StoreError> {
        if self.failing.load(Ordering::SeqCst) {
            return Err(StoreError::Io("disk on fire".into()));
        }
        self.inner.finish(attempt, outcome).await
    }
    async fn purge_expired(&self) -> Result<usize, StoreError> {
        self.inner.purge_expired().await
    }
}

/// A keyed call whose answer streams on unkept while its record cannot be completed: past
/// the body deadline and the hold, the job is still held until the record is completed, so a
/// newer token's request with the same key is not let through to take the record over and
/// run the step a second time.
#[tokio::test(start_paused = true)]
async fn a_streaming_keyed_answer_holds_its_job_until_its_record_is_completed() {
    let store = FailingFinish::default();
    store.failing.store(true, Ordering::SeqCst);
    let calls = Arc::new(AtomicUsize::new(0));
    let (sender, service) = streaming_first(calls.clone());
    let svc = FenceLayer::new(store.clone())
        .idempotency(fence_sink::IdempotencyConfig::default().max_response_body(4))
        .body_timeout(Duration::from_secs(1))
        .unknown_outcome_hold(Duration::from_secs(1))
        .drain_timeout(Duration::from_millis(200))
        .layer(service);
    sender
        .send(Bytes::from_static(b"\0\0\0\0\x08messages"))
        .unwrap();
    let keyed = |token: &'static str| {
        call(
            &[
                ("x-fencing-job", "j"),
                ("x-fencing-token", token),
                ("idempotency-key", "k"),
            ],
            body("\0\0\0\0\0"),
        )
    };
    let mut streaming = svc.clone().oneshot(keyed("1")).await.unwrap().into_body();
    assert!(streaming.frame().await.is_some(), "the first message");
    // Past the body deadline and the hold, the record still in flight.
    tokio::time::sleep(Duration::from_secs(5)).await;
    Answer::of(svc.clone().oneshot(keyed("2")).await.unwrap())
        .await
        .status(14, "urn:fence:drain-timeout");
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the step ran again");
    drop(sender);
    drop(streaming);
}

/// The answer of [`streaming_first`]'s service.
type Streamed = std::future::Ready<Result<Response<common::Channel>, Infallible>>;

/// A gRPC service counting its calls in `calls`, whose first answer streams what the
/// returned sender sends (it ends when the sender is dropped); later answers send nothing.
#[allow(clippy::type_complexity)] // a closure's service type can only be spelled so
fn streaming_first(
    calls: Arc<AtomicUsize>,
) -> (
    tokio::sync::mpsc::UnboundedSender<Bytes>,
    tower::util::ServiceFn<impl Fn(Request<RequestBody<In>>) -> Streamed + Clone>,
) {
    let (sender, channel) = common::Channel::new();
    let first = Arc::new(std::sync::Mutex::new(Some(channel)));
    let service = service_fn(move |_: Request<RequestBody<In>>| {
        calls.fetch_add(1, Ordering::SeqCst);
        let body = first
            .lock()
            .unwrap()
            .take()
            .unwrap_or_else(|| common::Channel::new().1);
        let mut response = Response::new(body);
        response
            .headers_mut()
            .insert("content-type", "application/grpc".parse().unwrap());
        std::future::ready(Ok(response))
    });
    (sender, service)
}

/// A call the service answers CANCELLED or DEADLINE_EXCEEDED is of unknown outcome: a gRPC
/// server answers so after dropping the handler of a call whose deadline ran out, wherever it
/// was, and a write it had sent may still commit. The job is held, so a newer token waits
/// (here it gets drain-timeout), whether the status came in the head (trailers-only) or in
/// the trailers after a message, with or without a key; a keyed call's retry is not run
/// again meanwhile. With `GrpcStatuses::NONE` the newer token passes at once.
#[tokio::test]
async fn a_call_that_ran_out_of_time_holds_its_job() {
    let cases = [
        ("4", true, None, true),
        ("1", false, None, true),
        ("4", false, Some("k"), true),
        ("1", true, Some("k"), true),
        ("4", false, None, false),
    ];
    for (status, trailers_only, key, held) in cases {
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = calls.clone();
        let statuses = if held {
            fence_sink::GrpcStatuses::DEFAULT
        } else {
            fence_sink::GrpcStatuses::NONE
        };
        let svc = FenceLayer::new(MemoryStore::new())
            .drain_timeout(Duration::from_millis(200))
            .unknown_outcome_grpc_statuses(statuses)
            .layer(service_fn(move |req: Request<RequestBody<In>>| {
                let first = req.headers()["x-fencing-token"] == "1";
                if first {
                    counted.fetch_add(1, Ordering::SeqCst);
                }
                let code = if first { status } else { "0" };
                let response = if trailers_only {
                    Response::builder()
                        .header("content-type", "application/grpc")
                        .header("grpc-status", code)
                        .body(UnsyncBoxBody::new(http_body_util::Empty::<Bytes>::new()))
                        .unwrap()
                } else {
                    answer(b"\0\0\0\0\0", &[("grpc-status", code)]).map(UnsyncBoxBody::new)
                };
                async { Ok::<_, Infallible>(response) }
            }));
        let mut metadata = vec![("x-fencing-job", "j"), ("x-fencing-token", "1")];
        if let Some(key) = key {
            metadata.push(("idempotency-key", key));
        }
        let case = format!("grpc-status {status}, trailers-only {trailers_only}, key {key:?}");
        let first = svc.clone().oneshot(call(&metadata, body("\0\0\0\0\0")));
        let _ = first.await.unwrap().into_body().collect().await;
        if key.is_some() {
            let again = svc.clone().oneshot(call(&metadata, body("\0\0\0\0\0")));
            let _ = again.await.unwrap().into_body().collect().await;
            assert_eq!(
                calls.load(Ordering::SeqCst),
                1,
                "{case}: the retry ran again"
            );
        }
        let newer = Answer::of(svc.clone().oneshot(fenced("j", "2")).await.unwrap()).await;
        if held {
            newer.status(14, "urn:fence:drain-timeout");
        } else {
            assert_eq!(newer.header("fence-problem-type"), None, "{case}");
        }
    }
}

/// gRPC-Web and Connect's streaming calls carry their status in the body's last message and
/// answer HTTP 200 either way. A keyed call that failed so is not kept for replay (a retry
/// runs it again, instead of replaying the failure for the record's retention), and one that
/// ran out of time (4) is of unknown outcome: the retry is not run while it may still act,
/// and a newer token waits.
#[tokio::test]
async fn a_failure_in_the_body_is_not_replayed() {
    fn message(flag: u8, payload: &[u8]) -> Vec<u8> {
        let mut m = vec![flag];
        m.extend_from_slice(&u32::try_from(payload.len()).unwrap().to_be_bytes());
        m.extend_from_slice(payload);
        m
    }
    let cases: [(&str, Vec<u8>, usize, bool); 4] = [
        (
            "application/grpc-web+proto",
            [message(0, b"x"), message(0x80, b"grpc-status: 14\r\n")].concat(),
            2,
            false,
        ),
        (
            "application/connect+json",
            message(2, br#"{"error":{"code":"unavailable"}}"#),
            2,
            false,
        ),
        (
            "application/grpc-web+proto",
            message(0x80, b"grpc-status: 4\r\n"),
            1,
            true,
        ),
        (
            "application/grpc-web+proto",
            [message(0, b"x"), message(0x80, b"grpc-status: 0\r\n")].concat(),
            1,
            false,
        ),
    ];
    for (kind, answer_body, runs, held) in cases {
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = calls.clone();
        let case = format!("{kind} {answer_body:?}");
        let answer_body = Bytes::from(answer_body);
        let svc = FenceLayer::new(MemoryStore::new())
            .drain_timeout(Duration::from_millis(200))
            .layer(service_fn(move |_: Request<RequestBody<In>>| {
                counted.fetch_add(1, Ordering::SeqCst);
                let response = Response::builder()
                    .header("content-type", kind)
                    .body(http_body_util::Full::new(answer_body.clone()))
                    .unwrap();
                async { Ok::<_, Infallible>(response) }
            }));
        let keyed = |token: &'static str, key: &'static str| {
            Request::post("http://sink/ledger.Ledger/Charge")
                .header("content-type", kind)
                .header("x-fencing-job", "j")
                .header("x-fencing-token", token)
                .header("idempotency-key", key)
                .body(body("\0\0\0\0\0"))
                .unwrap()
        };
        for _ in 0..2 {
            let answer = svc.clone().oneshot(keyed("1", "k")).await.unwrap();
            let _ = answer.into_body().collect().await;
        }
        assert_eq!(calls.load(Ordering::SeqCst), runs, "{case}");
        let newer = svc.clone().oneshot(keyed("2", "other")).await.unwrap();
        let problem = newer.headers().get("fence-problem-type").cloned();
        let text = newer.into_body().collect().await.unwrap().to_bytes();
        let drained = problem.is_some_and(|p| p == "urn:fence:drain-timeout")
            || String::from_utf8_lossy(&text).contains("urn:fence:drain-timeout");
        assert_eq!(drained, held, "{case}: {text:?}");
    }
}

/// A fence's own refusal of a call (a fence, or a proxy, behind this one) answered with a
/// status of the unknown-outcome list reached no service: the job is not held for it. Its
/// upstream-timeout answer may have, and is held.
#[tokio::test]
async fn a_fences_own_refusal_holds_nothing() {
    for (kind, held) in [
        ("urn:fence:body-timeout", false),
        ("urn:fence:overloaded", false),
        ("urn:fence:upstream-timeout", true),
    ] {
        let svc = FenceLayer::new(MemoryStore::new())
            .drain_timeout(Duration::from_millis(200))
            .unknown_outcome_grpc_statuses(fence_sink::GrpcStatuses::of([1, 4, 14]).unwrap())
            .layer(service_fn(move |req: Request<RequestBody<In>>| {
                let first = req.headers()["x-fencing-token"] == "1";
                let mut response = Response::builder()
                    .header("content-type", "application/grpc")
                    .header("grpc-status", if first { "4" } else { "0" });
                if first {
                    response = response.header("fence-problem-type", kind);
                }
                let response = response
                    .body(http_body_util::Empty::<Bytes>::new())
                    .unwrap();
                async { Ok::<_, Infallible>(response) }
            }));
        let _ = svc.clone().oneshot(fenced("j", "1")).await.unwrap();
        let newer = Answer::of(svc.clone().oneshot(fenced("j", "2")).await.unwrap()).await;
        if held {
            newer.status(14, "urn:fence:drain-timeout");
        } else {
            assert_eq!(newer.header("fence-problem-type"), None, "{kind}");
        }
    }
}
