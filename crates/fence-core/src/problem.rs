//! RFC 9457 problem details with the `urn:fence:*` types of the wire contract.
//!
//! ```
//! use fence_core::{Problem, ProblemType};
//!
//! let p = Problem::new(ProblemType::StaleToken, "token 7 is below the highest accepted, 8")
//!     .with_job("invoice-42".parse()?)
//!     .with_token(7)
//!     .with_highest(8);
//! let response: http::Response<Vec<u8>> = p.to_response();
//! assert_eq!(response.status(), 409);
//! assert_eq!(response.headers()["content-type"], "application/problem+json");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::fmt;

use http::{HeaderValue, StatusCode, header::CONTENT_TYPE};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::{JobId, Owner};

/// `application/problem+json`.
pub const PROBLEM_JSON: &str = "application/problem+json";

macro_rules! problem_types {
    ($($(#[$doc:meta])* $variant:ident => $uri:literal, $status:literal, $title:literal;)*) => {
        /// The problem types of the contract.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum ProblemType {
            $($(#[$doc])* $variant,)*
        }

        impl ProblemType {
            /// Every type, for tests and documentation.
            pub const ALL: &'static [Self] = &[$(Self::$variant),*];

            /// The `type` URI, e.g. `urn:fence:stale-token`.
            pub const fn uri(self) -> &'static str {
                match self { $(Self::$variant => $uri,)* }
            }

            /// The HTTP status this type is answered with.
            pub const fn status(self) -> StatusCode {
                match self {
                    $(Self::$variant => match StatusCode::from_u16($status) {
                        Ok(s) => s,
                        Err(_) => StatusCode::INTERNAL_SERVER_ERROR,
                    },)*
                }
            }

            /// A short human-readable summary that does not change between occurrences.
            pub const fn title(self) -> &'static str {
                match self { $(Self::$variant => $title,)* }
            }

            /// The type named by `uri`, if it is one of ours.
            pub fn from_uri(uri: &str) -> Option<Self> {
                match uri { $($uri => Some(Self::$variant),)* _ => None }
            }
        }
    };
}

problem_types! {
    /// 409: the token is below the highest generation the destination accepted.
    StaleToken => "urn:fence:stale-token", 409, "Stale fencing token";
    /// 428: a fenced request carries neither fencing header.
    MissingToken => "urn:fence:missing-token", 428, "Fencing token required";
    /// 400: the fencing or idempotency headers are malformed or repeated.
    MalformedToken => "urn:fence:malformed-token", 400, "Malformed fencing headers";
    /// 503: the generation store failed or timed out.
    StoreUnavailable => "urn:fence:store-unavailable", 503, "Fence store unavailable";
    /// 503: older in-flight requests did not finish within the drain limit.
    DrainTimeout => "urn:fence:drain-timeout", 503, "Older requests still in flight";
    /// 409: a request with the same idempotency key is still in flight.
    IdempotencyInFlight => "urn:fence:idempotency-in-flight", 409, "Request with this idempotency key in flight";
    /// 422: the idempotency key was used with a different request.
    IdempotencyKeyMismatch => "urn:fence:idempotency-key-mismatch", 422, "Idempotency key reused for a different request";
    /// 409: the request with this idempotency key ran, but its response was too large to
    /// store, so it cannot be replayed (added by fence).
    IdempotencyNotReplayable => "urn:fence:idempotency-not-replayable", 409, "Completed request cannot be replayed";
    /// 413: an idempotent request's body is above the limit the sink fingerprints (added by
    /// fence).
    PayloadTooLarge => "urn:fence:payload-too-large", 413, "Request body too large";
    /// 403: a signed token is required and this one does not verify.
    InvalidSignature => "urn:fence:invalid-signature", 403, "Invalid fencing token signature";
    /// 409: a signed token whose lease has ended, by the sink's clock and allowed skew.
    TokenExpired => "urn:fence:token-expired", 409, "Fencing token expired";
    /// 403: a signed token whose lease ends later than any lease the destination allows
    /// (now plus its longest lease TTL plus the clock skew; added by fence).
    TokenTooLongLived => "urn:fence:token-too-long-lived", 403, "Fencing token outlives the destination's window";
    /// 408: a fenced request's body did not arrive within the body limit.
    BodyTimeout => "urn:fence:body-timeout", 408, "Request body too slow";
    /// 503: the sink holds as many buffered bytes as it may; retry later (added by fence).
    Overloaded => "urn:fence:overloaded", 503, "Too much buffered";
    /// 429: the lease server holds as many waiting claims as it may, in all or for this
    /// client; retry after `Retry-After` (added by fence).
    TooManyWaiters => "urn:fence:too-many-waiters", 429, "Too many waiting claims";
    /// 409: another owner holds an unexpired lease on the job.
    LeaseHeld => "urn:fence:lease-held", 409, "Lease held by another owner";
    /// 409: the job's last lease expired and its lock-delay is still running: nobody can
    /// claim it for `claimable_in_ms` (contract section 12; added by fence).
    LockDelay => "urn:fence:lock-delay", 409, "Lock-delay running";
    /// 409: a semaphore claim named another number of slots than the one in force while a
    /// slot has a holder (held or expired) or was revoked before its lease would have ended;
    /// `slots` is the one in force (contract section 15; added by fence).
    SemaphoreSize => "urn:fence:semaphore-size", 409, "Semaphore has another number of slots";
    /// 410: the job is completed and can no longer be claimed.
    JobCompleted => "urn:fence:job-completed", 410, "Job completed";
    /// 409: the caller's owner and generation no longer hold the job.
    LeaseLost => "urn:fence:lease-lost", 409, "Lease lost";
    /// 403: the owner and generation hold the job, but the lease key is not theirs.
    LeaseKeyMismatch => "urn:fence:lease-key-mismatch", 403, "Wrong lease key";
    /// 401: no bearer secret, or one the server does not know.
    Unauthenticated => "urn:fence:unauthenticated", 401, "Authentication required";
    /// 403: the client's secret does not cover this job (or action).
    Forbidden => "urn:fence:forbidden", 403, "Forbidden";
    /// 404: the lease server has no record of the job.
    UnknownJob => "urn:fence:unknown-job", 404, "Unknown job";
    /// 400: a lease API request is malformed.
    BadRequest => "urn:fence:bad-request", 400, "Bad request";
    /// 502: the proxy could not reach its upstream (added by fence).
    UpstreamUnavailable => "urn:fence:upstream-unavailable", 502, "Upstream unavailable";
    /// 504: the proxy's upstream did not answer in time; whether the request took effect is
    /// unknown (added by fence).
    UpstreamTimeout => "urn:fence:upstream-timeout", 504, "Upstream timeout";
    /// 404: no such path (added by fence).
    NotFound => "urn:fence:not-found", 404, "Not found";
    /// 405: the path exists, the method does not (added by fence).
    MethodNotAllowed => "urn:fence:method-not-allowed", 405, "Method not allowed";
    /// 500: an unexpected failure inside fence (added by fence).
    Internal => "urn:fence:internal", 500, "Internal error";
}

impl ProblemType {
    /// The gRPC status code a fenced gRPC call is answered with for this problem (contract
    /// section 9; the rows the contract does not list map by meaning).
    pub const fn grpc_code(self) -> u8 {
        match self {
            Self::StaleToken
            | Self::TokenExpired
            | Self::IdempotencyInFlight
            | Self::LeaseHeld
            | Self::LockDelay
            | Self::LeaseLost => 10, // ABORTED
            Self::MissingToken
            | Self::IdempotencyKeyMismatch
            | Self::IdempotencyNotReplayable
            | Self::TokenTooLongLived
            | Self::SemaphoreSize
            | Self::JobCompleted => 9, // FAILED_PRECONDITION
            Self::MalformedToken | Self::BadRequest => 3, // INVALID_ARGUMENT
            Self::InvalidSignature | Self::Forbidden | Self::LeaseKeyMismatch => 7, // PERMISSION_DENIED
            Self::StoreUnavailable
            | Self::DrainTimeout
            | Self::Overloaded
            | Self::UpstreamUnavailable => 14, // UNAVAILABLE
            Self::BodyTimeout | Self::UpstreamTimeout => 4, // DEADLINE_EXCEEDED
            Self::PayloadTooLarge | Self::TooManyWaiters => 8, // RESOURCE_EXHAUSTED
            Self::Unauthenticated => 16,                    // UNAUTHENTICATED
            Self::UnknownJob | Self::NotFound => 5,         // NOT_FOUND
            Self::MethodNotAllowed => 12,                   // UNIMPLEMENTED
            Self::Internal => 13,                           // INTERNAL
        }
    }
}

/// `text` as a `grpc-message` value: UTF-8, with every byte outside printable ASCII and every
/// `%` percent-encoded, as the gRPC HTTP/2 protocol asks.
pub fn grpc_message(text: &str) -> String {
    use fmt::Write as _;
    let mut out = String::with_capacity(text.len());
    for &b in text.as_bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

impl fmt::Display for ProblemType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.uri())
    }
}

