//! Storage plumbing shared by fence's lease stores and sink stores.
//!
//! - [`disk`]: sled opened under a lock file, with group commit so every acknowledged write is
//!   on disk without a sync per write.
//! - `postgres` (only with the feature `postgres`): the connection pool, checked SQL identifiers, the
//!   database's clock in SQL and migrations serialised by an advisory lock.
//! - [`clock`]: the wall clock a store decides expiry with, injectable for tests.
//! - [`tls`]: rustls configurations from PEM files, one crypto provider for every connection.
//! - [`BoxError`] and [`error_chain`]: the error plumbing both store crates use.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! let db = fence_storage::disk::DurableDb::open(dir.path())?;
//! db.tree("jobs")?.insert("job", &7u64.to_be_bytes())?;
//! db.commit().await?; // on disk now
//! # Ok(()) }
//! ```

pub mod clock;
pub mod disk;
#[cfg(feature = "postgres")]
pub mod postgres;
pub mod tls;

/// One `#[tokio::test]` per case of a store conformance suite (for the suites' own macros):
/// each calls `$suite::$case(store, advance)` with what `$make` returned, or says it skipped
/// when `$make` returned `None` (having printed why).
#[doc(hidden)]
#[macro_export]
macro_rules! conformance_cases {
    ($suite:path; $make:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                use $suite as suite;
                match ($make)().await {
                    Some((store, advance)) => suite::$case(store, advance).await,
                    None => println!("skipped: {} (the backend's factory said why above)", stringify!($case)),
                }
            }
        )*
    };
}

/// What a store hears of changes made by other processes sharing it (a database's
/// notifications: `postgres::listen`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    /// A change, named by its payload (a job id, say).
    Payload(String),
    /// Changes may have been missed (a new session, a receiver that lagged behind): look
    /// again at everything a notice would have named. Also says that changes are heard
    /// (again) from now on.
    Missed,
    /// The session that hears changes is lost: until the next `Missed`, none is heard.
    Lost,
}

/// A boxed error source, as stores keep the cause of an I/O failure.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// `error: cause: cause`, for one-line logs and problem details.
///
/// ```
/// let e = std::io::Error::other("disk full");
/// assert_eq!(fence_storage::error_chain(&e), "disk full");
/// ```
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        out.push_str(": ");
        out.push_str(&cause.to_string());
        source = cause.source();
    }
    out
}
