//! The write-ahead log in front of sled: each write's after-image, appended and synced in batches.
//!
//! A write is applied to sled and its record appended to an in-memory buffer under one lock
//! ([`Shared::lock`]), so the log holds the writes to each key in the order sled applied them.
//! One writer thread takes everything buffered so far, writes it to the current segment as
//! one frame ([`format`]) with one `write` and one `fdatasync`, then answers every commit
//! that was waiting for it: one sync per batch, with no other thread in between (sled's own
//! flush hands its buffers to a pool of I/O threads and syncs twice). A commit that finds
//! nothing unsynced returns at once.
//!
//! Segments are checkpointed, not kept: every [`SEGMENT_AGE`] (or [`SEGMENT_BYTES`]) the
//! writer ends the segment, starts the next and hands the old one to a checkpoint thread,
//! which flushes sled (and syncs what it leaves out, [`super::sync`]) and then deletes the
//! old segments. Every record in them was applied to sled before they were closed, so
//! before that flush began: sled holds them on disk when they are deleted. One of them is
//! kept as the next segment's file, filled to [`SEGMENT_BYTES`] beforehand: writing inside a
//! file's length, `fdatasync` has no size to record, which on this machine's ext4 halves its
//! cost (BENCHMARKS.md). On open, the segments left are replayed into sled in order (each
//! record sets or removes one key, so replaying twice gives the same result), sled is
//! flushed, and they are deleted. A frame cut short or failing its checksum ends the replay;
//! a crash can only cut the last one written, which no commit had waited for (the writer
//! writes a frame once every earlier one is synced). So a frame of the same segment that
//! passes its checksum after one that fails proves damage, not a crash: the open is refused.

use std::{
    fs::File,
    hash::{BuildHasher, RandomState},
    io,
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
    sync::{
        Arc, Condvar, Mutex, MutexGuard, PoisonError,
        atomic::{AtomicU64, Ordering},
        mpsc,
    },
    thread,
    time::{Duration, Instant},
};

use tokio::sync::oneshot;

use super::{CommitError, sync::Syncer};

mod format;
mod replay;
mod rounds;

pub(super) use format::Op;
#[cfg(test)]
pub(super) use format::{frame, header};
pub(super) use replay::replay;
use rounds::Rounds;

/// The directory, inside the database's, that holds the log's segments.
pub(super) const LOG_DIR: &str = "log";

/// A segment older than this is checkpointed at the writer's next round.
pub(super) const SEGMENT_AGE: Duration = Duration::from_secs(2);

/// A segment larger than this is checkpointed at the writer's next round.
pub(super) const SEGMENT_BYTES: u64 = 16 << 20;

/// How long the writer sleeps when nobody waits, before writing what was buffered anyway.
const IDLE: Duration = Duration::from_secs(1);

pub(super) type Waiter = oneshot::Sender<Result<(), CommitError>>;

/// From how many waiters on the list the ones that went away are dropped (see `commit`).
pub(super) const PRUNE_FROM: usize = 1024;

/// The file kept for the next segment, filled to [`SEGMENT_BYTES`]; and the name it is filled
/// under (a crash leaves a half-filled one there, never under `SPARE`).
const SPARE: &str = "spare";
const FILLING: &str = "spare.filling";

/// The segments in `dir`, in the order they were written.
fn segments(dir: &Path) -> io::Result<Vec<(u64, PathBuf)>> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let number = name
            .to_str()
            .and_then(|n| n.strip_suffix(".log"))
            .and_then(|n| n.parse::<u64>().ok());
        if let Some(number) = number {
            found.push((number, entry.path()));
        }
    }
    found.sort_unstable();
    Ok(found)
}

