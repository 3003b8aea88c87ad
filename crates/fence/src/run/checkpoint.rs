//! `FENCE_CHECKPOINT_FILE`: the job's checkpoint into `fence run`'s command and back out.
//!
//! Before the command starts, the file holds the checkpoint the claim returned (empty when
//! the job has none; `FENCE_CHECKPOINT_GENERATION` names the generation that saved it). While
//! the command runs, each change of the file is saved under the lease (looked at every
//! second), and once more when the command has exited, before the job is completed or
//! released: the next run of the job starts from it. A save the server refuses as too large
//! or that is not UTF-8 is skipped with a warning; a stale lease's save is refused by the
//! server, so a run that lost its lease never overwrites its successor's progress.

use std::{
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use fence_core::lease_api::Checkpoint;
use fence_lease::{Checkpointer, HttpLeaseStore};
use tokio::{sync::Mutex, task::JoinHandle};

/// How often the file is looked at.
const EVERY: Duration = Duration::from_secs(1);

/// The file and what was last saved of it.
pub(super) struct CheckpointFile {
    path: PathBuf,
    saver: Checkpointer<HttpLeaseStore>,
    /// The file's modification time and length as last saved (or seeded).
    seen: Mutex<Option<(SystemTime, u64)>>,
}

/// Saves the file's changes every second until [`Saving::finish`].
pub(super) struct Saving {
    file: std::sync::Arc<CheckpointFile>,
    task: JoinHandle<()>,
}

fn stamp(path: &Path) -> Option<(SystemTime, u64)> {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len()))
}

impl CheckpointFile {
    /// Writes `resumed` (or nothing) to `path`, readable by this user only.
    pub(super) fn seed(
        path: PathBuf,
        resumed: Option<&Checkpoint>,
        saver: Checkpointer<HttpLeaseStore>,
    ) -> std::io::Result<Self> {
        let data = resumed.map_or("", |c| c.data.as_str());
        super::token_file::write_bytes(&path, data.as_bytes())?;
        let seen = Mutex::new(stamp(&path));
        Ok(Self { path, saver, seen })
    }

    pub(super) fn path(&self) -> &Path {
        &self.path
    }

    /// Starts saving the file's changes.
    pub(super) fn start(self) -> Saving {
        let file = std::sync::Arc::new(self);
        let watched = file.clone();
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(EVERY);
            loop {
                tick.tick().await;
                watched.save_if_changed().await;
            }
        });
        Saving { file, task }
    }

    async fn save_if_changed(&self) {
        let mut seen = self.seen.lock().await;
        let now = stamp(&self.path);
        if now.is_none() || now == *seen {
            return;
        }
        *seen = now;
        let data = match std::fs::read(&self.path).map(String::from_utf8) {
            Ok(Ok(data)) => data,
            Ok(Err(_)) => {
                tracing::warn!(path = %self.path.display(), "the checkpoint file is not UTF-8 text; not saved (base64-encode bytes)");
                return;
            }
            Err(e) => {
                tracing::warn!(path = %self.path.display(), error = %e, "cannot read the checkpoint file");
                return;
            }
        };
        match self.saver.save(data).await {
            Ok(_) => tracing::debug!(path = %self.path.display(), "checkpoint saved"),
            Err(e) => {
                tracing::warn!(error = %fence_storage::error_chain(&e), "the checkpoint was not saved");
            }
        }
    }
}

impl Saving {
    /// Stops looking every second and saves a last change, if any (the command has exited).
    pub(super) async fn finish(self) {
        self.task.abort();
        self.file.save_if_changed().await;
    }
}
