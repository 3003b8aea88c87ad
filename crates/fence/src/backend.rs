//! Where the server and the proxy keep their state, chosen once from `--data-dir` or `--store`.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use fence_core::{Generation, JobId, lease_api::ListQuery};
use fence_lease::{
    LeaseOp, LeaseRecord, LeaseStore, ListPage, Outcome, PgLeaseStore, PgTable, SledLeaseStore,
};
use fence_sink::{
    Attempt, Begin, Finish, GenerationStore, IdempotencyStore, IdleJob, IdlePage, Loaded,
    RunBounds, SledStore, StoreError, Verdict,
    postgres::{PgStore, PgTables},
};
use std::time::Duration;

use crate::cli::StorageArgs;

/// The storage a command was given.
#[derive(Clone)]
pub enum Backend {
    /// sled in this directory, held by this process alone.
    Sled(PathBuf),
    /// PostgreSQL, shared with every process that uses the same tables.
    Postgres {
        /// `postgres://…`
        url: String,
        /// The schema of the tables.
        schema: String,
    },
}

/// Never the URL: it may carry the database's password (`postgres://u:secret@host/db`).
impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Sled(dir) => f.debug_tuple("Sled").field(dir).finish(),
            Self::Postgres { schema, .. } => f
                .debug_struct("Postgres")
                .field("url", &"(not shown)")
                .field("schema", schema)
                .finish(),
        }
    }
}

