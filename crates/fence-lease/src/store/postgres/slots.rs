//! A semaphore claim in PostgreSQL (contract section 15): one transaction per claim.
//!
//! It takes a transaction-scoped advisory lock on the resource (so semaphore claims of one
//! resource, on every server sharing the table, decide one at a time), locks the rows of the
//! resource's slots `FOR UPDATE` (renewals, releases and forgetting of them wait) and the
//! floor row `FOR SHARE` (as a plain claim does), decides with the same Rust rule as the
//! memory and sled stores on the database's clock, and writes the slot it grants. A plain
//! claim of a slot is refused before any SQL runs, so only this transaction takes slots.
//!
//! Claims of one resource on this server first queue for its turn in memory ([`Turns`]),
//! then take a pooled connection: without that, a burst of claims of one busy semaphore
//! would each hold a connection while waiting for the advisory lock, and take the whole
//! pool from every other job's requests.

use fence_core::{
    JobId, Owner,
    lease_api::slot_job,
    secret::{LeaseKey, SecretHash},
};
use std::{collections::HashMap, sync::Arc};

use fence_storage::postgres::{Checkout, POOL_TIMEOUT};
use tokio_postgres::types::ToSql;

use super::{PgLeaseStore, generation};
use crate::store::{
    ClaimTerms, SlotClaim, StoreError, check_slot_claim, rules::Stored, slot_prefix, slot_records,
};

/// How many semaphore claims (of different resources) may hold a pooled connection at once:
/// half the pool, however many resources are busy.
const PERMITS: usize = fence_storage::postgres::POOL_SIZE / 2;

/// The in-memory turns of semaphore claims on this server: claims of one resource queue for
/// it one at a time (each waits for the advisory lock in the database otherwise, holding a
/// connection), then for one of [`PERMITS`]. A busy resource thus holds at most one permit,
/// and claims of other resources never queue behind its claims.
pub(super) struct Turns {
    /// One queue per resource with a claim in flight here; an entry goes with its last user.
    queues: std::sync::Mutex<HashMap<JobId, Arc<tokio::sync::Mutex<()>>>>,
    permits: tokio::sync::Semaphore,
}

impl Default for Turns {
    fn default() -> Self {
        Self {
            queues: std::sync::Mutex::default(),
            permits: tokio::sync::Semaphore::new(PERMITS),
        }
    }
}

/// A semaphore claim's turn: its resource's queue and a permit, until dropped.
pub(super) struct Turn<'a> {
    turns: &'a Turns,
    resource: JobId,
    queue: Option<Arc<tokio::sync::Mutex<()>>>,
    held: Option<(
        tokio::sync::OwnedMutexGuard<()>,
        tokio::sync::SemaphorePermit<'a>,
    )>,
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        self.held = None;
        let mut queues = self
            .turns
            .queues
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Under the map's lock, where queues are handed out: the map's and this one are the
        // last references, so nobody else waits on it.
        if let Some(queue) = self.queue.take()
            && Arc::strong_count(&queue) == 2
            && queues
                .get(&self.resource)
                .is_some_and(|q| Arc::ptr_eq(q, &queue))
        {
            queues.remove(&self.resource);
        }
    }
}

impl Turns {
    /// Waits for `resource`'s turn and a permit, both by `deadline`.
    pub(super) async fn take(
        &self,
        resource: &JobId,
        deadline: tokio::time::Instant,
    ) -> Result<Turn<'_>, StoreError> {
        let queue = self
            .queues
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(resource.clone())
            .or_default()
            .clone();
        let mut turn = Turn {
            turns: self,
            resource: resource.clone(),
            queue: Some(queue.clone()),
            held: None,
        };
        let waited = deadline.saturating_duration_since(tokio::time::Instant::now());
        // Before any connection is taken: nothing reached the database, nothing was decided.
        let late = |what: &str| {
            StoreError::Busy(format!(
                "a semaphore claim of {resource} waited {waited:?} on this server for {what}"
            ))
        };
        let mine = tokio::time::timeout_at(deadline, queue.lock_owned())
            .await
            .map_err(|_| late("the claims of the same resource before it"))?;
        let permit = tokio::time::timeout_at(deadline, self.permits.acquire())
            .await
            .map_err(|_| late("the claims of other resources"))?
            .map_err(|_| late("a permit (closed)"))?;
        turn.held = Some((mine, permit));
        Ok(turn)
    }

    #[cfg(test)]
    fn queued_resources(&self) -> usize {
        self.queues
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len()
    }
}

