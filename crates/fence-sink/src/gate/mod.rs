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
//! Memory: most cached jobs are idle (nothing in flight, no bump pending), and an idle job
//! needs only its highest generation: [`Slot::Idle`], 16 bytes beside the key. A job gets a
//! whole gate when a request needs one, and keeps it while it stays busy (a hot job's requests
//! then cost no allocation); the jobs given a gate are listed, and after every
//! [`COLLAPSE_EVERY`] of them one short pass over that list (not the map) turns the gates
//! nobody holds and that are quiet back into `Slot::Idle`, with the same test as eviction:
//! under the shard's write lock, a gate only the map holds cannot be taken by anyone.

use std::{
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicU64, Ordering::Relaxed},
    },
    time::Duration,
};

use dashmap::DashMap;
use fence_core::{Generation, JobId};
use tokio::{
    sync::{Notify, OnceCell},
    time::Instant,
};

use crate::detach::Detachable;
use crate::store::{GenerationStore, StoreError, Verdict};

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
    Current(InFlight),
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

/// One job's entry in the map.
#[derive(Debug)]
enum Slot {
    /// Loaded from the store, nothing in flight, no bump pending or running.
    Idle(Generation),
    /// Busy, or not loaded yet.
    Active(Arc<Gate>),
}

type Map = DashMap<JobId, Slot>;

/// Gates made between two collapsing passes; a pass looks at this many jobs (plus those still
/// busy from the last one), a few tens of microseconds.
const COLLAPSE_EVERY: usize = 256;

/// At most this many jobs are evicted by one pass, so no request pays for a long scan.
const EVICT_AT_ONCE: usize = 1024;

#[derive(Debug, Default)]
pub(crate) struct Gate {
    loaded: OnceCell<()>,
    state: Mutex<GateState>,
    changed: Notify,
}

