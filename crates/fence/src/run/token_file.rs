//! `FENCE_TOKEN_FILE`: the lease's latest token, for the command to read before each write.

use std::{
    io::Write as _,
    path::{Path, PathBuf},
};

use anyhow::Context as _;
use fence_lease::TokenUpdates;

/// `FENCE_TOKEN_FILE`: a file, in a directory only this user can read, that always holds the
/// lease's latest token (replaced atomically), for a command that outlives its first token.
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

/// Rewrites `path` with [`write_token`] at each of `updates`, until the lease ends or the
/// task is aborted.
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
    })
}
