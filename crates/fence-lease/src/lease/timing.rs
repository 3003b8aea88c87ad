//! A lease's timing: the local deadline, the safety margin and the renewal interval.

use std::time::Duration;

use fence_core::Ttl;
use tokio::time::Instant;

/// The client's timing settings, applied to each grant: a store may grant less than it was
/// asked for, and the margin and the renewal interval then follow the grant.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timing {
    /// The TTL asked for.
    pub(crate) ttl: Ttl,
    /// Set by [`LeaseClient::safety_margin`](crate::LeaseClient::safety_margin); else 10% of
    /// the grant, at least 50 ms.
    margin: Option<Duration>,
    /// Set by [`LeaseClient::renew_every`](crate::LeaseClient::renew_every); else a third of
    /// the grant.
    renew_every: Option<Duration>,
    /// Set by [`LeaseClient::progress_within`](crate::LeaseClient::progress_within): the
    /// keeper renews only while the worker reported progress this recently.
    pub(crate) progress_within: Option<Duration>,
}

/// A safety margin or renewal interval that does not fit the TTL asked for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TimingError {
    /// The margin leaves no time to hold the lease.
    #[error("invalid lease timing: safety margin {margin:?} is not shorter than the ttl {ttl:?}")]
    Margin {
        /// The margin.
        margin: Duration,
        /// The TTL asked for.
        ttl: Duration,
    },
    /// The renewal interval is zero, or a renewal would come after the local deadline.
    #[error(
        "invalid lease timing: renewal interval {every:?} must be above zero and shorter than ttl minus margin ({fits:?})"
    )]
    RenewEvery {
        /// The interval.
        every: Duration,
        /// The TTL asked for, minus the margin.
        fits: Duration,
    },
    /// The progress interval is zero.
    #[error("invalid lease timing: the progress interval must be above zero")]
    ProgressWithin,
}

impl Timing {
    /// Checks the settings against the TTL asked for; a shorter grant later falls back to a
    /// third of it (see [`Self::renew_every`]).
    pub(crate) fn new(
        ttl: Ttl,
        margin: Option<Duration>,
        renew_every: Option<Duration>,
    ) -> Result<Self, TimingError> {
        let timing = Self {
            ttl,
            margin,
            renew_every,
            progress_within: None,
        };
        let ttl = ttl.as_duration();
        let margin = timing.margin(timing.ttl);
        if margin >= ttl {
            return Err(TimingError::Margin { margin, ttl });
        }
        let every = renew_every.unwrap_or(ttl / 3);
        let fits = ttl - margin;
        if every.is_zero() || every >= fits {
            return Err(TimingError::RenewEvery { every, fits });
        }
        Ok(timing)
    }

    /// With renewals bound to progress reported within `within` (`None`: not bound).
    pub(crate) fn with_progress(mut self, within: Option<Duration>) -> Result<Self, TimingError> {
        if within.is_some_and(|w| w.is_zero()) {
            return Err(TimingError::ProgressWithin);
        }
        self.progress_within = within;
        Ok(self)
    }

    pub(crate) fn margin(&self, granted: Ttl) -> Duration {
        self.margin
            .unwrap_or_else(|| (granted.as_duration() / 10).max(Duration::from_millis(50)))
    }

    /// How long after a grant was asked for to renew it: the configured interval while it
    /// fits the grant (shorter than the grant minus the margin), else a third of the grant,
    /// and never later than halfway to the local deadline (a fixed margin may take most of
    /// a grant the store cut short).
    pub(crate) fn renew_every(&self, granted: Ttl) -> Duration {
        let granted_d = granted.as_duration();
        let fits = granted_d.saturating_sub(self.margin(granted));
        self.renew_every
            .filter(|every| *every < fits)
            .unwrap_or_else(|| (granted_d / 3).min(fits / 2))
    }

    /// The steady pace of retries after a failed renewal of a grant of `granted`: a quarter of
    /// its renewal interval (10 ms to 1 s). Paced from the grant, not the TTL asked for: a
    /// store that cut a 60 s request to 1 s leaves 900 ms to retry in, not 54 s.
    pub(crate) fn retry_pace(&self, granted: Ttl) -> Duration {
        (self.renew_every(granted) / 4).clamp(Duration::from_millis(10), Duration::from_secs(1))
    }

    /// Whether a grant leaves no time to hold the lease: it is not longer than the margin.
    pub(crate) fn leaves_no_time(&self, granted: Ttl) -> bool {
        granted.as_duration() <= self.margin(granted)
    }

    /// What the client counts on of a grant: what the store granted, never more than was
    /// asked. The contract's grant is the TTL asked for, capped; a longer one (a store's or
    /// a proxy's bug) is not believed, since the store may hold the lease only as long as
    /// was asked.
    pub(crate) fn counted(&self, granted: Ttl) -> Ttl {
        granted.min(self.ttl)
    }

    /// `t_send + granted - margin`; a grant shorter than the margin gives no time at all.
    pub(crate) fn deadline(&self, t_send: Instant, granted: Ttl) -> Instant {
        t_send + granted.as_duration().saturating_sub(self.margin(granted))
    }
}
