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
    atomic::{
        AtomicI64,
        Ordering::{AcqRel, Acquire, Release},
    },
};

use crate::store::STAMP_AHEAD_MS;

/// How far the offset may move from the current segment's and not count as a step (slewing
/// moves it by microseconds a second).
const TOLERANCE_MS: i64 = 1_000;

/// The most closed segments kept; past it the two neighbours with the closest offsets merge
/// (their smaller offset, their later end), which only takes stamps for younger.
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
    /// The lowest offset seen (0 at the open).
    lowest: AtomicI64,
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
            lowest: AtomicI64::new(0),
        }
    }

    /// Looks at the two clocks now (`wall_ms`, and `anchored_ms`, the time since the open on
    /// the wall clock's scale at the open), before a stamp is written or judged: a change of
    /// the offset since the current segment began closes it, up to the latest stamp written
    /// under it. Answers the new lowest offset when this one is lower than any before (a
    /// step back: the store records it for the next process, see `boot`).
    pub(super) fn observe(&self, wall_ms: u64, anchored_ms: u64) -> Option<i64> {
        let offset = offset(wall_ms, anchored_ms);
        if offset.abs_diff(self.current.load(Acquire)) <= TOLERANCE_MS.unsigned_abs() {
            return None;
        }
        let mut closed = self.closed.lock().unwrap_or_else(|e| e.into_inner());
        let current = self.current.load(Acquire);
        if offset.abs_diff(current) <= TOLERANCE_MS.unsigned_abs() {
            return None; // another caller closed it meanwhile
        }
        // Under the old offset (and up to the tolerance above it, which did not close the
        // segment) the wall clock would read this now: every stamp written under it is at
        // most that plus the stamp ahead.
        let wall_under_it = anchored_ms.saturating_add_signed(current.saturating_add(TOLERANCE_MS));
        closed.push(Segment {
            until_ms: after_stamps_of(wall_under_it),
            offset_ms: current,
        });
        if closed.len() > MAX_SEGMENTS {
            // The two neighbours whose offsets are closest merge: stamps of the one with the
            // larger offset are taken for younger by that difference, the least there is.
            let i = (0..closed.len() - 1)
                .min_by_key(|&i| closed[i].offset_ms.abs_diff(closed[i + 1].offset_ms))
                .unwrap_or(0);
            let (a, b) = (closed[i], closed[i + 1]);
            closed.splice(
                i..i + 2,
                [Segment {
                    until_ms: a.until_ms.max(b.until_ms),
                    offset_ms: a.offset_ms.min(b.offset_ms),
                }],
            );
        }
        self.current.store(offset, Release);
        (offset < self.lowest.fetch_min(offset, AcqRel)).then_some(offset)
    }

    /// How to judge stamps now (after [`observe`](Self::observe)).
    pub(super) fn judge(&self, anchored_ms: u64) -> Judge {
        let closed = self.closed.lock().unwrap_or_else(|e| e.into_inner());
        Judge {
            anchored_ms,
            current_ms: self.current.load(Acquire),
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
    /// was written under (the smallest that may be its own, the current one at most), less
    /// the tolerance (within it the offset may have crept up unseen, and a stamp written
    /// then would otherwise be aged by up to that).
    pub(super) fn now_for(&self, stamp_ms: u64) -> u64 {
        let offset = self
            .closed
            .iter()
            .filter(|s| stamp_ms <= s.until_ms)
            .map(|s| s.offset_ms)
            .fold(self.current_ms, i64::min);
        self.anchored_ms
            .saturating_add_signed(offset.saturating_sub(TOLERANCE_MS))
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
    const AHEAD: i64 = STAMP_AHEAD_MS as i64;

    /// A stamp written at `at` ms after the open under `offset`.
    fn stamp(at: u64, offset: i64) -> u64 {
        (OPEN + at).saturating_add_signed(offset) + STAMP_AHEAD_MS
    }

    /// The age `judge` gives a stamp at `at_now` ms after the open, under `offset_now`.
    fn age(steps: &Steps, at_now: u64, offset_now: i64, stamp_ms: u64) -> i64 {
        let anchored = OPEN + at_now;
        steps.observe(anchored.saturating_add_signed(offset_now), anchored);
        let now = steps.judge(anchored).now_for(stamp_ms);
        i64::try_from(now).unwrap() - i64::try_from(stamp_ms).unwrap()
    }

    /// A judged age is the real one (less the stamp ahead), or up to the tolerance younger:
    /// never older.
    fn assert_age(judged: i64, real: i64) {
        assert!(
            (real - TOLERANCE_MS..=real).contains(&judged),
            "judged {judged} ms old, {real} ms passed"
        );
    }

    /// Each stamp is judged by the offset it was written under, whatever steps came after,
    /// so its age is the real time since it (less the stamp ahead): one step forward, two
    /// steps forward, a step back then forward (a review's scenarios), small steps that each
    /// stay under the tolerance but add up, and a stamp written while the offset had crept up
    /// within the tolerance just before a step (a second review's).
    #[test]
    fn a_stamp_is_judged_by_the_offset_it_was_written_under() {
        // One step forward: before it on the time since the open, after it on the wall.
        let s = Steps::open(OPEN);
        let before = stamp(100_000, 0);
        s.observe(OPEN + 100_000, OPEN + 100_000);
        s.observe((OPEN + 110_000).saturating_add_signed(HOUR), OPEN + 110_000);
        let after = stamp(120_000, HOUR);
        assert_age(age(&s, 200_000, HOUR, before), 100_000 - AHEAD);
        assert_age(age(&s, 200_000, HOUR, after), 80_000 - AHEAD);
        // Two steps forward (years, then 2 s): the stamps between judged by the first.
        let s = Steps::open(OPEN);
        let years = 50 * 365 * 24 * HOUR;
        s.observe((OPEN + 10_000).saturating_add_signed(years), OPEN + 10_000);
        let between = stamp(20_000, years);
        s.observe(
            (OPEN + 30_000).saturating_add_signed(years + 2_000),
            OPEN + 30_000,
        );
        assert_age(age(&s, 40_000, years + 2_000, between), 20_000 - AHEAD);
        // Back an hour, then forward two: the stamp before both is not aged.
        let s = Steps::open(OPEN);
        s.observe(OPEN + 100_000, OPEN + 100_000);
        let j = stamp(100_000, 0);
        s.observe(
            (OPEN + 106_000).saturating_add_signed(-HOUR),
            OPEN + 106_000,
        );
        s.observe((OPEN + 111_000).saturating_add_signed(HOUR), OPEN + 111_000);
        assert_age(age(&s, 111_000, HOUR, j), 11_000 - AHEAD);
        // Forward an hour, a stamp, back to 0 unseen, then forward two hours.
        let s = Steps::open(OPEN);
        s.observe((OPEN + 50_000).saturating_add_signed(HOUR), OPEN + 50_000);
        let j = stamp(50_000, HOUR);
        assert_age(age(&s, 60_000, 2 * HOUR, j), 10_000 - AHEAD);
        // Steps of 0.9 s, each seen: they add up to a step that is seen.
        let s = Steps::open(OPEN);
        let j = stamp(1_000, 0);
        for i in 1..=10 {
            let at = 1_000 + i * 1_000;
            let offset = i64::try_from(i).unwrap() * 900;
            s.observe((OPEN + at).saturating_add_signed(offset), OPEN + at);
        }
        assert_age(age(&s, 11_000, 9_000, j), 10_000 - AHEAD);
        // The offset creeps up 0.9 s (unseen: under the tolerance), a stamp (its index entry
        // rounded up to the whole second, as sled's `stamps` tree keeps it), then a step of an
        // hour 0.2 s later: the stamp is judged by the crept offset, not the hour's.
        let s = Steps::open(OPEN);
        s.observe(OPEN + 100_500 + 900, OPEN + 100_500);
        let j = stamp(100_500, 900).div_ceil(1_000) * 1_000;
        s.observe((OPEN + 100_700).saturating_add_signed(HOUR), OPEN + 100_700);
        let judged = age(&s, 101_700, HOUR, j);
        assert!(
            (-3_000..0).contains(&(judged + AHEAD)),
            "judged {judged} ms old, 1.2 s after it was written"
        );
    }

    /// A step back takes stamps for younger (liveness), never older: a stamp written before
    /// it is judged by its own offset, one after it too, and the earlier process's stamps
    /// by offset 0 or the current one, the smaller. The lowest offset is reported once, for
    /// the store to record for the next process.
    #[test]
    fn a_step_back_never_ages_a_stamp() {
        let s = Steps::open(OPEN);
        let earlier = OPEN - 5_000;
        let before = stamp(100_000, 0);
        assert_eq!(
            s.observe(
                (OPEN + 110_000).saturating_add_signed(-HOUR),
                OPEN + 110_000
            ),
            Some(-HOUR)
        );
        assert_eq!(
            s.observe(
                (OPEN + 111_000).saturating_add_signed(-HOUR),
                OPEN + 111_000
            ),
            None
        );
        let after = stamp(120_000, -HOUR);
        assert!(age(&s, 200_000, -HOUR, before) <= 100_000 - AHEAD);
        assert_age(age(&s, 200_000, -HOUR, after), 80_000 - AHEAD);
        assert!(age(&s, 200_000, -HOUR, earlier) <= 205_000);
        assert_eq!(
            s.observe(
                (OPEN + 300_000).saturating_add_signed(-HOUR / 2),
                OPEN + 300_000
            ),
            None,
            "not the lowest"
        );
    }

    /// Past the most segments kept, the two with the closest offsets merge: stamps are taken
    /// for younger, never older, and by no more than the offsets' difference. A step of
    /// years followed by 40 small ones does not take the stamps after the big one back to
    /// the open's offset (a review: forgetting frozen for 55 years).
    #[test]
    fn merged_segments_only_take_stamps_for_younger() {
        let years = 55 * 365 * 24 * HOUR;
        let s = Steps::open(OPEN);
        let first = stamp(0, 0);
        s.observe((OPEN + 5_000).saturating_add_signed(years), OPEN + 5_000);
        let late = stamp(6_000, years);
        for i in 1..=(MAX_SEGMENTS as u64 + 8) {
            let at = 10_000 + i * 10_000;
            let offset = years + i64::try_from(i).unwrap() * 5_000;
            s.observe((OPEN + at).saturating_add_signed(offset), OPEN + at);
        }
        assert_eq!(s.closed.lock().unwrap().len(), MAX_SEGMENTS);
        let at_now = (MAX_SEGMENTS as u64 + 9) * 10_000 + 10_000;
        let offset_now = years + (MAX_SEGMENTS as i64 + 8) * 5_000;
        assert_age(age(&s, at_now, offset_now, first), at_now as i64 - AHEAD);
        let judged = age(&s, at_now, offset_now, late);
        let real = at_now as i64 - 6_000 - AHEAD;
        assert!(
            judged <= real && judged > real - 60_000,
            "judged {judged} ms old, {real} ms passed"
        );
    }
}
