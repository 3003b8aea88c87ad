//! Leases in PostgreSQL, shared by every process that uses the same table.
//!
//! Every decision is one SQL statement, and the database's clock (`clock_timestamp()`)
//! decides expiry.
//!
//! Forgetting (contract section 8) keeps the durable floor in the table itself, as the row of
//! the job `''` (no job id is empty, and listing starts after it). A claim reads the floor
//! for the generation a new row starts at, under `FOR SHARE`; forgetting locks the floor row
//! `FOR UPDATE` before it deletes anything and raises it in the same transaction. So a claim
//! either runs before a forgetting transaction (and the job's row is still there to update,
//! or the forgetting skips it as changed) or waits for it and reads the raised floor: no
//! claim, on any server sharing the table, starts a job at or below a generation it had.

use std::{sync::Arc, time::Duration};

use deadpool_postgres::Pool;
use fence_core::{
    Generation, JobId, Owner, Ttl,
    lease_api::{LeaseState, ListQuery},
    secret::LeaseKey,
};
use fence_storage::postgres::{Checkout, Ident, IdentError, MigrateError, NOW_MS, SetupError};
use tokio_postgres::{Row, types::ToSql};

use self::deadline::{ended, within};
use super::{
    ClaimTerms, Grant, LeaseOp, LeaseRecord, LeaseStore, ListPage, Outcome, SlotClaim, StoreError,
};

/// Where the lease table lives: `schema.table`, both plain lower-case SQL identifiers.
#[derive(Debug, Clone)]
pub struct PgTable {
    schema: Ident,
    table: Ident,
}

impl Default for PgTable {
    /// `fence.leases`.
    fn default() -> Self {
        Self::new("fence", "leases").expect("valid names")
    }
}

impl PgTable {
    /// `schema.table`.
    ///
    /// # Errors
    /// When either is not 1 to 63 characters of `a-z`, `0-9` and `_`, starting with a letter
    /// or `_` (so it never needs quoting and cannot inject SQL).
    pub fn new(schema: &str, table: &str) -> Result<Self, IdentError> {
        Ok(Self {
            schema: Ident::new("schema", schema)?,
            table: Ident::new("table", table)?,
        })
    }

    fn qualified(&self) -> String {
        format!("{}.{}", self.schema, self.table)
    }

