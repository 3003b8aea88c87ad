//! A sink store in process memory, for tests: nothing survives the process.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use fence_core::{Generation, JobId, headers::IdempotencyKey};
use fence_storage::clock::{Clock, SystemClock};

use super::{
    Attempt, Begin, Finish, GenerationStore, IdempotencyStore, StoreError, Verdict, ms, record,
};

/// Highest generations and idempotency records in memory.
#[derive(Debug, Clone)]
pub struct MemoryStore {
    inner: Arc<Mutex<Inner>>,
    clock: Arc<dyn Clock>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

#[derive(Debug, Default)]
struct Inner {
    highest: HashMap<JobId, Generation>,
    records: HashMap<(JobId, IdempotencyKey), record::Record>,
}

impl MemoryStore {
    /// An empty store on the system clock.
    pub fn new() -> Self {
        Self::with_clock(Arc::new(SystemClock::new()))
    }

    /// An empty store whose idempotency records expire on `clock`.
    pub fn with_clock(clock: Arc<dyn Clock>) -> Self {
        Self {
            inner: Arc::default(),
            clock,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl GenerationStore for MemoryStore {
    async fn observe(&self, job: &JobId, token: Generation) -> Result<Verdict, StoreError> {
        let mut inner = self.lock();
        let highest = inner.highest.entry(job.clone()).or_default();
        if token < *highest {
            return Ok(Verdict::Stale { highest: *highest });
        }
        *highest = token;
        Ok(Verdict::Accepted)
    }

    async fn highest(&self, job: &JobId) -> Result<Generation, StoreError> {
        Ok(self.lock().highest.get(job).copied().unwrap_or_default())
    }
}

impl IdempotencyStore for MemoryStore {
    async fn begin(&self, attempt: Attempt<'_>, in_flight: Duration) -> Result<Begin, StoreError> {
        let mut inner = self.lock();
        let k = (attempt.job.clone(), attempt.key.clone());
        let (write, answer) = record::begin(
            inner.records.get(&k),
            attempt.fingerprint,
            ms(in_flight),
            self.clock.now_ms(),
        );
        if let Some(r) = write {
            inner.records.insert(k, r);
        }
        Ok(answer)
    }

    async fn finish(&self, attempt: Attempt<'_>, outcome: Finish) -> Result<(), StoreError> {
        let mut inner = self.lock();
        let k = (attempt.job.clone(), attempt.key.clone());
        let now = self.clock.now_ms();
        match record::finish(inner.records.get(&k), attempt.fingerprint, outcome, now) {
            Some(Some(r)) => {
                inner.records.insert(k, r);
            }
            Some(None) => {
                inner.records.remove(&k);
            }
            None => {}
        }
        Ok(())
    }

    async fn purge_expired(&self) -> Result<usize, StoreError> {
        let now = self.clock.now_ms();
        let mut inner = self.lock();
        let before = inner.records.len();
        inner.records.retain(|_, r| r.is_live(now));
        Ok(before - inner.records.len())
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
}
