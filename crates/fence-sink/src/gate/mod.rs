//! The per-job gate: a higher token raises `highest` at once, then waits for older requests.
//!
//! The raise is durable before anything else happens, and the higher token passes only once
//! older requests of its job have finished (contract section 3, "newer token first").
//!
//! A gate holds the job's `highest`, the admitted requests of that generation (`current`),
//! those of older generations still running (`draining`) and the running bump. Per job one
//! gate, in a bounded map in front of the store:
//! - token < highest, or < the token being written: stale at once (a newer claim exists);
//! - token > highest: write it durably (one write at a time per job); highest := token, and
//!   the `current` requests become `draining`; from that moment every older token is stale;
//! - token == highest: through at once while nothing older is draining, else wait (bounded by
//!   the drain limit) until `draining` reaches 0. Giving up (drain timeout) changes nothing:
//!   `highest` stays raised.
//!
//! So no request with a lower token reaches the inner service after a higher one did, and a
//! higher one starts only once every older admitted request has finished (each is bounded
//! by the body deadline and the inner service's own time, or an unknown outcome's hold).
//!
//! The map may answer "stale" alone; it never admits a higher token without the store's
//! durable write. Only gates nobody holds are evicted (`remove_if` on the map's own
//! reference), and a new gate loads `highest` from the store before it decides.
//!
//! The map of gates, with idle jobs kept small, eviction and forgetting, is in [`cache`]; what
//! a restart leaves running, and how long a newer token waits for it, in [`restart`]; the
//! guards of admitted requests and running bumps in [`flight`].

use std::{
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicU64, Ordering::Relaxed},
    },
    time::Duration,
};

mod cache;
mod flight;
#[cfg(test)]
mod model;
mod restart;

use dashmap::DashMap;
use fence_core::{Generation, JobId};
use fence_storage::clock::Clock;
use tokio::{
    sync::{Notify, OnceCell},
    time::Instant,
};

pub use self::cache::{CacheStats, JobFence};
use self::cache::{Made, Map};
pub(crate) use self::flight::InFlight;
use self::flight::{Turn, Unsettled};
pub(crate) use self::restart::Restart;
use crate::detach::Detachable;
use crate::store::{GenerationStore, STAMP_AHEAD_MS, StoreError, Verdict};

/// Deliberately broken variants of the gate, which its model check must catch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mutant {
    /// [`cache::Slot::collapse`] folds a gate that a woken waiter still holds.
    CollapseHeld,
    /// Eviction and forgetting take out a gate that requests still hold.
    EvictHeld,
    /// The last older request to finish does not wake the newer ones waiting for it.
    DrainUnnotified,
}

#[cfg(test)]
thread_local! {
    static MUTANT: std::cell::Cell<Option<Mutant>> = const { std::cell::Cell::new(None) };
}

/// Whether the model check asked for `mutant` on this thread; always `false` outside tests.
#[inline(always)]
fn broken(mutant: Mutant) -> bool {
    #[cfg(test)]
    return MUTANT.with(|m| m.get() == Some(mutant));
    #[cfg(not(test))]
    {
        let _ = mutant;
        false
    }
}

/// What a gate decided for one request.
#[derive(Debug)]
pub(crate) enum Admission {
    /// Through; hold the guard until the request's effect can no longer happen.
    Admitted(InFlight),
    /// Below the highest accepted (or pending) generation.
    Stale {
        /// The highest generation accepted.
        highest: Generation,
        /// A newer token waiting for its bump, when that is what made this one stale.
        pending: Option<Generation>,
    },
    /// Older requests did not finish within the drain limit; `highest` is raised already.
    DrainTimeout { highest: Generation },
    /// The store failed or timed out. For a newer token's raise, its write may have landed:
    /// older tokens are refused from then on (see `GateState::unsure`).
    StoreFailed(StoreError),
}

