//! The lease server's answers, read back: grants, records, and refusals as outcomes.

use std::time::Duration;

use fence_core::{
    Generation, JobId, Problem, ProblemType, Ttl,
    lease_api::{LeaseBody, RecordBody, SlotBody, slot_of},
};
use http::StatusCode;

use crate::store::{Grant, LeaseRecord, Outcome, StoreError};

/// The most of a `Retry-After` a client waits for: a longer one (or a server's mistake) is
/// taken as this, and the caller's own deadline still applies.
pub(super) const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);

/// A 502, 503 or 504, whoever answered it (the server, or a gateway in front of it), as
/// [`StoreError::Unavailable`]: the caller may not know whether its request took effect.
pub(super) fn unavailable(
    status: StatusCode,
    retry_after: Option<&http::HeaderValue>,
    body: &[u8],
) -> Option<StoreError> {
    if !matches!(
        status,
        StatusCode::BAD_GATEWAY | StatusCode::SERVICE_UNAVAILABLE | StatusCode::GATEWAY_TIMEOUT
    ) {
        return None;
    }
    let retry_after = seconds(retry_after);
    let detail = match serde_json::from_slice::<Problem>(body) {
        Ok(p) => p.detail,
        Err(_) => String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned(),
    };
    Some(StoreError::Unavailable {
        status: status.as_u16(),
        detail,
        retry_after,
    })
}

/// A 429 `urn:fence:too-many-waiters` (a claim that had to wait, and the server's waiting
/// places were full) as [`StoreError::TooManyWaiters`]: the job was held, nothing changed.
pub(super) fn crowded(
    status: StatusCode,
    retry_after: Option<&http::HeaderValue>,
    body: &[u8],
) -> Option<StoreError> {
    if status != StatusCode::TOO_MANY_REQUESTS {
        return None;
    }
    let problem = serde_json::from_slice::<Problem>(body).ok()?;
    (problem.kind == ProblemType::TooManyWaiters).then(|| StoreError::TooManyWaiters {
        detail: problem.detail,
        retry_after: seconds(retry_after),
    })
}

/// The slot a semaphore claim of `slots` slots of `resource` was granted, checked against
/// what was asked (as the Go, Python and TypeScript clients check it): a slot from 1 to
/// `slots`, on the job `resource#slot`, and the answer's `resource` and `slots` those asked.
/// Otherwise a protocol error: which slot's job the grant is on is not known, so nothing can
/// release it, and holding a slot past the number asked would make more holders than that.
pub(super) fn granted_slot(
    resource: &JobId,
    slots: u32,
    answer: &SlotBody,
) -> Result<u32, StoreError> {
    let SlotBody { lease, slot: k, .. } = answer;
    if (1..=slots).contains(k)
        && answer.resource == *resource
        && answer.slots == slots
        && slot_of(&lease.job) == Some((resource.as_str(), *k))
    {
        return Ok(*k);
    }
    Err(StoreError::Protocol(format!(
        "a claim of semaphore {resource} ({slots} slots) was answered with job {}, slot {k} of resource {} ({} slots)",
        lease.job, answer.resource, answer.slots
    )))
}

/// A `Retry-After` in seconds, at most [`MAX_RETRY_AFTER`]: an HTTP-date (or anything else)
/// is no answer, and the caller's backoff decides.
fn seconds(retry_after: Option<&http::HeaderValue>) -> Option<Duration> {
    retry_after
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(|secs| Duration::from_secs(secs).min(MAX_RETRY_AFTER))
}

