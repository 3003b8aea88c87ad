//! Integration tests of `FenceLayer`/`Fence` against `docs/protocol.md` section 3: statuses and problem bodies, generation ordering, idempotency, restarts, and the layer under tower-test, axum and hyper.

mod common;

use std::{
    collections::HashMap,
    convert::Infallible,
    fmt::Debug,
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    task::{Context, Poll, Waker},
    time::Duration,
};

use bytes::Bytes;
use common::Partial;
use fence_core::{FencingToken, Generation, JobId, Problem};
use fence_sink::{
    Attempt, Begin, FenceLayer, Fenced, Finish, GenerationStore, IdempotencyConfig,
    IdempotencyStore, MemoryStore, RequestBody, SledStore, StoreError, Verdict,
};
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::BodyExt;
use proptest::prelude::*;
use tokio::sync::{Notify, mpsc};
use tower::{Layer, Service, ServiceExt};

const JOB: &str = "job-1";

// ---------------------------------------------------------------------------------------
// Requests and answers
// ---------------------------------------------------------------------------------------

/// A request with these raw headers (appended in order, so repeats are possible).
fn request(method: Method, path: &str, headers: &[(&str, &[u8])], body: &str) -> Request<String> {
    let mut builder = Request::builder().method(method).uri(path);
    for (name, value) in headers {
        builder = builder.header(
            *name,
            HeaderValue::from_bytes(value).expect("valid header value"),
        );
    }
    builder.body(body.to_owned()).expect("valid request")
}

/// Raw request headers, in order.
type Headers<'a> = Vec<(&'a str, &'a [u8])>;

/// A fenced POST to `path` of `job` with `token`.
fn post_to(path: &str, job: &str, token: u64) -> Request<String> {
    let token = token.to_string();
    request(
        Method::POST,
        path,
        &[
            ("x-fencing-job", job.as_bytes()),
            ("x-fencing-token", token.as_bytes()),
        ],
        "",
    )
}

/// A fenced POST to `/charge`.
fn post(job: &str, token: u64) -> Request<String> {
    post_to("/charge", job, token)
}

/// A fenced POST to `path` with an `Idempotency-Key` (raw header value) and a body.
fn keyed_to(path: &str, job: &str, token: u64, key: &str, body: &str) -> Request<String> {
    let token = token.to_string();
    let headers: [(&str, &[u8]); 3] = [
        ("x-fencing-job", job.as_bytes()),
        ("x-fencing-token", token.as_bytes()),
        ("idempotency-key", key.as_bytes()),
    ];
    request(Method::POST, path, &headers, body)
}

fn keyed(job: &str, token: u64, key: &str, body: &str) -> Request<String> {
    keyed_to("/charge", job, token, key, body)
}

fn with_header(mut req: Request<String>, name: &'static str, value: &str) -> Request<String> {
    req.headers_mut().append(
        name,
        HeaderValue::from_str(value).expect("valid header value"),
    );
    req
}

/// A whole response.
#[derive(Debug)]
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Answer {
    async fn of<B>(response: Response<B>) -> Self
    where
        B: Body<Data = Bytes>,
        B::Error: Debug,
    {
        let (head, body) = response.into_parts();
        let body = body.collect().await.expect("response body").to_bytes();
        Self {
            status: head.status,
            headers: head.headers,
            body,
        }
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The problem+json body, checked against the contract: content type, `type`, and a
    /// `status` member equal to the HTTP status. `token`/`highest` parse only as JSON integers.
    fn problem(&self, status: u16, uri: &str) -> Problem {
        assert_eq!(self.status, status, "status of {self:?}");
        assert_eq!(
            self.headers
                .get(http::header::CONTENT_TYPE)
                .map(HeaderValue::as_bytes),
            Some(&b"application/problem+json"[..]),
            "content type of {self:?}"
        );
        let axum::Json(problem) = axum::Json::<Problem>::from_bytes(&self.body)
            .unwrap_or_else(|e| panic!("not a contract problem body ({e}): {}", self.text()));
        assert_eq!(problem.kind.uri(), uri, "type of {}", self.text());
        assert_eq!(problem.status, status, "status member of {}", self.text());
        assert!(
            !problem.title.is_empty() && !problem.detail.is_empty(),
            "title and detail: {}",
            self.text()
        );
        problem
    }

    /// `Retry-After` in seconds; fails when absent or not a positive integer.
    fn retry_after(&self) -> u64 {
        let value = self
            .headers
            .get(http::header::RETRY_AFTER)
            .unwrap_or_else(|| panic!("no Retry-After on {self:?}"));
        let secs: u64 = value
            .to_str()
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("Retry-After {value:?}"));
        assert!(secs >= 1, "Retry-After {secs}");
        secs
    }

    fn replayed(&self) -> Option<&str> {
        self.headers
            .get("idempotent-replayed")
            .map(|v| v.to_str().expect("ascii"))
    }

    /// Headers as (name, value) pairs, grouped by name with each name's values in order.
    fn header_list(&self, without: &str) -> Vec<(String, Vec<u8>)> {
        let mut list: Vec<(String, Vec<u8>)> = self
            .headers
            .iter()
            .filter(|(n, _)| n.as_str() != without)
            .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
            .collect();
        list.sort_by(|a, b| a.0.cmp(&b.0)); // stable: keeps the order of repeated headers
        list
    }
}

/// Sends one request through a clone of `svc` (ready, then call).
async fn send<S, B>(svc: &S, req: Request<String>) -> Answer
where
    S: Service<Request<String>, Response = Response<B>> + Clone,
    S::Error: Debug,
    B: Body<Data = Bytes>,
    B::Error: Debug,
{
    Answer::of(
        svc.clone()
            .oneshot(req)
            .await
            .expect("the fence never fails with Err"),
    )
    .await
}

/// [`send`] taking the service by value, for a request spawned into a task of its own.
async fn send_owned<S, B>(svc: S, req: Request<String>) -> Answer
where
    S: Service<Request<String>, Response = Response<B>> + Clone,
    S::Error: Debug,
    B: Body<Data = Bytes>,
    B::Error: Debug,
{
    send(&svc, req).await
}

fn job(s: &str) -> JobId {
    s.parse().expect("valid job id")
}

fn token(t: u64) -> FencingToken {
    FencingToken::new(t).expect("nonzero token")
}

/// With paused time: returns once every other task is blocked (time only auto-advances
/// when the runtime is idle), without moving the clock by more than a millisecond.
async fn settle() {
    tokio::time::sleep(Duration::from_millis(1)).await;
}

fn poll_ready_now<S: Service<R>, R>(svc: &mut S) -> Poll<Result<(), S::Error>> {
    svc.poll_ready(&mut Context::from_waker(Waker::noop()))
}

/// A bound on waits that only a bug makes long, so such a bug fails the test instead of
/// hanging it (not a sleep: the wait ends as soon as the awaited thing happens).
const BUG_BOUND: Duration = Duration::from_secs(10);

/// The next request the mock receives.
async fn next_request<T, U>(
    handle: &mut tower_test::mock::Handle<T, U>,
) -> (T, tower_test::mock::SendResponse<U>) {
    tokio::time::timeout(BUG_BOUND, handle.next_request())
        .await
        .expect("no request reached the mock")
        .expect("the mock is closed")
}

/// The tag (`<token> <path>`) of the next call the `App` starts.
async fn started_within(started: &mut mpsc::UnboundedReceiver<String>) -> String {
    tokio::time::timeout(BUG_BOUND, started.recv())
        .await
        .expect("the inner service was not called")
        .expect("the app is gone")
}

// ---------------------------------------------------------------------------------------
// The inner service
// ---------------------------------------------------------------------------------------

/// The inner service of most tests. It counts and logs its calls (`start <token> <path>`,
/// `finish <token> <path>`), keeps the `Fenced` extension it saw, and answers:
/// - `/hold` waits for `release` (one `notify_one` per held request), `/forever` never answers;
/// - status from the request header `x-status` (default 201), body padded to `x-size` bytes;
/// - headers `content-type`, `x-run: <call number>` and `x-multi: a`, `x-multi: b`;
/// - body `run <n> <method> <path> <request body>`.
#[derive(Clone)]
struct App {
    calls: Arc<AtomicUsize>,
    log: Arc<Mutex<Vec<String>>>,
    fenced: Arc<Mutex<Vec<Option<Fenced>>>>,
    release: Arc<Notify>,
    started: mpsc::UnboundedSender<String>,
}

impl App {
    fn new() -> (Self, mpsc::UnboundedReceiver<String>) {
        let (started, rx) = mpsc::unbounded_channel();
        let app = Self {
            calls: Arc::default(),
            log: Arc::default(),
            fenced: Arc::default(),
            release: Arc::default(),
            started,
        };
        (app, rx)
    }

    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    fn log(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }

    fn fenced(&self) -> Vec<Option<Fenced>> {
        self.fenced.lock().unwrap().clone()
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<B> Service<Request<B>> for App
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Debug,
{
    type Response = Response<String>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Response<String>, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        let fenced = req.extensions().get::<Fenced>().cloned();
        let tag = format!(
            "{} {}",
            fenced
                .as_ref()
                .map_or("-".to_owned(), |f| f.token.to_string()),
            req.uri().path()
        );
        self.fenced.lock().unwrap().push(fenced);
        self.log.lock().unwrap().push(format!("start {tag}"));
        let _ = self.started.send(tag.clone());
        let this = self.clone();
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            let body = body.collect().await.expect("request body").to_bytes();
            match parts.uri.path() {
                "/hold" => this.release.notified().await,
                "/forever" => std::future::pending::<()>().await,
                _ => {}
            }
            this.log.lock().unwrap().push(format!("finish {tag}"));
            let header = |name: &str| {
                parts
                    .headers
                    .get(name)
                    .and_then(|v| v.to_str().ok()?.parse::<usize>().ok())
            };
            let status = header("x-status").map_or(201, |s| u16::try_from(s).expect("status"));
            let mut text = format!(
                "run {n} {} {} {}",
                parts.method,
                parts.uri.path(),
                String::from_utf8_lossy(&body)
            );
            while text.len() < header("x-size").unwrap_or(0) {
                text.push('.');
            }
            let response = Response::builder()
                .status(status)
                .header("content-type", "text/plain; charset=utf-8")
                .header("x-run", n)
                .header("x-multi", "a")
                .header("x-multi", "b")
                .body(text)
                .expect("valid response");
            Ok(response)
        })
    }
}

// ---------------------------------------------------------------------------------------
// Stores that misbehave
// ---------------------------------------------------------------------------------------

fn broken() -> StoreError {
    StoreError::Io("disk on fire".into())
}

/// Every call fails.
struct BrokenStore;

impl GenerationStore for BrokenStore {
    async fn observe(&self, _job: &JobId, _token: Generation) -> Result<Verdict, StoreError> {
        Err(broken())
    }

    async fn highest(&self, _job: &JobId) -> Result<Generation, StoreError> {
        Err(broken())
    }
}

