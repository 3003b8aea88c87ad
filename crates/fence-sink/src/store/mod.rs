//! Where a sink keeps the highest generation per job and its idempotency records.
//!
//! The bottom floor of the crate: it owns every type it persists (verdicts, fingerprints,
//! stored responses, records) and imports nothing from above. Two small traits, one atomic
//! verb per decision: [`GenerationStore::observe`] is an atomic, durable maximum;
//! [`IdempotencyStore::begin`] claims a (job, key) record or reports what it holds. The
//! in-memory gates of [`FenceLayer`](crate::FenceLayer) sit in front and answer the
//! same-generation path without touching the store.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use fence_core::Generation;
//! use fence_sink::{GenerationStore, MemoryStore, Verdict};
//!
//! let store = MemoryStore::new();
//! let job = "invoice-42".parse()?;
//! assert_eq!(store.observe(&job, Generation::new(8)).await?, Verdict::Accepted);
//! assert_eq!(
//!     store.observe(&job, Generation::new(7)).await?,
//!     Verdict::Stale { highest: Generation::new(8) }
//! );
//! # Ok(()) }
//! ```

mod memory;
#[cfg(feature = "postgres")]
pub mod postgres;
pub(crate) mod record;
mod settings;
mod sled;
mod stored;

use std::{future::Future, time::Duration};

use fence_core::{Generation, JobId, headers::IdempotencyKey};
use fence_storage::BoxError;

pub use self::{
    memory::MemoryStore,
    record::{Fingerprint, StoredResponse},
    settings::SinkSettings,
    sled::SledStore,
};

/// What [`GenerationStore::observe`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The token is the highest now (it was equal, or it was higher and is now stored durably).
    Accepted,
    /// The store holds a higher generation; nothing changed.
    Stale {
        /// The highest generation stored.
        highest: Generation,
    },
}

/// How far ahead of its clock a store stamps a job it accepts (ms): the stamp is a time by
/// which every admission of the job had happened (docs/protocol.md, "After a restart").
/// A token equal to the highest re-stamps its job only when less than half of this is left,
/// so a store asked on every request writes at most once every few seconds per job.
pub const STAMP_AHEAD_MS: u64 = 10_000;

/// The longest lease a destination accepts unless told otherwise (`FenceLayer::max_lease_ttl`,
/// `fence proxy --max-lease-ttl`): a signed token claiming a later lease end is refused.
pub const DEFAULT_MAX_LEASE_TTL: Duration = Duration::from_secs(24 * 3600);

/// The longest duration any setting of the layer keeps: 100 years. Longer (a caller's
/// `Duration::MAX` for "no limit") is taken as this, so that adding it to a clock reading
/// cannot overflow.
pub(crate) fn clamped(d: Duration) -> Duration {
    d.min(Duration::from_secs(100 * 365 * 24 * 3600))
}

/// How far apart a destination allows its clock and the lease server's unless told otherwise
/// (`FenceLayer::clock_skew`, `fence proxy --clock-skew`).
pub const DEFAULT_CLOCK_SKEW: Duration = Duration::from_secs(5);

/// Whether a job stamped `touched_ms` must be stamped again at `now_ms` for an accepted token
/// equal to its highest.
pub(crate) fn stamp_due(touched_ms: u64, now_ms: u64) -> bool {
    touched_ms < now_ms.saturating_add(STAMP_AHEAD_MS / 2)
}

/// A job as a gate loads it from the store: its highest generation and, where the store
/// keeps them, the stamps that bound what an earlier process may still have running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Loaded {
    /// The highest generation stored (0 when none).
    pub highest: Generation,
    /// The stamps, in the store's clock; `None` for a store that no earlier process could
    /// have used (memory) or a job with no record.
    pub prior: Option<Prior>,
}

impl Loaded {
    /// A job with `highest` and no stamps.
    pub fn new(highest: Generation) -> Self {
        Self {
            highest,
            prior: None,
        }
    }
}

/// How long a request a layer admits may still run at its service (`running_for`, from its
/// admission), and how long after that its effect may still land (`hold`, the unknown-outcome
/// hold): what a process after this one must wait for ([`GenerationStore::running_within`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct RunBounds {
    /// From admission, how long a request may still be running at the service.
    pub running_for: Duration,
    /// How long after that its effect may still happen, outcome unknown.
    pub hold: Duration,
}

impl RunBounds {
    /// Requests that may run for `running_for`, their effect landing up to `hold` after.
    pub fn new(running_for: Duration, hold: Duration) -> Self {
        Self { running_for, hold }
    }

