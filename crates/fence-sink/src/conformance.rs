//! The sink-store conformance suite: every behaviour of the store traits, for every backend.
//!
//! Covers [`GenerationStore`] and [`IdempotencyStore`];
//! [`sink_store_conformance!`](crate::sink_store_conformance) makes one test per case.
//!
//! A backend's test module supplies an async factory returning `Some((store, advance))`,
//! where `advance` moves the clock its idempotency records expire on, or `None` (after
//! printing why) to skip.

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use fence_core::{Generation, JobId, headers::IdempotencyKey};
use http::{HeaderMap, HeaderValue, Method, StatusCode};

use crate::{
    Attempt, Begin, Fingerprint, Finish, GenerationStore, IdempotencyStore, StoredResponse, Verdict,
};

#[doc(hidden)]
pub use fence_storage as __storage;

pub use fence_storage::clock::{Advance, advance_fn, ms};

pub mod steps;

/// Generates one `#[tokio::test]` per conformance case for the store made by `$make`.
#[macro_export]
macro_rules! sink_store_conformance {
    ($make:expr) => {
        $crate::conformance::__storage::conformance_cases!($crate::conformance; $make;
            first_observation_is_accepted_and_lower_is_stale,
            equal_is_accepted_and_highest_reads_back,
            jobs_are_independent,
            concurrent_observations_keep_the_maximum,
            begin_then_in_flight_then_replay,
            mismatched_fingerprint_is_reported,
            forget_lets_the_key_run_again,
            too_large_is_not_replayable,
            in_flight_and_retention_expire,
            keys_are_scoped_per_job,
            idle_jobs_are_listed_oldest_first_and_forgotten_only_if_unchanged,
            only_the_attempt_that_began_a_record_finishes_or_forgets_it,
            a_newer_generation_takes_over_an_older_generations_in_flight_record,
        );
    };
}

/// The attempt of `fingerprint` at (`job`, `key`): one attempt per fingerprint (its id is
/// made of the fingerprint's bytes), of generation 1.
pub fn at<'a>(
    job: &'a JobId,
    key: &'a IdempotencyKey,
    fingerprint: &'a Fingerprint,
) -> Attempt<'a> {
    let mut id = [0; 8];
    id.copy_from_slice(&fingerprint.0[..8]);
    attempt(job, key, fingerprint, u64::from_be_bytes(id) | 1, 1)
}

/// Attempt `id` of `fingerprint` at (`job`, `key`), admitted with a token of `generation`.
pub fn attempt<'a>(
    job: &'a JobId,
    key: &'a IdempotencyKey,
    fingerprint: &'a Fingerprint,
    id: u64,
    generation: u64,
) -> Attempt<'a> {
    Attempt {
        job,
        key,
        fingerprint,
        id,
        generation: Generation::new(generation),
        settled_after: Duration::ZERO,
    }
}

fn job(s: &str) -> JobId {
    s.parse().expect("valid job id")
}

fn g(v: u64) -> Generation {
    Generation::new(v)
}

fn key(s: &str) -> IdempotencyKey {
    IdempotencyKey::from_bytes(s.as_bytes()).expect("valid key")
}

fn fp(body: &str) -> Fingerprint {
    Fingerprint::of(&Method::POST, "/effects", body.as_bytes())
}

fn response(body: &'static str) -> StoredResponse {
    let mut headers = HeaderMap::new();
    headers.append("x-many", HeaderValue::from_static("1"));
    headers.append("x-many", HeaderValue::from_static("2"));
    let mut trailers = HeaderMap::new();
    trailers.append("grpc-status", HeaderValue::from_static("0"));
    StoredResponse {
        status: StatusCode::CREATED,
        headers,
        body: Bytes::from_static(body.as_bytes()),
        trailers: Some(Box::new(trailers)),
    }
}