impl Backend {
    /// The backend `--data-dir DIR` or `--store URL` (with `--pg-schema`) names.
    ///
    /// # Errors
    /// When `--store` is not a `postgres://` URL, or neither option is given.
    pub fn choose(args: StorageArgs) -> anyhow::Result<Self> {
        let StorageArgs {
            data_dir,
            store,
            pg_schema: schema,
        } = args;
        match (store, data_dir) {
            (Some(url), _)
                if url.starts_with("postgres://") || url.starts_with("postgresql://") =>
            {
                Ok(Self::Postgres { url, schema })
            }
            // Not the value: it may hold a password (a libpq `key=value` string, a URL of
            // another scheme, one still in its env file's quotes).
            (Some(url), _) => anyhow::bail!(
                "--store: expected a postgres:// or postgresql:// URL, got one starting {:?} (the rest is not repeated: it may hold a password; leave --store out to use sled in --data-dir)",
                url.chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || "+.-\"'".contains(*c))
                    .take(12)
                    .collect::<String>()
            ),
            (None, Some(dir)) => Ok(Self::Sled(dir)),
            (None, None) => anyhow::bail!("--data-dir is required without --store"),
        }
    }

    /// What to log as the store.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Sled(_) => "sled",
            Self::Postgres { .. } => "postgres",
        }
    }

    /// Opens the lease store, creating its directory or table.
    ///
    /// # Errors
    /// When the directory cannot be opened (another process holds it, permissions) or the
    /// database cannot be reached or migrated.
    pub async fn lease_store(&self) -> anyhow::Result<LeaseBackend> {
        Ok(match self {
            Self::Sled(dir) => {
                let store = SledLeaseStore::open_with_clock(dir, clock())
                    .with_context(|| in_dir("the lease database", dir))?;
                warn_if_others_may_enter(dir);
                LeaseBackend::Sled(store)
            }
            Self::Postgres { url, schema } => {
                // No connection is made yet: what fails here is the URL (a bad sslmode, an
                // sslrootcert it would not use, a file that cannot be read): usage, exit 2.
                let pg = PgLeaseStore::connect(url, PgTable::new(schema, "leases")?)
                    .await
                    .map_err(|e| {
                        crate::Usage::from_error(anyhow::Error::new(e).context("--store"))
                    })?;
                pg.migrate()
                    .await
                    .context("creating the lease table in PostgreSQL")?;
                #[cfg(feature = "test-hooks")]
                pg.shift_clock_ms(crate::test_hooks::clock_offset_ms());
                LeaseBackend::Postgres(pg)
            }
        })
    }

    /// Removes the data directory's `running` record when it is damaged (`fence proxy
    /// --clear-running-record`; one that reads is kept).
    ///
    /// # Errors
    /// On PostgreSQL, which keeps no such record, or when the removal fails.
    pub fn clear_running_record(&self) -> anyhow::Result<()> {
        match self {
            Self::Sled(dir) => {
                let cleared = SledStore::clear_running_record(dir)
                    .with_context(|| in_dir("the fence database", dir))?;
                if cleared {
                    tracing::warn!(dir = %dir.display(), "removed the damaged `running` record (--clear-running-record): this proxy waits by its own timeouts after the restart");
                }
                Ok(())
            }
            Self::Postgres { .. } => Err(crate::Usage::error(
                "--clear-running-record needs --data-dir: PostgreSQL keeps no such record",
            )),
        }
    }

    /// Why a proxy without verify keys may not run on this data directory, whose
    /// `forgetting` record says a proxy with --forget-after ran on it (`recorded`).
    pub fn forgot_here(&self, recorded: &fence_sink::SinkSettings) -> String {
        let dir = match self {
            Self::Sled(dir) => dir.display().to_string(),
            Self::Postgres { .. } => String::new(),
        };
        let lease = recorded
            .max_lease_ttl
            .map_or_else(|| "none".to_owned(), |l| format!("{l:?}"));
        format!(
            "a proxy with --forget-after ran on the --data-dir {dir} (its `forgetting` record, \
             written when such a proxy starts, whether or not it forgot a job, says clock skew \
             {:?}, longest lease {lease}), so every proxy on it must refuse expired tokens: \
             start this one with --verify-key too (it then takes that skew and lease when \
             smaller than its own); a stale token of a forgotten job would otherwise pass here \
             as a new job's first. Another --data-dir is no way out: it forgets every job at \
             once, and without keys nothing refuses a stale token (use one only for an upstream \
             whose jobs this directory never fenced)",
            recorded.clock_skew
        )
    }

    /// Opens the sink's store, creating its directory or tables.
    ///
    /// # Errors
    /// As [`lease_store`](Self::lease_store).
    pub async fn sink_store(&self) -> anyhow::Result<SinkBackend> {
        Ok(match self {
            Self::Sled(dir) => {
                let store =
                    SledStore::open(dir).with_context(|| in_dir("the fence database", dir))?;
                warn_if_others_may_enter(dir);
                SinkBackend::Sled(store)
            }
            Self::Postgres { url, schema } => {
                // No connection is made yet: what fails here is the URL, usage (exit 2).
                let pg = PgStore::connect(url, PgTables::new(schema, "sink")?)
                    .await
                    .map_err(|e| {
                        crate::Usage::from_error(anyhow::Error::new(e).context("--store"))
                    })?;
                pg.migrate()
                    .await
                    .context("creating the fence tables in PostgreSQL")?;
                SinkBackend::Postgres(pg)
            }
        })
    }
}

fn in_dir(what: &str, dir: &Path) -> String {
    format!("cannot open {what} in {}", dir.display())
}

/// The lease store's clock: the system's, shifted in the fault tests.
fn clock() -> std::sync::Arc<dyn fence_lease::Clock> {
    #[cfg(feature = "test-hooks")]
    return std::sync::Arc::new(fence_lease::SystemClock::with_offset_ms(
        crate::test_hooks::clock_offset_ms(),
    ));
    #[cfg(not(feature = "test-hooks"))]
    std::sync::Arc::new(fence_lease::SystemClock::new())
}

/// A lease store of either backend.
#[derive(Debug, Clone)]
pub enum LeaseBackend {
    /// On local disk.
    Sled(SledLeaseStore),
    /// In PostgreSQL.
    Postgres(PgLeaseStore),
}

impl LeaseBackend {
    /// Flushes a local store to disk (graceful shutdown); PostgreSQL needs nothing.
    ///
    /// # Errors
    /// When the flush fails.
    pub fn flush(&self) -> anyhow::Result<()> {
        match self {
            Self::Sled(s) => s.flush().context("flushing the lease database"),
            Self::Postgres(_) => Ok(()),
        }
    }
}

