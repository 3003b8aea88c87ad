//! The guard that marks a request's outcome unknown when its service's call ends unanswered.

use std::sync::Arc;

use super::Streaming;

impl Streaming {
    /// Held while the service runs. A service that panics, fails, or whose call is dropped
    /// before it answered (its client went away), may have sent its effect on its way in a
    /// task it handed the body to (the proxy's upstream connection), which shares this
    /// place: it would go when that task drops the body, without the hold, or never if the
    /// task does not read it. So the guard's drop marks the outcome unknown (on a panic
    /// always; the `InFlight` guard's own panic hold covers only a drop during the
    /// unwinding) and keeps the deadline `overdue_at` when the body lives on. A call dropped
    /// with its body in it holds nothing. Only a body still unfinished is seen (one that
    /// ended lets go of this place), and only on a streamed request: a keyed request's body
    /// is buffered.
    pub(crate) fn unknown_if_unanswered(
        self: &Arc<Self>,
        overdue_at: tokio::time::Instant,
    ) -> UnknownIfUnanswered<'_> {
        UnknownIfUnanswered {
            flight: self,
            overdue_at,
            answered: false,
        }
    }
}

/// Marks the request's outcome unknown when dropped before the service answered (see
/// [`Streaming::unknown_if_unanswered`]).
pub(crate) struct UnknownIfUnanswered<'a> {
    flight: &'a Arc<Streaming>,
    overdue_at: tokio::time::Instant,
    answered: bool,
}

impl UnknownIfUnanswered<'_> {
    /// The service answered: nothing to do here.
    pub(crate) fn answered(mut self) {
        self.answered = true;
    }
}

impl Drop for UnknownIfUnanswered<'_> {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        // Held elsewhere too: the body, by a task the service handed it to, which may never
        // read it (the call's own state, the body in it, is dropped before this guard).
        let handed_on = Arc::strong_count(self.flight) > 1;
        if handed_on {
            self.flight.keep_deadline(self.overdue_at);
        }
        if std::thread::panicking() || handed_on {
            self.flight.unknown();
        }
    }
}
