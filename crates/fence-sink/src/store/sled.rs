//! The default sink store: sled on local disk, every change durable before it is answered.

use std::{collections::HashMap, path::Path, sync::Arc, time::Duration};

use fence_core::{Generation, JobId};
use fence_storage::{
    clock::{Clock, SystemClock},
    disk::{DurableDb, OpenError, Tree},
};

use self::{forgetting::Forgetting, idempotency::record_job, running::Running, steps::Steps};
use super::{
    GenerationStore, IdleJob, IdlePage, Loaded, Prior, RunBounds, STAMP_AHEAD_MS, StoreError,
    Verdict, ms, record, stamp_due,
    stored::{StoredBytes, entry_len},
};

mod boot;
mod forgetting;
mod idempotency;
mod pair;
mod running;
mod steps;

/// Highest generations with their stamps (tree `generations`: job → generation, stamp and
/// the time of the last raise, 8 bytes big-endian each; records written before the raise was
/// kept have 16 bytes and count their stamp as the raise), the same stamps in time order
/// (tree `stamps`: stamp and job → nothing) and idempotency records (tree `idempotency`) in
/// a sled database; its `format` tree also keeps how long the processes on it let requests
/// run (module `running`) and whether they forgot jobs (module `forgetting`).
#[derive(Debug, Clone)]
pub struct SledStore {
    generations: Tree,
    stamps: Tree,
    records: Tree,
    /// The bytes `records` holds (keys and values): counted at the open, then kept at every
    /// write and removal.
    stored: Arc<StoredBytes>,
    format: Tree,
    running: Arc<Running>,
    forgetting: Arc<Forgetting>,
    db: DurableDb,
    clock: Arc<dyn Clock>,
    /// When this process opened the database (its clock): an earlier one had ended by then
    /// (the directory's lock is held while a process has it open).
    opened_ms: u64,
    /// The clock's monotonic reading at that time: how long ago the open was is measured
    /// on it, so a step of the wall clock since (NTP after a boot) does not cut short the
    /// wait for what an earlier process left running.
    opened_monotonic_ms: u64,
    /// Steps of the wall clock seen since: the offset each stamp was written under, for
    /// judging it idle.
    steps: Arc<Steps>,
    /// The time since the machine booted at the open, when the clock can read it (see
    /// `boot`).
    opened_boot: Option<fence_storage::clock::BootReading>,
}

/// How coarse the `stamps` tree's times are. A job's entry holds its stamp rounded *up* to a
/// whole second ([`stamp_bucket`]), so a job stamped again and again within one second (a
/// busy job bumped at every request) rewrites its entry once, not at every stamp: two sled
/// writes a bump fewer, 1.7× the bumps per second (BENCHMARKS.md, issue 32). Rounded up, an
/// entry is never earlier than the stamp: a job listed idle is idle; it is only listed up to
/// a second late. A stamp written after a job was listed is at least `STAMP_AHEAD_MS` past
/// the listing, so it always lands in a later second than the listed entry, and
/// [`GenerationStore::forget`] sees it.
const STAMP_BUCKET_MS: u64 = 1_000;

/// `touched_ms` rounded up to the next whole [`STAMP_BUCKET_MS`].
fn stamp_bucket(touched_ms: u64) -> u64 {
    touched_ms
        .div_ceil(STAMP_BUCKET_MS)
        .saturating_mul(STAMP_BUCKET_MS)
}

/// The tree saying which format the other trees are in.
fn db_format(db: &DurableDb) -> Result<Tree, OpenError> {
    db.tree("format")
}

/// The `format` key of the `stamps` tree, and its value since entries are whole seconds.
const STAMPS_KEY: &[u8] = b"stamps";
const STAMPS_FORMAT: &[u8] = b"whole-seconds";

/// The key of a job's entry in the `stamps` tree: its stamp's [`stamp_bucket`], then the job.
fn stamp_key(touched_ms: u64, job: &[u8]) -> Vec<u8> {
    let touched_ms = stamp_bucket(touched_ms);
    let mut k = Vec::with_capacity(8 + job.len());
    k.extend_from_slice(&touched_ms.to_be_bytes());
    k.extend_from_slice(job);
    k
}

fn io(e: impl Into<fence_storage::BoxError>) -> StoreError {
    StoreError::io(e)
}