fn segment_path(dir: &Path, number: u64) -> PathBuf {
    dir.join(format!("{number:020}.log"))
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Deletes segments `paths` (oldest first), the directory synced after each deletion: a
/// power cut then leaves the newest ones, never an older one alone. With one sync after all
/// of them, a file system that keeps some deletions and not others (ext4 without a journal,
/// ext2) could keep an old segment and lose every newer one; with no later segment to show
/// a gap in the numbers, replay would put the old values back.
fn remove_oldest_first(dir: &Path, paths: &[PathBuf]) -> io::Result<()> {
    for path in paths {
        std::fs::remove_file(path)?;
        sync_dir(dir)?;
    }
    Ok(())
}

fn remove_if_there(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// What writers, committers and the log's threads share.
#[derive(Debug)]
pub(super) struct Shared {
    state: Mutex<State>,
    work: Condvar,
    /// How many records are on disk (the count of the last batch synced).
    synced: AtomicU64,
    /// The writer's rounds, timed: what decides whether writes are taken.
    pub(super) rounds: Rounds,
    /// Taken by the writer before each write: a test holds it to stall the disk.
    #[cfg(any(test, feature = "test-hooks"))]
    pub(super) stall: Mutex<()>,
}

#[derive(Default)]
pub(super) struct State {
    /// Records not handed to the writer yet.
    buf: Vec<u8>,
    /// How many records were ever buffered.
    end: u64,
    waiters: Vec<Waiter>,
    closing: bool,
    /// The first failure, answered to every commit after it.
    failed: Option<CommitError>,
}

/// Sizes and counts only: the buffer holds stored records (idempotency responses, key hashes),
/// which have no place in a log line that prints a store.
impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("buffered_bytes", &self.buf.len())
            .field("end", &self.end)
            .field("waiters", &self.waiters.len())
            .field("closing", &self.closing)
            .field("failed", &self.failed)
            .finish()
    }
}

impl State {
    /// Whether a decision may still be applied under this lock: not once the log failed
    /// (its records would be dropped, see `push`).
    pub(super) fn taking(&self) -> sled::Result<()> {
        match self.failed {
            None => Ok(()),
            Some(_) => Err(rounds::failed()),
        }
    }

    /// Buffers one record. Call with the lock held since the write was applied to sled.
    pub(super) fn push(&mut self, op: Op<'_>) {
        if self.failed.is_none() {
            op.encode(&mut self.buf);
            self.end += 1;
        }
    }
}

impl Shared {
    /// The lock writers hold from applying a write to sled to buffering its record.
    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits until every record buffered before this call is on disk.
    pub(super) async fn commit(&self) -> Result<(), CommitError> {
        let rx = {
            let mut state = self.lock();
            if let Some(failed) = &state.failed {
                return Err(failed.clone());
            }
            if self.synced.load(Ordering::Acquire) >= state.end {
                return Ok(());
            }
            let (tx, rx) = oneshot::channel();
            if state.waiters.is_empty() {
                self.work.notify_one();
            }
            // While the disk stalls, commits that gave up (`commit_within`) leave their
            // waiter behind and their callers retry: drop those that nobody waits on any
            // more, at each doubling of the list, so it holds about what is waited on.
            let waiting = state.waiters.len();
            if waiting >= PRUNE_FROM && waiting.is_power_of_two() {
                state.waiters.retain(|waiter| !waiter.is_closed());
            }
            state.waiters.push(tx);
            rx
        };
        rx.await.map_err(|_| CommitError::Closed)?
    }

    /// Whether every record buffered so far is on disk (and the log has not failed).
    pub(super) fn all_synced(&self) -> bool {
        let state = self.lock();
        state.failed.is_none() && self.synced.load(Ordering::Acquire) >= state.end
    }

    #[cfg(test)]
    pub(super) fn waiting(&self) -> usize {
        self.lock().waiters.len()
    }

    /// Fails the log as a failed write would, for tests.
    #[cfg(any(test, feature = "test-hooks"))]
    pub(super) fn fail_for_test(&self) {
        let e = CommitError::Log(Arc::new(io::Error::other("failed for a test")));
        for waiter in self.fail(e.clone()) {
            let _ = waiter.send(Err(e.clone()));
        }
    }

    fn fail(&self, e: CommitError) -> Vec<Waiter> {
        self.rounds.fail();
        let mut state = self.lock();
        state.failed.get_or_insert(e);
        state.buf = Vec::new();
        std::mem::take(&mut state.waiters)
    }
}

/// The log's two threads; dropping it writes what is buffered, checkpoints everything and
/// deletes the segments (a clean shutdown leaves none).
#[derive(Debug)]
pub(super) struct Log {
    pub(super) shared: Arc<Shared>,
    dir: PathBuf,
    syncer: Arc<Syncer>,
    writer: Option<thread::JoinHandle<()>>,
    checkpointer: Option<thread::JoinHandle<()>>,
}

/// When the writer starts a new segment, the size a kept segment file is filled to, and how
/// long one round of the writer may last before writes are refused.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    pub(super) age: Duration,
    pub(super) bytes: u64,
    pub(super) stall: Duration,
}

