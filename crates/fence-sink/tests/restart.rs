//! After a restart over the same sled store, a newer token waits for what the process before
//! may have left running (docs/protocol.md section 3, "After a restart"), and nothing else does.
//!
//! A process that dies forgets its in-flight counts, while a request it passed on may still
//! commit where it went. In these tests the first process admits requests to a service that
//! never answers them (still running when the process dies), the second opens the same
//! directory and is asked for newer tokens. The stores' wall clock is a manual one (so hours
//! can pass between two requests); the waits are real, and each is checked from below: an
//! answer before its hold ended is the failure, which no slow machine can cause.

use std::{
    convert::Infallible,
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use fence_sink::{FenceLayer, RequestBody, SledStore};
use fence_storage::clock::{Clock, ManualClock};
use http::{Request, Response, StatusCode};
use tokio::time::Instant;
use tower::{Layer, ServiceExt, service_fn};

/// The proxy's upstream timeout, and its unknown-outcome hold.
const LONGEST: Duration = Duration::from_secs(3);
const HOLD: Duration = Duration::from_millis(1_500);

/// One process's fence over the store in `dir`, in front of a service that counts its calls
/// and, with `hang`, never answers.
struct Process {
    layer: FenceLayer<SledStore>,
    calls: Arc<AtomicUsize>,
    hang: bool,
}

impl Process {
    fn open(dir: &Path, clock: &ManualClock, drain: Duration, hang: bool) -> Self {
        Self::open_timed(dir, clock, drain, hang, (LONGEST, HOLD))
    }

    /// As [`open`](Self::open), with this longest request and hold.
    fn open_timed(
        dir: &Path,
        clock: &ManualClock,
        drain: Duration,
        hang: bool,
        (longest, hold): (Duration, Duration),
    ) -> Self {
        let clock: Arc<dyn Clock> = Arc::new(clock.clone());
        let store = SledStore::open_with_clock(dir, clock.clone()).expect("sled opens");
        let layer = FenceLayer::new(store)
            .clock(clock.clone())
            .without_idempotency()
            .longest_request(longest)
            .unknown_outcome_hold(hold)
            .drain_timeout(drain);
        Self {
            layer,
            calls: Arc::default(),
            hang,
        }
    }

    /// Sends a fenced POST in a task of its own; its status when it is answered.
    fn send(&self, job: &str, token: u64) -> tokio::task::JoinHandle<StatusCode> {
        let (calls, hang) = (self.calls.clone(), self.hang);
        let inner = service_fn(move |_req: Request<RequestBody<String>>| {
            calls.fetch_add(1, Ordering::SeqCst);
            async move {
                if hang {
                    std::future::pending::<()>().await;
                }
                Ok::<_, Infallible>(Response::new(String::new()))
            }
        });
        let svc = self.layer.layer(inner);
        let req = Request::post("/")
            .header("x-fencing-job", job)
            .header("x-fencing-token", token.to_string())
            .body(String::new())
            .unwrap();
        tokio::spawn(async move { svc.oneshot(req).await.unwrap().status() })
    }

    async fn status(&self, job: &str, token: u64) -> StatusCode {
        self.send(job, token).await.unwrap()
    }

    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

/// Lets spawned tasks get as far as they can (for what must NOT happen: a slow machine only
/// makes such a check weaker, never fails it).
async fn settle() {
    tokio::time::sleep(Duration::from_millis(100)).await;
}

/// Lets spawned tasks get on until `done` holds, within 10 s: what must happen goes through
/// the store's disk writes, which a fixed pause would race on a loaded machine.
async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "not within 10 s: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits (within 10 s) until `store` holds `generation` as `job`'s highest.
async fn until_raised(store: &SledStore, job: &str, generation: u64) {
    use fence_sink::GenerationStore;
    let job = job.parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.highest(&job).await.unwrap().get() < generation {
        assert!(
            Instant::now() < deadline,
            "not within 10 s: {job} raised to {generation}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A request's status and how long after `since` it was answered.
async fn answered(
    request: tokio::task::JoinHandle<StatusCode>,
    since: Instant,
) -> (StatusCode, Duration) {
    let status = request.await.unwrap();
    (status, since.elapsed())
}

/// The processes before: job `idle` written with token 3 long ago; job `busy` raised to 4 (with
/// nothing older running) by a process that dies with two requests of 4 still running.
/// Returns the directory.
async fn first_process(clock: &ManualClock) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let answers = Process::open(dir.path(), clock, Duration::from_secs(60), false);
    assert_eq!(answers.status("idle", 3).await, StatusCode::OK);
    assert_eq!(answers.status("busy", 3).await, StatusCode::OK);
    drop(answers);
    clock.advance(Duration::from_secs(300));
    let p = Process::open(dir.path(), clock, Duration::from_secs(60), true);
    let running = [p.send("busy", 4), p.send("busy", 4)];
    until("the busy job's two requests are running", || {
        p.layer.in_flight() == 2
    })
    .await;
    // The process dies: its tasks and every in-memory count go with it.
    for r in running {
        r.abort();
        let _ = r.await;
    }
    drop(p);
    dir
}

#[tokio::test]
async fn a_newer_token_waits_for_what_the_process_before_left_running() {
    let clock = ManualClock::new(1_700_000_000_000);
    let dir = first_process(&clock).await;
    clock.advance(Duration::from_secs(1)); // the restart takes a second
    let opened = Instant::now();
    let p = Process::open(dir.path(), &clock, Duration::from_secs(60), false);

    // A job idle for longer than any request may run waits for nothing: a wait would be
    // the whole hold.
    let asked = Instant::now();
    assert_eq!(p.status("idle", 4).await, StatusCode::OK);
    assert!(
        asked.elapsed() < HOLD,
        "the idle job's newer token waited {:?}, as if it had been busy",
        asked.elapsed()
    );
    // The busy job's holder goes on at once: when 4 was raised nothing older was running.
    assert_eq!(p.status("busy", 4).await, StatusCode::OK);
    assert_eq!(p.calls(), 2);

    // A newer token is raised at once (4 is stale from then on) and then waits until the
    // requests of 4 could no longer be running: the hold, from the restart (which came
    // before their upstream timeout ran out).
    let newer = p.send("busy", 5);
    until_raised(p.layer.store(), "busy", 5).await;
    assert_eq!(p.status("busy", 4).await, StatusCode::CONFLICT);
    let (status, after) = answered(newer, opened).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        after >= HOLD,
        "token 5 passed {after:?} after the restart, inside the {HOLD:?} hold"
    );
    assert!(
        after < HOLD + Duration::from_secs(5),
        "token 5 waited {after:?}"
    );
    assert_eq!(p.calls(), 3);
}

#[tokio::test]
async fn a_wait_longer_than_the_drain_limit_is_answered_at_once_with_the_token_raised() {
    let clock = ManualClock::new(1_700_000_000_000);
    let dir = first_process(&clock).await;
    let opened = Instant::now();
    let p = Process::open(dir.path(), &clock, Duration::from_millis(500), false);
    let (status, after) = answered(p.send("busy", 5), opened).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        after < HOLD,
        "it waited {after:?} for a hold it could not outlast"
    );
    // Newer token first: the old holder is fenced although the newer one did not pass.
    assert_eq!(p.status("busy", 4).await, StatusCode::CONFLICT);
    assert_eq!(p.calls(), 0);
    tokio::time::sleep_until(opened + HOLD).await;
    assert_eq!(p.status("busy", 5).await, StatusCode::OK);
}

#[tokio::test]
async fn the_highest_token_waits_when_older_ones_were_still_running_at_its_raise() {
    let clock = ManualClock::new(1_700_000_000_000);
    let dir = tempfile::tempdir().unwrap();
    {
        let p = Process::open(dir.path(), &clock, Duration::from_secs(60), true);
        let old = p.send("job", 1);
        until("1 runs", || p.calls() == 1).await;
        // Raised while 1 runs: 2 waits for it, and the process dies meanwhile.
        let newer = p.send("job", 2);
        until_raised(p.layer.store(), "job", 2).await;
        settle().await;
        assert_eq!(p.calls(), 1);
        for r in [old, newer] {
            r.abort();
            let _ = r.await;
        }
    }
    let opened = Instant::now();
    let p = Process::open(dir.path(), &clock, Duration::from_secs(60), false);
    let (status, after) = answered(p.send("job", 2), opened).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        after >= HOLD,
        "2 passed {after:?} after the restart while 1 could still run"
    );
}

/// A service whose effects die with its process: with no longest request and no hold, in
/// the process that died as in this one, nothing waits after a restart.
#[tokio::test]
async fn without_a_longest_request_and_hold_nothing_waits() {
    let clock = ManualClock::new(1_700_000_000_000);
    let dir = tempfile::tempdir().unwrap();
    let zero = (Duration::ZERO, Duration::ZERO);
    {
        let p = Process::open_timed(dir.path(), &clock, Duration::from_secs(60), true, zero);
        let running = p.send("busy", 4);
        until("4 runs", || p.layer.in_flight() == 1).await;
        running.abort();
        let _ = running.await;
    }
    let p = Process::open_timed(dir.path(), &clock, Duration::from_millis(100), false, zero);
    assert_eq!(p.status("busy", 5).await, StatusCode::OK);
}

/// The process before ran with longer timeouts than this one (an operator lowered
/// `--upstream-timeout` at the restart): the newer token waits by the bounds it admitted
/// under, which it recorded, not by this process's, by which its request of 4 would have
/// settled long ago. Here A's bound is 10 minutes after the restart, past the drain limit:
/// 503 at once, with 5 raised; by B's bounds (30 s and 30 s, 2 minutes after the stamp)
/// nothing would be left to wait for, and 5 would pass at once while 4 may still commit.
#[tokio::test]
async fn a_restart_with_shorter_timeouts_waits_by_those_the_process_before_ran_with() {
    const TEN_MINUTES: Duration = Duration::from_secs(600);
    const HALF_A_MINUTE: Duration = Duration::from_secs(30);
    let clock = ManualClock::new(1_700_000_000_000);
    let dir = tempfile::tempdir().unwrap();
    {
        let a = Process::open_timed(
            dir.path(),
            &clock,
            Duration::from_secs(60),
            true,
            (TEN_MINUTES, TEN_MINUTES),
        );
        let running = a.send("busy", 4);
        until("4 runs", || a.layer.in_flight() == 1).await;
        // The process dies two minutes later, 4 still at its upstream.
        clock.advance(Duration::from_secs(120));
        running.abort();
        let _ = running.await;
    }
    let b = Process::open_timed(
        dir.path(),
        &clock,
        Duration::from_millis(500),
        false,
        (HALF_A_MINUTE, HALF_A_MINUTE),
    );
    let asked = Instant::now();
    let (status, after) = answered(b.send("busy", 5), asked).await;
    assert_eq!(
        status,
        StatusCode::SERVICE_UNAVAILABLE,
        "5 was let through {after:?} after the restart, while the request of 4 the process \
         before admitted under a 10-minute upstream timeout may still commit"
    );
    assert_eq!(b.calls(), 0);
    // Newer token first: 4 is fenced from now on.
    assert_eq!(b.status("busy", 4).await, StatusCode::CONFLICT);
}

/// Forgetting, too, waits by the bounds the process before ran with: with B's own a job
/// would be forgotten (and its newer token let through at once) a minute after its stamp,
/// while the request of 4 that A admitted under 10-minute bounds may still commit.
#[tokio::test]
async fn forgetting_waits_by_the_bounds_the_process_before_ran_with() {
    use fence_core::signing::{TokenSigner, TokenVerifier};

    const TEN_MINUTES: Duration = Duration::from_secs(600);
    let clock = ManualClock::new(1_700_000_000_000);
    let dir = tempfile::tempdir().unwrap();
    {
        let a = Process::open_timed(
            dir.path(),
            &clock,
            Duration::from_secs(60),
            false,
            (TEN_MINUTES, TEN_MINUTES),
        );
        assert_eq!(a.status("busy", 4).await, StatusCode::OK);
    }
    let signer = TokenSigner::from_seed([9; 32]);
    let wall: Arc<dyn Clock> = Arc::new(clock.clone());
    let store = SledStore::open_with_clock(dir.path(), wall.clone()).expect("sled opens");
    let b = FenceLayer::new(store)
        .clock(wall)
        .without_idempotency()
        .require_signatures(TokenVerifier::new([signer.verify_key()]))
        .clock_skew(Duration::ZERO)
        .forget_after(Duration::from_secs(1), Duration::from_secs(1))
        .unwrap()
        .longest_request(Duration::from_secs(30))
        .unknown_outcome_hold(Duration::from_secs(30));
    let window = b.forgets_after().expect("it forgets");
    assert!(
        window >= 2 * TEN_MINUTES,
        "jobs are forgotten {window:?} after their stamp, before the request A admitted has \
         settled"
    );
}

/// A request that waited for older ones is stamped by its admission, not its arrival: the
/// stamp it is covered by (which a restart counts from) must not end before it went on.
#[tokio::test]
async fn a_request_admitted_after_a_long_wait_is_stamped_at_its_admission() {
    use fence_sink::GenerationStore;

    let clock = ManualClock::new(1_700_000_000_000);
    let dir = tempfile::tempdir().unwrap();
    let wall: Arc<dyn Clock> = Arc::new(clock.clone());
    let store = SledStore::open_with_clock(dir.path(), wall.clone()).unwrap();
    let layer = FenceLayer::new(store.clone())
        .clock(wall)
        .without_idempotency()
        .longest_request(LONGEST)
        .unknown_outcome_hold(HOLD)
        .drain_timeout(Duration::from_secs(60));
    // Token 1's request runs until the test lets it end.
    let running = Arc::new(tokio::sync::Semaphore::new(0));
    let inner = {
        let running = running.clone();
        service_fn(move |req: Request<RequestBody<String>>| {
            let running = running.clone();
            async move {
                if req.headers()["x-fencing-token"] == "1" {
                    let _ = running.acquire().await;
                }
                Ok::<_, Infallible>(Response::new(String::new()))
            }
        })
    };
    let send = |token: u64| {
        let svc = layer.layer(inner.clone());
        let req = Request::post("/")
            .header("x-fencing-job", "job")
            .header("x-fencing-token", token.to_string())
            .body(String::new())
            .unwrap();
        tokio::spawn(async move { svc.oneshot(req).await.unwrap().status() })
    };
    let older = send(1);
    until("1 runs", || layer.in_flight() == 1).await;
    // Raised at once, then waits for 1: its arrival is covered by the raise's stamp.
    let newer = send(2);
    until_raised(&store, "job", 2).await;
    settle().await;
    // 1 runs longer than that stamp covers, then ends: 2 goes on only now.
    clock.advance(Duration::from_secs(12));
    running.add_permits(1);
    assert_eq!(older.await.unwrap(), StatusCode::OK);
    assert_eq!(newer.await.unwrap(), StatusCode::OK);
    let admitted = clock.now_ms();
    let loaded = store.load(&"job".parse().unwrap()).await.unwrap();
    let stamp = loaded
        .prior
        .expect("a sled job has stamps")
        .admitted_until_ms;
    assert!(
        stamp >= admitted,
        "token 2 was admitted at {admitted} but the job's stamp ends at {stamp}: a restart \
         would stop waiting for it {} ms early",
        admitted - stamp
    );
}

/// Forgetting does not cut the wait short: a job whose only record of the request the dead
/// process left running is its stamp is not forgotten before that request has settled, even
/// when `forget_after` is shorter than the longest request plus the hold.
#[tokio::test]
async fn forgetting_waits_for_what_the_process_before_left_running() {
    use fence_core::{
        Generation,
        signing::{TokenSigner, TokenVerifier},
    };
    use fence_sink::{GenerationStore, STAMP_AHEAD_MS};

    // Forgetting after 1 s (leases of at most 1 s, no skew); a hold longer than the stamp
    // written ahead plus that, so the job is "idle for 1 s" well inside its hold.
    const FORGET: Duration = Duration::from_secs(1);
    const LONG_HOLD: Duration = Duration::from_millis(STAMP_AHEAD_MS + 3_000);
    let clock = ManualClock::new(1_700_000_000_000);
    let signer = TokenSigner::from_seed([9; 32]);
    let open = |dir: &Path| {
        let wall: Arc<dyn Clock> = Arc::new(clock.clone());
        let store = SledStore::open_with_clock(dir, wall.clone()).expect("sled opens");
        FenceLayer::new(store)
            .clock(wall)
            .without_idempotency()
            .require_signatures(TokenVerifier::new([signer.verify_key()]))
            .clock_skew(Duration::ZERO)
            .forget_after(FORGET, FORGET)
            .unwrap()
            .longest_request(LONGEST)
            .unknown_outcome_hold(LONG_HOLD)
            .drain_timeout(Duration::from_secs(60))
    };
    let send = |layer: &FenceLayer<SledStore>, generation: u64, hang: bool| {
        let inner = service_fn(move |_req: Request<RequestBody<String>>| async move {
            if hang {
                std::future::pending::<()>().await;
            }
            Ok::<_, Infallible>(Response::new(String::new()))
        });
        let token = signer.sign(
            &"busy".parse().unwrap(),
            Generation::new(generation),
            clock.now_ms() + FORGET.as_millis() as u64,
        );
        let req = Request::post("/")
            .header("x-fencing-job", "busy")
            .header("x-fencing-token", token)
            .body(String::new())
            .unwrap();
        let svc = layer.layer(inner);
        tokio::spawn(async move { svc.oneshot(req).await.unwrap().status() })
    };

    let dir = tempfile::tempdir().unwrap();
    {
        // The first process admits 4 to an upstream that never answers, and dies.
        let layer = open(dir.path());
        let running = send(&layer, 4, true);
        until("4 runs", || layer.in_flight() == 1).await;
        running.abort();
        let _ = running.await;
    }
    clock.advance(Duration::from_secs(1)); // the restart takes a second
    let layer = open(dir.path());
    let _upkeep = layer.spawn_maintenance();
    let opened = clock.now_ms();
    // Past the job's stamp plus `FORGET` (forgetting would be due), 1.5 s before the hold
    // after the restart ends (by the manual clock, which real time does not move). Were the
    // window `FORGET`, a pass would run every 125 ms: three seconds give a loaded machine
    // room for many, so the check below cannot pass for want of one.
    clock.advance(Duration::from_millis(STAMP_AHEAD_MS + 1_500));
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        layer
            .store()
            .highest(&"busy".parse().unwrap())
            .await
            .unwrap(),
        Generation::new(4),
        "the job was forgotten while the request of 4 the process before passed on may \
         still run"
    );
    let asked = Instant::now();
    let (status, after) = answered(send(&layer, 5, false), asked).await;
    assert_eq!(status, StatusCode::OK);
    let left = Duration::from_millis(opened + LONG_HOLD.as_millis() as u64 - clock.now_ms());
    assert!(
        after >= left - Duration::from_millis(100),
        "5 passed {after:?} after it was asked, {left:?} before the hold after the restart \
         ended"
    );
}

