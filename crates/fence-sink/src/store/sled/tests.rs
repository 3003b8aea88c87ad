//! The sled sink store's own tests, beside the conformance suite every sink store passes.

use std::collections::BTreeMap;

use proptest::prelude::*;

use fence_core::headers::IdempotencyKey;

use super::*;
use crate::{
    Fingerprint,
    conformance::at,
    store::{Attempt, Begin, Finish, IdempotencyStore},
};

const MINUTE: Duration = Duration::from_secs(60);

/// The response the stall tests store: an effect that ran.
#[cfg(feature = "test-hooks")]
fn paid() -> crate::StoredResponse {
    crate::StoredResponse {
        status: http::StatusCode::CREATED,
        headers: http::HeaderMap::new(),
        body: bytes::Bytes::from_static(b"paid"),
        trailers: None,
    }
}

crate::sink_store_conformance!(|| async {
    let clock = fence_storage::clock::ManualClock::new(1_700_000_000_000);
    let dir = tempfile::tempdir().unwrap().keep();
    let store = SledStore::open_with_clock(dir, Arc::new(clock.clone())).unwrap();
    Some((store, crate::conformance::advance_fn(clock)))
});

// The forward cases only: a step back holds a sled record the step longer (judged on the
// earlier of its two clocks; tests/records.rs), which the backward case rules out.
crate::conformance::__storage::conformance_cases!(crate::conformance::steps; || async {
    let clock = fence_storage::clock::ManualClock::new(1_700_000_000_000);
    let dir = tempfile::tempdir().unwrap().keep();
    let store = SledStore::open_with_clock(dir, Arc::new(clock.clone())).unwrap();
    Some((store, clock))
}; a_forward_step_of_the_wall_clock_does_not_expire_a_record,
    a_forward_step_of_the_wall_clock_does_not_age_a_job,);

