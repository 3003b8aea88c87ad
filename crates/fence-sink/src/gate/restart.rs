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
//! raise). Jobs idle for longer, and jobs never seen, wait for nothing. The longest request
//! and the hold are the longer of this process's and those the processes before recorded
//! ([`Prior::ran`]): a process restarted with shorter timeouts still waits for what the one
//! before admitted under its longer ones.

use std::{sync::atomic::Ordering::Relaxed, time::Duration};

use tokio::time::Instant;

use super::{GateState, Gates};
use crate::store::{GenerationStore, Prior, RunBounds, StoreError, ms};

/// How long a request that an earlier process admitted may still be running after it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Restart {
    /// The longest an admitted request runs before the layer gives up on it (the proxy's
    /// upstream timeout).
    pub(crate) longest_request: Duration,
    /// How long after its admission a streamed body may still be going to the service (the
    /// body deadline): a service that answered early may act on it until then.
    pub(crate) body: Duration,
    /// How long after that its effect may still happen (the unknown-outcome hold).
    pub(crate) hold: Duration,
    /// How long an admitted request may wait before the service has it: the begin of its
    /// `Idempotency-Key` record (the idempotency store's timeout), zero without keys.
    pub(crate) before_service: Duration,
    /// How long a handler may go on acting after its answer's head: a keyed call of
    /// messages (gRPC, Connect) is in flight until its answer ends, which may stream up to
    /// the body deadline after the head. Zero without keys.
    pub(crate) after_answer: Duration,
    /// Whether the bounds the processes before recorded count too (always, but for the
    /// negative control of the test hook `without_restart_hold`).
    pub(crate) heed_recorded: bool,
}

impl Restart {
    /// How long after its admission a request may still be running at the service: its
    /// wait before the service, the longest request or, when later, the end of a body
    /// streamed to it, and what its answer may stream on; zero when the longest request is
    /// (a service whose effects die with its process).
    pub(crate) fn running_for(&self) -> Duration {
        if self.longest_request.is_zero() {
            Duration::ZERO
        } else {
            self.longest_request
                .max(self.body)
                .saturating_add(self.before_service)
                .saturating_add(self.after_answer)
        }
    }

    /// How long after its admission a request can no longer be running, outcome unknown
    /// included.
    pub(crate) fn settled_after(&self) -> Duration {
        self.bounds().settled_after()
    }

    /// What this process's admissions may leave running, for the store to record.
    pub(crate) fn bounds(&self) -> RunBounds {
        RunBounds::new(self.running_for(), self.hold)
    }

    /// What a restart waits for: the longer of this process's bounds and those `recorded`
    /// by the processes before.
    pub(crate) fn with_recorded(&self, recorded: RunBounds) -> RunBounds {
        if self.heed_recorded {
            self.bounds().max(recorded)
        } else {
            self.bounds()
        }
    }
}

impl<St: GenerationStore> Gates<St> {
    /// Whether the store took bounds at least `restart`'s from this map's layers (two loads
    /// of atomics, on every admission: no clock, no timer).
    pub(super) fn running_told(&self, restart: Restart) -> bool {
        let bounds = restart.bounds();
        [bounds.running_for, bounds.hold]
            .iter()
            .zip(&self.told)
            .all(|(want, told)| ms(*want) <= told.load(Relaxed))
    }

    /// Tells the store what requests admitted under `restart` may leave running: durable
    /// before the first of them is admitted, so a process after this one waits for them by
    /// these bounds, whatever its own.
    pub(super) async fn tell_running(&self, restart: Restart) -> Result<(), StoreError> {
        let bounds = restart.bounds();
        self.store.running_within(bounds).await?;
        for (want, told) in [bounds.running_for, bounds.hold].iter().zip(&self.told) {
            told.fetch_max(ms(*want), Relaxed);
        }
        Ok(())
    }
}

