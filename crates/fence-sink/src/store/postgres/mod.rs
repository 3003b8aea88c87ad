//! The fence and idempotency records in PostgreSQL, shared by every sink on the same tables.
//!
//! Also the in-transaction check, for handlers that own a PostgreSQL database.
//!
//! ```no_run
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use fence_sink::{FenceLayer, postgres::{PgStore, PgTables}};
//!
//! let store = PgStore::connect("postgres://postgres@127.0.0.1/test", PgTables::default()).await?;
//! store.migrate().await?;
//! let layer = FenceLayer::new(store); // several processes on one database: one fence
//! # Ok(()) }
//! ```

use std::time::Duration;

use deadpool_postgres::Pool;
use fence_core::{Generation, JobId};
use fence_storage::postgres::{Ident, IdentError, MigrateError, NOW_MS, SetupError};
use tokio_postgres::GenericClient;

use super::{
    Attempt, Begin, Finish, GenerationStore, IdempotencyStore, IdleJob, IdlePage, STAMP_GRANULE_MS,
    StoreError, Verdict, record::Record,
};

/// Where the tables live: `schema.prefix_generations` and `schema.prefix_idempotency`.
#[derive(Debug, Clone)]
pub struct PgTables {
    generations: String,
    idempotency: String,
    schema: Ident,
    /// The SQL fence's functions: `schema.observe` and `schema.require` for the default
    /// prefix `sink`, `schema.{prefix}_observe` and `schema.{prefix}_require` for another.
    observe_fn: String,
    require_fn: String,
}

impl Default for PgTables {
    /// `fence.sink_generations` and `fence.sink_idempotency`.
    fn default() -> Self {
        Self::new("fence", "sink").expect("valid names")
    }
}

impl PgTables {
    /// Tables `schema.{prefix}_generations` and `schema.{prefix}_idempotency`.
    ///
    /// # Errors
    /// When the schema or a table name is not 1 to 63 characters of `a-z`, `0-9` and `_`,
    /// starting with a letter or `_`.
    pub fn new(schema: &str, prefix: &str) -> Result<Self, IdentError> {
        let schema = Ident::new("schema", schema)?;
        let table = |suffix: &str| {
            Ident::new("table", &format!("{prefix}_{suffix}")).map(|t| format!("{schema}.{t}"))
        };
        let function = |name: &str| {
            let name = if prefix == "sink" {
                name.to_owned()
            } else {
                format!("{prefix}_{name}")
            };
            Ident::new("function", &name).map(|f| format!("{schema}.{f}"))
        };
        Ok(Self {
            generations: table("generations")?,
            idempotency: table("idempotency")?,
            observe_fn: function("observe")?,
            require_fn: function("require")?,
            schema,
        })
    }
}

/// The sink's store in PostgreSQL. [`GenerationStore::is_shared`] is true: the layer asks
/// the database on every fenced request, so a token accepted by one sink process makes a
/// lower one stale on every other.
#[derive(Clone)]
pub struct PgStore {
    pool: Pool,
    tables: PgTables,
    #[cfg(any(test, feature = "test-hooks"))]
    offset_ms: std::sync::Arc<std::sync::atomic::AtomicI64>,
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore")
            .field("tables", &self.tables)
            .finish_non_exhaustive()
    }
}

fn io(e: impl Into<fence_storage::BoxError>) -> StoreError {
    StoreError::io(e)
}