/// The response of an effect that ran is kept while the disk stalls (a new request's
/// record is refused then): refused, the record would stay in flight, and a retry after
/// its timeout would run the effect again. The stall check is on the real clock (the
/// log's writer is a thread), so this waits out `STALLED_AFTER`.
#[cfg(feature = "test-hooks")]
#[tokio::test]
// The guard held across awaits is the stalled disk: the log's writer, another thread,
// waits on it; nothing on this task does.
#[allow(clippy::await_holding_lock)]
async fn an_effects_response_is_kept_while_the_disk_stalls() {
    let dir = tempfile::tempdir().unwrap();
    let store = SledStore::open(dir.path()).unwrap();
    let job: JobId = "stall".parse().unwrap();
    let (key, other) = (
        IdempotencyKey::from_bytes(b"k1").unwrap(),
        IdempotencyKey::from_bytes(b"k2").unwrap(),
    );
    let fp = Fingerprint::of(&http::Method::POST, "/pay", b"{}");
    let done = crate::conformance::attempt(&job, &key, &fp, 7, 1);
    assert_eq!(store.begin(done, MINUTE).await.unwrap(), Begin::Started);
    let stalled = store.db.stall_log();
    // A request that came before the stall waits for the disk: the log's writer is in
    // its round from here on.
    let waiting = {
        let (store, job, fp) = (store.clone(), job.clone(), fp);
        tokio::spawn(async move {
            let key = IdempotencyKey::from_bytes(b"k0").unwrap();
            let attempt = crate::conformance::attempt(&job, &key, &fp, 5, 1);
            store.begin(attempt, MINUTE).await
        })
    };
    tokio::time::sleep(fence_storage::disk::STALLED_AFTER + Duration::from_millis(500)).await;
    // A new request is refused while the disk stalls...
    let refused = tokio::time::timeout(
        Duration::from_secs(5),
        store.begin(crate::conformance::attempt(&job, &other, &fp, 9, 1), MINUTE),
    )
    .await
    .expect("a new request waited on the stalled disk instead of being refused");
    assert!(matches!(refused, Err(StoreError::Io(_))), "{refused:?}");
    // ...and so is an answer read from a record (here "in flight"), at once: it waits for
    // a commit, which the stalled disk cannot give.
    let retried = tokio::time::timeout(
        Duration::from_secs(1),
        store.begin(crate::conformance::attempt(&job, &key, &fp, 8, 1), MINUTE),
    )
    .await
    .expect("an answer read from a record waited on the stalled disk instead of being refused");
    assert!(matches!(retried, Err(StoreError::Io(_))), "{retried:?}");
    // ...the response of the one that ran is taken, and lands once the disk answers.
    let response = paid();
    let finishing = {
        let store = store.clone();
        let (job, key, fp, response) = (job.clone(), key.clone(), fp, response.clone());
        tokio::spawn(async move {
            let done = crate::conformance::attempt(&job, &key, &fp, 7, 1);
            let outcome = Finish::Store {
                response,
                retention: MINUTE,
            };
            store.finish(done, outcome).await
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(stalled);
    finishing.await.unwrap().unwrap();
    assert_eq!(waiting.await.unwrap().unwrap(), Begin::Started);
    drop(store);
    let store = SledStore::open(dir.path()).unwrap();
    let retry = crate::conformance::attempt(&job, &key, &fp, 8, 1);
    assert_eq!(
        store.begin(retry, MINUTE).await.unwrap(),
        Begin::Replay(response)
    );
}

/// A database of a build that kept exact stamps is rebuilt to whole seconds at open, so
/// that forgetting finds and removes its entries.
#[tokio::test]
async fn exact_stamps_of_an_older_build_are_rebuilt_to_whole_seconds() {
    let dir = tempfile::tempdir().unwrap();
    let clock = fence_storage::clock::ManualClock::new(1_700_000_000_123);
    let job: JobId = "old-build".parse().unwrap();
    {
        let store = SledStore::open_with_clock(dir.path(), Arc::new(clock.clone())).unwrap();
        store.observe(&job, Generation::new(3)).await.unwrap();
    }
    {
        // What the older build left: the exact stamp as key, and no format.
        let db = DurableDb::open(dir.path()).unwrap();
        let stamps = db.tree("stamps").unwrap();
        stamps.clear().unwrap();
        let mut exact = (1_700_000_010_123_u64).to_be_bytes().to_vec();
        exact.extend_from_slice(job.as_str().as_bytes());
        stamps.insert(exact, &[][..]).unwrap();
        db.tree("format").unwrap().clear().unwrap();
        db.commit().await.unwrap();
    }
    let store = SledStore::open_with_clock(dir.path(), Arc::new(clock)).unwrap();
    let keys: Vec<u64> = store
        .stamps
        .iter()
        .keys()
        .map(|k| u64::from_be_bytes(k.unwrap()[..8].try_into().unwrap()))
        .collect();
    assert_eq!(keys, [1_700_000_011_000], "rounded up to the second");
}

#[derive(Debug, Clone)]
enum Op {
    Observe { job: u8, token: u64 },
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (0u8..4, 1u64..20).prop_map(|(job, token)| Op::Observe { job, token }),
        1 => Just(Op::Reopen),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// The store behaves as a per-job maximum in a BTreeMap, across reopens.
    #[test]
    fn matches_a_btreemap_model_across_reopens(ops in proptest::collection::vec(op(), 1..40)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let mut store = Some(SledStore::open(dir.path()).unwrap());
        let mut model: BTreeMap<u8, u64> = BTreeMap::new();
        for op in ops {
            match op {
                Op::Observe { job, token } => {
                    let j: JobId = format!("job-{job}").parse().unwrap();
                    let got = rt.block_on(store.as_ref().unwrap().observe(&j, Generation::new(token))).unwrap();
                    let highest = model.entry(job).or_insert(0);
                    let want = if token < *highest { Verdict::Stale { highest: Generation::new(*highest) } } else { Verdict::Accepted };
                    *highest = (*highest).max(token);
                    prop_assert_eq!(got, want);
                }
                Op::Reopen => {
                    drop(store.take());
                    store = Some(SledStore::open(dir.path()).unwrap());
                }
            }
        }
        let store = store.unwrap();
        for (job, highest) in model {
            let j: JobId = format!("job-{job}").parse().unwrap();
            prop_assert_eq!(rt.block_on(store.highest(&j)).unwrap(), Generation::new(highest));
        }
    }
}

#[tokio::test]
async fn records_survive_reopen_and_corruption_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let (j, k) = (
        "j".parse::<JobId>().unwrap(),
        IdempotencyKey::from_bytes(b"k").unwrap(),
    );
    let f = Fingerprint::of(&http::Method::POST, "/", b"");
    {
        let store = SledStore::open(dir.path()).unwrap();
        store.observe(&j, Generation::new(41)).await.unwrap();
        let begin = store.begin(at(&j, &k, &f), MINUTE).await.unwrap();
        assert_eq!(begin, Begin::Started);
    }
    let store = SledStore::open(dir.path()).unwrap();
    assert_eq!(
        store.observe(&j, Generation::new(40)).await.unwrap(),
        Verdict::Stale {
            highest: Generation::new(41)
        }
    );
    let begin = store.begin(at(&j, &k, &f), MINUTE).await.unwrap();
    assert_eq!(
        begin,
        Begin::InFlight,
        "the in-flight record survived the restart"
    );
    store.generations.insert("bad", &b"xyz"[..]).unwrap();
    let err = store
        .observe(&"bad".parse().unwrap(), Generation::new(1))
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "stored record of job bad is corrupt: generation record is not 16 or 24 bytes"
    );
}

/// A replay read from a record whose write is not on disk yet waits for the disk: answered at
/// once, a crash could take the record back to in flight, and a retry after the in-flight
/// timeout would run the effect the caller was told had run.
#[cfg(feature = "test-hooks")]
#[tokio::test]
// The guard held across awaits is the stalled disk: the log's writer, another thread,
// waits on it; nothing on this task does.
#[allow(clippy::await_holding_lock)]
async fn a_replay_waits_until_the_record_it_reads_is_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    let store = SledStore::open(dir.path()).unwrap();
    let job: JobId = "replay".parse().unwrap();
    let key = IdempotencyKey::from_bytes(b"k").unwrap();
    let fp = Fingerprint::of(&http::Method::POST, "/pay", b"{}");
    let first = crate::conformance::attempt(&job, &key, &fp, 7, 1);
    assert_eq!(store.begin(first, MINUTE).await.unwrap(), Begin::Started);
    let response = paid();
    let stalled = store.db.stall_log();
    let finishing = {
        let (store, job, key, fp) = (store.clone(), job.clone(), key.clone(), fp);
        let outcome = Finish::Store {
            response: response.clone(),
            retention: MINUTE,
        };
        tokio::spawn(async move {
            let first = crate::conformance::attempt(&job, &key, &fp, 7, 1);
            store.finish(first, outcome).await
        })
    };
    // The finish is applied (it waits for its commit, behind the stalled writer).
    tokio::time::timeout(Duration::from_secs(5), async {
        while store
            .records
            .get(idempotency::record_key(&job, &key))
            .unwrap()
            .is_none_or(|raw| {
                matches!(
                    record::Record::decode(&raw).unwrap(),
                    record::Record::InFlight { .. }
                )
            })
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the finish was not applied");
    let retry = || crate::conformance::attempt(&job, &key, &fp, 7, 1);
    let early =
        tokio::time::timeout(Duration::from_millis(500), store.begin(retry(), MINUTE)).await;
    assert!(
        early.is_err(),
        "a replay was answered before its record was on disk: {early:?}"
    );
    drop(stalled);
    finishing.await.unwrap().unwrap();
    assert_eq!(
        store.begin(retry(), MINUTE).await.unwrap(),
        Begin::Replay(response)
    );
}

/// What another request's raise wrote is answered only once it is on disk, refused while
/// the disk stalls: a job loaded while its last raise is not on disk yet (the raise's commit
/// timed out on a stalling disk and its gate was evicted), and an older token's check that
/// reads such a raise (its stale answer names that highest). Either way the gate takes the
/// highest it read as settled, and lets that generation through with no write of its own: a
/// crash would then take the raise back while that effect stood.
#[cfg(feature = "test-hooks")]
#[tokio::test]
// The guard held across awaits is the stalled disk: the log's writer, another thread,
// waits on it; nothing on this task does.
#[allow(clippy::await_holding_lock)]
async fn a_read_of_a_raise_waits_until_it_is_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    let store = SledStore::open(dir.path()).unwrap();
    let job: JobId = "raised".parse().unwrap();
    let g = Generation::new;
    store.accept(&job, g(1), false).await.unwrap();
    let stalled = store.db.stall_log();
    let raising = {
        let (store, job) = (store.clone(), job.clone());
        tokio::spawn(async move { store.accept(&job, g(2), false).await })
    };
    // The raise is applied in memory; its commit waits behind the stalled writer.
    tokio::time::timeout(Duration::from_secs(5), async {
        while store.highest(&job).await.unwrap() < g(2) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the raise was not applied");
    let early = tokio::time::timeout(Duration::from_millis(500), store.load(&job)).await;
    assert!(
        !matches!(early, Ok(Ok(_))),
        "a load was answered before the raise it read was on disk: {early:?}"
    );
    let early = tokio::time::timeout(Duration::from_millis(500), store.observe(&job, g(1))).await;
    assert!(
        !matches!(early, Ok(Ok(_))),
        "a stale answer was given before the raise it names was on disk: {early:?}"
    );
    drop(stalled);
    raising.await.unwrap().unwrap();
    assert_eq!(store.load(&job).await.unwrap().highest, g(2));
    assert_eq!(
        store.observe(&job, g(1)).await.unwrap(),
        Verdict::Stale { highest: g(2) }
    );
}

/// The restart bound is measured on the clock's monotonic reading from the open: a wall
/// clock stepped forward an hour after the open (NTP after a boot) does not count as an
/// hour passed, which would end at once the wait for what an earlier process left running.
#[tokio::test]
async fn a_wall_clock_step_after_the_open_is_not_time_passed() {
    use fence_storage::clock::{Clock, ManualClock};
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_700_000_000_000);
    let job: JobId = "stepped".parse().unwrap();
    {
        let store = SledStore::open_with_clock(dir.path(), Arc::new(clock.clone())).unwrap();
        store.accept(&job, Generation::new(1), false).await.unwrap();
    }
    let store = SledStore::open_with_clock(dir.path(), Arc::new(clock.clone())).unwrap();
    let opened = clock.now_ms();
    clock.advance(Duration::from_secs(2));
    clock.step_ms(3_600_000);
    let prior = store.load(&job).await.unwrap().prior.expect("stamps");
    assert_eq!(prior.opened_ms, opened);
    assert_eq!(
        prior.now_ms,
        opened + 2_000,
        "the step counted as time passed"
    );
    // Nor does forgetting take the step for time passed: the job is not idle for an hour.
    let idle = store
        .idle(IdlePage {
            idle_for: Duration::from_secs(600),
            after: None,
            limit: 10,
        })
        .await
        .unwrap();
    assert_eq!(idle, [], "the step made the job look idle");
    // A job stamped by this process after the step is judged by the wall clock it was
    // stamped on: idle once its time has passed, not only after the process's restart.
    let later: JobId = "after-the-step".parse().unwrap();
    store
        .accept(&later, Generation::new(1), false)
        .await
        .unwrap();
    clock.advance(Duration::from_secs(600 + 20));
    let idle = store
        .idle(IdlePage {
            idle_for: Duration::from_secs(600),
            after: None,
            limit: 10,
        })
        .await
        .unwrap();
    let listed: Vec<&str> = idle.iter().map(|i| i.job.as_str()).collect();
    // (The earlier job too: 620 s have passed since the open, on either clock.)
    assert_eq!(
        listed,
        ["stepped", "after-the-step"],
        "the later job was judged by the time since the open"
    );
}

/// A stamp this process wrote before a forward step of the wall clock is not aged by the
/// step either. An audit: with forgetting on, a step of an hour forgot a job at once, and once
/// the clock was set right again a stale signed token that had not expired was taken as a new
/// job's first write, its effect committed after the newer holder's. A job stamped after the
/// step is judged on the wall clock it was stamped on.
#[tokio::test]
async fn a_forward_step_does_not_age_the_stamps_this_process_wrote_before_it() {
    use fence_storage::clock::ManualClock;
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_700_000_000_000);
    let store = SledStore::open_with_clock(dir.path(), Arc::new(clock.clone())).unwrap();
    let idle = || async {
        let page = IdlePage {
            idle_for: Duration::from_secs(600),
            after: None,
            limit: 10,
        };
        let jobs = store.idle(page).await.unwrap();
        jobs.into_iter()
            .map(|i| i.job.to_string())
            .collect::<Vec<_>>()
    };
    clock.advance(Duration::from_secs(60));
    let before: JobId = "before-the-step".parse().unwrap();
    store
        .accept(&before, Generation::new(1), false)
        .await
        .unwrap();
    assert_eq!(idle().await, Vec::<String>::new());
    clock.advance(Duration::from_secs(2));
    clock.step_ms(3_600_000);
    assert_eq!(idle().await, Vec::<String>::new(), "the step aged the job");
    let after: JobId = "after-the-step".parse().unwrap();
    store
        .accept(&after, Generation::new(1), false)
        .await
        .unwrap();
    clock.advance(Duration::from_secs(300));
    assert_eq!(idle().await, Vec::<String>::new(), "the step aged the job");
    clock.advance(Duration::from_secs(320));
    assert_eq!(idle().await, ["before-the-step", "after-the-step"]);
}

mod records;