pub(super) fn unexpected(status: StatusCode, body: &[u8]) -> StoreError {
    // The lease server's own 408 (`body-timeout`: the request's body did not arrive whole in
    // time) applied nothing, and asking again may pass. A gateway's 408 may not mean that:
    // envoy answers 408 when the upstream sent no head within its stream idle timeout,
    // after it forwarded the request (a waiting claim behind it): its answer is lost.
    if status == StatusCode::REQUEST_TIMEOUT {
        return match serde_json::from_slice::<Problem>(body) {
            Ok(p) if p.kind == ProblemType::BodyTimeout => StoreError::Busy(format!(
                "the request did not arrive in time (408): {}",
                p.detail
            )),
            Ok(p) => StoreError::Unavailable {
                status: status.as_u16(),
                detail: format!("{} ({})", p.detail, p.kind),
                retry_after: None,
            },
            Err(_) => StoreError::Unavailable {
                status: status.as_u16(),
                detail: String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned(),
                retry_after: None,
            },
        };
    }
    match serde_json::from_slice::<Problem>(body) {
        Ok(p)
            if matches!(
                p.kind,
                ProblemType::Unauthenticated | ProblemType::Forbidden
            ) =>
        {
            StoreError::Denied {
                status: status.as_u16(),
                detail: p.detail,
            }
        }
        Ok(p) if permanent(status) => StoreError::Refused {
            status: status.as_u16(),
            detail: format!("{} ({})", p.detail, p.kind),
        },
        Ok(p) => StoreError::Protocol(format!("{status}: {} ({})", p.detail, p.kind)),
        Err(_) => StoreError::Protocol(format!(
            "{status}: {}",
            String::from_utf8_lossy(&body[..body.len().min(200)])
        )),
    }
}

/// A 4xx that asking again cannot change: not 408 (the request took too long), 409 (a
/// conflict with what the job is doing now, such as a key's request in flight) or 429 (too
/// many), which a later try may pass. Only a problem body counts: a gateway's own 4xx page
/// says nothing of what the lease server would answer.
fn permanent(status: StatusCode) -> bool {
    status.is_client_error()
        && !matches!(
            status,
            StatusCode::REQUEST_TIMEOUT | StatusCode::CONFLICT | StatusCode::TOO_MANY_REQUESTS
        )
}

pub(super) fn decode<T: serde::de::DeserializeOwned>(
    status: StatusCode,
    body: &[u8],
) -> Result<T, StoreError> {
    serde_json::from_slice(body)
        .map_err(|e| StoreError::Protocol(format!("{status} with an unreadable body: {e}")))
}

pub(super) fn grant(status: StatusCode, body: &[u8]) -> Result<Grant, StoreError> {
    let lease: LeaseBody = decode(status, body)?;
    let ttl = Ttl::from_millis(lease.ttl_ms)
        .map_err(|e| StoreError::Protocol(format!("server granted an invalid ttl: {e}")))?;
    Ok(Grant {
        generation: lease.generation,
        ttl,
        expires_at_ms: lease.expires_at_ms,
        token: lease.token,
        checkpoint: lease.checkpoint,
    })
}

pub(super) fn record(status: StatusCode, body: &[u8]) -> Result<LeaseRecord, StoreError> {
    decode(status, body).map(from_body)
}

pub(super) fn from_body(r: RecordBody) -> LeaseRecord {
    LeaseRecord {
        job: r.job,
        owner: r.owner,
        generation: r.generation,
        state: r.state,
        expires_in: Duration::from_millis(r.expires_in_ms),
    }
}

