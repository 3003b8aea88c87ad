//! sled on local disk, opened under a lock file, with a write-ahead log for group commit.
//!
//! Every write goes through a [`Tree`]: it is applied to sled and its after-image appended to
//! the log's buffer under one lock. [`DurableDb::commit`] waits until every write made before
//! it is on disk: one writer thread appends all that was buffered with one `fdatasync` per
//! batch, shared by every writer of the moment (`log`). sled itself is flushed in the
//! background, every few seconds, and the log behind it deleted; on open, what the log holds
//! is replayed into sled first. A failed write or sync fails every later commit, and every
//! later write is refused: the process must be restarted.
//!
//! A directory is held by one process at a time: [`DurableDb::open`] takes an exclusive lock
//! on `fence.lock` in it first, and says [`OpenError::Locked`] when another process has it.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use fence_storage::disk::{DurableDb, OpenError};
//!
//! let dir = tempfile::tempdir()?;
//! let db = DurableDb::open(dir.path())?;
//! db.tree("jobs")?.insert("job", &7u64.to_be_bytes())?;
//! db.commit().await?;
//! # Ok(()) }
//! ```

use std::{
    fs::{File, TryLockError},
    os::unix::fs::DirBuilderExt,
    path::{Path, PathBuf},
    sync::Arc,
    thread,
    time::{Duration, Instant},
};

mod log;
mod sync;
mod tree;

use log::{Limits, Log};
use sync::Syncer;
pub use tree::Tree;

/// How long one write and sync of the log may take before writes are refused, unapplied,
/// until it ends: a stalled disk then answers 503 instead of letting writes that are not on
/// disk be read, and their records pile up in memory.
pub const STALLED_AFTER: Duration = Duration::from_secs(5);

/// The lock file every fence database directory holds while open.
pub const LOCK_FILE: &str = "fence.lock";

/// Why a database directory could not be opened.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    /// Another process has the directory open.
    #[error(
        "another fence process is using the data directory {path}; stop it or choose another directory"
    )]
    Locked {
        /// The directory.
        path: PathBuf,
    },
    /// The directory or its lock file could not be created or locked.
    #[error("cannot use the data directory {path}")]
    Directory {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// sled could not open the database in the directory (permissions, corrupt files).
    #[error("cannot open the database in {path}")]
    Sled {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: sled::Error,
    },
    /// The write-ahead log left by the last process could not be replayed: writes it
    /// acknowledged would be lost, so the database is not opened.
    #[error("cannot replay the write-ahead log in {path}")]
    Log {
        /// The log's directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A record the database keeps about the processes before this one could not be read:
    /// taken as absent, a safety bound would be lost, so the database is not opened.
    #[error("cannot read the `{record}` record in the data directory {path}: {reason}")]
    Record {
        /// The directory.
        path: PathBuf,
        /// The record's key in the `format` tree.
        record: &'static str,
        /// What it guards, and how to clear it safely.
        reason: String,
    },
}

/// Why a write could not be made durable.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum CommitError {
    /// sled's flush or a sync after it failed; the write may be lost on crash, and every
    /// later commit fails too until the process restarts (see `sync`).
    #[error("flushing sled to disk failed")]
    Flush(#[source] Arc<sled::Error>),
    /// Writing or syncing the write-ahead log failed; every later commit fails too until the
    /// process restarts.
    #[error("writing the write-ahead log failed")]
    Log(#[source] Arc<std::io::Error>),
    /// The log's writer thread is gone (the store is shutting down).
    #[error("the log writer has stopped")]
    Closed,
    /// The disk did not confirm the write in time ([`DurableDb::commit_within`]); it may
    /// still reach the disk, and later commits may succeed once the disk answers.
    #[error("the disk did not confirm the write within {0:?}")]
    TimedOut(Duration),
}

/// A sled database held by this process, with its write-ahead log. Cloning shares both; the
/// log is written out, sled flushed and the directory unlocked when the last clone (and the
/// last [`Tree`]) is dropped.
#[derive(Clone)]
pub struct DurableDb {
    inner: Arc<Inner>,
}

/// The directory only: sled's own `Debug` prints the trees' contents (stored records, key
/// hashes, idempotency responses), which have no place in a log line that prints a store.
impl std::fmt::Debug for DurableDb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DurableDb")
            .field("path", &self.inner.path)
            .finish_non_exhaustive()
    }
}