impl IdempotencyStore for BrokenStore {
    async fn begin(&self, _: Attempt<'_>, _: Duration) -> Result<Begin, StoreError> {
        Err(broken())
    }

    async fn finish(&self, _: Attempt<'_>, _: Finish) -> Result<(), StoreError> {
        Err(broken())
    }

    async fn purge_expired(&self) -> Result<usize, StoreError> {
        Err(broken())
    }
}

/// A `MemoryStore` that fails every call while `fail` is set; while `hang_observe` is set,
/// `observe` waits for `release` (a slow disk flush), and while `hang_highest` is set,
/// `highest` never answers.
#[derive(Default)]
struct FlakyStore {
    inner: MemoryStore,
    fail: AtomicBool,
    hang_observe: AtomicBool,
    hang_highest: AtomicBool,
    /// The next `begin` writes its record, then fails (a commit lost after the write).
    fail_after_begin: AtomicBool,
    /// This many next `finish` calls fail (a store still failing).
    fail_finishes: AtomicUsize,
    release: Notify,
}

impl FlakyStore {
    fn check(&self) -> Result<(), StoreError> {
        if self.fail.load(Ordering::SeqCst) {
            Err(broken())
        } else {
            Ok(())
        }
    }
}

impl GenerationStore for FlakyStore {
    async fn observe(&self, job: &JobId, token: Generation) -> Result<Verdict, StoreError> {
        self.check()?;
        if self.hang_observe.load(Ordering::SeqCst) {
            self.release.notified().await;
        }
        self.inner.observe(job, token).await
    }

    async fn highest(&self, job: &JobId) -> Result<Generation, StoreError> {
        self.check()?;
        if self.hang_highest.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        self.inner.highest(job).await
    }
}

impl IdempotencyStore for FlakyStore {
    async fn begin(&self, attempt: Attempt<'_>, for_: Duration) -> Result<Begin, StoreError> {
        self.check()?;
        let begun = self.inner.begin(attempt, for_).await;
        if self.fail_after_begin.swap(false, Ordering::SeqCst) {
            return Err(broken());
        }
        begun
    }

    async fn finish(&self, attempt: Attempt<'_>, outcome: Finish) -> Result<(), StoreError> {
        self.check()?;
        let failing = self
            .fail_finishes
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if failing.is_ok() {
            return Err(broken());
        }
        self.inner.finish(attempt, outcome).await
    }

    async fn purge_expired(&self) -> Result<usize, StoreError> {
        self.check()?;
        self.inner.purge_expired().await
    }
}

// ---------------------------------------------------------------------------------------
// 1. tower-test mock: rejections never reach the inner service; readiness is the inner's
// ---------------------------------------------------------------------------------------

type MockReq = Request<RequestBody<String>>;

#[tokio::test]
async fn mock_rejections_never_reach_the_inner_service() {
    let (mock, mut handle) = tower_test::mock::pair::<MockReq, Response<String>>();
    let mut svc = FenceLayer::new(MemoryStore::new()).layer(mock);

    // Token 8 goes through to the mock, with the Fenced extension.
    assert!(matches!(poll_ready_now(&mut svc), Poll::Ready(Ok(()))));
    let accepted = tokio::spawn(svc.call(post(JOB, 8)));
    let (seen, respond) = next_request(&mut handle).await;
    assert_eq!(
        seen.extensions().get::<Fenced>(),
        Some(&Fenced {
            job: job(JOB),
            token: token(8)
        })
    );
    respond.send_response(Response::new("done".to_owned()));
    let accepted = Answer::of(accepted.await.unwrap().unwrap()).await;
    assert_eq!(
        (accepted.status, accepted.text().as_str()),
        (StatusCode::OK, "done")
    );

    let only_job: [(&str, &[u8]); 1] = [("x-fencing-job", b"job-1")];
    let rejections = [
        (post(JOB, 7), 409, "urn:fence:stale-token"),
        (
            request(Method::POST, "/charge", &only_job, ""),
            400,
            "urn:fence:malformed-token",
        ),
        (
            request(Method::POST, "/charge", &[], ""),
            428,
            "urn:fence:missing-token",
        ),
    ];
    for (req, status, uri) in rejections {
        assert!(matches!(poll_ready_now(&mut svc), Poll::Ready(Ok(()))));
        let answer = Answer::of(svc.call(req).await.unwrap()).await;
        answer.problem(status, uri);
        assert!(
            handle.poll_request().is_pending(),
            "a {status} rejection reached the inner service"
        );
    }

    // The mock still works afterwards: token 8 again reaches it.
    assert!(matches!(poll_ready_now(&mut svc), Poll::Ready(Ok(()))));
    let again = tokio::spawn(svc.call(post(JOB, 8)));
    let (_, respond) = next_request(&mut handle).await;
    respond.send_response(Response::new(String::new()));
    assert_eq!(again.await.unwrap().unwrap().status(), 200);
}

