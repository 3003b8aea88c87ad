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

use std::{
    fmt,
    path::{Path, PathBuf},
    time::Duration,
};

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};

mod listen;
mod password;
mod root_cert;
pub mod throwaway;

pub use listen::{Listener, channel_name, listen};
use password::fill_password;
use root_cert::check_root_cert;

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
    /// `sslmode` names no mode libpq knows.
    #[error("sslmode={0:?} is not one of disable, allow, prefer, require, verify-ca, verify-full")]
    SslMode(String),
    /// `sslrootcert` with an `sslmode` that would not use it.
    #[error("{0}")]
    RootCert(String),
    /// The TLS configuration could not be made (a root certificate file, say).
    #[error("cannot set up TLS to PostgreSQL")]
    Tls(#[from] crate::tls::TlsError),
}

/// How many connections one store keeps at most.
pub const POOL_SIZE: usize = 16;

/// A pooled connection that goes back to the pool only when its user says it is done
/// ([`Checkout::done`]). Dropped otherwise (its request went away mid-statement), it is
/// taken out of the pool and closed: the statement may still be waiting in the database
/// (on a row lock, say), and the next user of the connection would queue behind it. The pool
/// opens a new connection in its place when one is needed.
#[derive(Debug)]
pub struct Checkout(Option<deadpool_postgres::Object>);

impl Checkout {
    /// A connection of `pool`, within the pool's timeout.
    ///
    /// # Errors
    /// When the pool has none to give and cannot open one in time.
    pub async fn of(pool: &Pool) -> Result<Self, deadpool_postgres::PoolError> {
        Ok(Self(Some(pool.get().await?)))
    }

    /// Every statement of this checkout has ended: the connection goes back to the pool.
    pub fn done(mut self) {
        drop(self.0.take());
    }
}

impl std::ops::Deref for Checkout {
    type Target = deadpool_postgres::Object;

    fn deref(&self) -> &Self::Target {
        self.0.as_ref().expect("present until done or dropped")
    }
}

/// For a transaction (`transaction` takes the connection mutably); the checkout still
/// decides whether the connection goes back to the pool.
impl std::ops::DerefMut for Checkout {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.0.as_mut().expect("present until done or dropped")
    }
}

impl Drop for Checkout {
    fn drop(&mut self) {
        if let Some(object) = self.0.take() {
            drop(deadpool_postgres::Object::take(object));
        }
    }
}

/// How long a store waits for a connection from its pool, or for a new one to be made.
pub const POOL_TIMEOUT: Duration = Duration::from_secs(10);

/// How a connection string asks for TLS (libpq's `sslmode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SslMode {
    /// No TLS.
    Disable,
    /// TLS when the server offers it, unverified.
    Prefer,
    /// TLS, unverified: against eavesdroppers, not impostors.
    Require,
    /// TLS, the certificate verified against the roots, not the host name.
    VerifyCa,
    /// TLS, the certificate verified against the roots and the host name.
    VerifyFull,
}

/// What fence reads itself out of a connection string: the options tokio-postgres does not
/// know (`sslmode=verify-ca|verify-full`, `sslrootcert`, `passfile`).
#[derive(Debug)]
struct Options {
    /// The string without them, for tokio-postgres.
    url: String,
    ssl: SslMode,
    root_cert: Option<PathBuf>,
    passfile: Option<PathBuf>,
}

