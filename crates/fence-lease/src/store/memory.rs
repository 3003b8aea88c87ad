//! A lease store in process memory, for tests and single-process tools.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use fence_core::{Generation, JobId, Owner};

use super::{
    ClaimOutcome, FinishOutcome, LeaseRecord, LeaseStore, RenewOutcome, StoreError, rules,
};
use crate::{Clock, SystemClock, Ttl};

/// A lease store in memory: the same rules as every backend, nothing on disk.
#[derive(Debug, Clone)]
pub struct MemoryLeaseStore {
    leases: Arc<Mutex<HashMap<JobId, rules::Stored>>>,
    clock: Arc<dyn Clock>,
}

impl Default for MemoryLeaseStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryLeaseStore {
    /// An empty store on the system clock.
    pub fn new() -> Self {
        Self::with_clock(Arc::new(SystemClock::new()))
    }

    /// An empty store on `clock`.
    pub fn with_clock(clock: Arc<dyn Clock>) -> Self {
        Self {
            leases: Arc::default(),
            clock,
        }
    }

    fn decide<T>(
        &self,
        job: &JobId,
        f: impl FnOnce(Option<&rules::Stored>, u64) -> rules::Decision<T>,
    ) -> Result<T, StoreError> {
        let mut leases = self.leases.lock().unwrap_or_else(|e| e.into_inner());
        let (new, out) = f(leases.get(job), self.clock.now_ms())?;
        if let Some(new) = new {
            leases.insert(job.clone(), new);
        }
        Ok(out)
    }
}

impl LeaseStore for MemoryLeaseStore {
    async fn claim(
        &self,
        job: &JobId,
        owner: &Owner,
        ttl: Ttl,
    ) -> Result<ClaimOutcome, StoreError> {
        self.decide(job, |cur, now| rules::claim(job, cur, owner, ttl, now))
    }

    async fn renew(
        &self,
        job: &JobId,
        owner: &Owner,
        generation: Generation,
        ttl: Ttl,
    ) -> Result<RenewOutcome, StoreError> {
        self.decide(job, |cur, now| {
            rules::renew(cur, owner, generation, ttl, now)
        })
    }

    async fn release(
        &self,
        job: &JobId,
        owner: &Owner,
        generation: Generation,
    ) -> Result<FinishOutcome, StoreError> {
        self.decide(job, |cur, now| {
            rules::finish(job, cur, owner, generation, false, now)
        })
    }

    async fn complete(
        &self,
        job: &JobId,
        owner: &Owner,
        generation: Generation,
    ) -> Result<FinishOutcome, StoreError> {
        self.decide(job, |cur, now| {
            rules::finish(job, cur, owner, generation, true, now)
        })
    }

    async fn get(&self, job: &JobId) -> Result<Option<LeaseRecord>, StoreError> {
        self.decide(job, |cur, now| Ok((None, cur.map(|s| s.record(job, now)))))
    }
}

#[cfg(test)]
mod conformance {
    use std::sync::Arc;

    use crate::{ManualClock, MemoryLeaseStore, conformance::advance_fn};

    crate::lease_store_conformance!(|| async {
        let clock = ManualClock::new(1_700_000_000_000);
        Some((
            MemoryLeaseStore::with_clock(Arc::new(clock.clone())),
            advance_fn(clock),
        ))
    });
}
