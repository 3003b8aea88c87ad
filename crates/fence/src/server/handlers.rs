//! The handlers of the lease API: act on a lease, read one, list them, health and metrics.

use std::{sync::Arc, time::Instant};

use axum::{
    Extension,
    body::Body,
    extract::{Path, State, rejection::PathRejection},
    http::{HeaderMap, Method, StatusCode, Uri, header::CONTENT_TYPE},
    response::{IntoResponse, Response},
};
use bytes::Bytes;
use fence_core::{
    JobId, Problem, ProblemType, Ttl,
    lease_api::{
        Action, BodyError, CheckpointRequest, ClaimRequest, DEFAULT_MAX_CHECKPOINT_BYTES,
        FinishRequest, MAX_CHECKPOINT_BODY, MAX_REQUEST_BODY, RenewRequest, RevokeRequest,
    },
};
use fence_lease::{LeaseOp, LeaseStore};
use fence_sink::PeerAddr;
use http_body_util::BodyExt;

use super::{
    AppState,
    answer::{
        Asking, answer, bad, finish, json, problem_response, record_body, store_error,
        store_read_failed,
    },
    guard::authorize,
};

pub(super) fn job_of(path: Result<String, PathRejection>) -> Result<JobId, Problem> {
    let raw = path.map_err(|e| {
        bad(format!(
            "job: the path segment is not valid percent-encoded UTF-8: {e}"
        ))
    })?;
    JobId::new(raw).map_err(|e| bad(format!("job (in the path): {e}")))
}

/// How long a lease API request's body may take to arrive once its head has: a body that
/// trickles (or never comes, after a `Content-Length`) would hold a connection slot for good.
pub(super) const BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Reads a request body of at most [`MAX_REQUEST_BODY`] bytes within [`BODY_TIMEOUT`] and
/// parses it with `parse`.
pub(super) async fn parse<T>(
    body: Body,
    parse: impl FnOnce(&[u8]) -> Result<T, BodyError>,
) -> Result<T, Problem> {
    let too_large = |limit| bad(format!("body: larger than {limit} bytes"));
    parse_within(body, (MAX_REQUEST_BODY, too_large), parse).await
}

/// [`parse`], for a body of at most `limit` bytes; a larger one is answered `too_large`.
async fn parse_within<T>(
    body: Body,
    (limit, too_large): (usize, impl FnOnce(usize) -> Problem),
    parse: impl FnOnce(&[u8]) -> Result<T, BodyError>,
) -> Result<T, Problem> {
    let read = tokio::time::timeout(BODY_TIMEOUT, read_within(body, limit));
    let Ok(read) = read.await else {
        return Err(Problem::new(
            ProblemType::BodyTimeout,
            format!(
                "body: did not arrive within {} s of the request's head; send it whole, promptly",
                BODY_TIMEOUT.as_secs()
            ),
        ));
    };
    let bytes: Bytes = match read {
        Ok(Some(b)) => b,
        Ok(None) => return Err(too_large(limit)),
        Err(e) => return Err(bad(format!("body: could not be read: {e}"))),
    };
    parse(&bytes).map_err(|e| bad(e.to_string()))
}

/// The body, when it holds at most `limit` bytes; `None` for a longer one, read on (and
/// thrown away, not kept) up to [`MAX_CHECKPOINT_BODY`] bytes more first: answered while
/// its client is still sending, the refusal would be lost to the reset a close with unread
/// bytes sends.
async fn read_within(mut body: Body, limit: usize) -> Result<Option<Bytes>, axum::Error> {
    let mut kept = bytes::BytesMut::new();
    let mut seen = 0usize;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        seen = seen.saturating_add(data.len());
        if seen <= limit {
            kept.extend_from_slice(&data);
        } else if seen > limit.saturating_add(MAX_CHECKPOINT_BODY) {
            return Ok(None);
        }
    }
    Ok((seen <= limit).then(|| kept.freeze()))
}

