//! Markers an inner service puts into a response's extensions for the fence.
//!
//! They tell the fence what it could not see for itself.

/// Put into a response's extensions by a service that cannot tell whether its effect
/// happened (a proxy whose upstream timed out after the request was sent, or whose
/// connection broke after the request was written): the upstream may still act on it.
///
/// The fence then keeps the request counted in flight for the layer's
/// [`unknown_outcome_hold`](crate::FenceLayer::unknown_outcome_hold), so a newer generation
/// does not pass while the old request may still land; and its idempotency record stays in
/// flight until its timeout instead of being forgotten like an ordinary 5xx, so a retry
/// meanwhile gets 409 rather than a second run.
#[derive(Debug, Clone, Copy, Default)]
pub struct OutcomeUnknown;

/// The gRPC statuses (0 to 31; gRPC's own run 0 to 16) that leave a call's outcome unknown
/// when a service answers with them, in the answer's head (a trailers-only answer) or its
/// trailers: see [`FenceLayer::unknown_outcome_grpc_statuses`](crate::FenceLayer::unknown_outcome_grpc_statuses).
///
/// By default CANCELLED (1) and DEADLINE_EXCEEDED (4): a gRPC server answers them when the
/// call's deadline ran out or the call was cancelled, after dropping its handler wherever it
/// was, so a write the handler had sent may still commit; a gateway that gave up on the
/// service answers DEADLINE_EXCEEDED or UNAVAILABLE (14) as well.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrpcStatuses(u32);

/// `grpc-status`, made once: a lookup by `&str` parses and validates the name each time,
/// and every streamed answer is looked at.
pub(crate) const GRPC_STATUS: http::HeaderName = http::HeaderName::from_static("grpc-status");
/// `fence-problem-type`, the kind of problem a fence answered.
const FENCE_PROBLEM_TYPE: http::HeaderName = http::HeaderName::from_static("fence-problem-type");

impl GrpcStatuses {
    /// No status leaves an outcome unknown.
    pub const NONE: Self = Self(0);

    /// CANCELLED (1) and DEADLINE_EXCEEDED (4).
    pub const DEFAULT: Self = Self(1 << 1 | 1 << 4);

    /// These statuses; a code above 31 is refused (`None`), as is 0 (OK).
    pub fn of(codes: impl IntoIterator<Item = u32>) -> Option<Self> {
        codes.into_iter().try_fold(Self::NONE, |set, code| {
            (1..32).contains(&code).then(|| Self(set.0 | 1 << code))
        })
    }

    /// Whether `status`, a `grpc-status` value as sent (ASCII digits), is one of these.
    pub fn contains(self, status: &http::HeaderValue) -> bool {
        std::str::from_utf8(status.as_bytes())
            .ok()
            .filter(|s| !s.is_empty() && s.len() <= 2 && s.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|s| s.parse::<u32>().ok())
            .is_some_and(|code| code < 32 && self.0 & 1 << code != 0)
    }

    /// Whether the `grpc-status` in `headers` (an answer's head or its trailers) is one of
    /// these.
    pub fn in_headers(self, headers: &http::HeaderMap) -> bool {
        self.0 != 0 && headers.get(GRPC_STATUS).is_some_and(|s| self.contains(s))
    }

    /// Whether an answer's head leaves the outcome unknown by its `grpc-status`: one of
    /// these, unless a fence wrote it (`fence-problem-type`) refusing the call before any
    /// service had it (overloaded, drain-timeout, a body that timed out...). Only a fence's
    /// `upstream-timeout` and `upstream-unavailable` answers come after a call may have gone
    /// on; a proxy in this process marks its own with [`OutcomeUnknown`] where that is so,
    /// and one across the network may have, so those count by their status.
    pub(crate) fn in_answer(self, head: &http::HeaderMap) -> bool {
        self.in_headers(head)
            && head.get(FENCE_PROBLEM_TYPE).is_none_or(|kind| {
                kind == "urn:fence:upstream-timeout" || kind == "urn:fence:upstream-unavailable"
            })
    }
}

impl Default for GrpcStatuses {
    fn default() -> Self {
        Self::DEFAULT
    }
}
