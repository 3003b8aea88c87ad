//! Replaying the segments a process left: into sled, in order, then deleted.

use std::{
    io,
    path::{Path, PathBuf},
};

use super::{
    super::{CommitError, sync::Syncer},
    FILLING, Op, SPARE, format, remove_if_there, remove_oldest_first, segments,
};

/// Why the log left on disk could not be replayed.
#[derive(Debug, thiserror::Error)]
pub(in crate::disk) enum ReplayError {
    #[error("cannot read or remove the log")]
    Io(#[from] io::Error),
    #[error("cannot write the log's records to sled")]
    Sled(#[from] sled::Error),
    #[error(
        "the log segment {path} has no end (its frames stop at byte {at}), yet a later one exists (a crash only cuts the last segment short)"
    )]
    Unended { path: PathBuf, at: usize },
    #[error(
        "the log segment {0} has a damaged header (zeros, or shorter than a header), yet a later one exists (only a crash while the last segment is created leaves its header unwritten)"
    )]
    NoHeader(PathBuf),
    #[error(
        "the log segment {0} does not start with this build's header: it was written by another version of fence, or its header is damaged. Keep the file; open the data directory with the version of fence that wrote it and stop that one cleanly (a clean stop leaves no log), or restore from a backup"
    )]
    Foreign(PathBuf),
    #[error(
        "the log segment {path} holds a frame at byte {at} that passes its checksum but does not read"
    )]
    Undecodable { path: PathBuf, at: usize },
    #[error(
        "the log segment {path} is damaged: its frame at byte {at} fails its checksum, yet a later one (at byte {later}) passes it, and a crash only cuts the last frame short; replaying would drop writes that were acknowledged. Keep the file (copy the data directory aside) and check the disk; then restore from a backup, or move the file out of the log directory to open without the writes it holds"
    )]
    Damaged {
        path: PathBuf,
        at: usize,
        later: usize,
    },
    #[error("cannot flush sled after replaying the log")]
    Flush(#[source] CommitError),
    #[error(
        "the log segment {0} has the largest number a segment can have, so no segment can follow it; a file of that name is not one fence wrote"
    )]
    LastNumber(PathBuf),
}

/// Replays the segments in `dir` into `db`, makes sled durable, deletes them; answers the
/// number the next segment takes.
pub(in crate::disk) fn replay(
    db: &sled::Db,
    syncer: &Syncer,
    dir: &Path,
) -> Result<u64, ReplayError> {
    let found = segments(dir)?;
    // Checkpoints delete segments oldest first, after a flush that covers every segment up
    // to the one deleted: where a number is missing (a power cut that kept some deletions
    // and not others), everything before the gap is in sled, and replaying it would put
    // back values older than later ones sled holds.
    let from = found
        .windows(2)
        .rposition(|w| w[0].0.checked_add(1) != Some(w[1].0))
        .map_or(0, |i| i + 1);
    for (i, (number, path)) in found.iter().enumerate().skip(from) {
        let bytes = std::fs::read(path)?;
        let segment = format::read(&bytes, *number).map_err(|e| match e {
            format::Unreadable::Undecodable { at } => ReplayError::Undecodable {
                path: path.clone(),
                at,
            },
            format::Unreadable::Damaged { at, later } => ReplayError::Damaged {
                path: path.clone(),
                at,
                later,
            },
            format::Unreadable::Foreign => ReplayError::Foreign(path.clone()),
        })?;
        if i + 1 < found.len() {
            match segment.end {
                format::End::Ended => {}
                format::End::Cut { at } => {
                    return Err(ReplayError::Unended {
                        path: path.clone(),
                        at,
                    });
                }
                format::End::NoHeader => return Err(ReplayError::NoHeader(path.clone())),
            }
        }
        for op in &segment.ops {
            match *op {
                Op::Put { tree, key, value } => {
                    db.open_tree(tree)?.insert(key, value)?;
                }
                Op::Remove { tree, key } => {
                    db.open_tree(tree)?.remove(key)?;
                }
                Op::Clear { tree } => db.open_tree(tree)?.clear()?,
            }
        }
    }
    let next = match found.last() {
        None => 1,
        Some((number, path)) => number
            .checked_add(1)
            .ok_or_else(|| ReplayError::LastNumber(path.clone()))?,
    };
    // A kept file holds frames of earlier segments; numbers start again after those found,
    // which may be below them (none found): never reuse it in another process.
    remove_if_there(&dir.join(FILLING))?;
    remove_if_there(&dir.join(SPARE))?;
    if !found.is_empty() {
        syncer.flush().map_err(ReplayError::Flush)?;
        let paths: Vec<PathBuf> = found.into_iter().map(|(_, path)| path).collect();
        remove_oldest_first(dir, &paths)?;
    }
    Ok(next)
}