/// The operation a request body asks for, its TTL capped at `--max-ttl` and a claim's
/// lock-delay the server's default when it names none, and a revoke's reason.
async fn operation(
    action: Action,
    body: Body,
    options: &super::ServerOptions,
) -> Result<(LeaseOp, Option<String>), Problem> {
    let cap = |ttl: Ttl| options.max_ttl.map_or(ttl, |max| ttl.min(max));
    Ok((
        match action {
            Action::Revoke => {
                let RevokeRequest { reason } = parse(body, RevokeRequest::from_json).await?;
                return Ok((LeaseOp::Revoke, reason));
            }
            Action::Claim => {
                let ClaimRequest {
                    owner,
                    lease_key: key,
                    ttl,
                    lock_delay,
                } = parse(body, ClaimRequest::from_json).await?;
                let ttl = cap(ttl);
                let lock_delay = lock_delay.or(options.lock_delay);
                LeaseOp::Claim {
                    owner,
                    key,
                    ttl,
                    lock_delay,
                }
            }
            Action::Renew => {
                let RenewRequest {
                    owner,
                    generation,
                    lease_key: key,
                    ttl,
                } = parse(body, RenewRequest::from_json).await?;
                let ttl = cap(ttl);
                LeaseOp::Renew {
                    owner,
                    generation,
                    key,
                    ttl,
                }
            }
            Action::Checkpoint => {
                let most = options
                    .max_checkpoint_bytes
                    .unwrap_or(DEFAULT_MAX_CHECKPOINT_BYTES);
                // Read no more than the largest checkpoint this server takes can need,
                // JSON-escaped at worst (6 bytes a byte) with the other fields.
                let limit = most
                    .saturating_mul(6)
                    .saturating_add(1024)
                    .min(MAX_CHECKPOINT_BODY);
                let too_large = |limit| {
                    Problem::new(
                        ProblemType::PayloadTooLarge,
                        format!(
                            "checkpoint: the body is larger than {limit} bytes, more than a checkpoint this server takes ({most} bytes, --max-checkpoint-bytes) can need; save less, or a reference to where the rest is"
                        ),
                    )
                };
                let CheckpointRequest {
                    owner,
                    generation,
                    lease_key: key,
                    checkpoint: data,
                } = parse_within(body, (limit, too_large), CheckpointRequest::from_json).await?;
                if data.len() > most {
                    return Err(Problem::new(
                        ProblemType::PayloadTooLarge,
                        format!(
                            "checkpoint: {} bytes of UTF-8, more than this server takes ({most}, --max-checkpoint-bytes); save less, or a reference to where the rest is",
                            data.len()
                        ),
                    ));
                }
                LeaseOp::Checkpoint {
                    owner,
                    generation,
                    key,
                    data,
                }
            }
            Action::Release | Action::Complete => {
                let FinishRequest {
                    owner,
                    generation,
                    lease_key: key,
                } = parse(body, FinishRequest::from_json).await?;
                if action == Action::Complete {
                    LeaseOp::Complete {
                        owner,
                        generation,
                        key,
                    }
                } else {
                    LeaseOp::Release {
                        owner,
                        generation,
                        key,
                    }
                }
            }
        },
        None,
    ))
}

/// `POST /v1/leases/{job}/claim|renew|release|complete|revoke`.
pub(super) async fn act<S: LeaseStore>(
    State(app): State<Arc<AppState<S>>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    peer: Option<Extension<PeerAddr>>,
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
    let peer = peer.map(|Extension(PeerAddr(addr))| addr.ip());
    let answer = async {
        let job = job_of(job)?;
        let caller = authorize(app.options.auth.as_ref(), &headers, Some(&job))?;
        if action == Action::Revoke
            && let Some(caller) = caller.as_ref().filter(|c| !c.client().may_revoke())
        {
            return Err(Problem::new(
                ProblemType::Forbidden,
                format!(
                    "client {} may not revoke leases: its line in the auth file does not end with +revoke",
                    caller.client().name()
                ),
            )
            .with_job(job));
        }
        let wait = wait_of(uri.query(), action)?.map(|w| w.min(app.options.waiting.longest));
        let (op, reason) = operation(action, body, &app.options).await?;
        let (owner, asked) = (op.owner().cloned(), op.generation());
        let outcome = match wait {
            Some(wait) => {
                // Bounded per client and in all: a place is held while the claim waits.
                // Without an auth file the client is the address the claim comes from (a
                // mapped IPv4 address as IPv4), whose connection seats the limit protects.
                let by_address;
                let client = match caller.as_ref() {
                    Some(c) => c.client().name(),
                    None => {
                        by_address = peer
                            .map(|ip| format!("address {}", fence_sink::refusals::peer_key(ip)))
                            .unwrap_or_default();
                        &by_address
                    }
                };
                let waited = app.waiters.claim(&*app.store, &job, op, (wait, client)).await;
                let waited = waited.map_err(|e| store_error(&job, &e))?;
                waited.map_err(|too_many| {
                    let detail = match too_many {
                        super::wait::TooMany::Total(n) => format!(
                            "the server holds its most waiting claims ({n}, --max-waiting-claims); claim again later"
                        ),
                        super::wait::TooMany::Client(n) => format!(
                            "this client (without an auth file: this address) has its most waiting claims ({n}, --max-waiting-claims-per-client); claim again later"
                        ),
                    };
                    Problem::new(ProblemType::TooManyWaiters, detail).with_job(job.clone())
                })
            }
            None => app.store.apply(&job, op).await.map_err(|e| store_error(&job, &e)),
        }?;
        let wakes = match outcome {
            // Released, completed or revoked: a waiting claim may go.
            fence_lease::Outcome::Done(_) | fence_lease::Outcome::Revoked(_) => {
                action != Action::Checkpoint
            }
            // A grant moved the lease's end (a holder's claim again never moves it earlier,
            // as a renewal never does): the head waiter, asleep until the end it last saw,
            // looks again (one read, only for a job with waiters).
            fence_lease::Outcome::Granted(_) => true,
            _ => false,
        };
        if wakes {
            app.waiters.changed(&job);
        }
        let client = caller.as_ref().map(|c| c.client().name().to_owned());
        let asking = Asking { owner: owner.as_ref(), generation: asked, action, reason, client, peer };
        answer(job, &asking, outcome)
    }
    .await;
    finish(action.as_str(), started, answer)
}