/// A request with an `Idempotency-Key` reaches the service only after its record's begin,
/// which may take the idempotency store's timeout: it may run upstream until its stamp plus
/// that plus the longest request. After a restart that came later than its stamp plus the
/// longest request (but before that plus the begin), a newer token waits the whole hold
/// from the restart, not what is left of a bound that forgot the begin.
#[tokio::test]
async fn a_keyed_request_may_run_past_the_longest_request_by_its_begin() {
    use fence_sink::{GenerationStore, IdempotencyConfig};

    const BEGIN: Duration = Duration::from_secs(2);
    let clock = ManualClock::new(1_700_000_000_000);
    let dir = tempfile::tempdir().unwrap();
    let open = || {
        let wall: Arc<dyn Clock> = Arc::new(clock.clone());
        let store = SledStore::open_with_clock(dir.path(), wall.clone()).expect("sled opens");
        let layer = FenceLayer::new(store.clone())
            .clock(wall)
            .idempotency(IdempotencyConfig::default().store_timeout(BEGIN))
            .longest_request(LONGEST)
            .unknown_outcome_hold(HOLD)
            .drain_timeout(Duration::from_secs(60));
        (store, layer)
    };
    let send = |layer: &FenceLayer<SledStore>, token: u64, key: Option<&str>| {
        let svc = layer.layer(service_fn(
            move |_req: Request<RequestBody<String>>| async move {
                if token == 4 {
                    std::future::pending::<()>().await; // still running when the process dies
                }
                Ok::<_, Infallible>(Response::new(String::new()))
            },
        ));
        let mut req = Request::post("/")
            .header("x-fencing-job", "keyed")
            .header("x-fencing-token", token.to_string());
        if let Some(key) = key {
            req = req.header("idempotency-key", key);
        }
        let req = req.body(String::new()).unwrap();
        tokio::spawn(async move { svc.oneshot(req).await.unwrap().status() })
    };
    let stamp = {
        let (store, layer) = open();
        let running = send(&layer, 4, Some("step-1"));
        until("the keyed request runs", || layer.in_flight() == 1).await;
        running.abort();
        let _ = running.await;
        drop(layer);
        let loaded = store.load(&"keyed".parse().unwrap()).await.unwrap();
        loaded
            .prior
            .expect("a sled job has stamps")
            .admitted_until_ms
    };
    // The process died 1.4 s after stamp + LONGEST, inside the begin's 2 s: the request may
    // have reached the service as late as that, and its effect may land a hold after.
    clock.set_ms(stamp + LONGEST.as_millis() as u64 + 1_400);
    let opened = Instant::now();
    let (_store, layer) = open();
    let (status, after) = answered(send(&layer, 5, None), opened).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        after >= HOLD,
        "token 5 passed {after:?} after the restart, inside the {HOLD:?} hold the keyed \
         request of 4 may still need"
    );
}

