//! The gates in memory: one entry per job, idle jobs kept small, eviction and forgetting.
//!
//! Most cached jobs are idle (nothing in flight, no bump pending), and an idle job needs only
//! its highest generation and stamp: [`Slot::Idle`], beside the key. A job gets a whole gate
//! when a request needs one, and keeps it while it stays busy (a hot job's requests then cost
//! no allocation); the jobs given a gate are listed, and after every [`COLLAPSE_EVERY`] of
//! them one short pass over that list (not the map) turns the gates nobody holds and that are
//! quiet back into `Slot::Idle`, with the same test as eviction: under the shard's write lock,
//! a gate only the map holds cannot be taken by anyone.

use std::{
    collections::HashSet,
    sync::{Arc, atomic::Ordering::Relaxed},
    time::Duration,
};

use dashmap::DashMap;
use fence_core::{Generation, JobId};

use super::{Gate, Gates, Mutant, broken};
use crate::store::{GenerationStore, IdlePage, StoreError};

/// One job's entry in the map.
#[derive(Debug)]
pub(super) enum Slot {
    /// Loaded from the store, nothing in flight, no bump pending or running: the highest
    /// generation and when the store last stamped it, as far as this process knows.
    Idle(Generation, u64),
    /// Busy, or not loaded yet.
    Active(Arc<Gate>),
}

pub(super) type Map = DashMap<JobId, Slot>;

/// Gates made between two collapsing passes; a pass looks at this many jobs (plus those still
/// busy from the last one), a few tens of microseconds.
pub(super) const COLLAPSE_EVERY: usize = 256;

/// At most this many jobs are evicted by one pass, so no request pays for a long scan.
const EVICT_AT_ONCE: usize = 1024;

