//! Leases in PostgreSQL, shared by every process that uses the same table. Every decision is
//! one SQL statement, and the database's clock (`clock_timestamp()`) decides expiry.

use std::{
    sync::{
        Arc,
        atomic::{AtomicI64, Ordering},
    },
    time::Duration,
};

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use fence_core::{Generation, JobId, Owner};
use tokio_postgres::{NoTls, Row};

use super::{
    ClaimOutcome, FinishOutcome, Grant, LeaseRecord, LeaseState, LeaseStore, RenewOutcome,
    StoreError,
};
use crate::Ttl;

/// Where the lease table lives: `schema.table`, both plain lower-case SQL identifiers.
#[derive(Debug, Clone)]
pub struct PgTable {
    schema: String,
    table: String,
}

impl Default for PgTable {
    /// `fence.leases`.
    fn default() -> Self {
        Self {
            schema: "fence".into(),
            table: "leases".into(),
        }
    }
}

impl PgTable {
    /// `schema.table`.
    ///
    /// # Errors
    /// When either is not 1 to 63 characters of `a-z`, `0-9` and `_`, starting with a letter
    /// or `_` (so it never needs quoting and cannot inject SQL).
    pub fn new(schema: &str, table: &str) -> Result<Self, StoreError> {
        for (what, name) in [("schema", schema), ("table", table)] {
            let ok = !name.is_empty()
                && name.len() <= 63
                && name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
                && !name.as_bytes()[0].is_ascii_digit();
            if !ok {
                return Err(StoreError::Protocol(format!(
                    "invalid {what} name {name:?}: use 1 to 63 of a-z, 0-9 and _, not starting with a digit"
                )));
            }
        }
        Ok(Self {
            schema: schema.into(),
            table: table.into(),
        })
    }

    fn qualified(&self) -> String {
        format!("{}.{}", self.schema, self.table)
    }
}

/// The lease store in PostgreSQL.
///
/// ```no_run
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use fence_lease::{LeaseClient, PgLeaseStore, PgTable};
///
/// let store = PgLeaseStore::connect("postgres://postgres@127.0.0.1/test", PgTable::default()).await?;
/// store.migrate().await?;
/// let lease = LeaseClient::new(store).claim("invoice-42".parse()?).await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PgLeaseStore {
    pool: Pool,
    table: PgTable,
    sql: Arc<Sql>,
    offset_ms: Arc<AtomicI64>,
}

impl std::fmt::Debug for PgLeaseStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgLeaseStore")
            .field("table", &self.table.qualified())
            .finish_non_exhaustive()
    }
}

struct Sql {
    claim: String,
    renew: String,
    release: String,
    complete: String,
    get: String,
}

/// The database's clock in ms since the Unix epoch, shifted by the test-only offset `$N`.
fn now_ms(offset_param: usize) -> String {
    format!(
        "((floor(extract(epoch from clock_timestamp()) * 1000))::bigint + ${offset_param}::bigint)"
    )
}

