//! The layer's background upkeep: sweeping expired idempotency records off the store.

use std::{
    sync::{Arc, Weak},
    time::Duration,
};

use tokio::task::JoinHandle;

use crate::IdempotencyStore;

/// A running upkeep task of a [`FenceLayer`](crate::FenceLayer); it stops when this handle is
/// dropped or stopped, or when the store is dropped.
#[derive(Debug)]
pub struct Maintenance {
    task: Option<JoinHandle<()>>,
}

impl Maintenance {
    /// Sweeps `store` every `every` (none: nothing to do).
    pub(crate) fn spawn<St: IdempotencyStore>(store: &Arc<St>, every: Option<Duration>) -> Self {
        let Some(every) = every else {
            return Self { task: None };
        };
        let weak: Weak<St> = Arc::downgrade(store);
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(every.max(Duration::from_millis(10)));
            tick.tick().await;
            loop {
                tick.tick().await;
                let Some(store) = weak.upgrade() else { return };
                match store.purge_expired().await {
                    Ok(0) => {}
                    Ok(n) => tracing::debug!(purged = n, "expired idempotency records deleted"),
                    Err(e) => {
                        tracing::warn!(error = %fence_storage::error_chain(&e), "sweeping idempotency records failed");
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

impl Drop for Maintenance {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}
