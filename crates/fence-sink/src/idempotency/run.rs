//! Runs one admitted request that carries an `Idempotency-Key`: begin, call, record.
//!
//! The steps: read the body (to fingerprint it), [`begin`](IdempotencyStore::begin) the
//! (job, key) record, and either answer from the record or call the inner service and
//! [`finish`](IdempotencyStore::finish) the record with its response. The body must arrive
//! by the request's deadline, and every byte held (the request, the captured response, a
//! replay) is taken from the layer's memory budget; the fence's guard stays with the caller.

use std::{future::Future, sync::Arc, time::Duration};

use bytes::{Bytes, BytesMut};
use fence_core::{
    JobId,
    headers::{IDEMPOTENT_REPLAYED, IdempotencyKey},
};
use fence_storage::BoxError;
use http::{HeaderMap, HeaderValue, Request, Response, request::Parts};
use http_body::Body;
use http_body_util::BodyExt;
use tokio::time::Instant;
use tower_service::Service;

use super::{
    IdempotencyConfig,
    capture::{Captured, capture},
    finish::{Finishing, OwnedAttempt, finish_again},
};
use crate::{
    OutcomeUnknown,
    body::{FenceBody, RequestBody, ResponseBody},
    budget::{Budget, Full, Reservation},
    metrics::count,
    reject::{self, RETRY, reject, starts_with_ignore_case},
    store::{Attempt, Begin, Fingerprint, Finish, IdempotencyStore, StoreError, StoredResponse},
};

/// One (job, key) and where its record lives.
pub(crate) struct Keyed<'a, St> {
    pub(crate) store: &'a Arc<St>,
    pub(crate) config: &'a IdempotencyConfig,
    pub(crate) job: &'a JobId,
    pub(crate) token: fence_core::FencingToken,
    pub(crate) key: &'a IdempotencyKey,
    /// The memory every clone of the layer holds for bodies, and its cap.
    pub(crate) budget: &'a Arc<Budget>,
    /// The client's address, when known: the bodies this request holds (its own, a replay,
    /// an answer kept) count against its share of the budget.
    pub(crate) peer: Option<std::net::IpAddr>,
    pub(crate) max_buffered: usize,
    /// When the request body must have arrived, and the limit that set it.
    pub(crate) deadline: Instant,
    pub(crate) body_timeout: Duration,
    /// This attempt's id (random, not 0): its in-flight record is its own.
    pub(crate) attempt: u64,
    /// See [`Attempt::settled_after`].
    pub(crate) settled_after: Duration,
    /// How long this attempt's in-flight record blocks its key: the layer's
    /// `Config::in_flight_timeout`.
    pub(crate) in_flight_for: Duration,
    /// Set once the service answered: from then on the request's future finishes in a task
    /// of its own if its caller goes away (see `Detachable::finishing_once`).
    pub(crate) committed: Option<&'a std::sync::atomic::AtomicBool>,
    /// The gRPC statuses that leave a call's outcome unknown (the layer's
    /// `unknown_outcome_grpc_statuses`).
    pub(crate) unknown_grpc: crate::GrpcStatuses,
}

/// A fresh attempt id: random, never 0 (which marks records from before ids were kept).
pub(crate) fn attempt_id() -> u64 {
    fastrand::u64(1..)
}

/// Why a request body was not read whole.
enum ReadFailure {
    TooLarge,
    Overloaded(Full),
    Body(BoxError),
}

type Answer<B> = Response<ResponseBody<B>>;

/// Put in the extensions of the answer to a call of whole messages (gRPC and its kin) that
/// streams on unkept (too large to keep, or slower than the body deadline): the service may
/// still be writing it, so the layer counts the request in flight until the answer ends, or
/// until this deadline (the answer's head plus the body deadline), then for the hold, as it
/// does for such a call without a key.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StreamsOn(pub(crate) Instant);

