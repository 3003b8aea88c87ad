//! A sink store in process memory, for tests: nothing survives the process.

use std::{
    collections::{BTreeSet, HashMap},
    sync::{Arc, Mutex},
    time::Duration,
};

use fence_core::{Generation, JobId, headers::IdempotencyKey};
use fence_storage::clock::{Clock, SystemClock};

use super::{
    Attempt, Begin, Finish, GenerationStore, IdempotencyStore, IdleJob, IdlePage, STAMP_AHEAD_MS,
    StoreError, Verdict, ms, record, stamp_due, stored::StoredBytes,
};

/// Highest generations and idempotency records in memory.
#[derive(Debug, Clone)]
pub struct MemoryStore {
    inner: Arc<Mutex<Inner>>,
    /// The bytes of `Inner::records`, as the sled store counts them (key and encoded value).
    stored: Arc<StoredBytes>,
    clock: Arc<dyn Clock>,
    /// The clock's wall and monotonic readings when the store was made: idempotency records
    /// are timed on the monotonic reading from then ([`records_now_ms`](Self::records_now_ms)).
    made_ms: u64,
    made_monotonic_ms: u64,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

#[derive(Debug, Default)]
struct Inner {
    /// Per job: the highest generation and its stamp (ahead of the last acceptance). Nothing
    /// outlives the process, so [`GenerationStore::load`] reports no stamps.
    highest: HashMap<JobId, (Generation, u64)>,
    /// The same stamps, oldest first.
    by_stamp: BTreeSet<IdleJob>,
    /// Each record with the bytes it counts for in [`MemoryStore::stored`] (kept, so that
    /// replacing or removing it need not encode it again).
    records: HashMap<(JobId, IdempotencyKey), (record::Record, usize)>,
}

impl MemoryStore {
    /// An empty store on the system clock.
    pub fn new() -> Self {
        Self::with_clock(Arc::new(SystemClock::new()))
    }

    /// An empty store whose idempotency records expire on `clock`: its wall time when the
    /// store is made plus its monotonic time since, so that a step of the wall clock is not
    /// time passed for a record in flight or kept.
    pub fn with_clock(clock: Arc<dyn Clock>) -> Self {
        Self {
            inner: Arc::default(),
            stored: Arc::default(),
            made_ms: clock.now_ms(),
            made_monotonic_ms: clock.monotonic_ms(),
            clock,
        }
    }

    /// The time idempotency records and jobs' stamps are written and judged on, as the sled
    /// store's records (the sled store's stamps are on the wall clock, for the next process): a step
    /// of the wall clock forward must not expire a record in flight (a retry would reach
    /// the service while the first attempt runs), nor one back hold a key the step longer.
    fn records_now_ms(&self) -> u64 {
        let since = self
            .clock
            .monotonic_ms()
            .saturating_sub(self.made_monotonic_ms);
        self.made_ms.saturating_add(since)
    }

