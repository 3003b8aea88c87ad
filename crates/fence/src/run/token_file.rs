//! `FENCE_TOKEN_FILE`: the lease's latest token, for the command to read before each write.

use std::{
    io::Write as _,
    os::unix::fs::OpenOptionsExt as _,
    path::{Path, PathBuf},
};

use anyhow::Context as _;
use fence_lease::LeaseView;

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

    /// Rewrites the file whenever the lease's token changes (a renewal signs a new one).
    pub(super) fn keep_current(&self, lease: LeaseView) -> tokio::task::JoinHandle<()> {
        keep_token_current(self.path(), lease)
    }
}

/// Replaces `path` with `token` and a newline, atomically (a reader sees the old token or
/// the new one, never part of one) and readable by this user only: the new file is written
/// beside it, mode 0600, and renamed over it.
pub(crate) fn write_token(path: &Path, token: &str) -> std::io::Result<()> {
    let mut next = path.as_os_str().to_owned();
    next.push(".next");
    let next = PathBuf::from(next);
    let written = (|| {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&next)?;
        file.write_all(format!("{token}\n").as_bytes())?;
        std::fs::rename(&next, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&next);
    }
    written
}

/// Rewrites `path` with [`write_token`] whenever the lease's token changes, until the lease
/// ends or the task is aborted.
pub(crate) fn keep_token_current(path: PathBuf, lease: LeaseView) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tokens = lease.tokens();
        while let Some(token) = tokens.next().await {
            if let Err(e) = write_token(&path, &token) {
                tracing::warn!(path = %path.display(), error = %e, "cannot update the token file");
            }
        }
    })
}
