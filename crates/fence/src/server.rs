//! The lease server: the HTTP lease API of `docs/protocol.md` section 4 over a lease store.
//!
//! Its clock decides; bodies are validated strictly, field by field, by the typed API of
//! `fence_core::lease_api`.

// Handlers answer a refusal as the Problem itself; boxing it would buy nothing.
#![allow(clippy::result_large_err)]

use std::{sync::Arc, time::Instant};

use axum::{
    Router,
    body::Body,
    extract::{Path, State, rejection::PathRejection},
    http::{StatusCode, header::CONTENT_TYPE},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use bytes::Bytes;
use fence_core::{
    JobId, Owner, Problem, ProblemType,
    lease_api::{
        Action, BodyError, ClaimRequest, FinishRequest, LeaseBody, MAX_REQUEST_BODY, RecordBody,
        RenewRequest,
    },
};
use fence_lease::{LeaseOp, LeaseRecord, LeaseStore, Outcome, StoreError};
use fence_storage::error_chain;
use http_body_util::{BodyExt, Limited};
use metrics_exporter_prometheus::PrometheusHandle;

struct AppState<S> {
    store: Arc<S>,
    metrics: Option<PrometheusHandle>,
}

/// The lease API router over `store`; `/metrics` renders `metrics` when given.
pub fn router<S: LeaseStore>(store: Arc<S>, metrics: Option<PrometheusHandle>) -> Router {
    let state = Arc::new(AppState { store, metrics });
    Router::new()
        .route("/v1/leases/{job}/{action}", post(act::<S>))
        .route("/v1/leases/{job}", get(status::<S>))
        .route("/healthz", get(healthz::<S>))
        .route("/metrics", get(render_metrics::<S>))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

type Answer = Result<Response, Problem>;

struct ProblemResponse(Problem);

impl IntoResponse for ProblemResponse {
    fn into_response(self) -> Response {
        self.0.to_response::<Body>()
    }
}

fn finish(op: &'static str, started: Instant, answer: Answer) -> Response {
    let outcome = match &answer {
        Ok(_) => "ok",
        Err(p) => match p.kind {
            ProblemType::LeaseHeld => "held",
            ProblemType::LeaseLost => "lost",
            ProblemType::JobCompleted => "completed",
            ProblemType::UnknownJob => "unknown",
            ProblemType::BadRequest => "bad_request",
            _ => "error",
        },
    };
    metrics::counter!("fence_lease_requests_total", "op" => op, "outcome" => outcome).increment(1);
    metrics::histogram!("fence_lease_request_seconds", "op" => op)
        .record(started.elapsed().as_secs_f64());
    match answer {
        Ok(r) => r,
        Err(p) => ProblemResponse(p).into_response(),
    }
}

fn bad(detail: impl Into<String>) -> Problem {
    Problem::new(ProblemType::BadRequest, detail)
}

fn job_of(path: Result<String, PathRejection>) -> Result<JobId, Problem> {
    let raw = path.map_err(|e| {
        bad(format!(
            "job: the path segment is not valid percent-encoded UTF-8: {e}"
        ))
    })?;
    JobId::new(raw).map_err(|e| bad(format!("job (in the path): {e}")))
}

/// Reads a request body of at most [`MAX_REQUEST_BODY`] bytes and parses it with `parse`.
async fn parse<T>(
    body: Body,
    parse: impl FnOnce(&[u8]) -> Result<T, BodyError>,
) -> Result<T, Problem> {
    let bytes: Bytes = match Limited::new(body, MAX_REQUEST_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            return Err(bad(format!("body: larger than {MAX_REQUEST_BODY} bytes")));
        }
        Err(e) => return Err(bad(format!("body: could not be read: {e}"))),
    };
    parse(&bytes).map_err(|e| bad(e.to_string()))
}

fn store_failed(e: &StoreError) -> Problem {
    tracing::error!(error = %error_chain(e), "lease store failed");
    Problem::new(
        ProblemType::Internal,
        format!("the lease store failed: {}", error_chain(e)),
    )
}

fn json(value: &impl serde::Serialize) -> Response {
    let body = serde_json::to_vec(value).unwrap_or_default();
    ([(CONTENT_TYPE, "application/json")], body).into_response()
}

/// The record body of the contract.
pub fn record_body(r: &LeaseRecord) -> RecordBody {
    RecordBody {
        job: r.job.clone(),
        owner: r.owner.clone(),
        generation: r.generation,
        state: r.state,
        expires_in_ms: u64::try_from(r.expires_in.as_millis()).unwrap_or(u64::MAX),
    }
}

/// Decides `op` and answers as the contract says.
async fn decide<S: LeaseStore>(
    app: &AppState<S>,
    job: JobId,
    action: Action,
    op: LeaseOp,
) -> Answer {
    let owner = op.owner().clone();
    let outcome = app
        .store
        .apply(&job, op)
        .await
        .map_err(|e| store_failed(&e))?;
    answer(job, &owner, action, outcome)
}

/// The HTTP answer to what the store decided.
fn answer(job: JobId, owner: &Owner, action: Action, outcome: Outcome) -> Answer {
    match outcome {
        Outcome::Granted(g) => Ok(json(&LeaseBody {
            job,
            owner: owner.clone(),
            generation: g.generation,
            ttl_ms: g.ttl.as_millis(),
            expires_at_ms: g.expires_at_ms,
            token: g.token,
        })),
        Outcome::Done(record) => Ok(json(&record_body(&record))),
        Outcome::Held {
            owner: holder,
            expires_in,
        } => {
            let ms = u64::try_from(expires_in.as_millis()).unwrap_or(u64::MAX);
            Err(Problem::new(
                ProblemType::LeaseHeld,
                format!("job {job} is held by {holder} for another {ms} ms"),
            )
            .with_job(job)
            .with_owner(Some(holder))
            .with_expires_in_ms(ms))
        }
        Outcome::Completed { owner, generation } => Err(Problem::new(
            ProblemType::JobCompleted,
            format!(
                "job {job} was completed at generation {generation} and cannot be claimed again"
            ),
        )
        .with_job(job)
        .with_owner(owner)
        .with_generation(generation.get())),
        Outcome::Lost { owner, generation } => {
            let what = match action {
                Action::Claim => "claim",
                Action::Renew => "renewal",
                Action::Release => "release",
                Action::Complete => "completion",
            };
            let holder = owner
                .as_ref()
                .map_or_else(|| "nobody".to_owned(), ToString::to_string);
            Err(Problem::new(
                ProblemType::LeaseLost,
                format!(
                    "job {job}: {what} refused: the lease is now generation {generation}, held by {holder}"
                ),
            )
            .with_job(job)
            .with_owner(owner)
            .with_generation(generation.get()))
        }
        _ => Err(Problem::new(ProblemType::Internal, "unknown lease outcome")),
    }
}

/// `POST /v1/leases/{job}/claim|renew|release|complete`.
async fn act<S: LeaseStore>(
    State(app): State<Arc<AppState<S>>>,
    method: axum::http::Method,
    uri: axum::http::Uri,
    path: Result<Path<(String, String)>, PathRejection>,
    body: Body,
) -> Response {
    let started = Instant::now();
    // The action is the last segment, also when the job's segment does not decode.
    let segment = uri.path().rsplit('/').next().unwrap_or_default();
    let Some(action) = Action::parse(segment) else {
        return not_found(method, uri).await;
    };
    let job = path.map(|Path((job, _))| job);
    let answer = async {
        let job = job_of(job)?;
        let op = match action {
            Action::Claim => {
                let ClaimRequest { owner, ttl } = parse(body, ClaimRequest::from_json).await?;
                LeaseOp::Claim { owner, ttl }
            }
            Action::Renew => {
                let RenewRequest {
                    owner,
                    generation,
                    ttl,
                } = parse(body, RenewRequest::from_json).await?;
                LeaseOp::Renew {
                    owner,
                    generation,
                    ttl,
                }
            }
            Action::Release | Action::Complete => {
                let FinishRequest { owner, generation } =
                    parse(body, FinishRequest::from_json).await?;
                if action == Action::Complete {
                    LeaseOp::Complete { owner, generation }
                } else {
                    LeaseOp::Release { owner, generation }
                }
            }
        };
        decide(&app, job, action, op).await
    }
    .await;
    finish(action.as_str(), started, answer)
}

async fn status<S: LeaseStore>(
    State(app): State<Arc<AppState<S>>>,
    path: Result<Path<String>, PathRejection>,
) -> Response {
    let started = Instant::now();
    let answer = async {
        let job = job_of(path.map(|Path(job)| job))?;
        match app.store.get(&job).await.map_err(|e| store_failed(&e))? {
            Some(r) => Ok(json(&record_body(&r))),
            None => Err(Problem::new(
                ProblemType::UnknownJob,
                format!("job {job} has never been claimed"),
            )
            .with_job(job)),
        }
    }
    .await;
    finish("status", started, answer)
}

async fn healthz<S: LeaseStore>(State(app): State<Arc<AppState<S>>>) -> Response {
    // A read through the store proves it answers.
    let probe: JobId = "fence-healthz".parse().expect("valid job id");
    match app.store.get(&probe).await {
        Ok(_) => (StatusCode::OK, "ok\n").into_response(),
        Err(e) => ProblemResponse(Problem::new(
            ProblemType::StoreUnavailable,
            format!("the lease store failed: {}", error_chain(&e)),
        ))
        .into_response(),
    }
}

async fn render_metrics<S: LeaseStore>(State(app): State<Arc<AppState<S>>>) -> Response {
    match &app.metrics {
        Some(h) => ([(CONTENT_TYPE, "text/plain; version=0.0.4")], h.render()).into_response(),
        None => (StatusCode::NOT_FOUND, "metrics are not enabled\n").into_response(),
    }
}

async fn not_found(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    let detail = format!(
        "{method} {} is not part of the lease API; see POST /v1/leases/{{job}}/claim|renew|release|complete and GET /v1/leases/{{job}}",
        uri.path()
    );
    ProblemResponse(Problem::new(ProblemType::NotFound, detail)).into_response()
}

async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    let detail = format!(
        "{method} {} is not allowed: claim, renew, release and complete are POST; a job's record is GET",
        uri.path()
    );
    ProblemResponse(Problem::new(ProblemType::MethodNotAllowed, detail)).into_response()
}