fn options(url: &str) -> Result<Options, SetupError> {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut kept = Vec::new();
    let mut opts = Options {
        url: String::new(),
        ssl: SslMode::Prefer,
        root_cert: None,
        passfile: None,
    };
    let (mut mode_given, mut system_roots) = (None, false);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let value = percent_decode(value);
        match key {
            "sslmode" => {
                mode_given = Some(value.clone());
                opts.ssl = match value.as_str() {
                    "disable" => SslMode::Disable,
                    "allow" | "prefer" => SslMode::Prefer,
                    "require" => SslMode::Require,
                    "verify-ca" => SslMode::VerifyCa,
                    "verify-full" => SslMode::VerifyFull,
                    other => return Err(SetupError::SslMode(other.to_owned())),
                };
            }
            // libpq's `system`: the system's roots, not a file of that name.
            "sslrootcert" if value == "system" => (system_roots, opts.root_cert) = (true, None),
            "sslrootcert" => (system_roots, opts.root_cert) = (false, Some(PathBuf::from(value))),
            "passfile" => opts.passfile = Some(PathBuf::from(value)),
            _ => kept.push(pair),
        }
    }
    check_root_cert(&mut opts, mode_given.as_deref(), system_roots)?;
    // tokio-postgres knows disable, prefer and require; verification is ours.
    kept.push(match opts.ssl {
        SslMode::Disable => "sslmode=disable",
        SslMode::Prefer => "sslmode=prefer",
        _ => "sslmode=require",
    });
    opts.url = format!("{base}?{}", kept.join("&"));
    Ok(opts)
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (
            bytes[i],
            bytes.get(i + 1).copied(),
            bytes.get(i + 2).copied(),
        ) {
            (b'%', Some(h), Some(l)) if hex(h).is_some() && hex(l).is_some() => {
                out.push(u8::try_from(hex(h).unwrap_or(0) * 16 + hex(l).unwrap_or(0)).unwrap_or(0));
                i += 3;
            }
            (b, ..) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The TLS client configuration `ssl` asks for.
/// As libpq: `require` with an `sslrootcert` verifies the issuer, like `verify-ca`.
fn tls_for(ssl: SslMode, root_cert: Option<&Path>) -> Result<rustls::ClientConfig, SetupError> {
    Ok(match ssl {
        SslMode::Require if root_cert.is_some() => crate::tls::any_name_config(root_cert)?,
        SslMode::Disable | SslMode::Prefer | SslMode::Require => crate::tls::encrypt_only_config()?,
        SslMode::VerifyFull => crate::tls::client_config(root_cert, &[])?,
        SslMode::VerifyCa => crate::tls::any_name_config(root_cert)?,
    })
}

/// How long a session of the fence's pools waits for a row lock before its statement fails.
pub const SESSION_LOCK_TIMEOUT: Duration = Duration::from_secs(2);

/// How long any statement of the fence's pools may run.
pub const SESSION_STATEMENT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a session of the fence's may sit idle inside a transaction before the database
/// ends it, rolling back and letting go of its locks: as long as a statement may run. The
/// fence's transactions (a semaphore claim holding its resource's advisory lock and slot
/// rows, forgetting holding the floor row, a migration) send their statements back to back;
/// one idle for that long belongs to a process that stalled (stopped, swapping, cut off),
/// whose open transaction would otherwise hold up every claim of the same semaphore, or
/// every claim, until TCP gave up on it (some two hours).
pub const SESSION_IDLE_IN_TRANSACTION_TIMEOUT: Duration = SESSION_STATEMENT_TIMEOUT;

/// TCP keepalives of the fence's sessions, both ways: idle time before the first probe, the
/// time between probes, how many go unanswered before the connection is dropped (some 25 s
/// in all, not the systems' two hours and more). The database so drops the session of a
/// fence host that went away (its connection slot, and any lock it held), and the fence the
/// pooled connections to a database host that did. A URL's own `keepalives_*` win.
const KEEPALIVE: (Duration, Duration, u32) = (Duration::from_secs(10), Duration::from_secs(5), 3);

/// The `statement_timeout` the fence's sessions to `url` run with: the URL's own
/// (`options=-c statement_timeout=30s`, which comes after the fence's and wins), else
/// [`SESSION_STATEMENT_TIMEOUT`]; `None` when the URL turns it off (`0`), or gives a value
/// this does not read (then the session may allow anything).
#[must_use]
pub fn session_statement_timeout(url: &str) -> Option<Duration> {
    let config: Option<tokio_postgres::Config> = options(url).ok().and_then(|o| o.url.parse().ok());
    let mut given = None;
    if let Some(options) = config
        .as_ref()
        .and_then(tokio_postgres::Config::get_options)
    {
        let mut words = options.split_whitespace();
        while let Some(word) = words.next() {
            // `-c name=value`, `-cname=value` or `--name=value` (dashes for underscores,
            // any case).
            let setting = match word {
                "-c" => words.next(),
                word => word.strip_prefix("-c").or_else(|| word.strip_prefix("--")),
            };
            if let Some((name, value)) = setting.and_then(|s| s.split_once('='))
                && name
                    .replace('-', "_")
                    .eq_ignore_ascii_case("statement_timeout")
            {
                given = Some(value.to_owned()); // the last one wins, as in PostgreSQL
            }
        }
    }
    match given.as_deref().map(postgres_duration) {
        None => Some(SESSION_STATEMENT_TIMEOUT),
        Some(Some(d)) if !d.is_zero() => Some(d),
        Some(_) => None,
    }
}

/// A PostgreSQL time setting: a number, whole or not, of `us`, `ms` (also none), `s`,
/// `min`, `h` or `d`, rounded to the millisecond as PostgreSQL does.
fn postgres_duration(value: &str) -> Option<Duration> {
    let value = value.trim_matches(|c| c == '\'' || c == '"');
    let number = value
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(value.len());
    let n: f64 = value[..number].parse().ok()?;
    let unit_ms = match value[number..].trim().to_ascii_lowercase().as_str() {
        "" | "ms" => 1.0,
        "us" => 0.001,
        "s" => 1_000.0,
        "min" => 60_000.0,
        "h" => 3_600_000.0,
        "d" => 86_400_000.0,
        _ => return None,
    };
    let ms = (n * unit_ms).round();
    // PostgreSQL's limit is i32::MAX ms; anything larger is refused there too.
    (ms.is_finite() && (0.0..=f64::from(i32::MAX)).contains(&ms))
        .then(|| Duration::from_millis(ms as u64))
}

/// The configuration and TLS connector of one of the fence's sessions to `url`, as
/// [`connect_pool`] describes; [`listen`] opens its session with them too.
fn session(
    url: &str,
) -> Result<
    (
        tokio_postgres::Config,
        tokio_postgres_rustls::MakeRustlsConnect,
    ),
    SetupError,
> {
    let Options {
        url,
        ssl,
        root_cert,
        passfile,
    } = options(url)?;
    let mut config: tokio_postgres::Config = url.parse().map_err(SetupError::Url)?;
    fill_password(&mut config, passfile);
    // Every wait of the fence's own sessions has a deadline (a row lock held by a writer's
    // open transaction is a wait too): a stalled writer holds up its own job for at most
    // SESSION_LOCK_TIMEOUT, and no query keeps a pooled connection busy for longer than
    // SESSION_STATEMENT_TIMEOUT. READ COMMITTED whatever the cluster's default: the
    // statements are written for it (a conflict waits for the row, then reads it again),
    // and under REPEATABLE READ a busy job's claims would fail with serialization errors,
    // answered as outcomes unknown. No transaction stays open idle for long, and the server
    // probes the connection (see SESSION_IDLE_IN_TRANSACTION_TIMEOUT and KEEPALIVE). Options
    // in the URL come after these, so they win.
    let (idle, interval, count) = KEEPALIVE;
    let options = format!(
        "-c lock_timeout={}ms -c statement_timeout={}ms -c idle_in_transaction_session_timeout={}ms -c tcp_keepalives_idle={} -c tcp_keepalives_interval={} -c tcp_keepalives_count={count} -c default_transaction_isolation=read\\ committed {}",
        SESSION_LOCK_TIMEOUT.as_millis(),
        SESSION_STATEMENT_TIMEOUT.as_millis(),
        SESSION_IDLE_IN_TRANSACTION_TIMEOUT.as_millis(),
        idle.as_secs(),
        interval.as_secs(),
        config.get_options().unwrap_or_default()
    );
    config.options(options.trim_end());
    // The client's side: tokio-postgres probes after two hours of silence by default, and
    // leaves the interval and count to the system. Only what the URL left at that default.
    if config.get_keepalives_idle() == Duration::from_secs(2 * 60 * 60) {
        config.keepalives_idle(idle);
    }
    if config.get_keepalives_interval().is_none() {
        config.keepalives_interval(interval);
    }
    if config.get_keepalives_retries().is_none() {
        config.keepalives_retries(count);
    }
    let tls = tokio_postgres_rustls::MakeRustlsConnect::new(tls_for(ssl, root_cert.as_deref())?);
    Ok((config, tls))
}

/// A pool of up to [`POOL_SIZE`] connections to `url` (`postgres://user@host:port/db`).
/// Connections are made when first needed, so a database that is down now is not an error.
///
/// TLS follows libpq's `sslmode`: `disable`, `prefer` (the default; unverified; `allow` is
/// read as `prefer`), `require` (encrypted, unverified, unless `sslrootcert` is given: then
/// as `verify-ca`), `verify-ca` (the certificate checked against `sslrootcert` or the
/// system roots) and `verify-full` (and its host name too). `sslrootcert` with a mode that
/// would not use it is refused; `sslrootcert=system` is the system roots and `verify-full`. Without a password in the
/// string, `PGPASSWORD` or the passfile (`passfile=`, `PGPASSFILE`, `~/.pgpass`) gives it, so
/// it need not appear on a command line.
///
/// # Errors
/// When `url` is not a valid connection string, names an unknown `sslmode`, or a root
/// certificate file cannot be read.
pub fn connect_pool(url: &str) -> Result<Pool, SetupError> {
    let (config, tls) = session(url)?;
    let manager = Manager::from_config(
        config,
        tls,
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

/// The database the PostgreSQL tests use: `DATABASE_URL`; else the local server on
/// 127.0.0.1:5432 (trust auth, database `test`) when it answers; else a throwaway cluster
/// started from the local PostgreSQL binaries ([`throwaway`]), as also with
/// `FENCE_TEST_POSTGRES=throwaway`. A test that cannot reach its database fails with the
/// connection error: it never passes without running.
///
/// # Panics
/// When a throwaway cluster is needed and cannot be started; the message names the
/// package to install when PostgreSQL's binaries are missing.
pub fn test_database_url() -> String {
    let forced = std::env::var("FENCE_TEST_POSTGRES").is_ok_and(|v| v == "throwaway");
    if !forced {
        if let Ok(url) = std::env::var("DATABASE_URL") {
            return url;
        }
        let local = std::net::SocketAddr::from(([127, 0, 0, 1], 5432));
        if std::net::TcpStream::connect_timeout(&local, Duration::from_secs(1)).is_ok() {
            return "postgres://postgres@127.0.0.1:5432/test".to_owned();
        }
    }
    throwaway::url().unwrap_or_else(|why| panic!("{why}"))
}

/// Restarts the test database at once when it is a [`throwaway`] cluster this process uses:
/// `None` when it is not, else whether the restart succeeded.
pub fn restart_throwaway_test_database() -> Option<bool> {
    throwaway::restart()
}

/// Drops the tables of schema `fence_test` in the test database at `url` whose names match
/// any of the SQL `LIKE` patterns: what earlier runs of a store's tests left there (each
/// test makes tables of its own, and the conformance suites have no teardown). Call it once
/// per run, before any test starts, so the test database holds one run's tables at most.
///
/// # Panics
/// When the test database does not answer: the tests would fail anyway.
pub async fn drop_test_tables(url: &str, like: &[&str]) {
    let pool = connect_pool(url).expect("the test database's URL is valid");
    let client = pool.get().await.expect("the test database answers");
    let like: Vec<String> = like.iter().map(|p| (*p).to_owned()).collect();
    let rows = client
        .query(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'fence_test'
               AND tablename LIKE ANY($1)",
            &[&like],
        )
        .await
        .expect("the test database lists its tables");
    for row in rows {
        let table: String = row.get(0);
        let _ = client
            .batch_execute(&format!(
                "DROP TABLE IF EXISTS fence_test.\"{}\" CASCADE",
                table.replace('"', "\"\"")
            ))
            .await;
    }
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
/// A `ddl` already applied to `schema` (recorded by its MD5 in `{schema}.fence_migrations`)
/// is not run again: its statements would take table locks (`ALTER TABLE` even when there is
/// nothing to alter) and so wait behind every writer's open transaction, failing a restart at
/// the fence's `lock_timeout` and holding up every session queued behind the lock meanwhile.
/// A new `ddl` (an upgrade) still needs those locks: a lock timeout then is retried, five
/// times in all, a second apart.
///
/// # Errors
/// When the database cannot be reached or refuses the statements.
pub async fn migrate(pool: &Pool, schema: &Ident, ddl: &str) -> Result<(), MigrateError> {
    let mut client = pool.get().await.map_err(MigrateError::Connect)?;
    let mut attempt = 1;
    loop {
        match migrate_once(&mut client, schema, ddl).await {
            Err(e)
                if attempt < 5
                    && e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) =>
            {
                attempt += 1;
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            other => return other.map_err(MigrateError::Refused),
        }
    }
}

async fn migrate_once(
    client: &mut deadpool_postgres::Object,
    schema: &Ident,
    ddl: &str,
) -> Result<(), tokio_postgres::Error> {
    let tx = client.transaction().await?;
    tx.execute(
        "SELECT pg_advisory_xact_lock(hashtext($1))",
        &[&format!("fence-migrate:{schema}")],
    )
    .await?;
    tx.batch_execute(&format!(
        "CREATE SCHEMA IF NOT EXISTS {schema};
         CREATE TABLE IF NOT EXISTS {schema}.fence_migrations (
             ddl_md5 text PRIMARY KEY,
             applied_at timestamptz NOT NULL DEFAULT now()
         );"
    ))
    .await?;
    let applied = tx
        .query_opt(
            &format!("SELECT 1 FROM {schema}.fence_migrations WHERE ddl_md5 = md5($1)"),
            &[&ddl],
        )
        .await?;
    if applied.is_none() {
        tx.batch_execute(ddl).await?;
        tx.execute(
            &format!("INSERT INTO {schema}.fence_migrations (ddl_md5) VALUES (md5($1))"),
            &[&ddl],
        )
        .await?;
    }
    tx.commit().await
}

#[cfg(test)]
mod tests;