impl SledStore {
    /// Opens (or creates) the generation and idempotency store in directory `path`, with
    /// idempotency records expiring on the system clock (as measured from the open on its
    /// monotonic reading: see [`open_with_clock`](Self::open_with_clock)).
    ///
    /// # Errors
    /// As [`DurableDb::open`].
    pub fn open(path: impl AsRef<Path>) -> Result<Self, OpenError> {
        Self::open_with_clock(path, Arc::new(SystemClock::new()))
    }

    /// Opens the store with idempotency records expiring on `clock`: its wall time at the
    /// open plus its monotonic time since, so that a step of the wall clock while the
    /// process runs is not time passed for a record in flight or kept.
    ///
    /// # Errors
    /// As [`DurableDb::open`]: [`OpenError::Locked`] while another process uses the
    /// directory, the other variants for permissions or corrupt files;
    /// [`OpenError::Record`] when a record of the processes before cannot be read (see
    /// [`clear_running_record`](Self::clear_running_record)).
    pub fn open_with_clock(
        path: impl AsRef<Path>,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, OpenError> {
        let path = path.as_ref();
        let db = DurableDb::open(path)?;
        let format = db_format(&db)?;
        let records = db.tree("idempotency")?;
        // Lengths only, nothing decoded: a day of records at a steady rate is many. Before
        // the clocks are read: a count that took T between the monotonic and the wall
        // reading would run the store's clock T ahead, and the restart hold T short. A read
        // that fails ends the open (sled's iterator may fail again at the same place).
        let mut jobs: HashMap<Box<[u8]>, u64> = HashMap::new();
        for item in records.iter() {
            let (k, v) = item.map_err(|source| OpenError::Sled {
                path: path.to_owned(),
                source,
            })?;
            let len = entry_len(&k, Some(&v)).unwrap_or(0);
            let job = jobs.entry(record_job(&k).into()).or_default();
            *job = job.saturating_add(u64::try_from(len).unwrap_or(u64::MAX));
        }
        let stored = StoredBytes::counted(jobs);
        // The two readings of the open, next to each other.
        let opened_monotonic_ms = clock.monotonic_ms();
        let opened_ms = clock.now_ms();
        let opened_boot = clock.since_boot();
        let store = Self {
            generations: db.tree("generations")?,
            stamps: db.tree("stamps")?,
            records,
            stored: Arc::new(stored),
            running: Arc::new(Running::open(&format, opened_monotonic_ms, path)?),
            forgetting: Arc::new(Forgetting::open(&format, path)),
            format,
            db,
            opened_ms,
            opened_monotonic_ms,
            steps: Arc::new(Steps::open(opened_ms)),
            opened_boot,
            clock,
        };
        store.restamp_after_a_step(opened_boot, path)?;
        store.repair_stamps(&store.format);
        Ok(store)
    }

    /// The store's clock now, as measured from the open on the clock's monotonic reading:
    /// `opened_ms` plus the time since. Stamps of an earlier process can only be compared
    /// with wall time, but within this process a step of the wall clock is not time passed.
    fn since_open_ms(&self) -> u64 {
        let since = self
            .clock
            .monotonic_ms()
            .saturating_sub(self.opened_monotonic_ms);
        self.opened_ms.saturating_add(since)
    }

    /// The time idempotency records are judged and written on: two readings, the wall
    /// clock and [`since_open_ms`](Self::since_open_ms) (the wall clock at the open plus the
    /// monotonic time since), a record judged live on the earlier and timed from the later,
    /// so that it lives while either clock says it does. On the wall clock alone, a step
    /// forward (NTP, a VM resumed or migrated) would expire a record in flight, and a retry
    /// with its key would reach the service while the first attempt still ran (or the purge
    /// would drop the record, and the first attempt's answer would find nothing to
    /// complete). On the anchored clock alone, the same step would come back at the next
    /// open: every record this process wrote would lag the wall clock the next process is
    /// anchored on by the step, and expire that much early. A step back holds a key, or
    /// keeps an answer, the step's size longer (liveness, never a second run).
    ///
    /// Until the unknown-outcome hold the processes before recorded has passed since the
    /// open, every in-flight record is live ([`record::Now::earlier_may_run`]): one they
    /// began may belong to a request still running at the service, and its time cannot be
    /// trusted after a step of the wall clock between its begin and this open (taken as
    /// time passed, it expired the record at the open, and a retry ran the effect again).
    fn records_now(&self) -> record::Now {
        let monotonic_ms = self.clock.monotonic_ms();
        record::Now::of(self.clock.now_ms(), self.since_open_ms())
            .holding_in_flight(self.running.before_may_run(monotonic_ms))
    }

    /// A crash between a job's write and its stamp's can leave the `stamps` tree short of a
    /// job (which would then never be forgotten) or holding an old stamp (skipped when
    /// read): when the counts differ, rebuild it from `generations`. Also when the tree is
    /// of a build before its entries were rounded to whole seconds ([`STAMPS_FORMAT`] not
    /// in `format`): its exact keys would never be found to be removed.
    fn repair_stamps(&self, format: &Tree) {
        let current = format
            .get(STAMPS_KEY)
            .ok()
            .flatten()
            .is_some_and(|v| *v == *STAMPS_FORMAT);
        if current && self.stamps.len() == self.generations.len() {
            return;
        }
        let _ = self.stamps.clear();
        for (job, value) in self.generations.iter().flatten() {
            if let Some(touched) = value.get(8..16).and_then(|b| <[u8; 8]>::try_from(b).ok()) {
                let _ = self
                    .stamps
                    .insert(stamp_key(u64::from_be_bytes(touched), &job), &[][..]);
            }
        }
        // After the entries: a crash before sled has both on disk rebuilds again.
        let _ = format.insert(STAMPS_KEY, STAMPS_FORMAT);
    }

    /// Removes the `running` record of the data directory `path` (no process may have it
    /// open) when it is damaged; one that reads is kept. Whether it removed it. Only safe
    /// once the longest request plus the unknown-outcome hold of the process before has
    /// passed since it stopped.
    ///
    /// # Errors
    /// As [`DurableDb::open`], or when the removal cannot be made durable.
    pub fn clear_running_record(path: impl AsRef<Path>) -> Result<bool, OpenError> {
        running::clear_running_record(path)
    }

    /// Flushes everything to disk now (graceful shutdown).
    ///
    /// # Errors
    /// When the flush fails.
    pub fn flush(&self) -> Result<(), StoreError> {
        self.db.flush_now().map_err(io)
    }

    /// How many jobs have a stored generation.
    pub fn job_count(&self) -> usize {
        self.generations.len()
    }

    /// A job's stored generation, stamp and last raise ((0, 0, 0) when none).
    fn decode_generation(
        job: &JobId,
        raw: Option<&[u8]>,
    ) -> Result<(Generation, u64, u64), StoreError> {
        let Some(b) = raw else {
            return Ok((Generation::ZERO, 0, 0));
        };
        let corrupt = || StoreError::Corrupt {
            job: job.clone(),
            reason: "generation record is not 16 or 24 bytes",
        };
        if b.len() != 16 && b.len() != 24 {
            return Err(corrupt());
        }
        let word = |i: usize| {
            b.get(i * 8..i * 8 + 8)
                .and_then(|s| <[u8; 8]>::try_from(s).ok())
                .map(u64::from_be_bytes)
                .ok_or_else(corrupt)
        };
        let touched = word(1)?;
        let raised = if b.len() == 24 { word(2)? } else { touched };
        Ok((Generation::new(word(0)?), touched, raised))
    }

    /// Applies a change to one idempotency record with compare-and-swap (or none), then waits
    /// for the group commit. A `begin` is a decision, refused while the disk stalls; a `finish`
    /// records what an effect that already ran answered, and is taken then (see
    /// `Tree::compare_and_swap_outcome`): refused, the record would stay in flight until its
    /// timeout and a retry after it would run the effect again.
    async fn update_record<T>(
        &self,
        job: &JobId,
        key: &[u8],
        write: Write,
        mut f: impl FnMut(Option<&record::Record>) -> (Option<Option<record::Record>>, T),
    ) -> Result<T, StoreError> {
        let out = loop {
            let raw = self.records.get(key).map_err(io)?;
            let cur = raw
                .as_deref()
                .map(record::Record::decode)
                .transpose()
                .map_err(|reason| StoreError::Corrupt {
                    job: job.clone(),
                    reason,
                })?;
            let (change, out) = f(cur.as_ref());
            // An answer read from a record another caller wrote (a replay, "in flight", a
            // mismatch) waits for a commit too: that write may not be on disk yet, and a
            // crash would take back what this caller was told. Refused at once while the
            // disk stalls, like a decision.
            let Some(new) = change else {
                self.db.commit_read().await.map_err(io)?;
                return Ok(out);
            };
            let new = new.map(|r| r.encode());
            let (old_len, new_len) = (
                entry_len(key, raw.as_deref()),
                entry_len(key, new.as_deref()),
            );
            let swapped = match write {
                Write::Decision => self.records.compare_and_swap(key, raw, new),
                Write::Outcome => self.records.compare_and_swap_outcome(key, raw, new),
            };
            match swapped.map_err(io)? {
                Ok(()) => {
                    self.stored
                        .replaced(job.as_str().as_bytes(), old_len, new_len);
                    break out;
                }
                Err(_) => continue,
            }
        };
        self.db.commit().await.map_err(io)?;
        Ok(out)
    }
}

/// Which compare-and-swap an idempotency record's change is written with.
#[derive(Clone, Copy)]
enum Write {
    Decision,
    Outcome,
}

impl SledStore {
    /// `observe` and `raise`: a raise records its time when older requests may be running.
    async fn accept(
        &self,
        job: &JobId,
        token: Generation,
        older_running: bool,
    ) -> Result<Verdict, StoreError> {
        let key = job.as_str().as_bytes();
        loop {
            let raw = self.generations.get(key).map_err(io)?;
            let (highest, touched, raised) = Self::decode_generation(job, raw.as_deref())?;
            if token < highest {
                // The highest may be a raise whose commit has not landed (another request's,
                // waiting on a slow disk): the caller's gate takes it as settled, and lets
                // that generation through without a write of its own, so it must be on disk
                // first, as for a load. Free when everything is synced; refused at once while
                // the disk stalls.
                self.db.commit_read().await.map_err(io)?;
                return Ok(Verdict::Stale { highest });
            }
            let now = self.clock.now_ms();
            if token == highest && raw.is_some() && !stamp_due(touched, now) {
                break; // stamped lately: make sure it is on disk too
            }
            // The offset of the wall clock this stamp is written under, for judging it idle.
            if let Some(lowest) = self.steps.observe(now, self.since_open_ms()) {
                self.lower_open_record(lowest);
            }
            let stamp = now.saturating_add(STAMP_AHEAD_MS);
            let raised = match (token > highest || raw.is_none(), older_running) {
                (true, true) => now,
                (true, false) => 0,
                (false, _) => raised,
            };
            let mut new = [0u8; 24];
            new[..8].copy_from_slice(&token.get().to_be_bytes());
            new[8..16].copy_from_slice(&stamp.to_be_bytes());
            new[16..].copy_from_slice(&raised.to_be_bytes());
            if self
                .generations
                .compare_and_swap(key, raw.clone(), Some(&new[..]))
                .map_err(io)?
                .is_ok()
            {
                let moved = stamp_bucket(touched) != stamp_bucket(stamp);
                if raw.is_none() || moved {
                    self.stamps
                        .insert(stamp_key(stamp, key), &[][..])
                        .map_err(io)?;
                }
                if raw.is_some() && moved {
                    self.stamps.remove(stamp_key(touched, key)).map_err(io)?;
                }
                break;
            }
        }
        self.db.commit().await.map_err(io)?;
        Ok(Verdict::Accepted)
    }
}

impl GenerationStore for SledStore {
    async fn observe(&self, job: &JobId, token: Generation) -> Result<Verdict, StoreError> {
        self.accept(job, token, true).await
    }

