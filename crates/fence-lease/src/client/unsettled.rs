//! The lease keys of claims whose answers were lost, kept for the next claim of the same job.
//!
//! A claim whose answer never arrived (an I/O error, a timeout, a 502, 503 or 504) may have
//! been granted. Asked again with the same owner and lease key, the store gives that lease
//! back (the contract's retry rule); asked with a new key, it answers that the job is held,
//! by this very owner, until the lost lease expires. So the key is kept for as long as such a
//! lease could last, and the client's next claim of the job uses it.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use fence_core::{JobId, secret::LeaseKey};
use tokio::time::Instant;

/// The most keys kept at once: past it, expired ones are dropped first, then new ones are not
/// kept (their jobs then wait for the lost lease's expiry, as without this).
const MAX_KEPT: usize = 10_000;

/// Keys of unsettled claims, by job, each until the lease it may have won would have expired.
#[derive(Debug, Default)]
pub(crate) struct Unsettled(Mutex<HashMap<JobId, (LeaseKey, Instant)>>);

impl Unsettled {
    /// The key of `job`'s last unsettled claim, while a lease it won could still be held.
    pub(crate) fn take(&self, job: &JobId) -> Option<LeaseKey> {
        let mut kept = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        kept.remove(job)
            .filter(|(_, until)| Instant::now() < *until)
            .map(|(key, _)| key)
    }

    /// Keeps `key` for `job` until `until`.
    pub(crate) fn keep(&self, job: JobId, key: LeaseKey, until: Instant) {
        let mut kept = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if kept.len() >= MAX_KEPT {
            let now = Instant::now();
            kept.retain(|_, (_, until)| now < *until);
        }
        if kept.len() < MAX_KEPT {
            kept.insert(job, (key, until));
        }
    }
}

/// A claim's key on its way: kept for the next claim of its job when dropped unsettled (its
/// answer lost, its caller gone mid-claim), as a lease it won could still be held for up to
/// `ttl`. A grant the client abandons is settled: its key is not kept (a release of it may
/// still land), and if giving it back fails the job waits for the grant's expiry.
#[derive(Debug)]
pub(crate) struct Pending {
    kept: Arc<Unsettled>,
    job: JobId,
    key: LeaseKey,
    ttl: Duration,
    settled: bool,
}

impl Pending {
    /// Watches the claim of `job` with `key`, asked for `ttl`.
    pub(crate) fn new(kept: Arc<Unsettled>, job: JobId, key: LeaseKey, ttl: Duration) -> Self {
        Self {
            kept,
            job,
            key,
            ttl,
            settled: false,
        }
    }

    /// The claim was refused, or its lease started: nothing to keep.
    pub(crate) fn settle(&mut self) {
        self.settled = true;
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.settled {
            let until = Instant::now() + self.ttl;
            self.kept.keep(self.job.clone(), self.key.clone(), until);
        }
    }
}