/// The statements of a semaphore claim on table `t`.
pub(super) struct SlotSql {
    /// `$1` the lock's name: one lock per table and resource.
    pub(super) lock: String,
    /// `$1` the slots' prefix: the slots' rows, locked.
    rows: String,
    /// `$1` clock offset: the floor, read under a share lock as a plain claim reads it, and
    /// the database's clock (read once the rows are locked).
    floor: String,
    /// `$1` job, `$2` owner, `$3` generation, `$4` lease end, `$5` now, `$6` key hash,
    /// `$7` lock-delay, `$8` slots.
    write: String,
}

impl SlotSql {
    pub(super) fn new(t: &str) -> Self {
        Self {
            lock: "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))".to_owned(),
            rows: format!(
                "SELECT job, owner, generation::text, lease_until_ms, changed_ms, completed,
                        key_hash, lock_delay_ms, slots, checkpoint,
                        checkpoint_generation::text
                 FROM {t} WHERE job COLLATE \"C\" >= $1 AND starts_with(job, $1)
                 ORDER BY job COLLATE \"C\" FOR UPDATE"
            ),
            floor: format!(
                "SELECT generation::text, {} FROM {t} WHERE job = '' FOR SHARE",
                super::now_ms(1)
            ),
            write: format!(
                "INSERT INTO {t} AS t (job, owner, generation, lease_until_ms, changed_ms,
                                       key_hash, completed, lock_delay_ms, slots)
                 VALUES ($1, $2, $3::text::numeric, $4, $5, $6, false, $7, $8)
                 ON CONFLICT (job) DO UPDATE SET
                   owner = excluded.owner, generation = excluded.generation,
                   lease_until_ms = excluded.lease_until_ms, changed_ms = excluded.changed_ms,
                   key_hash = excluded.key_hash, completed = false,
                   lock_delay_ms = excluded.lock_delay_ms, slots = excluded.slots"
            ),
        }
    }
}

/// A row as the Rust rule reads it.
fn stored(job: &JobId, row: &tokio_postgres::Row) -> Result<Stored, StoreError> {
    let corrupt = |reason| StoreError::Corrupt {
        job: job.clone(),
        reason,
    };
    let io = StoreError::io;
    let owner: Option<String> = row.try_get(1).map_err(io)?;
    let owner = owner
        .map(Owner::new)
        .transpose()
        .map_err(|_| corrupt("owner is not visible ASCII"))?;
    let key: Vec<u8> = row.try_get(6).map_err(io)?;
    // A row from before lease keys has none: no key matches it.
    let key = <[u8; 32]>::try_from(key.as_slice()).unwrap_or_default();
    let ms = |i| -> Result<u64, StoreError> {
        let v: i64 = row.try_get(i).map_err(io)?;
        Ok(u64::try_from(v).unwrap_or(0))
    };
    let data: Option<String> = row.try_get(9).map_err(io)?;
    let checkpoint = match data {
        Some(data) => Some((generation(job, row, 10)?, data)),
        None => None,
    };
    let slots: i32 = row.try_get(8).map_err(io)?;
    Ok(Stored {
        generation: generation(job, row, 2)?,
        owner,
        key: SecretHash::from_bytes(key),
        lease_until_ms: ms(3)?,
        changed_ms: ms(4)?,
        completed: row.try_get(5).map_err(io)?,
        lock_delay_ms: ms(7)?,
        checkpoint,
        slots: u32::try_from(slots).unwrap_or(0),
    })
}

impl PgLeaseStore {
    pub(super) async fn claim_slot_rows(
        &self,
        resource: &JobId,
        owner: &Owner,
        key: &LeaseKey,
        terms: ClaimTerms,
        slots: u32,
    ) -> Result<SlotClaim, StoreError> {
        check_slot_claim(resource, slots)?;
        // One deadline for the turn, the permit and the connection: the pool's timeout.
        let deadline = tokio::time::Instant::now() + POOL_TIMEOUT;
        let _turn = self.slot_turns.take(resource, deadline).await?;
        // Given back only once the transaction ended: a claim whose client went away may
        // still wait on the advisory lock, and the next user would queue behind it.
        let mut client = tokio::time::timeout_at(deadline, Checkout::of(&self.pool))
            .await
            .map_err(|_| StoreError::Timeout(POOL_TIMEOUT))?
            .map_err(StoreError::io)?;
        // The lock, the rows, the floor, the write.
        let decided = super::deadline::within(
            self.statement_deadline,
            4,
            self.decide_slot_rows(&mut client, resource, (owner, key), terms, slots),
        )
        .await;
        super::deadline::ended(client, &decided);
        decided
    }