/// Checks and advances the fence for `(job, token)` on `client`, which may be a
/// transaction: then the fence moves only if the transaction commits, together with the
/// handler's own effect; a rollback or a dropped connection leaves neither. Holding the
/// job's row lock until the end of the transaction orders concurrent transactions of one job.
///
/// ```no_run
/// # async fn handler(client: &mut tokio_postgres::Client) -> Result<(), Box<dyn std::error::Error>> {
/// use fence_sink::{Verdict, postgres::{PgTables, check_in_transaction}};
///
/// let tx = client.transaction().await?;
/// let job = "invoice-42".parse()?;
/// match check_in_transaction(&tx, &PgTables::default(), &job, fence_core::Generation::new(8)).await? {
///     Verdict::Accepted => {
///         tx.execute("INSERT INTO charges (job, amount) VALUES ($1, 10)", &[&"invoice-42"]).await?;
///         tx.commit().await?; // the effect and the fence commit together
///     }
///     Verdict::Stale { .. } => tx.rollback().await?, // a newer holder exists
/// }
/// # Ok(()) }
/// ```
///
/// # Errors
/// When the statement fails.
pub async fn check_in_transaction(
    client: &impl GenericClient,
    tables: &PgTables,
    job: &JobId,
    token: Generation,
) -> Result<Verdict, StoreError> {
    let t = &tables.generations;
    let now = fence_storage::postgres::NOW_MS;
    // Raised, or equal with a stamp at least a second old: (re)stamped with the database's
    // clock. Equal and stamped lately, or lower: nothing written.
    let bumped = client
        .query_opt(
            &format!(
                "INSERT INTO {t} AS g (job, highest, touched_ms) VALUES ($1, $2::text::numeric, {now})
                 ON CONFLICT (job) DO UPDATE SET highest = excluded.highest, touched_ms = excluded.touched_ms
                 WHERE g.highest < excluded.highest
                    OR (g.highest = excluded.highest AND g.touched_ms + {STAMP_GRANULE_MS} <= excluded.touched_ms)
                 RETURNING 1"
            ),
            &[&job.as_str(), &token.get().to_string()],
        )
        .await
        .map_err(io)?;
    if bumped.is_some() {
        return Ok(Verdict::Accepted);
    }
    // Not raised: equal (accepted; lock the row for the rest of a transaction) or higher.
    let row = client
        .query_one(
            &format!("SELECT highest::text FROM {t} WHERE job = $1 FOR SHARE"),
            &[&job.as_str()],
        )
        .await
        .map_err(io)?;
    let highest: String = row.try_get(0).map_err(io)?;
    let highest = Generation::new(highest.parse().map_err(|_| StoreError::Corrupt {
        job: job.clone(),
        reason: "highest out of range",
    })?);
    Ok(if highest > token {
        Verdict::Stale { highest }
    } else {
        Verdict::Accepted
    })
}

impl PgStore {
    /// A pool (up to 16 connections) to `url`. Call [`migrate`](Self::migrate) once.
    ///
    /// # Errors
    /// When `url` is not a valid connection string.
    pub async fn connect(url: &str, tables: PgTables) -> Result<Self, SetupError> {
        Ok(Self {
            pool: fence_storage::postgres::connect_pool(url)?,
            tables,
            #[cfg(any(test, feature = "test-hooks"))]
            offset_ms: std::sync::Arc::default(),
        })
    }

    /// Test hook (feature `test-hooks`): shifts the database clock, as this store reads it
    /// for idempotency records, by `ms` (cumulative).
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn shift_clock_ms(&self, ms: i64) {
        self.offset_ms
            .fetch_add(ms, std::sync::atomic::Ordering::SeqCst);
    }

    /// The clock offset, always 0 outside the fault tests.
    fn offset(&self) -> i64 {
        #[cfg(any(test, feature = "test-hooks"))]
        return self.offset_ms.load(std::sync::atomic::Ordering::SeqCst);
        #[cfg(not(any(test, feature = "test-hooks")))]
        0
    }

    /// The tables, for [`check_in_transaction`].
    pub fn tables(&self) -> &PgTables {
        &self.tables
    }

