//! A claim and a checkpoint in PostgreSQL: one statement decides, a refusal is read back.

use std::time::Duration;

use fence_core::{
    JobId, Owner, Ttl,
    lease_api::{Checkpoint, LeaseState},
    secret::LeaseKey,
};
use tokio_postgres::types::ToSql;

use super::{PgLeaseStore, Snapshot, generation, millis, now_ms};
use crate::store::{Grant, Outcome, StoreError};

/// `$1` job, `$2` owner, `$3` ttl_ms, `$4` clock offset, `$5` key hash, `$6` lock-delay ms.
/// A holder that claims again with its key while its lease runs keeps its generation (the
/// retry of a lost answer), and its lease's end never moves earlier (as a renewal's). A lease that expired is claimable once its lock-delay is over
/// too (contract section 12), and a job at the last generation is claimable by nobody else
/// (refused, then answered as exhausted, not a broken CHECK). A new row starts above the
/// floor, read under a share lock (see the module's notes). Returns the generation, the
/// lease's end and the job's checkpoint.
pub(super) fn sql(t: &str) -> String {
    format!(
        "INSERT INTO {t} AS t (job, owner, generation, lease_until_ms, changed_ms, key_hash, completed, lock_delay_ms)
         VALUES ($1, $2, (SELECT f.generation + 1 FROM {t} f WHERE f.job = '' FOR SHARE),
                 {now} + $3::bigint, {now}, $5, false, $6::bigint)
         ON CONFLICT (job) DO UPDATE SET
           generation = CASE WHEN t.owner = excluded.owner AND t.key_hash = excluded.key_hash
                                  AND t.lease_until_ms > excluded.changed_ms
                        THEN t.generation ELSE t.generation + 1 END,
           owner = excluded.owner,
           key_hash = excluded.key_hash,
           lease_until_ms = CASE WHEN t.owner = excluded.owner AND t.key_hash = excluded.key_hash
                                      AND t.lease_until_ms > excluded.changed_ms
                            THEN GREATEST(t.lease_until_ms, excluded.lease_until_ms)
                            ELSE excluded.lease_until_ms END,
           changed_ms = excluded.changed_ms,
           lock_delay_ms = CASE WHEN t.owner = excluded.owner AND t.key_hash = excluded.key_hash
                                     AND t.lease_until_ms > excluded.changed_ms
                           THEN t.lock_delay_ms ELSE excluded.lock_delay_ms END
         WHERE NOT t.completed
           AND ((t.owner = excluded.owner AND t.key_hash = excluded.key_hash
                 AND t.lease_until_ms > excluded.changed_ms)
                OR (t.generation < {last}
                    AND (t.owner IS NULL
                         OR t.lease_until_ms <= excluded.changed_ms - t.lock_delay_ms)))
         RETURNING t.generation::text, t.lease_until_ms, t.checkpoint, t.checkpoint_generation::text",
        now = now_ms(4),
        last = fence_core::Generation::LAST.get(),
    )
}

/// `$1` job, `$2` owner, `$3` generation, `$4` clock offset, `$5` key hash, `$6` checkpoint:
/// saved while owner, generation and key hold the job (as a renewal's condition), with the
/// generation that saved it. Returns the row as `get` does.
pub(super) fn checkpoint_sql(t: &str, holder: &str) -> String {
    format!(
        "UPDATE {t} SET checkpoint = $6, checkpoint_generation = generation, changed_ms = {now}
         WHERE {holder} AND key_hash = $5
         RETURNING owner, generation::text, lease_until_ms, completed, {now}",
        now = now_ms(4)
    )
}

/// `$1` job, `$2` clock offset: the columns of `get` and the lock-delay, for a refused claim.
pub(super) fn refused_sql(t: &str) -> String {
    format!(
        "SELECT owner, generation::text, lease_until_ms, completed, {now}, lock_delay_ms FROM {t} WHERE job = $1",
        now = now_ms(2)
    )
}

impl PgLeaseStore {
    pub(super) async fn claim_row(
        &self,
        job: &JobId,
        owner: &Owner,
        key: &LeaseKey,
        ttl: Ttl,
        lock_delay: Duration,
    ) -> Result<Outcome, StoreError> {
        let hash = key.hash();
        let hash = &hash.as_bytes()[..];
        // At most the longest lease (24 h), whoever asks: the SQL never overflows.
        let delay = lock_delay.min(Ttl::MAX.as_duration());
        let delay = i64::try_from(delay.as_millis()).unwrap_or(i64::MAX);
        loop {
            let params: [&(dyn ToSql + Sync); 6] = [
                &job.as_str(),
                &owner.as_str(),
                &millis(ttl),
                &self.offset(),
                &hash,
                &delay,
            ];
            if let Some(row) = self.query(&self.sql.claim, &params).await? {
                let until: i64 = row.try_get(1).map_err(StoreError::io)?;
                let data: Option<String> = row.try_get(2).map_err(StoreError::io)?;
                let checkpoint = match data {
                    Some(data) => Some(Checkpoint {
                        generation: generation(job, &row, 3)?,
                        data,
                    }),
                    None => None,
                };
                return Ok(Outcome::Granted(Grant {
                    generation: generation(job, &row, 0)?,
                    ttl,
                    expires_at_ms: u64::try_from(until).unwrap_or(0),
                    token: None,
                    checkpoint,
                }));
            }
            // Refused; read why. If the holder let go in between, decide again.
            let params: [&(dyn ToSql + Sync); 2] = [&job.as_str(), &self.offset()];
            let Some(row) = self.query(&self.sql.claim_refused, &params).await? else {
                continue;
            };
            let delay_ms: i64 = row.try_get(5).map_err(StoreError::io)?;
            let s = Snapshot::from_row(job, &row)?;
            let claimable_at = s.until_ms.saturating_add(delay_ms);
            if s.completed {
                return Ok(Outcome::Completed {
                    owner: s.owner,
                    generation: s.generation,
                });
            }
            // No generation above it: refused whatever else holds (the statement keeps only
            // the holder's retry at it).
            if s.generation == fence_core::Generation::LAST
                && (s.owner.is_none() || s.state() != LeaseState::Held)
            {
                return Err(StoreError::GenerationExhausted(job.clone()));
            }
            let Some(holder) = s.owner.clone() else {
                continue;
            };
            if s.state() == LeaseState::Held {
                return Ok(Outcome::Held {
                    owner: holder,
                    generation: s.generation,
                    expires_in: s.expires_in(),
                    lock_delay: false,
                });
            }
            if s.now_ms < claimable_at {
                let left = u64::try_from(claimable_at - s.now_ms).unwrap_or(0);
                return Ok(Outcome::Held {
                    owner: holder,
                    generation: s.generation,
                    expires_in: Duration::from_millis(left),
                    lock_delay: true,
                });
            }
        }
    }
}