/// Starts `attempt` (it must be new) and stores `body` as its response for `retention`.
async fn start_and_store<S: IdempotencyStore>(
    store: &S,
    attempt: Attempt<'_>,
    body: &'static str,
    retention: Duration,
) {
    assert_eq!(store.begin(attempt, LONG).await.unwrap(), Begin::Started);
    store_response(store, attempt, body, retention).await;
}

/// Finishes `attempt` by storing `body` as its response for `retention`.
async fn store_response<S: IdempotencyStore>(
    store: &S,
    attempt: Attempt<'_>,
    body: &'static str,
    retention: Duration,
) {
    let response = response(body);
    let done = Finish::Store {
        response,
        retention,
    };
    store.finish(attempt, done).await.unwrap();
}

const LONG: Duration = Duration::from_secs(3600);

/// The first token is accepted; anything lower afterwards is stale and names the highest.
pub async fn first_observation_is_accepted_and_lower_is_stale<S: GenerationStore>(
    store: S,
    _advance: Advance,
) {
    let j = job("sink-first");
    assert_eq!(store.highest(&j).await.unwrap(), Generation::ZERO);
    assert_eq!(store.observe(&j, g(7)).await.unwrap(), Verdict::Accepted);
    assert_eq!(
        store.observe(&j, g(6)).await.unwrap(),
        Verdict::Stale { highest: g(7) }
    );
    assert_eq!(
        store.observe(&j, g(1)).await.unwrap(),
        Verdict::Stale { highest: g(7) }
    );
    assert_eq!(
        store.observe(&j, g(u64::MAX)).await.unwrap(),
        Verdict::Accepted
    );
    assert_eq!(
        store.observe(&j, g(7)).await.unwrap(),
        Verdict::Stale {
            highest: g(u64::MAX)
        }
    );
}

/// The current token stays accepted; `highest` reads back what was accepted.
pub async fn equal_is_accepted_and_highest_reads_back<S: GenerationStore>(
    store: S,
    _advance: Advance,
) {
    let j = job("sink-equal");
    assert_eq!(store.observe(&j, g(3)).await.unwrap(), Verdict::Accepted);
    assert_eq!(store.observe(&j, g(3)).await.unwrap(), Verdict::Accepted);
    assert_eq!(store.highest(&j).await.unwrap(), g(3));
    assert_eq!(store.observe(&j, g(4)).await.unwrap(), Verdict::Accepted);
    assert_eq!(store.highest(&j).await.unwrap(), g(4));
}

/// Jobs never affect each other.
pub async fn jobs_are_independent<S: GenerationStore>(store: S, _advance: Advance) {
    let (a, b) = (job("sink-a"), job("sink-b"));
    assert_eq!(store.observe(&a, g(9)).await.unwrap(), Verdict::Accepted);
    assert_eq!(store.observe(&b, g(2)).await.unwrap(), Verdict::Accepted);
    assert_eq!(
        (
            store.highest(&a).await.unwrap(),
            store.highest(&b).await.unwrap()
        ),
        (g(9), g(2))
    );
}

/// 64 tasks observe tokens 1..=64 concurrently: the store ends at 64, and every stale
/// verdict names a highest above its token.
pub async fn concurrent_observations_keep_the_maximum<S: GenerationStore>(
    store: S,
    _advance: Advance,
) {
    let store = Arc::new(store);
    let j = job("sink-race");
    let tasks: Vec<_> = (1..=64u64)
        .map(|t| {
            let (store, j) = (store.clone(), j.clone());
            tokio::spawn(async move { (t, store.observe(&j, g(t)).await.unwrap()) })
        })
        .collect();
    for task in tasks {
        match task.await.unwrap() {
            (_, Verdict::Accepted) => {}
            (t, Verdict::Stale { highest }) => {
                assert!(highest > g(t), "token {t} stale under {highest}")
            }
        }
    }
    assert_eq!(store.highest(&j).await.unwrap(), g(64));
}

