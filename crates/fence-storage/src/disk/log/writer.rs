//! The log's writer threads: batches written to the segment in order, their syncs overlapping.
//!
//! A round takes everything buffered so far and the commits waiting for it, writes it as
//! one frame, syncs the file, and answers those commits. Up to [`IN_FLIGHT`] rounds run at
//! once, one per writer thread: a commit that arrives while a sync is running starts its own
//! sync at once instead of waiting for that one to end and then for its own (the disk takes
//! two `fdatasync` calls on one file in parallel: BENCHMARKS.md, "Overlapping syncs").
//!
//! Three orders keep this as safe as one writer:
//! - **Rounds write their frames in the order they took their batches** (`Segment::next`),
//!   so the file holds the records in the order sled applied them.
//! - **Rounds are answered in the order they took their batches** (`State::done`), each after
//!   its own sync returned and after every earlier round was answered. A sync covers every
//!   frame written before it began, so a round answered has its frame and every earlier one
//!   on disk; a crash can cut short or lose only frames of rounds not answered yet, and
//!   replay stops at the first of those (its checksum fails), dropping only records no
//!   commit was answered for. A round whose sync returned while an earlier one failed is
//!   answered with the failure: its frame follows one that may be lost.
//! - **A segment is ended and the next one started only while no round is running**
//!   (`State::rotating`), so no frame is written after the segment's end.

use std::{
    fs::File,
    hash::{BuildHasher, RandomState},
    io,
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
    sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, atomic::Ordering, mpsc},
    time::Instant,
};

use super::{CommitError, IDLE, Limits, Shared, Waiter, format, segment_path, sync_dir};

/// How many rounds (a batch's write and sync) may run at once: the number of writer threads.
pub(super) const IN_FLIGHT: u64 = 2;

/// What the writer threads share besides [`Shared`]: the segment being written.
pub(super) struct Writer {
    shared: Arc<Shared>,
    dir: PathBuf,
    limits: Limits,
    segment: Mutex<Segment>,
    /// Signalled when a round has written its frame (or found it had none): the next may.
    written: Condvar,
    /// Ended segments, to the checkpoint thread; it stops when the last writer thread ends.
    closed: mpsc::Sender<u64>,
}