#[tokio::test]
async fn mock_poll_ready_is_the_inner_services() {
    let (mock, mut handle) = tower_test::mock::pair::<MockReq, Response<String>>();
    let mut svc = FenceLayer::new(MemoryStore::new()).layer(mock);

    handle.allow(0);
    assert!(
        poll_ready_now(&mut svc).is_pending(),
        "ready while the inner service is not"
    );
    handle.allow(1);
    assert!(
        matches!(poll_ready_now(&mut svc), Poll::Ready(Ok(()))),
        "not ready while the inner service is"
    );

    // The service that was made ready is the one called (the mock panics otherwise).
    let call = tokio::spawn(svc.call(post(JOB, 3)));
    let (_, respond) = next_request(&mut handle).await;
    respond.send_response(Response::new(String::new()));
    assert_eq!(call.await.unwrap().unwrap().status(), 200);

    // The one allowed request is used up: not ready again until the mock allows more.
    assert!(poll_ready_now(&mut svc).is_pending());
    handle.allow(1);
    assert!(matches!(poll_ready_now(&mut svc), Poll::Ready(Ok(()))));

    // An error from the inner poll_ready passes through unchanged.
    handle.send_error("inner is gone");
    match poll_ready_now(&mut svc) {
        Poll::Ready(Err(e)) => assert_eq!(e.to_string(), "inner is gone"),
        other => panic!("expected the inner error, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------
// 2. Statuses and problem bodies
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn stale_token_gets_409_with_job_token_and_highest() {
    let (app, _started) = App::new();
    let svc = FenceLayer::new(MemoryStore::new()).layer(app.clone());
    assert_eq!(send(&svc, post(JOB, 8)).await.status, 201);
    assert_eq!(
        send(&svc, post(JOB, 8)).await.status,
        201,
        "the same token passes again"
    );

    let stale = send(&svc, post(JOB, 7)).await;
    let p = stale.problem(409, "urn:fence:stale-token");
    assert_eq!(
        (p.job, p.token, p.highest),
        (Some(job(JOB)), Some(7), Some(8))
    );
    assert!(
        stale.headers.get(http::header::RETRY_AFTER).is_none(),
        "a stale holder must not retry"
    );
    assert_eq!(
        app.calls(),
        2,
        "the stale request reached the inner service"
    );

    // Jobs are independent: token 1 of another job passes.
    assert_eq!(send(&svc, post("job-2", 1)).await.status, 201);
    // u64::MAX is a valid token.
    assert_eq!(send(&svc, post(JOB, u64::MAX)).await.status, 201);
    let p = send(&svc, post(JOB, 9))
        .await
        .problem(409, "urn:fence:stale-token");
    assert_eq!(p.highest, Some(u64::MAX));
}

#[tokio::test]
async fn an_idle_job_is_answered_from_memory_with_its_highest() {
    let (app, _started) = App::new();
    let layer = FenceLayer::new(FlakyStore::default()).without_idempotency();
    let svc = layer.layer(app.clone());
    assert_eq!(send(&svc, post(JOB, 3)).await.status, 201);
    assert_eq!(send(&svc, post(JOB, 5)).await.status, 201);
    // Every request has finished, so the job is idle in the cache. With the store failing,
    // only memory can answer.
    layer.store().fail.store(true, Ordering::SeqCst);
    assert_eq!(
        send(&svc, post(JOB, 5)).await.status,
        201,
        "the current token passes from memory"
    );
    let p = send(&svc, post(JOB, 4))
        .await
        .problem(409, "urn:fence:stale-token");
    assert_eq!(p.highest, Some(5), "the idle entry kept the highest");
    assert_eq!(
        send(&svc, post(JOB, 6)).await.status,
        503,
        "a bump still needs the store"
    );
    layer.store().fail.store(false, Ordering::SeqCst);
    assert_eq!(send(&svc, post(JOB, 6)).await.status, 201);
    assert_eq!(
        send(&svc, post(JOB, 5))
            .await
            .problem(409, "urn:fence:stale-token")
            .highest,
        Some(6)
    );
    let stats = layer.cache_stats();
    assert_eq!(
        (stats.cached_jobs, stats.misses, stats.hits),
        (1, 1, 6),
        "one read of the store, then memory"
    );
}

#[tokio::test]
async fn malformed_headers_get_400() {
    let (app, _started) = App::new();
    let svc = FenceLayer::new(MemoryStore::new()).layer(app.clone());
    let j: &str = "x-fencing-job";
    let t: &str = "x-fencing-token";
    let k: &str = "idempotency-key";
    let cases: Vec<(&str, Headers<'_>)> = vec![
        ("only the job", vec![(j, b"job-1")]),
        ("only the token", vec![(t, b"3")]),
        ("repeated token", vec![(j, b"job-1"), (t, b"3"), (t, b"3")]),
        (
            "repeated job",
            vec![(j, b"job-1"), (j, b"job-1"), (t, b"3")],
        ),
        ("empty token", vec![(j, b"job-1"), (t, b"")]),
        ("empty job", vec![(j, b""), (t, b"3")]),
        ("leading zero", vec![(j, b"job-1"), (t, b"01")]),
        ("negative", vec![(j, b"job-1"), (t, b"-1")]),
        ("zero", vec![(j, b"job-1"), (t, b"0")]),
        ("2^64", vec![(j, b"job-1"), (t, b"18446744073709551616")]),
        ("plus sign", vec![(j, b"job-1"), (t, b"+3")]),
        ("space in job", vec![(j, b"job 1"), (t, b"3")]),
        ("non-ascii job", vec![(j, b"j\xc3\xa9"), (t, b"3")]),
        ("257-byte job", vec![(j, &[b'x'; 257]), (t, b"3")]),
        (
            "bad idempotency key",
            vec![(j, b"job-1"), (t, b"3"), (k, b"a b")],
        ),
        (
            "empty idempotency key",
            vec![(j, b"job-1"), (t, b"3"), (k, b"")],
        ),
        (
            "repeated idempotency key",
            vec![(j, b"job-1"), (t, b"3"), (k, b"a"), (k, b"a")],
        ),
    ];
    for (what, headers) in cases {
        let answer = send(&svc, request(Method::POST, "/charge", &headers, "")).await;
        assert_eq!(answer.status, 400, "{what}: {answer:?}");
        answer.problem(400, "urn:fence:malformed-token");
    }
    assert_eq!(
        app.calls(),
        0,
        "a malformed request reached the inner service"
    );
    // Upper bounds that are still valid.
    let max_job = "x".repeat(256);
    let ok: [(&str, &[u8]); 2] = [(j, max_job.as_bytes()), (t, b"18446744073709551615")];
    assert_eq!(
        send(&svc, request(Method::POST, "/charge", &ok, ""))
            .await
            .status,
        201
    );
}

#[tokio::test]
async fn missing_headers_get_428_unless_allowed() {
    let (app, _started) = App::new();
    let strict = FenceLayer::new(MemoryStore::new()).layer(app.clone());
    for method in [Method::POST, Method::PUT, Method::PATCH, Method::DELETE] {
        let answer = send(&strict, request(method.clone(), "/charge", &[], "")).await;
        answer.problem(428, "urn:fence:missing-token");
    }
    assert_eq!(app.calls(), 0);

    let lenient = FenceLayer::new(MemoryStore::new())
        .allow_missing_token()
        .layer(app.clone());
    assert_eq!(
        send(&lenient, request(Method::POST, "/charge", &[], ""))
            .await
            .status,
        201
    );
    assert_eq!(
        app.fenced(),
        vec![None],
        "an unfenced request carried a Fenced extension"
    );
    // Allowing missing headers does not allow malformed or stale ones.
    let only_token: [(&str, &[u8]); 1] = [("x-fencing-token", b"3")];
    send(&lenient, request(Method::POST, "/charge", &only_token, ""))
        .await
        .problem(400, "urn:fence:malformed-token");
    assert_eq!(send(&lenient, post(JOB, 5)).await.status, 201);
    send(&lenient, post(JOB, 4))
        .await
        .problem(409, "urn:fence:stale-token");
}

#[tokio::test]
async fn unfenced_methods_pass_and_fence_methods_and_fence_when_change_that() {
    let (app, _started) = App::new();
    let default = FenceLayer::new(MemoryStore::new()).layer(app.clone());
    for method in [Method::GET, Method::HEAD, Method::OPTIONS] {
        assert_eq!(
            send(&default, request(method, "/charge", &[], ""))
                .await
                .status,
            201
        );
    }
    // A GET with a stale token is not fenced either: nothing is checked.
    assert_eq!(send(&default, post(JOB, 5)).await.status, 201);
    let mut get = post(JOB, 1);
    *get.method_mut() = Method::GET;
    assert_eq!(send(&default, get).await.status, 201);

    let methods = FenceLayer::new(MemoryStore::new())
        .fence_methods([Method::GET])
        .layer(app.clone());
    send(&methods, request(Method::GET, "/charge", &[], ""))
        .await
        .problem(428, "urn:fence:missing-token");
    // A method in other capitals is fenced too: an upstream may well read `get` as GET.
    let lower = Method::from_bytes(b"get").unwrap();
    send(&methods, request(lower, "/charge", &[], ""))
        .await
        .problem(428, "urn:fence:missing-token");
    // And with the default list, `get` is not GET: fenced.
    send(
        &default,
        request(Method::from_bytes(b"get").unwrap(), "/charge", &[], ""),
    )
    .await
    .problem(428, "urn:fence:missing-token");
    assert_eq!(
        send(&methods, request(Method::POST, "/charge", &[], ""))
            .await
            .status,
        201
    );

    let when = FenceLayer::new(MemoryStore::new())
        .fence_when(|p| p.uri.path().starts_with("/fenced/"))
        .layer(app.clone());
    send(&when, request(Method::GET, "/fenced/x", &[], ""))
        .await
        .problem(428, "urn:fence:missing-token");
    assert_eq!(
        send(&when, request(Method::POST, "/open", &[], ""))
            .await
            .status,
        201
    );
    assert_eq!(send(&when, post_to("/fenced/x", JOB, 2)).await.status, 201);
    send(&when, post_to("/fenced/y", JOB, 1))
        .await
        .problem(409, "urn:fence:stale-token");

    // fence_methods after fence_when goes back to a method list.
    let back = FenceLayer::new(MemoryStore::new())
        .fence_when(|_| false)
        .fence_methods([Method::DELETE])
        .layer(app.clone());
    send(&back, request(Method::DELETE, "/x", &[], ""))
        .await
        .problem(428, "urn:fence:missing-token");
}

#[tokio::test]
async fn store_failure_gets_503_with_retry_after() {
    let (app, _started) = App::new();
    let svc = FenceLayer::new(BrokenStore).layer(app.clone());
    let answer = send(&svc, post(JOB, 3)).await;
    let p = answer.problem(503, "urn:fence:store-unavailable");
    assert_eq!((p.job, p.token), (Some(job(JOB)), Some(3)));
    // The store's own error text (a database's names tables and hosts) stays in the log.
    assert!(
        !p.detail.contains("disk on fire") && p.detail.contains("sink store I/O failed"),
        "{}",
        p.detail
    );
    answer.retry_after();
    assert_eq!(
        app.calls(),
        0,
        "the request was passed on although the store failed"
    );
    // Header checks come first and need no store.
    send(&svc, request(Method::POST, "/charge", &[], ""))
        .await
        .problem(428, "urn:fence:missing-token");
}

/// A `begin` that failed may have written its record (a commit lost after the write): the
/// record is given up, tried again while the store still fails, so the client's retry after
/// `Retry-After` runs the request instead of meeting its own record in flight for the whole
/// in-flight timeout (nothing ran).
#[tokio::test]
async fn a_failed_begin_leaves_its_key_free() {
    let (app, _started) = App::new();
    let store = Arc::new(FlakyStore::default());
    let svc = FenceLayer::from_arc(store.clone()).layer(app.clone());
    store.fail_after_begin.store(true, Ordering::SeqCst);
    store.fail_finishes.store(2, Ordering::SeqCst); // the give-up's first two tries fail
    send(&svc, keyed(JOB, 5, "k", "pay"))
        .await
        .problem(503, "urn:fence:store-unavailable");
    assert_eq!(app.calls(), 0, "nothing ran");
    // The give-up runs in a task: tries at 0, 100 and 300 ms.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert_eq!(send(&svc, keyed(JOB, 5, "k", "pay")).await.status, 201);
    assert_eq!(app.calls(), 1);
}

/// The same with an in-flight timeout of `Duration::MAX` (a service that never gives up):
/// the give-up's deadline saturates instead of overflowing.
/// Every duration the layer takes may be as long as `Duration` holds: it is clamped, never
/// added to a clock reading to panic (a caller's "no limit").
#[tokio::test]
async fn endless_durations_do_not_panic() {
    let (app, _started) = App::new();
    let endless = Duration::MAX;
    let svc = FenceLayer::new(MemoryStore::new())
        .store_timeout(endless)
        .drain_timeout(endless)
        .body_timeout(endless)
        .unknown_outcome_hold(endless)
        .longest_request(endless)
        .clock_skew(endless)
        .max_lease_ttl(endless)
        .idempotency(
            IdempotencyConfig::default()
                .retention(endless)
                .in_flight_timeout(endless)
                .store_timeout(endless)
                .sweep_every(endless),
        )
        .layer(app.clone());
    assert_eq!(send(&svc, keyed(JOB, 5, "k", "pay")).await.status, 201);
    assert_eq!(
        send(&svc, keyed(JOB, 5, "k", "pay")).await.replayed(),
        Some("true")
    );
    assert_eq!(send(&svc, post(JOB, 6)).await.status, 201);
    assert_eq!(send(&svc, post(JOB, 7)).await.status, 201);
}

#[tokio::test]
async fn a_failed_begin_with_an_endless_in_flight_timeout_does_not_panic() {
    let (app, _started) = App::new();
    let store = Arc::new(FlakyStore::default());
    let svc = FenceLayer::from_arc(store.clone())
        .idempotency(IdempotencyConfig::default().in_flight_timeout(Duration::MAX))
        .layer(app.clone());
    store.fail_after_begin.store(true, Ordering::SeqCst);
    send(&svc, keyed(JOB, 5, "k", "pay"))
        .await
        .problem(503, "urn:fence:store-unavailable");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(send(&svc, keyed(JOB, 5, "k", "pay")).await.status, 201);
}

#[tokio::test]
async fn store_failure_on_bump_and_on_idempotency_gets_503_then_recovers() {
    let (app, _started) = App::new();
    let store = Arc::new(FlakyStore::default());
    let svc = FenceLayer::from_arc(store.clone()).layer(app.clone());
    assert_eq!(send(&svc, post(JOB, 5)).await.status, 201);

    store.fail.store(true, Ordering::SeqCst);
    let idem = send(&svc, keyed(JOB, 5, "k", "")).await;
    let p = idem.problem(503, "urn:fence:store-unavailable");
    assert_eq!(
        (p.job, p.token),
        (Some(job(JOB)), Some(5)),
        "the contract's members"
    );
    assert!(!p.detail.contains("disk on fire"), "{}", p.detail);
    idem.retry_after();
    assert_eq!(
        app.calls(),
        1,
        "a request was passed on although the store failed"
    );
    // The cached generation still answers without the store.
    assert_eq!(send(&svc, post(JOB, 5)).await.status, 201);
    let bump = send(&svc, post(JOB, 6)).await;
    bump.problem(503, "urn:fence:store-unavailable");
    bump.retry_after();
    assert_eq!(
        app.calls(),
        2,
        "the bump was passed on although the store failed"
    );
    // A holder of 6 exists, and whether its write landed is unknown: 5 is refused from now
    // on, which needs nothing from the store.
    send(&svc, post(JOB, 5))
        .await
        .problem(409, "urn:fence:stale-token");

    store.fail.store(false, Ordering::SeqCst);
    assert_eq!(
        send(&svc, post(JOB, 6)).await.status,
        201,
        "the failed bump left the gate stuck"
    );
    send(&svc, post(JOB, 5))
        .await
        .problem(409, "urn:fence:stale-token");
    assert_eq!(send(&svc, keyed(JOB, 6, "k", "")).await.status, 201);
}

#[tokio::test(start_paused = true)]
async fn store_timeout_gets_503() {
    let (app, _started) = App::new();
    let store = Arc::new(FlakyStore::default());
    let svc = FenceLayer::from_arc(store.clone())
        .store_timeout(Duration::from_millis(50))
        .layer(app.clone());

    store.hang_highest.store(true, Ordering::SeqCst);
    let start = tokio::time::Instant::now();
    let answer = send(&svc, post(JOB, 3)).await;
    answer.problem(503, "urn:fence:store-unavailable");
    answer.retry_after();
    assert!(start.elapsed() >= Duration::from_millis(50));

    store.hang_highest.store(false, Ordering::SeqCst);
    assert_eq!(send(&svc, post(JOB, 3)).await.status, 201);
    store.hang_observe.store(true, Ordering::SeqCst);
    send(&svc, post(JOB, 4))
        .await
        .problem(503, "urn:fence:store-unavailable");
    store.hang_observe.store(false, Ordering::SeqCst);
    assert_eq!(
        send(&svc, post(JOB, 4)).await.status,
        201,
        "a timed-out bump left the gate stuck"
    );
    assert_eq!(app.calls(), 2);
}

#[tokio::test]
async fn checks_run_in_contract_order() {
    let (app, mut started) = App::new();
    let svc = FenceLayer::new(MemoryStore::new()).layer(app.clone());
    assert_eq!(send(&svc, post(JOB, 8)).await.status, 201);
    // Malformed (400) before stale (409).
    let bad_key = keyed(JOB, 7, "a b", "");
    send(&svc, bad_key)
        .await
        .problem(400, "urn:fence:malformed-token");
    // Malformed (400) before missing (428).
    let only_key: [(&str, &[u8]); 1] = [("idempotency-key", b"a b")];
    send(&svc, request(Method::POST, "/charge", &only_key, ""))
        .await
        .problem(400, "urn:fence:malformed-token");
    // Fence (409) before idempotency: a key in flight under token 8 does not matter to token 7.
    assert_eq!(started_within(&mut started).await, "8 /charge");
    let held = tokio::spawn(svc.clone().oneshot(keyed_to("/hold", JOB, 8, "k", "")));
    assert_eq!(started_within(&mut started).await, "8 /hold");
    send(&svc, keyed_to("/hold", JOB, 7, "k", ""))
        .await
        .problem(409, "urn:fence:stale-token");
    send(&svc, keyed_to("/hold", JOB, 8, "k", ""))
        .await
        .problem(409, "urn:fence:idempotency-in-flight");
    app.release.notify_one();
    assert_eq!(held.await.unwrap().unwrap().status(), 201);
}

// ---------------------------------------------------------------------------------------
// 3. The Fenced extension
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn handler_sees_what_the_fence_accepted() {
    let (app, _started) = App::new();
    let svc = FenceLayer::new(MemoryStore::new()).layer(app.clone());
    send(&svc, post(JOB, 4)).await;
    send(&svc, keyed("job-2", 9, "k", "body")).await;
    send(&svc, request(Method::GET, "/", &[], "")).await;
    assert_eq!(
        app.fenced(),
        vec![
            Some(Fenced {
                job: job(JOB),
                token: token(4)
            }),
            Some(Fenced {
                job: job("job-2"),
                token: token(9)
            }),
            None,
        ]
    );
}

// ---------------------------------------------------------------------------------------
// 4. Ordering of generations, pending bumps, drain timeout
// ---------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn higher_token_waits_for_older_in_flight_and_blocks_older_arrivals() {
    let (app, _started) = App::new();
    let svc = FenceLayer::new(MemoryStore::new()).layer(app.clone());

    let slow7 = tokio::spawn(svc.clone().oneshot(post_to("/hold", JOB, 7)));
    settle().await;
    assert_eq!(app.log(), ["start 7 /hold"]);

    let waiting8 = tokio::spawn(svc.clone().oneshot(post(JOB, 8)));
    settle().await;
    assert_eq!(
        app.log(),
        ["start 7 /hold"],
        "token 8 started while token 7 was in flight"
    );
    assert!(!waiting8.is_finished());

    // Token 7 arriving while 8 waits is stale at once: a newer claim exists.
    let late7 = send(&svc, post(JOB, 7)).await;
    let p = late7.problem(409, "urn:fence:stale-token");
    assert_eq!(p.token, Some(7));
    assert_eq!(app.calls(), 1, "the late token 7 reached the inner service");

    app.release.notify_one();
    assert_eq!(slow7.await.unwrap().unwrap().status(), 201);
    assert_eq!(waiting8.await.unwrap().unwrap().status(), 201);
    assert_eq!(
        app.log(),
        [
            "start 7 /hold",
            "finish 7 /hold",
            "start 8 /charge",
            "finish 8 /charge"
        ]
    );
    send(&svc, post(JOB, 7))
        .await
        .problem(409, "urn:fence:stale-token");
}

#[tokio::test(start_paused = true)]
async fn a_higher_pending_bump_supersedes_a_lower_one() {
    let (app, _started) = App::new();
    let svc = FenceLayer::new(MemoryStore::new()).layer(app.clone());
    let slow7 = tokio::spawn(svc.clone().oneshot(post_to("/hold", JOB, 7)));
    settle().await;
    let waiting8 = tokio::spawn(svc.clone().oneshot(post(JOB, 8)));
    settle().await;
    let waiting9 = tokio::spawn(svc.clone().oneshot(post(JOB, 9)));
    settle().await;
    // 8 learns it is superseded (now or when 7 finishes), and never runs.
    app.release.notify_one();
    assert_eq!(slow7.await.unwrap().unwrap().status(), 201);
    Answer::of(waiting8.await.unwrap().unwrap())
        .await
        .problem(409, "urn:fence:stale-token");
    assert_eq!(waiting9.await.unwrap().unwrap().status(), 201);
    assert_eq!(
        app.log(),
        [
            "start 7 /hold",
            "finish 7 /hold",
            "start 9 /charge",
            "finish 9 /charge"
        ]
    );
}

/// Newer token first (contract v2, section 3): token 8 raises `highest` durably the moment
/// it arrives, before it waits for the older request in flight. Giving up on that wait (503
/// drain-timeout) leaves `highest` raised: the old holder cannot start anything new.
#[tokio::test(start_paused = true)]
async fn drain_timeout_gets_503_and_keeps_highest_raised() {
    let (app, _started) = App::new();
    let store = Arc::new(MemoryStore::new());
    let svc = FenceLayer::from_arc(store.clone())
        .drain_timeout(Duration::from_millis(100))
        .layer(app.clone());

    let _forever7 = tokio::spawn(svc.clone().oneshot(post_to("/forever", JOB, 7)));
    settle().await;
    assert_eq!(app.log(), ["start 7 /forever"]);

    let start = tokio::time::Instant::now();
    let eight = tokio::spawn(send_owned(svc.clone(), post(JOB, 8)));
    settle().await;
    // While 8 waits for the old request, 8 is durable and 7 is stale already.
    assert_eq!(
        store.highest(&job(JOB)).await.unwrap(),
        Generation::new(8),
        "raised before the wait"
    );
    send(&svc, post(JOB, 7))
        .await
        .problem(409, "urn:fence:stale-token");
    let answer = eight.await.unwrap();
    let waited = start.elapsed();
    let p = answer.problem(503, "urn:fence:drain-timeout");
    assert_eq!((p.job, p.token), (Some(job(JOB)), Some(8)));
    answer.retry_after();
    assert!(
        waited >= Duration::from_millis(100) && waited < Duration::from_millis(200),
        "waited {waited:?}"
    );
    assert_eq!(app.log(), ["start 7 /forever"], "token 8 was not passed on");

    // After the timeout, highest stays 8: the old holder's new requests stay out...
    send(&svc, post(JOB, 7))
        .await
        .problem(409, "urn:fence:stale-token");
    // ...and token 8 waits again rather than slipping past the running request.
    send(&svc, post(JOB, 8))
        .await
        .problem(503, "urn:fence:drain-timeout");
    assert_eq!(app.log(), ["start 7 /forever"]);
}

/// A client that goes away while its bump is being written (a SledStore commit takes a disk
/// flush, so the window is real) must not leave the job's gate "bumping" forever.
#[tokio::test(start_paused = true)]
async fn a_cancelled_bump_does_not_wedge_the_job() {
    let (app, _started) = App::new();
    let store = Arc::new(FlakyStore::default());
    let svc = FenceLayer::from_arc(store.clone())
        .drain_timeout(Duration::from_secs(1))
        .layer(app.clone());
    assert_eq!(send(&svc, post(JOB, 5)).await.status, 201);

    store.hang_observe.store(true, Ordering::SeqCst);
    let cancelled = tokio::spawn(svc.clone().oneshot(post(JOB, 6)));
    settle().await; // now inside the store's observe
    cancelled.abort();
    assert!(cancelled.await.unwrap_err().is_cancelled());
    // The write completes if anyone still waits for it (a bump that runs on after its
    // client left is fine too); either way the gate must be usable again.
    store.hang_observe.store(false, Ordering::SeqCst);
    store.release.notify_waiters();

    let retry = send(&svc, post(JOB, 6)).await;
    assert_eq!(
        retry.status,
        201,
        "token 6 after a cancelled bump: {} {}",
        retry.status,
        retry.text()
    );
}

// ---------------------------------------------------------------------------------------
// 5. Randomized interleavings
// ---------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Start,
    Finish,
}

#[derive(Debug, Clone, Copy)]
struct Event {
    id: usize,
    token: u64,
    kind: Kind,
    at: tokio::time::Instant,
}

/// A request's status and, for a problem, its type.
type Outcome = (StatusCode, Option<String>);

/// Requests reaching the layer (`true`) and getting their answers (`false`), by request id.
type Timeline = Vec<(usize, bool)>;

/// One run: requests `(generation index, arrival ms, handler ms)` against a fresh layer on a
/// paused current-thread runtime. Returns the inner service's events in order, the timeline
/// of arrivals and answers, and each request's status and problem type.
fn interleave(generations: u64, plan: &[(u64, u64, u64)]) -> (Vec<Event>, Timeline, Vec<Outcome>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async {
        let events: Arc<Mutex<Vec<Event>>> = Arc::default();
        let timeline: Arc<Mutex<Timeline>> = Arc::default();
        let durations: Arc<Vec<u64>> = Arc::new(plan.iter().map(|p| p.2).collect());
        let inner = {
            let events = events.clone();
            tower::service_fn(move |req: Request<RequestBody<String>>| {
                let id: usize = req.headers()["x-id"].to_str().unwrap().parse().unwrap();
                let token = req
                    .extensions()
                    .get::<Fenced>()
                    .expect("fenced")
                    .token
                    .get();
                let start = Event {
                    id,
                    token,
                    kind: Kind::Start,
                    at: tokio::time::Instant::now(),
                };
                events.lock().unwrap().push(start);
                let (events, ms) = (events.clone(), durations[id]);
                async move {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    let finish = Event {
                        id,
                        token,
                        kind: Kind::Finish,
                        at: tokio::time::Instant::now(),
                    };
                    events.lock().unwrap().push(finish);
                    Ok::<_, Infallible>(Response::new(String::new()))
                }
            })
        };
        let svc = FenceLayer::new(MemoryStore::new()).layer(inner);
        let mut tasks = Vec::new();
        for (id, &(generation, arrive, _)) in plan.iter().enumerate() {
            let (svc, timeline) = (svc.clone(), timeline.clone());
            let req = with_header(
                post(JOB, 1 + generation % generations),
                "x-id",
                &id.to_string(),
            );
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(arrive)).await;
                timeline.lock().unwrap().push((id, true));
                let response = svc.oneshot(req).await.unwrap();
                timeline.lock().unwrap().push((id, false));
                let answer = Answer::of(response).await;
                let kind = (answer.status != StatusCode::OK)
                    .then(|| {
                        axum::Json::<Problem>::from_bytes(&answer.body)
                            .map(|p| p.0.kind.uri().to_owned())
                    })
                    .map(|r| r.unwrap_or_else(|e| format!("not a problem: {e}")));
                (answer.status, kind)
            }));
        }
        let mut answers = Vec::new();
        for task in tasks {
            answers.push(task.await.unwrap());
        }
        let events = events.lock().unwrap().clone();
        let timeline = timeline.lock().unwrap().clone();
        (events, timeline, answers)
    })
}