    async fn raise(
        &self,
        job: &JobId,
        token: Generation,
        older_running: bool,
    ) -> Result<Verdict, StoreError> {
        self.accept(job, token, older_running).await
    }

    async fn highest(&self, job: &JobId) -> Result<Generation, StoreError> {
        let raw = self.generations.get(job.as_str().as_bytes()).map_err(io)?;
        Ok(Self::decode_generation(job, raw.as_deref())?.0)
    }

    async fn load(&self, job: &JobId) -> Result<Loaded, StoreError> {
        if self.running.lower_due(self.clock.monotonic_ms()) {
            // What the processes before admitted has settled: the record of their bounds
            // gives way to this process's own (see `running`). Optional: failed, the record
            // stays on the safe, longer side, and this load is no concern of it.
            if let Err(e) = self.running_within(RunBounds::default()).await {
                tracing::warn!(error = %e, "cannot lower the record of how long the processes before let requests run; it keeps their longer bounds");
            }
        }
        let raw = self.generations.get(job.as_str().as_bytes()).map_err(io)?;
        if raw.is_some() {
            // The record may be a raise whose commit has not landed (it timed out on a
            // stalling disk, its gate since evicted): a gate loaded from it would let its
            // generation through without a write of its own, and a crash would then take the
            // raise back while its effect stood. Refused at once while the disk stalls.
            self.db.commit_read().await.map_err(io)?;
        }
        let (highest, touched, raised) = Self::decode_generation(job, raw.as_deref())?;
        Ok(Loaded {
            highest,
            prior: raw.is_some().then(|| {
                Prior::new(touched, raised, self.opened_ms, self.since_open_ms())
                    .ran(self.running.before())
            }),
        })
    }