impl Log {
    /// Starts writing segment `next` in `dir` (after [`replay`]).
    pub(super) fn start(
        dir: PathBuf,
        next: u64,
        syncer: Arc<Syncer>,
        limits: Limits,
    ) -> io::Result<Self> {
        let shared = Arc::new(Shared {
            state: Mutex::default(),
            work: Condvar::new(),
            synced: AtomicU64::new(0),
            rounds: Rounds::new(limits.stall),
            #[cfg(any(test, feature = "test-hooks"))]
            stall: Mutex::default(),
        });
        let segment = Segment::create(&dir, next)?;
        let (closed_tx, closed_rx) = mpsc::channel::<u64>();
        let checkpointer = {
            let (shared, syncer, dir) = (shared.clone(), syncer.clone(), dir.clone());
            thread::Builder::new()
                .name("fence-checkpoint".into())
                .spawn(move || {
                    while let Ok(first) = closed_rx.recv() {
                        let upto = closed_rx.try_iter().fold(first, u64::max);
                        if let Err(e) = checkpoint(&syncer, &dir, upto, Some(limits.bytes)) {
                            for waiter in shared.fail(e.clone()) {
                                let _ = waiter.send(Err(e.clone()));
                            }
                            return;
                        }
                    }
                })?
        };
        let writer = {
            let (shared, dir) = (shared.clone(), dir.clone());
            thread::Builder::new()
                .name("fence-log".into())
                .spawn(move || write_loop(&shared, &dir, segment, &closed_tx, limits))?
        };
        Ok(Self {
            shared,
            dir,
            syncer,
            writer: Some(writer),
            checkpointer: Some(checkpointer),
        })
    }
}

impl Drop for Log {
    fn drop(&mut self) {
        self.shared.lock().closing = true;
        self.shared.work.notify_one();
        // The writer writes what is left and ends, dropping the checkpointer's channel.
        for thread in [self.writer.take(), self.checkpointer.take()]
            .into_iter()
            .flatten()
        {
            let _ = thread.join();
        }
        if self.shared.lock().failed.is_none()
            && checkpoint(&self.syncer, &self.dir, u64::MAX, None).is_ok()
        {
            let _ = remove_if_there(&self.dir.join(SPARE));
            let _ = sync_dir(&self.dir);
        }
    }
}

/// Flushes sled, then deletes every segment up to `upto`: their records were applied to
/// sled before they were closed, so before this flush began. With `keep`, the last of them
/// becomes the spare (when there is none), filled to `keep` bytes.
fn checkpoint(
    syncer: &Syncer,
    dir: &Path,
    upto: u64,
    keep: Option<u64>,
) -> Result<(), CommitError> {
    syncer.flush()?;
    let io = |e: io::Error| CommitError::Log(Arc::new(e));
    let mut done: Vec<PathBuf> = segments(dir)
        .map_err(io)?
        .into_iter()
        .filter(|(number, _)| *number <= upto)
        .map(|(_, path)| path)
        .collect();
    if done.is_empty() {
        return Ok(());
    }
    // The newest is kept for the next segment (when no file is kept yet) and goes last: the
    // others are deleted oldest first, so a crash in between leaves the newest ones in a
    // row, never a gap in the numbers (see `replay`).
    let kept = keep
        .filter(|_| !dir.join(SPARE).exists())
        .and_then(|bytes| done.pop().map(|path| (path, bytes)));
    remove_oldest_first(dir, &done).map_err(io)?;
    if let Some((path, bytes)) = kept {
        let filling = dir.join(FILLING);
        let made = std::fs::rename(&path, &filling)
            .and_then(|()| fill(&filling, bytes))
            .and_then(|()| std::fs::rename(&filling, dir.join(SPARE)));
        if made.is_err() {
            // Only a speed-up (a full disk, say): the next segment is a new file instead.
            remove_if_there(&filling).map_err(io)?;
            remove_if_there(&path).map_err(io)?;
        }
    }
    sync_dir(dir).map_err(io)?;
    Ok(())
}

/// Writes zeros from the end of the file at `path` to `bytes`, and syncs it.
fn fill(path: &Path, bytes: u64) -> io::Result<()> {
    let file = File::options().write(true).open(path)?;
    let zeros = vec![0u8; 1 << 20];
    let mut at = file.metadata()?.len();
    while at < bytes {
        let n = usize::try_from((bytes - at).min(zeros.len() as u64)).unwrap_or(zeros.len());
        file.write_all_at(&zeros[..n], at)?;
        at += n as u64;
    }
    file.sync_all()
}

