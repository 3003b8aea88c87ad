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
use fence_storage::postgres::POOL_TIMEOUT;
use tokio_postgres::types::ToSql;

use super::{PgLeaseStore, generation};
use crate::store::{
    ClaimTerms, SlotClaim, StoreError, check_slot_claim, rules::Stored, slot_prefix, slot_records,
};

/// How many turns resources are spread over: claims of resources that share one wait for
/// each other (a transaction each, milliseconds), and at most this many of the pool's
/// connections are held by semaphore claims at once, however many resources are busy.
const TURNS: usize = fence_storage::postgres::POOL_SIZE / 2;

/// The in-memory turns of semaphore claims, one per group of resources; which group a
/// resource falls in is drawn per process, so nobody can pick names that share another's.
pub(super) struct Turns {
    turns: [tokio::sync::Mutex<()>; TURNS],
    hasher: std::hash::RandomState,
}

impl Default for Turns {
    fn default() -> Self {
        Self {
            turns: std::array::from_fn(|_| tokio::sync::Mutex::new(())),
            hasher: std::hash::RandomState::new(),
        }
    }
}

impl Turns {
    /// Waits for `resource`'s turn, at most [`POOL_TIMEOUT`] (as long as a pooled
    /// connection is waited for).
    async fn take(&self, resource: &JobId) -> Result<tokio::sync::MutexGuard<'_, ()>, StoreError> {
        use std::hash::BuildHasher;
        let hashed = self.hasher.hash_one(resource.as_str());
        let turn = &self.turns[usize::try_from(hashed % TURNS as u64).unwrap_or(0)];
        tokio::time::timeout(POOL_TIMEOUT, turn.lock())
            .await
            .map_err(|_| {
                StoreError::io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "semaphore claims of {resource} queued for more than {} s on this server",
                        POOL_TIMEOUT.as_secs()
                    ),
                ))
            })
    }
}

/// The statements of a semaphore claim on table `t`.
pub(super) struct SlotSql {
    /// `$1` the lock's name: one lock per table and resource.
    lock: String,
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
        let sql = &self.sql.slots;
        let prefix = slot_prefix(resource);
        let lock = format!("fence-slots {} {resource}", self.table.qualified());
        let _turn = self.slot_turns.take(resource).await?;
        let mut client = self.pool.get().await.map_err(StoreError::io)?;
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