/// begin → Started; again → InFlight; finish(Store) → Replay of exactly what was stored.
pub async fn begin_then_in_flight_then_replay<S: IdempotencyStore>(store: S, _advance: Advance) {
    let (j, k, f) = (job("idem-1"), key("k1"), fp("body"));
    assert_eq!(
        store.begin(at(&j, &k, &f), LONG).await.unwrap(),
        Begin::Started
    );
    assert_eq!(
        store.begin(at(&j, &k, &f), LONG).await.unwrap(),
        Begin::InFlight
    );
    store_response(&store, at(&j, &k, &f), "done", LONG).await;
    assert_eq!(
        store.begin(at(&j, &k, &f), LONG).await.unwrap(),
        Begin::Replay(response("done"))
    );
}

/// The same key with another fingerprint is a mismatch, in flight or completed.
pub async fn mismatched_fingerprint_is_reported<S: IdempotencyStore>(store: S, _advance: Advance) {
    let (j, k) = (job("idem-2"), key("k2"));
    assert_eq!(
        store.begin(at(&j, &k, &fp("a")), LONG).await.unwrap(),
        Begin::Started
    );
    assert_eq!(
        store.begin(at(&j, &k, &fp("b")), LONG).await.unwrap(),
        Begin::Mismatch
    );
    store_response(&store, at(&j, &k, &fp("a")), "x", LONG).await;
    assert_eq!(
        store.begin(at(&j, &k, &fp("b")), LONG).await.unwrap(),
        Begin::Mismatch
    );
    // A finish with the wrong fingerprint changes nothing.
    store
        .finish(at(&j, &k, &fp("b")), Finish::Forget)
        .await
        .unwrap();
    assert_eq!(
        store.begin(at(&j, &k, &fp("a")), LONG).await.unwrap(),
        Begin::Replay(response("x"))
    );
}

/// A forgotten record (5xx, cancelled) lets the next request with the key run.
pub async fn forget_lets_the_key_run_again<S: IdempotencyStore>(store: S, _advance: Advance) {
    let (j, k, f) = (job("idem-3"), key("k3"), fp("body"));
    assert_eq!(
        store.begin(at(&j, &k, &f), LONG).await.unwrap(),
        Begin::Started
    );
    store.finish(at(&j, &k, &f), Finish::Forget).await.unwrap();
    assert_eq!(
        store.begin(at(&j, &k, &f), LONG).await.unwrap(),
        Begin::Started
    );
}

/// An attempt that outlived its in-flight timeout has lost its record, as a worker that
/// outlived its lease has lost the job: its late answer, or its forgetting after a 5xx,
/// changes nothing of the record its successor began.
pub async fn only_the_attempt_that_began_a_record_finishes_or_forgets_it<S: IdempotencyStore>(
    store: S,
    advance: Advance,
) {
    let (j, k, f) = (job("idem-attempts"), key("k"), fp("body"));
    let first = attempt(&j, &k, &f, 11, 1);
    let second = attempt(&j, &k, &f, 22, 1);
    let short = Duration::from_millis(5);
    assert_eq!(store.begin(first, short).await.unwrap(), Begin::Started);
    advance(ms(Duration::from_millis(20))); // the first attempt's record times out
    assert_eq!(store.begin(second, LONG).await.unwrap(), Begin::Started);
    // The first attempt answers late, then is told to forget (a 5xx): neither touches the
    // second attempt's record.
    store
        .finish(
            first,
            Finish::Store {
                response: response("late"),
                retention: LONG,
            },
        )
        .await
        .unwrap();
    store.finish(first, Finish::Forget).await.unwrap();
    let third = attempt(&j, &k, &f, 33, 1);
    assert_eq!(
        store.begin(third, LONG).await.unwrap(),
        Begin::InFlight,
        "the second attempt's record is still in flight"
    );
    store
        .finish(
            second,
            Finish::Store {
                response: response("second"),
                retention: LONG,
            },
        )
        .await
        .unwrap();
    match store.begin(third, LONG).await.unwrap() {
        Begin::Replay(r) => assert_eq!(r.body, Bytes::from_static(b"second")),
        other => panic!("expected the second attempt's answer, got {other:?}"),
    }
}