    /// Durable before it returns: the record is the longest told and, while what the
    /// processes before admitted may still run, theirs (see `running`).
    async fn running_within(&self, bounds: RunBounds) -> Result<(), StoreError> {
        let now_ms = self.clock.monotonic_ms();
        if self.running.record(&self.format, bounds, now_ms)? {
            self.db.commit().await.map_err(io)
        } else {
            // Another caller's write of the same record may not be on disk yet.
            self.db.commit_read().await.map_err(io)
        }
    }

    fn ran_within(&self) -> RunBounds {
        self.running.before()
    }

    async fn idle(&self, page: IdlePage<'_>) -> Result<Vec<IdleJob>, StoreError> {
        // Each stamp is judged by the offset of the wall clock it was written under
        // ([`Steps`]), an earlier process's by the earlier of the wall clock and the time
        // since the open: a wall clock stepped forward since (NTP after a boot) must not age
        // a stamp by the step and forget a job whose earlier request may still be running,
        // or whose older tokens have not expired.
        let idle_for = ms(page.idle_for);
        let wall_ms = self.clock.now_ms();
        let anchored_ms = self.since_open_ms();
        if let Some(lowest) = self.steps.observe(wall_ms, anchored_ms) {
            self.lower_open_record(lowest);
        }
        let judge = self.steps.judge(anchored_ms);
        // No stamp is judged at a later time than the wall clock's.
        let before_ms = wall_ms.saturating_sub(idle_for);
        let start = match page.after {
            Some(a) => {
                std::ops::Bound::Excluded(stamp_key(a.touched_ms, a.job.as_str().as_bytes()))
            }
            None => std::ops::Bound::Unbounded,
        };
        let end = std::ops::Bound::Excluded(before_ms.to_be_bytes().to_vec());
        let mut out = Vec::new();
        for item in self.stamps.range::<Vec<u8>, _>((start, end)) {
            let (k, _) = item.map_err(io)?;
            let Some((touched, job)) = k.split_first_chunk::<8>() else {
                continue;
            };
            let stamped = u64::from_be_bytes(*touched);
            if stamped >= judge.now_for(stamped).saturating_sub(idle_for) {
                continue;
            }
            let Ok(job) = std::str::from_utf8(job)
                .unwrap_or_default()
                .parse::<JobId>()
            else {
                continue;
            };
            out.push(IdleJob {
                touched_ms: stamped,
                job,
            });
            if out.len() >= page.limit {
                break;
            }
        }
        Ok(out)
    }

