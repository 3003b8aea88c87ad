//! An operator's revoke in PostgreSQL: one statement, the job's row locked while it decides.

use fence_core::{Generation, JobId, lease_api::LeaseState};

use super::{PgLeaseStore, Snapshot, generation, now_ms};
use crate::store::{LeaseRecord, Outcome, Revocation, StoreError};

/// `$1` job, `$2` clock offset. A row that is not completed and below the last generation
/// goes free at the next one, keeping the revoked lease's end (a semaphore's slot counts as
/// in force until then, as in the Rust rule); returns the new generation and when the
/// revoked lease would have ended (now, if it already had).
/// The row changed is announced on `channel` (waiting claims on other servers wake).
pub(super) fn sql(t: &str, channel: &str) -> String {
    format!(
        "WITH old AS (
           SELECT job, lease_until_ms FROM {t}
           WHERE job = $1 AND job <> '' AND NOT completed
             AND generation < {last}
           FOR UPDATE)
         UPDATE {t} AS t SET generation = t.generation + 1, owner = NULL, changed_ms = {now}
         FROM old WHERE t.job = old.job
         RETURNING t.generation::text, GREATEST(old.lease_until_ms, {now}), {notify}",
        notify = super::notify(channel, "t.job"),
        now = now_ms(2),
        last = fence_core::Generation::LAST.get(),
    )
}

impl PgLeaseStore {
    pub(super) async fn revoke_row(&self, job: &JobId) -> Result<Outcome, StoreError> {
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] =
            [&job.as_str(), &self.offset()];
        if let Some(row) = self.query(&self.sql.revoke, &params).await? {
            let until: i64 = row.try_get(1).map_err(StoreError::io)?;
            let record = LeaseRecord {
                job: job.clone(),
                owner: None,
                generation: generation(job, &row, 0)?,
                state: LeaseState::Free,
                expires_in: std::time::Duration::ZERO,
            };
            return Ok(Outcome::Revoked(Revocation {
                record,
                expires_at_ms: Some(u64::try_from(until).unwrap_or(0)),
                token: None,
            }));
        }
        // Refused: no row, a completed one, or the last generation.
        match self.snapshot(job).await? {
            None => Ok(Outcome::Unknown),
            Some(Snapshot {
                completed: true,
                owner,
                generation,
                ..
            }) => Ok(Outcome::Completed { owner, generation }),
            Some(s) if s.generation == Generation::LAST => {
                Err(StoreError::GenerationExhausted(job.clone()))
            }
            // Not refused for any reason this statement has: it changed in between.
            Some(_) => Err(StoreError::Protocol(format!(
                "revoke of {job} matched no row, but the row is revocable now; retry"
            ))),
        }
    }
}
