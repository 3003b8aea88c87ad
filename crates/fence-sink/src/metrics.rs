//! Counters of what the fence decided: `fence_sink_requests_total{outcome=...}`.
//!
//! They go through the `metrics` facade; exporters are the application's choice.

/// Counts one request with `outcome`: `accepted`, `stale`, `malformed`, `missing`,
/// `missing_allowed`, `unfenced`, `replayed`, `in_flight_conflict`, `mismatch`,
/// `not_replayable`, `drain_timeout` or `store_error`.
pub(crate) fn count(outcome: &'static str) {
    metrics::counter!("fence_sink_requests_total", "outcome" => outcome).increment(1);
}
