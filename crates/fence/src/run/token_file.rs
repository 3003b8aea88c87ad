//! `FENCE_TOKEN_FILE`: the lease's latest token, for the command to read before each write.

use std::{
    io::Write as _,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use anyhow::Context as _;
use fence_lease::TokenUpdates;

/// `FENCE_TOKEN_FILE`: a file, in a directory only this user can read, that always holds the
/// lease's latest token (replaced atomically), for a command that outlives its first token;
/// empty once the lease is lost.
pub(super) struct TokenFile {
    dir: tempfile::TempDir,
}

impl TokenFile {
    pub(super) fn new(token: &str) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("fence-run-")
            .tempdir()
            .context("creating the directory of FENCE_TOKEN_FILE")?;
        let file = Self { dir };
        write_token(&file.path(), token).context("writing FENCE_TOKEN_FILE")?;
        Ok(file)
    }

    pub(super) fn path(&self) -> PathBuf {
        self.dir.path().join("token")
    }

    /// `FENCE_CHECKPOINT_FILE`, beside the token in the same private directory.
    pub(super) fn checkpoint_path(&self) -> PathBuf {
        self.dir.path().join("checkpoint")
    }

    /// Rewrites the file whenever the lease's token changes (a renewal signs a new one):
    /// `updates` taken before the token the file was made with was read, so none is missed.
    /// Emptied when the lease is lost, by [`KeptTokenFile::empty`], or when the handle is
    /// dropped.
    pub(super) fn keep_current(&self, updates: TokenUpdates) -> KeptTokenFile {
        KeptTokenFile::keep(self.path(), updates)
    }
}

/// `fence keepalive --token-file`: the file kept current by a task while the lease is held,
/// and emptied when this is dropped, however keepalive ends (lost, stopped, failed). Nothing
/// keeps it current after that, and a lease not renewed any more ends at its TTL: a token
/// left there would outlive it.
pub(crate) struct KeptTokenFile {
    path: PathBuf,
    /// Set once the file is emptied for good; the task writes no token after.
    closed: Arc<Mutex<bool>>,
    task: tokio::task::JoinHandle<()>,
}

impl KeptTokenFile {
    /// Writes `token` to `path`, then keeps it current with `updates` (taken before `token`
    /// was read, so none is missed).
    pub(crate) fn start(
        path: PathBuf,
        token: &str,
        updates: TokenUpdates,
    ) -> std::io::Result<Self> {
        write_token(&path, token)?;
        Ok(Self::keep(path, updates))
    }

    /// Keeps `path`, which holds the token already, current with `updates`.
    fn keep(path: PathBuf, updates: TokenUpdates) -> Self {
        let closed = Arc::<Mutex<bool>>::default();
        let task = keep_token_current(path.clone(), updates, closed.clone());
        Self { path, closed, task }
    }

    /// Empties the file now, for good: `fence run` calls it on the loss before it signals
    /// the command, whose SIGTERM handler must not find the lost lease's token there (the
    /// task that empties it on the loss may not have run yet).
    pub(crate) fn empty(&self) {
        // Under the lock: a write of the task on another thread lands before this, not after.
        let mut closed = lock(&self.closed);
        if *closed {
            return;
        }
        *closed = true;
        self.task.abort();
        if let Err(e) = write_bytes(&self.path, b"") {
            tracing::warn!(path = %self.path.display(), error = %e, "cannot empty the token file");
        }
    }
}

impl Drop for KeptTokenFile {
    fn drop(&mut self) {
        self.empty();
    }
}

/// The flag, whatever a panic elsewhere left: a bool is always valid.
fn lock(closed: &Mutex<bool>) -> std::sync::MutexGuard<'_, bool> {
    closed
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Replaces `path` with `token` and a newline, atomically (a reader sees the old token or
/// the new one, never part of one) and readable by this user only: a new file is made beside
/// it (mode 0600, a name of its own, never following a link) and renamed over it.
pub(crate) fn write_token(path: &Path, token: &str) -> std::io::Result<()> {
    write_bytes(path, format!("{token}\n").as_bytes())
}

/// Replaces `path` with `bytes` as [`write_token`] does: atomically, readable by this user
/// only.
pub(crate) fn write_bytes(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let mut next = tempfile::Builder::new()
        .prefix(".fence-token-")
        .tempfile_in(dir)?;
    next.write_all(bytes)?;
    next.persist(path).map(drop).map_err(|e| e.error)
}

/// Rewrites `path` with [`write_token`] at each of `updates`, and empties it the moment the
/// lease is lost (a command that reads it before each write must not find a token the lease
/// no longer backs), until then or until the task is aborted.
/// Nothing is written once `closed` is set.
fn keep_token_current(
    path: PathBuf,
    mut updates: TokenUpdates,
    closed: Arc<Mutex<bool>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while let Some(token) = updates.next().await {
            let closed = lock(&closed);
            if *closed {
                return;
            }
            if let Err(e) = write_token(&path, &token) {
                tracing::warn!(path = %path.display(), error = %e, "cannot update the token file");
            }
        }
        if *lock(&closed) {
            return;
        }
        if let Err(e) = write_bytes(&path, b"") {
            tracing::warn!(path = %path.display(), error = %e, "cannot empty the token file of a lost lease");
        }
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use fence_lease::{LeaseClient, MemoryLeaseStore};

    use super::*;

    /// A command reading FENCE_TOKEN_FILE before each write finds no token once the lease is
    /// lost, not the last one, which a destination would still accept.
    #[tokio::test]
    async fn the_token_file_is_emptied_when_the_lease_is_lost() {
        let lease = LeaseClient::new(MemoryLeaseStore::new())
            .claim("tokens".parse().unwrap())
            .await
            .unwrap();
        let updates = lease.tokens();
        let file = TokenFile::new(&lease.token_string().unwrap()).unwrap();
        let _keeper = file.keep_current(updates);
        assert_eq!(std::fs::read_to_string(file.path()).unwrap(), "1\n");
        lease.release().await.unwrap();
        tokio::time::timeout(Duration::from_secs(5), async {
            while std::fs::read_to_string(file.path()).unwrap() != "" {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("emptied with the lease");
    }

    /// `empty` empties the file at once, before the task has seen the loss, and no token
    /// the task sees afterwards is written back.
    #[tokio::test]
    async fn emptied_on_demand_the_token_file_stays_empty() {
        let lease = LeaseClient::new(MemoryLeaseStore::new())
            .claim("emptied".parse().unwrap())
            .await
            .unwrap();
        let file = TokenFile::new(&lease.token_string().unwrap()).unwrap();
        let keeper = file.keep_current(lease.tokens());
        keeper.empty();
        assert_eq!(std::fs::read_to_string(file.path()).unwrap(), "");
        write_token(&file.path(), "stale").unwrap();
        keeper.empty(); // once for good: not written again
        assert_eq!(std::fs::read_to_string(file.path()).unwrap(), "stale\n");
        drop(keeper);
        assert_eq!(std::fs::read_to_string(file.path()).unwrap(), "stale\n");
    }
}
