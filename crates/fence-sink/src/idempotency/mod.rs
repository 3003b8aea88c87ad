//! `Idempotency-Key` handling: after the fence admits a request, per (job, key) the first
//! request runs and its response is stored; a duplicate gets the stored response replayed
//! byte for byte with `Idempotent-Replayed: true`.
//!
//! ```
//! use fence_sink::{FenceLayer, IdempotencyConfig, MemoryStore};
//! use std::time::Duration;
//!
//! let layer = FenceLayer::new(MemoryStore::new()).idempotency(
//!     IdempotencyConfig::default()
//!         .retention(Duration::from_secs(3600))
//!         .max_response_body(256 * 1024)
//!         .store_statuses(|s| s.is_success()),
//! );
//! # let _ = layer;
//! ```

pub(crate) mod record;

use std::{
    fmt,
    pin::Pin,
    sync::{Arc, Weak},
    time::Duration,
};

use bytes::{Bytes, BytesMut};
use fence_core::{
    JobId, Problem, ProblemType, headers::IDEMPOTENT_REPLAYED, headers::IdempotencyKey,
};
use http::{HeaderValue, Request, Response, StatusCode, request::Parts};
use http_body::Body;
use http_body_util::{BodyExt, Limited};
use tower_service::Service;

pub use self::record::{Fingerprint, StoredResponse};
use crate::{
    BoxError, IdempotencyStore,
    fence::{RequestBody, ResponseBody, gate::InFlight, reject},
    metrics::count,
    store::{Begin, Finish, StoreError},
};

/// Put into a response's extensions by a service that cannot tell whether its effect happened
/// (a proxy whose upstream timed out after the request was sent): the idempotency record then
/// stays in flight until its timeout instead of being forgotten like an ordinary 5xx, so a
/// retry meanwhile gets 409 rather than a second run.
#[derive(Debug, Clone, Copy, Default)]
pub struct OutcomeUnknown;

/// Which responses are stored for replay.
pub type StatusFilter = Arc<dyn Fn(StatusCode) -> bool + Send + Sync>;

/// How `Idempotency-Key` is handled.
#[derive(Clone)]
pub struct IdempotencyConfig {
    pub(crate) max_request_body: usize,
    pub(crate) max_response_body: usize,
    pub(crate) retention: Duration,
    pub(crate) in_flight_timeout: Duration,
    pub(crate) store_statuses: StatusFilter,
    pub(crate) sweep_every: Duration,
    pub(crate) store_timeout: Duration,
}

impl Default for IdempotencyConfig {
    /// Request bodies up to 1 MiB fingerprinted, response bodies up to 1 MiB stored, records
    /// kept 24 h, in-flight records given up after 5 minutes, 2xx and 4xx stored (5xx
    /// forgotten so a retry runs again), expired records swept every minute.
    fn default() -> Self {
        Self {
            max_request_body: 1 << 20,
            max_response_body: 1 << 20,
            retention: Duration::from_secs(24 * 3600),
            in_flight_timeout: Duration::from_secs(300),
            store_statuses: Arc::new(|s: StatusCode| s.is_success() || s.is_client_error()),
            sweep_every: Duration::from_secs(60),
            store_timeout: Duration::from_secs(5),
        }
    }
}

impl fmt::Debug for IdempotencyConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyConfig")
            .field("max_request_body", &self.max_request_body)
            .field("max_response_body", &self.max_response_body)
            .field("retention", &self.retention)
            .field("in_flight_timeout", &self.in_flight_timeout)
            .finish_non_exhaustive()
    }
}

impl IdempotencyConfig {
    /// Reads request bodies up to `bytes` to fingerprint them; a larger one gets 413.
    pub fn max_request_body(mut self, bytes: usize) -> Self {
        self.max_request_body = bytes;
        self
    }

    /// Stores response bodies up to `bytes`; a larger response is passed through and its
    /// record says it cannot be replayed (a retry gets 409).
    pub fn max_response_body(mut self, bytes: usize) -> Self {
        self.max_response_body = bytes;
        self
    }