impl LeaseStore for LeaseBackend {
    async fn apply(&self, job: &JobId, op: LeaseOp) -> Result<Outcome, fence_lease::StoreError> {
        match self {
            Self::Sled(s) => s.apply(job, op).await,
            Self::Postgres(s) => s.apply(job, op).await,
        }
    }

    async fn get(&self, job: &JobId) -> Result<Option<LeaseRecord>, fence_lease::StoreError> {
        match self {
            Self::Sled(s) => s.get(job).await,
            Self::Postgres(s) => s.get(job).await,
        }
    }

    async fn list(&self, query: &ListQuery) -> Result<ListPage, fence_lease::StoreError> {
        match self {
            Self::Sled(s) => s.list(query).await,
            Self::Postgres(s) => s.list(query).await,
        }
    }

    async fn claim_slot(
        &self,
        resource: &JobId,
        owner: &fence_core::Owner,
        key: &fence_core::secret::LeaseKey,
        terms: fence_lease::ClaimTerms,
        slots: u32,
    ) -> Result<fence_lease::SlotClaim, fence_lease::StoreError> {
        match self {
            Self::Sled(s) => s.claim_slot(resource, owner, key, terms, slots).await,
            Self::Postgres(s) => s.claim_slot(resource, owner, key, terms, slots).await,
        }
    }

    fn is_shared(&self) -> bool {
        match self {
            Self::Sled(s) => s.is_shared(),
            Self::Postgres(s) => s.is_shared(),
        }
    }

    fn changes(&self) -> Option<tokio::sync::broadcast::Receiver<fence_storage::Notice>> {
        match self {
            Self::Sled(s) => s.changes(),
            Self::Postgres(s) => s.changes(),
        }
    }

    async fn forget_idle(
        &self,
        idle_for: Duration,
        limit: usize,
    ) -> Result<usize, fence_lease::StoreError> {
        match self {
            Self::Sled(s) => s.forget_idle(idle_for, limit).await,
            Self::Postgres(s) => s.forget_idle(idle_for, limit).await,
        }
    }
}

/// A sink store of either backend.
#[derive(Debug, Clone)]
pub enum SinkBackend {
    /// On local disk.
    Sled(SledStore),
    /// In PostgreSQL.
    Postgres(PgStore),
}

impl SinkBackend {
    /// Flushes a local store to disk (graceful shutdown); PostgreSQL needs nothing.
    ///
    /// # Errors
    /// When the flush fails.
    pub fn flush(&self) -> anyhow::Result<()> {
        match self {
            Self::Sled(s) => s.flush().context("flushing the fence database"),
            Self::Postgres(_) => Ok(()),
        }
    }
}

impl GenerationStore for SinkBackend {
    async fn observe(&self, job: &JobId, token: Generation) -> Result<Verdict, StoreError> {
        match self {
            Self::Sled(s) => s.observe(job, token).await,
            Self::Postgres(s) => s.observe(job, token).await,
        }
    }

    async fn highest(&self, job: &JobId) -> Result<Generation, StoreError> {
        match self {
            Self::Sled(s) => s.highest(job).await,
            Self::Postgres(s) => s.highest(job).await,
        }
    }

    // Both stores outlive the process: their stamps must reach the gate (the trait's
    // defaults would drop them, and a restart would forget what was still running).
    async fn load(&self, job: &JobId) -> Result<Loaded, StoreError> {
        match self {
            Self::Sled(s) => s.load(job).await,
            Self::Postgres(s) => s.load(job).await,
        }
    }

    async fn raise(
        &self,
        job: &JobId,
        token: Generation,
        older_running: bool,
    ) -> Result<Verdict, StoreError> {
        match self {
            Self::Sled(s) => s.raise(job, token, older_running).await,
            Self::Postgres(s) => s.raise(job, token, older_running).await,
        }
    }

