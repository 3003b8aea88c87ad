//! The write-ahead log in front of sled: each write's after-image, appended and synced in batches.
//!
//! A write is applied to sled and its record appended to an in-memory buffer under one lock
//! ([`Shared::lock`]), so the log holds the writes to each key in the order sled applied them.
//! One writer thread takes everything buffered so far, appends it to the current segment
//! file with one `write` and one `fdatasync`, then answers every commit that was waiting for
//! it: one sync per batch, with no other thread in between (sled's own flush hands its
//! buffers to a pool of I/O threads and syncs twice). A commit that finds nothing unsynced
//! returns at once.
//!
//! Segments are checkpointed, not kept: every [`SEGMENT_AGE`] (or [`SEGMENT_BYTES`]) the
//! writer starts a new segment and hands the old one to a checkpoint thread, which flushes
//! sled (and syncs what it leaves out, [`super::sync`]) and then deletes the old segments.
//! Every record in them was applied to sled before they were closed, so before that flush
//! began: sled holds them on disk when they are deleted. On open, the segments left are
//! replayed into sled in order (each record sets or removes one key, so replaying twice
//! gives the same result), sled is flushed, and they are deleted. A record cut short or
//! failing its checksum ends the replay; it can only be the last one written, which no
//! commit had waited for.

use std::{
    fs::File,
    io::{self, Write},
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

/// The directory, inside the database's, that holds the log's segments.
pub(super) const LOG_DIR: &str = "log";

/// A segment older than this is checkpointed at the writer's next round.
pub(super) const SEGMENT_AGE: Duration = Duration::from_secs(2);

/// A segment larger than this is checkpointed at the writer's next round.
pub(super) const SEGMENT_BYTES: u64 = 16 << 20;

/// How long the writer sleeps when nobody waits, before writing what was buffered anyway.
const IDLE: Duration = Duration::from_secs(1);

/// Each record's header: the payload's length and its CRC-32, 4 bytes each, little-endian.
const HEADER: usize = 8;

pub(super) type Waiter = oneshot::Sender<Result<(), CommitError>>;

/// One write, as the log records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Op<'a> {
    /// `key` now holds `value` in `tree`.
    Put {
        tree: &'a [u8],
        key: &'a [u8],
        value: &'a [u8],
    },
    /// `key` is gone from `tree`.
    Remove { tree: &'a [u8], key: &'a [u8] },
    /// `tree` is empty.
    Clear { tree: &'a [u8] },
}

const PUT: u8 = 1;
const REMOVE: u8 = 2;
const CLEAR: u8 = 3;

impl Op<'_> {
    /// Appends this record (header and payload) to `buf`.
    pub(super) fn encode(&self, buf: &mut Vec<u8>) {
        let start = buf.len();
        buf.extend_from_slice(&[0; HEADER]);
        let (kind, tree, key, value) = match *self {
            Op::Put { tree, key, value } => (PUT, tree, Some(key), Some(value)),
            Op::Remove { tree, key } => (REMOVE, tree, Some(key), None),
            Op::Clear { tree } => (CLEAR, tree, None, None),
        };
        buf.push(kind);
        // Tree names are ours and short (`DurableDb::tree` refuses longer ones).
        buf.push(u8::try_from(tree.len()).unwrap_or(u8::MAX));
        buf.extend_from_slice(&tree[..tree.len().min(255)]);
        for part in [key, value].into_iter().flatten() {
            buf.extend_from_slice(&len32(part.len()).to_le_bytes());
            buf.extend_from_slice(part);
        }
        let payload = &buf[start + HEADER..];
        let (len, crc) = (len32(payload.len()), crc32fast::hash(payload));
        buf[start..start + 4].copy_from_slice(&len.to_le_bytes());
        buf[start + 4..start + HEADER].copy_from_slice(&crc.to_le_bytes());
    }
}

/// A length as the log stores it. sled keeps keys and values far below 4 GiB.
fn len32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// The records at the start of `bytes`, up to the first one cut short or damaged, and how many
/// bytes they take.
pub(super) fn decode(bytes: &[u8]) -> (Vec<Op<'_>>, usize) {
    let mut ops = Vec::new();
    let mut at = 0;
    while let Some((op, next)) = decode_one(bytes, at) {
        ops.push(op);
        at = next;
    }
    (ops, at)
}

