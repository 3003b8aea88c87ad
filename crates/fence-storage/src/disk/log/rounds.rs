//! The log writer's rounds, timed: decisions are refused while one lasts too long, or after the log failed.

use std::{
    io,
    sync::atomic::{AtomicBool, AtomicU64, Ordering},
    time::{Duration, Instant},
};

/// When the writer's current round (a write and its sync, or a rotation) began, and whether
/// the log has failed: read by every decision without a lock.
#[derive(Debug)]
pub(in crate::disk) struct Rounds {
    /// Milliseconds after `started`, plus one; 0 between rounds.
    began: AtomicU64,
    started: Instant,
    /// How long a round may last before decisions are refused.
    limit: Duration,
    /// Set once the log failed (as `State::failed`).
    broken: AtomicBool,
}

/// The error a write is refused with once the log failed.
pub(in crate::disk) fn failed() -> sled::Error {
    sled::Error::Io(io::Error::other(
        "the write-ahead log failed earlier: writes are refused until the process restarts",
    ))
}

impl Rounds {
    pub(super) fn new(limit: Duration) -> Self {
        Self {
            began: AtomicU64::new(0),
            started: Instant::now(),
            limit,
            broken: AtomicBool::new(false),
        }
    }

    /// Whether a decision may be applied: refused while the writer's round has lasted
    /// longer than the limit, and for good once the log failed. A decision applied then
    /// would be read by others (a generation, a holder) while it cannot be made durable,
    /// and its record held in memory for as long as the disk stalls; refused, it is
    /// neither, and the caller answers 503. Taken again once the round ends.
    ///
    /// # Errors
    /// An I/O error of kind `TimedOut` (stalled) or `Other` (failed) that says so.
    pub(in crate::disk) fn writable(&self) -> sled::Result<()> {
        if self.broken.load(Ordering::Acquire) {
            return Err(failed());
        }
        let began = self.began.load(Ordering::Acquire);
        if began == 0 {
            return Ok(());
        }
        let stalled = Duration::from_millis(self.millis().saturating_sub(began));
        if stalled <= self.limit {
            return Ok(());
        }
        Err(sled::Error::Io(io::Error::new(
            io::ErrorKind::TimedOut,
            format!(
                "the disk has not finished a write for {} ms (limit {} ms): writes are refused, unapplied, until it does",
                stalled.as_millis(),
                self.limit.as_millis()
            ),
        )))
    }

    /// Milliseconds since `started`, plus one (never 0, which means "no round").
    fn millis(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX - 1) + 1
    }

    pub(super) fn begin(&self) {
        self.began.store(self.millis(), Ordering::Release);
    }

    pub(super) fn end(&self) {
        self.began.store(0, Ordering::Release);
    }

    /// The log failed: every later decision is refused, saying so.
    pub(super) fn fail(&self) {
        self.broken.store(true, Ordering::Release);
        self.end();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(r: sled::Result<()>) -> Option<io::ErrorKind> {
        match r {
            Ok(()) => None,
            Err(sled::Error::Io(e)) => Some(e.kind()),
            Err(other) => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_round_past_its_limit_refuses_until_it_ends_and_a_failure_refuses_for_good() {
        // 500 ms: "within the limit" must hold across a descheduling on a loaded machine
        // (with 20 ms it could read as timed out).
        let rounds = Rounds::new(Duration::from_millis(500));
        assert_eq!(kind(rounds.writable()), None);
        rounds.begin();
        assert_eq!(kind(rounds.writable()), None, "within the limit");
        std::thread::sleep(Duration::from_millis(600));
        assert_eq!(kind(rounds.writable()), Some(io::ErrorKind::TimedOut));
        rounds.end();
        assert_eq!(kind(rounds.writable()), None, "the round ended");
        rounds.begin();
        rounds.fail();
        let failed = rounds.writable().unwrap_err().to_string();
        assert!(failed.contains("failed earlier"), "{failed}");
    }
}
