//! Forward steps of the wall clock seen while the store is open, for judging stamps idle.
//!
//! A job's stamp is written on the wall clock (the next process has only that to compare
//! it with). A stamp written before a forward step of the wall clock, judged after it on the
//! wall clock, looks idle by the step: with forgetting on, the job was forgotten at once, and
//! once the clock was set right again (or the process restarted with it right) a stale token
//! that had not expired was taken as the first write of a new job (an audit saw its effect
//! commit after the newer holder's). So the stamps written up to a forward step are judged
//! on the earlier of the wall clock and the time since the open, as an earlier process's are;
//! stamps written after it are judged on the wall clock they were written on (judged on the
//! time since the open, a step of years would keep them from being forgotten for the
//! process's whole life).

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};

use crate::store::STAMP_AHEAD_MS;

/// How far the wall clock may move against the monotonic one between two looks and not
/// count as a step (slewing moves it by microseconds a second).
const TOLERANCE_MS: i64 = 1_000;

/// The stamps to judge on the earlier clock, and the clocks' offset when last looked at.
#[derive(Debug)]
pub(super) struct Steps {
    /// Stamps up to this (wall ms) may have been written before a forward step (or by an
    /// earlier process): judged on the earlier of the two clocks.
    earlier_until_ms: AtomicU64,
    /// The wall clock minus the time since the open, at the last look.
    offset_ms: AtomicI64,
}

impl Steps {
    /// At the open, `opened_ms` on the wall clock: the stamps an earlier process wrote (up to
    /// its stamp ahead, rounded up to the whole second) are judged on the earlier clock.
    pub(super) fn open(opened_ms: u64) -> Self {
        Self {
            earlier_until_ms: AtomicU64::new(after_stamps_of(opened_ms)),
            offset_ms: AtomicI64::new(0),
        }
    }

    /// Looks at the two clocks now (`wall_ms`, and `anchored_ms`, the time since the open on
    /// the wall clock's scale at the open) and answers up to which stamp the earlier of them
    /// judges. A forward step since the last look moves that past every stamp written before
    /// it: before it, the wall clock read the anchored time plus the offset then.
    pub(super) fn earlier_until(&self, wall_ms: u64, anchored_ms: u64) -> u64 {
        let offset = i64::try_from(i128::from(wall_ms) - i128::from(anchored_ms)).unwrap_or(0);
        let before = self.offset_ms.swap(offset, Relaxed);
        if offset > before.saturating_add(TOLERANCE_MS) {
            let wall_before = anchored_ms.saturating_add_signed(before);
            self.earlier_until_ms
                .fetch_max(after_stamps_of(wall_before), Relaxed);
        }
        self.earlier_until_ms.load(Relaxed)
    }
}

/// The latest stamp written by the wall clock reading `wall_ms`: its stamp ahead, rounded up
/// to the whole second of the `stamps` tree.
fn after_stamps_of(wall_ms: u64) -> u64 {
    wall_ms.saturating_add(STAMP_AHEAD_MS + 1_000)
}
