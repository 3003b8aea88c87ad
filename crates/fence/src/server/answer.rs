//! What the server answers: a store's outcome as the contract's JSON or problem, and its log.

use std::{net::IpAddr, time::Instant};

use axum::{
    body::Body,
    http::{
        HeaderValue,
        header::{CONTENT_TYPE, RETRY_AFTER, WWW_AUTHENTICATE},
    },
    response::{IntoResponse, Response},
};
use fence_core::{
    Generation, JobId, Owner, Problem, ProblemType,
    lease_api::{Action, LeaseBody, RecordBody},
};
use fence_lease::{LeaseRecord, Outcome, StoreError};

/// An answer, or the problem that refused the request.
pub(super) type Answer = Result<Response, Problem>;

/// A problem as a response; a 401 says how to authenticate.
pub(super) fn problem_response(p: Problem) -> Response {
    let kind = p.kind;
    let mut response = p.to_response::<Body>();
    // For the refusal log (`mark_authenticated`).
    response.extensions_mut().insert(p);
    match kind {
        ProblemType::Unauthenticated => {
            response.headers_mut().insert(
                WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"fence\""),
            );
        }
        ProblemType::StoreUnavailable | ProblemType::TooManyWaiters => {
            response
                .headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from_static("1"));
        }
        ProblemType::LockDelay => {
            // Whole seconds, rounded up: a client that comes back then finds the job free.
            let secs = response
                .extensions()
                .get::<Problem>()
                .and_then(|p| p.claimable_in_ms)
                .map_or(1, |ms| ms.div_ceil(1000).max(1));
            response
                .headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(secs));
        }
        _ => {}
    }
    response
}

/// Counts and times `op`, and turns the answer into a response.
pub(super) fn finish(op: &'static str, started: Instant, answer: Answer) -> Response {
    let outcome = match &answer {
        Ok(_) => "ok",
        Err(p) => outcome_of(p.kind),
    };
    metrics::counter!("fence_lease_requests_total", "op" => op, "outcome" => outcome).increment(1);
    metrics::histogram!("fence_lease_request_seconds", "op" => op)
        .record(started.elapsed().as_secs_f64());
    answer.unwrap_or_else(problem_response)
}

/// The `outcome` label of a refusal: one of [`LEASE_OUTCOMES`].
pub(super) const fn outcome_of(kind: ProblemType) -> &'static str {
    match kind {
        ProblemType::LeaseHeld => "held",
        ProblemType::LeaseLost => "lost",
        ProblemType::LeaseKeyMismatch => "key_mismatch",
        ProblemType::JobCompleted => "completed",
        ProblemType::UnknownJob => "unknown",
        ProblemType::BadRequest => "bad_request",
        ProblemType::Unauthenticated => "unauthenticated",
        ProblemType::Forbidden => "forbidden",
        ProblemType::TooManyWaiters => "too_many_waiters",
        ProblemType::LockDelay => "lock_delay",
        ProblemType::PayloadTooLarge => "too_large",
        ProblemType::SemaphoreSize => "semaphore_size",
        _ => "error",
    }
}

/// The `op` labels of `fence_lease_requests_total`, for its HELP text.
pub const LEASE_OPS: &[&str] = &[
    "claim",
    "renew",
    "release",
    "complete",
    "revoke",
    "checkpoint",
    "claim_slot",
    "status",
    "list",
];

/// The `outcome` labels of `fence_lease_requests_total`, for its HELP text.
pub const LEASE_OUTCOMES: &[&str] = &[
    "ok",
    "held",
    "lost",
    "key_mismatch",
    "completed",
    "unknown",
    "bad_request",
    "unauthenticated",
    "forbidden",
    "too_many_waiters",
    "lock_delay",
    "too_large",
    "semaphore_size",
    "error",
];

pub(super) fn bad(detail: impl Into<String>) -> Problem {
    Problem::new(ProblemType::BadRequest, detail)
}