/// The outcome a refusal stands for, by its problem type.
pub(super) fn refused(status: StatusCode, body: &[u8]) -> Result<Outcome, StoreError> {
    let Ok(p) = serde_json::from_slice::<Problem>(body) else {
        return Err(unexpected(status, body));
    };
    let generation = Generation::new(p.generation.unwrap_or(0));
    match p.kind {
        ProblemType::LeaseHeld => Ok(Outcome::Held {
            owner: p
                .owner
                .ok_or_else(|| StoreError::Protocol("lease-held without an owner".into()))?,
            generation,
            expires_in: Duration::from_millis(p.expires_in_ms.unwrap_or(0)),
            lock_delay: false,
        }),
        ProblemType::LockDelay => Ok(Outcome::Held {
            owner: p
                .owner
                .ok_or_else(|| StoreError::Protocol("lock-delay without an owner".into()))?,
            generation,
            expires_in: Duration::from_millis(p.claimable_in_ms.unwrap_or(0)),
            lock_delay: true,
        }),
        ProblemType::JobCompleted => Ok(Outcome::Completed {
            owner: p.owner,
            generation,
        }),
        ProblemType::LeaseLost => Ok(Outcome::Lost {
            owner: p.owner,
            generation,
        }),
        ProblemType::LeaseKeyMismatch => Ok(Outcome::KeyMismatch),
        ProblemType::UnknownJob => Ok(Outcome::Unknown),
        ProblemType::SemaphoreSize => Ok(Outcome::SemaphoreSize {
            slots: p
                .slots
                .ok_or_else(|| StoreError::Protocol("semaphore-size without slots".into()))?,
        }),
        _ => Err(unexpected(status, body)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(v: &str) -> http::HeaderValue {
        http::HeaderValue::from_str(v).unwrap()
    }

    /// 502, 503 and 504 are unavailable whoever answered, with the server's detail and a
    /// `Retry-After` in seconds, capped; anything else is not.
    #[test]
    fn gateway_and_unavailable_answers_are_unavailable_with_their_retry_after() {
        let problem = br#"{"type":"urn:fence:store-unavailable","title":"t","status":503,"detail":"the disk did not confirm"}"#;
        let got = unavailable(StatusCode::SERVICE_UNAVAILABLE, Some(&header("2")), problem);
        assert!(
            matches!(&got, Some(StoreError::Unavailable { status: 503, detail, retry_after: Some(d) })
                if detail == "the disk did not confirm" && *d == Duration::from_secs(2)),
            "{got:?}"
        );
        for (status, after) in [
            (StatusCode::BAD_GATEWAY, None),
            (
                StatusCode::GATEWAY_TIMEOUT,
                Some(header("Wed, 21 Oct 2026 07:28:00 GMT")),
            ),
            (StatusCode::SERVICE_UNAVAILABLE, Some(header("-1"))),
        ] {
            let got = unavailable(status, after.as_ref(), b"<html>bad gateway</html>");
            assert!(
                matches!(&got, Some(StoreError::Unavailable { detail, retry_after: None, .. })
                    if detail == "<html>bad gateway</html>"),
                "{status}: {got:?}"
            );
        }
        let huge = unavailable(
            StatusCode::SERVICE_UNAVAILABLE,
            Some(&header("99999999999")),
            b"",
        );
        assert!(
            matches!(huge, Some(StoreError::Unavailable { retry_after: Some(d), .. }) if d == MAX_RETRY_AFTER)
        );
        for status in [
            StatusCode::INTERNAL_SERVER_ERROR,
            StatusCode::CONFLICT,
            StatusCode::OK,
        ] {
            assert!(
                unavailable(status, Some(&header("1")), b"").is_none(),
                "{status}"
            );
        }
    }

    /// A slot grant is taken only as what was asked: a slot in range, on its own job, of the
    /// resource and number of slots asked.
    #[test]
    fn a_slot_grant_other_than_asked_is_a_protocol_error() {
        let resource: JobId = "exports".parse().unwrap();
        let body = |job: &str, resource: &str, slot: u32, slots: u32| -> SlotBody {
            let json = format!(
                r#"{{"job":"{job}","owner":"w","generation":1,"ttl_ms":30000,"expires_at_ms":5,"resource":"{resource}","slot":{slot},"slots":{slots}}}"#
            );
            serde_json::from_str(&json).unwrap()
        };
        let ok = body("exports#2", "exports", 2, 3);
        assert_eq!(granted_slot(&resource, 3, &ok).unwrap(), 2);
        for (what, bad) in [
            (
                "a slot past those asked",
                body("exports#4", "exports", 4, 3),
            ),
            ("slot 0", body("exports#0", "exports", 0, 3)),
            ("another job", body("exports#1", "exports", 2, 3)),
            ("another resource", body("other#2", "other", 2, 3)),
            ("another resource member", body("exports#2", "other", 2, 3)),
            (
                "another number of slots",
                body("exports#2", "exports", 2, 4),
            ),
        ] {
            let got = granted_slot(&resource, 3, &bad);
            assert!(
                matches!(got, Err(StoreError::Protocol(_))),
                "{what}: {got:?}"
            );
        }
    }

    /// A 429 too-many-waiters is the server's waiting places full, with its Retry-After; a
    /// 429 of another type, or not a problem, is not.
    #[test]
    fn too_many_waiters_is_its_own_error_with_its_retry_after() {
        let body = br#"{"type":"urn:fence:too-many-waiters","title":"t","status":429,"detail":"the server holds its most waiting claims (2, --max-waiting-claims); claim again later","job":"j"}"#;
        let got = crowded(StatusCode::TOO_MANY_REQUESTS, Some(&header("1")), body);
        assert!(
            matches!(&got, Some(StoreError::TooManyWaiters { detail, retry_after: Some(d) })
                if detail.contains("most waiting claims") && *d == Duration::from_secs(1)),
            "{got:?}"
        );
        let got = got.unwrap();
        assert!(!got.is_permanent() && !got.answer_lost(), "{got:?}");
        let overloaded =
            br#"{"type":"urn:fence:overloaded","title":"t","status":429,"detail":"no"}"#;
        assert!(crowded(StatusCode::TOO_MANY_REQUESTS, None, overloaded).is_none());
        assert!(crowded(StatusCode::TOO_MANY_REQUESTS, None, b"slow down").is_none());
        assert!(crowded(StatusCode::CONFLICT, None, body).is_none());
    }

    /// A 4xx problem other than authentication, 408, 409 and 429 is a refusal that asking
    /// again cannot change; a 5xx, a 408, a 409, a 429 and any answer that is not a problem
    /// are not. The lease server's own 408 (`body-timeout`) is busy: nothing was applied;
    /// another 408 (a gateway's) leaves the answer lost.
    #[test]
    fn a_client_error_problem_is_a_permanent_refusal_and_nothing_else_is() {
        let problem = |status: u16, kind: &str| {
            format!(r#"{{"type":"urn:fence:{kind}","title":"t","status":{status},"detail":"no"}}"#)
        };
        let bad = unexpected(
            StatusCode::BAD_REQUEST,
            problem(400, "bad-request").as_bytes(),
        );
        assert!(
            matches!(&bad, StoreError::Refused { status: 400, detail } if detail.starts_with("no")),
            "{bad:?}"
        );
        assert!(bad.is_permanent());
        let denied = unexpected(
            StatusCode::UNAUTHORIZED,
            problem(401, "unauthenticated").as_bytes(),
        );
        assert!(
            matches!(denied, StoreError::Denied { status: 401, .. }),
            "{denied:?}"
        );
        assert!(denied.is_permanent());
        for (status, body) in [
            (StatusCode::TOO_MANY_REQUESTS, problem(429, "overloaded")),
            (StatusCode::CONFLICT, problem(409, "idempotency-in-flight")),
            (StatusCode::INTERNAL_SERVER_ERROR, problem(500, "internal")),
            (
                StatusCode::BAD_REQUEST,
                "<html>a gateway's page</html>".to_owned(),
            ),
        ] {
            let got = unexpected(status, body.as_bytes());
            assert!(
                matches!(got, StoreError::Protocol(_)) && !got.is_permanent(),
                "{status} {body}: {got:?}"
            );
        }
        // The lease server's own 408 applied nothing; a gateway's may come after it
        // forwarded the request (envoy's stream idle timeout): its answer is lost.
        let body = problem(408, "body-timeout");
        let got = unexpected(StatusCode::REQUEST_TIMEOUT, body.as_bytes());
        assert!(
            matches!(got, StoreError::Busy(_)) && !got.is_permanent() && !got.answer_lost(),
            "{body}: {got:?}"
        );
        for body in [
            "upstream request timeout".to_owned(),
            problem(408, "internal"),
        ] {
            let got = unexpected(StatusCode::REQUEST_TIMEOUT, body.as_bytes());
            assert!(
                matches!(got, StoreError::Unavailable { status: 408, .. })
                    && !got.is_permanent()
                    && got.answer_lost(),
                "{body}: {got:?}"
            );
        }
    }
}
