//! Deleting expired idempotency records, in batches found through an index on their expiry.
//!
//! One `DELETE` of a table grown to millions of expired records (24 h of keys at a few hundred
//! a second) outlasts the sessions' statement timeout every time, rolls back, and purges
//! nothing, so the table grows without bound. Batches of [`PURGE_BATCH`], each a statement of
//! its own, go through an index on `live_until_ms`. The index is built `CONCURRENTLY` in the
//! background, outside the migration: a plain build in the migration's transaction would block
//! every proxy's writes to the table, and time out on a large one at each start.

use std::{
    sync::atomic::{AtomicU8, Ordering},
    time::Duration,
};

use fence_storage::postgres::Checkout;

use super::{PgStore, io, now_ms};
use crate::store::StoreError;

/// The expired idempotency records one statement of a purge deletes at most.
const PURGE_BATCH: u64 = 1_000;

/// The most statements one purge runs (what is left waits for the next pass).
const MAX_PURGE_BATCHES: usize = 1_000;

/// How long the index's build may take, and wait for the transactions it must outlast.
const BUILD_TIMEOUT: Duration = Duration::from_secs(3_600);
const BUILD_LOCK_TIMEOUT: Duration = Duration::from_secs(60);

/// Where the index stands, as this process knows: not known to be there (a purge then starts
/// a build), being built by this process, or there and valid.
const UNKNOWN: u8 = 0;
const BUILDING: u8 = 1;
const READY: u8 = 2;

impl PgStore {
    /// Deletes expired records, a batch per statement until a batch comes back short (at most
    /// [`MAX_PURGE_BATCHES`]); rows another sink is deleting are skipped, not waited for.
    /// While the index is not known to be there, a build starts in the background and this
    /// purge goes on without it.
    pub(super) async fn purge(&self) -> Result<usize, StoreError> {
        self.index_expiry_in_background();
        let client = Checkout::of(&self.pool).await.map_err(io)?;
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
        client.done();
        Ok(purged)
    }

    /// Starts [`build_expiry_index`](Self::build_expiry_index) in a task of its own unless
    /// the index is known to be there or this process is building it.
    fn index_expiry_in_background(&self) {
        let state: &AtomicU8 = &self.expiry_index;
        if state
            .compare_exchange(UNKNOWN, BUILDING, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            state.store(UNKNOWN, Ordering::Release);
            return;
        };
        let store = self.clone();
        runtime.spawn(async move {
            let next = match store.build_expiry_index().await {
                Ok(true) => READY,
                Ok(false) => UNKNOWN, // another process builds it: looked at again next purge
                Err(e) => {
                    tracing::warn!(
                        error = %fence_storage::error_chain(&e),
                        table = %store.tables.idempotency,
                        "building the index of idempotency records' expiry failed; purging without it, trying again at the next purge"
                    );
                    UNKNOWN
                }
            };
            store.expiry_index.store(next, Ordering::Release);
        });
    }

    /// Whether the index is there and valid, after building it if need be: `CREATE INDEX
    /// CONCURRENTLY` (writes go on meanwhile), by one process at a time (an advisory lock; false
    /// when another holds it), an index a failed build left invalid dropped first. On a
    /// connection taken out of the pool, under longer timeouts than the sessions' own: it is
    /// closed after, even when the build is cancelled, never handed to another caller.
    async fn build_expiry_index(&self) -> Result<bool, StoreError> {
        let client = deadpool_postgres::Object::take(self.pool.get().await.map_err(io)?);
        let (schema, table) = (self.tables.schema.to_string(), &self.tables.idempotency);
        let name = format!(
            "{}_expiry",
            table.rsplit('.').next().unwrap_or(table.as_str())
        );
        // Whether the index exists (`None`: not), and is valid.
        let valid = || async {
            client
                .query_opt(
                    "SELECT i.indisvalid FROM pg_index i \
                     JOIN pg_class c ON c.oid = i.indexrelid \
                     JOIN pg_namespace n ON n.oid = c.relnamespace \
                     WHERE n.nspname = $1 AND c.relname = $2",
                    &[&schema, &name],
                )
                .await
                .map(|row| row.map(|row| row.get::<_, bool>(0)))
                .map_err(io)
        };
        if valid().await? == Some(true) {
            return Ok(true);
        }
        let locked: bool = client
            .query_one(
                "SELECT pg_try_advisory_lock(hashtext($1))",
                &[&format!("{schema}.{name}")],
            )
            .await
            .map_err(io)?
            .get(0);
        if !locked {
            return Ok(false);
        }
        client
            .batch_execute(&format!(
                "SET statement_timeout = {}; SET lock_timeout = {}",
                BUILD_TIMEOUT.as_millis(),
                BUILD_LOCK_TIMEOUT.as_millis()
            ))
            .await
            .map_err(io)?;
        // Looked at again under the lock: an invalid index now is a failed build's.
        let valid = valid().await?;
        if valid == Some(false) {
            client
                .batch_execute(&format!(
                    "DROP INDEX CONCURRENTLY IF EXISTS {schema}.{name}"
                ))
                .await
                .map_err(io)?;
        }
        if valid != Some(true) {
            client
                .batch_execute(&format!(
                    "CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON {table} (live_until_ms)"
                ))
                .await
                .map_err(io)?;
        }
        // The connection (and with it the advisory lock) goes when `client` is dropped.
        Ok(true)
    }
}