impl Sql {
    fn new(t: &str) -> Self {
        // $1 job, $2 owner, $3 ttl_ms, $4 clock offset.
        let claim = format!(
            "INSERT INTO {t} AS t (job, owner, generation, lease_until_ms, completed)
             VALUES ($1, $2, 1, {now} + $3::bigint, false)
             ON CONFLICT (job) DO UPDATE SET
               generation = CASE WHEN t.owner = excluded.owner AND t.lease_until_ms > excluded.lease_until_ms - $3::bigint
                            THEN t.generation ELSE t.generation + 1 END,
               owner = excluded.owner,
               lease_until_ms = excluded.lease_until_ms
             WHERE NOT t.completed
               AND (t.owner IS NULL OR t.owner = excluded.owner OR t.lease_until_ms <= excluded.lease_until_ms - $3::bigint)
             RETURNING t.generation::text, t.lease_until_ms",
            now = now_ms(4)
        );
        // $1 job, $2 owner, $3 generation, $4 ttl_ms, $5 clock offset.
        let renew = format!(
            "UPDATE {t} SET lease_until_ms = {now} + $4::bigint
             WHERE job = $1 AND owner = $2 AND generation = $3::text::numeric AND NOT completed
             RETURNING lease_until_ms",
            now = now_ms(5)
        );
        // $1 job, $2 owner, $3 generation, $4 clock offset; returns the row as `get` does.
        let returning = format!(
            "RETURNING owner, generation::text, lease_until_ms, completed, {}",
            now_ms(4)
        );
        let release = format!(
            "UPDATE {t} SET owner = NULL, lease_until_ms = 0
             WHERE job = $1 AND owner = $2 AND generation = $3::text::numeric AND NOT completed
             {returning}"
        );
        let complete = format!(
            "UPDATE {t} SET completed = true
             WHERE job = $1 AND owner = $2 AND generation = $3::text::numeric AND NOT completed
             {returning}"
        );
        // $1 job, $2 clock offset.
        let get = format!(
            "SELECT owner, generation::text, lease_until_ms, completed, {now} FROM {t} WHERE job = $1",
            now = now_ms(2)
        );
        Self {
            claim,
            renew,
            release,
            complete,
            get,
        }
    }
}

fn io(e: impl std::error::Error + Send + Sync + 'static) -> StoreError {
    StoreError::Io(Box::new(e))
}

fn generation(row: &Row, idx: usize) -> Result<Generation, StoreError> {
    let text: String = row.try_get(idx).map_err(io)?;
    text.parse::<u64>()
        .map(Generation::new)
        .map_err(|_| StoreError::Protocol(format!("generation {text:?} out of range")))
}

/// A job's row as read by `get`, with the database's now.
struct Snapshot {
    owner: Option<Owner>,
    generation: Generation,
    until_ms: i64,
    completed: bool,
    now_ms: i64,
}

impl Snapshot {
    /// Columns: owner, generation::text, lease_until_ms, completed, now_ms.
    fn from_row(r: &Row) -> Result<Self, StoreError> {
        let owner: Option<String> = r.try_get(0).map_err(io)?;
        let owner = owner
            .map(Owner::new)
            .transpose()
            .map_err(|e| StoreError::Protocol(format!("stored owner: {e}")))?;
        Ok(Self {
            owner,
            generation: generation(r, 1)?,
            until_ms: r.try_get(2).map_err(io)?,
            completed: r.try_get(3).map_err(io)?,
            now_ms: r.try_get(4).map_err(io)?,
        })
    }

    fn state(&self) -> LeaseState {
        if self.completed {
            LeaseState::Completed
        } else if self.owner.is_none() {
            LeaseState::Free
        } else if self.now_ms < self.until_ms {
            LeaseState::Held
        } else {
            LeaseState::Expired
        }
    }

    fn record(self, job: &JobId) -> LeaseRecord {
        let state = self.state();
        let expires_in = match state {
            LeaseState::Held => {
                Duration::from_millis(u64::try_from(self.until_ms - self.now_ms).unwrap_or(0))
            }
            _ => Duration::ZERO,
        };
        LeaseRecord {
            job: job.clone(),
            owner: self.owner,
            generation: self.generation,
            state,
            expires_in,
        }
    }
}

