//! A count of the bytes the idempotency records hold, in all and per job.

use std::sync::atomic::{AtomicI64, Ordering};

use dashmap::DashMap;

/// Bytes of idempotency records (each its key plus its encoded value), adjusted at every
/// write and removal: what [`IdempotencyStore::stored_bytes`](super::IdempotencyStore::stored_bytes)
/// and [`IdempotencyStore::job_stored_bytes`](super::IdempotencyStore::job_stored_bytes)
/// report.
///
/// Signed: the stores count a change after it is made, so a record's removal (the purge of
/// one born expired) may be counted before its writing, and a count below zero for a moment
/// comes back to the right one when the other is counted (a count clamped at zero would keep
/// the writing's bytes for ever). Reported never below zero.
#[derive(Debug, Default)]
pub(crate) struct StoredBytes {
    total: AtomicI64,
    /// Per job (its id's bytes), what its records hold; a job whose count is zero has no
    /// entry, so the map is as large as the jobs with records.
    jobs: DashMap<Box<[u8]>, i64>,
}

impl StoredBytes {
    /// The bytes of the records already stored, as counted at an open.
    pub(crate) fn counted(jobs: impl IntoIterator<Item = (Box<[u8]>, u64)>) -> Self {
        let counted = Self::default();
        for (job, bytes) in jobs {
            counted.adjust(&job, i64::try_from(bytes).unwrap_or(i64::MAX));
        }
        counted
    }

    pub(crate) fn get(&self) -> u64 {
        u64::try_from(self.total.load(Ordering::Relaxed)).unwrap_or(0)
    }

    /// What the records of `job` hold.
    pub(crate) fn of(&self, job: &[u8]) -> u64 {
        self.jobs
            .get(job)
            .map_or(0, |n| u64::try_from(*n).unwrap_or(0))
    }

    /// A record of `job` of `old` bytes (`None`: there was none) is now one of `new`
    /// (`None`: gone).
    pub(crate) fn replaced(&self, job: &[u8], old: Option<usize>, new: Option<usize>) {
        self.adjust(job, as_i64(new).saturating_sub(as_i64(old)));
    }

    fn adjust(&self, job: &[u8], delta: i64) {
        if delta == 0 {
            return;
        }
        self.total.fetch_add(delta, Ordering::Relaxed);
        let apply = |n: &mut i64| *n = n.saturating_add(delta);
        let emptied = match self.jobs.get_mut(job) {
            Some(mut n) => {
                apply(&mut n);
                *n == 0
            }
            // No entry yet (one allocation per job with records, not per write).
            None => {
                let mut n = self.jobs.entry(job.into()).or_insert(0);
                apply(&mut n);
                *n == 0
            }
        };
        if emptied {
            self.jobs.remove_if(job, |_, n| *n == 0);
        }
    }
}

fn as_i64(bytes: Option<usize>) -> i64 {
    bytes.map_or(0, |n| i64::try_from(n).unwrap_or(i64::MAX))
}

/// The bytes one record counts for: its key and its value, or `None` when there is no value.
pub(crate) fn entry_len(key: &[u8], value: Option<&[u8]>) -> Option<usize> {
    value.map(|v| key.len().saturating_add(v.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record's removal counted before its writing (a record born expired, purged between
    /// its write and the count) leaves the counts right once both are counted, and a job
    /// whose records are all gone has no entry left.
    #[test]
    fn counts_come_back_right_whatever_order_changes_are_counted_in() {
        let counted = StoredBytes::counted([(Box::from(&b"a"[..]), 100)]);
        assert_eq!((counted.get(), counted.of(b"a")), (100, 100));
        // Job b: its record's removal counted first, then its writing.
        counted.replaced(b"b", Some(40), None);
        assert_eq!(
            (counted.get(), counted.of(b"b")),
            (60, 0),
            "never below zero"
        );
        counted.replaced(b"b", None, Some(40));
        assert_eq!((counted.get(), counted.of(b"b")), (100, 0));
        assert!(
            !counted.jobs.contains_key(&b"b"[..]),
            "an empty job kept its entry"
        );
        // Replaced by a larger record, then removed.
        counted.replaced(b"a", Some(100), Some(150));
        assert_eq!((counted.get(), counted.of(b"a")), (150, 150));
        counted.replaced(b"a", Some(150), None);
        assert_eq!((counted.get(), counted.of(b"a")), (0, 0));
        assert!(counted.jobs.is_empty());
    }
}
