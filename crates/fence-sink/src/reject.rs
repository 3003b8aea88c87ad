//! Rejections: every answer the layer gives instead of the inner service, as problem+json.
//!
//! The fence and the idempotency runner describe what went wrong with the constructors here;
//! [`reject`] turns a problem into the response, so every rejection is shaped in one place.

use std::time::Duration;

use fence_core::{
    FencingToken, Generation, JobId, Problem, ProblemType,
    headers::{HeaderError, IdempotencyKey},
};
use http::{HeaderValue, Response, header::RETRY_AFTER};

use crate::{
    body::ResponseBody,
    budget::{Full, PEER_SHARE},
};

/// How long a client should wait before retrying a 503 or an in-flight 409.
pub(crate) const RETRY: Option<Duration> = Some(Duration::from_secs(1));

/// A problem+json response, with `Retry-After` where the client should come back. The problem
/// stays in its extensions: a gRPC call gets the same answer the gRPC way ([`grpc`]).
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
    response.extensions_mut().insert(problem);
    response
}

/// Whether a request is a gRPC call (contract section 9): its content type is
/// `application/grpc`, alone or followed by `+` (`+proto`, `+json`) or parameters (`;`), in
/// any case (a media type's name is case-insensitive, and servers lower-case it before they
/// dispatch). gRPC-Web (`application/grpc-web`) is not: its clients read HTTP statuses, and
/// the proxy sends it over HTTP/1.1 like any request; nor is another type that merely starts
/// the same (`application/grpcfoo`).
pub fn is_grpc(headers: &http::HeaderMap) -> bool {
    content_type(headers).is_some_and(|t| is_media_type(t, b"application/grpc"))
}

/// Whether the content type `t` is `name`, alone or followed by a `+` suffix or parameters
/// (`;`), in any case.
fn is_media_type(t: &[u8], name: &[u8]) -> bool {
    starts_with_ignore_case(t, name)
        && matches!(t.get(name.len()), None | Some(b'+' | b';' | b' ' | b'\t'))
}

fn content_type(headers: &http::HeaderMap) -> Option<&[u8]> {
    headers
        .get(http::header::CONTENT_TYPE)
        .map(HeaderValue::as_bytes)
}

/// Whether `value` starts with `prefix`, ASCII case ignored (a media type's name).
pub(crate) fn starts_with_ignore_case(value: &[u8], prefix: &[u8]) -> bool {
    value
        .get(..prefix.len())
        .is_some_and(|start| start.eq_ignore_ascii_case(prefix))
}

/// Whether a request's body carries whole messages that a service may act on one by one as
/// they arrive: gRPC (`application/grpc`, `application/grpc-web`) and Connect's streaming
/// calls (`application/connect+proto`, `+json`). When such a stream fails midway, the service
/// may be acting on the messages it got: the outcome is unknown. In any case, as
/// [`is_grpc`].
pub(crate) fn carries_messages(headers: &http::HeaderMap) -> bool {
    content_type(headers).is_some_and(|t| {
        [
            &b"application/grpc"[..],
            b"application/grpc-web",
            b"application/grpc-web-text",
        ]
        .iter()
        .any(|name| is_media_type(t, name))
            || starts_with_ignore_case(t, b"application/connect+")
    })
}

/// A rejection answered the gRPC way (contract section 9): see [`Problem::to_grpc_head`].
/// Any other response passes unchanged.
pub(crate) fn grpc<B>(response: Response<ResponseBody<B>>) -> Response<ResponseBody<B>> {
    let (mut head, body) = response.into_parts();
    let Some(problem) = head.extensions.remove::<Problem>() else {
        return Response::from_parts(head, body);
    };
    problem.to_grpc_head(&mut head.status, &mut head.headers);
    Response::from_parts(head, ResponseBody::full(bytes::Bytes::new()))
}

pub(crate) fn malformed(e: &HeaderError) -> Problem {
    Problem::new(ProblemType::MalformedToken, e.to_string())
}