    /// The longer of each: what covers the requests admitted under either.
    #[must_use]
    pub fn max(self, other: Self) -> Self {
        Self {
            running_for: self.running_for.max(other.running_for),
            hold: self.hold.max(other.hold),
        }
    }

    /// Whether every request admitted under `other` is covered by these.
    pub fn covers(&self, other: &Self) -> bool {
        self.running_for >= other.running_for && self.hold >= other.hold
    }

    /// How long after its admission a request can no longer be running, outcome unknown
    /// included.
    pub fn settled_after(&self) -> Duration {
        self.running_for.saturating_add(self.hold)
    }
}

/// What bounds the requests an earlier process admitted for a job, all in ms of the store's
/// clock: it admitted none after `admitted_until_ms`, none of a generation below the highest
/// after `raised_ms`, and it had ended by `opened_ms` (when this process opened the store);
/// `ran` says how long what it admitted may have run, as it recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Prior {
    /// Every admission of the job happened before this (the job's stamp, written ahead).
    pub admitted_until_ms: u64,
    /// When `highest` was last raised while requests of older generations may have been
    /// running (0: none were); none of those were admitted after it.
    pub raised_ms: u64,
    /// When this process opened the store: any earlier process had ended by then.
    pub opened_ms: u64,
    /// The store's clock as it answered. A store that measures time since `opened_ms` on a
    /// monotonic clock (sled does) reports `opened_ms` plus that, so a step of the wall clock
    /// after the open does not cut short the wait for what an earlier process left running.
    pub now_ms: u64,
    /// The bounds the processes before this one ran with, as they recorded them
    /// ([`GenerationStore::running_within`]; zero: none recorded). A layer waits for the
    /// longer of these and its own: a process restarted with shorter timeouts must still
    /// wait for what the one before admitted under its longer ones.
    pub ran: RunBounds,
}

impl Prior {
    /// The stamps of a stored job, with no recorded bounds.
    pub fn new(admitted_until_ms: u64, raised_ms: u64, opened_ms: u64, now_ms: u64) -> Self {
        Self {
            admitted_until_ms,
            raised_ms,
            opened_ms,
            now_ms,
            ran: RunBounds::default(),
        }
    }

    /// The stamps, with the bounds the processes before this one recorded.
    #[must_use]
    pub fn ran(mut self, ran: RunBounds) -> Self {
        self.ran = ran;
        self
    }
}

/// A job whose stamp is older than asked, for [`GenerationStore::idle`]: where the next
/// page starts, and what [`GenerationStore::forget`] must still find to delete it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct IdleJob {
    /// When the store last stamped the job (ms since the Unix epoch, the store's clock; the
    /// sled store rounds it up to a whole second, and judges it a second younger for the
    /// wall clock's steps under its tolerance, so a job may be listed up to two seconds late).
    pub touched_ms: u64,
    /// The job.
    pub job: JobId,
}

/// Which idle jobs [`GenerationStore::idle`] lists: those stamped at least `idle_for` ago by
/// the store's clock, oldest first, after `after` (the last of the previous page), at most
/// `limit`.
#[derive(Debug, Clone, Copy)]
pub struct IdlePage<'a> {
    /// How long ago a job was stamped, at least.
    pub idle_for: Duration,
    /// Where the previous page ended.
    pub after: Option<&'a IdleJob>,
    /// The most jobs to list.
    pub limit: usize,
}

