//! What makes a sled flush durable: sled's own flush, then the syncs sled leaves out.
//!
//! sled 0.34 ends a flush on Linux with `sync_file_range(WAIT_BEFORE | WRITE | WAIT_AFTER)`,
//! which waits for the pages to reach the device but neither flushes the device's write cache
//! nor writes the file's size when the log grew: enough to survive the process being killed,
//! not a power cut or a kernel crash (`man 2 sync_file_range`: "there are no guarantees that
//! the data will be available after a crash"). And a value larger than a quarter of a segment
//! (128 KiB: a large stored response) goes to a file of its own under `blobs/`, written and
//! never synced. So after sled's flush, [`Syncer::flush`] syncs the blob files that are new or
//! changed since it last looked (and the `blobs` directory when one is new), then calls
//! `fdatasync` on sled's file, then syncs sled's directory (its snapshot renames and
//! deletions). The blobs go first: a log record pointing at a blob is durable only once the
//! blob is.
//!
//! A flush or sync that failed once fails every later commit too: after a failed `fsync` the
//! kernel may drop the pages it could not write and report the next `fsync` as a success, so
//! a later "durable" answer could rest on writes already lost. The process must be restarted
//! (as PostgreSQL does after a failed `fsync`); until then the store answers 503.

use std::{
    collections::HashMap,
    ffi::OsString,
    fs::File,
    io,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::SystemTime,
};

use super::CommitError;

/// The file sled 0.34 keeps its log and pages in, inside the database's directory.
pub(super) const SLED_LOG: &str = "db";

/// The directory sled 0.34 writes large values to, one file each.
const SLED_BLOBS: &str = "blobs";

/// sled's database with the handles its durability needs; shared by the flusher thread and
/// [`super::DurableDb::flush_now`].
#[derive(Debug)]
pub(super) struct Syncer {
    db: sled::Db,
    log: File,
    /// sled's directory: its snapshot files are renamed into place and old ones deleted.
    dir: PathBuf,
    blobs: PathBuf,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Each blob file as last synced: its length and modification time.
    blobs: HashMap<OsString, (u64, Option<SystemTime>)>,
    /// The first failure, answered to every commit after it.
    failed: Option<CommitError>,
}

impl Syncer {
    /// For the database `db` in directory `path`.
    ///
    /// # Errors
    /// When sled's file cannot be opened.
    pub(super) fn new(db: sled::Db, path: &Path) -> io::Result<Self> {
        Ok(Self {
            log: File::open(path.join(SLED_LOG))?,
            dir: path.to_path_buf(),
            blobs: path.join(SLED_BLOBS),
            db,
            state: Mutex::default(),
        })
    }

    /// Every write made before this call, on disk; or the first failure ever seen.
    pub(super) fn flush(&self) -> Result<(), CommitError> {
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(failed) = &state.failed {
            return Err(failed.clone());
        }
        let result = self.flush_and_sync(&mut state.blobs);
        if let Err(e) = &result {
            state.failed = Some(e.clone());
        }
        result
    }

    fn flush_and_sync(
        &self,
        synced: &mut HashMap<OsString, (u64, Option<SystemTime>)>,
    ) -> Result<(), CommitError> {
        let io = |e: io::Error| CommitError::Flush(Arc::new(sled::Error::Io(e)));
        self.db
            .flush()
            .map_err(|e| CommitError::Flush(Arc::new(e)))?;
        sync_blobs(&self.blobs, synced).map_err(io)?;
        self.log.sync_data().map_err(io)?;
        // sled renames a new snapshot into place and deletes older ones without syncing the
        // directory; a checkpoint then deletes the log segments this flush covers. On a
        // file system that does not keep metadata changes in order (ext4 without a journal,
        // for one), a crash could keep the deletion and lose the rename: sync the directory
        // so both are on disk before the segments go.
        File::open(&self.dir)
            .and_then(|dir| dir.sync_all())
            .map_err(io)
    }
}

/// Syncs the files of `dir` that are not in `synced` as they are now (new, or grown since:
/// a blob still being written when last seen), and `dir` itself when one is new; `synced`
/// becomes what is there now. A missing directory or a file gone meanwhile is not an error.
fn sync_blobs(
    dir: &Path,
    synced: &mut HashMap<OsString, (u64, Option<SystemTime>)>,
) -> io::Result<()> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let mut now = HashMap::with_capacity(synced.len());
    let mut new_file = false;
    for entry in entries {
        let entry = entry?;
        let meta = match entry.metadata() {
            Ok(meta) => meta,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        let seen = (meta.len(), meta.modified().ok());
        let name = entry.file_name();
        match synced.get(&name) {
            Some(was) if *was == seen => {}
            was => {
                match File::open(entry.path()) {
                    Ok(file) => file.sync_data()?,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(e),
                }
                new_file |= was.is_none();
            }
        }
        now.insert(name, seen);
    }
    if new_file {
        File::open(dir)?.sync_all()?;
    }
    *synced = now;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blob_files_are_synced_when_new_or_grown_and_forgotten_when_gone() {
        let dir = tempfile::tempdir().unwrap();
        let mut synced = HashMap::new();
        sync_blobs(&dir.path().join("absent"), &mut synced).expect("no directory: nothing to do");
        std::fs::write(dir.path().join("1"), b"abc").unwrap();
        sync_blobs(dir.path(), &mut synced).unwrap();
        assert_eq!(synced[&OsString::from("1")].0, 3);
        std::fs::write(dir.path().join("1"), b"abcdef").unwrap();
        std::fs::write(dir.path().join("2"), b"x").unwrap();
        sync_blobs(dir.path(), &mut synced).unwrap();
        assert_eq!(
            synced[&OsString::from("1")].0,
            6,
            "a grown file is seen again"
        );
        assert!(synced.contains_key(&OsString::from("2")));
        std::fs::remove_file(dir.path().join("1")).unwrap();
        sync_blobs(dir.path(), &mut synced).unwrap();
        assert_eq!(synced.keys().collect::<Vec<_>>(), [&OsString::from("2")]);
    }
}