/// The wall clock stepped forward after the restart (NTP after a boot) is not time passed:
/// the newer token still waits out the hold for what the process before left running.
#[tokio::test]
async fn a_wall_clock_step_after_the_restart_does_not_end_the_wait() {
    let clock = ManualClock::new(1_700_000_000_000);
    let dir = first_process(&clock).await;
    let opened = Instant::now();
    let p = Process::open(dir.path(), &clock, Duration::from_secs(60), false);
    clock.step_ms(3_600_000);
    let (status, after) = answered(p.send("busy", 5), opened).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        after >= HOLD,
        "token 5 passed {after:?} after the restart, inside the {HOLD:?} hold: the clock's \
         step counted as time passed"
    );
}

/// A keyed call of messages is in flight until its answer ends, which may stream up to the
/// body deadline after its head: a process that died past stamp + longest request + begin,
/// but inside that body deadline, may have left its handler acting, and a newer token waits
/// the whole hold from the restart.
#[tokio::test]
async fn a_keyed_answer_may_stream_past_the_longest_request_by_the_body_deadline() {
    use fence_sink::{GenerationStore, IdempotencyConfig};

    const BEGIN: Duration = Duration::from_secs(2);
    const BODY: Duration = Duration::from_secs(4);
    let clock = ManualClock::new(1_700_000_000_000);
    let dir = tempfile::tempdir().unwrap();
    let open = || {
        let wall: Arc<dyn Clock> = Arc::new(clock.clone());
        let store = SledStore::open_with_clock(dir.path(), wall.clone()).expect("sled opens");
        let layer = FenceLayer::new(store.clone())
            .clock(wall)
            .idempotency(IdempotencyConfig::default().store_timeout(BEGIN))
            .body_timeout(BODY)
            .longest_request(LONGEST)
            .unknown_outcome_hold(HOLD)
            .drain_timeout(Duration::from_secs(60));
        (store, layer)
    };
    let send = |layer: &FenceLayer<SledStore>, token: u64| {
        let svc = layer.layer(service_fn(
            move |_req: Request<RequestBody<String>>| async move {
                if token == 4 {
                    std::future::pending::<()>().await; // still running when the process dies
                }
                Ok::<_, Infallible>(Response::new(String::new()))
            },
        ));
        let req = Request::post("/")
            .header("x-fencing-job", "streamed")
            .header("x-fencing-token", token.to_string())
            .header("content-type", "application/grpc")
            .header("idempotency-key", format!("step-{token}"))
            .body(String::new())
            .unwrap();
        tokio::spawn(async move { svc.oneshot(req).await.unwrap().status() })
    };
    let stamp = {
        let (store, layer) = open();
        let running = send(&layer, 4);
        until("the keyed call runs", || layer.in_flight() == 1).await;
        running.abort();
        let _ = running.await;
        drop(layer);
        let loaded = store.load(&"streamed".parse().unwrap()).await.unwrap();
        loaded
            .prior
            .expect("a sled job has stamps")
            .admitted_until_ms
    };
    // The process died 3 s after stamp + LONGEST + BEGIN: its answer could have come at
    // LONGEST + BEGIN and streamed on, its handler acting, for the 4 s of BODY.
    clock.set_ms(stamp + (LONGEST + BEGIN).as_millis() as u64 + 3_000);
    let opened = Instant::now();
    let (_store, layer) = open();
    let (status, after) = answered(send(&layer, 5), opened).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        after >= HOLD,
        "token 5 passed {after:?} after the restart, inside the {HOLD:?} hold the streamed \
         answer of 4 may still need"
    );
}

