//! The guards a gate hands out: per admitted request, per running bump, per store call.

use std::{sync::Arc, time::Duration};

use fence_core::Generation;

use super::{Gate, Mutant, broken};

/// How many of a shared store's connections one job's requests may use at once: a job whose
/// row a stalled SQL writer holds locked ties up that many of the pool's connections, not
/// all of them.
pub(crate) const STORE_CALLS_PER_JOB: usize = 4;

/// One of a job's [`STORE_CALLS_PER_JOB`] turns at the store, given back when dropped (the
/// call ended, or its request went away).
pub(super) struct Turn<'a>(&'a Gate);

impl<'a> Turn<'a> {
    /// Waits for one of `gate`'s turns.
    pub(super) async fn take(gate: &'a Gate) -> Self {
        loop {
            let notified = gate.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable(); // registered before the check: no wake-up is missed
            {
                let mut s = gate.lock();
                if s.store_calls < STORE_CALLS_PER_JOB {
                    s.store_calls += 1;
                    return Self(gate);
                }
            }
            notified.await;
        }
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        self.0.lock().store_calls -= 1;
        self.0.changed.notify_waiters();
    }
}

/// Clears a bump's mark when its task ends without settling (a panic in the store, or the
/// runtime shutting down), so the job is not left waiting on a bump that will never finish.
pub(super) struct Unsettled<'a> {
    pub(super) gate: &'a Gate,
    pub(super) token: Generation,
}

impl Drop for Unsettled<'_> {
    fn drop(&mut self) {
        let mut s = self.gate.lock();
        // While this bump runs, `bumping` is this token (only `decide` sets it, and only when
        // it is empty; only `settle` or this clears it), so the check never fails today: it
        // keeps this guard correct should a second bump ever be allowed to start.
        if s.bumping == Some(self.token) {
            s.bumping = None;
        }
        drop(s);
        self.gate.changed.notify_waiters();
    }
}

/// Marks one admitted request in flight; dropping it lets a newer generation that waits for
/// it proceed.
#[derive(Debug)]
pub(crate) struct InFlight {
    pub(super) gate: Arc<Gate>,
    pub(super) generation: Generation,
    /// How long a drop while the thread unwinds from a panic keeps the request in flight
    /// (see [`Self::held_on_panic`]); zero until set.
    pub(super) panic_hold: Duration,
}

impl InFlight {
    /// Dropped while its thread unwinds from a panic (the service panicked after admission,
    /// having perhaps sent its effect on its way), the request stays in flight for `hold`,
    /// as after any unknown outcome, instead of letting a newer token pass at once. The
    /// fence's futures hold the guard in their state, which a panic out of their poll drops
    /// as it unwinds, whoever catches it further out.
    pub(crate) fn held_on_panic(mut self, hold: Duration) -> Self {
        self.panic_hold = hold;
        self
    }

    /// Keeps the request counted in flight for `hold` more (after an unknown outcome: the
    /// upstream may still act on it), then lets it go. Without a runtime to wait on, at once.
    pub(crate) fn hold(self, hold: Duration) {
        if hold.is_zero() {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                tokio::time::sleep(hold).await;
                drop(self);
            });
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if std::thread::panicking() && !self.panic_hold.is_zero() {
            // The count moves to `rest`, which goes when the hold ends (at once without a
            // runtime): exactly one of the two gives it back.
            let rest = InFlight {
                gate: Arc::clone(&self.gate),
                generation: self.generation,
                panic_hold: Duration::ZERO,
            };
            rest.hold(self.panic_hold);
            return;
        }
        let mut s = self.gate.lock();
        if self.generation == s.highest {
            s.current -= 1;
            return;
        }
        // Older than `highest`: counted in `draining` since the raise.
        s.draining -= 1;
        let drained = s.draining == 0 && !broken(Mutant::DrainUnnotified);
        drop(s);
        if drained {
            self.gate.changed.notify_waiters();
        }
    }
}
