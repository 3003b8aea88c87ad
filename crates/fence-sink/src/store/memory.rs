//! A sink store in process memory, for tests: nothing survives the process.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use fence_core::{Generation, JobId, headers::IdempotencyKey};

use super::{Begin, Finish, GenerationStore, IdempotencyStore, StoreError, Verdict, ms, now_ms};
use crate::idempotency::{Fingerprint, record};

/// Highest generations and idempotency records in memory.
#[derive(Debug, Clone, Default)]
pub struct MemoryStore {
    inner: Arc<Mutex<Inner>>,
}

#[derive(Debug, Default)]
struct Inner {
    highest: HashMap<JobId, Generation>,
    records: HashMap<(JobId, IdempotencyKey), record::Record>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
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
    async fn begin(
        &self,
        job: &JobId,
        key: &IdempotencyKey,
        fp: &Fingerprint,
        in_flight_for: Duration,
    ) -> Result<Begin, StoreError> {
        let mut inner = self.lock();
        let k = (job.clone(), key.clone());
        let (write, answer) = record::begin(inner.records.get(&k), fp, ms(in_flight_for), now_ms());
        if let Some(r) = write {
            inner.records.insert(k, r);
        }
        Ok(answer)
    }

    async fn finish(
        &self,
        job: &JobId,
        key: &IdempotencyKey,
        fp: &Fingerprint,
        outcome: Finish,
        retention: Duration,
    ) -> Result<(), StoreError> {
        let mut inner = self.lock();
        let k = (job.clone(), key.clone());
        match record::finish(inner.records.get(&k), fp, outcome, ms(retention), now_ms()) {
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
        let now = now_ms();
        let mut inner = self.lock();
        let before = inner.records.len();
        inner.records.retain(|_, r| r.is_live(now));
        Ok(before - inner.records.len())
    }
}

#[cfg(test)]
mod conformance {
    crate::sink_store_conformance!(|| async { Some(crate::MemoryStore::new()) });
}
