//! `FENCE_CHECKPOINT_FILE`: the job's checkpoint into `fence run`'s command and back out.
//!
//! Before the command starts, the file holds the checkpoint the claim returned (empty when
//! the job has none; `FENCE_CHECKPOINT_GENERATION` names the generation that saved it). While
//! the command runs, each change of the file is saved under the lease (looked at every
//! second), and once more when the command has exited, before the job is completed or
//! released (tried again while the server fails to take it, for a minute at most): the next
//! run of the job starts from it. A save the server refuses as too large
//! or that is not UTF-8 is skipped with a warning; a stale lease's save is refused by the
//! server, so a run that lost its lease never overwrites its successor's progress. The file
//! may be read while the command writes it: commands should write a file beside it and
//! rename it over (as `mv` does), so that a save never holds half a checkpoint.

use std::{
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use fence_core::lease_api::{Checkpoint, MAX_CHECKPOINT_BYTES};
use fence_lease::{Backoff, Checkpointer, HttpLeaseStore, LeaseView};
use tokio::{sync::Mutex, task::JoinHandle};

/// How often the file is looked at.
const EVERY: Duration = Duration::from_secs(1);

/// The last save, when the server fails to take it, is tried again after pauses of about
/// 100 ms doubling up to a second, while the lease is held, for a minute at most.
const LAST_PAUSES: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(1));
const LAST_WINDOW: Duration = Duration::from_secs(60);

/// The file and what was last saved of it.
pub(super) struct CheckpointFile {
    path: PathBuf,
    saver: Checkpointer<HttpLeaseStore>,
    seen: Mutex<Seen>,
}

/// The file as last saved (or seeded, or refused for good).
struct Seen {
    /// Its modification time and length: while they stay, the file is not read every second.
    stamp: Option<(SystemTime, u64)>,
    /// Its bytes: what decides whether it changed. A rewrite of the same length within one
    /// tick of the file system's clock leaves the stamp as it was.
    bytes: Option<Vec<u8>>,
}

/// Saves the file's changes every second until [`Saving::finish`].
pub(super) struct Saving {
    file: std::sync::Arc<CheckpointFile>,
    stop: tokio::sync::watch::Sender<bool>,
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
        let seen = Mutex::new(Seen {
            stamp: stamp(&path),
            bytes: Some(data.as_bytes().to_vec()),
        });
        Ok(Self { path, saver, seen })
    }

    pub(super) fn path(&self) -> &Path {
        &self.path
    }

    /// Starts saving the file's changes.
    pub(super) fn start(self) -> Saving {
        let file = std::sync::Arc::new(self);
        let watched = file.clone();
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(EVERY);
            loop {
                tokio::select! {
                    _ = stopped.changed() => return,
                    _ = tick.tick() => {
                        watched.save_if_changed(false).await;
                    }
                }
            }
        });
        Saving { file, stop, task }
    }

    /// Saves the file if its bytes changed since the last save: read when its modification
    /// time or length moved, or always with `look_inside` (the last save, once the command
    /// exited). A change is marked saved once the store took it, or refused it for good (too
    /// large, not UTF-8, the lease lost): a save that failed for a while (the server did not
    /// answer) is tried again. False when it is to be tried again.
    async fn save_if_changed(&self, look_inside: bool) -> bool {
        let mut seen = self.seen.lock().await;
        let now = stamp(&self.path);
        if now.is_none() || (now == seen.stamp && !look_inside) {
            return true;
        }
        let read = self.read();
        if let Ok(bytes) = &read
            && seen.bytes.as_ref() == Some(bytes)
        {
            seen.stamp = now;
            return true;
        }
        let bytes = read.as_ref().ok().cloned();
        match read.and_then(text) {
            Ok(data) => match self.saver.save(data).await {
                Ok(_) => tracing::debug!(path = %self.path.display(), "checkpoint saved"),
                // The server did not answer (unreachable, a timeout, a 502, 503 or 504), or
                // applied nothing (busy, a 408): again. Any other refusal (too large, a bad
                // request, the lease lost) is final.
                Err(fence_lease::FinishError::Store(e))
                    if e.answer_lost() || matches!(e, fence_lease::StoreError::Busy(_)) =>
                {
                    let error = fence_storage::error_chain(&e);
                    tracing::warn!(%error, "the checkpoint was not saved; trying again");
                    return false;
                }
                Err(e) => {
                    tracing::warn!(error = %fence_storage::error_chain(&e), "the checkpoint was not saved");
                }
            },
            Err(why) => tracing::warn!(path = %self.path.display(), "{why}; not saved"),
        }
        *seen = Seen { stamp: now, bytes };
        true
    }

    /// The file's bytes: at most [`MAX_CHECKPOINT_BYTES`] (read no further).
    fn read(&self) -> Result<Vec<u8>, String> {
        use std::io::Read as _;
        let file = std::fs::File::open(&self.path)
            .map_err(|e| format!("cannot read the checkpoint file: {e}"))?;
        let mut bytes = Vec::new();
        let limit = MAX_CHECKPOINT_BYTES as u64;
        file.take(limit + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| format!("cannot read the checkpoint file: {e}"))?;
        if bytes.len() as u64 > limit {
            return Err(format!(
                "the checkpoint file holds more than {limit} bytes, more than any server takes"
            ));
        }
        Ok(bytes)
    }
}

/// The checkpoint's text: the file's bytes, UTF-8.
fn text(bytes: Vec<u8>) -> Result<String, String> {
    String::from_utf8(bytes)
        .map_err(|_| "the checkpoint file is not UTF-8 text (base64-encode bytes)".to_owned())
}

impl Saving {
    /// Stops looking every second (a save under way finishes first) and saves a last change,
    /// if any: the command has exited. A last save the server fails to take (no answer, a
    /// 503) is tried again while `lease` is held, for a minute at most: the next run resumes
    /// from it, and the job is given up only after.
    pub(super) async fn finish(self, lease: &LeaseView) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
        let until = tokio::time::Instant::now() + LAST_WINDOW;
        let mut pauses = Backoff::new(LAST_PAUSES.0, LAST_PAUSES.1);
        loop {
            // Each attempt is cut at the window's end too: one can take the store's timeout.
            let saved = tokio::time::timeout_at(until, self.file.save_if_changed(true)).await;
            let pause = pauses.next_pause();
            match saved {
                Ok(true) => return,
                Ok(false) if !lease.is_lost() && tokio::time::Instant::now() + pause < until => {
                    tokio::time::sleep(pause).await;
                }
                _ => {
                    tracing::warn!("the command's last checkpoint was not saved");
                    return;
                }
            }
        }
    }
}
