//! A count of the bytes the idempotency records hold, in all and per job.

use std::sync::atomic::{AtomicU64, Ordering};

use dashmap::DashMap;

/// Bytes of idempotency records (each its key plus its encoded value), adjusted at every
/// write and removal: what [`IdempotencyStore::stored_bytes`](super::IdempotencyStore::stored_bytes)
/// and [`IdempotencyStore::job_stored_bytes`](super::IdempotencyStore::job_stored_bytes)
/// report.
#[derive(Debug, Default)]
pub(crate) struct StoredBytes {
    total: AtomicU64,
    /// Per job (its id's bytes), what its records hold; a job without records has no entry,
    /// so the map is as large as the jobs with records.
    jobs: DashMap<Box<[u8]>, u64>,
}

impl StoredBytes {
    /// The bytes of the records already stored, as counted at an open.
    pub(crate) fn counted(jobs: impl IntoIterator<Item = (Box<[u8]>, u64)>) -> Self {
        let counted = Self::default();
        for (job, bytes) in jobs {
            counted.adjust(&job, 0, bytes);
        }
        counted
    }

    pub(crate) fn get(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }

    /// What the records of `job` hold.
    pub(crate) fn of(&self, job: &[u8]) -> u64 {
        self.jobs.get(job).map_or(0, |n| *n)
    }

    /// A record of `job` of `old` bytes (`None`: there was none) is now one of `new`
    /// (`None`: gone).
    pub(crate) fn replaced(&self, job: &[u8], old: Option<usize>, new: Option<usize>) {
        self.adjust(job, as_u64(old), as_u64(new));
    }

    fn adjust(&self, job: &[u8], old: u64, new: u64) {
        if new >= old {
            self.total.fetch_add(new - old, Ordering::Relaxed);
        } else {
            // Saturating: a count that went wrong must not wrap into "full" for ever.
            let _ = self
                .total
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                    Some(n.saturating_sub(old - new))
                });
        }
        let apply = |n: &mut u64| *n = n.saturating_sub(old).saturating_add(new);
        if let Some(mut n) = self.jobs.get_mut(job) {
            apply(&mut n);
            let empty = *n == 0;
            drop(n);
            if empty {
                self.jobs.remove_if(job, |_, n| *n == 0);
            }
        } else if new > old {
            // Only a record added makes an entry (one allocation per job, not per write).
            self.jobs
                .entry(job.into())
                .and_modify(apply)
                .or_insert(new - old);
        }
    }
}

fn as_u64(bytes: Option<usize>) -> u64 {
    bytes.map_or(0, |n| u64::try_from(n).unwrap_or(u64::MAX))
}

/// The bytes one record counts for: its key and its value, or `None` when there is no value.
pub(crate) fn entry_len(key: &[u8], value: Option<&[u8]>) -> Option<usize> {
    value.map(|v| key.len().saturating_add(v.len()))
}