impl Slot {
    /// The gate of a busy job; an idle one gets a fresh gate holding its highest generation
    /// (and `made` is set).
    fn activate(&mut self, made: &mut bool) -> Arc<Gate> {
        match self {
            Slot::Active(gate) => gate.clone(),
            Slot::Idle(highest, touched_ms) => {
                let gate = Arc::new(Gate::idle(*highest, *touched_ms));
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
            Slot::Idle(..) => true,
            Slot::Active(gate) => Arc::strong_count(gate) == 1 || broken(Mutant::EvictHeld),
        }
    }

    /// Turns a quiet gate that only the map holds back into [`Slot::Idle`].
    ///
    /// Both tests matter: a busy gate is never quiet, but a waiter woken when the last older
    /// request finished holds a gate that is quiet until it runs again. Folding that gate
    /// would leave the waiter deciding on an orphan while new requests get a fresh gate, and
    /// a newer token could then pass beside it. Only the gate's model check reaches that
    /// window (between a wake-up and the waiter's next poll): see `model.rs`.
    fn collapse(&mut self) {
        if let Slot::Active(gate) = self
            && (Arc::strong_count(gate) == 1 || broken(Mutant::CollapseHeld))
            && let Some((highest, touched_ms)) = gate.quiet()
        {
            *self = Slot::Idle(highest, touched_ms);
        }
    }
}

/// A job's fence as a layer sees it: [`FenceLayer::job`](crate::FenceLayer::job).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct JobFence {
    /// The highest generation accepted (0: none, or forgotten).
    pub highest: Generation,
    /// Admitted requests of the job still running.
    pub in_flight: usize,
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

/// The jobs a collapsing pass will look at.
#[derive(Debug, Default)]
pub(super) struct Made {
    pub(super) jobs: Vec<JobId>,
    /// How many of `jobs` the last pass found busy and kept: the next pass waits for
    /// [`COLLAPSE_EVERY`] new ones on top, so long-busy jobs do not make every gate trigger one.
    pub(super) carried: usize,
}

impl<St: GenerationStore> Gates<St> {
    pub(super) fn gate(&self, job: &JobId, capacity: usize) -> Arc<Gate> {
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
    /// listed again for the next pass, each once. A busy job carried from pass to pass is
    /// listed again when it is made again (evicted or forgotten once nobody held it, then
    /// asked for), so `jobs` may hold it twice, and so may the list made since: counted
    /// twice, it would be carried twice at every pass, and a job made again and again while
    /// busy would grow the list without bound.
    pub(super) fn collapse_idle(&self, jobs: Vec<JobId>) {
        let mut seen = HashSet::with_capacity(jobs.len());
        let mut busy = Vec::new();
        for job in &jobs {
            if !seen.insert(job) {
                continue;
            }
            if let Some(mut slot) = self.map.get_mut(job) {
                slot.collapse();
                if matches!(*slot, Slot::Active(_)) {
                    drop(slot);
                    busy.push(job.clone());
                }
            }
        }
        if !busy.is_empty() {
            let mut list = self.made.lock().unwrap_or_else(|e| e.into_inner());
            // Made again since this pass took the list: listed already.
            let listed: HashSet<&JobId> = list.jobs.iter().collect();
            busy.retain(|job| !listed.contains(job));
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

    /// Forgets the jobs the store has not stamped for `idle_for`, in pages of `batch`: each
    /// leaves the map first, unless a request holds its gate (in flight, or a bump running),
    /// and is then deleted from the store unless stamped again meanwhile. Runs in the
    /// background; returns how many jobs were forgotten.
    ///
    /// A request that arrives in between reads the job's highest from the store (still
    /// there) or finds it gone and starts from zero; either is safe once every token below
    /// the job's highest has expired, which `idle_for` (longer than any lease plus twice the
    /// clock skew) guarantees (contract section 8).
    pub(crate) async fn forget_idle(
        &self,
        idle_for: Duration,
        batch: usize,
    ) -> Result<usize, StoreError> {
        let mut after = None;
        let mut forgotten = 0;
        loop {
            let page = self
                .store
                .idle(IdlePage {
                    idle_for,
                    after: after.as_ref(),
                    limit: batch,
                })
                .await?;
            for idle in &page {
                if self.let_go(&idle.job) && self.store.forget(idle).await? {
                    forgotten += 1;
                }
            }
            if page.len() < batch {
                return Ok(forgotten);
            }
            after = page.last().cloned();
            tokio::task::yield_now().await;
        }
    }

    /// What the layer knows of `job` now: its highest generation and how many admitted
    /// requests are still running; read from the store when the job is not cached.
    pub(crate) async fn peek(&self, job: &JobId) -> Result<JobFence, StoreError> {
        let (highest, in_flight) = match self.cached(job) {
            Some(known) => known,
            None => (self.store.highest(job).await?, 0),
        };
        Ok(JobFence { highest, in_flight })
    }

    /// `job`'s highest generation when it is in memory; never reads the store.
    pub(crate) fn cached_highest(&self, job: &JobId) -> Option<Generation> {
        self.cached(job).map(|(highest, _)| highest)
    }

    /// `job`'s highest generation and admitted requests still running, when it is in memory.
    fn cached(&self, job: &JobId) -> Option<(Generation, usize)> {
        self.map.get(job).and_then(|slot| match &*slot {
            Slot::Idle(highest, _) => Some((*highest, 0)),
            Slot::Active(gate) if gate.loaded.initialized() => {
                let s = gate.lock();
                Some((s.highest, s.current + s.draining))
            }
            Slot::Active(_) => None,
        })
    }

    /// Admitted requests still running, over every job (a walk over the map: for a metric,
    /// not for a request path).
    pub(crate) fn in_flight(&self) -> usize {
        self.map
            .iter()
            .map(|entry| match entry.value() {
                Slot::Active(gate) => {
                    let s = gate.lock();
                    s.current + s.draining
                }
                Slot::Idle(..) => 0,
            })
            .sum()
    }

    /// Takes `job` out of the map unless a request holds its gate; whether it is out.
    pub(super) fn let_go(&self, job: &JobId) -> bool {
        // Atomic with the check: nobody can take the gate between the test and the removal.
        self.map.remove_if(job, |_, slot| slot.unheld()).is_some() || !self.map.contains_key(job)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryStore;

    /// A job busy at every pass, and made again in between (let go while nobody held it,
    /// then asked for again): listed once, however often.
    #[test]
    fn a_busy_job_made_again_and_again_is_listed_once() {
        let gates = Gates::new(Arc::new(MemoryStore::new()));
        let job: JobId = "busy".parse().unwrap();
        let pass = || {
            let jobs = std::mem::take(&mut gates.made.lock().unwrap().jobs);
            gates.collapse_idle(jobs);
        };
        for _ in 0..5 {
            let held = gates.gate(&job, 1_000);
            pass(); // held (and not loaded): busy, carried to the next pass
            drop(held);
            assert!(gates.let_go(&job), "nobody holds it");
        }
        let _held = gates.gate(&job, 1_000);
        pass();
        let listed = gates.made.lock().unwrap().jobs.len();
        assert!(listed <= 1, "one job listed {listed} times");
    }
}
