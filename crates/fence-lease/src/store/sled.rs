//! A durable lease store embedded in the process, on sled, with group commit.

use std::{
    ops::Bound,
    path::Path,
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use fence_core::{Generation, JobId, lease_api::ListQuery};
use fence_storage::{
    clock::{Clock, SystemClock},
    disk::{CommitError, DurableDb, OpenError, Tree},
};

use fence_core::{Owner, lease_api::slot_job, secret::LeaseKey};

use super::{
    ClaimTerms, LeaseOp, LeaseRecord, LeaseStore, ListPage, Outcome, SlotClaim, StoreError,
    check_slot_claim, page, rules, slot_prefix, slot_records,
};

/// A lease store in a sled database on local disk.
///
/// Every claim, renew, release and complete is on disk before it is acknowledged: the
/// decision is applied with a compare-and-swap (so concurrent callers cannot both win),
/// then the caller waits for a group commit shared with every other writer.
#[derive(Debug, Clone)]
pub struct SledLeaseStore {
    tree: Tree,
    /// `floor`: the highest generation ever forgotten (8 bytes big-endian).
    meta: Tree,
    db: DurableDb,
    clock: Arc<dyn Clock>,
    /// The key after which the next [`forget_idle`](LeaseStore::forget_idle) batch reads on
    /// (it wraps around to the start): a pass of batches reads the tree once, instead of
    /// every batch reading again from the start past the jobs it kept.
    forget_from: Arc<Mutex<Option<sled::IVec>>>,
    /// Held while a semaphore claim reads a resource's slots and writes the one it grants:
    /// only semaphore claims take slots (a plain claim of one is refused), so no two decide
    /// on the same slots at once (renewals, releases and forgetting may change a slot in
    /// between; the compare-and-swap catches that and the claim decides again).
    slot_claims: Arc<tokio::sync::Mutex<()>>,
}

const FLOOR: &[u8] = b"floor";

impl SledLeaseStore {
    /// The longest a decision waits for the disk to confirm it: as long as a PostgreSQL
    /// store's statements may run (`fence_storage::postgres::SESSION_STATEMENT_TIMEOUT`).
    pub const COMMIT_TIMEOUT: Duration = Duration::from_secs(5);

    /// The lease store in directory `path` (created if missing), deciding expiry on `clock`.
    ///
    /// # Errors
    /// As [`DurableDb::open`]: [`OpenError::Locked`] while another process uses the
    /// directory, the other variants for permissions or corrupt files.
    pub fn open_with_clock(
        path: impl AsRef<Path>,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, OpenError> {
        let db = DurableDb::open(path)?;
        Ok(Self {
            tree: db.tree("leases")?,
            meta: db.tree("meta")?,
            db,
            clock,
            forget_from: Arc::default(),
            slot_claims: Arc::default(),
        })
    }

    /// The lease store in directory `path` (created if missing), deciding expiry on the
    /// system clock.
    ///
    /// # Errors
    /// As [`open_with_clock`](Self::open_with_clock).
    pub fn open(path: impl AsRef<Path>) -> Result<Self, OpenError> {
        Self::open_with_clock(path, Arc::new(SystemClock::new()))
    }

    /// The highest generation ever forgotten, with its raw value for a compare-and-swap.
    fn floor(&self) -> Result<(Generation, Option<sled::IVec>), StoreError> {
        let raw = self.meta.get(FLOOR).map_err(StoreError::io)?;
        let floor = match raw.as_deref() {
            None => Generation::ZERO,
            Some(b) => Generation::new(u64::from_be_bytes(<[u8; 8]>::try_from(b).map_err(
                |_| StoreError::Corrupt {
                    job: "(floor)".parse().expect("valid job id"),
                    reason: "the floor is not 8 bytes",
                },
            )?)),
        };
        Ok((floor, raw))
    }

    /// Waits until every write made so far is on disk, for at most [`Self::COMMIT_TIMEOUT`]: a
    /// disk that stalls fails the requests waiting on it (503, outcome unknown) instead of
    /// holding them and their connections for as long as it stalls.
    async fn durable(&self) -> Result<(), StoreError> {
        self.db
            .commit_within(Self::COMMIT_TIMEOUT)
            .await
            .map_err(|e| match e {
                CommitError::TimedOut(within) => StoreError::Timeout(within),
                e => StoreError::io(e),
            })
    }

    /// Flushes everything to disk now (graceful shutdown).
    ///
    /// # Errors
    /// When the flush fails.
    pub fn flush(&self) -> Result<(), StoreError> {
        self.db.flush_now().map_err(StoreError::io)
    }

    /// How many jobs have a record.
    pub fn job_count(&self) -> usize {
        self.tree.len()
    }
}

impl LeaseStore for SledLeaseStore {
    /// Applies one decision atomically, then waits until it is durable.
    async fn apply(&self, job: &JobId, op: LeaseOp) -> Result<Outcome, StoreError> {
        let key = job.as_str().as_bytes();
        loop {
            let raw = self.tree.get(key).map_err(StoreError::io)?;
            let cur = raw
                .as_deref()
                .map(|b| rules::Stored::decode(job, b))
                .transpose()?;
            // Read after the record: forgetting raises the floor before it deletes a record,
            // so a record seen gone comes with the floor that covers it.
            let (floor, _) = self.floor()?;
            let (new, out) = rules::decide(job, cur.as_ref(), floor, &op, self.clock.now_ms())?;
            if let Some(new) = new {
                let swapped = self
                    .tree
                    .compare_and_swap(key, raw, Some(new.encode()))
                    .map_err(StoreError::io)?;
                if swapped.is_err() {
                    continue; // someone else decided first: decide again on what they wrote
                }
            }
            // Also when nothing was written: the answer may rest on another caller's write
            // that is not on disk yet. Answer only once it is, so no observer ever sees a
            // generation a crash could take back.
            self.durable().await?;
            return Ok(out);
        }
    }

    /// Decides under the store's slot-claim lock, then waits until it is durable.
    async fn claim_slot(
        &self,
        resource: &JobId,
        owner: &Owner,
        key: &LeaseKey,
        terms: ClaimTerms,
        slots: u32,
    ) -> Result<SlotClaim, StoreError> {
        check_slot_claim(resource, slots)?;
        let prefix = slot_prefix(resource);
        let out = {
            let _one_at_a_time = self.slot_claims.lock().await;
            loop {
                let mut raws = Vec::new();
                let items = self.tree.scan_prefix(prefix.as_str()).map(|item| {
                    let (key, value) = item.map_err(StoreError::io)?;
                    let Ok(job) = JobId::from_bytes(&key) else {
                        return Err(StoreError::Corrupt {
                            job: prefix.clone(),
                            reason: "a key under the resource's prefix is not a job id",
                        });
                    };
                    let stored = rules::Stored::decode(&job, &value)?;
                    raws.push((job.clone(), value));
                    Ok((job, stored))
                });
                let records = slot_records(items)?;
                // Read after the records, as in `apply`.
                let (floor, _) = self.floor()?;
                let now = self.clock.now_ms();
                let (new, out) = super::decide_slot(
                    resource,
                    &records,
                    floor,
                    (owner, key),
                    (terms, slots),
                    now,
                )?;
                let Some((slot, new)) = new else { break out };
                let job = slot_job(resource, slot);
                let old = raws
                    .into_iter()
                    .find(|(j, _)| *j == job)
                    .map(|(_, value)| value);
                let swapped = self
                    .tree
                    .compare_and_swap(job.as_str().as_bytes(), old, Some(new.encode()))
                    .map_err(StoreError::io)?;
                if swapped.is_ok() {
                    break out;
                }
                // A renewal, release or forgetting changed the slot meanwhile: decide again.
            }
        };
        // Also when nothing was written, as in `apply`.
        self.durable().await?;
        Ok(out)
    }

    async fn get(&self, job: &JobId) -> Result<Option<LeaseRecord>, StoreError> {
        let raw = self
            .tree
            .get(job.as_str().as_bytes())
            .map_err(StoreError::io)?;
        let stored = raw
            .map(|raw| rules::Stored::decode(job, &raw))
            .transpose()?;
        // Answer only what is on disk (see `apply`); also for no record, so that a server
        // whose disk stalls says so at `/healthz` (a status of a job never claimed).
        self.durable().await?;
        Ok(stored.map(|stored| stored.record(job, self.clock.now_ms())))
    }

    async fn forget_idle(&self, idle_for: Duration, limit: usize) -> Result<usize, StoreError> {
        // The scan reads and decodes every record it keeps (held, recently changed) until it
        // has `limit` to forget: a million of them take seconds, which on a runtime worker
        // would stall every request it serves. It runs on a blocking thread instead.
        let scanner = self.clone();
        let scanned = tokio::task::spawn_blocking(move || scanner.forgettable(idle_for, limit));
        let (batch, top) = match scanned.await {
            Ok(scanned) => scanned?,
            // A panic in the scan is the caller's, as it would have been inline.
            Err(e) => match e.try_into_panic() {
                Ok(panic) => std::panic::resume_unwind(panic),
                Err(e) => return Err(StoreError::io(e)),
            },
        };
        if batch.is_empty() {
            return Ok(0);
        }
        // The floor first, on disk: a crash after it leaves the records, never a record
        // gone without the floor above it.
        loop {
            let (floor, raw) = self.floor()?;
            if top <= floor {
                break;
            }
            let new = top.get().to_be_bytes();
            let swapped = self
                .meta
                .compare_and_swap(FLOOR, raw, Some(&new[..]))
                .map_err(StoreError::io)?;
            if swapped.is_ok() {
                break;
            }
        }
        self.durable().await?;
        let mut forgotten = 0;
        for (key, value) in batch {
            // Only if unchanged since it was read: a claim in between keeps its record.
            let gone = self
                .tree
                .compare_and_swap(key, Some(value), None::<&[u8]>)
                .map_err(StoreError::io)?;
            forgotten += usize::from(gone.is_ok());
        }
        // The deletions are not waited on: one a crash takes back only brings back a record
        // at or below the floor, which is on disk already.
        Ok(forgotten)
    }

    async fn list(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        let prefix = query.prefix.as_deref().unwrap_or_default().as_bytes();
        let after = query.after.as_ref().map(|a| a.as_str().as_bytes());
        let start = match after {
            Some(a) if a >= prefix => Bound::Excluded(a.to_vec()),
            _ => Bound::Included(prefix.to_vec()),
        };
        let now = self.clock.now_ms();
        let records = self
            .tree
            .range((start, Bound::Unbounded))
            .take_while(|item| item.as_ref().map_or(true, |(k, _)| k.starts_with(prefix)))
            .map(|item| {
                let (key, value) = item.map_err(StoreError::io)?;
                let job = JobId::from_bytes(&key).map_err(|_| StoreError::Corrupt {
                    job: "(unreadable)".parse().expect("valid job id"),
                    reason: "a key is not a job id",
                })?;
                Ok(rules::Stored::decode(&job, &value)?.record(&job, now))
            });
        let page = page(query, records)?;
        // Answer only what is on disk (see `apply`).
        self.durable().await?;
        Ok(page)
    }
}

/// Records to forget, as read (key and value, for the compare-and-swap that deletes each).
type ForgetBatch = Vec<(sled::IVec, sled::IVec)>;

impl SledLeaseStore {
    /// Up to `limit` records idle for `idle_for`, read on from where the last batch ended
    /// (wrapping around), with the highest generation among them. Blocking: it may read the
    /// whole tree.
    fn forgettable(
        &self,
        idle_for: Duration,
        limit: usize,
    ) -> Result<(ForgetBatch, Generation), StoreError> {
        let now = self.clock.now_ms();
        let idle_ms = u64::try_from(idle_for.as_millis()).unwrap_or(u64::MAX);
        let mut batch = Vec::new();
        let mut top = Generation::ZERO;
        let from = self
            .forget_from
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        // From the last batch's end to the end of the tree, then from the start up to it.
        let after = from.clone().map_or(Bound::Unbounded, Bound::Excluded);
        let before = from.map(|key| self.tree.range((Bound::Unbounded, Bound::Included(key))));
        let items = self.tree.range((after, Bound::Unbounded));
        for item in items.chain(before.into_iter().flatten()) {
            let (key, value) = item.map_err(StoreError::io)?;
            let Ok(job) = JobId::from_bytes(&key) else {
                continue;
            };
            let stored = rules::Stored::decode(&job, &value)?;
            if stored.forgettable(now, idle_ms) {
                top = top.max(stored.generation);
                batch.push((key, value));
                if batch.len() >= limit {
                    let last = batch.last().map(|(key, _)| key.clone());
                    *self
                        .forget_from
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner) = last;
                    break;
                }
            }
        }
        Ok((batch, top))
    }
}

#[cfg(test)]
mod tests {
    use std::{sync::Arc, time::Duration};

    use fence_core::Generation;

    use fence_storage::clock::ManualClock;

    use super::*;
    use crate::{Outcome, Ttl, conformance::advance_fn};

    crate::lease_store_conformance!(|| async {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new(1_700_000_000_000);
        let store = SledLeaseStore::open_with_clock(dir.keep(), Arc::new(clock.clone())).unwrap();
        Some((store, advance_fn(clock)))
    });

    /// Forgetting scans on a blocking thread: a pass over many records it must keep (here
    /// 30,000 held leases) leaves the runtime's only thread free to serve others meanwhile.
    #[test]
    fn the_forgetting_scan_does_not_hold_the_runtime() {
        let dir = tempfile::tempdir().unwrap();
        let store = SledLeaseStore::open(dir.path()).unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let served = runtime.block_on(async {
            let (owner, key): (Owner, _) = ("a".parse().unwrap(), crate::new_lease_key().unwrap());
            let seed: JobId = "seed".parse().unwrap();
            let held = store
                .claim(&seed, &owner, &key, Ttl::DEFAULT)
                .await
                .unwrap();
            assert!(matches!(held, Outcome::Granted(_)));
            let value = store.tree.get("seed").unwrap().unwrap();
            for i in 0..30_000 {
                store
                    .tree
                    .insert(format!("held-{i:06}"), value.clone())
                    .unwrap();
            }
            let served = Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let other = {
                let served = served.clone();
                tokio::spawn(async move {
                    loop {
                        served.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        tokio::task::yield_now().await;
                    }
                })
            };
            tokio::task::yield_now().await;
            let before = served.load(std::sync::atomic::Ordering::Relaxed);
            assert_eq!(store.forget_idle(Duration::ZERO, 1_000).await.unwrap(), 0);
            other.abort();
            served.load(std::sync::atomic::Ordering::Relaxed) - before
        });
        assert!(
            served > 0,
            "nothing else ran on the runtime while forgetting scanned"
        );
    }

    /// A disk that stops answering fails the decisions waiting on it after
    /// `COMMIT_TIMEOUT` (paused time: at once), and the store works again once the disk
    /// answers.
    #[cfg(feature = "test-hooks")]
    #[tokio::test(start_paused = true)]
    // The guard held across awaits is the stalled disk: the log's writer, another thread,
    // waits on it; nothing on this task does.
    #[allow(clippy::await_holding_lock)]
    async fn a_stalled_disk_fails_decisions_in_time() {
        let dir = tempfile::tempdir().unwrap();
        let store = SledLeaseStore::open(dir.path()).unwrap();
        let job: JobId = "stall".parse().unwrap();
        let (owner, key): (Owner, _) = ("a".parse().unwrap(), crate::new_lease_key().unwrap());
        let stalled = store.db.stall_log();
        let failed = tokio::time::timeout(
            SledLeaseStore::COMMIT_TIMEOUT * 2,
            store.claim(&job, &owner, &key, Ttl::DEFAULT),
        )
        .await
        .expect("the claim waited on the stalled disk past COMMIT_TIMEOUT");
        assert!(
            matches!(failed, Err(StoreError::Timeout(d)) if d == SledLeaseStore::COMMIT_TIMEOUT),
            "{failed:?}"
        );
        // A status, even of a job never claimed (what `/healthz` reads), says so too.
        let probe: JobId = "never-claimed".parse().unwrap();
        let status = tokio::time::timeout(SledLeaseStore::COMMIT_TIMEOUT * 2, store.get(&probe))
            .await
            .expect("the status waited on the stalled disk past COMMIT_TIMEOUT");
        assert!(matches!(status, Err(StoreError::Timeout(_))), "{status:?}");
        drop(stalled);
        // The log's writer is a thread on the real clock: from here the runtime's is too.
        tokio::time::resume();
        // The claim took effect after all: another owner finds it held, and a retry with
        // the same owner and key is the same lease.
        let other: Owner = "b".parse().unwrap();
        let held = store
            .claim(&job, &other, &crate::new_lease_key().unwrap(), Ttl::DEFAULT)
            .await
            .unwrap();
        assert!(
            matches!(&held, Outcome::Held { owner: holder, generation, .. } if *holder == owner && generation.get() == 1),
            "{held:?}"
        );
        let retried = store.claim(&job, &owner, &key, Ttl::DEFAULT).await.unwrap();
        assert!(
            matches!(&retried, Outcome::Granted(grant) if grant.generation.get() == 1),
            "{retried:?}"
        );
    }

    #[tokio::test]
    async fn generations_and_expiry_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let (ka, kb) = (
            crate::new_lease_key().unwrap(),
            crate::new_lease_key().unwrap(),
        );
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
                let Outcome::Granted(g) = store.claim(&j, &a, &ka, Ttl::DEFAULT).await.unwrap()
                else {
                    panic!()
                };
                store.release(&j, &a, g.generation, &ka).await.unwrap();
            }
            store.claim(&j, &a, &ka, Ttl::DEFAULT).await.unwrap();
        }
        let store = SledLeaseStore::open_with_clock(dir.path(), Arc::new(clock.clone())).unwrap();
        let rec = store.get(&j).await.unwrap().unwrap();
        assert_eq!(
            (rec.generation, rec.state),
            (Generation::new(41), fence_core::lease_api::LeaseState::Held)
        );
        // Reopening neither extends nor shortens the lease: it expires at the same store time.
        assert!(matches!(
            store.claim(&j, &b, &kb, Ttl::DEFAULT).await.unwrap(),
            Outcome::Held { .. }
        ));
        clock.advance(Duration::from_secs(30));
        let Outcome::Granted(g) = store.claim(&j, &b, &kb, Ttl::DEFAULT).await.unwrap() else {
            panic!()
        };
        assert_eq!(g.generation, Generation::new(42));
    }

    #[tokio::test]
    async fn a_corrupt_record_is_an_error_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        let store = SledLeaseStore::open(dir.path()).unwrap();
        for (bytes, want) in [
            (&b"\x02\x02garbage"[..], "record is too short"),
            (&b"\x01\x02garbage"[..], "unknown record format version"),
            (&b""[..], "record is too short"),
        ] {
            store.tree.insert("j", bytes).unwrap();
            let err = store
                .claim(
                    &"j".parse().unwrap(),
                    &"a".parse().unwrap(),
                    &crate::new_lease_key().unwrap(),
                    Ttl::DEFAULT,
                )
                .await
                .unwrap_err();
            assert_eq!(
                err.to_string(),
                format!("stored lease of job j is corrupt: {want}")
            );
        }
    }
}
