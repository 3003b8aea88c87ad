//! The proxy's own metrics: upstream calls by outcome, with their latency.

use tokio::time::Instant;

/// The metrics of one outcome of upstream calls, registered once (a lookup by name and
/// label on every request would cost more than the rest of the bookkeeping).
pub(super) struct Outcome {
    count: metrics::Counter,
    seconds: metrics::Histogram,
}

impl Outcome {
    fn new(outcome: &'static str) -> Self {
        Self {
            count: metrics::counter!("fence_proxy_upstream_requests_total", "outcome" => outcome),
            seconds: metrics::histogram!("fence_proxy_upstream_seconds", "outcome" => outcome),
        }
    }

    pub(super) fn record(&self, started: Instant) {
        self.count.increment(1);
        self.seconds.record(started.elapsed().as_secs_f64());
    }
}

/// The `outcome` labels of `fence_proxy_upstream_requests_total` and
/// `fence_proxy_upstream_seconds`, for their HELP texts: those the proxy counts by.
pub const UPSTREAM_OUTCOMES: &[&str] =
    &["ok", "unavailable", "timeout", "bad_target", "overloaded"];

/// Every outcome of an upstream call, as `fence_proxy_upstream_requests_total{outcome}`.
pub(super) struct Outcomes {
    pub(super) ok: Outcome,
    pub(super) unavailable: Outcome,
    pub(super) timeout: Outcome,
    pub(super) bad_target: Outcome,
    /// Refused by the proxy, never sent: no room for another upstream connection.
    pub(super) overloaded: Outcome,
}

impl Outcomes {
    pub(super) fn new() -> Self {
        Self {
            ok: Outcome::new("ok"),
            unavailable: Outcome::new("unavailable"),
            timeout: Outcome::new("timeout"),
            bad_target: Outcome::new("bad_target"),
            overloaded: Outcome::new("overloaded"),
        }
    }
}

#[cfg(test)]
mod tests {
    /// The HELP texts list what `Outcomes::new` registers.
    #[test]
    fn the_listed_outcomes_are_the_registered_ones() {
        let source = include_str!("metrics.rs");
        let registered: Vec<&str> = source
            .split("Outcome::new(\"")
            .skip(1)
            .filter_map(|rest| rest.split('"').next())
            .collect();
        assert_eq!(registered, super::UPSTREAM_OUTCOMES);
    }
}
