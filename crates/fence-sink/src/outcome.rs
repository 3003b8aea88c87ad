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
