//! The layer's background upkeep: expired idempotency records, and idle jobs, off the store.

use std::{
    sync::{Arc, Weak},
    time::Duration,
};

use tokio::task::JoinHandle;

use crate::{GenerationStore, IdempotencyStore, gate::Gates};

/// How many idle jobs one page of a forgetting pass handles before it yields.
const FORGET_BATCH: usize = 1_000;

/// A running upkeep task of a [`FenceLayer`](crate::FenceLayer); it stops when this handle is
/// dropped or stopped, or when the store is dropped.
#[derive(Debug)]
pub struct Maintenance {
    task: Option<JoinHandle<()>>,
}

impl Maintenance {
    /// Sweeps idempotency records every `sweep`, and forgets jobs idle for `forget.after`
    /// every eighth of it (at most a minute, at least 10 ms); none of either: nothing to do.
    /// Before the first job is forgotten, the store is told the window tokens end within
    /// ([`GenerationStore::forgetting_within`]); until it has taken it, nothing is forgotten.
    pub(crate) fn spawn<St: GenerationStore + IdempotencyStore>(
        gates: &Arc<Gates<St>>,
        sweep: Option<Duration>,
        forget: Option<Forgetting>,
    ) -> Self {
        let forget_after = forget.map(|f| f.after);
        if sweep.is_none() && forget_after.is_none() {
            return Self { task: None };
        }
        let weak: Weak<Gates<St>> = Arc::downgrade(gates);
        let every = |d: Duration| {
            let mut tick = tokio::time::interval(d.max(Duration::from_millis(10)));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick
        };
        let mut sweeps = sweep.map(every);
        let mut forgets = forget_after.map(|d| every((d / 8).min(Duration::from_secs(60))));
        let task = tokio::spawn(async move {
            let mut told = false;
            loop {
                let (sweep_now, forget_now) = tokio::select! {
                    _ = async { sweeps.as_mut()?.tick().await; Some(()) }, if sweeps.is_some() => (true, false),
                    _ = async { forgets.as_mut()?.tick().await; Some(()) }, if forgets.is_some() => (false, true),
                };
                let Some(gates) = weak.upgrade() else { return };
                if sweep_now {
                    sweep_once(&**gates.store()).await;
                }
                if let (true, Some(forget)) = (forget_now, forget) {
                    if !told {
                        let store = gates.store();
                        match store
                            .forgetting_within(forget.clock_skew, forget.max_lease_ttl)
                            .await
                        {
                            Ok(()) => told = true,
                            Err(e) => {
                                tracing::warn!(error = %fence_storage::error_chain(&e), "telling the store the tokens' window failed; nothing is forgotten until it takes it");
                                continue;
                            }
                        }
                    }
                    match gates.forget_idle(forget.after, FORGET_BATCH).await {
                        Ok(0) => {}
                        Ok(n) => tracing::debug!(forgotten = n, "idle jobs forgotten"),
                        Err(e) => {
                            tracing::warn!(error = %fence_storage::error_chain(&e), "forgetting idle jobs failed");
                        }
                    }
                }
            }
        });
        Self { task: Some(task) }
    }

    /// Stops the upkeep and waits until its current pass, if any, has ended.
    pub async fn stop(mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
        }
    }
}

/// A layer's forgetting: after how long idle, and the window every token it admits ends
/// within (its clock skew and longest lease).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Forgetting {
    pub(crate) after: Duration,
    pub(crate) clock_skew: Duration,
    pub(crate) max_lease_ttl: Duration,
}

async fn sweep_once<St: IdempotencyStore>(store: &St) {
    match store.purge_expired().await {
        Ok(0) => {}
        Ok(n) => tracing::debug!(purged = n, "expired idempotency records deleted"),
        Err(e) => {
            tracing::warn!(error = %fence_storage::error_chain(&e), "sweeping idempotency records failed");
        }
    }
}

impl Drop for Maintenance {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}
