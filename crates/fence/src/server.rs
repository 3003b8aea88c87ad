//! The lease server: the HTTP lease API of PROTOCOL.md section 4 over any [`LeaseStore`].
//! Its clock decides; bodies are validated strictly, field by field.

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
use fence_core::{
    Generation, JobId, Owner, Problem, ProblemType,
    lease_api::{LeaseBody, RecordBody},
};
use fence_lease::{
    ClaimOutcome, FinishOutcome, Grant, LeaseRecord, LeaseStore, RenewOutcome, StoreError, Ttl,
};
use http_body_util::{BodyExt, Limited};
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::{Map, Value};

/// The largest request body the server reads.
pub const MAX_BODY: usize = 16 * 1024;

struct AppState<S> {
    store: Arc<S>,
    metrics: Option<PrometheusHandle>,
}

/// The lease API router over `store`; `/metrics` renders `metrics` when given.
pub fn router<S: LeaseStore>(store: Arc<S>, metrics: Option<PrometheusHandle>) -> Router {
    let state = Arc::new(AppState { store, metrics });
    Router::new()
        .route("/v1/leases/{job}/claim", post(claim::<S>))
        .route("/v1/leases/{job}/renew", post(renew::<S>))
        .route("/v1/leases/{job}/release", post(release::<S>))
        .route("/v1/leases/{job}/complete", post(complete::<S>))
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

fn job_of(path: Result<Path<String>, PathRejection>) -> Result<JobId, Problem> {
    let Path(raw) = path.map_err(|e| {
        bad(format!(
            "job: the path segment is not valid percent-encoded UTF-8: {e}"
        ))
    })?;
    JobId::new(raw).map_err(|e| bad(format!("job (in the path): {e}")))
}

/// Parses a JSON object with only `allowed` fields.
async fn object(body: Body, allowed: &[&str]) -> Result<Map<String, Value>, Problem> {
    let bytes = match Limited::new(body, MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            return Err(bad(format!("body: larger than {MAX_BODY} bytes")));
        }
        Err(e) => return Err(bad(format!("body: could not be read: {e}"))),
    };
    let value: Value =
        serde_json::from_slice(&bytes).map_err(|e| bad(format!("body: not valid JSON: {e}")))?;
    let Value::Object(map) = value else {
        return Err(bad("body: must be a JSON object"));
    };
    if let Some(unknown) = map.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(bad(format!(
            "{unknown}: unknown field; allowed: {}",
            allowed.join(", ")
        )));
    }
    Ok(map)
}

fn owner_of(map: &Map<String, Value>) -> Result<Owner, Problem> {
    match map.get("owner") {
        None => Err(bad("owner: missing")),
        Some(Value::String(s)) => Owner::new(s.as_str()).map_err(|e| bad(format!("owner: {e}"))),
        Some(_) => Err(bad("owner: must be a string")),
    }
}

fn u64_of(map: &Map<String, Value>, field: &str) -> Result<Option<u64>, Problem> {
    match map.get(field) {
        None => Ok(None),
        Some(Value::Number(n)) => n.as_u64().map(Some).ok_or_else(|| {
            bad(format!(
                "{field}: must be an integer from 0 to 18446744073709551615, got {n}"
            ))
        }),
        Some(_) => Err(bad(format!("{field}: must be an integer"))),
    }
}

fn generation_of(map: &Map<String, Value>) -> Result<Generation, Problem> {
    u64_of(map, "generation")?
        .map(Generation::new)
        .ok_or_else(|| bad("generation: missing"))
}

fn ttl_of(map: &Map<String, Value>) -> Result<Ttl, Problem> {
    match u64_of(map, "ttl_ms")? {
        None => Ok(Ttl::DEFAULT),
        Some(ms) => Ttl::from_millis(ms).map_err(|e| bad(format!("ttl_ms: {e}"))),
    }
}

fn store_failed(e: &StoreError) -> Problem {
    tracing::error!(error = %crate::error_chain(e), "lease store failed");
    Problem::new(
        ProblemType::Internal,
        format!("the lease store failed: {}", crate::error_chain(e)),
    )
}

fn json(value: &impl serde::Serialize) -> Response {
    let body = serde_json::to_vec(value).unwrap_or_default();
    ([(CONTENT_TYPE, "application/json")], body).into_response()
}

fn lease(job: &JobId, owner: &Owner, grant: &Grant) -> Response {
    json(&LeaseBody {
        job: job.clone(),
        owner: owner.clone(),
        generation: grant.generation.get(),
        ttl_ms: grant.ttl.as_millis(),
        expires_at_ms: grant.expires_at_ms,
        token: grant.token.clone(),
    })
}