    /// Creates the schema and tables if they do not exist; safe to run any number of times,
    /// from any number of processes at once.
    ///
    /// # Errors
    /// When the database cannot be reached or refuses the DDL.
    pub async fn migrate(&self) -> Result<(), MigrateError> {
        let PgTables {
            generations,
            idempotency,
            schema,
            observe_fn,
            require_fn,
        } = &self.tables;
        let now = fence_storage::postgres::NOW_MS;
        // An index name is unqualified and lives in the table's schema.
        let stamps_index = format!(
            "{}_stamps",
            generations.rsplit('.').next().unwrap_or(generations)
        );
        let ddl = format!(
            "CREATE TABLE IF NOT EXISTS {generations} (
               job text PRIMARY KEY,
               highest numeric(20, 0) NOT NULL CHECK (highest >= 0 AND highest <= 18446744073709551615),
               touched_ms bigint NOT NULL DEFAULT 0
             );
             ALTER TABLE {generations} ADD COLUMN IF NOT EXISTS touched_ms bigint NOT NULL DEFAULT 0;
             CREATE INDEX IF NOT EXISTS {stamps_index} ON {generations} (touched_ms, job);
             CREATE TABLE IF NOT EXISTS {idempotency} (
               job text NOT NULL,
               key text NOT NULL,
               fingerprint bytea NOT NULL,
               in_flight boolean NOT NULL,
               record bytea NOT NULL,
               live_until_ms bigint NOT NULL,
               PRIMARY KEY (job, key)
             );
             -- The SQL fence (contract section 11): the same decision as check_in_transaction,
             -- on the same table, for writers in any language.
             CREATE OR REPLACE FUNCTION {observe_fn}(p_job text, p_token numeric) RETURNS boolean
             LANGUAGE plpgsql AS $fence$
             DECLARE h numeric;
             BEGIN
               IF p_job IS NULL OR p_token IS NULL OR octet_length(p_job) NOT BETWEEN 1 AND 256
                  OR p_job !~ '^[\x21-\x7e]+$' OR p_token < 0 OR p_token > 18446744073709551615
                  OR p_token <> trunc(p_token) THEN
                 RAISE EXCEPTION 'malformed fencing job or token: job %, token %', p_job, p_token
                   USING ERRCODE = '22023';
               END IF;
               INSERT INTO {generations} AS g (job, highest, touched_ms) VALUES (p_job, p_token, {now})
                 ON CONFLICT (job) DO UPDATE SET highest = excluded.highest, touched_ms = excluded.touched_ms
                 WHERE g.highest < excluded.highest
                    OR (g.highest = excluded.highest AND g.touched_ms + {STAMP_GRANULE_MS} <= excluded.touched_ms);
               IF FOUND THEN
                 RETURN true;
               END IF;
               SELECT g.highest INTO h FROM {generations} g WHERE g.job = p_job FOR SHARE;
               RETURN h <= p_token;
             END
             $fence$;
             CREATE OR REPLACE FUNCTION {require_fn}(p_job text, p_token numeric) RETURNS void
             LANGUAGE plpgsql AS $fence$
             DECLARE h numeric;
             BEGIN
               IF NOT {observe_fn}(p_job, p_token) THEN
                 SELECT g.highest INTO h FROM {generations} g WHERE g.job = p_job;
                 RAISE EXCEPTION 'stale fencing token: job %, token %, highest %', p_job, p_token, h
                   USING ERRCODE = 'ZF409';
               END IF;
             END
             $fence$;"
        );
        fence_storage::postgres::migrate(&self.pool, schema, &ddl).await
    }
}

impl GenerationStore for PgStore {
    async fn observe(&self, job: &JobId, token: Generation) -> Result<Verdict, StoreError> {
        let client = self.pool.get().await.map_err(io)?;
        check_in_transaction(&**client, &self.tables, job, token).await
    }

    async fn highest(&self, job: &JobId) -> Result<Generation, StoreError> {
        let client = self.pool.get().await.map_err(io)?;
        let row = client
            .query_opt(
                &format!(
                    "SELECT highest::text FROM {} WHERE job = $1",
                    self.tables.generations
                ),
                &[&job.as_str()],
            )
            .await
            .map_err(io)?;
        match row {
            None => Ok(Generation::ZERO),
            Some(r) => {
                let text: String = r.try_get(0).map_err(io)?;
                text.parse()
                    .map(Generation::new)
                    .map_err(|_| StoreError::Corrupt {
                        job: job.clone(),
                        reason: "highest out of range",
                    })
            }
        }
    }

    fn is_shared(&self) -> bool {
        true
    }

    async fn idle(&self, page: IdlePage<'_>) -> Result<Vec<IdleJob>, StoreError> {
        let client = self.pool.get().await.map_err(io)?;
        let t = &self.tables.generations;
        let idle_ms = i64::try_from(page.idle_for.as_millis()).unwrap_or(i64::MAX);
        let limit = i64::try_from(page.limit).unwrap_or(i64::MAX);
        let (after_ms, after_job) = match page.after {
            Some(a) => (
                i64::try_from(a.touched_ms).unwrap_or(i64::MAX),
                a.job.as_str(),
            ),
            None => (-1, ""),
        };
        let rows = client
            .query(
                &format!(
                    "SELECT touched_ms, job FROM {t}
                     WHERE touched_ms < {NOW_MS} - $1 AND (touched_ms, job) > ($2, $3)
                     ORDER BY touched_ms, job LIMIT $4"
                ),
                &[&idle_ms, &after_ms, &after_job, &limit],
            )
            .await
            .map_err(io)?;
        let mut out = Vec::with_capacity(rows.len());
        for row in rows {
            let touched: i64 = row.try_get(0).map_err(io)?;
            let job: &str = row.try_get(1).map_err(io)?;
            if let Ok(job) = job.parse() {
                out.push(IdleJob {
                    touched_ms: u64::try_from(touched).unwrap_or(0),
                    job,
                });
            }
        }
        Ok(out)
    }

    async fn forget(&self, idle: &IdleJob) -> Result<bool, StoreError> {
        let client = self.pool.get().await.map_err(io)?;
        let touched = i64::try_from(idle.touched_ms).unwrap_or(i64::MAX);
        let n = client
            .execute(
                &format!(
                    "DELETE FROM {} WHERE job = $1 AND touched_ms = $2",
                    self.tables.generations
                ),
                &[&idle.job.as_str(), &touched],
            )
            .await
            .map_err(io)?;
        Ok(n == 1)
    }
}

