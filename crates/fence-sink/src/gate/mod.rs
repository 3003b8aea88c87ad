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
//! The map of gates, with idle jobs kept small, eviction and forgetting, is in [`cache`].

use std::{
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicU64, Ordering::Relaxed},
    },
    time::Duration,
};

mod cache;
#[cfg(test)]
mod model;

use dashmap::DashMap;
use fence_core::{Generation, JobId};
use tokio::{
    sync::{Notify, OnceCell},
    time::Instant,
};

pub use self::cache::{CacheStats, JobFence};
use self::cache::{Made, Map};
use crate::detach::Detachable;
use crate::store::{GenerationStore, StoreError, Verdict};

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
    /// The store failed or timed out; nothing changed.
    StoreFailed(StoreError),
}

enum Step {
    Stale {
        highest: Generation,
        pending: Option<Generation>,
    },
    /// Through; with `touch`, the job's stamp is due to be renewed in the store.
    Current {
        guard: InFlight,
        touch: bool,
    },
    Bump,
    Wait,
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
    /// When the store last stamped the job, as far as this process knows (0: unknown).
    touched_ms: u64,
}

impl GateState {
    /// `highest` moves up to `to` (never down); the requests of the old `highest` still
    /// running are older ones from now on.
    fn raise(&mut self, to: Generation) {
        if to > self.highest {
            self.draining += self.current;
            self.current = 0;
            self.highest = to;
        }
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
    fn idle(highest: Generation, touched_ms: u64) -> Self {
        Self {
            loaded: OnceCell::new_with(Some(())),
            state: Mutex::new(GateState {
                highest,
                touched_ms,
                ..GateState::default()
            }),
            changed: Notify::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The highest generation and stamp, when the gate holds nothing but those: loaded,
    /// nothing in flight, no bump pending or running.
    fn quiet(&self) -> Option<(Generation, u64)> {
        if !self.loaded.initialized() {
            return None;
        }
        let s = self.lock();
        (s.current == 0 && s.draining == 0 && s.bumping.is_none())
            .then_some((s.highest, s.touched_ms))
    }
}

/// Clears a bump's mark when its task ends without settling (a panic in the store, or the
/// runtime shutting down), so the job is not left waiting on a bump that will never finish.
struct Unsettled<'a> {
    gate: &'a Gate,
    token: Generation,
}

impl Drop for Unsettled<'_> {
    fn drop(&mut self) {
        let mut s = self.gate.lock();
        // While this bump runs, `bumping` is this token (only `decide` sets it, and only when
        // it is empty; only `settle` or this clears it), so the check never fails today: it
        // keeps this guard correct should a second bump ever be allowed to start.
        if s.bumping == Some(self.token) {
            s.bumping = None;
        }
        drop(s);
        self.gate.changed.notify_waiters();
    }
}

/// Marks one admitted request in flight; dropping it lets a newer generation that waits for
/// it proceed.
#[derive(Debug)]
pub(crate) struct InFlight {
    gate: Arc<Gate>,
    generation: Generation,
}

impl InFlight {
    /// Keeps the request counted in flight for `hold` more (after an unknown outcome: the
    /// upstream may still act on it), then lets it go. Without a runtime to wait on, at once.
    pub(crate) fn hold(self, hold: Duration) {
        if hold.is_zero() {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                tokio::time::sleep(hold).await;
                drop(self);
            });
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut s = self.gate.lock();
        if self.generation == s.highest {
            s.current -= 1;
            return;
        }
        // Older than `highest`: counted in `draining` since the raise.
        s.draining -= 1;
        let drained = s.draining == 0 && !broken(Mutant::DrainUnnotified);
        drop(s);
        if drained {
            self.gate.changed.notify_waiters();
        }
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
    /// When forgetting is on: how old a job's stamp in the store may get while requests are
    /// admitted before one of them renews it (in the background).
    pub(crate) touch_every: Option<Duration>,
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
}

impl<St: GenerationStore> Gates<St> {
    pub(crate) fn new(store: Arc<St>) -> Self {
        Self {
            map: DashMap::new(),
            store,
            lookups: AtomicU64::new(0),
            reads: AtomicU64::new(0),
            made: Mutex::default(),
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

    async fn load(&self, gate: &Gate, job: &JobId, timeout: Duration) -> Result<(), StoreError> {
        let init = gate.loaded.get_or_try_init(|| async {
            self.reads.fetch_add(1, Relaxed);
            let highest = self.store.highest(job).await?;
            gate.lock().raise(highest);
            Ok::<_, StoreError>(())
        });
        tokio::time::timeout(timeout, init)
            .await
            .map_err(|_| StoreError::Timeout(timeout))??;
        Ok(())
    }

    async fn observe(
        &self,
        job: &JobId,
        token: Generation,
        timeout: Duration,
    ) -> Result<Verdict, StoreError> {
        tokio::time::timeout(timeout, self.store.observe(job, token))
            .await
            .map_err(|_| StoreError::Timeout(timeout))?
    }

    /// Decides one request of `job` carrying `token`, at `now_ms` by the layer's clock.
    ///
    /// Cancel-safe: a bump whose durable write has started finishes (and updates the gate)
    /// in a task of its own when the request goes away.
    pub(crate) async fn admit(
        self: &Arc<Self>,
        job: &JobId,
        token: Generation,
        limits: Limits,
        now_ms: u64,
    ) -> Admission {
        let gate = &self.gate(job, limits.max_cached_jobs);
        if let Err(e) = self.load(gate, job, limits.store_timeout).await {
            return Admission::StoreFailed(e);
        }
        let deadline = Instant::now() + limits.drain_timeout;
        loop {
            let notified = gate.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable(); // registered before the check: no wake-up is missed
            match self.decide(gate, token, limits.touch_every, now_ms) {
                Step::Stale { highest, pending } => return Admission::Stale { highest, pending },
                Step::Current { guard, .. } if self.store.is_shared() => {
                    // The store stamps the job on this very call.
                    return self
                        .confirm(gate, job, token, guard, limits.store_timeout)
                        .await;
                }
                Step::Current { guard, touch } => {
                    if touch {
                        self.touch(job, token, limits.store_timeout);
                    }
                    return Admission::Admitted(guard);
                }
                Step::Bump => {
                    match self
                        .bump(
                            gate.clone(),
                            job.clone(),
                            token,
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
                Step::Wait => {}
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                let highest = gate.lock().highest;
                return Admission::DrainTimeout { highest };
            }
        }
    }

    /// Renews `job`'s stamp in the store, in the background (a failure only means the job
    /// may be forgotten and reloaded sooner).
    fn touch(&self, job: &JobId, token: Generation, timeout: Duration) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (store, job) = (self.store.clone(), job.clone());
        runtime.spawn(async move {
            let _ = tokio::time::timeout(timeout, store.observe(&job, token)).await;
        });
    }

    /// One look at the gate, under its lock.
    fn decide(
        &self,
        gate: &Arc<Gate>,
        token: Generation,
        touch_every: Option<Duration>,
        now_ms: u64,
    ) -> Step {
        let mut s = gate.lock();
        let newest = s.bumping.map_or(s.highest, |b| b.max(s.highest));
        if token < newest {
            return Step::Stale {
                highest: s.highest,
                pending: s.bumping.filter(|b| token >= s.highest && token < *b),
            };
        }
        if token == s.highest {
            if s.draining > 0 {
                return Step::Wait;
            }
            s.current += 1;
            let touch = touch_every.is_some_and(|every| {
                now_ms.saturating_sub(s.touched_ms)
                    >= u64::try_from(every.as_millis()).unwrap_or(u64::MAX)
            });
            if touch {
                s.touched_ms = now_ms;
            }
            return Step::Current {
                guard: InFlight {
                    gate: gate.clone(),
                    generation: token,
                },
                touch,
            };
        }
        // token > highest: raise it, one durable write at a time per job; a request above a
        // write that is running waits for it, then raises again.
        if s.bumping.is_some() {
            return Step::Wait;
        }
        s.bumping = Some(token);
        Step::Bump
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
        match self.observe(job, token, timeout).await {
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
        token: Generation,
        timeout: Duration,
        now_ms: u64,
    ) -> Result<(), Admission> {
        let gates = self.clone();
        Detachable::finishing(Box::pin(async move {
            let unsettled = Unsettled { gate: &gate, token };
            let result = gates.observe(&job, token, timeout).await;
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
                s.touched_ms = now_ms; // the store stamped it just now
                Ok(())
            }
            Ok(Verdict::Stale { highest }) => {
                s.raise(highest);
                Err(Admission::Stale {
                    highest,
                    pending: None,
                })
            }
            Err(e) => Err(Admission::StoreFailed(e)),
        }
    }
}
