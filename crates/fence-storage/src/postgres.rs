//! PostgreSQL plumbing shared by the lease and sink stores: pool, identifiers, clock, migrations.
//!
//! ```no_run
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use fence_storage::postgres::{Ident, connect_pool, migrate};
//!
//! let pool = connect_pool("postgres://postgres@127.0.0.1/test")?;
//! let schema = Ident::new("schema", "fence")?;
//! migrate(&pool, &schema, &format!("CREATE TABLE IF NOT EXISTS {schema}.t (k text)")).await?;
//! # Ok(()) }
//! ```

use std::{fmt, time::Duration};

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use tokio_postgres::NoTls;

/// The database's clock in milliseconds since the Unix epoch, as an SQL expression. Every
/// decision about time that a PostgreSQL store makes reads this clock, never a process's.
pub const NOW_MS: &str = "(floor(extract(epoch from clock_timestamp()) * 1000))::bigint";

/// The longest identifier PostgreSQL keeps whole (`NAMEDATALEN - 1`).
pub const MAX_IDENT_LEN: usize = 63;

/// A schema or table name that never needs quoting and cannot inject SQL: 1 to 63 of
/// `a-z`, `0-9` and `_`, not starting with a digit.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Ident(String);

/// A name that is not a plain lower-case SQL identifier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {what} name {name:?}: use 1 to 63 of a-z, 0-9 and _, not starting with a digit")]
pub struct IdentError {
    /// What the name is for (`"schema"`, `"table"`).
    pub what: &'static str,
    /// The name.
    pub name: String,
}

impl Ident {
    /// Checks `name`, a `what` (`"schema"`, `"table"`).
    ///
    /// ```
    /// # use fence_storage::postgres::Ident;
    /// assert!(Ident::new("table", "leases").is_ok());
    /// assert!(Ident::new("table", "x; drop").is_err());
    /// ```
    ///
    /// # Errors
    /// When it is empty, longer than 63 characters, or holds anything else.
    pub fn new(what: &'static str, name: &str) -> Result<Self, IdentError> {
        let ok = !name.is_empty()
            && name.len() <= MAX_IDENT_LEN
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
            && !name.as_bytes()[0].is_ascii_digit();
        if ok {
            Ok(Self(name.to_owned()))
        } else {
            Err(IdentError {
                what,
                name: name.to_owned(),
            })
        }
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Ident {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Why a pool could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SetupError {
    /// The connection string does not parse.
    #[error("invalid PostgreSQL connection string")]
    Url(#[source] tokio_postgres::Error),
    /// The pool could not be built.
    #[error("cannot build the PostgreSQL connection pool")]
    Pool(#[source] deadpool_postgres::BuildError),
    /// A schema or table name is not a plain identifier.
    #[error(transparent)]
    Ident(#[from] IdentError),
}

/// How many connections one store keeps at most.
pub const POOL_SIZE: usize = 16;

/// How long a store waits for a connection from its pool, or for a new one to be made.
pub const POOL_TIMEOUT: Duration = Duration::from_secs(10);

/// A pool of up to [`POOL_SIZE`] connections to `url` (`postgres://user@host:port/db`).
/// Connections are made when first needed, so a database that is down now is not an error.
///
/// # Errors
/// When `url` is not a valid connection string.
pub fn connect_pool(url: &str) -> Result<Pool, SetupError> {
    let config: tokio_postgres::Config = url.parse().map_err(SetupError::Url)?;
    let manager = Manager::from_config(
        config,
        NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(POOL_SIZE)
        .wait_timeout(Some(POOL_TIMEOUT))
        .create_timeout(Some(POOL_TIMEOUT))
        .runtime(deadpool_postgres::Runtime::Tokio1)
        .build()
        .map_err(SetupError::Pool)
}

/// Why a migration failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MigrateError {
    /// No connection could be had.
    #[error("cannot connect to PostgreSQL")]
    Connect(#[source] deadpool_postgres::PoolError),
    /// The database refused the statements.
    #[error("PostgreSQL refused the migration")]
    Refused(#[source] tokio_postgres::Error),
}

/// Runs `ddl` in one transaction, serialised against every other migration of `schema`
/// (from any process) by an advisory lock, so concurrent `CREATE ... IF NOT EXISTS` do not
/// race. Write `ddl` so that it can run any number of times.
///
/// # Errors
/// When the database cannot be reached or refuses the statements.
pub async fn migrate(pool: &Pool, schema: &Ident, ddl: &str) -> Result<(), MigrateError> {
    let client = pool.get().await.map_err(MigrateError::Connect)?;
    client
        .batch_execute(&format!(
            "BEGIN;
             SELECT pg_advisory_xact_lock(hashtext('fence-migrate:{schema}'));
             CREATE SCHEMA IF NOT EXISTS {schema};
             {ddl}
             COMMIT;"
        ))
        .await
        .map_err(MigrateError::Refused)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_checked_by_one_rule() {
        assert!(Ident::new("table", "leases").is_ok());
        assert!(Ident::new("table", &"a".repeat(63)).is_ok());
        for bad in ["", "Fence", "x;drop", "1x", "a.b", "a b", &"a".repeat(64)] {
            let e = Ident::new("table", bad).unwrap_err();
            assert!(e.to_string().starts_with("invalid table name"), "{e}");
        }
    }
}