    /// Keeps completed records this long.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// Gives up an in-flight record after this long (a crash mid-request leaves one), so the
    /// key becomes usable again.
    pub fn in_flight_timeout(mut self, timeout: Duration) -> Self {
        self.in_flight_timeout = timeout;
        self
    }

    /// Stores the responses whose status passes `filter`; others are forgotten, so a retry
    /// runs again.
    pub fn store_statuses(
        mut self,
        filter: impl Fn(StatusCode) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.store_statuses = Arc::new(filter);
        self
    }

    /// Gives the store this long per call before answering 503 (default 5 s).
    pub fn store_timeout(mut self, timeout: Duration) -> Self {
        self.store_timeout = timeout;
        self
    }

    /// Sweeps expired records this often.
    pub fn sweep_every(mut self, every: Duration) -> Self {
        self.sweep_every = every;
        self
    }
}

/// Starts the background task that deletes expired records; it ends when the store is dropped.
pub(crate) fn spawn_sweeper<St: IdempotencyStore>(store: &Arc<St>, every: Duration) {
    let weak: Weak<St> = Arc::downgrade(store);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every.max(Duration::from_millis(10)));
        tick.tick().await;
        loop {
            tick.tick().await;
            let Some(store) = weak.upgrade() else { return };
            match store.purge_expired().await {
                Ok(0) => {}
                Ok(n) => tracing::debug!(purged = n, "expired idempotency records deleted"),
                Err(e) => {
                    tracing::warn!(error = %crate::error_chain(&e), "sweeping idempotency records failed")
                }
            }
        }
    });
}

async fn timed<T>(
    limit: Duration,
    f: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout(limit, f)
        .await
        .map_err(|_| StoreError::Timeout(limit))?
}