impl PgLeaseStore {
    /// Connects a pool (up to 16 connections) to the database at `url`
    /// (`postgres://user@host:port/db`). Call [`migrate`](Self::migrate) once before use.
    ///
    /// # Errors
    /// When `url` is not a valid connection string.
    pub async fn connect(url: &str, table: PgTable) -> Result<Self, StoreError> {
        let config: tokio_postgres::Config = url.parse().map_err(io)?;
        let manager = Manager::from_config(
            config,
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(16)
            .wait_timeout(Some(Duration::from_secs(10)))
            .create_timeout(Some(Duration::from_secs(10)))
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .build()
            .map_err(io)?;
        let sql = Arc::new(Sql::new(&table.qualified()));
        Ok(Self {
            pool,
            table,
            sql,
            offset_ms: Arc::default(),
        })
    }

    /// Creates the schema and table if they do not exist. Safe to run any number of times,
    /// from any number of processes at once.
    ///
    /// # Errors
    /// When the database cannot be reached or refuses the DDL.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let client = self.pool.get().await.map_err(io)?;
        let t = self.table.qualified();
        let ddl = format!(
            "SELECT pg_advisory_xact_lock(hashtext('fence-migrate:{schema}'));
             CREATE SCHEMA IF NOT EXISTS {schema};
             CREATE TABLE IF NOT EXISTS {t} (
               job text PRIMARY KEY,
               owner text,
               generation numeric(20, 0) NOT NULL CHECK (generation >= 0 AND generation <= 18446744073709551615),
               lease_until_ms bigint NOT NULL,
               completed boolean NOT NULL DEFAULT false
             );",
            schema = self.table.schema
        );
        // One transaction, serialised by an advisory lock: concurrent migrations do not race
        // on CREATE ... IF NOT EXISTS.
        client
            .batch_execute(&format!("BEGIN; {ddl} COMMIT;"))
            .await
            .map_err(io)
    }

    /// Test only: shifts the database clock as this store reads it by `ms` (cumulative).
    pub fn shift_clock_ms(&self, ms: i64) {
        self.offset_ms.fetch_add(ms, Ordering::SeqCst);
    }

    fn offset(&self) -> i64 {
        self.offset_ms.load(Ordering::SeqCst)
    }

    async fn snapshot(&self, job: &JobId) -> Result<Option<Snapshot>, StoreError> {
        let client = self.pool.get().await.map_err(io)?;
        let row = client
            .query_opt(&self.sql.get, &[&job.as_str(), &self.offset()])
            .await
            .map_err(io)?;
        row.as_ref().map(Snapshot::from_row).transpose()
    }

    async fn lost(&self, job: &JobId) -> Result<(Option<Owner>, Generation), StoreError> {
        Ok(self
            .snapshot(job)
            .await?
            .map_or((None, Generation::ZERO), |s| (s.owner, s.generation)))
    }

    async fn finish(
        &self,
        job: &JobId,
        owner: &Owner,
        g: Generation,
        complete: bool,
    ) -> Result<FinishOutcome, StoreError> {
        let sql = if complete {
            &self.sql.complete
        } else {
            &self.sql.release
        };
        let client = self.pool.get().await.map_err(io)?;
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] = [
            &job.as_str(),
            &owner.as_str(),
            &g.get().to_string(),
            &self.offset(),
        ];
        let done = client.query_opt(sql, &params).await.map_err(io)?;
        drop(client);
        match done {
            Some(row) => Ok(FinishOutcome::Done(Snapshot::from_row(&row)?.record(job))),
            None => {
                let (owner, generation) = self.lost(job).await?;
                Ok(FinishOutcome::Lost { owner, generation })
            }
        }
    }
}