/// A newer generation's request with the same key (a derived key: same step, another
/// holder) takes over an in-flight record of an older generation, whatever its body: the
/// fence admits it only once the older request has ended. A completed record is not taken
/// over: the step was done, and its answer stands.
pub async fn a_newer_generation_takes_over_an_older_generations_in_flight_record<
    S: IdempotencyStore,
>(
    store: S,
    _advance: Advance,
) {
    let (j, k) = (job("idem-generations"), key("charge"));
    let (old_body, new_body) = (
        fp("amount=10 by the old holder"),
        fp("amount=10 by the new"),
    );
    let old = attempt(&j, &k, &old_body, 1, 7);
    assert_eq!(store.begin(old, LONG).await.unwrap(), Begin::Started);
    let same_generation = attempt(&j, &k, &new_body, 2, 7);
    assert_eq!(
        store.begin(same_generation, LONG).await.unwrap(),
        Begin::Mismatch,
        "within one generation a key still names one request"
    );
    let newer = attempt(&j, &k, &new_body, 3, 8);
    assert_eq!(store.begin(newer, LONG).await.unwrap(), Begin::Started);
    // The old attempt's answer, if it ever comes, is not kept.
    store
        .finish(
            old,
            Finish::Store {
                response: response("old"),
                retention: LONG,
            },
        )
        .await
        .unwrap();
    store
        .finish(
            newer,
            Finish::Store {
                response: response("new"),
                retention: LONG,
            },
        )
        .await
        .unwrap();
    match store
        .begin(attempt(&j, &k, &new_body, 4, 8), LONG)
        .await
        .unwrap()
    {
        Begin::Replay(r) => assert_eq!(r.body, Bytes::from_static(b"new")),
        other => panic!("expected the newer attempt's answer, got {other:?}"),
    }
    assert_eq!(
        store
            .begin(attempt(&j, &k, &old_body, 5, 9), LONG)
            .await
            .unwrap(),
        Begin::Mismatch,
        "a completed record is not taken over"
    );
}

/// A response too large to store leaves a record that refuses replays and re-runs.
pub async fn too_large_is_not_replayable<S: IdempotencyStore>(store: S, _advance: Advance) {
    let (j, k, f) = (job("idem-4"), key("k4"), fp("body"));
    assert_eq!(
        store.begin(at(&j, &k, &f), LONG).await.unwrap(),
        Begin::Started
    );
    store
        .finish(at(&j, &k, &f), Finish::TooLarge { retention: LONG })
        .await
        .unwrap();
    assert_eq!(
        store.begin(at(&j, &k, &f), LONG).await.unwrap(),
        Begin::NotReplayable
    );
}

/// An in-flight record past its timeout and a completed one past its retention are gone:
/// the key runs again, and purging deletes them.
pub async fn in_flight_and_retention_expire<S: IdempotencyStore>(store: S, advance: Advance) {
    let (j, f, crashed) = (job("idem-5"), fp("body"), key("crashed"));
    let short = Duration::from_millis(1);
    let begin = store.begin(at(&j, &crashed, &f), short).await.unwrap();
    assert_eq!(begin, Begin::Started);
    start_and_store(&store, at(&j, &key("kept"), &f), "k", LONG).await;
    start_and_store(&store, at(&j, &key("old"), &f), "o", short).await;
    advance(ms(Duration::from_millis(20)));
    assert_eq!(store.purge_expired().await.unwrap(), 2);
    let begin = store.begin(at(&j, &crashed, &f), LONG).await.unwrap();
    assert_eq!(begin, Begin::Started, "a crashed attempt's key runs again");
    assert_eq!(
        store.begin(at(&j, &key("old"), &f), LONG).await.unwrap(),
        Begin::Started
    );
    assert_eq!(
        store.begin(at(&j, &key("kept"), &f), LONG).await.unwrap(),
        Begin::Replay(response("k"))
    );
}

