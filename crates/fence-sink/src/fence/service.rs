//! [`Fence`]: the service that checks every fenced request against its job's gate.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll},
};

use fence_core::{
    FencingToken, JobId,
    headers::{FencingHeaders, IdempotencyKey},
};
use http::{Request, Response, request::Parts};
use tower_service::Service;
use tracing::Instrument;

use super::{
    future::ResponseFuture,
    shared::{Config, Shared},
};
use crate::{
    GenerationStore, IdempotencyStore, OutcomeUnknown,
    body::{FenceBody, RequestBody, ResponseBody, Streaming},
    gate::Admission,
    idempotency::{Finishing, Keyed, StreamsOn},
    metrics::count,
    refusals::Asked,
    reject::{self, RETRY, reject},
};

/// What the fence accepted for a request, inserted into its extensions so a handler can use
/// it (for instance, to write the token into its own database row).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fenced {
    /// The job.
    pub job: JobId,
    /// The token the fence accepted.
    pub token: FencingToken,
}

/// The fencing middleware: the inner service plus the layer's shared state. See
/// [`FenceLayer`](super::FenceLayer).
pub struct Fence<S, St> {
    inner: S,
    shared: Arc<Shared<St>>,
}

impl<S: Clone, St> Clone for Fence<S, St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: std::fmt::Debug, St> std::fmt::Debug for Fence<S, St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fence")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, St> Fence<S, St> {
    pub(crate) fn from_shared(inner: S, shared: Arc<Shared<St>>) -> Self {
        Self { inner, shared }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

/// What the headers of a fenced request ask for.
pub(super) enum Checked {
    /// Fence `job` at `token`.
    Fence {
        job: JobId,
        token: FencingToken,
        key: Option<IdempotencyKey>,
        /// The verified lease end of a signed token (ms, Unix time), checked again at
        /// admission.
        lease_end: Option<u64>,
    },
    /// No fencing headers, and the layer lets such requests through.
    Pass,
    /// Refused before the fence: the problem says why.
    Rejected(fence_core::Problem),
}

impl Config {
    /// Checks the headers of a fenced request, in the contract's order: well-formed (400),
    /// present (428), signed (403).
    pub(super) fn check(&self, parts: &Parts) -> Checked {
        let headers = FencingHeaders::from_headers(&parts.headers)
            .and_then(|f| Ok((f, IdempotencyKey::from_headers(&parts.headers)?)));
        let (fencing, key) = match headers {
            Ok(headers) => headers,
            Err(e) => {
                count("malformed");
                return Checked::Rejected(reject::malformed(&e));
            }
        };
        let Some(FencingHeaders { job, token, signed }) = fencing else {
            if self.require_token {
                count("missing");
                return Checked::Rejected(reject::missing(parts));
            }
            count("missing_allowed");
            return Checked::Pass;
        };
        if let Some(signatures) = &self.signatures {
            let valid = signed.as_ref().is_some_and(|s| {
                let capacity = self.limits.max_cached_jobs;
                signatures.check(
                    &job,
                    token.generation(),
                    s.expires_at_ms,
                    &s.signature,
                    capacity,
                )
            });
            if !valid {
                count("invalid_signature");
                return Checked::Rejected(reject::invalid_signature(job, token, signed.is_some()));
            }
            // Verified, so its lease end can be trusted: a lease that ended is stale, and one
            // that ends later than any lease the server may grant is refused, so forgetting
            // never meets a token that outlives its window (contract section 8).
            if let Some(s) = &signed {
                let now = self.clock.now_ms();
                if self.ended(s.expires_at_ms, now) {
                    count("expired");
                    return Checked::Rejected(reject::expired(job, token, s.expires_at_ms));
                }
                let skew = self.skew_ms();
                let latest = now
                    .saturating_add(
                        u64::try_from(self.max_lease_ttl.as_millis()).unwrap_or(u64::MAX),
                    )
                    .saturating_add(skew);
                if s.expires_at_ms > latest {
                    count("too_long_lived");
                    return Checked::Rejected(reject::too_long_lived(
                        job,
                        token,
                        s.expires_at_ms,
                        latest,
                    ));
                }
            }
        }
        let lease_end = signed
            .filter(|_| self.signatures.is_some())
            .map(|s| s.expires_at_ms);
        Checked::Fence {
            job,
            token,
            key,
            lease_end,
        }
    }

    /// Whether a lease that ends at `expires_at_ms` has ended at `now_ms`, beyond the skew.
    fn ended(&self, expires_at_ms: u64, now_ms: u64) -> bool {
        expires_at_ms.saturating_add(self.skew_ms()) < now_ms
    }

    fn skew_ms(&self) -> u64 {
        u64::try_from(self.clock_skew.as_millis()).unwrap_or(u64::MAX)
    }
}

impl<S, St, ReqB, ResB> Service<Request<ReqB>> for Fence<S, St>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqB: FenceBody,
    ResB: FenceBody,
    St: GenerationStore + IdempotencyStore,
{
    type Response = Response<ResponseBody<ResB>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResB, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let (parts, body) = req.into_parts();
        let config = &self.shared.config;
        let grpc = reject::is_grpc(&parts.headers);
        let checked = if config.is_fenced(&parts) {
            config.check(&parts)
        } else {
            count("unfenced");
            Checked::Pass
        };
        let (job, token, key) = match checked {
            Checked::Fence {
                job,
                token,
                key,
                lease_end,
            } => (job, token, (key, lease_end)),
            Checked::Pass => {
                let request = Request::from_parts(parts, RequestBody::inner(body));
                return ResponseFuture::unfenced(self.inner.call(request));
            }
            Checked::Rejected(problem) => {
                let asked = Asked::of(&parts);
                let answer = reject(problem, None);
                let future =
                    if parts.version == http::Version::HTTP_2 && !grpc && !body.is_end_stream() {
                        let version = parts.version;
                        ResponseFuture::fenced(
                            Box::pin(async move {
                                crate::discard::discard(version, body).await;
                                Ok(answer)
                            }),
                            false,
                            None,
                        )
                    } else {
                        ResponseFuture::rejected(answer)
                    };
                return future.grpc(grpc).asked(asked);
            }
        };
        let asked = Asked::of(&parts);
        // The service that poll_ready made ready is the one the future calls.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let span = tracing::debug_span!("fence", job = %job, token = %token);
        let detach = config.run_to_completion;
        // Without run_to_completion, a request with an Idempotency-Key the service answered
        // is still finished when its caller goes away: the effect happened, so its record
        // must be completed (or forgotten), not left in flight for a newer token to take
        // over and run the step again.
        let committed = (!detach && key.0.is_some() && config.idempotency.is_some())
            .then(|| Arc::new(AtomicBool::new(false)));
        let request = Request::from_parts(parts, body);
        let future = fenced(
            inner,
            self.shared.clone(),
            request,
            job,
            token,
            key,
            committed.clone(),
        )
        .instrument(span);
        // With run_to_completion, the request's guard lives in the future, which a caller
        // that goes away hands to a task: it is released when the effect is over, not when
        // the caller stops waiting.
        ResponseFuture::fenced(Box::pin(future), detach, committed)
            .grpc(grpc)
            .asked(asked)
    }
}