/// Durable per-job highest generations, each stamped with when it was last accepted.
pub trait GenerationStore: Send + Sync + 'static {
    /// Atomically: if `token` is at least the stored highest, make it the highest, stamp the
    /// job [`STAMP_AHEAD_MS`] ahead of the store's clock when it is raised or less than half
    /// of that is left (on disk before this returns; a raise also records when it happened)
    /// and accept; otherwise report the highest.
    fn observe(
        &self,
        job: &JobId,
        token: Generation,
    ) -> impl Future<Output = Result<Verdict, StoreError>> + Send;

    /// As [`observe`](Self::observe), for a token above the highest the caller knows of:
    /// `older_running` says whether requests of older generations may still be running.
    /// A store that keeps [`Prior`] stamps records the raise's time only when they may (so
    /// that after a restart the new highest waits only when something older could still
    /// land); the default records it always, as `observe` does.
    fn raise(
        &self,
        job: &JobId,
        token: Generation,
        older_running: bool,
    ) -> impl Future<Output = Result<Verdict, StoreError>> + Send {
        let _ = older_running;
        self.observe(job, token)
    }

    /// The highest generation stored for `job` (0 when none), to fill a cache.
    fn highest(&self, job: &JobId) -> impl Future<Output = Result<Generation, StoreError>> + Send;

    /// The job as a gate loads it: [`highest`](Self::highest) and, for a store that outlives
    /// its process, the stamps of [`Prior`]. The default has no stamps: right for a store
    /// that dies with its process (memory), wrong for any other, and for a wrapper around one
    /// (delegate it), since a restart would then forget what may still be running.
    fn load(&self, job: &JobId) -> impl Future<Output = Result<Loaded, StoreError>> + Send {
        let highest = self.highest(job);
        async move { Ok(Loaded::new(highest.await?)) }
    }

    /// Whether [`load`](Self::load) gives the jobs' [`Prior`] stamps (a store that outlives
    /// its process and keeps them, as sled does): a layer that forgets on it then never
    /// deletes a job before what an earlier process may have left running on it has
    /// settled, since the stamps are all a later process knows of that. The default answers
    /// `true`, the safe side; a store without them answers `false` (memory, which dies with
    /// its process; PostgreSQL, whose order across processes is kept by the SQL fence). A
    /// wrapper around another store delegates it.
    fn loads_stamps(&self) -> bool {
        true
    }

    /// Whether other processes share this store: then a cached highest can be out of date,
    /// and the layer asks the store on every request instead of answering from memory.
    fn is_shared(&self) -> bool {
        false
    }

    /// A page of idle jobs (see [`IdlePage`]). A store that cannot forget answers none (the
    /// default).
    fn idle(
        &self,
        page: IdlePage<'_>,
    ) -> impl Future<Output = Result<Vec<IdleJob>, StoreError>> + Send {
        let _ = page;
        async { Ok(Vec::new()) }
    }

    /// Atomically: deletes `job` if its stamp is still `idle.touched_ms` (nothing accepted
    /// since), durably; whether it did.
    fn forget(&self, idle: &IdleJob) -> impl Future<Output = Result<bool, StoreError>> + Send {
        let _ = idle;
        async { Ok(false) }
    }

    /// Told by a layer before it admits a request under `bounds` (its longest request, and
    /// its unknown-outcome hold), and done only once they are durable. A store that outlives
    /// its process and keeps [`Prior`] stamps records them (the longest told so far, and those
    /// [`ran_within`](Self::ran_within) gives while what the processes before admitted may
    /// still run), so a process after this one waits for what this one may leave running by
    /// this one's bounds, not by its own shorter ones. The default keeps nothing: right for a
    /// store that dies with its process and for one without stamps (PostgreSQL). A wrapper
    /// around another store delegates it.
    fn running_within(
        &self,
        bounds: RunBounds,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = bounds;
        async { Ok(()) }
    }

    /// The bounds the processes before this one recorded with
    /// [`running_within`](Self::running_within) (zero: none, the default), as read when the
    /// store was opened; the same as the [`Prior::ran`] of each job. A wrapper delegates it.
    fn ran_within(&self) -> RunBounds {
        RunBounds::default()
    }

    /// Told by a layer that forgets, before its first [`forget`](Self::forget), the window
    /// every token it admits ends within: the clock skew it allows and the longest lease. A
    /// store with a fence of its own beside the layer's (PostgreSQL's SQL fence) records them
    /// so that fence refuses, once a job is forgotten, what the layer refuses; a store that
    /// outlives its process (sled) records them, durably, so that a process after this one
    /// can refuse to run without the same check (`SledStore::recorded_settings`); the
    /// default keeps nothing. A wrapper around another store delegates it.
    fn forgetting_within(
        &self,
        clock_skew: Duration,
        max_lease_ttl: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = (clock_skew, max_lease_ttl);
        async { Ok(()) }
    }
}

/// What [`IdempotencyStore::begin`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Begin {
    /// No live record: one is now in flight for the caller, which must run the request and
    /// then call [`IdempotencyStore::finish`].
    Started,
    /// The same request completed; here is its response.
    Replay(StoredResponse),
    /// The same request is still in flight.
    InFlight,
    /// The same request completed, but its response was too large to store.
    NotReplayable,
    /// The key was used for a different request.
    Mismatch,
}