/// Without idempotency too, a body streamed to the service may go on until its deadline,
/// after the service answered (an upstream that answers early and reads on): a process that
/// died past stamp + longest request, but inside the body deadline, may have left the service
/// acting on it, and a newer token waits the whole hold from the restart.
#[tokio::test]
async fn a_streamed_body_may_run_past_the_longest_request_by_the_body_deadline() {
    use fence_sink::GenerationStore;

    const BODY: Duration = Duration::from_secs(5);
    let clock = ManualClock::new(1_700_000_000_000);
    let dir = tempfile::tempdir().unwrap();
    let open = || {
        let wall: Arc<dyn Clock> = Arc::new(clock.clone());
        let store = SledStore::open_with_clock(dir.path(), wall.clone()).expect("sled opens");
        let layer = FenceLayer::new(store.clone())
            .clock(wall)
            .without_idempotency()
            .body_timeout(BODY)
            .longest_request(LONGEST)
            .unknown_outcome_hold(HOLD)
            .drain_timeout(Duration::from_secs(60));
        (store, layer)
    };
    let send = |layer: &FenceLayer<SledStore>, token: u64| {
        let svc = layer.layer(service_fn(
            move |_req: Request<RequestBody<String>>| async move {
                if token == 4 {
                    std::future::pending::<()>().await; // still running when the process dies
                }
                Ok::<_, Infallible>(Response::new(String::new()))
            },
        ));
        let req = Request::post("/")
            .header("x-fencing-job", "streamed")
            .header("x-fencing-token", token.to_string())
            .body(String::new())
            .unwrap();
        tokio::spawn(async move { svc.oneshot(req).await.unwrap().status() })
    };
    let stamp = {
        let (store, layer) = open();
        let running = send(&layer, 4);
        until("the request of 4 runs", || layer.in_flight() == 1).await;
        running.abort();
        let _ = running.await;
        drop(layer);
        let loaded = store.load(&"streamed".parse().unwrap()).await.unwrap();
        loaded
            .prior
            .expect("a sled job has stamps")
            .admitted_until_ms
    };
    // The process died 1.8 s after stamp + LONGEST (more than the hold), 0.2 s before the
    // body deadline: the body of 4 may still have been going to the service.
    clock.set_ms(stamp + LONGEST.as_millis() as u64 + 1_800);
    let opened = Instant::now();
    let (_store, layer) = open();
    let (status, after) = answered(send(&layer, 5), opened).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        after >= HOLD,
        "token 5 passed {after:?} after the restart, inside the {HOLD:?} hold the body of 4 \
         may still need"
    );
}