/// The same key under two jobs names two records.
pub async fn keys_are_scoped_per_job<S: IdempotencyStore>(store: S, _advance: Advance) {
    let (k, f) = (key("shared"), fp("body"));
    assert_eq!(
        store.begin(at(&job("idem-x"), &k, &f), LONG).await.unwrap(),
        Begin::Started
    );
    assert_eq!(
        store.begin(at(&job("idem-y"), &k, &f), LONG).await.unwrap(),
        Begin::Started
    );
    store_response(&store, at(&job("idem-x"), &k, &f), "x", LONG).await;
    assert_eq!(
        store.begin(at(&job("idem-y"), &k, &f), LONG).await.unwrap(),
        Begin::InFlight
    );
}

fn page(idle_for: Duration, after: Option<&crate::IdleJob>, limit: usize) -> crate::IdlePage<'_> {
    crate::IdlePage {
        idle_for,
        after,
        limit,
    }
}

/// Jobs stamped long enough ago are listed oldest first, in pages; one is deleted only while
/// its stamp is the one listed (nothing accepted since), and then reads as never seen.
pub async fn idle_jobs_are_listed_oldest_first_and_forgotten_only_if_unchanged<
    S: GenerationStore,
>(
    store: S,
    advance: Advance,
) {
    // Stamps are milliseconds of the store's clock (a manual one, or the database's).
    let tick = || async {
        advance(ms(Duration::from_millis(3)));
        tokio::time::sleep(Duration::from_millis(3)).await;
    };
    let (a, b, c) = (job("idle-a"), job("idle-b"), job("idle-c"));
    for (j, t) in [(&a, 3), (&b, 5), (&c, 7)] {
        assert_eq!(store.observe(j, g(t)).await.unwrap(), Verdict::Accepted);
        tick().await;
    }
    assert!(
        store.idle(page(LONG, None, 10)).await.unwrap().is_empty(),
        "nothing is an hour old"
    );
    assert!(
        store
            .idle(page(Duration::ZERO, None, 10))
            .await
            .unwrap()
            .is_empty(),
        "a job is stamped ahead: it is not idle the moment it was accepted"
    );
    // Past the stamps, and the two seconds a store may list them late by
    // (`IdleJob::touched_ms`).
    advance(ms(Duration::from_millis(crate::STAMP_AHEAD_MS + 2_000)));
    let all = store.idle(page(Duration::ZERO, None, 10)).await.unwrap();
    let jobs: Vec<&JobId> = all.iter().map(|i| &i.job).collect();
    assert_eq!(jobs, [&a, &b, &c], "oldest first");
    let first = store.idle(page(Duration::ZERO, None, 2)).await.unwrap();
    let rest = store
        .idle(page(Duration::ZERO, first.last(), 2))
        .await
        .unwrap();
    assert_eq!(
        first.len() + rest.len(),
        3,
        "pages cover all: {first:?} {rest:?}"
    );
    assert_eq!(rest[0].job, c);
    // b is accepted again (a higher token): its listed stamp is out of date.
    tick().await;
    assert_eq!(store.observe(&b, g(6)).await.unwrap(), Verdict::Accepted);
    assert!(
        !store.forget(&all[1]).await.unwrap(),
        "b changed since it was listed"
    );
    assert_eq!(store.highest(&b).await.unwrap(), g(6));
    assert!(store.forget(&all[0]).await.unwrap());
    assert!(!store.forget(&all[0]).await.unwrap(), "already gone");
    assert_eq!(
        store.highest(&a).await.unwrap(),
        Generation::ZERO,
        "a reads as never seen"
    );
    assert_eq!(store.observe(&a, g(1)).await.unwrap(), Verdict::Accepted);
}
