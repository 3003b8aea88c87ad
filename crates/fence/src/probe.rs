//! Health probes of a store: one at a time, its answer shared for a second.
//!
//! The probes (`/healthz`, `/readyz` of the lease server and of the proxy's admin listener)
//! need no secret, so a flood of them must not reach the store one by one: on PostgreSQL
//! each would take a connection of the pool that claims, renewals and fenced requests wait
//! for. A failure is shared like a success: a store that is down would otherwise be asked
//! again, and its failure logged, for every probe.

use std::time::Duration;

use tokio::{sync::Mutex, time::Instant};

/// How long a probe's answer is given to the probes that follow.
const FRESH: Duration = Duration::from_secs(1);

/// The last probe of the store (its answer `T`), and when it answered.
#[derive(Debug)]
pub(crate) struct Shared<T> {
    last: Mutex<Option<(Instant, T)>>,
}

impl<T> Default for Shared<T> {
    fn default() -> Self {
        Self {
            last: Mutex::new(None),
        }
    }
}

impl<T: Clone> Shared<T> {
    /// The answer of a probe of the store that ended while this one waited for it, or that
    /// is less than a second old (whatever it said); otherwise of `probe`, run now while the
    /// probes that come meanwhile wait for it. A store that came back is seen within a
    /// second.
    pub(crate) async fn check(&self, probe: impl Future<Output = T>) -> T {
        let asked = Instant::now();
        let mut last = self.last.lock().await;
        if let Some((at, answer)) = &*last
            && (*at > asked || at.elapsed() < FRESH)
        {
            return answer.clone();
        }
        let answer = probe.await;
        *last = Some((Instant::now(), answer.clone()));
        answer
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    };

    use fence_core::problem::Problem;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_flood_of_probes_reaches_the_store_once_a_second() {
        let health = Arc::new(Shared::default());
        let asked = Arc::new(AtomicUsize::new(0));
        let probe = |asked: Arc<AtomicUsize>| async move {
            asked.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(50)).await; // a slow store
            Ok::<(), Problem>(())
        };
        let flood: Vec<_> = (0..100)
            .map(|_| {
                let (health, asked) = (health.clone(), asked.clone());
                tokio::spawn(async move { health.check(probe(asked)).await })
            })
            .collect();
        for answer in flood {
            assert_eq!(answer.await.unwrap(), Ok(()));
        }
        assert_eq!(asked.load(Ordering::SeqCst), 1, "one probe for the flood");
        tokio::time::sleep(FRESH).await;
        health.check(probe(asked.clone())).await.unwrap();
        assert_eq!(
            asked.load(Ordering::SeqCst),
            2,
            "a stale answer is not given"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_failure_is_shared_for_a_second_like_a_success() {
        let health = Arc::new(Shared::default());
        let asked = Arc::new(AtomicUsize::new(0));
        let failing = |asked: Arc<AtomicUsize>| async move {
            asked.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(50)).await;
            Err(Problem::new(
                fence_core::problem::ProblemType::StoreUnavailable,
                "down",
            ))
        };
        let flood: Vec<_> = (0..20)
            .map(|_| {
                let (health, asked) = (health.clone(), asked.clone());
                tokio::spawn(async move { health.check(failing(asked)).await })
            })
            .collect();
        for answer in flood {
            assert!(answer.await.unwrap().is_err());
        }
        assert_eq!(asked.load(Ordering::SeqCst), 1, "one probe for the flood");
        // Probes that come after it within the second get the failure, not a read each.
        for _ in 0..20 {
            tokio::time::sleep(Duration::from_millis(10)).await;
            assert!(health.check(failing(asked.clone())).await.is_err());
        }
        assert_eq!(asked.load(Ordering::SeqCst), 1, "one read in the second");
        // The store is back: the first probe after the second asks it.
        tokio::time::sleep(FRESH).await;
        assert_eq!(health.check(async { Ok(()) }).await, Ok::<(), Problem>(()));
    }
}
