//! What a process before this one may have left running, and how long a newer token waits for it.
//!
//! After a restart: the in-flight counts of the process before are gone, while what it
//! passed on may still be running. The store's stamps bound it ([`Prior`]): every admission
//! is covered by a durable stamp *before* the request goes on (written ahead, refreshed in
//! the background while the job is busy, so the fast path does not wait for it). A gate that
//! loads a job with stamps assumes that requests the earlier process admitted by the stamp
//! ran until at most `min(stamp + longest request, when this process opened the store)` and
//! then, outcome unknown, for the unknown-outcome hold: a newer token waits out that time,
//! and so does the highest token when older ones may still run (admitted before the last
//! raise). Jobs idle for longer, and jobs never seen, wait for nothing.

use std::time::Duration;

use tokio::time::Instant;

use super::GateState;
use crate::store::{Prior, ms};

/// How long a request that an earlier process admitted may still be running after it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Restart {
    /// The longest an admitted request runs before the layer gives up on it (the proxy's
    /// upstream timeout).
    pub(crate) longest_request: Duration,
    /// How long after that its effect may still happen (the unknown-outcome hold).
    pub(crate) hold: Duration,
    /// How long an admitted request may wait before the service has it: the begin of its
    /// `Idempotency-Key` record (the idempotency store's timeout), zero without keys.
    pub(crate) before_service: Duration,
}

impl Restart {
    /// How long after its admission a request may still be running at the service: its
    /// wait before the service plus the longest request; zero when the longest request is
    /// (a service whose effects die with its process).
    pub(crate) fn running_for(&self) -> Duration {
        if self.longest_request.is_zero() {
            Duration::ZERO
        } else {
            self.longest_request.saturating_add(self.before_service)
        }
    }

    /// How long after its admission a request can no longer be running, outcome unknown
    /// included.
    pub(crate) fn settled_after(&self) -> Duration {
        self.running_for().saturating_add(self.hold)
    }
}

impl GateState {
    /// Takes the stamps of a job loaded from the store, at `now_ms` by the layer's clock.
    pub(super) fn load_prior(&mut self, prior: Prior, restart: Restart, now_ms: u64) {
        let bound = |admitted: u64| {
            admitted
                .saturating_add(ms(restart.running_for()))
                .min(prior.opened_ms)
                .saturating_add(ms(restart.hold))
        };
        let now = Instant::now();
        let until = |admitted: u64| {
            let left = bound(admitted).saturating_sub(prior.now_ms);
            (left > 0).then(|| now + Duration::from_millis(left))
        };
        self.prior_current = self.prior_current.max(until(prior.admitted_until_ms));
        self.prior_older = self.prior_older.max(until(prior.raised_ms));
        // The stamp covers what is left of it by the store's clock; half of that is counted,
        // a margin for the two clocks' rates.
        let left = prior.admitted_until_ms.saturating_sub(prior.now_ms) / 2;
        if left > 0 {
            self.covered_until_ms = now_ms.saturating_add(left);
        }
    }
}