    fn loads_stamps(&self) -> bool {
        match self {
            Self::Sled(s) => s.loads_stamps(),
            Self::Postgres(s) => s.loads_stamps(),
        }
    }

    fn is_shared(&self) -> bool {
        match self {
            Self::Sled(s) => s.is_shared(),
            Self::Postgres(s) => s.is_shared(),
        }
    }

    async fn idle(&self, page: IdlePage<'_>) -> Result<Vec<IdleJob>, StoreError> {
        match self {
            Self::Sled(s) => s.idle(page).await,
            Self::Postgres(s) => s.idle(page).await,
        }
    }

    async fn forget(&self, idle: &IdleJob) -> Result<bool, StoreError> {
        match self {
            Self::Sled(s) => s.forget(idle).await,
            Self::Postgres(s) => s.forget(idle).await,
        }
    }

    async fn running_within(&self, bounds: RunBounds) -> Result<(), StoreError> {
        match self {
            Self::Sled(s) => s.running_within(bounds).await,
            Self::Postgres(s) => s.running_within(bounds).await,
        }
    }

    fn ran_within(&self) -> RunBounds {
        match self {
            Self::Sled(s) => s.ran_within(),
            Self::Postgres(s) => s.ran_within(),
        }
    }

    async fn forgetting_within(
        &self,
        clock_skew: std::time::Duration,
        max_lease_ttl: std::time::Duration,
    ) -> Result<(), StoreError> {
        match self {
            Self::Sled(s) => s.forgetting_within(clock_skew, max_lease_ttl).await,
            Self::Postgres(s) => s.forgetting_within(clock_skew, max_lease_ttl).await,
        }
    }
}

impl IdempotencyStore for SinkBackend {
    async fn begin(&self, attempt: Attempt<'_>, in_flight: Duration) -> Result<Begin, StoreError> {
        match self {
            Self::Sled(s) => s.begin(attempt, in_flight).await,
            Self::Postgres(s) => s.begin(attempt, in_flight).await,
        }
    }

    async fn finish(&self, attempt: Attempt<'_>, outcome: Finish) -> Result<(), StoreError> {
        match self {
            Self::Sled(s) => s.finish(attempt, outcome).await,
            Self::Postgres(s) => s.finish(attempt, outcome).await,
        }
    }

    async fn purge_expired(&self) -> Result<usize, StoreError> {
        match self {
            Self::Sled(s) => s.purge_expired().await,
            Self::Postgres(s) => s.purge_expired().await,
        }
    }

    fn stored_bytes(&self) -> Option<u64> {
        match self {
            Self::Sled(s) => s.stored_bytes(),
            Self::Postgres(s) => s.stored_bytes(),
        }
    }

    fn job_stored_bytes(&self, job: &JobId) -> Option<u64> {
        match self {
            Self::Sled(s) => s.job_stored_bytes(job),
            Self::Postgres(s) => s.job_stored_bytes(job),
        }
    }
}

/// Logs a warning when users other than this process's may enter the data directory `dir`:
/// it holds stored responses (headers and bodies), checkpoints and hashes of lease keys, in
/// files made as the umask allows. fence makes a new directory 0700; one made before (by an
/// older build, or by hand) keeps its mode, which is its owner's to change.
fn warn_if_others_may_enter(dir: &std::path::Path) {
    if let Some(mode) = crate::open_to_others(dir) {
        tracing::warn!(
            dir = %dir.display(),
            mode = format_args!("{mode:o}"),
            "other users may enter the data directory, which holds stored responses and checkpoints: chmod 700 it"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::Backend;

    /// A store URL's password never shows in a `Debug` print (a log line, a panic message).
    #[test]
    fn debug_never_shows_the_store_url() {
        let backend = Backend::Postgres {
            url: "postgres://fence:s3cret-pw@db.internal/fence".into(),
            schema: "public".into(),
        };
        let shown = format!("{backend:?}");
        assert!(!shown.contains("s3cret-pw"), "{shown}");
        assert!(shown.contains("public"), "{shown}");
    }
}