enum Step {
    Stale {
        highest: Generation,
        pending: Option<Generation>,
    },
    /// Through, once the job's stamp covers it (see [`Stamp`]).
    Current { guard: InFlight, stamp: Stamp },
    /// Raise `highest` to the token; whether older requests may still be running then.
    Bump { older_running: bool },
    /// Wait for a change, or until the instant given (a restart's hold ends).
    Wait(Option<Instant>),
}

/// What an admitted request needs of the job's durable stamp.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stamp {
    /// The stamp covers it, with time to spare.
    Covered,
    /// The stamp covers it, but is due: renew it in the background.
    Renew,
    /// The stamp does not cover it: write one before the request goes on.
    First,
}

#[derive(Debug, Default)]
struct GateState {
    highest: Generation,
    /// Admitted requests of generation `highest`, not finished.
    current: usize,
    /// Admitted requests of older generations, not finished: a request of `highest` waits
    /// until there are none.
    draining: usize,
    /// The token whose durable write is running, if any.
    bumping: Option<Generation>,
    /// The highest token whose durable write failed or timed out: it may be on disk, and a
    /// holder of it exists, so tokens below it are refused as stale; its next request writes
    /// it again.
    unsure: Generation,
    /// Admissions before this (ms, the layer's clock) are covered by the job's durable
    /// stamp (0: not known to be covered).
    covered_until_ms: u64,
    /// A renewal of the stamp is running in the background.
    stamping: bool,
    /// Requests of generation `highest` that the process before this one admitted may still
    /// be running until then.
    prior_current: Option<Instant>,
    /// Requests of older generations that the process before admitted may still be running
    /// until then.
    prior_older: Option<Instant>,
    /// Calls of the store for this job running now (at most
    /// [`STORE_CALLS_PER_JOB`](flight::STORE_CALLS_PER_JOB)).
    store_calls: usize,
}

impl GateState {
    /// `highest` moves up to `to` (never down); the requests of the old `highest` still
    /// running are older ones from now on.
    fn raise(&mut self, to: Generation) {
        if to > self.highest {
            self.draining += self.current;
            self.current = 0;
            self.highest = to;
            self.prior_older = self.prior_older.max(self.prior_current.take());
        }
    }

    /// When requests older than `highest` may still be running in the process before, if
    /// that is still ahead.
    fn prior_older_pending(&self) -> Option<Instant> {
        // The clock is read only while there is such a time.
        self.prior_older.filter(|until| *until > Instant::now())
    }
}

#[derive(Debug, Default)]
pub(crate) struct Gate {
    loaded: OnceCell<()>,
    state: Mutex<GateState>,
    changed: Notify,
}

impl Gate {
    /// A gate rebuilt from a collapsed entry. Were `highest` lost here (0), nothing unsafe
    /// would follow, only a store write: every token above a gate's `highest` is bumped
    /// through the store, which answers stale for anything below its own highest.
    fn idle(highest: Generation, covered_until_ms: u64) -> Self {
        Self {
            loaded: OnceCell::new_with(Some(())),
            state: Mutex::new(GateState {
                highest,
                covered_until_ms,
                ..GateState::default()
            }),
            changed: Notify::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The highest generation and stamp, when the gate holds nothing but those: loaded,
    /// nothing in flight, no bump pending, running or of unknown outcome, no stamp being
    /// renewed, and nothing an earlier process admitted still to wait for.
    fn quiet(&self) -> Option<(Generation, u64)> {
        if !self.loaded.initialized() {
            return None;
        }
        let s = self.lock();
        let now = Instant::now();
        let prior =
            s.prior_older.is_some_and(|t| t > now) || s.prior_current.is_some_and(|t| t > now);
        let unsure = s.unsure > s.highest;
        let busy = s.current > 0 || s.draining > 0 || s.bumping.is_some() || s.stamping;
        (!busy && !prior && !unsure).then_some((s.highest, s.covered_until_ms))
    }
}

/// The limits a layer decides with; every clone of a layer shares one map of gates, but may
/// set its own limits.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// At most this many jobs in memory.
    pub(crate) max_cached_jobs: usize,
    /// Per store call.
    pub(crate) store_timeout: Duration,
    /// For older in-flight requests to finish before a newer generation passes.
    pub(crate) drain_timeout: Duration,
    /// What a process before this one may still have running (see the module's docs).
    pub(crate) restart: Restart,
}

/// All gates of one layer and its clones.
#[derive(Debug)]
pub(crate) struct Gates<St> {
    map: Map,
    store: Arc<St>,
    lookups: AtomicU64,
    reads: AtomicU64,
    /// Jobs given a gate since the last collapsing pass, and those still busy then.
    made: Mutex<Made>,
    /// The longest request and hold (ms) the store has durably taken from this map's layers
    /// ([`GenerationStore::running_within`]): a request admitted under longer ones waits
    /// for the store to take them first.
    told: [AtomicU64; 2],
}

impl<St: GenerationStore> Gates<St> {
    pub(crate) fn new(store: Arc<St>) -> Self {
        Self {
            map: DashMap::new(),
            store,
            lookups: AtomicU64::new(0),
            reads: AtomicU64::new(0),
            made: Mutex::default(),
            told: [AtomicU64::new(0), AtomicU64::new(0)],
        }
    }