/// Fences one request that carries `job` and `token`, with its `Idempotency-Key` and the
/// verified lease end of a signed token.
pub(super) async fn fenced<S, St, ReqB, ResB>(
    mut inner: S,
    shared: Arc<Shared<St>>,
    request: Request<ReqB>,
    job: JobId,
    token: FencingToken,
    (key, lease_end): (Option<IdempotencyKey>, Option<u64>),
    committed: Option<Arc<AtomicBool>>,
) -> Result<Response<ResponseBody<ResB>>, S::Error>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>>,
    ReqB: FenceBody,
    ResB: FenceBody,
    St: GenerationStore + IdempotencyStore,
{
    let Shared { config, gates, .. } = &*shared;
    let keyed = match (&key, &config.idempotency) {
        (Some(key), Some(idempotency)) => Some(Keyed {
            store: gates.store(),
            config: idempotency,
            job: &job,
            token,
            key,
            budget: &shared.budget,
            peer: request
                .extensions()
                .get::<crate::PeerAddr>()
                .map(|p| p.0.ip()),
            max_buffered: config.max_buffered_bytes,
            // Read only for a request that is buffered: a streamed one's counts from its
            // admission (`Ready::Streamed`).
            deadline: tokio::time::Instant::now() + config.body_timeout,
            body_timeout: config.body_timeout,
            attempt: crate::idempotency::attempt_id(),
            settled_after: config.limits.restart.settled_after(),
            in_flight_for: config.in_flight_timeout(idempotency),
            committed: committed.as_deref(),
            unknown_grpc: config.unknown_grpc,
        }),
        _ => None,
    };
    // A request that is buffered (it has an Idempotency-Key) is read whole before the fence
    // admits it: until then it has reached nobody, holds up no newer token, and a newer
    // token raised meanwhile makes it stale (docs/protocol.md section 3, "Bodies"). A token
    // already below the highest in memory is told so first: read, its body would earn it a
    // 413 or a 503 `overloaded` that says to try again, where 409 says to stop.
    if keyed.is_some()
        && let Some(highest) = gates
            .cached_highest(&job)
            .filter(|highest| token.generation() < *highest)
    {
        count("stale");
        drop(inner);
        if !reject::is_grpc(request.headers()) {
            let (parts, body) = request.into_parts();
            crate::discard::discard(parts.version, body).await;
        }
        return Ok(reject(reject::stale(job, token, highest, None), None));
    }
    let request = match keyed {
        // Boxed, as `run` below: requests without a key do not carry their futures.
        Some(keyed) => match Box::pin(keyed.read(request)).await {
            Ok(read) => Ready::Read(keyed, Box::new(read)),
            Err(answer) => return Ok(answer),
        },
        None => Ready::Streamed(request),
    };
    // Its lease may have ended while the body was read (up to the body deadline, longer
    // than forgetting's margin): a job forgotten meanwhile must not meet it unchecked
    // (contract section 8).
    let ended = lease_end.filter(|end| config.ended(*end, config.clock.now_ms()));
    let admission = match ended {
        Some(end) => Err(end),
        None => Ok(gates
            .admit(&job, token.generation(), config.limits, &*config.clock)
            .await),
    };
    let (problem, retry) = match admission {
        Err(end) => {
            count("expired");
            (Err(reject::expired(job.clone(), token, end)), None)
        }
        Ok(Admission::Admitted(guard)) => (Ok(guard), None),
        Ok(Admission::Stale { highest, pending }) => {
            count("stale");
            (
                Err(reject::stale(job.clone(), token, highest, pending)),
                None,
            )
        }
        Ok(Admission::DrainTimeout { highest }) => {
            count("drain_timeout");
            (
                Err(reject::drain_timeout(job.clone(), token, highest)),
                RETRY,
            )
        }
        Ok(Admission::StoreFailed(e)) => {
            count("store_error");
            let problem = reject::store_failed(&job, token, "generation", &e);
            (Err(problem), RETRY)
        }
    };
    let hold = config.unknown_outcome_hold;
    let guard = match problem {
        // A panic of the service from here on holds the job (see `InFlight::held_on_panic`).
        Ok(guard) => guard.held_on_panic(hold),
        Err(problem) => {
            // The inner service's readiness (a permit of a concurrency limit, a buffer slot)
            // is not held while the refused body drains.
            drop(inner);
            if let Ready::Streamed(request) = request
                && !reject::is_grpc(request.headers())
            {
                let (parts, body) = request.into_parts();
                crate::discard::discard(parts.version, body).await;
            }
            return Ok(reject(problem, retry));
        }
    };
    let fenced = Fenced {
        job: job.clone(),
        token,
    };
    match request {
        Ready::Read(keyed, read) => {
            let mut read = *read;
            read.0.extensions.insert(fenced);
            let mut response = Box::pin(keyed.run(&mut inner, read)).await;
            let finishing = response
                .as_mut()
                .ok()
                .and_then(|r| r.extensions_mut().remove::<Finishing>());
            // The effect is done (its answer read whole): a newer token may proceed, unless
            // the service could not tell (or failed) and may still act on the request, or
            // its record is still being completed (a newer request with its key would run
            // the step again).
            let extensions = response.as_ref().ok().map(http::Response::extensions);
            let unknown = extensions.is_some_and(|e| e.get::<OutcomeUnknown>().is_some());
            // Until when an answer that streams on keeps the request in flight.
            let streams_on = extensions.and_then(|e| e.get::<StreamsOn>()).map(|s| s.0);
            // A call of messages whose answer streams on unkept: in flight until the answer
            // ends (held for the hold if it is cut), and no longer than the body deadline
            // from the answer's head (then held for the hold), as without a key; and, when
            // its record is completed in the background, until that is done too.
            if let Some(until) = streams_on {
                let flight = Streaming::new(guard, hold, true, config.unknown_grpc);
                if unknown {
                    flight.unknown();
                }
                match (finishing, tokio::runtime::Handle::try_current()) {
                    // The deadline counts only once the record is completed: a newer token's
                    // request with the same key would take an in-flight record over and run
                    // the step again.
                    (Some(finishing), Ok(runtime)) => {
                        let waiting = flight.clone();
                        runtime.spawn(async move {
                            finishing.done().await;
                            waiting.keep_deadline(until);
                        });
                    }
                    _ => flight.keep_deadline(until),
                }
                return response.map(|r| r.map(|body| body.answering(flight)));
            }
            match finishing {
                // Held for the unknown outcome's hold after the record is done, when the
                // service may still be acting (its answer cut).
                Some(finishing) => {
                    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                        runtime.spawn(async move {
                            finishing.done().await;
                            if unknown {
                                guard.hold(hold);
                            }
                        });
                    }
                }
                None if !unknown && response.is_ok() => drop(guard),
                None => guard.hold(hold),
            }
            response
        }
        Ready::Streamed(request) => {
            let (mut parts, body) = request.into_parts();
            parts.extensions.insert(fenced);
            count("accepted");
            let limit = config.body_timeout;
            // A streamed body's deadline counts from admission: the service has its head.
            let deadline = tokio::time::Instant::now() + limit;
            // In flight until the service answered and the request's body has ended (a
            // streaming call goes on after its answer's head), held longer when the outcome
            // became unknown.
            let flight = Streaming::new(
                guard,
                hold,
                reject::carries_messages(&parts.headers),
                config.unknown_grpc,
            );
            streamed(
                &mut inner,
                parts,
                body,
                (deadline, limit),
                &job,
                token,
                flight,
            )
            .await
        }
    }
}

