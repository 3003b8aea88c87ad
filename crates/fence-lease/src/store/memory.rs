//! A lease store in process memory, for tests and single-process tools.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use fence_core::{Generation, JobId, lease_api::ListQuery};
use fence_storage::clock::{Clock, SystemClock};

use fence_core::{Owner, secret::LeaseKey};

use super::{
    ClaimTerms, LeaseOp, LeaseRecord, LeaseStore, ListPage, Outcome, SlotClaim, StoreError,
    check_slot_claim, page, rules, slot_prefix, slot_records,
};

/// A lease store in memory: the same rules as every backend, nothing on disk.
#[derive(Debug, Clone)]
pub struct MemoryLeaseStore {
    leases: Arc<Mutex<Leases>>,
    clock: Arc<dyn Clock>,
}

/// The records, and the highest generation ever forgotten.
#[derive(Debug, Default)]
struct Leases {
    jobs: BTreeMap<JobId, rules::Stored>,
    floor: Generation,
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

    fn leases(&self) -> std::sync::MutexGuard<'_, Leases> {
        // Nothing panics while the map is held; a poisoned map is still a valid map.
        self.leases.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl LeaseStore for MemoryLeaseStore {
    async fn apply(&self, job: &JobId, op: LeaseOp) -> Result<Outcome, StoreError> {
        let mut leases = self.leases();
        let floor = leases.floor;
        let (new, out) = rules::decide(job, leases.jobs.get(job), floor, &op, self.clock.now_ms())?;
        if let Some(new) = new {
            leases.jobs.insert(job.clone(), new);
        }
        Ok(out)
    }

    async fn claim_slot(
        &self,
        resource: &JobId,
        owner: &Owner,
        key: &LeaseKey,
        terms: ClaimTerms,
        slots: u32,
    ) -> Result<SlotClaim, StoreError> {
        check_slot_claim(resource, slots)?;
        let now = self.clock.now_ms();
        // The whole decision under the map's lock: nothing changes between reading the slots
        // and writing the one granted.
        let mut leases = self.leases();
        let prefix = slot_prefix(resource);
        let records = slot_records(
            leases
                .jobs
                .range(prefix.clone()..)
                .take_while(|(job, _)| job.as_str().starts_with(prefix.as_str()))
                .map(|(job, s)| Ok((job.clone(), s.clone()))),
        )?;
        let (new, out) = super::decide_slot(
            resource,
            &records,
            leases.floor,
            (owner, key),
            (terms, slots),
            now,
        )?;
        if let Some((slot, new)) = new {
            let job = fence_core::lease_api::slot_job(resource, slot);
            leases.jobs.insert(job, new);
        }
        Ok(out)
    }

    async fn get(&self, job: &JobId) -> Result<Option<LeaseRecord>, StoreError> {
        let now = self.clock.now_ms();
        Ok(self.leases().jobs.get(job).map(|s| s.record(job, now)))
    }

    async fn forget_idle(&self, idle_for: Duration, limit: usize) -> Result<usize, StoreError> {
        let now = self.clock.now_ms();
        let idle_ms = u64::try_from(idle_for.as_millis()).unwrap_or(u64::MAX);
        let mut leases = self.leases();
        let gone: Vec<JobId> = leases
            .jobs
            .iter()
            .filter(|(_, s)| s.forgettable(now, idle_ms))
            .map(|(j, _)| j.clone())
            .take(limit)
            .collect();
        for job in &gone {
            if let Some(s) = leases.jobs.remove(job) {
                leases.floor = leases.floor.max(s.generation);
            }
        }
        Ok(gone.len())
    }

    async fn list(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        let now = self.clock.now_ms();
        let leases = self.leases();
        let mut jobs: Vec<&JobId> = leases
            .jobs
            .keys()
            .filter(|j| query.after.as_ref().is_none_or(|a| *j > a))
            .filter(|j| {
                query
                    .prefix
                    .as_ref()
                    .is_none_or(|p| j.as_str().starts_with(p.as_str()))
            })
            .collect();
        jobs.sort();
        page(
            query,
            jobs.into_iter().map(|j| Ok(leases.jobs[j].record(j, now))),
        )
    }
}

#[cfg(test)]
mod conformance {
    use std::sync::Arc;

    use fence_storage::clock::ManualClock;

    use crate::{MemoryLeaseStore, conformance::advance_fn};

    crate::lease_store_conformance!(|| async {
        let clock = ManualClock::new(1_700_000_000_000);
        Some((
            MemoryLeaseStore::with_clock(Arc::new(clock.clone())),
            advance_fn(clock),
        ))
    });
}
