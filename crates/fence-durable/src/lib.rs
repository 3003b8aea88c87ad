//! Group commit for sled 0.34: one flusher thread, many waiters.
//!
//! sled's `flush_async` deadlocks under concurrent load (spacejam/sled#1241), and a
//! synchronous `flush` per request costs a disk sync each. [`GroupCommit`] makes every
//! write durable with one `flush` shared by all writers that queued before it began:
//! a writer applies its change to sled, then awaits [`GroupCommit::commit`]; the flusher
//! thread takes every waiter queued so far, calls `flush()` once and wakes them all.
//! Every write done before a flush begins is covered by it.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! let db = sled::open(dir.path())?;
//! let commit = fence_durable::GroupCommit::new(db.clone());
//! db.insert("job", &7u64.to_be_bytes())?;
//! commit.commit().await?; // on disk now
//! # Ok(()) }
//! ```

use std::{
    path::Path,
    sync::{Arc, mpsc},
    thread,
    time::{Duration, Instant},
};

use tokio::sync::oneshot;

/// Why a write could not be made durable.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum CommitError {
    /// sled's flush failed; the write may be lost on crash.
    #[error("flushing sled to disk failed")]
    Flush(#[source] Arc<sled::Error>),
    /// The flusher thread is gone (the store is shutting down).
    #[error("the flusher thread has stopped")]
    Closed,
}

type Waiter = oneshot::Sender<Result<(), CommitError>>;

/// Opens (or creates) a sled database in `path`.
///
/// sled releases its file lock from a background thread shortly after the last handle is
/// dropped, so a database reopened at once in the same process can find it still locked.
/// This waits up to 2 s for such a lock; a lock held longer (another process) is an error.
///
/// # Errors
/// When sled cannot open the directory.
pub fn open_db(path: impl AsRef<Path>) -> sled::Result<sled::Db> {
    let give_up = Instant::now() + Duration::from_secs(2);
    loop {
        match sled::Config::new().path(path.as_ref()).open() {
            Err(sled::Error::Io(e))
                if e.to_string().contains("could not acquire lock") && Instant::now() < give_up =>
            {
                thread::sleep(Duration::from_millis(10));
            }
            other => return other,
        }
    }
}

/// A handle to one flusher thread of one sled database. Cloning shares the thread; the
/// thread stops (after a last flush) when the last handle is dropped.
#[derive(Debug, Clone)]
pub struct GroupCommit {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    tx: Option<mpsc::Sender<Waiter>>,
    thread: Option<thread::JoinHandle<()>>,
    db: sled::Db,
}

impl GroupCommit {
    /// Starts the flusher thread for `db`.
    pub fn new(db: sled::Db) -> Self {
        let (tx, rx) = mpsc::channel::<Waiter>();
        let flusher = db.clone();
        let thread = thread::Builder::new()
            .name("fence-flusher".into())
            .spawn(move || {
                let mut batch = Vec::new();
                while let Ok(first) = rx.recv() {
                    batch.push(first);
                    batch.extend(rx.try_iter());
                    let result = flusher
                        .flush()
                        .map(drop)
                        .map_err(|e| CommitError::Flush(Arc::new(e)));
                    for waiter in batch.drain(..) {
                        // A waiter that went away (its request was cancelled) needs no answer.
                        let _ = waiter.send(result.clone());
                    }
                }
            })
            .ok();
        let tx = thread.as_ref().map(|_| tx);
        Self {
            inner: Arc::new(Inner { tx, thread, db }),
        }
    }

    /// Waits until every write made before this call is on disk.
    ///
    /// # Errors
    /// When the flush fails or the flusher thread has stopped.
    pub async fn commit(&self) -> Result<(), CommitError> {
        let (tx, rx) = oneshot::channel();
        let Some(sender) = &self.inner.tx else {
            // No flusher thread could be started: flush on this thread instead.
            return self.flush_now();
        };
        sender.send(tx).map_err(|_| CommitError::Closed)?;
        rx.await.map_err(|_| CommitError::Closed)?
    }

    /// Flushes synchronously on the calling thread (shutdown, tests).
    ///
    /// # Errors
    /// When the flush fails.
    pub fn flush_now(&self) -> Result<(), CommitError> {
        self.inner
            .db
            .flush()
            .map(drop)
            .map_err(|e| CommitError::Flush(Arc::new(e)))
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Closing the channel ends the thread once it has answered everyone queued; joining
        // it releases its handle on the database, so the directory can be reopened at once.
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
            let db = sled::open(dir.path()).unwrap();
            let commit = GroupCommit::new(db.clone());
            let mut tasks = Vec::new();
            for i in 0u64..200 {
                let (db, commit) = (db.clone(), commit.clone());
                tasks.push(tokio::spawn(async move {
                    db.insert(i.to_be_bytes(), &i.to_be_bytes()).unwrap();
                    commit.commit().await.unwrap();
                }));
            }
            for t in tasks {
                t.await.unwrap();
            }
        }
        let db = sled::open(dir.path()).unwrap();
        assert_eq!(db.len(), 200);
    }
}