    /// Recorded in `format`, for the processes after this one (module `forgetting`).
    async fn forgetting_within(
        &self,
        clock_skew: Duration,
        max_lease_ttl: Duration,
    ) -> Result<(), StoreError> {
        self.record_forgetting(clock_skew, max_lease_ttl).await
    }

    async fn forget(&self, idle: &IdleJob) -> Result<bool, StoreError> {
        self.forgetting_recorded().await?;
        let key = idle.job.as_str().as_bytes();
        let raw = self.generations.get(key).map_err(io)?;
        let (_, touched, _) = Self::decode_generation(&idle.job, raw.as_deref())?;
        if raw.is_none() || stamp_bucket(touched) != idle.touched_ms {
            // Stamped again since, or gone: the entry was left behind (by a crash between
            // the two writes); put the right one in its place.
            self.stamps
                .remove(stamp_key(idle.touched_ms, key))
                .map_err(io)?;
            if raw.is_some() {
                self.stamps
                    .insert(stamp_key(touched, key), &[][..])
                    .map_err(io)?;
            }
            return Ok(false);
        }
        let gone = self
            .generations
            .compare_and_swap(key, raw, None::<&[u8]>)
            .map_err(io)?
            .is_ok();
        if gone {
            self.stamps
                .remove(stamp_key(idle.touched_ms, key))
                .map_err(io)?;
            // Not waited on: a deletion a crash takes back only brings an idle job back,
            // to be forgotten again; the next commit of anyone flushes it anyway.
        }
        Ok(gone)
    }
}

#[cfg(test)]
mod tests;
