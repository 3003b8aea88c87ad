//! sled on local disk, opened under a lock file, with group commit.
//!
//! sled's `flush_async` deadlocks under concurrent load (spacejam/sled#1241), and a
//! synchronous `flush` per request costs a disk sync each. [`DurableDb::commit`] makes every
//! write durable with one `flush` shared by all writers that queued before it began: a
//! writer applies its change to sled, then awaits `commit`; one flusher thread takes every
//! waiter queued so far, calls `flush()` once, then syncs what sled leaves unsynced (its
//! own sync survives a killed process but not a power cut: see `sync`), and wakes them all.
//! Every write done before a flush begins is covered by it. A failed flush fails every later
//! commit: the process must be restarted.
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
    path::{Path, PathBuf},
    sync::{Arc, mpsc},
    thread,
    time::{Duration, Instant},
};

use tokio::sync::oneshot;

mod sync;

use sync::Syncer;

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
}

/// Why a write could not be made durable.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum CommitError {
    /// sled's flush or a sync after it failed; the write may be lost on crash, and every
    /// later commit fails too until the process restarts (see `sync`).
    #[error("flushing sled to disk failed")]
    Flush(#[source] Arc<sled::Error>),
    /// The flusher thread is gone (the store is shutting down).
    #[error("the flusher thread has stopped")]
    Closed,
}

type Waiter = oneshot::Sender<Result<(), CommitError>>;

/// A sled database held by this process, with one flusher thread. Cloning shares both; the
/// thread stops (after a last flush) and the directory is unlocked when the last clone is
/// dropped.
#[derive(Debug, Clone)]
pub struct DurableDb {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    path: PathBuf,
    tx: Option<mpsc::Sender<Waiter>>,
    thread: Option<thread::JoinHandle<()>>,
    db: sled::Db,
    /// sled's flush and the syncs it leaves out (`sync`), shared with the flusher thread.
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
    /// with a page cache of [`CACHE_BYTES`].
    ///
    /// sled releases its own file lock from a background thread shortly after the last
    /// handle is dropped, so a database reopened at once in the same process can find it
    /// still held; with the directory's lock in hand that can only be this process's own
    /// closing handle, and sled is given up to 2 s to let go.
    ///
    /// # Errors
    /// [`OpenError::Locked`] when another process holds the directory; the other variants
    /// when it cannot be created, locked or opened.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, OpenError> {
        let path = path.as_ref();
        let directory = |source| OpenError::Directory {
            path: path.to_owned(),
            source,
        };
        std::fs::create_dir_all(path).map_err(directory)?;
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
            match sled::Config::new()
                .path(path)
                .cache_capacity(CACHE_BYTES)
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
        // The directory's entries (a new database's files) on disk too.
        File::open(path)
            .and_then(|dir| dir.sync_all())
            .map_err(directory)?;
        let syncer = Syncer::new(db.clone(), path).map_err(directory)?;
        Ok(Self::start(path.to_owned(), db, lock, Arc::new(syncer)))
    }

    fn start(path: PathBuf, db: sled::Db, lock: File, syncer: Arc<Syncer>) -> Self {
        let (tx, rx) = mpsc::channel::<Waiter>();
        let flusher = syncer.clone();
        let thread = thread::Builder::new()
            .name("fence-flusher".into())
            .spawn(move || {
                let mut batch = Vec::new();
                while let Ok(first) = rx.recv() {
                    batch.push(first);
                    batch.extend(rx.try_iter());
                    let result = flusher.flush();
                    for waiter in batch.drain(..) {
                        // A waiter that went away (its request was cancelled) needs no answer.
                        let _ = waiter.send(result.clone());
                    }
                }
            })
            .ok();
        let tx = thread.as_ref().map(|_| tx);
        Self {
            inner: Arc::new(Inner {
                path,
                tx,
                thread,
                db,
                syncer,
                _lock: lock,
            }),
        }
    }

    /// Opens (or creates) the tree `name`.
    ///
    /// # Errors
    /// When sled fails.
    pub fn tree(&self, name: &str) -> Result<sled::Tree, OpenError> {
        self.inner
            .db
            .open_tree(name)
            .map_err(|source| OpenError::Sled {
                path: self.inner.path.clone(),
                source,
            })
    }

    /// Waits until every write made before this call is on disk.
    ///
    /// # Errors
    /// When the flush fails or the flusher thread has stopped.
    pub async fn commit(&self) -> Result<(), CommitError> {
        let Some(sender) = &self.inner.tx else {
            // No flusher thread could be started: flush on this thread instead.
            return self.flush_now();
        };
        let (tx, rx) = oneshot::channel();
        sender.send(tx).map_err(|_| CommitError::Closed)?;
        rx.await.map_err(|_| CommitError::Closed)?
    }

    /// Flushes synchronously on the calling thread (shutdown, tools).
    ///
    /// # Errors
    /// When the flush fails.
    pub fn flush_now(&self) -> Result<(), CommitError> {
        self.inner.syncer.flush()
    }

    /// How much space the database takes on disk, in bytes.
    ///
    /// # Errors
    /// When sled cannot tell.
    pub fn size_on_disk(&self) -> sled::Result<u64> {
        self.inner.db.size_on_disk()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Closing the channel ends the thread once it has answered everyone queued; joining
        // it releases its handle on the database before the directory is unlocked.
        drop(self.tx.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn many_waiters_share_flushes_and_all_see_their_writes_after_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let db = DurableDb::open(dir.path()).unwrap();
            let tree = db.tree("t").unwrap();
            let mut tasks = Vec::new();
            for i in 0u64..200 {
                let (db, tree) = (db.clone(), tree.clone());
                tasks.push(tokio::spawn(async move {
                    tree.insert(i.to_be_bytes(), &i.to_be_bytes()).unwrap();
                    db.commit().await.unwrap();
                }));
            }
            for t in tasks {
                t.await.unwrap();
            }
        }
        let db = DurableDb::open(dir.path()).unwrap();
        assert_eq!(db.tree("t").unwrap().len(), 200);
    }

    #[test]
    fn a_directory_in_use_is_refused_by_name_and_free_again_once_closed() {
        let dir = tempfile::tempdir().unwrap();
        let first = DurableDb::open(dir.path()).unwrap();
        // Another process holding it looks the same as another open file description.
        let err = DurableDb::open(dir.path()).unwrap_err();
        assert!(matches!(err, OpenError::Locked { .. }), "{err:?}");
        assert_eq!(
            err.to_string(),
            format!(
                "another fence process is using the data directory {}; stop it or choose another directory",
                dir.path().display()
            )
        );
        drop(first);
        DurableDb::open(dir.path()).expect("unlocked once closed");
    }
}