    /// The channel servers on this table notify when they let a job go (payload: the job id)
    /// and listen on ([`fence_storage::postgres::channel_name`] of `schema.table`).
    #[must_use]
    pub fn channel(&self) -> String {
        fence_storage::postgres::channel_name(&self.qualified())
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
    /// The connection string, for the session that listens for other servers' changes.
    url: Arc<str>,
    /// That session, started by the first [`LeaseStore::changes`].
    listener: Arc<std::sync::OnceLock<Option<fence_storage::postgres::Listener>>>,
    /// Semaphore claims take their resource's turn here before a pooled connection (see
    /// `slots`).
    slot_turns: Arc<slots::Turns>,
    /// How long one statement is waited for (see `deadline`).
    statement_deadline: Duration,
    #[cfg(any(test, feature = "test-hooks"))]
    offset_ms: Arc<std::sync::atomic::AtomicI64>,
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
    claim_refused: String,
    checkpoint: String,
    lock_floor: String,
    forget: String,
    renew: String,
    release: String,
    complete: String,
    revoke: String,
    get: String,
    list: String,
    slots: slots::SlotSql,
}

/// The database's clock in ms since the Unix epoch, plus the offset parameter `$N` (always
/// 0 but in the fault tests, which shift it).
fn now_ms(offset_param: usize) -> String {
    format!("({NOW_MS} + ${offset_param}::bigint)")
}

/// `pg_notify` on `channel` with the job column `job` as payload, skipped while the
/// database's notification queue is half full. PostgreSQL keeps a notification until every
/// listening session has read it, and a NOTIFY fails at commit once the queue is full: one
/// server frozen with its session open (SIGSTOP, a paused container) would in time make every
/// release, completion and revoke on every server fail. Skipped, the waiters on other servers
/// find the job at their backstop look instead (2 s, longer with many jobs waited for).
fn notify(channel: &str, job: &str) -> String {
    format!("CASE WHEN pg_notification_queue_usage() < 0.5 THEN pg_notify('{channel}', {job}) END")
}

impl Sql {
    fn new(t: &str, channel: &str) -> Self {
        // Renew, release and complete need owner, generation and key: $1 job, $2 owner,
        // $3 generation, then their own parameters.
        let holder = "job = $1 AND owner = $2 AND generation = $3::text::numeric AND NOT completed";
        // $4 ttl_ms, $5 clock offset, $6 key hash. Never earlier than the end already
        // granted (a holder whose renewal's answer is lost keeps its last grant's deadline).
        let renew = format!(
            "UPDATE {t} SET lease_until_ms = GREATEST(lease_until_ms, {now} + $4::bigint),
                 changed_ms = {now}
             WHERE {holder} AND key_hash = $6
             RETURNING lease_until_ms",
            now = now_ms(5)
        );
        // $4 clock offset, $5 key hash; returns the row as `get` does.
        // The channel is `[a-z0-9_.]` (PgTable's names, or a hash): safe as a literal.
        let returning = format!(
            "RETURNING owner, generation::text, lease_until_ms, completed, {now}, {notify}",
            now = now_ms(4),
            notify = notify(channel, "job"),
        );
        let release = format!(
            "UPDATE {t} SET owner = NULL, lease_until_ms = 0, changed_ms = {now}
             WHERE {holder} AND key_hash = $5
             {returning}",
            now = now_ms(4)
        );
        // A semaphore's slot (slots > 0) is released instead: never completed (section 15).
        let complete = format!(
            "UPDATE {t} SET completed = (slots = 0), changed_ms = {now},
               owner = CASE WHEN slots = 0 THEN owner END,
               lease_until_ms = CASE WHEN slots = 0 THEN LEAST(lease_until_ms, {now}) ELSE 0 END
             WHERE {holder} AND key_hash = $5
             {returning}",
            now = now_ms(4)
        );
        // $1 after (exclusive), $2 prefix, $3 how many, $4 clock offset. `starts_with` and the
        // byte order of "C" collation match the order sled and the memory store list in.
        let list = format!(
            "SELECT owner, generation::text, lease_until_ms, completed, {now}, job FROM {t}
             WHERE job COLLATE \"C\" > $1 AND starts_with(job, $2)
             ORDER BY job COLLATE \"C\" LIMIT $3",
            now = now_ms(4)
        );
        // $1 job, $2 clock offset.
        let get = format!(
            "SELECT owner, generation::text, lease_until_ms, completed, {now} FROM {t} WHERE job = $1",
            now = now_ms(2)
        );
        // Forgetting, in a transaction that has locked the floor row first (`lock_floor`):
        // $1 idle ms, $2 how many, $3 clock offset. Rows unchanged for $1 whose lease ended
        // at least $1 ago (so none is held) go, oldest first, and the floor rises to the
        // highest generation among them. Rows a claim holds locked are skipped, and a row a
        // claim changed meanwhile fails the outer condition when it is checked again.
        let lock_floor = format!("SELECT 1 FROM {t} WHERE job = '' FOR UPDATE");
        // A row at the last generation is never forgotten: the floor would rise there, and
        // every claim after it would break the generation's CHECK (`floor + 1`).
        let idle = format!(
            "changed_ms <= {now} - $1::bigint AND lease_until_ms <= {now} - $1::bigint
             AND (completed OR owner IS NULL OR lease_until_ms <= {now} - lock_delay_ms)
             AND generation < {last}",
            now = now_ms(3),
            last = fence_core::Generation::LAST.get(),
        );
        let forget = format!(
            "WITH gone AS (
               DELETE FROM {t} WHERE job IN (
                 SELECT job FROM {t} WHERE job <> '' AND {idle}
                 ORDER BY changed_ms LIMIT $2 FOR UPDATE SKIP LOCKED)
               AND job <> '' AND {idle}
               RETURNING generation)
             UPDATE {t} SET generation = GREATEST(generation, (SELECT max(generation) FROM gone))
             WHERE job = '' AND EXISTS (SELECT 1 FROM gone)
             RETURNING (SELECT count(*) FROM gone)"
        );
        Self {
            revoke: revoke::sql(t, channel),
            claim: claim::sql(t),
            claim_refused: claim::refused_sql(t),
            checkpoint: claim::checkpoint_sql(t, holder),
            lock_floor,
            forget,
            renew,
            release,
            complete,
            get,
            list,
            slots: slots::SlotSql::new(t),
        }
    }
}