/// The history of one run against the rules of section 3.
fn check_history(
    generations: u64,
    plan: &[(u64, u64, u64)],
    events: &[Event],
    timeline: &[(usize, bool)],
    answers: &[Outcome],
) -> Result<(), String> {
    let token_of = |id: usize| 1 + plan[id].0 % generations;
    let mut newest_started = 0;
    let mut running: HashMap<usize, u64> = HashMap::new();
    for pair in events.windows(2) {
        if pair[1].at < pair[0].at {
            return Err(format!("events out of time order: {pair:?}"));
        }
    }
    for e in events {
        match e.kind {
            Kind::Start => {
                if e.token < newest_started {
                    return Err(format!(
                        "{e:?} started after token {newest_started} had started"
                    ));
                }
                if let Some((id, t)) = running.iter().find(|(_, t)| **t < e.token) {
                    return Err(format!(
                        "{e:?} started while request {id} with token {t} was running"
                    ));
                }
                newest_started = e.token;
                running.insert(e.id, e.token);
            }
            Kind::Finish => {
                running.remove(&e.id);
            }
        }
    }
    let max_token = (0..plan.len()).map(token_of).max().unwrap_or(0);
    for (id, (status, kind)) in answers.iter().enumerate() {
        let token = token_of(id);
        let ran = events.iter().any(|e| e.id == id && e.kind == Kind::Start);
        match (status.as_u16(), kind.as_deref()) {
            (200, None) if ran => {}
            (409, Some("urn:fence:stale-token")) if !ran => {
                // Stale only if a newer token arrived before it was answered.
                let answered = timeline
                    .iter()
                    .position(|e| *e == (id, false))
                    .expect("answered");
                let newer = |(a, arrived): &(usize, bool)| *arrived && token_of(*a) > token;
                if !timeline[..answered].iter().any(newer) {
                    return Err(format!(
                        "request {id} (token {token}) got 409 but no newer token had arrived"
                    ));
                }
                if token == max_token {
                    return Err(format!(
                        "request {id} carries the newest token {token} but got 409"
                    ));
                }
            }
            other => {
                return Err(format!(
                    "request {id} (token {token}, ran {ran}) answered {other:?}"
                ));
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, failure_persistence: None, ..ProptestConfig::default() })]

    /// No older token starts after a newer one started, and no newer token starts while an
    /// older one runs, whatever the arrival order and handler durations.
    #[test]
    fn randomized_interleavings_keep_generations_ordered(
        generations in 2u64..=3,
        plan in prop::collection::vec((0u64..3, 0u64..30, 0u64..30), 2..10),
    ) {
        let (events, timeline, answers) = interleave(generations, &plan);
        if let Err(e) = check_history(generations, &plan, &events, &timeline, &answers) {
            prop_assert!(false, "{e}\nplan {plan:?}\nevents {events:#?}\ntimeline {timeline:?}\nanswers {answers:?}");
        }
    }
}