    /// Puts `new` in the place of (job, key)'s record (`None`: removes it), counting bytes.
    fn replace(&self, inner: &mut Inner, k: (JobId, IdempotencyKey), new: Option<record::Record>) {
        let new_size = new
            .as_ref()
            .map(|r| k.0.as_str().len() + 1 + k.1.as_str().len() + r.encode().len());
        let job = k.0.clone();
        let old = match new.zip(new_size) {
            Some(sized) => inner.records.insert(k, sized),
            None => inner.records.remove(&k),
        };
        self.stored
            .replaced(job.as_str().as_bytes(), old.map(|(_, size)| size), new_size);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl GenerationStore for MemoryStore {
    /// Its jobs die with the process: no later process loads them.
    fn loads_stamps(&self) -> bool {
        false
    }

    async fn observe(&self, job: &JobId, token: Generation) -> Result<Verdict, StoreError> {
        // Stamped and judged idle on the time since the store was made, not the wall clock:
        // nothing outlives the process, and a forward step of the wall clock must not age a
        // job and forget it while its older tokens have not expired.
        let now = self.records_now_ms();
        let mut inner = self.lock();
        let (highest, touched) = inner.highest.get(job).copied().unwrap_or_default();
        if token < highest {
            return Ok(Verdict::Stale { highest });
        }
        if token == highest && !stamp_due(touched, now) {
            return Ok(Verdict::Accepted); // stamped lately
        }
        let stamp = now.saturating_add(STAMP_AHEAD_MS);
        inner.highest.insert(job.clone(), (token, stamp));
        inner.by_stamp.remove(&IdleJob {
            touched_ms: touched,
            job: job.clone(),
        });
        inner.by_stamp.insert(IdleJob {
            touched_ms: stamp,
            job: job.clone(),
        });
        Ok(Verdict::Accepted)
    }

    async fn highest(&self, job: &JobId) -> Result<Generation, StoreError> {
        Ok(self
            .lock()
            .highest
            .get(job)
            .map(|h| h.0)
            .unwrap_or_default())
    }

    async fn idle(&self, page: IdlePage<'_>) -> Result<Vec<IdleJob>, StoreError> {
        let before_ms = self.records_now_ms().saturating_sub(ms(page.idle_for));
        use std::ops::Bound;
        let inner = self.lock();
        let start = page
            .after
            .map_or(Bound::Unbounded, |a| Bound::Excluded(a.clone()));
        Ok(inner
            .by_stamp
            .range((start, Bound::Unbounded))
            .take_while(|i| i.touched_ms < before_ms)
            .take(page.limit)
            .cloned()
            .collect())
    }

    async fn forget(&self, idle: &IdleJob) -> Result<bool, StoreError> {
        let mut inner = self.lock();
        match inner.highest.get(&idle.job) {
            Some(&(_, touched)) if touched == idle.touched_ms => {
                inner.highest.remove(&idle.job);
                inner.by_stamp.remove(idle);
                Ok(true)
            }
            _ => Ok(false),
        }
    }
}

impl IdempotencyStore for MemoryStore {
    async fn begin(&self, attempt: Attempt<'_>, in_flight: Duration) -> Result<Begin, StoreError> {
        let mut inner = self.lock();
        let k = (attempt.job.clone(), attempt.key.clone());
        let (write, answer) = record::begin(
            inner.records.get(&k).map(|(r, _)| r),
            &attempt,
            ms(in_flight),
            record::Now::at(self.records_now_ms()),
        );
        if let Some(r) = write {
            self.replace(&mut inner, k, Some(r));
        }
        Ok(answer)
    }

    async fn finish(&self, attempt: Attempt<'_>, outcome: Finish) -> Result<(), StoreError> {
        let mut inner = self.lock();
        let k = (attempt.job.clone(), attempt.key.clone());
        let now = record::Now::at(self.records_now_ms());
        if let Some(new) = record::finish(
            inner.records.get(&k).map(|(r, _)| r),
            &attempt,
            outcome,
            now,
        ) {
            self.replace(&mut inner, k, new);
        }
        Ok(())
    }

    async fn purge_expired(&self) -> Result<usize, StoreError> {
        let now = self.records_now_ms();
        let mut inner = self.lock();
        let mut purged = 0;
        inner.records.retain(|(job, _), (r, size)| {
            let live = r.is_live(now);
            if !live {
                self.stored
                    .replaced(job.as_str().as_bytes(), Some(*size), None);
                purged += 1;
            }
            live
        });
        Ok(purged)
    }

    fn stored_bytes(&self) -> Option<u64> {
        Some(self.stored.get())
    }

    fn job_stored_bytes(&self, job: &JobId) -> Option<u64> {
        Some(self.stored.of(job.as_str().as_bytes()))
    }
}

#[cfg(test)]
mod conformance {
    use std::sync::Arc;

    use fence_storage::clock::ManualClock;

    use crate::conformance::advance_fn;

    crate::sink_store_conformance!(|| async {
        let clock = ManualClock::new(1_700_000_000_000);
        let store = crate::MemoryStore::with_clock(Arc::new(clock.clone()));
        Some((store, advance_fn(clock)))
    });

    crate::sink_store_step_conformance!(|| async {
        let clock = ManualClock::new(1_700_000_000_000);
        let store = crate::MemoryStore::with_clock(Arc::new(clock.clone()));
        Some((store, clock))
    });
}