#[derive(Debug)]
struct Inner {
    /// Dropped first (fields drop in order): it writes what is buffered and checkpoints it
    /// into sled, before sled's handle goes and the directory is unlocked.
    log: Log,
    path: PathBuf,
    db: sled::Db,
    /// sled's flush and the syncs it leaves out (`sync`), shared with the log's checkpoints.
    syncer: Arc<Syncer>,
    /// Dropped last: the directory stays locked until sled has let go of it.
    _lock: File,
}

/// sled's page cache, per database. sled's own default is 1 GiB, and under churn (jobs
/// written once and forgotten) it fills with pages of keys long gone: resident memory then
/// climbs toward the cache's size while the data on disk stays flat (BENCHMARKS.md, "where
/// the resident memory went"). 128 MiB holds the pages of a few hundred thousand live jobs;
/// more live jobs than that are read back from the operating system's file cache.
pub const CACHE_BYTES: u64 = 128 << 20;

impl DurableDb {
    /// Opens (or creates) the database in directory `path`, locking it for this process,
    /// with a page cache of [`CACHE_BYTES`], and replays the write-ahead log a previous
    /// process left.
    ///
    /// sled releases its own file lock from a background thread shortly after the last
    /// handle is dropped, so a database reopened at once in the same process can find it
    /// still held; with the directory's lock in hand that can only be this process's own
    /// closing handle, and sled is given up to 2 s to let go.
    ///
    /// # Errors
    /// [`OpenError::Locked`] when another process holds the directory; [`OpenError::Log`]
    /// when the log cannot be replayed; the other variants when the directory cannot be
    /// created, locked or opened.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, OpenError> {
        Self::open_with(
            path.as_ref(),
            Limits {
                age: log::SEGMENT_AGE,
                bytes: log::SEGMENT_BYTES,
                stall: STALLED_AFTER,
            },
        )
    }

    fn open_with(path: &Path, limits: Limits) -> Result<Self, OpenError> {
        let directory = |source| OpenError::Directory {
            path: path.to_owned(),
            source,
        };
        let log_dir = path.join(log::LOG_DIR);
        // Only this process's user may enter what it creates: the database holds stored
        // responses (headers and bodies, cookies and all), checkpoints and lease keys' hashes.
        // sled's files are made as the umask allows; a directory of mode 0700 keeps them
        // private. An existing directory keeps the mode its owner gave it.
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&log_dir)
            .map_err(directory)?;
        let lock = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path.join(LOCK_FILE))
            .map_err(directory)?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                return Err(OpenError::Locked {
                    path: path.to_owned(),
                });
            }
            Err(TryLockError::Error(e)) => return Err(directory(e)),
        }
        let give_up = Instant::now() + Duration::from_secs(2);
        let db = loop {
            // No flushes of sled's own: the log's checkpoints flush it.
            match sled::Config::new()
                .path(path)
                .cache_capacity(CACHE_BYTES)
                .flush_every_ms(None)
                .open()
            {
                // Our own handle that is still closing (see above).
                Err(sled::Error::Io(_)) if Instant::now() < give_up => {
                    thread::sleep(Duration::from_millis(10));
                }
                Err(source) => {
                    return Err(OpenError::Sled {
                        path: path.to_owned(),
                        source,
                    });
                }
                Ok(db) => break db,
            }
        };
        // The directory's entries (a new database's files, the log's directory) on disk
        // too, sled's configuration file (which sled writes without a sync: cut short, it
        // makes sled refuse to open), and the directory's own entry in its parent (new on a
        // first start): without them a power cut soon after the first start could lose the
        // whole database, acknowledged writes included.
        // The parent is best effort: one this user may enter but not read (mode 0711)
        // cannot be opened to sync, and that must not stop a start that worked before.
        let conf = path.join("conf");
        let synced = |p: &Path| File::open(p).and_then(|f| f.sync_all());
        let absent_or_denied = |r: std::io::Result<()>| match r {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => Ok(()),
            other => other,
        };
        let parent = path
            .canonicalize()
            .ok()
            .and_then(|p| p.parent().map(Path::to_owned));
        synced(path)
            .and_then(|()| absent_or_denied(synced(&conf)))
            .and_then(|()| parent.map_or(Ok(()), |p| absent_or_denied(synced(&p))))
            .map_err(directory)?;
        let syncer = Arc::new(Syncer::new(db.clone(), path).map_err(directory)?);
        let next = log::replay(&db, &syncer, &log_dir).map_err(|e| OpenError::Log {
            path: log_dir.clone(),
            source: Box::new(e),
        })?;
        let log = Log::start(log_dir, next, syncer.clone(), limits).map_err(directory)?;
        Ok(Self {
            inner: Arc::new(Inner {
                path: path.to_owned(),
                db,
                syncer,
                log,
                _lock: lock,
            }),
        })
    }

    /// Opens (or creates) the tree `name`: reads as sled's, writes through the log.
    ///
    /// # Errors
    /// When sled fails, or `name` is longer than 255 bytes.
    pub fn tree(&self, name: &str) -> Result<Tree, OpenError> {
        let sled_error = |source| OpenError::Sled {
            path: self.inner.path.clone(),
            source,
        };
        if name.len() > 255 {
            return Err(sled_error(sled::Error::Unsupported(format!(
                "a tree name of {} bytes (at most 255)",
                name.len()
            ))));
        }
        let tree = self.inner.db.open_tree(name).map_err(sled_error)?;
        Ok(Tree::new(tree, name, self.clone()))
    }

    fn log(&self) -> &log::Shared {
        &self.inner.log.shared
    }

    /// Waits until every write made before this call is on disk.
    ///
    /// # Errors
    /// When writing the log failed (now or before) or its writer has stopped.
    pub async fn commit(&self) -> Result<(), CommitError> {
        self.log().commit().await
    }

    /// [`commit`](Self::commit), giving up after `within` ([`CommitError::TimedOut`]) when
    /// the disk does not answer: a stalled disk then fails requests instead of holding
    /// them, and their connections, for as long as it stalls.
    ///
    /// # Errors
    /// As `commit`, and when `within` runs out first.
    pub async fn commit_within(&self, within: Duration) -> Result<(), CommitError> {
        tokio::time::timeout(within, self.commit())
            .await
            .unwrap_or(Err(CommitError::TimedOut(within)))
    }

    /// [`commit`](Self::commit) for an answer read from what others wrote, changing nothing
    /// (an idempotency replay, say): it waits for their writes like any commit, but while
    /// the disk stalls ([`STALLED_AFTER`]) it is refused at once, as a decision is, instead
    /// of holding its request until the caller's timeout.
    ///
    /// # Errors
    /// As `commit`; [`CommitError::TimedOut`] at once while the disk stalls.
    pub async fn commit_read(&self) -> Result<(), CommitError> {
        // Nothing pending: no wait, stalled or not (a stall can be a rotation's, say, with
        // every record already on disk).
        if self.log().all_synced() {
            return Ok(());
        }
        match self.log().rounds.writable() {
            Err(sled::Error::Io(e)) if e.kind() == std::io::ErrorKind::TimedOut => {
                Err(CommitError::TimedOut(STALLED_AFTER))
            }
            _ => self.commit().await,
        }
    }

    /// Fails the log as a failed write would: every later write and commit fails, for
    /// tests (never in a shipped binary).
    #[cfg(any(test, feature = "test-hooks"))]
    #[doc(hidden)]
    pub fn fail_log(&self) {
        self.log().fail_for_test();
    }

    /// Holds the log's writer before its next write while the answer lives: a disk that
    /// does not answer, for tests (never in a shipped binary).
    #[cfg(any(test, feature = "test-hooks"))]
    #[doc(hidden)]
    pub fn stall_log(&self) -> std::sync::MutexGuard<'_, ()> {
        self.log()
            .stall
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Flushes sled synchronously on the calling thread (shutdown, tools): every write made
    /// before this call is in sled's files on disk.
    ///
    /// # Errors
    /// When the flush fails.
    pub fn flush_now(&self) -> Result<(), CommitError> {
        self.inner.syncer.flush()
    }

    /// How much space the database takes on disk, in bytes (sled's files, not the log's).
    ///
    /// # Errors
    /// When sled cannot tell.
    pub fn size_on_disk(&self) -> sled::Result<u64> {
        self.inner.db.size_on_disk()
    }
}

#[cfg(test)]
mod tests;
