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
use fence_storage::postgres::{Checkout, Ident, IdentError, MigrateError, NOW_MS, SetupError};
use tokio_postgres::GenericClient;

use super::{
    Attempt, Begin, Finish, GenerationStore, IdempotencyStore, IdleJob, IdlePage, Loaded,
    STAMP_AHEAD_MS, StoreError, Verdict,
};

/// Where the tables live: `schema.prefix_generations` and `schema.prefix_idempotency`.
#[derive(Debug, Clone)]
pub struct PgTables {
    generations: String,
    idempotency: String,
    schema: Ident,
    /// The SQL fence's functions: `schema.observe` and `schema.require` for the default
    /// prefix `sink`, `schema.{prefix}_observe` and `schema.{prefix}_require` for another;
    /// and the decision both share, `schema.{prefix}_accept`, which writers are not granted.
    observe_fn: String,
    require_fn: String,
    accept_fn: String,
    /// One row: whether the sinks on these tables forget idle jobs, and their clock skew.
    settings: String,
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
            accept_fn: table("accept")?,
            settings: table("settings")?,
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
    /// Set once this process has recorded, before its first delete, that the sinks on these
    /// tables forget idle jobs.
    forgetting: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Where the index the purge uses stands, as this process knows (see `purge.rs`).
    expiry_index: std::sync::Arc<std::sync::atomic::AtomicU8>,
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
/// It calls the SQL fence's functions (section 11 of docs/protocol.md), so the role needs
/// what a writer is granted, plus `SELECT` on the table to name the highest when stale.
/// While the sinks on these tables forget idle jobs, the function refuses a check without
/// the token's lease end (SQLSTATE `ZF428`): use [`check_in_transaction_expiring`].
///
/// # Errors
/// When a statement fails.
pub async fn check_in_transaction(
    client: &impl GenericClient,
    tables: &PgTables,
    job: &JobId,
    token: Generation,
) -> Result<Verdict, StoreError> {
    let accepted: bool = client
        .query_one(
            &format!("SELECT {}($1, $2::text::numeric)", tables.observe_fn),
            &[&job.as_str(), &token.get().to_string()],
        )
        .await
        .map_err(io)?
        .try_get(0)
        .map_err(io)?;
    verdict(client, tables, job, accepted).await
}

/// [`check_in_transaction`] for a signed token: also stale (the function returns false)
/// when its lease ended at `expires_at_ms` longer than the sinks' clock skew ago, by the
/// database's clock. The form to use while sinks forget idle jobs.
///
/// # Errors
/// When a statement fails.
pub async fn check_in_transaction_expiring(
    client: &impl GenericClient,
    tables: &PgTables,
    job: &JobId,
    token: Generation,
    expires_at_ms: u64,
) -> Result<Verdict, StoreError> {
    let expires = i64::try_from(expires_at_ms).unwrap_or(i64::MAX);
    let accepted: bool = client
        .query_one(
            &format!(
                "SELECT {}($1, $2::text::numeric, $3::bigint)",
                tables.observe_fn
            ),
            &[&job.as_str(), &token.get().to_string(), &expires],
        )
        .await
        .map_err(io)?
        .try_get(0)
        .map_err(io)?;
    verdict(client, tables, job, accepted).await
}

/// Accepted, or stale with the highest stored.
async fn verdict(
    client: &impl GenericClient,
    tables: &PgTables,
    job: &JobId,
    accepted: bool,
) -> Result<Verdict, StoreError> {
    if accepted {
        return Ok(Verdict::Accepted);
    }
    // Forgotten (no row, 0): an expired token of a job nobody holds.
    let highest = read_highest(client, tables, job).await?;
    Ok(Verdict::Stale { highest })
}

/// The highest generation stored for `job` (0 when it has no row).
async fn read_highest(
    client: &impl GenericClient,
    tables: &PgTables,
    job: &JobId,
) -> Result<Generation, StoreError> {
    let row = client
        .query_opt(
            &format!(
                "SELECT highest::text FROM {} WHERE job = $1",
                tables.generations
            ),
            &[&job.as_str()],
        )
        .await
        .map_err(io)?;
    match row {
        None => Ok(Generation::ZERO),
        Some(row) => parse_highest(job, &row.try_get::<_, String>(0).map_err(io)?),
    }
}

/// A `highest` read as text (numeric(20, 0) does not fit a bigint).
fn parse_highest(job: &JobId, text: &str) -> Result<Generation, StoreError> {
    text.parse()
        .map(Generation::new)
        .map_err(|_| StoreError::Corrupt {
            job: job.clone(),
            reason: "highest out of range",
        })
}

/// The store's own decision (the proxy's and the layer's; they checked the token's expiry
/// themselves): the table, directly, as the functions do.
async fn decide(
    client: &impl GenericClient,
    tables: &PgTables,
    job: &JobId,
    token: Generation,
) -> Result<Verdict, StoreError> {
    let t = &tables.generations;
    let now = fence_storage::postgres::NOW_MS;
    // Lower than what is committed: stale, answered from a plain read, so a stale check
    // neither waits for the row lock of the current holder's open transaction (an SQL writer
    // between `require` and its commit) nor takes it (highest only rises; a forgotten job's
    // row held expired tokens only). Otherwise raised, or equal with less than half of its
    // stamp ahead left: (re)stamped ahead of the database's clock (a raise also records its
    // time). Equal and stamped lately: nothing written. One statement either way.
    let row = client
        .query_one(
            &format!(
                "WITH cur AS (SELECT highest FROM {t} WHERE job = $1),
                 bumped AS (
                   INSERT INTO {t} AS g (job, highest, touched_ms, raised_ms)
                     SELECT $1, $2::text::numeric, {now} + {STAMP_AHEAD_MS}, {now}
                     WHERE NOT EXISTS (SELECT 1 FROM cur WHERE highest > $2::text::numeric)
                   ON CONFLICT (job) DO UPDATE SET highest = excluded.highest, touched_ms = excluded.touched_ms,
                     raised_ms = CASE WHEN g.highest < excluded.highest THEN excluded.raised_ms ELSE g.raised_ms END
                   WHERE g.highest < excluded.highest
                      OR (g.highest = excluded.highest AND g.touched_ms < excluded.touched_ms - {half})
                   RETURNING 1)
                 SELECT EXISTS (SELECT 1 FROM bumped), (SELECT highest::text FROM cur)",
                half = STAMP_AHEAD_MS / 2
            ),
            &[&job.as_str(), &token.get().to_string()],
        )
        .await
        .map_err(io)?;
    if row.try_get::<_, bool>(0).map_err(io)? {
        return Ok(Verdict::Accepted);
    }
    if let Some(read) = row.try_get::<_, Option<String>>(1).map_err(io)? {
        let highest = parse_highest(job, &read)?;
        if highest > token {
            return Ok(Verdict::Stale { highest });
        }
    }
    // Not raised: equal (accepted; lock the row for the rest of a transaction), or raised by
    // another since the read (stale).
    let row = client
        .query_one(
            &format!("SELECT highest::text FROM {t} WHERE job = $1 FOR SHARE"),
            &[&job.as_str()],
        )
        .await
        .map_err(io)?;
    let highest = parse_highest(job, &row.try_get::<_, String>(0).map_err(io)?)?;
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
            forgetting: std::sync::Arc::default(),
            expiry_index: std::sync::Arc::default(),
            #[cfg(any(test, feature = "test-hooks"))]
            offset_ms: std::sync::Arc::default(),
        })
    }

    /// Test hook (feature `test-hooks`): shifts the database clock, as this store reads it
    /// for idempotency records and idle jobs, by `ms` (cumulative).
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
        let ddl = schema::ddl(&self.tables);
        fence_storage::postgres::migrate(&self.pool, &self.tables.schema, &ddl).await
    }
}