    pub(crate) fn stats(&self) -> CacheStats {
        let reads = self.reads.load(Relaxed);
        CacheStats {
            cached_jobs: self.map.len(),
            hits: self.lookups.load(Relaxed).saturating_sub(reads),
            misses: reads,
        }
    }

    pub(crate) fn store(&self) -> &Arc<St> {
        &self.store
    }

    /// How many jobs are cached.
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// Loads the job's gate from the store once; `clock` is read only when it does (an
    /// admission to a loaded gate, every one after the first, reads no clock here).
    async fn load(
        &self,
        gate: &Gate,
        job: &JobId,
        limits: Limits,
        clock: &dyn Clock,
    ) -> Result<(), StoreError> {
        let timeout = limits.store_timeout;
        if !self.running_told(limits.restart) {
            tokio::time::timeout(timeout, self.tell_running(limits.restart))
                .await
                .map_err(|_| StoreError::Timeout(timeout))??;
        }
        let init = gate.loaded.get_or_try_init(|| async {
            let now_ms = clock.now_ms();
            self.reads.fetch_add(1, Relaxed);
            let loaded = self.store.load(job).await?;
            let mut s = gate.lock();
            s.raise(loaded.highest);
            if let Some(prior) = loaded.prior {
                s.load_prior(prior, limits.restart, now_ms);
            }
            Ok::<_, StoreError>(())
        });
        tokio::time::timeout(timeout, init)
            .await
            .map_err(|_| StoreError::Timeout(timeout))??;
        Ok(())
    }

    async fn observe(
        &self,
        gate: &Gate,
        job: &JobId,
        token: Generation,
        timeout: Duration,
    ) -> Result<Verdict, StoreError> {
        let call = async {
            let _turn = Turn::take(gate).await;
            self.store.observe(job, token).await
        };
        tokio::time::timeout(timeout, call)
            .await
            .map_err(|_| StoreError::Timeout(timeout))?
    }