fn generation(job: &JobId, row: &Row, idx: usize) -> Result<Generation, StoreError> {
    let text: String = row.try_get(idx).map_err(StoreError::io)?;
    text.parse::<u64>()
        .map(Generation::new)
        .map_err(|_| StoreError::Corrupt {
            job: job.clone(),
            reason: "generation out of range",
        })
}

fn millis(ttl: Ttl) -> i64 {
    i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX)
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
    fn from_row(job: &JobId, r: &Row) -> Result<Self, StoreError> {
        let owner: Option<String> = r.try_get(0).map_err(StoreError::io)?;
        let owner = owner
            .map(Owner::new)
            .transpose()
            .map_err(|_| StoreError::Corrupt {
                job: job.clone(),
                reason: "owner is not visible ASCII",
            })?;
        Ok(Self {
            owner,
            generation: generation(job, r, 1)?,
            until_ms: r.try_get(2).map_err(StoreError::io)?,
            completed: r.try_get(3).map_err(StoreError::io)?,
            now_ms: r.try_get(4).map_err(StoreError::io)?,
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

    fn expires_in(&self) -> Duration {
        Duration::from_millis(u64::try_from(self.until_ms - self.now_ms).unwrap_or(0))
    }

    fn record(self, job: &JobId) -> LeaseRecord {
        let state = self.state();
        let expires_in = match state {
            LeaseState::Held => self.expires_in(),
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

    fn lost(self) -> Outcome {
        Outcome::Lost {
            owner: self.owner,
            generation: self.generation,
        }
    }
}

impl PgLeaseStore {
    /// A pool (up to 16 connections) to the database at `url`
    /// (`postgres://user@host:port/db`). Call [`migrate`](Self::migrate) once before use.
    ///
    /// # Errors
    /// When `url` is not a valid connection string.
    pub async fn connect(url: &str, table: PgTable) -> Result<Self, SetupError> {
        let pool = fence_storage::postgres::connect_pool(url)?;
        let sql = Arc::new(Sql::new(&table.qualified(), &table.channel()));
        Ok(Self {
            pool,
            table,
            sql,
            url: url.into(),
            listener: Arc::default(),
            slot_turns: Arc::default(),
            statement_deadline: deadline::statement_deadline(
                fence_storage::postgres::session_statement_timeout(url),
            ),
            #[cfg(any(test, feature = "test-hooks"))]
            offset_ms: Arc::default(),
        })
    }

    /// Creates the schema and table if they do not exist. Safe to run any number of times,
    /// from any number of processes at once.
    ///
    /// # Errors
    /// When the database cannot be reached or refuses the DDL.
    pub async fn migrate(&self) -> Result<(), MigrateError> {
        let t = self.table.qualified();
        let ddl = format!(
            "CREATE TABLE IF NOT EXISTS {t} (
               job text COLLATE \"C\" PRIMARY KEY,
               owner text,
               generation numeric(20, 0) NOT NULL CHECK (generation >= 0 AND generation <= 18446744073709551615),
               lease_until_ms bigint NOT NULL,
               completed boolean NOT NULL DEFAULT false
             );
             ALTER TABLE {t} ADD COLUMN IF NOT EXISTS key_hash bytea NOT NULL DEFAULT ''::bytea;
             ALTER TABLE {t} ADD COLUMN IF NOT EXISTS changed_ms bigint NOT NULL DEFAULT 0;
             ALTER TABLE {t} ADD COLUMN IF NOT EXISTS lock_delay_ms bigint NOT NULL DEFAULT 0;
             ALTER TABLE {t} ADD COLUMN IF NOT EXISTS checkpoint text;
             ALTER TABLE {t} ADD COLUMN IF NOT EXISTS checkpoint_generation numeric(20, 0);
             ALTER TABLE {t} ADD COLUMN IF NOT EXISTS slots integer NOT NULL DEFAULT 0;
             INSERT INTO {t} (job, owner, generation, lease_until_ms, completed, changed_ms)
               VALUES ('', NULL, 0, 0, true, 0) ON CONFLICT (job) DO NOTHING;
             CREATE INDEX IF NOT EXISTS {table}_changed_ms ON {t} (changed_ms);",
            table = self.table.table
        );
        fence_storage::postgres::migrate(&self.pool, &self.table.schema, &ddl).await
    }

    /// Test hook (feature `test-hooks`): shifts the database clock as this store reads it by
    /// `ms` (cumulative).
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn shift_clock_ms(&self, ms: i64) {
        self.offset_ms
            .fetch_add(ms, std::sync::atomic::Ordering::SeqCst);
    }

    fn offset(&self) -> i64 {
        #[cfg(any(test, feature = "test-hooks"))]
        return self.offset_ms.load(std::sync::atomic::Ordering::SeqCst);
        #[cfg(not(any(test, feature = "test-hooks")))]
        0
    }

    async fn query(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<Row>, StoreError> {
        // Given back only once the statement ended: a claim whose client went away may
        // still wait on a row lock, and the next request would queue behind it.
        let client = Checkout::of(&self.pool).await.map_err(StoreError::io)?;
        // Prepared once per connection: every later call is one round trip, not two.
        let row = within(self.statement_deadline, 1, async {
            match client.prepare_cached(sql).await {
                Ok(statement) => client.query_opt(&statement, params).await,
                Err(e) => Err(e),
            }
            .map_err(StoreError::io)
        })
        .await;
        ended(client, &row);
        row
    }

    async fn snapshot(&self, job: &JobId) -> Result<Option<Snapshot>, StoreError> {
        let row = self
            .query(&self.sql.get, &[&job.as_str(), &self.offset()])
            .await?;
        row.as_ref().map(|r| Snapshot::from_row(job, r)).transpose()
    }

    /// The answer to a refused renewal, release or completion: `KeyMismatch` when owner and
    /// generation still hold the job (so the key was wrong), else `Lost`.
    async fn refused(
        &self,
        job: &JobId,
        owner: &Owner,
        generation: Generation,
    ) -> Result<Outcome, StoreError> {
        Ok(match self.snapshot(job).await? {
            Some(s)
                if !s.completed
                    && s.generation == generation
                    && s.owner.as_ref() == Some(owner) =>
            {
                Outcome::KeyMismatch
            }
            Some(s) => s.lost(),
            None => Outcome::Lost {
                owner: None,
                generation: Generation::ZERO,
            },
        })
    }

    /// [`LeaseOp::Renew`]: one statement, extending the lease while owner, generation and
    /// key still match.
    async fn renew_row(
        &self,
        job: &JobId,
        owner: &Owner,
        generation: Generation,
        key: &LeaseKey,
        ttl: Ttl,
    ) -> Result<Outcome, StoreError> {
        let hash = key.hash();
        let params: [&(dyn ToSql + Sync); 6] = [
            &job.as_str(),
            &owner.as_str(),
            &generation.get().to_string(),
            &millis(ttl),
            &self.offset(),
            &&hash.as_bytes()[..],
        ];
        match self.query(&self.sql.renew, &params).await? {
            Some(row) => {
                let until: i64 = row.try_get(0).map_err(StoreError::io)?;
                Ok(Outcome::Granted(Grant {
                    generation,
                    ttl,
                    expires_at_ms: u64::try_from(until).unwrap_or(0),
                    token: None,
                    checkpoint: None,
                }))
            }
            None => self.refused(job, owner, generation).await,
        }
    }
}

impl LeaseStore for PgLeaseStore {
    /// Several servers may share the database.
    fn is_shared(&self) -> bool {
        true
    }

    /// Releases, completions and revokes of every server on this table (`pg_notify` on
    /// [`PgTable::channel`] in their statement), heard on one session of this store's own,
    /// started by the first call (inside a tokio runtime; `None` outside one).
    fn changes(&self) -> Option<tokio::sync::broadcast::Receiver<fence_storage::Notice>> {
        tokio::runtime::Handle::try_current().ok()?;
        let listener = self
            .listener
            .get_or_init(|| fence_storage::postgres::listen(&self.url, &self.table.channel()).ok());
        listener
            .as_ref()
            .map(fence_storage::postgres::Listener::subscribe)
    }

    async fn apply(&self, job: &JobId, op: LeaseOp) -> Result<Outcome, StoreError> {
        op.check(job)?;
        let (owner, g, key, sql) = match &op {
            LeaseOp::Claim {
                owner,
                key,
                ttl,
                lock_delay,
            } => {
                let delay = lock_delay.unwrap_or_default();
                return self.claim_row(job, owner, key, *ttl, delay).await;
            }
            LeaseOp::Revoke => return self.revoke_row(job).await,
            LeaseOp::Renew {
                owner,
                generation,
                key,
                ttl,
            } => return self.renew_row(job, owner, *generation, key, *ttl).await,
            LeaseOp::Release {
                owner,
                generation,
                key,
            } => (owner, generation, key, &self.sql.release),
            LeaseOp::Complete {
                owner,
                generation,
                key,
            } => (owner, generation, key, &self.sql.complete),
            LeaseOp::Checkpoint {
                owner,
                generation,
                key,
                ..
            } => (owner, generation, key, &self.sql.checkpoint),
        };
        let hash = key.hash();
        let data = match &op {
            LeaseOp::Checkpoint { data, .. } => Some(data.as_str()),
            _ => None,
        };
        let params: [&(dyn ToSql + Sync); 6] = [
            &job.as_str(),
            &owner.as_str(),
            &g.get().to_string(),
            &self.offset(),
            &&hash.as_bytes()[..],
            &data,
        ];
        let params = if data.is_some() {
            &params[..]
        } else {
            &params[..5]
        };
        match self.query(sql, params).await? {
            Some(row) => Ok(Outcome::Done(Snapshot::from_row(job, &row)?.record(job))),
            None => self.refused(job, owner, *g).await,
        }
    }

    async fn get(&self, job: &JobId) -> Result<Option<LeaseRecord>, StoreError> {
        Ok(self.snapshot(job).await?.map(|s| s.record(job)))
    }

    async fn claim_slot(
        &self,
        resource: &JobId,
        owner: &Owner,
        key: &LeaseKey,
        terms: ClaimTerms,
        slots: u32,
    ) -> Result<SlotClaim, StoreError> {
        self.claim_slot_rows(resource, owner, key, terms, slots)
            .await
    }

    async fn forget_idle(&self, idle_for: Duration, limit: usize) -> Result<usize, StoreError> {
        self.forget_idle_rows(idle_for, limit).await
    }

    async fn list(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        self.list_rows(query).await
    }
}

mod claim;
mod deadline;
mod revoke;
mod scan;
mod slots;
#[cfg(test)]
mod tests;