fn decode_one(bytes: &[u8], at: usize) -> Option<(Op<'_>, usize)> {
    let word = |i: usize| -> Option<u32> {
        Some(u32::from_le_bytes(bytes.get(i..i + 4)?.try_into().ok()?))
    };
    let len = usize::try_from(word(at)?).ok()?;
    let crc = word(at + 4)?;
    let start = at + HEADER;
    let payload = bytes.get(start..start.checked_add(len)?)?;
    if crc32fast::hash(payload) != crc {
        return None;
    }
    let (&kind, rest) = payload.split_first()?;
    let (&tree_len, rest) = rest.split_first()?;
    let (tree, mut rest) = rest.split_at_checked(usize::from(tree_len))?;
    let mut part = || -> Option<&[u8]> {
        let (n, tail) = rest.split_first_chunk::<4>()?;
        let (part, tail) = tail.split_at_checked(usize::try_from(u32::from_le_bytes(*n)).ok()?)?;
        rest = tail;
        Some(part)
    };
    let op = match kind {
        PUT => Op::Put {
            tree,
            key: part()?,
            value: part()?,
        },
        REMOVE => Op::Remove { tree, key: part()? },
        CLEAR => Op::Clear { tree },
        _ => return None,
    };
    rest.is_empty().then_some((op, start + len))
}

/// Why the log left on disk could not be replayed.
#[derive(Debug, thiserror::Error)]
pub(super) enum ReplayError {
    #[error("cannot read or remove the log")]
    Io(#[from] io::Error),
    #[error("cannot write the log's records to sled")]
    Sled(#[from] sled::Error),
    #[error(
        "the log segment {0} is damaged before its end (only the last segment's last record can be cut short by a crash)"
    )]
    Damaged(PathBuf),
    #[error("cannot flush sled after replaying the log")]
    Flush(#[source] CommitError),
}

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

/// Replays the segments in `dir` into `db`, makes sled durable, deletes them; answers how
/// many records were replayed and the number the next segment takes.
pub(super) fn replay(
    db: &sled::Db,
    syncer: &Syncer,
    dir: &Path,
) -> Result<(usize, u64), ReplayError> {
    let found = segments(dir)?;
    let mut replayed = 0;
    for (i, (_, path)) in found.iter().enumerate() {
        let bytes = std::fs::read(path)?;
        let (ops, used) = decode(&bytes);
        if used < bytes.len() && i + 1 < found.len() {
            return Err(ReplayError::Damaged(path.clone()));
        }
        for op in &ops {
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
        replayed += ops.len();
    }
    let next = found.last().map_or(1, |(n, _)| n.saturating_add(1));
    if !found.is_empty() {
        syncer.flush().map_err(ReplayError::Flush)?;
        for (_, path) in &found {
            std::fs::remove_file(path)?;
        }
        sync_dir(dir)?;
    }
    Ok((replayed, next))
}

/// What writers, committers and the log's threads share.
#[derive(Debug)]
pub(super) struct Shared {
    state: Mutex<State>,
    work: Condvar,
    /// How many records are on disk (the count of the last batch synced).
    synced: AtomicU64,
}

#[derive(Debug, Default)]
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

impl State {
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
            state.waiters.push(tx);
            rx
        };
        rx.await.map_err(|_| CommitError::Closed)?
    }