pub(crate) fn missing(parts: &http::request::Parts) -> Problem {
    let detail = format!(
        "{} {} is fenced: send X-Fencing-Job and X-Fencing-Token with the job id and the generation of your lease",
        parts.method,
        parts.uri.path()
    );
    Problem::new(ProblemType::MissingToken, detail)
}

/// A problem about `job`'s `token`.
fn about(kind: ProblemType, job: JobId, token: FencingToken, detail: String) -> Problem {
    Problem::new(kind, detail)
        .with_job(job)
        .with_token(token.get())
}

pub(crate) fn invalid_signature(job: JobId, token: FencingToken, signed: bool) -> Problem {
    let detail = if signed {
        format!(
            "job {job}: the signature of token {token} is not valid for this job and generation under any key this destination trusts"
        )
    } else {
        format!(
            "job {job}: this destination requires signed tokens (<generation>.<expires_at_ms>.<signature>, as the lease server returned it); token {token} carries no signature"
        )
    };
    about(ProblemType::InvalidSignature, job, token, detail)
}

pub(crate) fn stale(
    job: JobId,
    token: FencingToken,
    highest: Generation,
    pending: Option<Generation>,
) -> Problem {
    let detail = match pending {
        Some(newer) => format!(
            "job {job}: token {token} is older than token {newer}, which a newer lease holder has presented (it is applied once older requests have finished and its write is on disk); a newer lease holder exists"
        ),
        None => format!(
            "job {job}: token {token} is below generation {highest}, which this destination has already seen; a newer lease holder exists"
        ),
    };
    about(ProblemType::StaleToken, job, token, detail).with_highest(highest.get())
}

pub(crate) fn expired(job: JobId, token: FencingToken, expires_at_ms: u64) -> Problem {
    let detail = format!(
        "job {job}: token {token} belongs to a lease that ended at {expires_at_ms} ms (Unix time, lease server's clock), beyond the allowed clock skew; a newer holder may have the job: stop work on it"
    );
    about(ProblemType::TokenExpired, job, token, detail).with_expires_at_ms(expires_at_ms)
}

pub(crate) fn too_long_lived(
    job: JobId,
    token: FencingToken,
    expires_at_ms: u64,
    latest_ms: u64,
) -> Problem {
    let detail = format!(
        "job {job}: token {token} claims a lease ending at {expires_at_ms} ms (Unix time), after {latest_ms} ms, the latest this destination accepts (now plus its longest lease TTL plus the clock skew): the lease server grants longer leases than this destination allows; its --max-ttl must not exceed the destination's --max-lease-ttl"
    );
    about(ProblemType::TokenTooLongLived, job, token, detail).with_expires_at_ms(expires_at_ms)
}

pub(crate) fn drain_timeout(job: JobId, token: FencingToken, highest: Generation) -> Problem {
    let detail = format!(
        "job {job}: token {token} was newer than every token before it, so older tokens are refused from now on, but requests with older tokens were still in flight when the drain limit ran out; retry"
    );
    about(ProblemType::DrainTimeout, job, token, detail).with_highest(highest.get())
}

