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

/// A record is forgotten once it has been idle for the whole window counted from its last
/// change and from its lease's end, whichever is later, whatever changed it: released,
/// completed or revoked while held, or completed or released after its lease ran out
/// (allowed while nobody claimed since). A completed job forgotten early could run again
/// early; one forgotten late keeps the store larger. A revoke keeps the revoked lease's end
/// (a semaphore's slot stays in force until then), so a revoked job is forgotten from there.
async fn forgets_from_the_last_change<S: LeaseStore>(store: S, clock: &ManualClock) {
    const SECOND: Duration = Duration::from_secs(1);
    let idle = 60 * SECOND;
    let owner: Owner = "w".parse().unwrap();
    // 10 s leases, claimed at 0 s.
    let mut held = Vec::new();
    for j in [
        "released",
        "completed",
        "revoked",
        "completed-late",
        "released-late",
    ] {
        let (g, k) = claim(&store, &job(j)).await;
        held.push((job(j), g, k));
    }
    let [released, completed, revoked, completed_late, released_late] = &held[..] else {
        unreachable!()
    };
    clock.advance(5 * SECOND); // 5 s: in the lease
    store
        .release(&released.0, &owner, released.1, &released.2)
        .await
        .unwrap();
    store
        .complete(&completed.0, &owner, completed.1, &completed.2)
        .await
        .unwrap();
    assert!(matches!(
        store
            .apply(&revoked.0, fence_lease::LeaseOp::Revoke)
            .await
            .unwrap(),
        Outcome::Revoked(_)
    ));
    clock.advance(15 * SECOND); // 20 s: past the leases' end at 10 s
    let (j, g, k) = completed_late;
    assert!(matches!(
        store.complete(j, &owner, *g, k).await.unwrap(),
        Outcome::Done(_)
    ));
    let (j, g, k) = released_late;
    assert!(matches!(
        store.release(j, &owner, *g, k).await.unwrap(),
        Outcome::Done(_)
    ));

    let forgotten = |want: &'static [&'static str]| {
        let (store, held) = (&store, &held);
        async move {
            let mut gone = Vec::new();
            for (j, _, _) in held {
                if store.get(j).await.unwrap().is_none() {
                    gone.push(j.as_str().to_owned());
                }
            }
            let at = fence_lease::Clock::now_ms(clock) - START;
            assert_eq!(gone, want, "forgotten at {at} ms");
        }
    };
    clock.advance(40 * SECOND); // 60 s: 55 s after the changes at 5 s
    assert_eq!(
        store.forget_idle(idle, 100).await.unwrap(),
        0,
        "nothing idle for 60 s"
    );
    forgotten(&[]).await;
    clock.advance(7 * SECOND); // 67 s: 62 s after the changes, 57 s after the leases' end
    assert_eq!(store.forget_idle(idle, 100).await.unwrap(), 2);
    forgotten(&["released", "completed"]).await;
    clock.advance(8 * SECOND); // 75 s: 65 s after the leases' end, 55 s after the late changes
    assert_eq!(
        store.forget_idle(idle, 100).await.unwrap(),
        1,
        "the revoked lease's end at 10 s, the others changed at 20 s"
    );
    forgotten(&["released", "completed", "revoked"]).await;
    clock.advance(5 * SECOND); // 80 s
    assert_eq!(store.forget_idle(idle, 100).await.unwrap(), 2);
    forgotten(&[
        "released",
        "completed",
        "revoked",
        "completed-late",
        "released-late",
    ])
    .await;
}

#[tokio::test]
async fn each_store_forgets_from_the_last_change() {
    let clock = ManualClock::new(START);
    forgets_from_the_last_change(
        MemoryLeaseStore::with_clock(Arc::new(clock.clone())),
        &clock,
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(START);
    let sled = SledLeaseStore::open_with_clock(dir.path(), Arc::new(clock.clone())).unwrap();
    forgets_from_the_last_change(sled, &clock).await;
}

/// Calls `forget_idle` with `limit` until a call forgets fewer (a pass, as `fence server`
/// runs one); how many each call forgot.
async fn pass<S: LeaseStore>(store: &S, limit: usize) -> Vec<usize> {
    let mut counts = Vec::new();
    loop {
        let n = store.forget_idle(IDLE, limit).await.unwrap();
        counts.push(n);
        if n < limit {
            return counts;
        }
    }
}

/// Batches smaller than what there is to forget: a pass still forgets every idle job, also
/// the ones that became idle behind where an earlier batch stopped (a store that resumes
/// each batch where the last one ended must wrap around to the start).
async fn batches_cover_every_idle_job<S: LeaseStore>(store: S, clock: &ManualClock) {
    let owner: Owner = "w".parse().unwrap();
    let jobs: Vec<JobId> = (0..30).map(|i| job(&format!("j{i:02}"))).collect();
    for j in jobs.iter().step_by(2) {
        let (g, k) = claim(&store, j).await;
        store.release(j, &owner, g, &k).await.unwrap();
    }
    clock.advance(IDLE + Duration::from_secs(11));
    // The odd jobs are claimed now: held, and changed too recently to be forgotten.
    for j in jobs.iter().skip(1).step_by(2) {
        claim(&store, j).await;
    }
    // One batch of 4 of the 15 even jobs; the rest of them wait for the next pass.
    assert_eq!(store.forget_idle(IDLE, 4).await.unwrap(), 4);
    // Then the odd jobs' leases end and stay unchanged: they are idle too, before and
    // after where that batch stopped.
    clock.advance(IDLE + Duration::from_secs(11));
    assert_eq!(pass(&store, 4).await, [4, 4, 4, 4, 4, 4, 2]);
    for j in &jobs {
        assert!(store.get(j).await.unwrap().is_none(), "{j} is forgotten");
    }
    assert_eq!(pass(&store, 4).await, [0], "nothing is left");
}

#[tokio::test]
async fn each_store_forgets_every_idle_job_in_small_batches() {
    let clock = ManualClock::new(START);
    let memory = MemoryLeaseStore::with_clock(Arc::new(clock.clone()));
    batches_cover_every_idle_job(memory, &clock).await;
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(START);
    let sled = SledLeaseStore::open_with_clock(dir.path(), Arc::new(clock.clone())).unwrap();
    batches_cover_every_idle_job(sled, &clock).await;
}
