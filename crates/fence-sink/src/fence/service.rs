//! [`Fence`]: the service that checks every fenced request against its job's gate.

use std::{
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use fence_core::{
    FencingToken, JobId, Problem, ProblemType,
    headers::{FencingHeaders, IdempotencyKey},
};
use http::{HeaderValue, Request, Response, header::RETRY_AFTER, request::Parts};
use http_body::Body;
use tower_service::Service;
use tracing::Instrument;

use super::{
    FenceLayer,
    body::{RequestBody, ResponseBody},
    future::ResponseFuture,
    gate::Admission,
};
use crate::{BoxError, GenerationStore, IdempotencyStore, idempotency, metrics::count};

/// What the fence accepted for a request, inserted into its extensions so a handler can use
/// it (for instance, to write the token into its own database row).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fenced {
    /// The job.
    pub job: JobId,
    /// The token the fence accepted.
    pub token: FencingToken,
}

/// The fencing middleware. See [`FenceLayer`].
pub struct Fence<S, St> {
    inner: S,
    layer: FenceLayer<St>,
}

impl<S: Clone, St> Clone for Fence<S, St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            layer: self.layer.clone(),
        }
    }
}

impl<S: std::fmt::Debug, St> std::fmt::Debug for Fence<S, St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fence")
            .field("inner", &self.inner)
            .field("layer", &self.layer)
            .finish()
    }
}

impl<S, St> Fence<S, St> {
    /// Wraps `inner` with `layer`'s configuration and state.
    pub fn new(inner: S, layer: FenceLayer<St>) -> Self {
        Self { inner, layer }
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

/// A problem+json response, with `Retry-After` where the client should come back.
pub(crate) fn reject<B>(
    problem: Problem,
    retry_after: Option<Duration>,
) -> Response<ResponseBody<B>> {
    let mut response: Response<ResponseBody<B>> = problem.to_response();
    if let Some(after) = retry_after {
        response
            .headers_mut()
            .insert(RETRY_AFTER, HeaderValue::from(after.as_secs().max(1)));
    }
    response
}

impl<S, St, ReqB, ResB> Service<Request<ReqB>> for Fence<S, St>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqB: Body<Data = Bytes> + Send + 'static,
    ReqB::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
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
        let config = &self.layer.config;
        if !config.is_fenced(&parts) {
            count("unfenced");
            return ResponseFuture::unfenced(
                self.inner
                    .call(Request::from_parts(parts, RequestBody::inner(body))),
            );
        }
        let malformed = |e: fence_core::headers::HeaderError| {
            count("malformed");
            ResponseFuture::rejected(reject(
                Problem::new(ProblemType::MalformedToken, e.to_string()),
                None,
            ))
        };
        let fencing = match FencingHeaders::from_headers(&parts.headers) {
            Ok(f) => f,
            Err(e) => return malformed(e),
        };
        let key = match IdempotencyKey::from_headers(&parts.headers) {
            Ok(k) => k,
            Err(e) => return malformed(e),
        };
        let Some(FencingHeaders {
            job,
            token,
            signature,
        }) = fencing
        else {
            if config.require_token {
                count("missing");
                let detail = format!(
                    "{} {} is fenced: send X-Fencing-Job and X-Fencing-Token with the job id and the generation of your lease",
                    parts.method,
                    parts.uri.path()
                );
                return ResponseFuture::rejected(reject(
                    Problem::new(ProblemType::MissingToken, detail),
                    None,
                ));
            }
            count("missing_allowed");
            return ResponseFuture::unfenced(
                self.inner
                    .call(Request::from_parts(parts, RequestBody::inner(body))),
            );
        };
        if let Some(signatures) = &config.signatures {
            let valid = signature
                .as_deref()
                .is_some_and(|s| signatures.check(&job, token.generation(), s));
            if !valid {
                count("invalid_signature");
                let detail = match &signature {
                    None => format!(
                        "job {job}: this destination requires signed tokens (<generation>.<signature> as the lease server returned it); token {token} carries no signature"
                    ),
                    Some(_) => format!(
                        "job {job}: the signature of token {token} is not valid for this job and generation under any key this destination trusts"
                    ),
                };
                let p = Problem::new(ProblemType::InvalidSignature, detail)
                    .with_job(job)
                    .with_token(token.get());
                return ResponseFuture::rejected(reject(p, None));
            }
        }
        // The service that poll_ready made ready is the one the future calls.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let layer = self.layer.clone();
        let span = tracing::debug_span!("fence", job = %job, token = %token);
        let detach = layer.config.run_to_completion;
        let future = fenced(inner, layer, parts, body, job, token, key).instrument(span);
        // With run_to_completion, the request's guard lives in the future, which a caller
        // that goes away hands to a task: it is released when the effect is over, not when
        // the caller stops waiting.
        ResponseFuture::fenced(Box::pin(future), detach)
    }
}

async fn fenced<S, St, ReqB, ResB>(
    mut inner: S,
    layer: FenceLayer<St>,
    mut parts: Parts,
    body: ReqB,
    job: JobId,
    token: FencingToken,
    key: Option<IdempotencyKey>,
) -> Result<Response<ResponseBody<ResB>>, S::Error>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>>,
    ReqB: Body<Data = Bytes> + Send + 'static,
    ReqB::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
    St: GenerationStore + IdempotencyStore,
{
    let retry = Some(Duration::from_secs(1));
    let guard = match layer
        .gates
        .admit(&job, token.generation(), layer.limits())
        .await
    {
        Admission::Admitted(guard) => guard,
        Admission::Stale { highest, pending } => {
            count("stale");
            let detail = match pending {
                Some(newer) => format!(
                    "job {job}: token {token} is older than token {newer}, which is waiting for older requests to finish before it is applied; a newer lease holder exists"
                ),
                None => format!(
                    "job {job}: token {token} is below generation {highest}, which this destination has already seen; a newer lease holder exists"
                ),
            };
            let p = Problem::new(ProblemType::StaleToken, detail)
                .with_job(job)
                .with_token(token.get())
                .with_highest(highest.get());
            return Ok(reject(p, None));
        }
        Admission::DrainTimeout { highest } => {
            count("drain_timeout");
            let detail = format!(
                "job {job}: token {token} is newer than the highest accepted, but requests with older tokens were still in flight when the drain limit ran out; nothing changed, retry"
            );
            return Ok(reject(
                Problem::new(ProblemType::DrainTimeout, detail)
                    .with_job(job)
                    .with_token(token.get())
                    .with_highest(highest.get()),
                retry,
            ));
        }
        Admission::StoreFailed(e) => {
            count("store_error");
            tracing::warn!(error = %crate::error_chain(&e), "generation store failed");
            let detail = format!(
                "job {job}: the generation store failed: {}",
                crate::error_chain(&e)
            );
            return Ok(reject(
                Problem::new(ProblemType::StoreUnavailable, detail)
                    .with_job(job)
                    .with_token(token.get()),
                retry,
            ));
        }
    };
    parts.extensions.insert(Fenced {
        job: job.clone(),
        token,
    });
    match (key, &layer.config.idempotency) {
        (Some(key), Some(config)) => {
            let store: Arc<St> = layer.gates.store().clone();
            idempotency::run(&mut inner, &*store, config, parts, body, &job, &key, guard).await
        }
        _ => {
            count("accepted");
            let response = inner
                .call(Request::from_parts(parts, RequestBody::inner(body)))
                .await;
            drop(guard); // the effect is done (or failed): a newer token may proceed
            response.map(|r| r.map(ResponseBody::inner))
        }
    }
}