/// The checker itself rejects the histories it must reject.
#[test]
fn the_history_checker_catches_violations() {
    let at = tokio::time::Instant::now();
    let ev = |id, token, kind| Event {
        id,
        token,
        kind,
        at,
    };
    let plan = [(0, 0, 0), (1, 0, 0)];
    let ok = [(StatusCode::OK, None), (StatusCode::OK, None)];
    let older_after_newer = [
        ev(1, 2, Kind::Start),
        ev(1, 2, Kind::Finish),
        ev(0, 1, Kind::Start),
        ev(0, 1, Kind::Finish),
    ];
    let both = [(0, true), (1, true), (0, false), (1, false)];
    assert!(check_history(2, &plan, &older_after_newer, &both, &ok).is_err());
    let overlap = [
        ev(0, 1, Kind::Start),
        ev(1, 2, Kind::Start),
        ev(0, 1, Kind::Finish),
        ev(1, 2, Kind::Finish),
    ];
    assert!(check_history(2, &plan, &overlap, &both, &ok).is_err());
    let fine = [
        ev(0, 1, Kind::Start),
        ev(0, 1, Kind::Finish),
        ev(1, 2, Kind::Start),
        ev(1, 2, Kind::Finish),
    ];
    assert!(check_history(2, &plan, &fine, &both, &ok).is_ok());
    let stale = [
        (
            StatusCode::CONFLICT,
            Some("urn:fence:stale-token".to_owned()),
        ),
        (StatusCode::OK, None),
    ];
    // Token 2 arrived before token 1 was answered: a justified 409.
    assert!(check_history(2, &plan, &fine[2..], &both, &stale).is_ok());
    // Token 1 was answered 409 before any newer token arrived.
    let answered_first = [(0, true), (0, false), (1, true), (1, false)];
    assert!(check_history(2, &plan, &fine[2..], &answered_first, &stale).is_err());
    // The newest token is never stale.
    let newest_stale = [(StatusCode::OK, None), stale[0].clone()];
    assert!(check_history(2, &plan, &fine[..2], &both, &newest_stale).is_err());
}

// ---------------------------------------------------------------------------------------
// 6. Restart with SledStore
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn sled_restart_keeps_highest_and_idempotency_records() {
    let dir = tempfile::tempdir().unwrap();
    let first_body = {
        let (app, _started) = App::new();
        let store = SledStore::open(dir.path()).expect("open sled");
        let layer = FenceLayer::new(store);
        let svc = layer.layer(app.clone());
        assert_eq!(send(&svc, post(JOB, 41)).await.status, 201);
        let first = send(&svc, keyed(JOB, 41, "k-1", "pay 5")).await;
        assert_eq!(first.status, 201);
        send(&svc, post(JOB, 40))
            .await
            .problem(409, "urn:fence:stale-token");
        drop(svc);
        drop(layer); // the last holders of the store: sled's file lock is released
        first.body
    };

    let store = SledStore::open(dir.path())
        .unwrap_or_else(|e| panic!("sled did not reopen after the layer was dropped: {e:?}"));
    let (app, _started) = App::new();
    let svc = FenceLayer::new(store).layer(app.clone());
    let p = send(&svc, post(JOB, 40))
        .await
        .problem(409, "urn:fence:stale-token");
    assert_eq!((p.token, p.highest), (Some(40), Some(41)));
    assert_eq!(send(&svc, post(JOB, 41)).await.status, 201);
    let replay = send(&svc, keyed(JOB, 41, "k-1", "pay 5")).await;
    assert_eq!(
        (replay.status, replay.replayed()),
        (StatusCode::CREATED, Some("true"))
    );
    assert_eq!(replay.body, first_body);
    assert_eq!(
        replay.headers.get_all("x-multi").iter().collect::<Vec<_>>(),
        ["a", "b"]
    );
    assert_eq!(app.calls(), 1, "the replay ran the inner service");
}

// ---------------------------------------------------------------------------------------
// 7. Idempotency
// ---------------------------------------------------------------------------------------