/// The `which` store failed: the answer says how (the error itself, never its sources: a
/// database's error text names tables and hosts, a disk's paths, and anyone who can send
/// a request reads the answer); the whole chain goes to the log.
pub(crate) fn store_failed(
    job: &JobId,
    token: FencingToken,
    which: &str,
    e: &(dyn std::error::Error + 'static),
) -> Problem {
    crate::refusals::log_store_failure(which, job, e);
    let detail = format!(
        "job {job}: the {which} store failed ({e}); retry (this destination's log has the cause)"
    );
    about(ProblemType::StoreUnavailable, job.clone(), token, detail)
}

pub(crate) fn body_too_large(job: &JobId, key: &IdempotencyKey, limit: usize) -> Problem {
    let detail = format!(
        "job {job}: the body of a request with Idempotency-Key {key} is above the {limit} bytes this destination fingerprints"
    );
    Problem::new(ProblemType::PayloadTooLarge, detail).with_job(job.clone())
}

/// The body was not in within `limit`: before the fence decided (an `Idempotency-Key`'s
/// body, read whole from its arrival), or while it was streamed to the service (`streamed`,
/// counting from admission), which then saw its head and part of it.
pub(crate) fn body_timeout(
    job: &JobId,
    token: FencingToken,
    limit: std::time::Duration,
    streamed: bool,
) -> Problem {
    let detail = if streamed {
        format!(
            "job {job}: the request body did not arrive within {limit:?} of admission; the service saw the request's head and part of its body, cut short, so whether it acted is unknown unless it acts only on whole requests"
        )
    } else {
        format!(
            "job {job}: the request body did not arrive within {limit:?} of the request's arrival; the service did not see the request"
        )
    };
    about(ProblemType::BodyTimeout, job.clone(), token, detail)
}

pub(crate) fn overloaded(job: &JobId, max: usize, full: Full) -> Problem {
    let detail = match full {
        Full::Total => format!(
            "job {job}: the destination holds its maximum of {max} bytes of buffered bodies; nothing was passed on, retry"
        ),
        Full::Peer => format!(
            "job {job}: the destination holds this client's share ({} bytes, a {}th of its {max}) of buffered bodies; nothing was passed on, retry once this client's earlier bodies have arrived",
            max.div_ceil(PEER_SHARE),
            PEER_SHARE
        ),
    };
    Problem::new(ProblemType::Overloaded, detail).with_job(job.clone())
}

pub(crate) fn request_body_failed(job: &JobId, e: &dyn std::fmt::Display) -> Problem {
    let detail = format!("job {job}: reading the request body failed: {e}");
    Problem::new(ProblemType::BadRequest, detail).with_job(job.clone())
}

pub(crate) fn response_body_failed(job: &JobId, e: &dyn std::fmt::Display) -> Problem {
    let detail = format!("job {job}: the service's response body failed: {e}");
    Problem::new(ProblemType::Internal, detail).with_job(job.clone())
}

pub(crate) fn key_in_flight(job: &JobId, key: &IdempotencyKey) -> Problem {
    let detail = format!(
        "job {job}: a request with Idempotency-Key {key} is still in flight; retry when it has finished"
    );
    Problem::new(ProblemType::IdempotencyInFlight, detail).with_job(job.clone())
}

pub(crate) fn key_mismatch(job: &JobId, key: &IdempotencyKey) -> Problem {
    let detail = format!(
        "job {job}: Idempotency-Key {key} was already used for a request with a different method, path or body"
    );
    Problem::new(ProblemType::IdempotencyKeyMismatch, detail).with_job(job.clone())
}

pub(crate) fn not_replayable(job: &JobId, key: &IdempotencyKey) -> Problem {
    let detail = format!(
        "job {job}: the request with Idempotency-Key {key} already ran, but its response could not be kept (too large to store, over the memory budget or the stored records' cap while it arrived, or its body broke off), so it cannot be replayed"
    );
    Problem::new(ProblemType::IdempotencyNotReplayable, detail).with_job(job.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_is_its_media_type_not_a_prefix() {
        let of = |t: &str| {
            let mut headers = http::HeaderMap::new();
            headers.insert(http::header::CONTENT_TYPE, t.parse().unwrap());
            is_grpc(&headers)
        };
        for yes in [
            "application/grpc",
            "Application/GRPC+proto",
            "application/grpc+json",
            "application/grpc; charset=utf-8",
        ] {
            assert!(of(yes), "{yes}");
        }
        for no in [
            "application/grpc-web",
            "application/grpc-web+proto",
            "application/grpcfoo",
            "application/grp",
            "application/json",
        ] {
            assert!(!of(no), "{no}");
        }
        let messages = |t: &str| {
            let mut headers = http::HeaderMap::new();
            headers.insert(http::header::CONTENT_TYPE, t.parse().unwrap());
            carries_messages(&headers)
        };
        for yes in [
            "application/grpc",
            "application/grpc-web+proto",
            "application/grpc-web-text",
            "application/connect+json",
        ] {
            assert!(messages(yes), "{yes}");
        }
        for no in [
            "application/grpcfoo",
            "application/grpc-webx",
            "application/json",
        ] {
            assert!(!messages(no), "{no}");
        }
    }
}