impl LeaseStore for PgLeaseStore {
    async fn claim(
        &self,
        job: &JobId,
        owner: &Owner,
        ttl: Ttl,
    ) -> Result<ClaimOutcome, StoreError> {
        let ttl_ms = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX);
        loop {
            let client = self.pool.get().await.map_err(io)?;
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] =
                [&job.as_str(), &owner.as_str(), &ttl_ms, &self.offset()];
            if let Some(row) = client
                .query_opt(&self.sql.claim, &params)
                .await
                .map_err(io)?
            {
                let until: i64 = row.try_get(1).map_err(io)?;
                let expires_at_ms = u64::try_from(until).unwrap_or(0);
                return Ok(ClaimOutcome::Granted(Grant {
                    generation: generation(&row, 0)?,
                    ttl,
                    expires_at_ms,
                    token: None,
                }));
            }
            drop(client);
            // Refused; read why. If the holder let go in between, decide again.
            match self.snapshot(job).await? {
                Some(s) if s.completed => {
                    return Ok(ClaimOutcome::Completed {
                        owner: s.owner,
                        generation: s.generation,
                    });
                }
                Some(s) if s.state() == LeaseState::Held => {
                    let expires_in =
                        Duration::from_millis(u64::try_from(s.until_ms - s.now_ms).unwrap_or(0));
                    let holder = s.owner.expect("held implies an owner");
                    return Ok(ClaimOutcome::Held {
                        owner: holder,
                        expires_in,
                    });
                }
                _ => continue,
            }
        }
    }

    async fn renew(
        &self,
        job: &JobId,
        owner: &Owner,
        g: Generation,
        ttl: Ttl,
    ) -> Result<RenewOutcome, StoreError> {
        let ttl_ms = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX);
        let client = self.pool.get().await.map_err(io)?;
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] = [
            &job.as_str(),
            &owner.as_str(),
            &g.get().to_string(),
            &ttl_ms,
            &self.offset(),
        ];
        match client
            .query_opt(&self.sql.renew, &params)
            .await
            .map_err(io)?
        {
            Some(row) => {
                let until: i64 = row.try_get(0).map_err(io)?;
                Ok(RenewOutcome::Renewed(Grant {
                    generation: g,
                    ttl,
                    expires_at_ms: u64::try_from(until).unwrap_or(0),
                    token: None,
                }))
            }
            None => {
                drop(client);
                let (owner, generation) = self.lost(job).await?;
                Ok(RenewOutcome::Lost { owner, generation })
            }
        }
    }

    async fn release(
        &self,
        job: &JobId,
        owner: &Owner,
        g: Generation,
    ) -> Result<FinishOutcome, StoreError> {
        self.finish(job, owner, g, false).await
    }

    async fn complete(
        &self,
        job: &JobId,
        owner: &Owner,
        g: Generation,
    ) -> Result<FinishOutcome, StoreError> {
        self.finish(job, owner, g, true).await
    }

    async fn get(&self, job: &JobId) -> Result<Option<LeaseRecord>, StoreError> {
        Ok(self.snapshot(job).await?.map(|s| s.record(job)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store on a table of its own, so parallel tests do not share jobs.
    async fn fresh() -> Option<PgLeaseStore> {
        let Ok(url) = std::env::var("DATABASE_URL") else {
            println!(
                "skipped: DATABASE_URL not set (run ../shared/services.sh postgres to get one)"
            );
            return None;
        };
        let table =
            PgTable::new("fence_test", &format!("leases_{:016x}", fastrand::u64(..))).unwrap();
        let store = PgLeaseStore::connect(&url, table).await.unwrap();
        store.migrate().await.unwrap();
        Some(store)
    }

    crate::lease_store_conformance!(|| async {
        let store = fresh().await?;
        let shifter = store.clone();
        let advance: crate::conformance::Advance = Box::new(move |d: Duration| {
            shifter.shift_clock_ms(i64::try_from(d.as_millis()).unwrap())
        });
        Some((store, advance))
    });

    #[test]
    fn table_names_are_checked() {
        assert!(PgTable::new("fence", "leases").is_ok());
        for (s, t) in [
            ("", "x"),
            ("Fence", "x"),
            ("fence", "x;drop"),
            ("fence", "1x"),
            ("a.b", "x"),
        ] {
            assert!(PgTable::new(s, t).is_err(), "{s}.{t}");
        }
    }

    #[tokio::test]
    async fn migrate_is_idempotent_and_generations_never_reset() {
        let Some(store) = fresh().await else { return };
        store.migrate().await.unwrap();
        let (j, a) = ("j".parse().unwrap(), "a".parse().unwrap());
        let ClaimOutcome::Granted(g) = store.claim(&j, &a, Ttl::DEFAULT).await.unwrap() else {
            panic!()
        };
        store.complete(&j, &a, g.generation).await.unwrap();
        store.migrate().await.unwrap();
        let rec = store.get(&j).await.unwrap().unwrap();
        assert_eq!(
            (rec.generation, rec.state),
            (Generation::new(1), LeaseState::Completed)
        );
    }
}