/// One round: the batch's number in the order batches were taken, the count of records
/// it brings to disk, and the commits it answers.
struct Round {
    number: u64,
    end: u64,
    waiters: Vec<Waiter>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Writer {
    pub(super) fn new(
        shared: Arc<Shared>,
        dir: PathBuf,
        limits: Limits,
        segment: Segment,
        closed: mpsc::Sender<u64>,
    ) -> Self {
        Self {
            shared,
            dir,
            limits,
            segment: Mutex::new(segment),
            written: Condvar::new(),
            closed,
        }
    }

    /// One writer thread's life: rounds until the log closes (everything buffered written)
    /// or fails.
    pub(super) fn run(&self) {
        let mut batch = Vec::new();
        while let Some(round) = self.take(&mut batch) {
            let written = self.write(round.number, &batch);
            batch.clear();
            if !self.finish(round, written) {
                return;
            }
            if let Err(e) = self.rotate_if_due() {
                self.fail(e, Vec::new());
                return;
            }
        }
    }

    /// Waits for work and a free place among the rounds, then takes everything buffered
    /// and every waiting commit; `None` when the log failed, or closed with nothing left.
    fn take(&self, batch: &mut Vec<u8>) -> Option<Round> {
        let shared = &*self.shared;
        let mut state = shared.lock();
        let mut idle = false;
        loop {
            if state.failed.is_some() {
                return None;
            }
            let left = !state.buf.is_empty() || !state.waiters.is_empty();
            if state.closing && !left {
                return None;
            }
            let free = !state.rotating && state.started - state.done < IN_FLIGHT;
            // When nobody waits, what was buffered is written anyway after `IDLE` (and an
            // old segment ended: see `rotate_if_due`).
            if free && (!state.waiters.is_empty() || (state.closing && left) || idle) {
                break;
            }
            let (next, waited) = shared
                .work
                .wait_timeout(state, IDLE)
                .unwrap_or_else(PoisonError::into_inner);
            state = next;
            idle = waited.timed_out();
        }
        std::mem::swap(batch, &mut state.buf);
        let number = state.started;
        state.started += 1;
        let now = shared.rounds.now();
        if state.starts.is_empty() {
            shared.rounds.began_at(now);
        }
        state.starts.push_back(now);
        Some(Round {
            number,
            end: state.end,
            waiters: std::mem::take(&mut state.waiters),
        })
    }

    /// Writes round `number`'s frame after every earlier round's, then syncs the file.
    fn write(&self, number: u64, batch: &[u8]) -> io::Result<()> {
        #[cfg(any(test, feature = "test-hooks"))]
        drop(lock(&self.shared.stall));
        let file = {
            let mut segment = lock(&self.segment);
            while segment.next != number {
                segment = self
                    .written
                    .wait(segment)
                    .unwrap_or_else(PoisonError::into_inner);
            }
            let file = if batch.is_empty() {
                Ok(None)
            } else {
                segment.write(batch).map(|()| Some(segment.file.clone()))
            };
            // Also after a failed write: the next round finds the log failed and stops.
            segment.next += 1;
            self.written.notify_all();
            file?
        };
        match file {
            Some(file) => {
                #[cfg(test)]
                self.shared.before_sync(batch)?;
                file.sync_data()
            }
            None => Ok(()),
        }
    }

    /// Answers `round` once every earlier round was: with `written`'s failure, or an earlier
    /// one's, or `Ok`. Answers whether the thread goes on.
    fn finish(&self, round: Round, written: io::Result<()>) -> bool {
        if let Err(e) = written {
            self.fail(e, round.waiters);
            return false;
        }
        let shared = &*self.shared;
        let mut state = shared.lock();
        while state.done != round.number && state.failed.is_none() {
            state = shared
                .turn
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
        if let Some(e) = state.failed.clone() {
            drop(state);
            for waiter in round.waiters {
                let _ = waiter.send(Err(e.clone()));
            }
            return false;
        }
        state.done += 1;
        state.starts.pop_front();
        shared
            .rounds
            .began_at(state.starts.front().copied().unwrap_or(0));
        shared.synced.store(round.end, Ordering::Release);
        shared.turn.notify_all();
        if state.closing {
            // A thread that waited for a free place may have nothing left to do: it ends.
            shared.work.notify_all();
        }
        drop(state);
        for waiter in round.waiters {
            // A waiter that went away (its request was cancelled) needs no answer.
            let _ = waiter.send(Ok(()));
        }
        true
    }

    /// Ends the segment and starts the next when it is old or large enough, once no round
    /// is running; another thread's rotation makes this one's unneeded.
    fn rotate_if_due(&self) -> io::Result<()> {
        if !self.due(&lock(&self.segment)) {
            return Ok(());
        }
        let shared = &*self.shared;
        let mut state = shared.lock();
        if state.closing || state.rotating || state.failed.is_some() {
            return Ok(());
        }
        state.rotating = true;
        while state.started != state.done && state.failed.is_none() {
            state = shared
                .turn
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
        if state.failed.is_some() {
            return Ok(());
        }
        drop(state);
        shared.rounds.begin();
        let rotated = {
            let mut segment = lock(&self.segment);
            if self.due(&segment) {
                rotate(&self.dir, &mut segment).map(Some)
            } else {
                Ok(None)
            }
        };
        shared.rounds.end();
        shared.lock().rotating = false;
        shared.work.notify_all();
        if let Some(ended) = rotated? {
            let _ = self.closed.send(ended);
        }
        Ok(())
    }

    fn due(&self, segment: &Segment) -> bool {
        segment.len >= self.limits.bytes
            || (segment.has_frames() && segment.opened.elapsed() >= self.limits.age)
    }

    fn fail(&self, e: io::Error, waiters: Vec<Waiter>) {
        let e = CommitError::Log(Arc::new(e));
        for waiter in waiters.into_iter().chain(self.shared.fail(e.clone())) {
            let _ = waiter.send(Err(e.clone()));
        }
    }
}

/// The segment being written.
pub(super) struct Segment {
    number: u64,
    salt: u64,
    file: Arc<File>,
    /// Where the next frame goes.
    len: u64,
    opened: Instant,
    frame: Vec<u8>,
    /// The round whose frame goes next.
    next: u64,
}

impl Segment {
    /// Segment `number`, in the spare's file when there is one, else in a new one; its
    /// directory entry on disk before any record is. Its frames are written by rounds from
    /// `next` on.
    pub(super) fn create(dir: &Path, number: u64, next: u64) -> io::Result<Self> {
        let path = segment_path(dir, number);
        let file = match std::fs::rename(dir.join(super::SPARE), &path) {
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
            file: Arc::new(file),
            len: format::SEGMENT_HEADER as u64,
            opened: Instant::now(),
            frame: Vec::new(),
            next,
        })
    }

    /// Whether a frame was written since the header.
    fn has_frames(&self) -> bool {
        self.len > format::SEGMENT_HEADER as u64
    }

    /// Writes `body` as one frame (empty: the segment's end), not synced.
    fn write(&mut self, body: &[u8]) -> io::Result<()> {
        if u32::try_from(body.len()).is_err() {
            // The frame's length is 32 bits (sled's values are far smaller; so is a batch).
            return Err(io::Error::other(
                "a batch of 4 GiB or more cannot be logged",
            ));
        }
        self.frame.clear();
        format::frame(self.number, self.salt, body, &mut self.frame);
        self.file.write_all_at(&self.frame, self.len)?;
        self.len += self.frame.len() as u64;
        Ok(())
    }
}

/// Ends `segment` and starts the next; answers the ended one's number. Only while no round
/// runs.
fn rotate(dir: &Path, segment: &mut Segment) -> io::Result<u64> {
    // On disk before the next segment exists: replay takes a segment without its end for
    // the last one written.
    segment.write(&[])?;
    segment.file.sync_data()?;
    let next = Segment::create(dir, segment.number + 1, segment.next)?;
    Ok(std::mem::replace(segment, next).number)
}