/// How a started request ended, for [`IdempotencyStore::finish`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finish {
    /// Store this response for replay until `retention` has passed.
    Store {
        /// The response.
        response: StoredResponse,
        /// How long to keep it.
        retention: Duration,
    },
    /// The response was too large to store, or its body broke off: remember for `retention`
    /// that the request ran, but that it cannot be replayed.
    TooLarge {
        /// How long to remember it.
        retention: Duration,
    },
    /// Forget the record (a response whose status is not stored, such as a 5xx, or an error
    /// from the service), so a retry runs again. A request dropped mid-way is not forgotten:
    /// its in-flight record stays until its timeout.
    Forget,
}

/// One attempt of an idempotent request: its (job, key) record, its fingerprint, and what
/// tells it from every other attempt (an in-flight record belongs to the attempt that began
/// it, as a job belongs to the holder of its lease).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attempt<'a> {
    /// The job.
    pub job: &'a JobId,
    /// The idempotency key (per job).
    pub key: &'a IdempotencyKey,
    /// What makes two requests the same request.
    pub fingerprint: &'a Fingerprint,
    /// This attempt's own random id (not 0): only the attempt that began an in-flight
    /// record may finish or forget it.
    pub id: u64,
    /// The generation of the token the request was admitted with: an in-flight record of an
    /// older generation is taken over (the fence admitted this one only once the older
    /// request had finished, or its unknown outcome's hold had ended).
    pub generation: Generation,
    /// How long after it began an attempt can no longer be running (the layer's longest
    /// request plus its unknown-outcome hold). A store
    /// shared by several processes ([`GenerationStore::is_shared`]) takes an older
    /// generation's in-flight record over only once that long has passed since it began:
    /// the fence of this process drained only the requests this process admitted.
    pub settled_after: Duration,
}

/// Durable per-(job, key) idempotency records.
///
/// A record's times (its in-flight timeout, its retention) are the store's clock. A backend
/// that keeps its own clock (memory, sled) measures it as the wall time at its open plus the
/// monotonic time since, so a step of the wall clock while it runs is not time passed
/// (`conformance::steps`); PostgreSQL uses the database's clock, and a step of that host's
/// clock is (docs/protocol.md, section 3).
pub trait IdempotencyStore: Send + Sync + 'static {
    /// Atomically: when no live record exists for (job, key) (none, an in-flight record whose
    /// `in_flight` ran out or that an older generation began, or a completed one older than
    /// its retention), write an in-flight record of this attempt and answer `Started`;
    /// otherwise compare fingerprints and answer.
    fn begin(
        &self,
        attempt: Attempt<'_>,
        in_flight: Duration,
    ) -> impl Future<Output = Result<Begin, StoreError>> + Send;

    /// Completes what `begin` started, if the record is still this attempt's (in flight,
    /// begun by `attempt.id`); otherwise changes nothing: a successor owns it.
    fn finish(
        &self,
        attempt: Attempt<'_>,
        outcome: Finish,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Deletes records that are no longer live; returns how many.
    fn purge_expired(&self) -> impl Future<Output = Result<usize, StoreError>> + Send;

    /// How many bytes the stored records hold (keys and encoded records, live or not yet
    /// purged), as the store counts them: the memory and sled stores do, at every write;
    /// `None` (the default, and PostgreSQL's) when the store does not count, and the layer's
    /// [cap](crate::IdempotencyConfig::max_stored_bytes) then does not apply.
    fn stored_bytes(&self) -> Option<u64> {
        None
    }

    /// How many bytes the records of `job` hold, counted as [`stored_bytes`](Self::stored_bytes)
    /// (`None`, the default: not counted): past three quarters of the cap, a job holding
    /// its share (a quarter) or more gets no new keys ([`max_stored_bytes`](crate::IdempotencyConfig::max_stored_bytes)).
    fn job_stored_bytes(&self, job: &JobId) -> Option<u64> {
        let _ = job;
        None
    }
}

/// Why a sink store could not decide.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// Reading or writing the backing storage failed.
    #[error("sink store I/O failed")]
    Io(#[source] BoxError),
    /// A stored record could not be decoded.
    #[error("stored record of job {job} is corrupt: {reason}")]
    Corrupt {
        /// The job.
        job: JobId,
        /// What is wrong.
        reason: &'static str,
    },
    /// The store did not answer in time.
    #[error("sink store did not answer within {0:?}")]
    Timeout(Duration),
}

impl StoreError {
    /// Wraps an I/O failure, keeping it as the source.
    pub fn io(e: impl Into<BoxError>) -> Self {
        Self::Io(e.into())
    }
}

pub(crate) fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