impl GenerationStore for PgStore {
    async fn observe(&self, job: &JobId, token: Generation) -> Result<Verdict, StoreError> {
        let client = Checkout::of(&self.pool).await.map_err(io)?;
        let verdict = decide(&***client, &self.tables, job, token).await;
        client.done();
        verdict
    }

    async fn highest(&self, job: &JobId) -> Result<Generation, StoreError> {
        let client = Checkout::of(&self.pool).await.map_err(io)?;
        let highest = read_highest(&***client, &self.tables, job).await;
        client.done();
        highest
    }

    /// No stamps: proxies on one database cannot tell a crashed process's admissions from a
    /// live one's, and a live proxy's are not waited for either (docs/protocol.md section 5).
    /// On PostgreSQL the order of effects across proxies and across their restarts is kept
    /// by `require` in the effect's own transaction. (The stamps are still written: they
    /// bound forgetting.)
    async fn load(&self, job: &JobId) -> Result<Loaded, StoreError> {
        Ok(Loaded::new(self.highest(job).await?))
    }

    /// See [`load`](Self::load): no stamps, so forgetting has no restart hold to wait for.
    fn loads_stamps(&self) -> bool {
        false
    }

    fn is_shared(&self) -> bool {
        true
    }

    async fn idle(&self, page: IdlePage<'_>) -> Result<Vec<IdleJob>, StoreError> {
        let client = Checkout::of(&self.pool).await.map_err(io)?;
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
                     WHERE touched_ms < {now} - $1 AND (touched_ms, job) > ($2, $3)
                     ORDER BY touched_ms, job LIMIT $4",
                    now = now_ms(5)
                ),
                &[&idle_ms, &after_ms, &after_job, &limit, &self.offset()],
            )
            .await;
        client.done();
        let rows = rows.map_err(io)?;
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

    async fn forgetting_within(
        &self,
        clock_skew: Duration,
        max_lease_ttl: Duration,
    ) -> Result<(), StoreError> {
        self.announce_forgetting(true, clock_skew, max_lease_ttl)
            .await
            .map(drop)
    }

    async fn forget(&self, idle: &IdleJob) -> Result<bool, StoreError> {
        self.forgetting_recorded().await?;
        let client = Checkout::of(&self.pool).await.map_err(io)?;
        let touched = i64::try_from(idle.touched_ms).unwrap_or(i64::MAX);
        let n = client
            .execute(
                // Not a row a writer's transaction holds locked (a current token's check
                // locks its row until the writer commits): waiting for it would fail the
                // whole pass at the lock timeout, pass after pass, and no job would be forgotten.
                &format!(
                    "DELETE FROM {t} WHERE job IN \
                     (SELECT job FROM {t} WHERE job = $1 AND touched_ms = $2 FOR UPDATE SKIP LOCKED)",
                    t = self.tables.generations
                ),
                &[&idle.job.as_str(), &touched],
            )
            .await;
        client.done();
        Ok(n.map_err(io)? == 1)
    }
}