/// A sled store that notes, in order, when the bounds a layer tells it are on disk
/// (`running_within` returned, after its commit: told late by a delay).
#[derive(Clone)]
struct Noting {
    inner: SledStore,
    events: Arc<std::sync::Mutex<Vec<&'static str>>>,
}

impl Noting {
    fn note(&self, event: &'static str) {
        self.events.lock().unwrap().push(event);
    }
}

impl fence_sink::GenerationStore for Noting {
    async fn observe(
        &self,
        job: &fence_core::JobId,
        token: fence_core::Generation,
    ) -> Result<fence_sink::Verdict, fence_sink::StoreError> {
        self.inner.observe(job, token).await
    }
    async fn raise(
        &self,
        job: &fence_core::JobId,
        token: fence_core::Generation,
        older_running: bool,
    ) -> Result<fence_sink::Verdict, fence_sink::StoreError> {
        self.inner.raise(job, token, older_running).await
    }
    async fn highest(
        &self,
        job: &fence_core::JobId,
    ) -> Result<fence_core::Generation, fence_sink::StoreError> {
        self.inner.highest(job).await
    }
    async fn load(
        &self,
        job: &fence_core::JobId,
    ) -> Result<fence_sink::Loaded, fence_sink::StoreError> {
        self.inner.load(job).await
    }
    async fn running_within(
        &self,
        bounds: fence_sink::RunBounds,
    ) -> Result<(), fence_sink::StoreError> {
        // Slow, so that a service reached without waiting for it is reached first.
        tokio::time::sleep(Duration::from_millis(300)).await;
        self.inner.running_within(bounds).await?;
        self.note("bounds on disk");
        Ok(())
    }
    fn ran_within(&self) -> fence_sink::RunBounds {
        self.inner.ran_within()
    }
}