/// The `wait` of a claim's query (`?wait=10s`, [`fence_core::lease_api::WAIT_PATTERN`]); `None` for none
/// or zero. Any other parameter, or `wait` on another action, is a bad request.
fn wait_of(query: Option<&str>, action: Action) -> Result<Option<std::time::Duration>, Problem> {
    let Some(query) = query.filter(|q| !q.is_empty()) else {
        return Ok(None);
    };
    let mut wait = None;
    // As any query string is read: empty pairs skipped, names and values percent-decoded.
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let decode = |part: &str| {
            fence_core::lease_api::decode_query_component(part)
                .map_err(|e| bad(format!("query: {e}")))
        };
        let (name, value) = (decode(name)?, decode(value)?);
        if name != "wait" || action != Action::Claim || wait.is_some() {
            return Err(bad(format!(
                "{name}: not a parameter of {}; only a claim takes one, wait (once)",
                action.as_str()
            )));
        }
        let d = fence_core::lease_api::parse_wait(&value).map_err(|e| bad(format!("wait: {e}")))?;
        wait = Some(d);
    }
    Ok(wait.filter(|d| !d.is_zero()))
}

/// `GET /v1/leases/{job}`.
pub(super) async fn status<S: LeaseStore>(
    State(app): State<Arc<AppState<S>>>,
    headers: HeaderMap,
    path: Result<Path<String>, PathRejection>,
) -> Response {
    let started = Instant::now();
    let answer = async {
        let job = job_of(path.map(|Path(job)| job))?;
        authorize(app.options.auth.as_ref(), &headers, Some(&job))?;
        match app
            .store
            .get(&job)
            .await
            .map_err(|e| store_read_failed(Some(&job), &e))?
        {
            Some(r) => Ok(json(&record_body(&r))),
            None => Err(Problem::new(
                ProblemType::UnknownJob,
                format!("job {job} has never been claimed, or was forgotten (--forget-after)"),
            )
            .with_job(job)),
        }
    }
    .await;
    finish("status", started, answer)
}

/// `GET /healthz` and `GET /readyz`: 200 when the store answers a read (the server is then
/// ready for lease calls), 503 `store-unavailable` when it does not. No secret needed: one
/// probe reaches the store at a time, its answer shared for a second.
pub(super) async fn healthz<S: LeaseStore>(State(app): State<Arc<AppState<S>>>) -> Response {
    // A read through the store proves it answers.
    let probe = async {
        let job: JobId = "fence-healthz".parse().expect("valid job id");
        app.store
            .get(&job)
            .await
            .map(|_| ())
            .map_err(|e| store_read_failed(None, &e))
    };
    match app.health.check(probe).await {
        Ok(()) => (StatusCode::OK, "ok\n").into_response(),
        Err(p) => problem_response(p),
    }
}

/// `GET /metrics`: needs a bearer secret when the server has an auth file, unless the
/// metrics are public.
pub(super) async fn render_metrics<S: LeaseStore>(
    State(app): State<Arc<AppState<S>>>,
    headers: HeaderMap,
) -> Response {
    if !app.options.public_metrics
        && let Err(p) = authorize(app.options.auth.as_ref(), &headers, None)
    {
        return problem_response(p);
    }
    match &app.options.metrics {
        Some(h) => ([(CONTENT_TYPE, "text/plain; version=0.0.4")], h.render()).into_response(),
        None => (StatusCode::NOT_FOUND, "metrics are not enabled\n").into_response(),
    }
}

pub(super) async fn not_found(method: Method, uri: Uri) -> Response {
    let (method, path) = quoted(&method, &uri);
    let detail = format!(
        "{method} {path} is not part of the lease API; see POST /v1/leases/{{job}}/claim|renew|release|complete|revoke|checkpoint, POST /v1/semaphores/{{resource}}/claim, GET /v1/leases/{{job}} and GET /v1/leases"
    );
    problem_response(Problem::new(ProblemType::NotFound, detail))
}

pub(super) async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    let (method, path) = quoted(&method, &uri);
    let detail = format!(
        "{method} {path} is not allowed: claim, renew, release, complete and revoke are POST; a job's record and the list are GET"
    );
    problem_response(Problem::new(ProblemType::MethodNotAllowed, detail))
}

/// The method and path of a request as a detail quotes them: cut short past a few hundred
/// bytes (a head may hold a 64 KiB path), so the detail's own advice survives the refusal
/// log's cut of details.
fn quoted(method: &Method, uri: &Uri) -> (String, String) {
    use fence_sink::refusals::{MAX_QUOTED, clipped};
    (
        clipped(method.as_str(), MAX_QUOTED).into_owned(),
        clipped(uri.path(), MAX_QUOTED).into_owned(),
    )
}