/// The database's clock plus the offset parameter `$N` (0 outside the fault tests).
fn now_ms(offset_param: usize) -> String {
    format!("({NOW_MS} + ${offset_param}::bigint)")
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl IdempotencyStore for PgStore {
    async fn begin(&self, attempt: Attempt<'_>, in_flight: Duration) -> Result<Begin, StoreError> {
        let client = self.pool.get().await.map_err(io)?;
        let t = &self.tables.idempotency;
        let record = Record::InFlight {
            fingerprint: *attempt.fingerprint,
            until_ms: 0,
        }
        .encode();
        // One statement decides: a new record, or one that is no longer live, is taken over.
        let started = client
            .query_opt(
                &format!(
                    "INSERT INTO {t} AS i (job, key, fingerprint, in_flight, record, live_until_ms)
                     VALUES ($1, $2, $3, true, $4, {now} + $5::bigint)
                     ON CONFLICT (job, key) DO UPDATE SET fingerprint = excluded.fingerprint, in_flight = true,
                       record = excluded.record, live_until_ms = excluded.live_until_ms
                     WHERE i.live_until_ms <= {now}
                     RETURNING 1",
                    now = now_ms(6)
                ),
                &[
                    &attempt.job.as_str(),
                    &attempt.key.as_str(),
                    &&attempt.fingerprint.0[..],
                    &record,
                    &ms(in_flight),
                    &self.offset(),
                ],
            )
            .await
            .map_err(io)?;
        if started.is_some() {
            return Ok(Begin::Started);
        }
        let row = client
            .query_opt(
                &format!("SELECT record FROM {t} WHERE job = $1 AND key = $2"),
                &[&attempt.job.as_str(), &attempt.key.as_str()],
            )
            .await
            .map_err(io)?;
        let Some(row) = row else {
            // Deleted in between (a forgotten 5xx): the next attempt starts it.
            return Ok(Begin::InFlight);
        };
        let bytes: Vec<u8> = row.try_get(0).map_err(io)?;
        let record = Record::decode(&bytes).map_err(|reason| StoreError::Corrupt {
            job: attempt.job.clone(),
            reason,
        })?;
        Ok(if record.fingerprint() != attempt.fingerprint {
            Begin::Mismatch
        } else {
            match record {
                Record::InFlight { .. } => Begin::InFlight,
                Record::Done {
                    response: Some(r), ..
                } => Begin::Replay(r),
                Record::Done { response: None, .. } => Begin::NotReplayable,
            }
        })
    }

    async fn finish(&self, attempt: Attempt<'_>, outcome: Finish) -> Result<(), StoreError> {
        let client = self.pool.get().await.map_err(io)?;
        let t = &self.tables.idempotency;
        let mine = "job = $1 AND key = $2 AND fingerprint = $3 AND in_flight";
        let (job_s, key_s, fp_s) = (
            attempt.job.as_str(),
            attempt.key.as_str(),
            &attempt.fingerprint.0[..],
        );
        let response = match outcome {
            Finish::Forget => {
                client
                    .execute(
                        &format!("DELETE FROM {t} WHERE {mine}"),
                        &[&job_s, &key_s, &fp_s],
                    )
                    .await
                    .map_err(io)?;
                return Ok(());
            }
            Finish::Store {
                response,
                retention,
            } => (Some(response), retention),
            Finish::TooLarge { retention } => (None, retention),
        };
        let (response, retention) = response;
        let record = Record::Done {
            fingerprint: *attempt.fingerprint,
            expires_ms: 0,
            response,
        }
        .encode();
        client
            .execute(
                &format!(
                    "UPDATE {t} SET in_flight = false, record = $4, live_until_ms = {now} + $5::bigint WHERE {mine}",
                    now = now_ms(6)
                ),
                &[&job_s, &key_s, &fp_s, &record, &ms(retention), &self.offset()],
            )
            .await
            .map_err(io)?;
        Ok(())
    }

    async fn purge_expired(&self) -> Result<usize, StoreError> {
        let client = self.pool.get().await.map_err(io)?;
        let n = client
            .execute(
                &format!(
                    "DELETE FROM {} WHERE live_until_ms <= {}",
                    self.tables.idempotency,
                    now_ms(1)
                ),
                &[&self.offset()],
            )
            .await
            .map_err(io)?;
        Ok(usize::try_from(n).unwrap_or(usize::MAX))
    }
}

#[cfg(test)]
mod tests;