/// The segment being written.
struct Segment {
    number: u64,
    salt: u64,
    file: File,
    /// Where the next frame goes.
    len: u64,
    opened: Instant,
    frame: Vec<u8>,
}

impl Segment {
    /// Segment `number`, in the spare's file when there is one, else in a new one; its
    /// directory entry on disk before any record is.
    fn create(dir: &Path, number: u64) -> io::Result<Self> {
        let path = segment_path(dir, number);
        let file = match std::fs::rename(dir.join(SPARE), &path) {
            Ok(()) => File::options().write(true).open(&path)?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                File::options().create_new(true).write(true).open(&path)?
            }
            Err(e) => return Err(e),
        };
        // A salt no earlier use of the file (nor any client) could know: std's hasher keys
        // are drawn from the operating system's randomness.
        let salt = RandomState::new().hash_one(number);
        file.write_all_at(&format::header(salt), 0)?;
        file.sync_data()?;
        sync_dir(dir)?;
        Ok(Self {
            number,
            salt,
            file,
            len: format::SEGMENT_HEADER as u64,
            opened: Instant::now(),
            frame: Vec::new(),
        })
    }

    /// Whether a frame was written since the header.
    fn has_frames(&self) -> bool {
        self.len > format::SEGMENT_HEADER as u64
    }

    /// Writes `body` as one frame (empty: the segment's end) and syncs it.
    fn append(&mut self, body: &[u8]) -> io::Result<()> {
        if u32::try_from(body.len()).is_err() {
            // The frame's length is 32 bits (sled's values are far smaller; so is a batch).
            return Err(io::Error::other(
                "a batch of 4 GiB or more cannot be logged",
            ));
        }
        self.frame.clear();
        format::frame(self.number, self.salt, body, &mut self.frame);
        self.file.write_all_at(&self.frame, self.len)?;
        self.file.sync_data()?;
        self.len += self.frame.len() as u64;
        Ok(())
    }
}

/// Ends `segment` and starts the next; answers the ended one's number.
fn rotate(dir: &Path, segment: &mut Segment) -> io::Result<u64> {
    // On disk before the next segment exists: replay takes a segment without its end for
    // the last one written.
    segment.append(&[])?;
    let number = segment
        .number
        .checked_add(1)
        .ok_or_else(|| io::Error::other("the log's segment numbers are used up"))?;
    let next = Segment::create(dir, number)?;
    Ok(std::mem::replace(segment, next).number)
}

fn write_loop(
    shared: &Shared,
    dir: &Path,
    mut segment: Segment,
    closed: &mpsc::Sender<u64>,
    limits: Limits,
) {
    let mut batch = Vec::new();
    let fail = |e: io::Error, waiters: Vec<Waiter>| {
        let e = CommitError::Log(Arc::new(e));
        for waiter in waiters.into_iter().chain(shared.fail(e.clone())) {
            let _ = waiter.send(Err(e.clone()));
        }
    };
    loop {
        let (end, waiters, closing) = {
            let mut state = shared.lock();
            if state.waiters.is_empty() && !state.closing {
                state = shared
                    .work
                    .wait_timeout(state, IDLE)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
            if state.failed.is_some() {
                return;
            }
            std::mem::swap(&mut batch, &mut state.buf);
            (state.end, std::mem::take(&mut state.waiters), state.closing)
        };
        shared.rounds.begin();
        #[cfg(any(test, feature = "test-hooks"))]
        drop(shared.stall.lock().unwrap_or_else(PoisonError::into_inner));
        if !batch.is_empty() {
            if let Err(e) = segment.append(&batch) {
                return fail(e, waiters);
            }
            batch.clear();
        }
        shared.rounds.end();
        shared.synced.store(end, Ordering::Release);
        for waiter in waiters {
            // A waiter that went away (its request was cancelled) needs no answer.
            let _ = waiter.send(Ok(()));
        }
        if closing {
            return;
        }
        let due = segment.len >= limits.bytes
            || (segment.has_frames() && segment.opened.elapsed() >= limits.age);
        if due {
            shared.rounds.begin();
            let rotated = rotate(dir, &mut segment);
            shared.rounds.end();
            match rotated {
                Ok(ended) => {
                    let _ = closed.send(ended);
                }
                Err(e) => return fail(e, Vec::new()),
            }
        }
    }
}
