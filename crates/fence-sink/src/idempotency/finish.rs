//! A record whose completion failed is completed again in the background ([`Finishing`]).

use std::time::Duration;

use fence_core::{JobId, headers::IdempotencyKey};
use tokio::time::Instant;

use crate::store::{Attempt, Fingerprint, Finish, IdempotencyStore};

/// An [`Attempt`] whose parts it owns.
pub(super) struct OwnedAttempt {
    pub(super) job: JobId,
    pub(super) key: IdempotencyKey,
    pub(super) fingerprint: Fingerprint,
    pub(super) id: u64,
    pub(super) generation: fence_core::Generation,
}

impl OwnedAttempt {
    pub(super) fn attempt(&self) -> Attempt<'_> {
        Attempt {
            job: &self.job,
            key: &self.key,
            fingerprint: &self.fingerprint,
            id: self.id,
            generation: self.generation,
            // Only ever finished or forgotten, which takes nothing over.
            settled_after: Duration::ZERO,
        }
    }
}

/// The first pause and the longest between retries of a record's completion that failed.
const FINISH_RETRY_FIRST: Duration = Duration::from_millis(100);
const FINISH_RETRY_MOST: Duration = Duration::from_secs(5);

/// Tries `outcome` of `owned`'s record again, after [`FINISH_RETRY_FIRST`] doubling to
/// [`FINISH_RETRY_MOST`], each try within `limit`, until one lands or `until` has passed.
pub(super) async fn finish_again<St: IdempotencyStore>(
    store: &St,
    owned: &OwnedAttempt,
    outcome: Finish,
    limit: Duration,
    until: Instant,
) {
    let mut pause = FINISH_RETRY_FIRST;
    while Instant::now() < until {
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(FINISH_RETRY_MOST);
        let again = tokio::time::timeout(limit, store.finish(owned.attempt(), outcome.clone()));
        if let Ok(Ok(())) = again.await {
            return;
        }
    }
}

/// On an answer whose record could not be completed: the completion is retried in the
/// background until it lands or the record's in-flight timeout passes, and the request stays
/// in flight until then. Otherwise a newer token's request with the same key would take the
/// record over and run the step again, although it ran.
#[derive(Clone, Debug)]
pub(crate) struct Finishing(pub(super) tokio::sync::watch::Receiver<bool>);

impl Finishing {
    /// Returns once the completion landed or was given up.
    pub(crate) async fn done(mut self) {
        let _ = self.0.wait_for(|done| *done).await;
    }
}