/// A store failure: 503 with `Retry-After`, since a retry may find the store back. Whether
/// the request took effect is unknown: a store can fail after its decision was applied (a
/// sled write whose log sync failed, a PostgreSQL connection lost after its commit was sent),
/// so the detail says how to retry safely rather than that nothing happened. The cause goes
/// to the server's log only: a database's error text names tables and hosts, and anyone who
/// can connect reads the answer, rate-limited like refusals (a store that is down fails
/// every request).
fn store_failed(job: Option<&JobId>, e: &StoreError) -> Problem {
    fence_sink::refusals::log_store_failure("lease", job, e);
    Problem::new(
        ProblemType::StoreUnavailable,
        "the lease store failed; whether the request took effect is unknown: retry with the \
         same owner and lease key (the server's log has the cause)",
    )
}

/// A store failure on a read (a lease's status, a list, the health probe): nothing was
/// asked to change, so the answer only says to retry. The cause goes to the log only,
/// rate-limited like refusals.
pub(super) fn store_read_failed(job: Option<&JobId>, e: &StoreError) -> Problem {
    fence_sink::refusals::log_store_failure("lease", job, e);
    Problem::new(
        ProblemType::StoreUnavailable,
        "the lease store did not answer; retry (the server's log has the cause)",
    )
}

/// A store's error for `job`: 400 for what no store may do for that job id (a plain claim
/// of a semaphore's slot, a claim past the last generation) or a request refused as asked,
/// else [`store_failed`].
pub(super) fn store_error(job: &JobId, e: &StoreError) -> Problem {
    match e {
        StoreError::Reserved { job, .. } | StoreError::GenerationExhausted(job) => {
            bad(e.to_string()).with_job(job.clone())
        }
        StoreError::Refused { detail, .. } => bad(detail.clone()),
        // Logged by the refusal log (rate-limited): nothing failed, and nothing was decided.
        StoreError::Busy(why) => Problem::new(
            ProblemType::StoreUnavailable,
            format!("{why}: nothing was decided; ask again after Retry-After"),
        ),
        StoreError::Timeout(within) => {
            fence_sink::refusals::log_store_failure("lease", job, e);
            Problem::new(
                ProblemType::StoreUnavailable,
                format!(
                    "the lease store did not confirm within {within:?} that the decision is on \
                     disk; whether it took effect is unknown: retry with the same owner and \
                     lease key (a claim retried so gets the same lease back while it has not \
                     expired; a release or completion that took effect answers lease-lost)"
                ),
            )
        }
        _ => store_failed(Some(job), e),
    }
}

pub(super) fn json(value: &impl serde::Serialize) -> Response {
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
        token: None,
    }
}

/// What a request asked for, as the answer and its log need it.
pub(super) struct Asking<'a> {
    /// Who asks (nobody for a revoke).
    pub(super) owner: Option<&'a Owner>,
    /// The generation the request named (none for a claim or a revoke).
    pub(super) generation: Option<Generation>,
    pub(super) action: Action,
    /// A revoke's reason.
    pub(super) reason: Option<String>,
    /// The auth-file client that asks (none without an auth file).
    pub(super) client: Option<String>,
    /// The address it asks from, for the rate limit of the refusals' log.
    pub(super) peer: Option<IpAddr>,
}

/// Whether a refusal of `kind` to `asking` is logged now (`fence_sink::refusals`: at most
/// so many per kind and peer in a window): the number left out before it, for its event's
/// `suppressed` field (`None` when there were none), or `None` when it is left out too.
fn logged(kind: ProblemType, asking: &Asking<'_>) -> Option<Option<u64>> {
    fence_sink::refusals::admit_refusal(kind, asking.peer)
        .map(|left_out| (left_out > 0).then_some(left_out))
}

