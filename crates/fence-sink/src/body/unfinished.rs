//! The guard that marks a request's outcome unknown when its service's call ends unfinished.

use std::sync::Arc;

use super::Streaming;

impl Streaming {
    /// Held while the service runs. A service that panics, or whose call is dropped before
    /// it answered (its client went away), may have sent its effect on its way in a task it
    /// handed the body to (the proxy's upstream connection), which shares this place: it
    /// would go when that task drops the body, without the hold, or never if the task does
    /// not read it. So the guard's drop marks the outcome unknown (on a panic always; the
    /// `InFlight` guard's own panic hold covers only a drop during the unwinding) and keeps
    /// the deadline `overdue_at` when the body lives on. A call dropped with its body in it
    /// holds nothing. Only a body still unfinished is seen (one that ended lets go of this
    /// place), and only on a streamed request: a keyed request's body is buffered.
    pub(crate) fn unknown_if_unfinished(
        self: &Arc<Self>,
        overdue_at: tokio::time::Instant,
    ) -> UnknownIfUnfinished<'_> {
        UnknownIfUnfinished {
            flight: self,
            overdue_at,
            finished: false,
        }
    }

    /// [`keep_deadline`](Self::keep_deadline) when this place is held elsewhere too, once
    /// the service's call is over: the body, by a task the service handed it to, which may
    /// never read it. Answers whether it was.
    pub(crate) fn keep_deadline_if_handed_on(self: &Arc<Self>, at: tokio::time::Instant) -> bool {
        let handed_on = Arc::strong_count(self) > 1;
        if handed_on {
            self.keep_deadline(at);
        }
        handed_on
    }
}

/// Marks the request's outcome unknown when dropped before the service's call was over (see
/// [`Streaming::unknown_if_unfinished`]).
pub(crate) struct UnknownIfUnfinished<'a> {
    flight: &'a Arc<Streaming>,
    overdue_at: tokio::time::Instant,
    finished: bool,
}

impl UnknownIfUnfinished<'_> {
    /// The service answered or failed (which its caller handles): nothing to do here.
    pub(crate) fn finished(mut self) {
        self.finished = true;
    }
}

impl Drop for UnknownIfUnfinished<'_> {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        // The call's own state, the body in it, is dropped before this guard.
        let handed_on = self.flight.keep_deadline_if_handed_on(self.overdue_at);
        if std::thread::panicking() || handed_on {
            self.flight.unknown();
        }
    }
}