impl<St: IdempotencyStore> Keyed<'_, St> {
    /// Runs a request whose body [`read`](Self::read) has read once per (job, key): the
    /// first time through `inner`, later from the record.
    pub(crate) async fn run<S, ReqB, ResB>(
        &self,
        inner: &mut S,
        (parts, bytes, trailers, held): ReadRequest,
    ) -> Result<Answer<ResB>, S::Error>
    where
        S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>>,
        ReqB: FenceBody,
        ResB: FenceBody,
    {
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        let scope: Vec<Vec<&[u8]>> = self
            .config
            .scope_headers
            .iter()
            .map(|name| {
                parts
                    .headers
                    .get_all(name)
                    .iter()
                    .map(http::HeaderValue::as_bytes)
                    .collect()
            })
            .collect();
        let fingerprint = Fingerprint::scoped(&parts.method, path, &scope, &bytes);
        let messages = reject::carries_messages(&parts.headers);
        let held = match self.begin(&fingerprint, held).await {
            Ok(held) => held,
            Err(answer) => return Ok(answer),
        };
        // A new key past the records' cap: forgotten again, and refused before the service
        // runs (its outcome is known).
        if let Err(full) = super::cap::admit(self.config, self.held()) {
            let finishing = self.finish(&fingerprint, Finish::Forget).await;
            count("overloaded");
            let problem = super::cap::refused(self.job, self.config, &full);
            let retry = Some(self.config.sweep_every);
            return Ok(marked(reject(problem, retry), finishing));
        }
        count("accepted");
        let request = Request::from_parts(
            parts,
            RequestBody::buffered(bytes, trailers.map(|t| *t), held),
        );
        // An error from the service leaves unknown whether the effect happened: the
        // in-flight record stays until its timeout, so a retry meanwhile gets 409 rather
        // than a second run.
        let mut response = inner.call(request).await?;
        if self.unknown_grpc.in_answer(response.headers()) {
            // A call that ran out of time or was cancelled (a trailers-only answer): its
            // handler was dropped wherever it was, and what it had sent may still commit.
            response.extensions_mut().insert(OutcomeUnknown);
        }
        if let Some(committed) = self.committed {
            committed.store(true, std::sync::atomic::Ordering::Release);
        }
        Ok(self.record(&fingerprint, response, messages).await)
    }

    /// The request head and its whole body, under the memory budget, by the deadline; or
    /// the answer when the body cannot be had: 408 past the deadline, 413 over the
    /// fingerprinting limit, 503 over the budget, 400 when it fails. The service sees none
    /// of those requests.
    pub(crate) async fn read<ReqB, B>(
        &self,
        request: Request<ReqB>,
    ) -> Result<ReadRequest, Answer<B>>
    where
        ReqB: Body<Data = Bytes>,
        ReqB::Error: Into<BoxError>,
    {
        let (parts, body) = request.into_parts();
        let limit = self.config.max_request_body;
        let mut held = Reservation::of_peer(self.budget, self.peer);
        let mut buf = BytesMut::new();
        let mut trailers = None;
        let read = async {
            let mut body = std::pin::pin!(body);
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|e| ReadFailure::Body(e.into()))?;
                match frame.into_data() {
                    Ok(data) => {
                        if buf.len() + data.len() > limit {
                            return Err(ReadFailure::TooLarge);
                        }
                        held.take(data.len(), self.max_buffered)
                            .map_err(ReadFailure::Overloaded)?;
                        buf.extend_from_slice(&data);
                    }
                    // Trailers go on to the service as they came (less the fields the fence
                    // judges, see `RequestBody`); they are not part of the fingerprint.
                    Err(frame) => {
                        if let Ok(last) = frame.into_trailers() {
                            trailers = Some(Box::new(last));
                        }
                    }
                }
            }
            Ok(())
        };
        let failure = match tokio::time::timeout_at(self.deadline, read).await {
            Ok(Ok(())) => {
                // The headers the fingerprint covers are judged in the head only: a service
                // merging trailers into its headers must not read a value it never covered.
                if let Some(trailers) = trailers.as_mut() {
                    for name in &self.config.scope_headers {
                        trailers.remove(name);
                    }
                }
                return Ok((parts, buf.freeze(), trailers, held));
            }
            Ok(Err(failure)) => failure,
            Err(_) => {
                count("body_timeout");
                return Err(reject(
                    reject::body_timeout(self.job, self.token, self.body_timeout, false),
                    None,
                ));
            }
        };
        Err(match failure {
            ReadFailure::TooLarge => {
                count("too_large");
                reject(reject::body_too_large(self.job, self.key, limit), None)
            }
            ReadFailure::Overloaded(full) => {
                count("overloaded");
                reject(reject::overloaded(self.job, self.max_buffered, full), RETRY)
            }
            ReadFailure::Body(e) => {
                count("body_failed");
                reject(reject::request_body_failed(self.job, &e), None)
            }
        })
    }

    /// Begins the record: `Ok` with the request body's reservation `held` when the caller is
    /// to run the request, else the answer. A replay lets the request's body go before it
    /// takes the stored answer's bytes: the client holds the one or the other, not both.
    async fn begin<B>(
        &self,
        fingerprint: &Fingerprint,
        held: Reservation,
    ) -> Result<Reservation, Answer<B>> {
        let attempt = self.attempt(fingerprint);
        let begun = self
            .timed(self.store.begin(attempt, self.in_flight_for))
            .await;
        let (job, key) = (self.job, self.key);
        let (problem, retry) = match begun {
            Ok(Begin::Started) => return Ok(held),
            Err(e) => {
                // The record may have been written after all (a begin that timed out, or
                // whose commit failed after the write): nothing ran, so it must not block its
                // key. Give it up, if it is this attempt's, in the background.
                self.release_unknown_begin(fingerprint);
                count("store_error");
                (
                    reject::store_failed(job, self.token, "idempotency", &e),
                    RETRY,
                )
            }
            Ok(Begin::Replay(stored)) => {
                drop(held);
                let mut held = Reservation::of_peer(self.budget, self.peer);
                if let Err(full) = held.take(stored.body.len(), self.max_buffered) {
                    count("overloaded");
                    return Err(reject(
                        reject::overloaded(self.job, self.max_buffered, full),
                        RETRY,
                    ));
                }
                count("replayed");
                return Err(replay(stored, held));
            }
            Ok(Begin::InFlight) => {
                count("in_flight_conflict");
                (reject::key_in_flight(job, key), RETRY)
            }
            Ok(Begin::Mismatch) => {
                count("mismatch");
                (reject::key_mismatch(job, key), None)
            }
            Ok(Begin::NotReplayable) => {
                count("not_replayable");
                (reject::not_replayable(job, key), None)
            }
        };
        Err(reject(problem, retry))
    }

    /// Finishes the record with the service's response, and answers with that response.
    /// `messages`: the call is one of whole messages (gRPC and its kin, see
    /// [`reject::carries_messages`]), whose service may act on after its answer broke off.
    async fn record<B>(
        &self,
        fingerprint: &Fingerprint,
        response: Response<B>,
        messages: bool,
    ) -> Answer<B>
    where
        B: FenceBody,
    {
        if response.extensions().get::<OutcomeUnknown>().is_some() {
            // The effect may have happened: the in-flight record stays until its timeout.
            return response.map(ResponseBody::inner);
        }
        // A gRPC error answered in the headers alone (trailers-only, HTTP 200) is not an
        // answer to keep: like a server error, the call is forgotten and may be retried.
        let grpc_error = response
            .headers()
            .get("grpc-status")
            .is_some_and(|status| status.as_bytes() != b"0");
        if grpc_error || !(self.config.store_statuses)(response.status()) {
            let finishing = self.finish(fingerprint, Finish::Forget).await;
            let mut answer = response.map(ResponseBody::inner);
            // A call of messages whose answer is not kept still streams from a handler that
            // may be acting: in flight until it ends, as without a key.
            if messages {
                let by = Instant::now() + self.body_timeout;
                answer.extensions_mut().insert(StreamsOn(by));
            }
            return marked(answer, finishing);
        }
        let (head, body) = response.into_parts();
        let mut held = Reservation::of_peer(self.budget, self.peer);
        let limit = self.config.max_response_body;
        // The answer to keep must arrive within the body deadline of its head: one that
        // stalls is streamed on unkept (not replayable), and lets a newer token go on.
        let by = Instant::now() + self.body_timeout;
        let (answer, finishing) =
            match capture(body, (limit, by), &mut held, self.max_buffered).await {
                Captured::Whole(bytes, trailers) => {
                    // A gRPC status is in the trailers, or for gRPC-Web and Connect streaming
                    // in the body's last message.
                    let statuses = [
                        trailers
                            .as_ref()
                            .and_then(|t| t.get(crate::outcome::GRPC_STATUS))
                            .cloned(),
                        status_in_body(&head, &bytes),
                    ];
                    let mut statuses = statuses.iter().flatten();
                    if statuses.clone().any(|s| self.unknown_grpc.contains(s)) {
                        // A call that ran out of time or was cancelled after its answer
                        // began: its handler may still have a write on its way. The
                        // in-flight record stays until its timeout, so a retry meanwhile
                        // gets 409 rather than a second run, and the job is held as for any
                        // unknown outcome.
                        let body = ResponseBody::held(bytes, trailers, Some(held));
                        let mut answer = Response::from_parts(head, body);
                        answer.extensions_mut().insert(OutcomeUnknown);
                        return answer;
                    }
                    if statuses.any(|s| s != "0") || fence_refusal(&head, &bytes) {
                        // A gRPC call that failed, or a refusal in the fence's words:
                        // forgotten, like a server error, so a retry runs it again instead
                        // of replaying the failure.
                        let finishing = self.finish(fingerprint, Finish::Forget).await;
                        let body = ResponseBody::held(bytes, trailers, Some(held));
                        (Response::from_parts(head, body), finishing)
                    } else if !super::cap::fits(self.config, self.held()) {
                        // The records reached their cap while this request ran: it is
                        // remembered as not replayable, like an answer too large to store.
                        let retention = self.config.retention;
                        let finishing = self
                            .finish(fingerprint, Finish::TooLarge { retention })
                            .await;
                        let body = ResponseBody::held(bytes, trailers, Some(held));
                        (Response::from_parts(head, body), finishing)
                    } else {
                        let stored = StoredResponse {
                            status: head.status,
                            headers: head.headers.clone(),
                            body: bytes.clone(),
                            trailers: trailers.clone().map(Box::new),
                        };
                        let retention = self.config.retention;
                        let outcome = Finish::Store {
                            response: stored,
                            retention,
                        };
                        let finishing = self.finish(fingerprint, outcome).await;
                        let body = ResponseBody::held(bytes, trailers, Some(held));
                        (Response::from_parts(head, body), finishing)
                    }
                }
                Captured::TooLarge(prefix, trailers, rest) => {
                    let retention = self.config.retention;
                    let finishing = self
                        .finish(fingerprint, Finish::TooLarge { retention })
                        .await;
                    let body = ResponseBody::prefixed(prefix, trailers, rest, Some(held));
                    let mut answer = Response::from_parts(head, body);
                    if messages {
                        answer.extensions_mut().insert(StreamsOn(by));
                    }
                    (answer, finishing)
                }
                Captured::Failed(e) => {
                    // The service answered (a status it keeps), so it acted; its body broke off.
                    // A retry must not run it again, and there is nothing whole to replay.
                    let retention = self.config.retention;
                    let finishing = self
                        .finish(fingerprint, Finish::TooLarge { retention })
                        .await;
                    let mut answer = reject(reject::response_body_failed(self.job, &e), None);
                    // A call of messages (a server stream whose handler writes on) may still
                    // be acting: the job is held as for any unknown outcome, as it is
                    // without a key (see `Answering::cut`).
                    if messages {
                        answer.extensions_mut().insert(OutcomeUnknown);
                    }
                    (answer, finishing)
                }
            };
        marked(answer, finishing)
    }

    /// What the store holds, in all and for this job, for the cap.
    fn held(&self) -> super::cap::Held {
        let stored = self.store.stored_bytes();
        super::cap::Held {
            stored,
            job: stored.and_then(|_| self.store.job_stored_bytes(self.job)),
        }
    }

    /// Completes the record; `Some` when that failed and goes on in the background (see
    /// [`Finishing`]).
    async fn finish(&self, fingerprint: &Fingerprint, outcome: Finish) -> Option<Finishing> {
        let attempt = self.attempt(fingerprint);
        let finished = self
            .timed(self.store.finish(attempt, outcome.clone()))
            .await;
        let e = finished.err()?;
        // Under the store failures' rate limit: a store that is down fails every request.
        if let Some(suppressed) = crate::refusals::admit("idempotency-completion", None) {
            let suppressed = (suppressed > 0).then_some(suppressed);
            tracing::warn!(job = %self.job, error = %fence_storage::error_chain(&e), suppressed, "completing an idempotency record failed; retrying in the background while the job's newer tokens wait");
        }
        let (done, finishing) = tokio::sync::watch::channel(false);
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return None;
        };
        let (store, owned) = (self.store.clone(), self.owned(fingerprint));
        let (limit, until) = (self.config.store_timeout, self.retry_until());
        runtime.spawn(async move {
            finish_again(&*store, &owned, outcome, limit, until).await;
            let _ = done.send(true);
        });
        Some(Finishing(finishing))
    }

    /// Until when a record's completion is tried again: while it is in flight (a year for an
    /// in-flight timeout near `Duration::MAX`, a service that never gives up).
    fn retry_until(&self) -> Instant {
        Instant::now()
            .checked_add(self.in_flight_for)
            .unwrap_or_else(|| Instant::now() + Duration::from_secs(365 * 24 * 3600))
    }

    fn attempt<'a>(&'a self, fingerprint: &'a Fingerprint) -> Attempt<'a> {
        Attempt {
            job: self.job,
            key: self.key,
            fingerprint,
            id: self.attempt,
            generation: self.token.generation(),
            settled_after: self.settled_after,
        }
    }

    /// After a `begin` whose outcome is unknown (it failed or timed out), forgets the in-flight record
    /// it may have written, in a task of its own, tried again with backoff while it fails
    /// (the store only deletes a record this attempt began; without a runtime, or if it
    /// fails until the record's in-flight timeout, the record times out).
    fn release_unknown_begin(&self, fingerprint: &Fingerprint) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (store, owned) = (self.store.clone(), self.owned(fingerprint));
        let (limit, until) = (self.config.store_timeout, self.retry_until());
        // The store that just failed may fail the first try too (a disk error, a connection
        // lost): tried again with backoff until the record would time out anyway.
        runtime.spawn(async move {
            let forget = tokio::time::timeout(limit, store.finish(owned.attempt(), Finish::Forget));
            if !matches!(forget.await, Ok(Ok(()))) {
                finish_again(&*store, &owned, Finish::Forget, limit, until).await;
            }
        });
    }

    /// This attempt, owned: for a task that outlives the request.
    fn owned(&self, fingerprint: &Fingerprint) -> OwnedAttempt {
        OwnedAttempt {
            job: self.job.clone(),
            key: self.key.clone(),
            fingerprint: *fingerprint,
            id: self.attempt,
            generation: self.token.generation(),
        }
    }

    async fn timed<T>(
        &self,
        f: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let limit: Duration = self.config.store_timeout;
        tokio::time::timeout(limit, f)
            .await
            .map_err(|_| StoreError::Timeout(limit))?
    }
}

