//! The state every [`Fence`](super::Fence) of one layer shares: configuration and gates.

use std::{sync::Arc, time::Duration};

use http::{Method, request::Parts};

use fence_storage::clock::Clock;

use super::signature::Signatures;
use crate::{
    IdempotencyConfig,
    budget::Budget,
    gate::{Gates, Limits},
};

/// Decides which requests are fenced.
pub type FencePredicate = Arc<dyn Fn(&Parts) -> bool + Send + Sync>;

/// What the fence does, as set by the builder methods of [`FenceLayer`].
#[derive(Clone)]
pub(crate) struct Config {
    /// `None`: every method but the safe ones (GET, HEAD, OPTIONS, TRACE).
    pub(crate) methods: Option<Vec<Method>>,
    pub(crate) predicate: Option<FencePredicate>,
    pub(crate) require_token: bool,
    pub(crate) idempotency: Option<IdempotencyConfig>,
    pub(crate) run_to_completion: bool,
    pub(crate) signatures: Option<Arc<Signatures>>,
    pub(crate) limits: Limits,
    /// A fenced request's body must have arrived this long after admission.
    pub(crate) body_timeout: Duration,
    /// How long a request whose outcome is unknown stays in flight after its answer.
    pub(crate) unknown_outcome_hold: Duration,
    /// The gRPC statuses of unknown outcome.
    pub(crate) unknown_grpc: crate::GrpcStatuses,
    /// The most bytes of bodies the layer holds at once (see [`Budget`]).
    pub(crate) max_buffered_bytes: usize,
    /// The clock signed tokens' lease ends are compared with.
    pub(crate) clock: Arc<dyn Clock>,
    /// How far the lease server's clock may be ahead of this one.
    pub(crate) clock_skew: Duration,
    /// The longest lease the lease server grants: a signed token may end at most this (plus
    /// the skew) after now.
    pub(crate) max_lease_ttl: Duration,
    /// Forget a job with no admitted request for this long (contract section 8); stretched
    /// by `spawn_maintenance` to the token window and, on a store with restart stamps, to
    /// what an earlier process may have left running.
    pub(crate) forget_after: Option<Duration>,
}

impl Config {
    /// How long an in-flight `Idempotency-Key` record blocks retries of its key: the
    /// configured timeout, and never less than one attempt can still act (its body's
    /// deadline, the longest request, the unknown-outcome hold). A record given up sooner
    /// would let a retry of the same token run beside an attempt still going: the gate does
    /// not hold a token back behind requests of its own generation.
    pub(crate) fn in_flight_timeout(&self, idempotency: &IdempotencyConfig) -> Duration {
        // The record is written before its begin's commit lands, which the service's
        // request waits for: that wait counts too.
        let longest = self
            .body_timeout
            .saturating_add(self.limits.restart.longest_request)
            .saturating_add(self.limits.restart.before_service)
            .saturating_add(self.unknown_outcome_hold);
        idempotency.in_flight_timeout.max(longest)
    }

    pub(crate) fn is_fenced(&self, parts: &Parts) -> bool {
        match &self.predicate {
            Some(p) => p(parts),
            None => match &self.methods {
                // Methods are case-sensitive to HTTP, but not to every upstream: `post` is
                // fenced with POST rather than let through to one that reads it as POST.
                Some(methods) => methods
                    .iter()
                    .any(|m| m.as_str().eq_ignore_ascii_case(parts.method.as_str())),
                None => !matches!(
                    parts.method,
                    Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
                ),
            },
        }
    }
}

/// Everything a [`Fence`] needs, behind one `Arc`: a request clones it with one reference
/// count. Every clone of a layer shares the gates (one view of each job); a builder method
/// called on a clone gives that clone a configuration of its own.
pub(crate) struct Shared<St> {
    pub(crate) config: Config,
    pub(crate) gates: Arc<Gates<St>>,
    /// The bytes of bodies every clone holds, against each clone's own cap.
    pub(crate) budget: Arc<Budget>,
}

impl<St> Clone for Shared<St> {
    fn clone(&self) -> Self {
        Self {
            config: self.config.clone(),
            gates: self.gates.clone(),
            budget: self.budget.clone(),
        }
    }
}