    /// Decides one request of `job` carrying `token`, by the layer's `clock`: read again at
    /// every look at the gate, so a request admitted after a long wait is judged by the
    /// stamp's cover at its admission, not at its arrival.
    ///
    /// Cancel-safe: a bump whose durable write has started finishes (and updates the gate)
    /// in a task of its own when the request goes away.
    pub(crate) async fn admit(
        self: &Arc<Self>,
        job: &JobId,
        token: Generation,
        limits: Limits,
        clock: &dyn Clock,
    ) -> Admission {
        let gate = &self.gate(job, limits.max_cached_jobs);
        if let Err(e) = self.load(gate, job, limits, clock).await {
            return Admission::StoreFailed(e);
        }
        let deadline = Instant::now() + limits.drain_timeout;
        loop {
            let notified = gate.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable(); // registered before the check: no wake-up is missed
            // Now, not when the request arrived: a wait for older requests or a raise may
            // have outlasted the stamp that covered it then.
            let now_ms = clock.now_ms();
            match self.decide(gate, token, now_ms) {
                Step::Stale { highest, pending } => return Admission::Stale { highest, pending },
                Step::Current { guard, stamp }
                    if self.store.is_shared() || stamp == Stamp::First =>
                {
                    // A shared store is asked every time (and stamps the job on that call);
                    // otherwise the stamp must cover this request before it goes on.
                    let admitted = self
                        .confirm(gate, job, token, guard, limits.store_timeout)
                        .await;
                    if matches!(admitted, Admission::Admitted(_)) {
                        // That call stamped the job (a renewal due is done with it).
                        Self::stamped(gate, now_ms, stamp == Stamp::Renew);
                    } else if stamp == Stamp::Renew {
                        gate.lock().stamping = false;
                    }
                    return admitted;
                }
                Step::Current { guard, stamp } => {
                    if stamp == Stamp::Renew {
                        self.touch(gate, job, token, limits.store_timeout, now_ms);
                    }
                    return Admission::Admitted(guard);
                }
                Step::Bump { older_running } => {
                    match self
                        .bump(
                            gate.clone(),
                            job.clone(),
                            (token, older_running),
                            limits.store_timeout,
                            now_ms,
                        )
                        .await
                    {
                        // Raised: now wait, like any request of `highest`, for older ones.
                        Ok(()) => continue,
                        Err(refused) => return refused,
                    }
                }
                Step::Wait(until) => {
                    // What an earlier process may still be running ends after the drain
                    // limit: say so now rather than at the limit.
                    if until.is_some_and(|u| u > deadline) {
                        let highest = gate.lock().highest;
                        return Admission::DrainTimeout { highest };
                    }
                    let wake = until.map_or(deadline, |u| u.min(deadline));
                    if tokio::time::timeout_at(wake, notified).await.is_err()
                        && Instant::now() >= deadline
                    {
                        let highest = gate.lock().highest;
                        return Admission::DrainTimeout { highest };
                    }
                }
            }
        }
    }

    /// The job's stamp was written at `now_ms` (the layer's clock): admissions for half of
    /// [`STAMP_AHEAD_MS`] from then are covered.
    fn stamped(gate: &Gate, now_ms: u64, renewal: bool) {
        let mut s = gate.lock();
        s.covered_until_ms = s
            .covered_until_ms
            .max(now_ms.saturating_add(STAMP_AHEAD_MS / 2));
        if renewal {
            s.stamping = false;
        }
    }