/// docs/protocol.md, "What a stored answer holds, and who is given it": a stored answer keeps
/// every header, `Set-Cookie` included, and is replayed to any request with the same job,
/// key, method, path and body, whatever its credentials or `Host`: the second caller is
/// given the first caller's cookie, and the service runs once.
#[tokio::test]
async fn a_replay_gives_the_first_callers_set_cookie_to_whoever_sends_the_same_request() {
    let calls = Arc::new(AtomicUsize::new(0));
    let svc = FenceLayer::new(MemoryStore::new()).layer(tower::service_fn({
        let calls = calls.clone();
        move |req: Request<RequestBody<String>>| {
            let n = calls.fetch_add(1, Ordering::SeqCst);
            let host = req.headers().get("host").cloned();
            async move {
                let mut answer = Response::new(format!("run {n}"));
                *answer.status_mut() = StatusCode::CREATED;
                answer.headers_mut().insert(
                    "set-cookie",
                    HeaderValue::from_str(&format!("s=for-{host:?}")).unwrap(),
                );
                Ok::<_, Infallible>(answer)
            }
        }
    }));
    let from = |host: &str, credentials: &str| {
        let req = with_header(keyed(JOB, 5, "k-cookie", "{}"), "host", host);
        with_header(req, "authorization", credentials)
    };
    let first = send(&svc, from("a.example", "Bearer alice")).await;
    assert_eq!(first.status, 201);
    let cookie = first.headers["set-cookie"].clone();
    let other = send(&svc, from("b.example", "Bearer bob")).await;
    assert_eq!(other.replayed(), Some("true"));
    assert_eq!(
        other.headers["set-cookie"], cookie,
        "the first caller's cookie"
    );
    assert_eq!(other.body, first.body);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn duplicate_key_replays_byte_for_byte_and_runs_once() {
    let (app, _started) = App::new();
    let svc = FenceLayer::new(MemoryStore::new()).layer(app.clone());
    let first = send(&svc, keyed(JOB, 5, "k-1", r#"{"amount":5}"#)).await;
    assert_eq!(first.status, 201);
    assert_eq!(first.replayed(), None, "a first run claims to be a replay");
    assert_eq!(first.text(), r#"run 1 POST /charge {"amount":5}"#);

    for _ in 0..2 {
        let again = send(&svc, keyed(JOB, 5, "k-1", r#"{"amount":5}"#)).await;
        assert_eq!(again.status, first.status);
        assert_eq!(again.body, first.body);
        assert_eq!(again.replayed(), Some("true"));
        assert_eq!(
            again.header_list("idempotent-replayed"),
            first.header_list("idempotent-replayed")
        );
    }
    assert_eq!(app.calls(), 1);
    // A newer token of the same job replays the same record.
    assert_eq!(
        send(&svc, keyed(JOB, 6, "k-1", r#"{"amount":5}"#))
            .await
            .replayed(),
        Some("true")
    );
    assert_eq!(app.calls(), 1);
}

#[tokio::test]
async fn concurrent_duplicate_gets_409_in_flight() {
    let (app, mut started) = App::new();
    let svc = FenceLayer::new(MemoryStore::new()).layer(app.clone());
    let first = tokio::spawn(svc.clone().oneshot(keyed_to("/hold", JOB, 5, "k", "x")));
    assert_eq!(started_within(&mut started).await, "5 /hold");

    let dup = send(&svc, keyed_to("/hold", JOB, 5, "k", "x")).await;
    let p = dup.problem(409, "urn:fence:idempotency-in-flight");
    assert_eq!(p.job, Some(job(JOB)));
    dup.retry_after();
    assert_eq!(app.calls(), 1);

    app.release.notify_one();
    let first = Answer::of(first.await.unwrap().unwrap()).await;
    assert_eq!(first.status, 201);
    let replay = send(&svc, keyed_to("/hold", JOB, 5, "k", "x")).await;
    assert_eq!(
        (replay.replayed(), &replay.body),
        (Some("true"), &first.body)
    );
    assert_eq!(app.calls(), 1);
}

#[tokio::test]
async fn same_key_with_a_different_request_gets_422() {
    let (app, _started) = App::new();
    let svc = FenceLayer::new(MemoryStore::new()).layer(app.clone());
    assert_eq!(send(&svc, keyed(JOB, 5, "k", "pay 5")).await.status, 201);
    send(&svc, keyed(JOB, 5, "k", "pay 6"))
        .await
        .problem(422, "urn:fence:idempotency-key-mismatch");
    send(&svc, keyed_to("/refund", JOB, 5, "k", "pay 5"))
        .await
        .problem(422, "urn:fence:idempotency-key-mismatch");
    let mut put = keyed(JOB, 5, "k", "pay 5");
    *put.method_mut() = Method::PUT;
    send(&svc, put)
        .await
        .problem(422, "urn:fence:idempotency-key-mismatch");
    assert_eq!(app.calls(), 1);
}

#[tokio::test]
async fn server_errors_are_forgotten_and_client_errors_stored() {
    let (app, _started) = App::new();
    let svc = FenceLayer::new(MemoryStore::new()).layer(app.clone());
    let failing = || with_header(keyed(JOB, 5, "k", "body"), "x-status", "503");
    let first = send(&svc, failing()).await;
    assert_eq!(
        (first.status, first.replayed()),
        (StatusCode::SERVICE_UNAVAILABLE, None)
    );
    let second = send(&svc, failing()).await;
    assert_eq!(
        (second.status, second.replayed()),
        (StatusCode::SERVICE_UNAVAILABLE, None)
    );
    assert_eq!(app.calls(), 2, "a 5xx was replayed instead of run again");
    // The retry that succeeds is stored (x-status is not part of the fingerprint).
    assert_eq!(send(&svc, keyed(JOB, 5, "k", "body")).await.status, 201);
    assert_eq!(
        send(&svc, keyed(JOB, 5, "k", "body")).await.replayed(),
        Some("true")
    );
    assert_eq!(app.calls(), 3);

    // 4xx is stored by default.
    let not_found = send(
        &svc,
        with_header(keyed(JOB, 5, "k-404", ""), "x-status", "404"),
    )
    .await;
    assert_eq!(not_found.status, 404);
    let replay = send(
        &svc,
        with_header(keyed(JOB, 5, "k-404", ""), "x-status", "200"),
    )
    .await;
    assert_eq!(
        (replay.status, replay.replayed()),
        (StatusCode::NOT_FOUND, Some("true"))
    );
    assert_eq!(app.calls(), 4);
}

/// A redirect after a write (303 See Other: post, redirect, get) says the write was done:
/// stored and replayed, the step not run again. It was forgotten, and every retry of its key
/// ran the step once more. 307 and 308 ask for the same request elsewhere, followed with the
/// same key: forgotten, or the follow-up to the other path would be a key mismatch (422).
#[tokio::test]
async fn a_redirect_after_a_write_is_stored() {
    let (app, _started) = App::new();
    let svc = FenceLayer::new(MemoryStore::new()).layer(app.clone());
    // (status, stored): a stored one is replayed to the retry, a forgotten one runs again.
    let cases = [
        ("303", true),
        ("302", true),
        ("301", true),
        ("307", false),
        ("308", false),
    ];
    let mut calls = 0;
    for (status, stored) in cases {
        let key = format!("k-{status}");
        let first = send(
            &svc,
            with_header(keyed(JOB, 5, &key, "body"), "x-status", status),
        )
        .await;
        assert_eq!(first.status.as_str(), status);
        let retry = send(&svc, keyed(JOB, 5, &key, "body")).await;
        calls += if stored { 1 } else { 2 };
        let expected = if stored {
            (status, Some("true"))
        } else {
            ("201", None)
        };
        assert_eq!(
            (retry.status.as_str(), retry.replayed()),
            expected,
            "a {status}: stored {stored}"
        );
        assert_eq!(app.calls(), calls);
    }
}

/// 408, 425 and 429 ask for the request again: forgotten, not replayed to every retry for
/// the whole retention (a rate limit's 429 would otherwise block its key for 24 h).
#[tokio::test]
async fn statuses_that_ask_for_a_retry_are_forgotten() {
    let (app, _started) = App::new();
    let svc = FenceLayer::new(MemoryStore::new()).layer(app.clone());
    for (n, status) in ["429", "408", "425"].into_iter().enumerate() {
        let key = format!("k-{status}");
        let limited = send(
            &svc,
            with_header(keyed(JOB, 5, &key, "body"), "x-status", status),
        )
        .await;
        assert_eq!(
            (limited.status.as_str(), limited.replayed()),
            (status, None)
        );
        let retry = send(&svc, keyed(JOB, 5, &key, "body")).await;
        assert_eq!(
            (retry.status, retry.replayed()),
            (StatusCode::CREATED, None),
            "a {status} was replayed instead of run again"
        );
        assert_eq!(app.calls(), 2 * n + 2);
    }
}

#[tokio::test]
async fn quoted_and_bare_keys_are_the_same_key() {
    let (app, _started) = App::new();
    let svc = FenceLayer::new(MemoryStore::new()).layer(app.clone());
    let first = send(&svc, keyed(JOB, 5, "\"abc\"", "b")).await;
    assert_eq!(
        (first.status, first.replayed()),
        (StatusCode::CREATED, None)
    );
    let bare = send(&svc, keyed(JOB, 5, "abc", "b")).await;
    assert_eq!((bare.replayed(), &bare.body), (Some("true"), &first.body));
    assert_eq!(app.calls(), 1);
}

#[tokio::test]
async fn the_same_key_under_two_jobs_is_two_records() {
    let (app, _started) = App::new();
    let svc = FenceLayer::new(MemoryStore::new()).layer(app.clone());
    let a = send(&svc, keyed("job-a", 1, "k", "same")).await;
    let b = send(&svc, keyed("job-b", 1, "k", "same")).await;
    assert_eq!((a.replayed(), b.replayed()), (None, None));
    assert_eq!(app.calls(), 2);
    assert_eq!(
        send(&svc, keyed("job-a", 1, "k", "same")).await.body,
        a.body
    );
    assert_eq!(
        send(&svc, keyed("job-b", 1, "k", "same")).await.body,
        b.body
    );
    assert_ne!(a.body, b.body);
    assert_eq!(app.calls(), 2);
}

#[tokio::test]
async fn a_too_large_response_passes_whole_but_cannot_be_replayed() {
    let (app, _started) = App::new();
    let svc = FenceLayer::new(MemoryStore::new())
        .idempotency(IdempotencyConfig::default().max_response_body(16))
        .layer(app.clone());
    let big = || with_header(keyed(JOB, 5, "k", "body"), "x-size", "100");
    let first = send(&svc, big()).await;
    assert_eq!(first.status, 201);
    assert_eq!(first.body.len(), 100);
    assert!(
        first.text().starts_with("run 1 POST /charge body....."),
        "{}",
        first.text()
    );
    let retry = send(&svc, big()).await;
    let p = retry.problem(409, "urn:fence:idempotency-not-replayable");
    assert_eq!(p.job, Some(job(JOB)));
    assert_eq!(app.calls(), 1, "a non-replayable request ran twice");
}

/// The in-flight timeout is measured on the system wall clock inside the store, not on tokio
/// time, so this one test uses a short real timeout and a real sleep.
#[tokio::test]
async fn a_crashed_in_flight_record_blocks_the_key_until_the_in_flight_timeout() {
    let (app, mut started) = App::new();
    let timeout = Duration::from_millis(200);
    // A record is never given up sooner than its request may run (body deadline, longest
    // request, the begin's store timeout, hold): all four short here, so the 200 ms is what
    // counts.
    let svc = FenceLayer::new(MemoryStore::new())
        .body_timeout(Duration::from_millis(100))
        .longest_request(Duration::ZERO)
        .unknown_outcome_hold(Duration::ZERO)
        .idempotency(
            IdempotencyConfig::default()
                .in_flight_timeout(timeout)
                .store_timeout(Duration::from_millis(50)),
        )
        .layer(app.clone());

    // The response future is dropped while the inner service is running.
    let crashed = tokio::spawn(svc.clone().oneshot(keyed_to("/hold", JOB, 5, "k", "x")));
    assert_eq!(started_within(&mut started).await, "5 /hold");
    crashed.abort();
    assert!(crashed.await.unwrap_err().is_cancelled());

    let blocked = send(&svc, keyed_to("/hold", JOB, 5, "k", "x")).await;
    blocked.problem(409, "urn:fence:idempotency-in-flight");
    blocked.retry_after();
    assert_eq!(app.calls(), 1);

    tokio::time::sleep(timeout + Duration::from_millis(100)).await; // real time: see above
    app.release.notify_one(); // lets the next held request through (a stored permit)
    let retry = send(&svc, keyed_to("/hold", JOB, 5, "k", "x")).await;
    assert_eq!(
        (retry.status, retry.replayed()),
        (StatusCode::CREATED, None),
        "the key did not become usable again: {}",
        retry.text()
    );
    assert_eq!(app.calls(), 2);
    let replay = send(&svc, keyed_to("/hold", JOB, 5, "k", "x")).await;
    assert_eq!(
        (replay.replayed(), &replay.body),
        (Some("true"), &retry.body)
    );
    assert_eq!(app.calls(), 2);
}

#[tokio::test]
async fn a_keyed_body_above_the_fingerprint_limit_gets_413_and_never_runs() {
    let (app, _started) = App::new();
    let svc = FenceLayer::new(MemoryStore::new())
        .idempotency(IdempotencyConfig::default().max_request_body(8))
        .layer(app.clone());
    let big = send(&svc, keyed(JOB, 1, "k", "123456789")).await;
    let problem = big.problem(413, "urn:fence:payload-too-large");
    assert!(problem.detail.contains("8 bytes"), "{}", problem.detail);
    assert_eq!(app.calls(), 0, "a refused body reached the service");
    // The refusal left no record: the same key with a body within the limit runs.
    assert_eq!(send(&svc, keyed(JOB, 1, "k", "12345678")).await.status, 201);
    assert_eq!(app.calls(), 1);
}

/// A stale token with a key is told it is stale (409, stop) before its body is read, not that
/// the body is too large (413, send a smaller one) or that the buffers are full (503, retry).
#[tokio::test]
async fn a_stale_keyed_request_gets_409_before_its_body_is_judged() {
    let (app, _started) = App::new();
    let svc = FenceLayer::new(MemoryStore::new())
        .idempotency(IdempotencyConfig::default().max_request_body(8))
        .layer(app.clone());
    assert_eq!(send(&svc, post(JOB, 5)).await.status, 201);
    let big = send(&svc, keyed(JOB, 4, "k", "123456789")).await;
    let problem = big.problem(409, "urn:fence:stale-token");
    assert!(
        problem.detail.contains("below generation 5"),
        "{}",
        problem.detail
    );
    // The current token with the same body: 413, as before.
    send(&svc, keyed(JOB, 5, "k", "123456789"))
        .await
        .problem(413, "urn:fence:payload-too-large");
    // Buffers too small for the body: a stale token is still told to stop, not to retry.
    let tight = FenceLayer::new(MemoryStore::new())
        .idempotency(IdempotencyConfig::default())
        .max_buffered_bytes(4)
        .layer(app.clone());
    assert_eq!(send(&tight, post(JOB, 5)).await.status, 201);
    send(&tight, keyed(JOB, 4, "k", "123456789"))
        .await
        .problem(409, "urn:fence:stale-token");
    send(&tight, keyed(JOB, 5, "k", "123456789"))
        .await
        .problem(503, "urn:fence:overloaded");
    assert_eq!(app.calls(), 2, "a refused request reached the service");
}

/// The service answered, then its body broke off: it acted, so a retry with the key must
/// not run it again (409 not-replayable, the service called once).
#[tokio::test]
async fn a_response_that_breaks_off_is_not_run_again_on_retry() {
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let svc = FenceLayer::new(MemoryStore::new()).layer(tower::service_fn(
        move |_req: Request<RequestBody<String>>| {
            counted.fetch_add(1, Ordering::SeqCst);
            async {
                Ok::<_, Infallible>(Response::new(Partial::fails_after(
                    b"part",
                    std::io::Error::other("the upstream went away"),
                )))
            }
        },
    ));
    send(&svc, keyed(JOB, 1, "k", "x"))
        .await
        .problem(500, "urn:fence:internal");
    send(&svc, keyed(JOB, 1, "k", "x"))
        .await
        .problem(409, "urn:fence:idempotency-not-replayable");
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the effect ran twice");
}

/// A memory store that counts the idempotency records its sweeps purge, and takes
/// `begin_delay` to start a keyed request.
#[derive(Clone)]
struct Swept {
    inner: MemoryStore,
    purged: Arc<AtomicUsize>,
    begin_delay: Duration,
}

impl Swept {
    fn on(clock: &fence_storage::clock::ManualClock) -> Self {
        Self {
            inner: MemoryStore::with_clock(Arc::new(clock.clone())),
            purged: Arc::default(),
            begin_delay: Duration::ZERO,
        }
    }
}

impl GenerationStore for Swept {
    async fn observe(&self, job: &JobId, token: Generation) -> Result<Verdict, StoreError> {
        self.inner.observe(job, token).await
    }
    async fn highest(&self, job: &JobId) -> Result<Generation, StoreError> {
        self.inner.highest(job).await
    }
}

impl IdempotencyStore for Swept {
    async fn begin(&self, attempt: Attempt<'_>, d: Duration) -> Result<Begin, StoreError> {
        tokio::time::sleep(self.begin_delay).await;
        self.inner.begin(attempt, d).await
    }
    async fn finish(&self, attempt: Attempt<'_>, outcome: Finish) -> Result<(), StoreError> {
        self.inner.finish(attempt, outcome).await
    }
    async fn purge_expired(&self) -> Result<usize, StoreError> {
        let n = self.inner.purge_expired().await?;
        self.purged.fetch_add(n, Ordering::SeqCst);
        Ok(n)
    }
}

/// Moves both clocks together, a second at a time, `secs` times: the store's (it decides
/// expiry) and tokio's (it runs the sweeper).
async fn pass(clock: &fence_storage::clock::ManualClock, secs: u64) {
    for _ in 0..secs {
        clock.advance(Duration::from_secs(1));
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The defaults as documented: a stored response replays for 24 hours, then the key runs
/// again; the maintenance task sweeps the expired record within a minute, on its own; an
/// in-flight record whose request vanished blocks its key for 5 minutes, no longer.
#[tokio::test(start_paused = true)]
async fn by_default_records_replay_for_a_day_are_swept_and_in_flight_ones_give_up_after_5_minutes()
{
    let clock = fence_storage::clock::ManualClock::new(1_700_000_000_000);
    let store = Swept::on(&clock);
    let layer = FenceLayer::new(store.clone());
    let _upkeep = layer.spawn_maintenance();
    let (app, mut started) = App::new();
    let svc = layer.layer(app.clone());
    let pass = |secs: u64| pass(&clock, secs);
    // Every answer within 10 s (paused time): a request that waits on the service fails.
    let ask = |req| {
        let svc = svc.clone();
        async move {
            tokio::time::timeout(Duration::from_secs(10), send(&svc, req))
                .await
                .expect("an answer: the request did not reach a held service")
        }
    };

    pass(30).await; // off the sweeper's beat
    assert_eq!(ask(keyed(JOB, 1, "day", "x")).await.status, 201);
    pass(24 * 3600 - 5).await;
    let replay = ask(keyed(JOB, 1, "day", "x")).await;
    assert_eq!((replay.replayed(), app.calls()), (Some("true"), 1));
    assert_eq!(store.purged.load(Ordering::SeqCst), 0, "swept before 24 h");
    pass(5).await; // 24 h since the record was stored: expired
    let mut waited = 0;
    while store.purged.load(Ordering::SeqCst) == 0 {
        assert!(
            waited < 60,
            "no sweep within a minute of the record's expiry"
        );
        pass(1).await;
        waited += 1;
    }
    let again = ask(keyed(JOB, 1, "day", "x")).await;
    assert_eq!(
        (again.status, again.replayed(), app.calls()),
        (StatusCode::CREATED, None, 2)
    );

    // A request that vanished mid-flight: its key answers 409 until 5 minutes have passed.
    while started.try_recv().is_ok() {}
    let crashed = tokio::spawn(svc.clone().oneshot(keyed_to("/hold", JOB, 1, "gone", "x")));
    assert_eq!(started_within(&mut started).await, "1 /hold");
    crashed.abort();
    assert!(crashed.await.unwrap_err().is_cancelled());
    pass(299).await;
    ask(keyed_to("/hold", JOB, 1, "gone", "x"))
        .await
        .problem(409, "urn:fence:idempotency-in-flight");
    pass(2).await;
    app.release.notify_one();
    let retried = ask(keyed_to("/hold", JOB, 1, "gone", "x")).await;
    assert_eq!(
        (retried.status, retried.replayed()),
        (StatusCode::CREATED, None)
    );
}

// ---------------------------------------------------------------------------------------
// 8. Arbitrary header bytes
// ---------------------------------------------------------------------------------------

fn header_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        3 => prop::collection::vec(any::<u8>(), 0..12),
        2 => "[0-9]{0,22}".prop_map(String::into_bytes),
        3 => "[1-4]".prop_map(String::into_bytes),
        1 => "[-+ 0]?[0-9]{1,3}[ ]?".prop_map(String::into_bytes),
        2 => prop_oneof![Just("job-a"), Just("job-b")].prop_map(|s| s.as_bytes().to_vec()),
        2 => "[!-~]{0,12}".prop_map(String::into_bytes),
        1 => "[!-~]{250,260}".prop_map(String::into_bytes),
        2 => r#""([ -!#-\[\]-~]|\\"|\\\\){0,12}""#.prop_map(String::into_bytes),
        1 => Just(b"18446744073709551615".to_vec()),
        1 => Just(b"18446744073709551616".to_vec()),
        1 => prop::collection::vec(0x80u8..=0xff, 1..4),
        2 => "[0-4]{1,2}\\.[0-9]{0,3}\\.[A-Za-z0-9_-]{85,87}".prop_map(String::into_bytes),
        1 => "[1-4]\\.[0-9]{1,3}(\\.[!-~]{0,4})?".prop_map(String::into_bytes),
    ]
}

/// The contract's own rules, written independently of fence-core.
fn model_job(b: &[u8]) -> bool {
    (1..=256).contains(&b.len()) && b.iter().all(|c| (0x21..=0x7e).contains(c))
}

/// The generation a well-formed token names: `<generation>` or a v2 signed token
/// `<generation>.<expires_at_ms>.<86 base64url characters>` (contract section 6; without
/// verify keys a signed token counts by its generation and its expiry is ignored).
fn model_token(b: &[u8]) -> Option<u64> {
    let parts: Vec<&[u8]> = b.split(|&c| c == b'.').collect();
    match parts[..] {
        [generation] => model_generation(generation),
        [generation, expires, signature] => {
            let expires_ok = (1..=20).contains(&expires.len())
                && expires.iter().all(u8::is_ascii_digit)
                && (expires == b"0" || expires[0] != b'0')
                && std::str::from_utf8(expires).ok()?.parse::<u64>().is_ok();
            let signature_ok = signature.len() == 86
                && signature
                    .iter()
                    .all(|c| c.is_ascii_alphanumeric() || *c == b'-' || *c == b'_');
            if !(expires_ok && signature_ok) {
                return None;
            }
            model_generation(generation)
        }
        _ => None,
    }
}

fn model_generation(b: &[u8]) -> Option<u64> {
    let digits = (1..=20).contains(&b.len()) && b.iter().all(u8::is_ascii_digit) && b[0] != b'0';
    if !digits {
        return None;
    }
    std::str::from_utf8(b).ok()?.parse::<u64>().ok()
}

fn model_key(b: &[u8]) -> bool {
    if let Some(rest) = b.strip_prefix(b"\"") {
        let mut len = 0;
        let mut i = 0;
        loop {
            match rest.get(i) {
                None => return false,
                Some(b'"') => return i + 1 == rest.len() && (1..=255).contains(&len),
                Some(b'\\') => match rest.get(i + 1) {
                    Some(b'"' | b'\\') => i += 2,
                    _ => return false,
                },
                Some(0x20..=0x7e) => i += 1,
                Some(_) => return false,
            }
            len += 1;
        }
    }
    (1..=255).contains(&b.len()) && b.iter().all(|c| (0x21..=0x7e).contains(c))
}

#[test]
fn arbitrary_header_bytes_never_panic() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let inner = tower::service_fn(|_req: Request<RequestBody<String>>| async {
        Ok::<_, Infallible>(Response::new("ok".to_owned()))
    });
    let svc = rt.block_on(async { FenceLayer::new(MemoryStore::new()).layer(inner) });
    let highest: Mutex<HashMap<Vec<u8>, u64>> = Mutex::default();
    let config = proptest::test_runner::Config {
        cases: 3000,
        failure_persistence: None,
        ..Default::default()
    };
    let mut runner = proptest::test_runner::TestRunner::new(config);
    let strategy = (
        prop::option::of(header_bytes()),
        prop::option::of(header_bytes()),
        prop::option::of(header_bytes()),
        prop::option::of(0usize..3),
    );
    runner
        .run(&strategy, |(job, token, key, repeat)| {
            let headers: Vec<(&str, Vec<u8>)> = [
                ("x-fencing-job", job),
                ("x-fencing-token", token),
                ("idempotency-key", key),
            ]
            .into_iter()
            .filter_map(|(n, v)| Some((n, v?)))
            .collect();
            if headers
                .iter()
                .any(|(_, v)| HeaderValue::from_bytes(v).is_err())
            {
                return Ok(()); // not a header value at all: http rejects it before any service
            }
            let mut pairs: Vec<(&str, &[u8])> =
                headers.iter().map(|(n, v)| (*n, v.as_slice())).collect();
            let repeated = repeat.and_then(|i| pairs.get(i).copied());
            pairs.extend(repeated);
            let answer = rt.block_on(send(&svc, request(Method::POST, "/charge", &pairs, "")));
            let status = answer.status.as_u16();
            prop_assert!(
                [200, 400, 409, 428].contains(&status),
                "{status} for {pairs:?}: {}",
                answer.text()
            );

            // The model: well-formed (400), present (428), fence (409).
            let get = |name: &str| {
                headers
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| v.as_slice())
            };
            let (j, t, k) = (
                get("x-fencing-job"),
                get("x-fencing-token"),
                get("idempotency-key"),
            );
            let well_formed = repeated.is_none()
                && j.is_none_or(model_job)
                && t.is_none_or(|t| model_token(t).is_some())
                && k.is_none_or(model_key)
                && j.is_some() == t.is_some();
            let want = match (well_formed, j, t.and_then(model_token)) {
                (false, ..) => 400,
                (true, None, _) => 428,
                (true, Some(j), Some(t)) => {
                    let mut highest = highest.lock().unwrap();
                    let h = highest.entry(j.to_vec()).or_default();
                    if t < *h {
                        409
                    } else {
                        *h = t;
                        200
                    }
                }
                (true, Some(_), None) => unreachable!("well-formed implies a token"),
            };
            prop_assert_eq!(status, want, "for {:?}: {}", pairs, answer.text());
            let uri = match status {
                400 => Some("urn:fence:malformed-token"),
                409 => Some("urn:fence:stale-token"),
                428 => Some("urn:fence:missing-token"),
                _ => None,
            };
            if let Some(uri) = uri {
                answer.problem(status, uri);
            }
            Ok(())
        })
        .unwrap();
}

// ---------------------------------------------------------------------------------------
// 9. Under axum and hyper
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn axum_router_accepts_current_and_rejects_stale() {
    use axum::{Extension, Router, routing::post as route_post};

    async fn charge(Extension(fenced): Extension<Fenced>) -> String {
        format!("{} {}", fenced.job, fenced.token)
    }
    let router = Router::new()
        .route("/charge", route_post(charge))
        .layer(FenceLayer::new(MemoryStore::new()));
    let req = |t: u64| {
        Request::post("/charge")
            .header("x-fencing-job", JOB)
            .header("x-fencing-token", t)
            .body(axum::body::Body::empty())
            .unwrap()
    };
    let ok = Answer::of(router.clone().oneshot(req(8)).await.unwrap()).await;
    assert_eq!((ok.status, ok.text().as_str()), (StatusCode::OK, "job-1 8"));
    let stale = Answer::of(router.clone().oneshot(req(7)).await.unwrap()).await;
    let p = stale.problem(409, "urn:fence:stale-token");
    assert_eq!(p.highest, Some(8));
}

#[tokio::test]
async fn hyper_server_accepts_current_and_rejects_stale() {
    use http_body_util::Full;
    use hyper::body::Incoming;
    use hyper_util::{rt::TokioIo, service::TowerToHyperService};

    let calls = Arc::new(AtomicUsize::new(0));
    let inner = {
        let calls = calls.clone();
        tower::service_fn(move |req: Request<RequestBody<Incoming>>| {
            calls.fetch_add(1, Ordering::SeqCst);
            async move {
                let fenced = req.extensions().get::<Fenced>().cloned().expect("fenced");
                let body = req
                    .into_body()
                    .collect()
                    .await
                    .expect("request body")
                    .to_bytes();
                let text = format!(
                    "{} {} {}",
                    fenced.job,
                    fenced.token,
                    String::from_utf8_lossy(&body)
                );
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(text))))
            }
        })
    };
    let svc = FenceLayer::new(MemoryStore::new()).layer(inner);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let svc = TowerToHyperService::new(svc.clone());
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc),
            );
        }
    });

    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut client, conn) =
        hyper::client::conn::http1::handshake::<_, Full<Bytes>>(TokioIo::new(stream))
            .await
            .unwrap();
    let conn = tokio::spawn(conn);
    let req = |t: u64, body: &'static str| {
        Request::post(format!("http://{addr}/charge"))
            .header("x-fencing-job", JOB)
            .header("x-fencing-token", t)
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .unwrap()
    };
    let ok = Answer::of(client.send_request(req(8, "pay")).await.unwrap()).await;
    assert_eq!(
        (ok.status, ok.text().as_str()),
        (StatusCode::OK, "job-1 8 pay")
    );
    let stale = Answer::of(client.send_request(req(7, "pay")).await.unwrap()).await;
    let p = stale.problem(409, "urn:fence:stale-token");
    assert_eq!((p.token, p.highest), (Some(7), Some(8)));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    conn.abort();
    server.abort();
}