/// A request as the fence admits it: read whole (it has an `Idempotency-Key`), or with its
/// body still to stream.
enum Ready<'a, St, ReqB> {
    // Boxed: the head, trailers and reservation of a request read whole are large.
    Read(Keyed<'a, St>, Box<crate::idempotency::ReadRequest>),
    Streamed(Request<ReqB>),
}

/// How long after its body deadline a request still in flight (its body unfinished, or the
/// answer that counts for it) is taken for one whose service stopped reading, or whose
/// client stopped reading its answer (see `streamed`).
const OVERDUE_AFTER: std::time::Duration = std::time::Duration::from_millis(100);

/// Passes a request on with its body streamed under the deadline. When the body ran out of
/// time and the service did not answer with a success, the client gets 408 (keeping the
/// service's [`OutcomeUnknown`], if any).
async fn streamed<S, ReqB, ResB>(
    inner: &mut S,
    parts: Parts,
    body: ReqB,
    (deadline, limit): (tokio::time::Instant, std::time::Duration),
    job: &JobId,
    token: FencingToken,
    flight: Arc<Streaming>,
) -> Result<Response<ResponseBody<ResB>>, S::Error>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>>,
    ReqB: FenceBody,
    ResB: FenceBody,
{
    let fired = Arc::new(AtomicBool::new(false));
    let body = if body.is_end_stream() {
        RequestBody::inner(body)
    } else {
        RequestBody::timed(body, deadline, limit, fired.clone()).in_flight(flight.clone())
    };
    let called = {
        // Without an answer (a panic, a drop, a failure) the guard keeps the deadline of a
        // body handed on.
        let unanswered = flight.unknown_if_unanswered(deadline + OVERDUE_AFTER);
        let called = inner.call(Request::from_parts(parts, body)).await;
        if called.is_ok() {
            unanswered.answered();
        }
        called
    };
    let response = match called {
        Ok(response) => response,
        Err(e) => {
            // The service failed: whether it acted is unknown.
            flight.unknown();
            return Err(e);
        }
    };
    if response.extensions().get::<OutcomeUnknown>().is_some()
        || flight.unknown_grpc.in_answer(response.headers())
    {
        // Also a call that ran out of time or was cancelled (a trailers-only answer): its
        // handler was dropped wherever it was, and what it had sent may still commit.
        flight.unknown();
    }
    // The request stays in flight until its answer ended too (`ResponseBody::answering`)
    // when it was answered before its body ended here (a streaming call, an upload answered
    // early), and always for a body of whole messages (gRPC and its kin): a hop (the proxy)
    // hands a body on as fast as it comes, so its end here says nothing of what the
    // service's handler has applied, and a call's answer ends when its handler is done. A
    // service that stops reading never polls the body to its deadline, and a client that
    // stops reading the answer never lets it end, so the deadline is kept here as well. A
    // little after it: a service still reading gets the body's own `BodyTimeout` first,
    // which lets the request go at once (a gRPC call's: after the hold, see
    // `Streaming::body_failed`); one that stopped reading, or whose answer is unfinished,
    // is held.
    let answer_counts = Arc::strong_count(&flight) > 1 || flight.carries_messages();
    if answer_counts {
        flight.keep_deadline(deadline + OVERDUE_AFTER);
    }
    // A gRPC service answers a failed call with HTTP 200 and a `grpc-status` other than 0
    // in its headers (a trailers-only answer): that is no success either.
    let grpc_failed = response
        .headers()
        .get(crate::outcome::GRPC_STATUS)
        .is_some_and(|status| status.as_bytes() != b"0");
    if !fired.load(Ordering::Relaxed) || (response.status().is_success() && !grpc_failed) {
        return Ok(response.map(|body| {
            let body = ResponseBody::inner(body);
            if answer_counts {
                body.answering(flight)
            } else {
                body
            }
        }));
    }
    count("body_timeout");
    let mut answer = reject(reject::body_timeout(job, token, limit, true), None);
    if response.extensions().get::<OutcomeUnknown>().is_some() {
        answer.extensions_mut().insert(OutcomeUnknown);
    }
    Ok(answer)
}