impl Serialize for ProblemType {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.uri())
    }
}

impl<'de> Deserialize<'de> for ProblemType {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::from_uri(&s)
            .ok_or_else(|| serde::de::Error::custom(format!("unknown problem type {s:?}")))
    }
}

/// An RFC 9457 problem details body.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[non_exhaustive]
pub struct Problem {
    /// The problem type.
    #[serde(rename = "type")]
    pub kind: ProblemType,
    /// Its title.
    pub title: String,
    /// The HTTP status.
    pub status: u16,
    /// What happened this time, precisely.
    pub detail: String,
    /// The job concerned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<JobId>,
    /// The token the request carried.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<u64>,
    /// The highest generation the destination has accepted for the job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub highest: Option<u64>,
    /// The current owner of the lease (lease API).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<Owner>,
    /// The current generation of the lease (lease API).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<u64>,
    /// How long the current lease has left (lease API).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_in_ms: Option<u64>,
    /// When the token's lease ended, in ms since the Unix epoch (token-expired).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at_ms: Option<u64>,
    /// How long until the job can be claimed again (lock-delay).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claimable_in_ms: Option<u64>,
    /// The number of slots in force (semaphore-size).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slots: Option<u32>,
}

impl Serialize for Problem {
    /// Members that do not apply are left out, except `owner` on the lease problems, where
    /// the contract names it: there a job nobody holds is `"owner": null`.
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("type", &self.kind)?;
        m.serialize_entry("title", &self.title)?;
        m.serialize_entry("status", &self.status)?;
        m.serialize_entry("detail", &self.detail)?;
        if let Some(job) = &self.job {
            m.serialize_entry("job", job)?;
        }
        if let Some(token) = self.token {
            m.serialize_entry("token", &token)?;
        }
        if let Some(highest) = self.highest {
            m.serialize_entry("highest", &highest)?;
        }
        let names_owner = matches!(
            self.kind,
            ProblemType::LeaseHeld
                | ProblemType::LockDelay
                | ProblemType::LeaseLost
                | ProblemType::JobCompleted
        );
        if self.owner.is_some() || names_owner {
            m.serialize_entry("owner", &self.owner)?;
        }
        if let Some(generation) = self.generation {
            m.serialize_entry("generation", &generation)?;
        }
        if let Some(ms) = self.expires_in_ms {
            m.serialize_entry("expires_in_ms", &ms)?;
        }
        if let Some(ms) = self.expires_at_ms {
            m.serialize_entry("expires_at_ms", &ms)?;
        }
        if let Some(ms) = self.claimable_in_ms {
            m.serialize_entry("claimable_in_ms", &ms)?;
        }
        if let Some(slots) = self.slots {
            m.serialize_entry("slots", &slots)?;
        }
        m.end()
    }
}