// ---------------------------------------------------------------------------------------
// run_to_completion: a dropped request stays in flight until its effect is over
// ---------------------------------------------------------------------------------------

/// With `run_to_completion`, a request whose caller went away still counts as in flight until
/// the inner service finished, so a newer token waits for it; without it, the inner call is
/// cancelled with the caller and a newer token goes at once.
#[tokio::test]
async fn run_to_completion_keeps_a_dropped_request_in_flight() {
    for detached in [true, false] {
        let log: Arc<Mutex<Vec<String>>> = Arc::default();
        let release = Arc::new(tokio::sync::Notify::new());
        let (started_tx, mut started_rx) = tokio::sync::mpsc::unbounded_channel::<u64>();
        let inner = {
            let (log, release) = (log.clone(), release.clone());
            tower::service_fn(move |req: http::Request<fence_sink::RequestBody<String>>| {
                let (log, release, started_tx) = (log.clone(), release.clone(), started_tx.clone());
                async move {
                    let token = req
                        .extensions()
                        .get::<fence_sink::Fenced>()
                        .unwrap()
                        .token
                        .get();
                    log.lock().unwrap().push(format!("start {token}"));
                    let _ = started_tx.send(token);
                    if token == 7 {
                        release.notified().await;
                    }
                    log.lock().unwrap().push(format!("end {token}"));
                    Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
                }
            })
        };
        let mut layer = FenceLayer::new(MemoryStore::new());
        if detached {
            layer = layer.run_to_completion();
        }
        let svc = tower::Layer::layer(&layer, inner);
        let request = |token: u64| {
            http::Request::post("/")
                .header("x-fencing-job", "detach")
                .header("x-fencing-token", token)
                .body(String::new())
                .unwrap()
        };
        let first = tokio::spawn(svc.clone().oneshot(request(7)));
        assert_eq!(started_rx.recv().await, Some(7));
        first.abort(); // the client went away
        let _ = first.await;
        let second = tokio::spawn(svc.clone().oneshot(request(8)));
        if detached {
            tokio::time::sleep(Duration::from_millis(100)).await;
            assert_eq!(
                *log.lock().unwrap(),
                ["start 7"],
                "8 waits while 7 still runs"
            );
            release.notify_one();
        }
        assert_eq!(second.await.unwrap().unwrap().status(), 200);
        let want: &[&str] = if detached {
            &["start 7", "end 7", "start 8", "end 8"]
        } else {
            &["start 7", "start 8", "end 8"]
        };
        assert_eq!(*log.lock().unwrap(), want, "detached: {detached}");
    }
}

