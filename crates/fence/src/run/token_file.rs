//! `FENCE_TOKEN_FILE`: the lease's latest token, for the command to read before each write.

use std::{
    io::Write as _,
    path::{Path, PathBuf},
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
    pub(super) fn keep_current(&self, updates: TokenUpdates) -> tokio::task::JoinHandle<()> {
        keep_token_current(self.path(), updates)
    }
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
pub(crate) fn keep_token_current(
    path: PathBuf,
    mut updates: TokenUpdates,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while let Some(token) = updates.next().await {
            if let Err(e) = write_token(&path, &token) {
                tracing::warn!(path = %path.display(), error = %e, "cannot update the token file");
            }
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
        let keeper = file.keep_current(updates);
        assert_eq!(std::fs::read_to_string(file.path()).unwrap(), "1\n");
        lease.release().await.unwrap();
        tokio::time::timeout(Duration::from_secs(5), keeper)
            .await
            .expect("the keeper ends with the lease")
            .unwrap();
        assert_eq!(std::fs::read_to_string(file.path()).unwrap(), "");
    }
}