/// `answer`, carrying `finishing` when its record's completion goes on in the background.
fn marked<B>(mut answer: Answer<B>, finishing: Option<Finishing>) -> Answer<B> {
    if let Some(finishing) = finishing {
        answer.extensions_mut().insert(finishing);
    }
    answer
}

fn replay<B>(stored: StoredResponse, held: Reservation) -> Answer<B> {
    let mut response = Response::new(ResponseBody::held(
        stored.body,
        stored.trailers.map(|t| *t),
        Some(held),
    ));
    *response.status_mut() = stored.status;
    *response.headers_mut() = stored.headers;
    response
        .headers_mut()
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}

/// The gRPC status a gRPC-Web or Connect streaming answer's body ends with, if it is one.
fn status_in_body(head: &http::response::Parts, body: &[u8]) -> Option<http::HeaderValue> {
    super::ended::status_in_body(head.headers.get(http::header::CONTENT_TYPE), body)
}

/// A keyed request read whole: its head, body, trailers and the memory they hold.
pub(crate) type ReadRequest = (Parts, Bytes, Option<Box<HeaderMap>>, Reservation);

/// Whether an answer is a fence's refusal of the request before it reached the service that
/// acts: a problem whose type says so (`urn:fence:stale-token`, as a service answers when
/// the SQL fence inside its transaction refused the token, or a fence behind this one's
/// refusals: an expired or unsigned token, a store or drain that failed, a key in flight).
/// It tells where the job's lease stood for that token, not what the step did: kept and
/// replayed, it would refuse every newer holder's request with the same (derived) key for
/// the whole retention, telling each to stop work on a step that never ran. Types that
/// say the step may have run (`idempotency-not-replayable`, `body-timeout`) are kept, as are
/// the service's own 4xx.
fn fence_refusal(head: &http::response::Parts, body: &[u8]) -> bool {
    use fence_core::ProblemType as T;
    let problem = head
        .headers
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|t| {
            starts_with_ignore_case(t.as_bytes(), fence_core::problem::PROBLEM_JSON.as_bytes())
        });
    // Only with the status a fence answers it with: an answer that merely carries such a
    // body with another status (a 2xx after the effect committed) is the service's own,
    // and forgetting it would let a retry run the step again.
    let kind = || {
        let value = serde_json::from_slice::<serde_json::Value>(body).ok()?;
        T::from_uri(value.get("type")?.as_str()?).filter(|kind| kind.status() == head.status)
    };
    problem
        && matches!(
            kind(),
            Some(
                T::StaleToken
                    | T::TokenExpired
                    | T::TokenTooLongLived
                    | T::InvalidSignature
                    | T::MissingToken
                    | T::MalformedToken
                    | T::StoreUnavailable
                    | T::DrainTimeout
                    | T::Overloaded
                    | T::PayloadTooLarge
                    | T::IdempotencyInFlight
                    | T::IdempotencyKeyMismatch
                    | T::LeaseLost
                    | T::LeaseHeld
            )
        )
}