impl GateState {
    /// Takes the stamps of a job loaded from the store, at `now_ms` by the layer's clock.
    pub(super) fn load_prior(&mut self, prior: Prior, restart: Restart, now_ms: u64) {
        // By the bounds the process before ran with, when they were longer than ours.
        let ran = restart.with_recorded(prior.ran);
        let bound = |admitted: u64| {
            admitted
                .saturating_add(ms(ran.running_for))
                .min(prior.opened_ms)
                .saturating_add(ms(ran.hold))
        };
        let now = Instant::now();
        // Never longer than the settling time from now: whatever the earlier process
        // admitted, it admitted before now. (A clock stepped back after the store was
        // opened would otherwise keep a newer token waiting for the size of the step.)
        let settled = ms(ran.settled_after());
        let until = |admitted: u64| {
            let left = bound(admitted).saturating_sub(prior.now_ms).min(settled);
            (left > 0).then(|| now + Duration::from_millis(left))
        };
        self.prior_current = self.prior_current.max(until(prior.admitted_until_ms));
        self.prior_older = self.prior_older.max(until(prior.raised_ms));
        // The stamp covers what is left of it by the store's clock; half of that is counted,
        // a margin for the two clocks' rates. Measured from the later of the store's answer
        // and the layer's clock: a wall clock stepped forward since the open must not make
        // the stamp seem to cover more than it does.
        let left = prior
            .admitted_until_ms
            .saturating_sub(prior.now_ms.max(now_ms))
            / 2;
        if left > 0 {
            self.covered_until_ms = now_ms.saturating_add(left);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A job stamped before a clock stepped back an hour (opened and stamped "in the
    /// future"): the wait for what the earlier process may have left running is the
    /// settling time at most, not the hour of the step as well.
    #[tokio::test(start_paused = true)]
    async fn a_clock_stepped_back_does_not_stretch_the_wait_after_a_restart() {
        let restart = Restart {
            longest_request: Duration::from_secs(60),
            body: Duration::ZERO,
            hold: Duration::from_secs(60),
            before_service: Duration::ZERO,
            after_answer: Duration::ZERO,
            heed_recorded: true,
        };
        let now_ms = 1_000_000_000;
        let hour = 3_600_000;
        let prior = Prior::new(now_ms + hour + 10_000, now_ms + hour, now_ms + hour, now_ms);
        let mut state = GateState::default();
        state.load_prior(prior, restart, now_ms);
        let start = Instant::now();
        for until in [state.prior_current, state.prior_older] {
            let until = until.expect("a wait: the stamps are recent by their clock");
            assert_eq!(until - start, restart.settled_after());
        }
    }

    /// A process restarted with shorter bounds than the one before waits by the longer ones
    /// that one recorded: by its own, what it admitted would seem settled already.
    #[tokio::test(start_paused = true)]
    async fn a_restart_waits_by_the_longer_bounds_the_process_before_recorded() {
        let minute = Duration::from_secs(60);
        let restart = Restart {
            longest_request: Duration::from_secs(30),
            body: Duration::ZERO,
            hold: Duration::from_secs(30),
            before_service: Duration::ZERO,
            after_answer: Duration::ZERO,
            heed_recorded: true,
        };
        // Admitted by a stamp 2 minutes before the restart, under 10-minute bounds.
        let opened_ms = 1_000_000_000;
        let ran = RunBounds::new(10 * minute, 10 * minute);
        let prior = Prior::new(
            opened_ms - 120_000,
            opened_ms - 120_000,
            opened_ms,
            opened_ms,
        );
        let mut state = GateState::default();
        state.load_prior(prior.ran(ran), restart, opened_ms);
        let waits = state.prior_current.map(|until| until - Instant::now());
        assert_eq!(waits, Some(10 * minute), "the hold from the restart");
        // The negative control's hook waits by its own bounds alone.
        let mut state = GateState::default();
        let off = Restart {
            heed_recorded: false,
            ..restart
        };
        state.load_prior(prior.ran(ran), off, opened_ms);
        assert_eq!(state.prior_current, None);
    }
}
