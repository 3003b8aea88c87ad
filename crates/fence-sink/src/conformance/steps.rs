//! Conformance cases where a step of the wall clock must not count as time passed.
//!
//! For stores that judge idempotency records on their own clock.
//!
//! [`sink_store_step_conformance!`](crate::sink_store_step_conformance) makes one test per
//! case. A backend's factory returns `Some((store, clock))`, the [`ManualClock`] the store
//! was made with, or `None` to skip. PostgreSQL does not run these: its records are judged
//! on the database's clock (`clock_timestamp()`), which a step of the database host's clock
//! moves (docs/protocol.md, "Idempotency").

use std::time::Duration;

use bytes::Bytes;
use fence_storage::clock::ManualClock;

use super::{attempt, fp, job, key, response, store_response};
use crate::{Begin, Finish, GenerationStore, IdempotencyStore, IdlePage};

/// Generates one `#[tokio::test]` per clock-step case for the store made by `$make`.
#[macro_export]
macro_rules! sink_store_step_conformance {
    ($make:expr) => {
        $crate::conformance::__storage::conformance_cases!($crate::conformance::steps; $make;
            a_forward_step_of_the_wall_clock_does_not_expire_a_record,
            a_backward_step_of_the_wall_clock_does_not_hold_a_key_longer,
            a_forward_step_of_the_wall_clock_does_not_age_a_job,
        );
    };
}

/// The proxy's default in-flight timeout.
const IN_FLIGHT: Duration = Duration::from_secs(300);
/// A retention a step is longer than.
const RETENTION: Duration = Duration::from_secs(600);

/// A request is in flight, its upstream slow; 1 s later NTP (or a VM resume) steps the wall
/// clock 10 min forward. The client's retry with the same key and body must still get
/// "in flight", not reach the upstream a second time while the first runs; the purge must
/// not drop the record (the first attempt's answer would then find nothing to complete, and a
/// later retry would run the step again); the first attempt's answer is then replayed. A
/// finished record's retention does not end early by a step either, only by time passed.
pub async fn a_forward_step_of_the_wall_clock_does_not_expire_a_record<S: IdempotencyStore>(
    store: S,
    clock: ManualClock,
) {
    let (j, k, f) = (job("step-forward"), key("charge"), fp("amount=10"));
    let first = attempt(&j, &k, &f, 11, 1);
    assert_eq!(store.begin(first, IN_FLIGHT).await.unwrap(), Begin::Started);
    clock.advance(Duration::from_secs(1));
    clock.step_ms(600_000);
    let retry = attempt(&j, &k, &f, 22, 1);
    assert_eq!(
        store.begin(retry, IN_FLIGHT).await.unwrap(),
        Begin::InFlight,
        "a step of the wall clock expired a record in flight: the retry would run again"
    );
    assert_eq!(
        store.purge_expired().await.unwrap(),
        0,
        "the purge took a step of the wall clock for time passed"
    );
    store_response(&store, first, "paid", RETENTION).await;
    let later = attempt(&j, &k, &f, 33, 1);
    match store.begin(later, IN_FLIGHT).await.unwrap() {
        Begin::Replay(r) => assert_eq!(r.body, Bytes::from_static(b"paid")),
        other => panic!("expected the first attempt's answer, got {other:?}"),
    }
    // A step longer than the retention is not the retention passed either ...
    clock.step_ms(3_600_000);
    assert_eq!(store.purge_expired().await.unwrap(), 0);
    assert_eq!(
        store.begin(later, IN_FLIGHT).await.unwrap(),
        Begin::Replay(response("paid"))
    );
    // ... time passed is: the retention, plus the first step for a store that times a record
    // from the later of two clocks (sled: kept longer by a step, never shorter).
    clock.advance(RETENTION + Duration::from_secs(600));
    assert_eq!(store.purge_expired().await.unwrap(), 1);
    assert_eq!(store.begin(later, IN_FLIGHT).await.unwrap(), Begin::Started);
}

/// The wall clock steps an hour back (`date -s`, a bad RTC corrected) while a request is in
/// flight, or after one finished: its key is free again once the in-flight timeout (the
/// retention) of real time has passed, as documented, not that plus the step.
pub async fn a_backward_step_of_the_wall_clock_does_not_hold_a_key_longer<S: IdempotencyStore>(
    store: S,
    clock: ManualClock,
) {
    let (j, f) = (job("step-back"), fp("amount=10"));
    let (crashed, done) = (key("crashed"), key("done"));
    let first = attempt(&j, &crashed, &f, 11, 1);
    assert_eq!(store.begin(first, IN_FLIGHT).await.unwrap(), Begin::Started);
    let finished = attempt(&j, &done, &f, 12, 1);
    assert_eq!(
        store.begin(finished, IN_FLIGHT).await.unwrap(),
        Begin::Started
    );
    store
        .finish(
            finished,
            Finish::Store {
                response: response("kept"),
                retention: IN_FLIGHT,
            },
        )
        .await
        .unwrap();
    clock.step_ms(-3_600_000);
    clock.advance(IN_FLIGHT + Duration::from_secs(1));
    assert_eq!(
        store.purge_expired().await.unwrap(),
        2,
        "a step back kept records past their time"
    );
    let retry = attempt(&j, &crashed, &f, 22, 1);
    assert_eq!(
        store.begin(retry, IN_FLIGHT).await.unwrap(),
        Begin::Started,
        "a step back held the key past its in-flight timeout"
    );
    let again = attempt(&j, &done, &f, 23, 1);
    assert_eq!(store.begin(again, IN_FLIGHT).await.unwrap(), Begin::Started);
}

/// A job admitted, then the wall clock steps an hour forward: the job is not idle by the step
/// (with forgetting on it was forgotten at once, and once the clock was set right a stale
/// token that had not expired was taken as a new job's first write), only by time passed.
pub async fn a_forward_step_of_the_wall_clock_does_not_age_a_job<S: GenerationStore>(
    store: S,
    clock: ManualClock,
) {
    clock.advance(Duration::from_secs(60));
    store
        .observe(&job("stepped"), fence_core::Generation::new(1))
        .await
        .unwrap();
    clock.advance(Duration::from_secs(1));
    assert_eq!(idle_jobs(&store).await, 0);
    clock.step_ms(3_600_000);
    assert_eq!(idle_jobs(&store).await, 0, "the step aged the job");
    clock.advance(Duration::from_secs(620));
    assert_eq!(idle_jobs(&store).await, 1, "idle once the time has passed");
}

/// How many jobs `store` lists as idle for 10 minutes.
async fn idle_jobs<S: GenerationStore>(store: &S) -> usize {
    let page = IdlePage {
        idle_for: Duration::from_secs(600),
        after: None,
        limit: 10,
    };
    store.idle(page).await.unwrap().len()
}