/// The record body of the contract.
pub fn record_body(r: &LeaseRecord) -> RecordBody {
    RecordBody {
        job: r.job.clone(),
        owner: r.owner.clone(),
        generation: r.generation.get(),
        state: r.state.as_str().to_owned(),
        expires_in_ms: u64::try_from(r.expires_in.as_millis()).unwrap_or(u64::MAX),
    }
}

fn lost(job: JobId, owner: Option<Owner>, generation: Generation, what: &str) -> Problem {
    let holder = owner
        .as_ref()
        .map_or_else(|| "nobody".to_owned(), ToString::to_string);
    Problem::new(
        ProblemType::LeaseLost,
        format!(
            "job {job}: {what} refused: the lease is now generation {generation}, held by {holder}"
        ),
    )
    .with_job(job)
    .with_owner(owner)
    .with_generation(generation.get())
}

async fn claim<S: LeaseStore>(
    State(app): State<Arc<AppState<S>>>,
    path: Result<Path<String>, PathRejection>,
    body: Body,
) -> Response {
    let started = Instant::now();
    let answer = async {
        let job = job_of(path)?;
        let map = object(body, &["owner", "ttl_ms"]).await?;
        let (owner, ttl) = (owner_of(&map)?, ttl_of(&map)?);
        match app
            .store
            .claim(&job, &owner, ttl)
            .await
            .map_err(|e| store_failed(&e))?
        {
            ClaimOutcome::Granted(g) => Ok(lease(&job, &owner, &g)),
            ClaimOutcome::Held {
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
            ClaimOutcome::Completed { owner, generation } => Err(Problem::new(
                ProblemType::JobCompleted,
                format!(
                    "job {job} was completed at generation {generation} and cannot be claimed again"
                ),
            )
            .with_job(job)
            .with_owner(owner)
            .with_generation(generation.get())),
            _ => Err(Problem::new(ProblemType::Internal, "unknown claim outcome")),
        }
    }
    .await;
    finish("claim", started, answer)
}

async fn renew<S: LeaseStore>(
    State(app): State<Arc<AppState<S>>>,
    path: Result<Path<String>, PathRejection>,
    body: Body,
) -> Response {
    let started = Instant::now();
    let answer = async {
        let job = job_of(path)?;
        let map = object(body, &["owner", "generation", "ttl_ms"]).await?;
        let (owner, generation, ttl) = (owner_of(&map)?, generation_of(&map)?, ttl_of(&map)?);
        match app
            .store
            .renew(&job, &owner, generation, ttl)
            .await
            .map_err(|e| store_failed(&e))?
        {
            RenewOutcome::Renewed(g) => Ok(lease(&job, &owner, &g)),
            RenewOutcome::Lost { owner, generation } => {
                Err(lost(job, owner, generation, "renewal"))
            }
            _ => Err(Problem::new(ProblemType::Internal, "unknown renew outcome")),
        }
    }
    .await;
    finish("renew", started, answer)
}

async fn finish_op<S: LeaseStore>(
    app: &AppState<S>,
    path: Result<Path<String>, PathRejection>,
    body: Body,
    complete: bool,
) -> Answer {
    let job = job_of(path)?;
    let map = object(body, &["owner", "generation"]).await?;
    let (owner, generation) = (owner_of(&map)?, generation_of(&map)?);
    let outcome = if complete {
        app.store.complete(&job, &owner, generation).await
    } else {
        app.store.release(&job, &owner, generation).await
    };
    match outcome.map_err(|e| store_failed(&e))? {
        FinishOutcome::Done(r) => Ok(json(&record_body(&r))),
        FinishOutcome::Lost { owner, generation } => Err(lost(
            job,
            owner,
            generation,
            if complete { "completion" } else { "release" },
        )),
        _ => Err(Problem::new(ProblemType::Internal, "unknown outcome")),
    }
}

async fn release<S: LeaseStore>(
    State(app): State<Arc<AppState<S>>>,
    path: Result<Path<String>, PathRejection>,
    body: Body,
) -> Response {
    let started = Instant::now();
    let answer = finish_op(&app, path, body, false).await;
    finish("release", started, answer)
}

async fn complete<S: LeaseStore>(
    State(app): State<Arc<AppState<S>>>,
    path: Result<Path<String>, PathRejection>,
    body: Body,
) -> Response {
    let started = Instant::now();
    let answer = finish_op(&app, path, body, true).await;
    finish("complete", started, answer)
}

async fn status<S: LeaseStore>(
    State(app): State<Arc<AppState<S>>>,
    path: Result<Path<String>, PathRejection>,
) -> Response {
    let started = Instant::now();
    let answer = async {
        let job = job_of(path)?;
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
            format!("the lease store failed: {}", crate::error_chain(&e)),
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