impl fence_sink::IdempotencyStore for Noting {
    async fn begin(
        &self,
        attempt: fence_sink::Attempt<'_>,
        d: Duration,
    ) -> Result<fence_sink::Begin, fence_sink::StoreError> {
        self.inner.begin(attempt, d).await
    }
    async fn finish(
        &self,
        attempt: fence_sink::Attempt<'_>,
        o: fence_sink::Finish,
    ) -> Result<(), fence_sink::StoreError> {
        self.inner.finish(attempt, o).await
    }
    async fn purge_expired(&self) -> Result<usize, fence_sink::StoreError> {
        self.inner.purge_expired().await
    }
}

/// The bounds a process admits under are on disk before its first request reaches the
/// service: told after the admission, or without waiting for their commit, a crash right
/// after would leave the next process waiting by its own (perhaps shorter) bounds while
/// that request can still commit upstream.
#[tokio::test]
async fn the_bounds_are_on_disk_before_the_first_request_reaches_the_service() {
    let dir = tempfile::tempdir().unwrap();
    let store = Noting {
        inner: SledStore::open(dir.path()).unwrap(),
        events: Arc::default(),
    };
    let layer = FenceLayer::new(store.clone())
        .without_idempotency()
        .longest_request(LONGEST)
        .unknown_outcome_hold(HOLD);
    let noted = store.clone();
    let svc = layer.layer(service_fn(move |_req: Request<RequestBody<String>>| {
        noted.note("service");
        async { Ok::<_, Infallible>(Response::new(String::new())) }
    }));
    let req = Request::post("/")
        .header("x-fencing-job", "first")
        .header("x-fencing-token", "1")
        .body(String::new())
        .unwrap();
    assert_eq!(svc.oneshot(req).await.unwrap().status(), StatusCode::OK);
    settle().await;
    let events = store.events.lock().unwrap().clone();
    assert_eq!(events.first(), Some(&"bounds on disk"), "{events:?}");
    assert!(events.contains(&"service"), "{events:?}");
    drop(store);
    drop(layer);
    let reopened = SledStore::open(dir.path()).unwrap();
    let ran = fence_sink::GenerationStore::ran_within(&reopened);
    assert!(ran.running_for >= LONGEST && ran.hold == HOLD, "{ran:?}");
}