impl Gate {
    fn idle(highest: Generation) -> Self {
        Self {
            loaded: OnceCell::new_with(Some(())),
            state: Mutex::new(GateState {
                highest,
                ..GateState::default()
            }),
            changed: Notify::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The highest generation, when the gate holds nothing but that: loaded, nothing in
    /// flight, no bump pending or running.
    fn quiet(&self) -> Option<Generation> {
        if !self.loaded.initialized() {
            return None;
        }
        let s = self.lock();
        (s.current == 0 && s.draining == 0 && s.bumping.is_none()).then_some(s.highest)
    }
}

impl Slot {
    /// The gate of a busy job; an idle one gets a fresh gate holding its highest generation
    /// (and `made` is set).
    fn activate(&mut self, made: &mut bool) -> Arc<Gate> {
        match self {
            Slot::Active(gate) => gate.clone(),
            Slot::Idle(highest) => {
                let gate = Arc::new(Gate::idle(*highest));
                *self = Slot::Active(gate.clone());
                *made = true;
                gate
            }
        }
    }

    /// Whether only the map holds this entry's gate, if it has one. Checked under the shard's
    /// write lock, the answer cannot change: nobody else can reach the gate to clone it.
    fn unheld(&self) -> bool {
        match self {
            Slot::Idle(_) => true,
            Slot::Active(gate) => Arc::strong_count(gate) == 1,
        }
    }

    /// Turns a quiet gate that only the map holds back into [`Slot::Idle`].
    fn collapse(&mut self) {
        if let Slot::Active(gate) = self
            && Arc::strong_count(gate) == 1
            && let Some(highest) = gate.quiet()
        {
            *self = Slot::Idle(highest);
        }
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
        let drained = s.draining == 0;
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
}

/// How the job cache has served lookups since the layer was built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct CacheStats {
    /// Jobs held in memory now.
    pub cached_jobs: usize,
    /// Fenced requests whose job was in memory.
    pub hits: u64,
    /// Reads of a job's highest generation from the store, to fill the cache (concurrent
    /// requests for one uncached job share one read).
    pub misses: u64,
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

/// The jobs a collapsing pass will look at.
#[derive(Debug, Default)]
struct Made {
    jobs: Vec<JobId>,
    /// How many of `jobs` the last pass found busy and kept: the next pass waits for
    /// [`COLLAPSE_EVERY`] new ones on top, so long-busy jobs do not make every gate trigger one.
    carried: usize,
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

    fn gate(&self, job: &JobId, capacity: usize) -> Arc<Gate> {
        self.lookups.fetch_add(1, Relaxed);
        if let Some(slot) = self.map.get(job)
            && let Slot::Active(gate) = &*slot
        {
            return gate.clone(); // a busy (or recently busy) job: no write lock, no allocation
        }
        let mut made = false;
        let gate = match self.map.get_mut(job) {
            Some(mut slot) => slot.activate(&mut made),
            None => {
                made = true;
                self.map
                    .entry(job.clone())
                    .or_insert_with(|| Slot::Active(Arc::default()))
                    .activate(&mut made)
            }
        };
        let capacity = capacity.max(1);
        if made {
            let mut list = self.made.lock().unwrap_or_else(|e| e.into_inner());
            list.jobs.push(job.clone());
            if list.jobs.len() >= list.carried + COLLAPSE_EVERY {
                let jobs = std::mem::take(&mut list.jobs);
                list.carried = 0;
                drop(list);
                self.collapse_idle(jobs);
            }
        }
        if self.map.len() > capacity {
            self.evict(capacity);
        }
        gate
    }

    /// Every quiet gate nobody holds among `jobs` becomes [`Slot::Idle`]; the busy ones are
    /// listed again for the next pass.
    fn collapse_idle(&self, jobs: Vec<JobId>) {
        let mut busy = Vec::new();
        for job in jobs {
            if let Some(mut slot) = self.map.get_mut(&job) {
                slot.collapse();
                if matches!(*slot, Slot::Active(_)) {
                    drop(slot);
                    busy.push(job);
                }
            }
        }
        if !busy.is_empty() {
            let mut list = self.made.lock().unwrap_or_else(|e| e.into_inner());
            list.carried += busy.len();
            list.jobs.extend(busy);
        }
    }

    /// Drops idle gates until the map is back under capacity, with some headroom so the scan
    /// is paid once per many inserts.
    fn evict(&self, capacity: usize) {
        let target = capacity - (capacity / 16).clamp(1, EVICT_AT_ONCE).min(capacity - 1);
        let excess = self.map.len().saturating_sub(target);
        let idle: Vec<JobId> = self
            .map
            .iter()
            .filter(|e| e.value().unheld())
            .map(|e| e.key().clone())
            .take(excess)
            .collect();
        for job in idle {
            // Atomic with the check: nobody can take the gate between the test and the removal.
            self.map.remove_if(&job, |_, slot| slot.unheld());
        }
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

    /// Decides one request of `job` carrying `token`.
    ///
    /// Cancel-safe: a bump whose durable write has started finishes (and updates the gate)
    /// in a task of its own when the request goes away.
    pub(crate) async fn admit(
        self: &Arc<Self>,
        job: &JobId,
        token: Generation,
        limits: Limits,
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
            match self.decide(gate, token) {
                Step::Stale { highest, pending } => return Admission::Stale { highest, pending },
                Step::Current(guard) if self.store.is_shared() => {
                    return self
                        .confirm(gate, job, token, guard, limits.store_timeout)
                        .await;
                }
                Step::Current(guard) => return Admission::Admitted(guard),
                Step::Bump => {
                    match self
                        .bump(gate.clone(), job.clone(), token, limits.store_timeout)
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

    /// One look at the gate, under its lock.
    fn decide(&self, gate: &Arc<Gate>, token: Generation) -> Step {
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
            return Step::Current(InFlight {
                gate: gate.clone(),
                generation: token,
            });
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
    ) -> Result<(), Admission> {
        let gates = self.clone();
        Detachable::finishing(Box::pin(async move {
            let unsettled = Unsettled { gate: &gate, token };
            let result = gates.observe(&job, token, timeout).await;
            std::mem::forget(unsettled);
            let settled = Self::settle(&gate, token, result);
            gate.changed.notify_waiters();
            settled
        }))
        .await
    }

    fn settle(
        gate: &Gate,
        token: Generation,
        result: Result<Verdict, StoreError>,
    ) -> Result<(), Admission> {
        let mut s = gate.lock();
        s.bumping = None;
        match result {
            Ok(Verdict::Accepted) => {
                s.raise(token);
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