    /// The claim's transaction on `client`.
    async fn decide_slot_rows(
        &self,
        client: &mut Checkout,
        resource: &JobId,
        (owner, key): (&Owner, &LeaseKey),
        terms: ClaimTerms,
        slots: u32,
    ) -> Result<SlotClaim, StoreError> {
        let sql = &self.sql.slots;
        let prefix = slot_prefix(resource);
        let lock = format!("fence-slots {} {resource}", self.table.qualified());
        let tx = client.transaction().await.map_err(StoreError::io)?;
        tx.execute(&sql.lock, &[&lock])
            .await
            .map_err(StoreError::io)?;
        let rows = tx
            .query(&sql.rows, &[&prefix.as_str()])
            .await
            .map_err(StoreError::io)?;
        let records = slot_records(rows.iter().map(|row| {
            let job: String = row.try_get(0).map_err(StoreError::io)?;
            let job = JobId::new(job).map_err(|_| StoreError::Corrupt {
                job: resource.clone(),
                reason: "a slot's job id is not visible ASCII",
            })?;
            Ok((job.clone(), stored(&job, row)?))
        }))?;
        // The floor row is there from `migrate` on (a plain claim needs it too).
        let row = tx
            .query_one(&sql.floor, &[&self.offset()])
            .await
            .map_err(StoreError::io)?;
        let floor = generation(resource, &row, 0)?;
        let now_ms: i64 = row.try_get(1).map_err(StoreError::io)?;
        let now_ms = u64::try_from(now_ms).unwrap_or(0);
        let (new, out) = crate::store::decide_slot(
            resource,
            &records,
            floor,
            (owner, key),
            (terms, slots),
            now_ms,
        )?;
        if let Some((slot, new)) = new {
            let job = slot_job(resource, slot);
            let millis = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
            let params: [&(dyn ToSql + Sync); 8] = [
                &job.as_str(),
                &owner.as_str(),
                &new.generation.get().to_string(),
                &millis(new.lease_until_ms),
                &millis(new.changed_ms),
                &&new.key.as_bytes()[..],
                &millis(new.lock_delay_ms),
                &i32::try_from(new.slots).unwrap_or(i32::MAX),
            ];
            tx.execute(&sql.write, &params)
                .await
                .map_err(StoreError::io)?;
        }
        tx.commit().await.map_err(StoreError::io)?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::time::{Instant, timeout};

    use super::*;

    fn job(s: &str) -> JobId {
        s.parse().unwrap()
    }

    /// Claims of a busy resource queue behind each other, holding no permit while they
    /// wait, and not behind other resources' claims; at most `PERMITS` resources go on at
    /// once; nothing is kept once every claim left.
    #[tokio::test(start_paused = true)]
    async fn a_busy_resource_holds_one_permit_and_delays_no_other() {
        let turns = Arc::new(Turns::default());
        let later = Instant::now() + Duration::from_secs(60);
        let hot = turns.take(&job("hot"), later).await.unwrap();
        // A second claim of the same resource, queued behind the first until it is done.
        let (got, mut second) = tokio::sync::oneshot::channel();
        let queued = {
            let turns = turns.clone();
            tokio::spawn(async move {
                let turn = turns.take(&job("hot"), later).await.unwrap();
                let _ = got.send(());
                drop(turn);
            })
        };
        let short = Duration::from_millis(50);
        tokio::time::sleep(short).await;
        assert!(
            second.try_recv().is_err(),
            "the second claim waits for the first"
        );
        let mut others = Vec::new();
        for i in 1..PERMITS {
            let other = timeout(short, turns.take(&job(&format!("r{i}")), later)).await;
            others.push(other.expect("another resource does not wait").unwrap());
        }
        assert!(
            timeout(short, turns.take(&job("one-too-many"), later))
                .await
                .is_err(),
            "all {PERMITS} permits are held"
        );
        drop(others);
        drop(hot);
        queued.await.unwrap();
        assert!(second.try_recv().is_ok());
        assert_eq!(turns.queued_resources(), 0);
    }

    /// A claim that waited past its deadline says which wait it was, and leaves nothing.
    #[tokio::test(start_paused = true)]
    async fn a_turn_waited_for_past_the_deadline_is_an_error() {
        let turns = Turns::default();
        let held = turns
            .take(&job("hot"), Instant::now() + Duration::from_secs(60))
            .await
            .unwrap();
        let late = turns
            .take(&job("hot"), Instant::now() + Duration::from_secs(1))
            .await
            .err()
            .expect("the deadline passed");
        // Nothing reached the database: busy, not an answer lost (a 503 "unknown").
        assert!(!late.answer_lost(), "{late:?}");
        let StoreError::Busy(text) = &late else {
            panic!("{late:?}")
        };
        assert!(text.contains("claims of the same resource"), "{text}");
        drop(held);
        assert_eq!(turns.queued_resources(), 0);
    }
}
