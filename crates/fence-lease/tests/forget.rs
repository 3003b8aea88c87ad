//! The lease server forgets idle jobs (contract section 8) and keeps one durable floor: a job
//! claimed again, or claimed for the first time, starts above every generation it ever had.

use std::{sync::Arc, time::Duration};

use fence_core::{Generation, JobId, Owner, Ttl};
use fence_lease::{
    LeaseStore, ManualClock, MemoryLeaseStore, Outcome, SledLeaseStore, new_lease_key,
};

const START: u64 = 1_700_000_000_000;
const IDLE: Duration = Duration::from_secs(3600);

fn job(s: &str) -> JobId {
    s.parse().unwrap()
}

async fn claim<S: LeaseStore>(
    store: &S,
    job: &JobId,
) -> (Generation, fence_core::secret::LeaseKey) {
    let key = new_lease_key().unwrap();
    let owner: Owner = "w".parse().unwrap();
    match store
        .claim(job, &owner, &key, Ttl::from_millis(10_000).unwrap())
        .await
        .unwrap()
    {
        Outcome::Granted(g) => (g.generation, key),
        other => panic!("{other:?}"),
    }
}

async fn history<S: LeaseStore>(store: &S, clock: &ManualClock) {
    let owner: Owner = "w".parse().unwrap();
    // "a": claimed, released, claimed again and completed: generation 2.
    let a = job("a");
    let (g1, k1) = claim(store, &a).await;
    store.release(&a, &owner, g1, &k1).await.unwrap();
    let (g2, k2) = claim(store, &a).await;
    assert_eq!(g2, Generation::new(2));
    store.complete(&a, &owner, g2, &k2).await.unwrap();
    // "b": held, so never forgotten while the lease runs.
    let (_, _) = claim(store, &job("b")).await;
    clock.advance(Duration::from_secs(5));
    // "c": claimed 4 times, left to expire.
    let c = job("c");
    for _ in 0..4 {
        let (g, k) = claim(store, &c).await;
        store.release(&c, &owner, g, &k).await.unwrap();
    }
    let (g, _) = claim(store, &c).await;
    assert_eq!(g, Generation::new(5));
}

async fn forgets_and_starts_above<S: LeaseStore>(store: S, clock: &ManualClock) -> S {
    history(&store, clock).await;
    assert_eq!(
        store.forget_idle(IDLE, 100).await.unwrap(),
        0,
        "nothing idle yet"
    );
    clock.advance(IDLE + Duration::from_secs(11));
    assert_eq!(
        store.forget_idle(IDLE, 100).await.unwrap(),
        3,
        "a, b and c: all ended and idle"
    );
    for j in ["a", "b", "c"] {
        assert!(
            store.get(&job(j)).await.unwrap().is_none(),
            "{j} is forgotten (GET is 404)"
        );
    }
    // A forgotten completed job may run again, above every generation it had.
    let (again, _) = claim(&store, &job("a")).await;
    assert_eq!(
        again,
        Generation::new(6),
        "the floor is 5 (c's), so a starts at 6"
    );
    store
}

#[tokio::test]
async fn memory_store_forgets_and_claims_start_above_the_floor() {
    let clock = ManualClock::new(START);
    let store = MemoryLeaseStore::with_clock(Arc::new(clock.clone()));
    let store = forgets_and_starts_above(store, &clock).await;
    let (fresh, _) = claim(&store, &job("never-seen")).await;
    assert_eq!(
        fresh,
        Generation::new(6),
        "a job with no record starts at floor + 1"
    );
}

#[tokio::test]
async fn sled_store_forgets_and_the_floor_survives_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(START);
    {
        let store = SledLeaseStore::open_with_clock(dir.path(), Arc::new(clock.clone())).unwrap();
        forgets_and_starts_above(store, &clock).await;
    }
    let store = SledLeaseStore::open_with_clock(dir.path(), Arc::new(clock.clone())).unwrap();
    let (c, _) = claim(&store, &job("c")).await;
    assert_eq!(
        c,
        Generation::new(6),
        "after a restart, still above the floor"
    );
    let (fresh, _) = claim(&store, &job("new")).await;
    assert_eq!(fresh, Generation::new(6));
    assert!(store.job_count() <= 3);
}

#[tokio::test]
async fn a_held_lease_is_never_forgotten() {
    let clock = ManualClock::new(START);
    let store = MemoryLeaseStore::with_clock(Arc::new(clock.clone()));
    let owner: Owner = "w".parse().unwrap();
    let j = job("long");
    let key = new_lease_key().unwrap();
    store
        .claim(
            &j,
            &owner,
            &key,
            Ttl::from_millis(24 * 3600 * 1000).unwrap(),
        )
        .await
        .unwrap();
    clock.advance(IDLE * 2);
    assert_eq!(store.forget_idle(IDLE, 100).await.unwrap(), 0);
    assert!(store.get(&j).await.unwrap().is_some());
}