/// The HTTP answer to what the store decided, logged as one event with the job and the
/// generation (never the lease key); a refusal under the refusal log's rate limit per kind
/// and peer, so a client looping on a held job cannot fill a disk.
pub(super) fn answer(job: JobId, asking: &Asking<'_>, outcome: Outcome) -> Answer {
    let Asking {
        action,
        generation: asked,
        ..
    } = *asking;
    let owner = asking.owner.map_or("-", Owner::as_str);
    let peer = asking.peer.map(tracing::field::display);
    let what = match action {
        Action::Claim => "claim",
        Action::Renew => "renewal",
        Action::Release => "release",
        Action::Complete => "completion",
        Action::Revoke => "revoke",
        Action::Checkpoint => "checkpoint",
    };
    match outcome {
        Outcome::Granted(g) => {
            if action == Action::Claim {
                tracing::info!(job = %job, generation = g.generation.get(), owner = %owner, ttl_ms = g.ttl.as_millis(), "claim granted");
            } else {
                tracing::debug!(job = %job, generation = g.generation.get(), owner = %owner, "lease renewed");
            }
            let owner = asking.owner.cloned().ok_or_else(|| {
                Problem::new(ProblemType::Internal, "a lease granted to nobody")
            })?;
            Ok(json(&LeaseBody {
                job,
                owner,
                generation: g.generation,
                ttl_ms: g.ttl.as_millis(),
                expires_at_ms: g.expires_at_ms,
                token: g.token,
                checkpoint: g.checkpoint,
            }))
        }
        Outcome::Done(record) => {
            let done = match action {
                Action::Complete => "lease completed",
                Action::Checkpoint => "checkpoint saved",
                _ => "lease released",
            };
            tracing::info!(job = %job, generation = record.generation.get(), owner = %owner, state = %record.state, "{done}");
            Ok(json(&record_body(&record)))
        }
        Outcome::Held {
            owner: holder,
            generation,
            expires_in,
            lock_delay: true,
        } => {
            // Logged once, by the refusal log (`mark_authenticated`).
            let ms = u64::try_from(expires_in.as_millis()).unwrap_or(u64::MAX);
            Err(Problem::new(
                ProblemType::LockDelay,
                format!(
                    "job {job}: the lease of {holder} (generation {generation}) expired and its lock-delay lets nobody claim the job for another {ms} ms"
                ),
            )
            .with_job(job)
            .with_owner(Some(holder))
            .with_generation(generation.get())
            .with_claimable_in_ms(ms))
        }
        Outcome::Held {
            owner: holder,
            generation,
            expires_in,
            ..
        } => {
            let ms = u64::try_from(expires_in.as_millis()).unwrap_or(u64::MAX);
            if let Some(suppressed) = logged(ProblemType::LeaseHeld, asking) {
                tracing::info!(job = %job, generation = generation.get(), owner = %owner, holder = %holder, expires_in_ms = ms, peer, suppressed, "claim refused: held");
            }
            Err(Problem::new(
                ProblemType::LeaseHeld,
                format!("job {job} is held by {holder} for another {ms} ms"),
            )
            .with_job(job)
            .with_owner(Some(holder))
            .with_generation(generation.get())
            .with_expires_in_ms(ms))
        }
        Outcome::Completed { owner, generation } => {
            if let Some(suppressed) = logged(ProblemType::JobCompleted, asking) {
                tracing::info!(job = %job, generation = generation.get(), peer, suppressed, "claim refused: completed");
            }
            Err(Problem::new(
                ProblemType::JobCompleted,
                format!(
                    "job {job} was completed at generation {generation} and cannot be claimed again"
                ),
            )
            .with_job(job)
            .with_owner(owner)
            .with_generation(generation.get()))
        }
        Outcome::KeyMismatch => {
            if let Some(suppressed) = logged(ProblemType::LeaseKeyMismatch, asking) {
                tracing::warn!(job = %job, generation = asked.map(Generation::get), owner = %owner, peer, suppressed, "{what} refused: wrong lease key");
            }
            Err(Problem::new(
                ProblemType::LeaseKeyMismatch,
                format!(
                    "job {job}: {what} refused: the lease key is not the one this lease was claimed with; nothing changed"
                ),
            )
            .with_job(job))
        }
        Outcome::Lost {
            owner: holder,
            generation,
        } => {
            let who = holder
                .as_ref()
                .map_or_else(|| "nobody".to_owned(), ToString::to_string);
            if let Some(suppressed) = logged(ProblemType::LeaseLost, asking) {
                tracing::info!(job = %job, generation = asked.map(Generation::get), current = generation.get(), owner = %owner, peer, suppressed, "{what} refused: lease lost");
            }
            Err(Problem::new(
                ProblemType::LeaseLost,
                format!(
                    "job {job}: {what} refused: the lease is now generation {generation}, held by {who}"
                ),
            )
            .with_job(job)
            .with_owner(holder)
            .with_generation(generation.get()))
        }
        Outcome::Revoked(r) => {
            let reason = asking.reason.as_deref().unwrap_or("");
            let by = asking.client.as_deref();
            tracing::warn!(job = %job, generation = r.record.generation.get(), reason, by, "lease revoked");
            let mut body = record_body(&r.record);
            body.token = r.token;
            Ok(json(&body))
        }
        Outcome::Unknown => Err(Problem::new(
            ProblemType::UnknownJob,
            format!("job {job} has never been claimed, or was forgotten (--forget-after): there is no lease to {action}"),
        )
        .with_job(job)),
        _ => Err(Problem::new(ProblemType::Internal, "unknown lease outcome")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store that timed out may have decided: its answer must not say nothing was.
    #[test]
    fn a_store_timeout_says_the_outcome_is_unknown_and_how_to_retry() {
        let job: fence_core::JobId = "j".parse().unwrap();
        let within = std::time::Duration::from_secs(5);
        let timed_out = store_error(&job, &StoreError::Timeout(within));
        assert_eq!(
            (timed_out.kind, timed_out.status),
            (ProblemType::StoreUnavailable, 503)
        );
        assert!(
            timed_out.detail.contains("within 5s"),
            "{}",
            timed_out.detail
        );
        assert!(timed_out.detail.contains("unknown"), "{}", timed_out.detail);
        assert!(
            timed_out.detail.contains("same owner and lease key"),
            "{}",
            timed_out.detail
        );
        // A failure may come after the decision was applied: never "nothing was decided".
        let failed = store_error(&job, &StoreError::io(std::io::Error::other("disk gone")));
        assert!(failed.detail.contains("unknown"), "{}", failed.detail);
        assert!(
            failed.detail.contains("same owner and lease key"),
            "{}",
            failed.detail
        );
        assert!(!failed.detail.contains("disk gone"), "{}", failed.detail);
    }

    /// A request that found the server busy before it reached the store (a burst of
    /// semaphore claims of one resource) decided nothing, and says so: not "unknown".
    #[test]
    fn a_busy_store_says_nothing_was_decided() {
        let job: JobId = "exports".parse().unwrap();
        let busy = store_error(
            &job,
            &StoreError::Busy("claims queued before it".to_owned()),
        );
        assert_eq!(
            (busy.kind, busy.status),
            (ProblemType::StoreUnavailable, 503)
        );
        assert!(
            busy.detail.contains("nothing was decided"),
            "{}",
            busy.detail
        );
        assert!(
            busy.detail.contains("claims queued before it"),
            "{}",
            busy.detail
        );
        assert!(!busy.detail.contains("unknown"), "{}", busy.detail);
    }

    /// A job at the last generation can never be claimed again: a request that cannot
    /// succeed (400, naming why), not a store failure whose retry would never end.
    #[test]
    fn an_exhausted_generation_is_a_bad_request_not_a_store_failure() {
        let job: fence_core::JobId = "j".parse().unwrap();
        let exhausted = store_error(&job, &StoreError::GenerationExhausted(job.clone()));
        assert_eq!(
            (exhausted.kind, exhausted.status),
            (ProblemType::BadRequest, 400)
        );
        assert!(
            exhausted.detail.contains("cannot be claimed again"),
            "{}",
            exhausted.detail
        );
        assert_eq!(exhausted.job, Some(job));
    }
}