    fn fail(&self, e: CommitError) -> Vec<Waiter> {
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

/// When the writer starts a new segment.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    pub(super) age: Duration,
    pub(super) bytes: u64,
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
                        if let Err(e) = checkpoint(&syncer, &dir, upto) {
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
        if self.shared.lock().failed.is_none() {
            let _ = checkpoint(&self.syncer, &self.dir, u64::MAX);
        }
    }
}

/// Flushes sled, then deletes every segment up to `upto`: their records were applied to
/// sled before they were closed, so before this flush began.
fn checkpoint(syncer: &Syncer, dir: &Path, upto: u64) -> Result<(), CommitError> {
    syncer.flush()?;
    let io = |e: io::Error| CommitError::Log(Arc::new(e));
    let mut removed = false;
    for (number, path) in segments(dir).map_err(io)? {
        if number <= upto {
            std::fs::remove_file(path).map_err(io)?;
            removed = true;
        }
    }
    if removed {
        sync_dir(dir).map_err(io)?;
    }
    Ok(())
}

/// The segment being written.
struct Segment {
    number: u64,
    file: File,
    len: u64,
    opened: Instant,
}

impl Segment {
    /// A new, empty segment, its directory entry on disk before any record is.
    fn create(dir: &Path, number: u64) -> io::Result<Self> {
        let file = File::options()
            .create_new(true)
            .append(true)
            .open(segment_path(dir, number))?;
        sync_dir(dir)?;
        Ok(Self {
            number,
            file,
            len: 0,
            opened: Instant::now(),
        })
    }

    fn append(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.file.write_all(bytes)?;
        self.file.sync_data()?;
        self.len += bytes.len() as u64;
        Ok(())
    }
}

fn write_loop(
    shared: &Shared,
    dir: &Path,
    mut segment: Segment,
    closed: &mpsc::Sender<u64>,
    limits: Limits,
) {
    let mut batch = Vec::new();
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
        let written = if batch.is_empty() {
            Ok(())
        } else {
            segment.append(&batch)
        };
        batch.clear();
        if let Err(e) = written {
            let e = CommitError::Log(Arc::new(e));
            for waiter in waiters.into_iter().chain(shared.fail(e.clone())) {
                let _ = waiter.send(Err(e.clone()));
            }
            return;
        }
        shared.synced.store(end, Ordering::Release);
        for waiter in waiters {
            // A waiter that went away (its request was cancelled) needs no answer.
            let _ = waiter.send(Ok(()));
        }
        if closing {
            return;
        }
        let due = segment.len >= limits.bytes
            || (segment.len > 0 && segment.opened.elapsed() >= limits.age);
        if due {
            match Segment::create(dir, segment.number + 1) {
                Ok(next) => {
                    let old = std::mem::replace(&mut segment, next);
                    let _ = closed.send(old.number);
                }
                Err(e) => {
                    let e = CommitError::Log(Arc::new(e));
                    for waiter in shared.fail(e.clone()) {
                        let _ = waiter.send(Err(e.clone()));
                    }
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoded(ops: &[Op<'_>]) -> Vec<u8> {
        let mut buf = Vec::new();
        for op in ops {
            op.encode(&mut buf);
        }
        buf
    }

    #[test]
    fn records_read_back_as_written_and_stop_at_the_first_damaged_one() {
        let ops = [
            Op::Put {
                tree: b"leases",
                key: b"job-1",
                value: &[7; 300],
            },
            Op::Remove {
                tree: b"leases",
                key: b"",
            },
            Op::Clear { tree: b"stamps" },
            Op::Put {
                tree: b"",
                key: b"k",
                value: b"",
            },
        ];
        let bytes = encoded(&ops);
        assert_eq!(decode(&bytes), (ops.to_vec(), bytes.len()));
        // Cut anywhere inside the last record: the others still read, the cut one does not.
        let last = encoded(&ops[..3]).len();
        for cut in last..bytes.len() {
            assert_eq!(
                decode(&bytes[..cut]),
                (ops[..3].to_vec(), last),
                "cut at {cut}"
            );
        }
        // One flipped bit anywhere in a record ends the replay before it.
        for at in 0..bytes.len() {
            let mut damaged = bytes.clone();
            damaged[at] ^= 0x10;
            let (read, used) = decode(&damaged);
            assert!(used <= at, "a record read past a damaged byte at {at}");
            assert_eq!(read, ops[..read.len()].to_vec());
        }
    }

    #[test]
    fn any_bytes_decode_without_panicking() {
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        for len in 0..2_000 {
            let bytes: Vec<u8> = (0..len % 97)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed as u8
                })
                .collect();
            let (_, used) = decode(&bytes);
            assert!(used <= bytes.len());
        }
    }
}
