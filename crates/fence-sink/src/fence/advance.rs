//! Raising a job's fence without a request: what an operator's revoke pushes to a sink.

use std::convert::Infallible;

use bytes::Bytes;
use fence_core::{
    JobId, Problem, ProblemType,
    headers::{X_FENCING_JOB, X_FENCING_TOKEN},
};
use http::{Request, Response, StatusCode};
use http_body_util::Empty;

use super::{
    FenceLayer,
    service::{Checked, fenced},
};
use crate::{GenerationStore, IdempotencyStore, RequestBody};

impl<St: GenerationStore + IdempotencyStore> FenceLayer<St> {
    /// Raises `job`'s highest generation to the one the signed `token` carries, as a fenced
    /// request with that token would (its signature verified, its expiry checked, ordered
    /// after the older requests still in flight), but reaching no service: what `fence
    /// revoke --sink` pushes (contract section 11, `POST /v1/fence/{job}`). Returns the
    /// job's highest generation afterwards; a token at or below it changes nothing and is
    /// not an error, since everything below the highest is refused already.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use fence_core::{Generation, signing::{TokenSigner, TokenVerifier}};
    /// use fence_sink::{FenceLayer, MemoryStore};
    ///
    /// let signer = TokenSigner::from_seed([7; 32]);
    /// let verifier = TokenVerifier::new([signer.verify_key()]);
    /// let layer = FenceLayer::new(MemoryStore::new()).require_signatures(verifier);
    /// let far = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_millis() as u64 + 60_000;
    /// let (job, g) = ("job-1".parse()?, Generation::new);
    /// assert_eq!(layer.advance(&job, &signer.sign(&job, g(9), far)).await?, 9);
    /// assert_eq!(layer.advance(&job, &signer.sign(&job, g(4), far)).await?, 9);
    /// assert!(layer.advance(&job, "9").await.is_err()); // not signed
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// The problem a fenced request with this token would get (malformed, invalid
    /// signature, expired, store unavailable, drain timeout), and `forbidden` when the
    /// layer verifies no signatures: without keys, anyone who can call this could raise a
    /// job above every real generation and lock its workers out.
    pub async fn advance(&self, job: &JobId, token: &str) -> Result<u64, Problem> {
        let config = &self.shared.config;
        if config.signatures.is_none() {
            return Err(Problem::new(
                ProblemType::Forbidden,
                "this sink verifies no signed tokens (no verify key), so it takes no pushed generation: anyone could raise a job past its workers",
            )
            .with_job(job.clone()));
        }
        let request = Request::post("/")
            .header(X_FENCING_JOB, job.as_str())
            .header(X_FENCING_TOKEN, token)
            .body(Empty::<Bytes>::new())
            .map_err(|_| {
                Problem::new(
                    ProblemType::MalformedToken,
                    "token: not a valid header value (visible ASCII only)",
                )
            })?;
        let (parts, body) = request.into_parts();
        let (job, token) = match config.check(&parts) {
            Checked::Fence { job, token, .. } => (job, token),
            Checked::Rejected(problem) => return Err(problem),
            Checked::Pass => unreachable!("the request carries both fencing headers"),
        };
        let generation = token.generation().get();
        let request = Request::from_parts(parts, body);
        let Ok(response) = fenced(
            Nothing,
            self.shared.clone(),
            request,
            job,
            token,
            (None, None),
            None,
        )
        .await;
        if response.status() == StatusCode::OK {
            return Ok(generation);
        }
        match response.extensions().get::<Problem>() {
            Some(p) if p.kind == ProblemType::StaleToken => Ok(p.highest.unwrap_or(generation)),
            Some(p) => Err(p.clone()),
            None => Err(Problem::new(
                ProblemType::Internal,
                format!("the fence answered {} without a problem", response.status()),
            )),
        }
    }
}

/// The service behind a push: it does nothing, successfully.
#[derive(Clone, Copy)]
struct Nothing;

impl tower_service::Service<Request<RequestBody<Empty<Bytes>>>> for Nothing {
    type Response = Response<Empty<Bytes>>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Infallible>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Request<RequestBody<Empty<Bytes>>>) -> Self::Future {
        std::future::ready(Ok(Response::new(Empty::new())))
    }
}
