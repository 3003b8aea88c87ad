//! Deleting expired idempotency records, in batches found through an index on their expiry.
//!
//! One `DELETE` of a table grown to millions of expired records (24 h of keys at a few hundred
//! a second) outlasts the sessions' statement timeout every time, rolls back, and purges
//! nothing, so the table grows without bound. Batches of [`PURGE_BATCH`], each a statement of
//! its own, go through an index on `live_until_ms`. The index is built by the purge itself,
//! `CONCURRENTLY` and outside the migration: a plain build in the migration's transaction would
//! block every proxy's writes to the table, and time out on a large one at each start.

use std::{sync::atomic::Ordering, time::Duration};

use super::{PgStore, io, now_ms};
use crate::store::StoreError;

/// The expired idempotency records one statement of a purge deletes at most.
pub(super) const PURGE_BATCH: u64 = 1_000;

/// The most statements one purge runs (what is left waits for the next pass).
pub(super) const MAX_PURGE_BATCHES: usize = 1_000;

/// How long the index's build may take, and wait for the transactions it must outlast.
const BUILD_TIMEOUT: Duration = Duration::from_secs(3_600);
const BUILD_LOCK_TIMEOUT: Duration = Duration::from_secs(60);

impl PgStore {
    /// Deletes expired records, a batch per statement until a batch comes back short (at most
    /// [`MAX_PURGE_BATCHES`]); rows another sink is deleting are skipped, not waited for. The
    /// first purge of the process builds the index if it is missing; a build that fails is
    /// logged and tried again at the next purge, which goes on without it meanwhile.
    pub(super) async fn purge(&self) -> Result<usize, StoreError> {
        if !self.expiry_indexed.load(Ordering::Relaxed) {
            match self.build_expiry_index().await {
                Ok(()) => self.expiry_indexed.store(true, Ordering::Relaxed),
                Err(e) => tracing::warn!(
                    error = %fence_storage::error_chain(&e),
                    table = %self.tables.idempotency,
                    "building the index of idempotency records' expiry failed; purging without it"
                ),
            }
        }
        let client = self.pool.get().await.map_err(io)?;
        let table = &self.tables.idempotency;
        let sql = format!(
            "DELETE FROM {table} WHERE (job, key) IN (SELECT job, key FROM {table} \
             WHERE live_until_ms <= {} LIMIT {PURGE_BATCH} FOR UPDATE SKIP LOCKED)",
            now_ms(1)
        );
        let mut purged = 0usize;
        for _ in 0..MAX_PURGE_BATCHES {
            let n = client.execute(&sql, &[&self.offset()]).await.map_err(io)?;
            purged = purged.saturating_add(usize::try_from(n).unwrap_or(usize::MAX));
            if n < PURGE_BATCH {
                break;
            }
        }
        Ok(purged)
    }

    /// `CREATE INDEX CONCURRENTLY` (writes go on meanwhile) on `live_until_ms`, under longer
    /// timeouts than the sessions' own, restored after; an index a failed build left invalid
    /// is dropped and built again.
    async fn build_expiry_index(&self) -> Result<(), StoreError> {
        let client = self.pool.get().await.map_err(io)?;
        let (schema, table) = (&self.tables.schema, &self.tables.idempotency);
        let name = format!(
            "{}_expiry",
            table.rsplit('.').next().unwrap_or(table.as_str())
        );
        let invalid = client
            .query_opt(
                "SELECT NOT i.indisvalid FROM pg_index i \
                 JOIN pg_class c ON c.oid = i.indexrelid \
                 JOIN pg_namespace n ON n.oid = c.relnamespace \
                 WHERE n.nspname = $1 AND c.relname = $2",
                &[&schema.to_string(), &name],
            )
            .await
            .map_err(io)?
            .is_some_and(|row| row.get::<_, bool>(0));
        client
            .batch_execute(&format!(
                "SET statement_timeout = {}; SET lock_timeout = {}",
                BUILD_TIMEOUT.as_millis(),
                BUILD_LOCK_TIMEOUT.as_millis()
            ))
            .await
            .map_err(io)?;
        let built = async {
            if invalid {
                client
                    .batch_execute(&format!(
                        "DROP INDEX CONCURRENTLY IF EXISTS {schema}.{name}"
                    ))
                    .await?;
            }
            client
                .batch_execute(&format!(
                    "CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON {table} (live_until_ms)"
                ))
                .await
        }
        .await;
        // Back to the timeouts the session was opened with, before it returns to the pool.
        let reset = client
            .batch_execute("RESET statement_timeout; RESET lock_timeout")
            .await;
        built.map_err(io)?;
        reset.map_err(io)
    }
}