    /// Renews `job`'s stamp in the store, in the background, before the one that covers its
    /// requests runs out (a failure only means the next request writes one first).
    fn touch(
        &self,
        gate: &Arc<Gate>,
        job: &JobId,
        token: Generation,
        timeout: Duration,
        now_ms: u64,
    ) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            gate.lock().stamping = false;
            return;
        };
        let (store, job, gate) = (self.store.clone(), job.clone(), gate.clone());
        runtime.spawn(async move {
            let done = tokio::time::timeout(timeout, store.observe(&job, token)).await;
            if let Ok(Ok(Verdict::Accepted)) = done {
                Self::stamped(&gate, now_ms, true);
            } else {
                gate.lock().stamping = false;
            }
        });
    }

    /// One look at the gate, under its lock.
    fn decide(&self, gate: &Arc<Gate>, token: Generation, now_ms: u64) -> Step {
        let mut s = gate.lock();
        // A raise running, or one whose write may have landed: newer than `highest`.
        let pending = s.bumping.max((s.unsure > s.highest).then_some(s.unsure));
        if token < pending.map_or(s.highest, |p| p.max(s.highest)) {
            return Step::Stale {
                highest: s.highest,
                pending: pending.filter(|p| token >= s.highest && token < *p),
            };
        }
        if token == s.highest {
            let prior = s.prior_older_pending();
            if s.draining > 0 || prior.is_some() {
                return Step::Wait(prior);
            }
            s.current += 1;
            let stamp = if now_ms >= s.covered_until_ms {
                Stamp::First
            } else if !s.stamping && now_ms.saturating_add(STAMP_AHEAD_MS / 4) >= s.covered_until_ms
            {
                s.stamping = true;
                Stamp::Renew
            } else {
                Stamp::Covered
            };
            return Step::Current {
                guard: InFlight {
                    gate: gate.clone(),
                    generation: token,
                    panic_hold: Duration::ZERO,
                },
                stamp,
            };
        }
        // token > highest: raise it, one durable write at a time per job; a request above a
        // write that is running waits for it, then raises again.
        if s.bumping.is_some() {
            return Step::Wait(None);
        }
        s.bumping = Some(token);
        let now = Instant::now();
        let older_running = s.current > 0
            || s.draining > 0
            || s.prior_current.is_some_and(|t| t > now)
            || s.prior_older.is_some_and(|t| t > now);
        Step::Bump { older_running }
    }

    /// With a shared store, other processes may have moved on: the store has the last word.
    async fn confirm(
        &self,
        gate: &Gate,
        job: &JobId,
        token: Generation,
        guard: InFlight,
        timeout: Duration,
    ) -> Admission {
        match self.observe(gate, job, token, timeout).await {
            Ok(Verdict::Accepted) => Admission::Admitted(guard),
            Ok(Verdict::Stale { highest }) => {
                drop(guard);
                gate.lock().raise(highest);
                gate.changed.notify_waiters();
                Admission::Stale {
                    highest,
                    pending: None,
                }
            }
            Err(e) => Admission::StoreFailed(e),
        }
    }

    /// Writes `token` durably as the job's `highest` and settles the gate: `Ok` once it is
    /// raised. It runs in the request's task while the request waits for it, and to the end
    /// in a task of its own if the request goes away.
    async fn bump(
        self: &Arc<Self>,
        gate: Arc<Gate>,
        job: JobId,
        (token, older_running): (Generation, bool),
        timeout: Duration,
        now_ms: u64,
    ) -> Result<(), Admission> {
        let gates = self.clone();
        Detachable::finishing(Box::pin(async move {
            let unsettled = Unsettled { gate: &gate, token };
            // Within the job's turns, like its checks: a job whose row a stalled writer holds
            // takes at most STORE_CALLS_PER_JOB of a shared store's connections in all.
            let raise = async {
                let _turn = Turn::take(&gate).await;
                gates.store.raise(&job, token, older_running).await
            };
            let result = tokio::time::timeout(timeout, raise)
                .await
                .unwrap_or(Err(StoreError::Timeout(timeout)));
            std::mem::forget(unsettled);
            let settled = Self::settle(&gate, token, result, now_ms);
            gate.changed.notify_waiters();
            settled
        }))
        .await
    }

    fn settle(
        gate: &Gate,
        token: Generation,
        result: Result<Verdict, StoreError>,
        now_ms: u64,
    ) -> Result<(), Admission> {
        let mut s = gate.lock();
        s.bumping = None;
        match result {
            Ok(Verdict::Accepted) => {
                s.raise(token);
                // The store stamped it just now.
                s.covered_until_ms = s
                    .covered_until_ms
                    .max(now_ms.saturating_add(STAMP_AHEAD_MS / 2));
                Ok(())
            }
            Ok(Verdict::Stale { highest }) => {
                s.raise(highest);
                Err(Admission::Stale {
                    highest,
                    pending: None,
                })
            }
            Err(e) => {
                s.unsure = s.unsure.max(token);
                Err(Admission::StoreFailed(e))
            }
        }
    }
}