impl Problem {
    /// A problem of `kind` with its standard title and status.
    pub fn new(kind: ProblemType, detail: impl Into<String>) -> Self {
        Self {
            kind,
            title: kind.title().to_owned(),
            status: kind.status().as_u16(),
            detail: detail.into(),
            job: None,
            token: None,
            highest: None,
            owner: None,
            generation: None,
            expires_in_ms: None,
            expires_at_ms: None,
            claimable_in_ms: None,
            slots: None,
        }
    }

    /// Names the job.
    pub fn with_job(mut self, job: JobId) -> Self {
        self.job = Some(job);
        self
    }

    /// Names the token the request carried.
    pub fn with_token(mut self, token: u64) -> Self {
        self.token = Some(token);
        self
    }

    /// Names the highest accepted generation.
    pub fn with_highest(mut self, highest: u64) -> Self {
        self.highest = Some(highest);
        self
    }

    /// Names the current owner.
    pub fn with_owner(mut self, owner: Option<Owner>) -> Self {
        self.owner = owner;
        self
    }

    /// Names the current generation.
    pub fn with_generation(mut self, generation: u64) -> Self {
        self.generation = Some(generation);
        self
    }

    /// Names how long the current lease has left.
    pub fn with_expires_in_ms(mut self, ms: u64) -> Self {
        self.expires_in_ms = Some(ms);
        self
    }

    /// Names when the token's lease ended.
    pub fn with_expires_at_ms(mut self, ms: u64) -> Self {
        self.expires_at_ms = Some(ms);
        self
    }

