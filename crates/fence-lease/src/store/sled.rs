//! A durable lease store embedded in the process, on sled, with group commit.

use std::{path::Path, sync::Arc};

use fence_core::{Generation, JobId, Owner};
use fence_durable::GroupCommit;

use super::{
    ClaimOutcome, FinishOutcome, LeaseRecord, LeaseStore, RenewOutcome, StoreError, rules,
};
use crate::{Clock, SystemClock, Ttl};

/// A lease store in a sled database on local disk.
///
/// Every claim, renew, release and complete is on disk before it is acknowledged: the
/// decision is applied with a compare-and-swap (so concurrent callers cannot both win),
/// then the caller waits for a group commit shared with every other writer.
#[derive(Debug, Clone)]
pub struct SledLeaseStore {
    tree: sled::Tree,
    commit: GroupCommit,
    clock: Arc<dyn Clock>,
}

impl SledLeaseStore {
    /// Opens (or creates) the store in directory `path`, on the system clock.
    ///
    /// # Errors
    /// When the directory cannot be opened as a sled database (missing permissions,
    /// another process holds it, corrupt files).
    pub fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        Self::open_with_clock(path, Arc::new(SystemClock::new()))
    }

    /// Opens the store on `clock`.
    ///
    /// # Errors
    /// As [`open`](Self::open).
    pub fn open_with_clock(
        path: impl AsRef<Path>,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, StoreError> {
        let db = fence_durable::open_db(path).map_err(io)?;
        Self::from_db(&db, clock)
    }

    fn from_db(db: &sled::Db, clock: Arc<dyn Clock>) -> Result<Self, StoreError> {
        let tree = db.open_tree("leases").map_err(io)?;
        Ok(Self {
            tree,
            commit: GroupCommit::new(db.clone()),
            clock,
        })
    }

    /// Flushes everything to disk now (graceful shutdown).
    ///
    /// # Errors
    /// When the flush fails.
    pub fn flush(&self) -> Result<(), StoreError> {
        self.commit.flush_now().map_err(io)
    }

    /// Applies one decision atomically, then waits until it is durable.
    async fn decide<T>(
        &self,
        job: &JobId,
        mut f: impl FnMut(Option<&rules::Stored>, u64) -> rules::Decision<T>,
    ) -> Result<T, StoreError> {
        let key = job.as_str().as_bytes();
        let out = loop {
            let raw = self.tree.get(key).map_err(io)?;
            let cur = raw
                .as_deref()
                .map(|b| rules::Stored::decode(job, b))
                .transpose()?;
            let (new, out) = f(cur.as_ref(), self.clock.now_ms())?;
            let Some(new) = new else {
                // Nothing to write, but the answer may rest on another caller's write that is
                // not on disk yet: answer only once it is, so no observer ever sees a
                // generation a crash could take back.
                self.commit.commit().await.map_err(io)?;
                return Ok(out);
            };
            match self
                .tree
                .compare_and_swap(key, raw, Some(new.encode()))
                .map_err(io)?
            {
                Ok(()) => break out,
                Err(_) => continue, // someone else decided first: decide again on what they wrote
            }
        };
        self.commit.commit().await.map_err(io)?;
        Ok(out)
    }
}

fn io(e: impl std::error::Error + Send + Sync + 'static) -> StoreError {
    StoreError::Io(Box::new(e))
}

impl LeaseStore for SledLeaseStore {
    async fn claim(
        &self,
        job: &JobId,
        owner: &Owner,
        ttl: Ttl,
    ) -> Result<ClaimOutcome, StoreError> {
        self.decide(job, |cur, now| rules::claim(job, cur, owner, ttl, now))
            .await
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
        .await
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
        .await
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
        .await
    }

    async fn get(&self, job: &JobId) -> Result<Option<LeaseRecord>, StoreError> {
        self.decide(job, |cur, now| Ok((None, cur.map(|s| s.record(job, now)))))
            .await
    }
}

#[cfg(test)]
mod tests {
    use std::{sync::Arc, time::Duration};

    use fence_core::Generation;

    use super::*;
    use crate::{ManualClock, conformance::advance_fn};

    crate::lease_store_conformance!(|| async {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new(1_700_000_000_000);
        let store = SledLeaseStore::open_with_clock(dir.keep(), Arc::new(clock.clone())).unwrap();
        Some((store, advance_fn(clock)))
    });

    #[tokio::test]
    async fn generations_and_expiry_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new(1_700_000_000_000);
        let (j, a, b) = (
            "j".parse().unwrap(),
            "a".parse().unwrap(),
            "b".parse().unwrap(),
        );
        {
            let store =
                SledLeaseStore::open_with_clock(dir.path(), Arc::new(clock.clone())).unwrap();
            for _ in 0..40 {
                let ClaimOutcome::Granted(g) = store.claim(&j, &a, Ttl::DEFAULT).await.unwrap()
                else {
                    panic!()
                };
                store.release(&j, &a, g.generation).await.unwrap();
            }
            store.claim(&j, &a, Ttl::DEFAULT).await.unwrap();
        }
        let store = SledLeaseStore::open_with_clock(dir.path(), Arc::new(clock.clone())).unwrap();
        let rec = store.get(&j).await.unwrap().unwrap();
        assert_eq!(
            (rec.generation, rec.state),
            (Generation::new(41), crate::LeaseState::Held)
        );
        // Reopening neither extends nor shortens the lease: it expires at the same store time.
        assert!(matches!(
            store.claim(&j, &b, Ttl::DEFAULT).await.unwrap(),
            ClaimOutcome::Held { .. }
        ));
        clock.advance(Duration::from_secs(30));
        let ClaimOutcome::Granted(g) = store.claim(&j, &b, Ttl::DEFAULT).await.unwrap() else {
            panic!()
        };
        assert_eq!(g.generation, Generation::new(42));
    }

    #[tokio::test]
    async fn a_corrupt_record_is_an_error_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        let db = sled::open(dir.path()).unwrap();
        db.open_tree("leases")
            .unwrap()
            .insert("j", &b"\x01\x02garbage"[..])
            .unwrap();
        let store = SledLeaseStore::from_db(&db, Arc::new(SystemClock::new())).unwrap();
        let err = store
            .claim(&"j".parse().unwrap(), &"a".parse().unwrap(), Ttl::DEFAULT)
            .await
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "stored lease of job j is corrupt: record is too short"
        );
    }
}