/// Runs one admitted request that carries an idempotency key.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run<S, St, ReqB, ResB>(
    inner: &mut S,
    store: &St,
    config: &IdempotencyConfig,
    parts: Parts,
    body: ReqB,
    job: &JobId,
    key: &IdempotencyKey,
    guard: InFlight,
) -> Result<Response<ResponseBody<ResB>>, S::Error>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>>,
    ReqB: Body<Data = Bytes> + Send + 'static,
    ReqB::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
    St: IdempotencyStore,
{
    let retry = Some(Duration::from_secs(1));
    let bytes = match Limited::new(body, config.max_request_body).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            let detail = format!(
                "job {job}: the body of a request with Idempotency-Key {key} is above the {} bytes this destination fingerprints",
                config.max_request_body
            );
            return Ok(reject(
                Problem::new(ProblemType::PayloadTooLarge, detail).with_job(job.clone()),
                None,
            ));
        }
        Err(e) => {
            let detail = format!("job {job}: reading the request body failed: {e}");
            return Ok(reject(
                Problem::new(ProblemType::BadRequest, detail).with_job(job.clone()),
                None,
            ));
        }
    };
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let fingerprint = Fingerprint::of(&parts.method, path, &bytes);
    let begin = timed(
        config.store_timeout,
        store.begin(job, key, &fingerprint, config.in_flight_timeout),
    )
    .await;
    match begin {
        Err(e) => {
            count("store_error");
            let detail = format!(
                "job {job}: the idempotency store failed: {}",
                crate::error_chain(&e)
            );
            Ok(reject(
                Problem::new(ProblemType::StoreUnavailable, detail).with_job(job.clone()),
                retry,
            ))
        }
        Ok(Begin::Replay(stored)) => {
            count("replayed");
            let mut response = Response::new(ResponseBody::full(stored.body));
            *response.status_mut() = stored.status;
            *response.headers_mut() = stored.headers;
            response
                .headers_mut()
                .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
            Ok(response)
        }
        Ok(Begin::InFlight) => {
            count("in_flight_conflict");
            let detail = format!(
                "job {job}: a request with Idempotency-Key {key} is still in flight; retry when it has finished"
            );
            Ok(reject(
                Problem::new(ProblemType::IdempotencyInFlight, detail).with_job(job.clone()),
                retry,
            ))
        }
        Ok(Begin::Mismatch) => {
            count("mismatch");
            let detail = format!(
                "job {job}: Idempotency-Key {key} was already used for a request with a different method, path or body"
            );
            Ok(reject(
                Problem::new(ProblemType::IdempotencyKeyMismatch, detail).with_job(job.clone()),
                None,
            ))
        }
        Ok(Begin::NotReplayable) => {
            count("not_replayable");
            let detail = format!(
                "job {job}: the request with Idempotency-Key {key} already ran, but its response was too large to store, so it cannot be replayed"
            );
            Ok(reject(
                Problem::new(ProblemType::IdempotencyNotReplayable, detail).with_job(job.clone()),
                None,
            ))
        }
        Ok(Begin::Started) => {
            count("accepted");
            let result = inner
                .call(Request::from_parts(parts, RequestBody::buffered(bytes)))
                .await;
            let finish = |outcome| async {
                if let Err(e) = timed(
                    config.store_timeout,
                    store.finish(job, key, &fingerprint, outcome, config.retention),
                )
                .await
                {
                    // The in-flight record stays until its timeout: retries get 409, never a second run.
                    tracing::warn!(error = %crate::error_chain(&e), "completing an idempotency record failed");
                }
            };
            let response = match result {
                Err(e) => {
                    // Nobody knows whether the effect happened: the in-flight record stays until
                    // its timeout, so a retry meanwhile gets 409 rather than a second run.
                    return Err(e);
                }
                Ok(response) => response,
            };
            if response.extensions().get::<OutcomeUnknown>().is_some() {
                drop(guard);
                return Ok(response.map(ResponseBody::inner));
            }
            if !(config.store_statuses)(response.status()) {
                finish(Finish::Forget).await;
                drop(guard);
                return Ok(response.map(ResponseBody::inner));
            }
            let (head, body) = response.into_parts();
            let response = match capture(body, config.max_response_body).await {
                Captured::Whole(bytes) => {
                    let stored = StoredResponse {
                        status: head.status,
                        headers: head.headers.clone(),
                        body: bytes.clone(),
                    };
                    finish(Finish::Store(stored)).await;
                    Response::from_parts(head, ResponseBody::full(bytes))
                }
                Captured::TooLarge(prefix, trailers, rest) => {
                    finish(Finish::TooLarge).await;
                    Response::from_parts(head, ResponseBody::prefixed(prefix, trailers, rest))
                }
                Captured::Failed(e) => {
                    finish(Finish::Forget).await;
                    let detail = format!("job {job}: the service's response body failed: {e}");
                    reject(
                        Problem::new(ProblemType::Internal, detail).with_job(job.clone()),
                        None,
                    )
                }
            };
            drop(guard);
            Ok(response)
        }
    }
}

enum Captured<B> {
    Whole(Bytes),
    /// The prefix read, trailers if the body ended with them, and the rest of the body.
    TooLarge(Bytes, Option<http::HeaderMap>, Pin<Box<B>>),
    Failed(BoxError),
}

/// Reads a response body up to `limit` bytes: all of it, or what was read so far and the
/// rest of the body to stream on. A body with trailers is not stored (their order against
/// the data cannot be replayed faithfully by every client), but passed on whole.
async fn capture<B>(body: B, limit: usize) -> Captured<B>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let mut body = Box::pin(body);
    let mut buf = BytesMut::new();
    loop {
        match body.frame().await {
            None => return Captured::Whole(buf.freeze()),
            Some(Err(e)) => return Captured::Failed(e.into()),
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => {
                    buf.extend_from_slice(&data);
                    if buf.len() > limit {
                        return Captured::TooLarge(buf.freeze(), None, body);
                    }
                }
                Err(frame) => {
                    return Captured::TooLarge(buf.freeze(), frame.into_trailers().ok(), body);
                }
            },
        }
    }
}
