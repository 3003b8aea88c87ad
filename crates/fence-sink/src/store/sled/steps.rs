//! Steps of the wall clock seen while the store is open, for judging stamps idle.
//!
//! A job's stamp is written on the wall clock (the next process has only that to compare
//! it with). A stamp written before a forward step of the wall clock, judged after it on the
//! wall clock, looks idle by the step: with forgetting on, the job was forgotten at once, and
//! once the clock was set right again (or the process restarted with it right) a stale token
//! that had not expired was taken as the first write of a new job (an audit saw its effect
//! commit after the newer holder's). So the store tracks the wall clock's offset from its
//! monotonic time since the open ([`Steps::observe`], at every stamp it writes and at every
//! look for idle jobs) in segments, and judges a stamp by the offset it was written under
//! ([`Judge`]): the real time since it. Where the wall-clock ranges of several segments hold
//! a stamp (after a step back), the smallest offset among them judges it, which takes it for
//! younger, never older, than it is. Stamps of an earlier process are judged as written
//! under offset 0 (the wall clock at the open) or the current one, whichever is smaller.

use std::sync::{
    Mutex,
    atomic::{AtomicI64, Ordering::Relaxed},
};

use crate::store::STAMP_AHEAD_MS;

/// How far the offset may move from the current segment's and not count as a step (slewing
/// moves it by microseconds a second).
const TOLERANCE_MS: i64 = 1_000;

/// The most closed segments kept; past it the two oldest merge (their smaller offset, their
/// later end), which only takes stamps for younger.
const MAX_SEGMENTS: usize = 32;

/// The stamps written while the wall clock ran `offset_ms` ahead of the time since the open
/// (behind, when negative), up to `until_ms` on the wall clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Segment {
    until_ms: u64,
    offset_ms: i64,
}

/// The wall clock's steps since the open.
#[derive(Debug)]
pub(super) struct Steps {
    /// The current segment's offset (read without the lock on every stamp).
    current: AtomicI64,
    /// The closed segments, oldest first; the first holds what an earlier process stamped.
    closed: Mutex<Vec<Segment>>,
}

impl Steps {
    /// At the open, `opened_ms` on the wall clock: the stamps an earlier process wrote (up to
    /// its stamp ahead, rounded up to the whole second) are judged as written under offset 0.
    pub(super) fn open(opened_ms: u64) -> Self {
        Self {
            current: AtomicI64::new(0),
            closed: Mutex::new(vec![Segment {
                until_ms: after_stamps_of(opened_ms),
                offset_ms: 0,
            }]),
        }
    }

    /// Looks at the two clocks now (`wall_ms`, and `anchored_ms`, the time since the open on
    /// the wall clock's scale at the open), before a stamp is written or judged: a change of
    /// the offset since the current segment began closes it, up to the latest stamp written
    /// under it.
    pub(super) fn observe(&self, wall_ms: u64, anchored_ms: u64) {
        let offset = offset(wall_ms, anchored_ms);
        if offset.abs_diff(self.current.load(Relaxed)) <= TOLERANCE_MS.unsigned_abs() {
            return;
        }
        let mut closed = self.closed.lock().unwrap_or_else(|e| e.into_inner());
        let current = self.current.load(Relaxed);
        if offset.abs_diff(current) <= TOLERANCE_MS.unsigned_abs() {
            return; // another caller closed it meanwhile
        }
        // Under the old offset the wall clock would read this now: every stamp written
        // under it is at most that plus the stamp ahead.
        closed.push(Segment {
            until_ms: after_stamps_of(anchored_ms.saturating_add_signed(current)),
            offset_ms: current,
        });
        if closed.len() > MAX_SEGMENTS {
            let (a, b) = (closed[0], closed[1]);
            closed.splice(
                0..2,
                [Segment {
                    until_ms: a.until_ms.max(b.until_ms),
                    offset_ms: a.offset_ms.min(b.offset_ms),
                }],
            );
        }
        self.current.store(offset, Relaxed);
    }

    /// How to judge stamps now (after [`observe`](Self::observe)).
    pub(super) fn judge(&self, anchored_ms: u64) -> Judge {
        let closed = self.closed.lock().unwrap_or_else(|e| e.into_inner());
        Judge {
            anchored_ms,
            current_ms: self.current.load(Relaxed),
            closed: closed.clone(),
        }
    }
}

/// The segments at one look, to judge stamps by.
pub(super) struct Judge {
    anchored_ms: u64,
    current_ms: i64,
    closed: Vec<Segment>,
}

impl Judge {
    /// The time a stamp `stamp_ms` is judged at: the time since the open plus the offset it
    /// was written under (the smallest that may be its own, the current one at most).
    pub(super) fn now_for(&self, stamp_ms: u64) -> u64 {
        let offset = self
            .closed
            .iter()
            .filter(|s| stamp_ms <= s.until_ms)
            .map(|s| s.offset_ms)
            .fold(self.current_ms, i64::min);
        self.anchored_ms.saturating_add_signed(offset)
    }
}

/// The wall clock minus the time since the open.
fn offset(wall_ms: u64, anchored_ms: u64) -> i64 {
    let d = i128::from(wall_ms) - i128::from(anchored_ms);
    i64::try_from(d).unwrap_or(if d < 0 { i64::MIN } else { i64::MAX })
}

