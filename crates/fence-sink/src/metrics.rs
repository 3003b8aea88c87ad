//! Counters of what the fence decided: `fence_sink_requests_total{outcome=...}`.
//!
//! They go through the `metrics` facade; exporters are the application's choice.

/// Defines [`count`] and [`OUTCOMES`] from one list, so that each outcome's key is a static
/// made at compile time: a label given as a variable would build, hash and free a key on
/// every request.
macro_rules! outcomes {
    ($($outcome:literal),* $(,)?) => {
        /// Counts one request with `outcome`, one of [`OUTCOMES`].
        pub(crate) fn count(outcome: &'static str) {
            match outcome {
                $($outcome => {
                    metrics::counter!("fence_sink_requests_total", "outcome" => $outcome)
                        .increment(1);
                })*
                _ => {
                    debug_assert!(false, "{outcome} is not in OUTCOMES");
                    metrics::counter!("fence_sink_requests_total", "outcome" => outcome)
                        .increment(1);
                }
            }
        }

        /// Every outcome the layer counts requests under, for the metric's HELP text and its
        /// test.
        pub const OUTCOMES: &[&str] = &[$($outcome),*];
    };
}

outcomes![
    "accepted",
    "stale",
    "expired",
    "too_long_lived",
    "missing",
    "missing_allowed",
    "malformed",
    "invalid_signature",
    "unfenced",
    "replayed",
    "in_flight_conflict",
    "mismatch",
    "not_replayable",
    "too_large",
    "body_failed",
    "body_timeout",
    "drain_timeout",
    "overloaded",
    "store_error",
];