    /// Says how long until the job can be claimed again (lock-delay).
    pub fn with_claimable_in_ms(mut self, ms: u64) -> Self {
        self.claimable_in_ms = Some(ms);
        self
    }

    /// Names the number of slots in force (semaphore-size).
    pub fn with_slots(mut self, slots: u32) -> Self {
        self.slots = Some(slots);
        self
    }

    /// The HTTP status.
    pub fn status_code(&self) -> StatusCode {
        StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    /// The JSON body.
    pub fn to_json(&self) -> Vec<u8> {
        // Serialising plain strings and integers cannot fail.
        serde_json::to_vec(self).unwrap_or_else(|_| b"{}".to_vec())
    }

    /// Turns the head of this problem's response into a gRPC answer (contract section 9):
    /// HTTP 200, `content-type: application/grpc`, `grpc-status` by [`ProblemType::grpc_code`],
    /// `grpc-message` (the detail, percent-encoded), `fence-problem-type` and, where it
    /// applies, `fence-highest`. The caller sends it with an empty body (a trailers-only
    /// answer); other headers (`Retry-After`) stay as metadata.
    pub fn to_grpc_head(&self, status: &mut StatusCode, headers: &mut http::HeaderMap) {
        *status = StatusCode::OK;
        headers.remove(http::header::CONTENT_LENGTH);
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        headers.insert(
            "grpc-status",
            HeaderValue::from(u16::from(self.kind.grpc_code())),
        );
        if let Ok(message) = HeaderValue::try_from(grpc_message(&self.detail)) {
            headers.insert("grpc-message", message);
        }
        headers.insert(
            "fence-problem-type",
            HeaderValue::from_static(self.kind.uri()),
        );
        if let Some(highest) = self.highest {
            headers.insert("fence-highest", HeaderValue::from(highest));
        }
    }

    /// An HTTP response carrying this problem.
    pub fn to_response<B: From<Vec<u8>>>(&self) -> http::Response<B> {
        let mut response = http::Response::new(B::from(self.to_json()));
        *response.status_mut() = self.status_code();
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        response
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}): {}", self.kind, self.status, self.detail)
    }
}

impl std::error::Error for Problem {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_round_trips_and_has_the_contract_status() {
        let want = [
            ("urn:fence:stale-token", 409),
            ("urn:fence:missing-token", 428),
            ("urn:fence:malformed-token", 400),
            ("urn:fence:store-unavailable", 503),
            ("urn:fence:drain-timeout", 503),
            ("urn:fence:idempotency-in-flight", 409),
            ("urn:fence:idempotency-key-mismatch", 422),
            ("urn:fence:invalid-signature", 403),
            ("urn:fence:token-expired", 409),
            ("urn:fence:body-timeout", 408),
            ("urn:fence:lease-key-mismatch", 403),
            ("urn:fence:unauthenticated", 401),
            ("urn:fence:forbidden", 403),
            ("urn:fence:lease-held", 409),
            ("urn:fence:semaphore-size", 409),
            ("urn:fence:job-completed", 410),
            ("urn:fence:lease-lost", 409),
            ("urn:fence:unknown-job", 404),
            ("urn:fence:bad-request", 400),
        ];
        for (uri, status) in want {
            let t = ProblemType::from_uri(uri).unwrap_or_else(|| panic!("{uri} missing"));
            assert_eq!((t.uri(), t.status().as_u16()), (uri, status));
        }
        for t in ProblemType::ALL {
            assert_eq!(ProblemType::from_uri(t.uri()), Some(*t));
        }
    }

    #[test]
    fn json_shape() {
        let p = Problem::new(ProblemType::StaleToken, "stale")
            .with_token(7)
            .with_highest(u64::MAX);
        let v: serde_json::Value = serde_json::from_slice(&p.to_json()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({
                "type": "urn:fence:stale-token", "title": "Stale fencing token", "status": 409,
                "detail": "stale", "token": 7, "highest": 18446744073709551615u64
            })
        );
        let back: Problem = serde_json::from_value(v).unwrap();
        assert_eq!(back, p);
        let lost = Problem::new(ProblemType::LeaseLost, "lost")
            .with_owner(None)
            .with_generation(3);
        let v: serde_json::Value = serde_json::from_slice(&lost.to_json()).unwrap();
        assert_eq!(
            (
                v["owner"].is_null(),
                v.get("owner").is_some(),
                &v["generation"]
            ),
            (true, true, &serde_json::json!(3))
        );
    }
}
