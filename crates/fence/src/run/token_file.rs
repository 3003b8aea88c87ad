//! `FENCE_TOKEN_FILE`: the lease's latest token, for the command to read before each write.

use std::path::PathBuf;

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
        file.write(token)?;
        Ok(file)
    }

    pub(super) fn path(&self) -> PathBuf {
        self.dir.path().join("token")
    }

    fn write(&self, token: &str) -> anyhow::Result<()> {
        let next = self.dir.path().join("token.next");
        std::fs::write(&next, format!("{token}\n")).context("writing FENCE_TOKEN_FILE")?;
        std::fs::rename(&next, self.path()).context("replacing FENCE_TOKEN_FILE")
    }

    /// Rewrites the file whenever the lease's token changes (a renewal signs a new one).
    pub(super) fn keep_current(&self, lease: LeaseView) -> tokio::task::JoinHandle<()> {
        let (dir, path) = (self.dir.path().to_owned(), self.path());
        tokio::spawn(async move {
            let mut tokens = lease.tokens();
            while let Some(token) = tokens.next().await {
                let next = dir.join("token.next");
                if std::fs::write(&next, format!("{token}\n")).is_ok() {
                    let _ = std::fs::rename(&next, &path);
                }
            }
        })
    }
}