/// The database's clock plus the offset parameter `$N` (0 outside the fault tests).
fn now_ms(offset_param: usize) -> String {
    format!("({NOW_MS} + ${offset_param}::bigint)")
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// An attempt id as the `bigint` column keeps it (the same 64 bits).
fn signed(id: u64) -> i64 {
    i64::from_be_bytes(id.to_be_bytes())
}

impl IdempotencyStore for PgStore {
    async fn begin(&self, attempt: Attempt<'_>, in_flight: Duration) -> Result<Begin, StoreError> {
        let client = Checkout::of(&self.pool).await.map_err(io)?;
        let begun = self.begin_on(&client, attempt, in_flight).await;
        client.done();
        begun
    }

    async fn finish(&self, attempt: Attempt<'_>, outcome: Finish) -> Result<(), StoreError> {
        let client = Checkout::of(&self.pool).await.map_err(io)?;
        let finished = self.finish_on(&client, attempt, outcome).await;
        client.done();
        finished
    }

    /// In batches, through an index on their expiry that the first purge builds (`purge.rs`).
    async fn purge_expired(&self) -> Result<usize, StoreError> {
        self.purge().await
    }
}

#[cfg(test)]
mod forget_tests;
mod idempotency;
#[cfg(test)]
mod lock_tests;
mod purge;
mod schema;
mod settings;
pub use settings::SinkSettings;
#[cfg(test)]
mod tests;