/// Settings other than the defaults take effect: records kept 10 minutes and swept every
/// 10 s, only 2xx answers stored (a 4xx runs again on a retry), and a store that takes
/// longer than the idempotency store timeout to start a keyed request is a 503.
#[tokio::test(start_paused = true)]
async fn idempotency_settings_other_than_the_defaults_take_effect() {
    let clock = fence_storage::clock::ManualClock::new(1_700_000_000_000);
    let mut store = Swept::on(&clock);
    let config = IdempotencyConfig::default()
        .retention(Duration::from_secs(600))
        .sweep_every(Duration::from_secs(10))
        .store_statuses(|s| s.is_success())
        .store_timeout(Duration::from_millis(100));
    let layer = FenceLayer::new(store.clone()).idempotency(config.clone());
    let _upkeep = layer.spawn_maintenance();
    let (app, _started) = App::new();
    let svc = layer.layer(app.clone());
    let pass = |secs: u64| pass(&clock, secs);
    pass(35).await; // off the beat of both a 10 s and a 60 s sweeper
    assert_eq!(send(&svc, keyed(JOB, 1, "ten", "x")).await.status, 201);
    pass(595).await;
    let replay = send(&svc, keyed(JOB, 1, "ten", "x")).await;
    assert_eq!((replay.replayed(), app.calls()), (Some("true"), 1));
    pass(5).await; // 10 minutes since the record was stored: expired
    let mut waited = 0;
    while store.purged.load(Ordering::SeqCst) == 0 {
        assert!(waited < 11, "no sweep within 10 s of the record's expiry");
        pass(1).await;
        waited += 1;
    }
    let again = send(&svc, keyed(JOB, 1, "ten", "x")).await;
    assert_eq!((again.replayed(), app.calls()), (None, 2));

    let teapot = || with_header(keyed(JOB, 1, "tea", "x"), "x-status", "418");
    assert_eq!(send(&svc, teapot()).await.status, 418);
    let retried = send(&svc, teapot()).await;
    assert_eq!(
        (retried.status.as_u16(), retried.replayed(), app.calls()),
        (418, None, 4)
    );

    store.begin_delay = Duration::from_secs(1);
    let slow = FenceLayer::new(store)
        .idempotency(config)
        .layer(app.clone());
    send(&slow, keyed(JOB, 1, "slow", "x"))
        .await
        .problem(503, "urn:fence:store-unavailable");
    assert_eq!(app.calls(), 4, "nothing ran without its record");
}

/// The settings show in Debug (for a configuration dump at start-up); the status filter, a
/// closure, is left out.
#[test]
fn idempotency_settings_show_in_debug() {
    let config = IdempotencyConfig::default().retention(Duration::from_secs(7));
    let shown = format!("{config:?}");
    assert!(
        shown.starts_with("IdempotencyConfig {") && shown.contains("retention: 7s"),
        "{shown}"
    );
}