/// The latest stamp written by the wall clock reading `wall_ms`: its stamp ahead, rounded up
/// to the whole second of the `stamps` tree.
fn after_stamps_of(wall_ms: u64) -> u64 {
    wall_ms.saturating_add(STAMP_AHEAD_MS + 1_000)
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPEN: u64 = 1_700_000_000_000;
    const HOUR: i64 = 3_600_000;

    /// A stamp written at `at` ms after the open under `offset`.
    fn stamp(at: u64, offset: i64) -> u64 {
        (OPEN + at).saturating_add_signed(offset) + STAMP_AHEAD_MS
    }

    /// The real age `judge` gives a stamp: how long ago by the time since the open.
    fn age(steps: &Steps, at_now: u64, offset_now: i64, stamp_ms: u64) -> i64 {
        let anchored = OPEN + at_now;
        steps.observe(anchored.saturating_add_signed(offset_now), anchored);
        let now = steps.judge(anchored).now_for(stamp_ms);
        i64::try_from(now).unwrap() - i64::try_from(stamp_ms).unwrap()
    }

    /// Each stamp is judged by the offset it was written under, whatever steps came after,
    /// so its age is the real time since it (less the stamp ahead): one step forward, two
    /// steps forward, a step back then forward (a review's scenarios), and small steps that
    /// each stay under the tolerance but add up.
    #[test]
    fn a_stamp_is_judged_by_the_offset_it_was_written_under() {
        let ahead = i64::try_from(STAMP_AHEAD_MS).unwrap();
        // One step forward: before it on the time since the open, after it on the wall.
        let s = Steps::open(OPEN);
        let before = stamp(100_000, 0);
        s.observe(OPEN + 100_000, OPEN + 100_000);
        s.observe((OPEN + 110_000).saturating_add_signed(HOUR), OPEN + 110_000);
        let after = stamp(120_000, HOUR);
        assert_eq!(age(&s, 200_000, HOUR, before), 100_000 - ahead);
        assert_eq!(age(&s, 200_000, HOUR, after), 80_000 - ahead);
        // Two steps forward (years, then 2 s): the stamps between judged by the first.
        let s = Steps::open(OPEN);
        let years = 50 * 365 * 24 * HOUR;
        s.observe((OPEN + 10_000).saturating_add_signed(years), OPEN + 10_000);
        let between = stamp(20_000, years);
        s.observe(
            (OPEN + 30_000).saturating_add_signed(years + 2_000),
            OPEN + 30_000,
        );
        assert_eq!(age(&s, 40_000, years + 2_000, between), 20_000 - ahead);
        // Back an hour, then forward two: the stamp before both is not aged.
        let s = Steps::open(OPEN);
        s.observe(OPEN + 100_000, OPEN + 100_000);
        let j = stamp(100_000, 0);
        s.observe(
            (OPEN + 106_000).saturating_add_signed(-HOUR),
            OPEN + 106_000,
        );
        s.observe((OPEN + 111_000).saturating_add_signed(HOUR), OPEN + 111_000);
        assert_eq!(age(&s, 111_000, HOUR, j), 11_000 - ahead);
        // Forward an hour, a stamp, back to 0 unseen, then forward two hours.
        let s = Steps::open(OPEN);
        s.observe((OPEN + 50_000).saturating_add_signed(HOUR), OPEN + 50_000);
        let j = stamp(50_000, HOUR);
        assert_eq!(age(&s, 60_000, 2 * HOUR, j), 10_000 - ahead);
        // Steps of 0.9 s, each seen: they add up to a step that is seen.
        let s = Steps::open(OPEN);
        let j = stamp(1_000, 0);
        for i in 1..=10 {
            let at = 1_000 + i * 1_000;
            let offset = i64::try_from(i).unwrap() * 900;
            s.observe((OPEN + at).saturating_add_signed(offset), OPEN + at);
        }
        let real = 11_000 - 1_000 - ahead;
        let judged = age(&s, 11_000, 9_000, j);
        assert!(
            (real..=real + TOLERANCE_MS).contains(&judged),
            "aged {judged} ms for {real} ms passed"
        );
    }

    /// A step back takes stamps for younger (liveness), never older: a stamp written before
    /// it is judged by its own offset, one after it too, and the earlier process's stamps
    /// by offset 0 or the current one, the smaller.
    #[test]
    fn a_step_back_never_ages_a_stamp() {
        let ahead = i64::try_from(STAMP_AHEAD_MS).unwrap();
        let s = Steps::open(OPEN);
        let earlier = OPEN - 5_000;
        let before = stamp(100_000, 0);
        s.observe(
            (OPEN + 110_000).saturating_add_signed(-HOUR),
            OPEN + 110_000,
        );
        let after = stamp(120_000, -HOUR);
        assert!(age(&s, 200_000, -HOUR, before) <= 100_000 - ahead);
        assert_eq!(age(&s, 200_000, -HOUR, after), 80_000 - ahead);
        assert!(age(&s, 200_000, -HOUR, earlier) <= 205_000);
    }

    /// Past the most segments kept, the oldest merge: stamps are taken for younger, not older.
    #[test]
    fn merged_segments_only_take_stamps_for_younger() {
        let s = Steps::open(OPEN);
        let first = stamp(0, 0);
        for i in 1..=(MAX_SEGMENTS as u64 + 8) {
            let at = i * 10_000;
            let offset = i64::try_from(i).unwrap() * 5_000;
            s.observe((OPEN + at).saturating_add_signed(offset), OPEN + at);
        }
        assert_eq!(s.closed.lock().unwrap().len(), MAX_SEGMENTS);
        let at_now = (MAX_SEGMENTS as u64 + 9) * 10_000;
        let real = i64::try_from(at_now).unwrap() - i64::try_from(STAMP_AHEAD_MS).unwrap();
        assert!(age(&s, at_now, 500_000, first) <= real);
    }
}
