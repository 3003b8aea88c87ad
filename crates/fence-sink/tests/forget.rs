//! Expiring tokens and bounded state at the destination (contract section 8): a token whose
//! lease ended is refused by itself, so a sink may forget idle jobs (and be restored from an
//! old backup) without letting a stale write through.

mod common;

use std::{collections::BTreeMap, convert::Infallible, sync::Arc, time::Duration};

use common::CountingSink;
use fence_core::{
    Generation, JobId,
    signing::{TokenSigner, TokenVerifier},
};
use fence_sink::{
    FenceLayer, ForgetError, GenerationStore, IdempotencyStore, Maintenance, MemoryStore,
    RequestBody, STAMP_AHEAD_MS, SledStore,
};
use fence_storage::clock::{Clock, ManualClock};
use http::{Request, Response, StatusCode};
use proptest::prelude::*;
use tower::{Layer, ServiceExt, service_fn};

const START: u64 = 1_700_000_000_000;
const SKEW: Duration = Duration::from_secs(5);
const MAX_TTL: Duration = Duration::from_secs(30);
const FORGET: Duration = Duration::from_secs(60); // >= 30 s + 2 x 5 s
/// Long enough after a job's last request for it to be forgotten: [`FORGET`] past its stamp,
/// which is written [`STAMP_AHEAD_MS`] ahead, and a little more.
const FORGOTTEN: Duration = Duration::from_secs(60 + STAMP_AHEAD_MS / 1_000 + 10);

fn job() -> JobId {
    "invoice-42".parse().unwrap()
}

/// The lease server's side: tokens for `job` at `generation` ending at `expires_at_ms`.
fn sign(signer: &TokenSigner, generation: u64, expires_at_ms: u64) -> String {
    signer.sign(&job(), Generation::new(generation), expires_at_ms)
}

/// A sink checking signatures and expiry on `clock`, forgetting after [`FORGET`].
fn new_sink<St: GenerationStore + IdempotencyStore>(
    store: St,
    signer: &TokenSigner,
    clock: &ManualClock,
) -> CountingSink<St> {
    let layer = FenceLayer::new(store)
        .require_signatures(TokenVerifier::new([signer.verify_key()]))
        .clock(Arc::new(clock.clone()))
        .clock_skew(SKEW)
        .forget_after(FORGET, MAX_TTL)
        .unwrap()
        // A sink reopened here had nothing running when it stopped: its newer holder need
        // not wait for one (tests/restart.rs is about that wait).
        .longest_request(Duration::ZERO)
        .unknown_outcome_hold(Duration::ZERO);
    CountingSink::new(layer)
}

/// A sink on a memory store, its clock at [`START`], trusting `signer`.
fn in_memory() -> (
    ManualClock,
    TokenSigner,
    MemoryStore,
    CountingSink<MemoryStore>,
) {
    let clock = ManualClock::new(START);
    let signer = TokenSigner::from_seed([7; 32]);
    let store = MemoryStore::with_clock(Arc::new(clock.clone()));
    let sink = new_sink(store.clone(), &signer, &clock);
    (clock, signer, store, sink)
}

/// Moves both clocks: the sink's (stamps, expiry) and tokio's (the forgetting task).
async fn pass(clock: &ManualClock, d: Duration) {
    clock.advance(d);
    tokio::time::sleep(d).await;
    // Let the forgetting pass that just came due run to its end.
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_token_whose_lease_ended_is_409_token_expired_beyond_the_skew() {
    let clock = ManualClock::new(START);
    let signer = TokenSigner::from_seed([7; 32]);
    let sink = new_sink(
        MemoryStore::with_clock(Arc::new(clock.clone())),
        &signer,
        &clock,
    );
    let t = sign(&signer, 1, START + 10_000);
    assert_eq!(sink.send(job().as_str(), &t).await.0, StatusCode::OK);
    clock.advance(Duration::from_millis(10_000 + 5_000)); // at the end plus the skew: still in
    assert_eq!(sink.send(job().as_str(), &t).await.0, StatusCode::OK);
    clock.advance(Duration::from_millis(1));
    let (status, problem) = sink.send(job().as_str(), &t).await;
    assert_eq!(status, StatusCode::CONFLICT, "{problem}");
    assert_eq!(problem["type"], "urn:fence:token-expired");
    assert_eq!(problem["expires_at_ms"], START + 10_000);
    assert_eq!(sink.calls(), 2, "the service saw no expired write");
    // Without verify keys an expiry cannot be trusted, so it is ignored.
    let open = FenceLayer::new(MemoryStore::new()).clock(Arc::new(clock.clone()));
    let inner = service_fn(|_r: Request<RequestBody<String>>| async {
        Ok::<_, Infallible>(Response::new(String::new()))
    });
    let req = Request::post("/")
        .header("x-fencing-job", job().as_str())
        .header("x-fencing-token", &t)
        .body(String::new())
        .unwrap();
    assert_eq!(open.layer(inner).oneshot(req).await.unwrap().status(), 200);
}

#[test]
fn forgetting_without_signatures_or_too_soon_is_refused() {
    let e = FenceLayer::new(MemoryStore::new())
        .forget_after(Duration::from_secs(3600), MAX_TTL)
        .unwrap_err();
    assert_eq!(e, ForgetError::Unsigned);
    let verifier = TokenVerifier::new([TokenSigner::from_seed([1; 32]).verify_key()]);
    let e = FenceLayer::new(MemoryStore::new())
        .require_signatures(verifier)
        .clock_skew(SKEW)
        .forget_after(Duration::from_secs(39), MAX_TTL)
        .unwrap_err();
    assert!(matches!(e, ForgetError::TooSoon { .. }), "{e}");
    assert!(
        e.to_string().contains("shorter than the longest lease TTL"),
        "{e}"
    );
}

/// Proof (a): a worker stalls past its lease, a new holder claims and writes, the sink
/// forgets the job, then the stale worker's write arrives: 409 token-expired.
#[tokio::test(start_paused = true)]
async fn a_stale_write_after_the_job_is_forgotten_is_refused_as_expired() {
    let (clock, signer, store, sink) = in_memory();
    let _upkeep: Maintenance = sink.layer.spawn_maintenance();
    let old = sign(&signer, 1, START + MAX_TTL.as_millis() as u64);
    assert_eq!(sink.send(job().as_str(), &old).await.0, StatusCode::OK);
    // Worker 1 stalls; its lease runs out; worker 2 claims generation 2 and writes.
    pass(&clock, MAX_TTL).await;
    let new = sign(&signer, 2, clock.now_ms() + MAX_TTL.as_millis() as u64);
    assert_eq!(sink.send(job().as_str(), &new).await.0, StatusCode::OK);
    // Nothing more for a while: the sink forgets the job, on disk and in memory.
    pass(&clock, FORGOTTEN).await;
    assert_eq!(
        store.highest(&job()).await.unwrap(),
        Generation::ZERO,
        "forgotten in the store"
    );
    assert_eq!(sink.layer.cached_jobs(), 0, "forgotten in memory");
    // Worker 1 wakes up and writes: its token's lease ended long ago.
    let (status, problem) = sink.send(job().as_str(), &old).await;
    assert_eq!(status, StatusCode::CONFLICT, "{problem}");
    assert_eq!(problem["type"], "urn:fence:token-expired");
    // The live holder, renewed, goes on.
    let renewed = sign(&signer, 2, clock.now_ms() + MAX_TTL.as_millis() as u64);
    assert_eq!(sink.send(job().as_str(), &renewed).await.0, StatusCode::OK);
}

/// The window the upkeep forgets by: `FORGET` on a memory store, stretched on sled to what a
/// restarted process must wait for (the longest request, its begin, the hold), never shorter
/// than the token window; none without `forget_after`.
#[test]
fn the_forgetting_window_is_stretched_only_where_a_restart_needs_it() {
    fn forgetting<St: GenerationStore + IdempotencyStore>(store: St) -> FenceLayer<St> {
        FenceLayer::new(store)
            .require_signatures(TokenVerifier::new([
                TokenSigner::from_seed([7; 32]).verify_key()
            ]))
            .clock_skew(SKEW)
            .forget_after(FORGET, MAX_TTL)
            .unwrap()
            .longest_request(Duration::from_secs(60))
            .unknown_outcome_hold(Duration::from_secs(45))
    }
    assert_eq!(forgetting(MemoryStore::new()).forgets_after(), Some(FORGET));
    let dir = tempfile::tempdir().unwrap();
    let sled = forgetting(SledStore::open(dir.path()).unwrap());
    // 60 s + the default idempotency store timeout a keyed request may wait for its
    // record's begin (5 s) + the default body deadline a keyed call of messages may stream
    // its answer after its head (30 s) + 45 s.
    assert_eq!(sled.forgets_after(), Some(Duration::from_secs(140)));
    // A body deadline longer than the longest request counts instead of it (a body may be
    // streamed to a service that answered early until then): shortened too.
    let short = sled
        .longest_request(Duration::from_secs(1))
        .body_timeout(Duration::from_secs(1))
        .unknown_outcome_hold(Duration::from_secs(1));
    assert_eq!(short.forgets_after(), Some(FORGET));
    let widened = short.clock_skew(Duration::from_secs(30));
    assert_eq!(widened.forgets_after(), Some(Duration::from_secs(90)));
    assert_eq!(FenceLayer::new(MemoryStore::new()).forgets_after(), None);
}

/// A clock skew widened after `forget_after` (the builder cannot refuse it there) widens the
/// window tokens end within, and forgetting waits for it: a job is forgotten no sooner than
/// the longest lease plus twice the skew in force.
#[tokio::test(start_paused = true)]
async fn a_skew_set_after_forget_after_delays_forgetting() {
    let clock = ManualClock::new(START);
    let signer = TokenSigner::from_seed([7; 32]);
    let store = MemoryStore::with_clock(Arc::new(clock.clone()));
    let wide = Duration::from_secs(30); // window: 30 s + 2 x 30 s = 90 s, not FORGET's 60 s
    let layer = FenceLayer::new(store.clone())
        .require_signatures(TokenVerifier::new([signer.verify_key()]))
        .clock(Arc::new(clock.clone()))
        .clock_skew(SKEW)
        .forget_after(FORGET, MAX_TTL)
        .unwrap()
        .clock_skew(wide);
    let sink = CountingSink::new(layer);
    let _upkeep: Maintenance = sink.layer.spawn_maintenance();
    let token = sign(&signer, 1, START + MAX_TTL.as_millis() as u64);
    assert_eq!(sink.send(job().as_str(), &token).await.0, StatusCode::OK);
    pass(&clock, FORGOTTEN).await;
    assert_eq!(
        store.highest(&job()).await.unwrap(),
        Generation::new(1),
        "forgotten after FORGET although the skew in force makes the window 90 s"
    );
    pass(&clock, Duration::from_secs(30)).await;
    assert_eq!(
        store.highest(&job()).await.unwrap(),
        Generation::ZERO,
        "not forgotten once the 90 s window had passed"
    );
}

/// The attack of issue 30: a sink forgot a job whose newer generations it had seen; a token
/// of an older generation, validly signed by a lease server with a longer maximum TTL than
/// the sink was told (an hour ahead), arrives. It is refused for outliving the window the
/// sink forgets by (403 token-too-long-lived), before and after the forgetting alike; a
/// token ending exactly at the window's edge still passes.
#[tokio::test(start_paused = true)]
async fn a_token_that_outlives_the_window_is_refused_before_and_after_forgetting() {
    let (clock, signer, store, sink) = in_memory();
    let _upkeep = sink.layer.spawn_maintenance();
    let edge = |c: &ManualClock| c.now_ms() + (MAX_TTL + SKEW).as_millis() as u64;
    for generation in [4, 5] {
        let t = sign(&signer, generation, edge(&clock));
        assert_eq!(sink.send(job().as_str(), &t).await.0, StatusCode::OK);
    }
    let hour_ahead = |c: &ManualClock| c.now_ms() + 3_600_000;
    let long = sign(&signer, 6, hour_ahead(&clock));
    let (status, problem) = sink.send(job().as_str(), &long).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{problem}");
    assert_eq!(problem["type"], "urn:fence:token-too-long-lived");
    assert_eq!(problem["expires_at_ms"], hour_ahead(&clock));
    pass(&clock, FORGOTTEN).await;
    assert_eq!(
        store.highest(&job()).await.unwrap(),
        Generation::ZERO,
        "forgotten"
    );
    let stale = sign(&signer, 3, hour_ahead(&clock));
    let (status, problem) = sink.send(job().as_str(), &stale).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{problem}");
    assert_eq!(problem["type"], "urn:fence:token-too-long-lived");
    assert_eq!(sink.calls(), 2, "no write of a too long-lived token ran");
    // One millisecond inside the window is a lease the server may grant: it passes.
    let fresh = sign(&signer, 7, edge(&clock));
    assert_eq!(sink.send(job().as_str(), &fresh).await.0, StatusCode::OK);
    let over = sign(&signer, 7, edge(&clock) + 1);
    assert_eq!(
        sink.send(job().as_str(), &over).await.0,
        StatusCode::FORBIDDEN
    );
}

/// Proof (b): the old lease was *released* early (its token's end still ahead when the new
/// holder claims), and the stale write is held in the network until after forgetting.
#[tokio::test(start_paused = true)]
async fn a_released_leases_write_held_until_after_forgetting_is_refused() {
    let (clock, signer, store, sink) = in_memory();
    let _upkeep = sink.layer.spawn_maintenance();
    let old = sign(&signer, 1, START + MAX_TTL.as_millis() as u64);
    // Worker 1 releases after a second; worker 2 claims at once and writes.
    pass(&clock, Duration::from_secs(1)).await;
    let new = sign(&signer, 2, clock.now_ms() + MAX_TTL.as_millis() as u64);
    assert_eq!(sink.send(job().as_str(), &new).await.0, StatusCode::OK);
    // Worker 1's write, sent before its release, is stuck in the network this long:
    pass(&clock, FORGOTTEN).await;
    assert_eq!(store.highest(&job()).await.unwrap(), Generation::ZERO);
    let (status, problem) = sink.send(job().as_str(), &old).await;
    assert_eq!(status, StatusCode::CONFLICT, "{problem}");
    assert_eq!(problem["type"], "urn:fence:token-expired");
    assert_eq!(sink.calls(), 1);
}

/// Proof (d): the stale write carries an `Idempotency-Key`, so its body is read whole
/// before the fence decides, and it arrives before the newer holder's first write (a token
/// below the highest already in memory is refused before its body is read). The newer
/// holder writes while the body trickles in, and the body takes long enough for the job to
/// be forgotten meanwhile, with the forgetting window as short as the sink allows. Its token
/// was valid when it arrived and has ended when it is admitted: refused.
#[tokio::test(start_paused = true)]
async fn a_stale_keyed_write_whose_body_outlasts_forgetting_is_refused() {
    let clock = ManualClock::new(START);
    let signer = TokenSigner::from_seed([7; 32]);
    let store = MemoryStore::with_clock(Arc::new(clock.clone()));
    let shortest = MAX_TTL + 2 * SKEW;
    let layer = FenceLayer::new(store.clone())
        .require_signatures(TokenVerifier::new([signer.verify_key()]))
        .clock(Arc::new(clock.clone()))
        .clock_skew(SKEW)
        .forget_after(shortest, MAX_TTL)
        .unwrap()
        .body_timeout(Duration::from_secs(90))
        .longest_request(Duration::ZERO)
        .unknown_outcome_hold(Duration::ZERO);
    let sink = CountingSink::new(layer);
    let _upkeep = sink.layer.spawn_maintenance();
    let old = sign(&signer, 1, START + MAX_TTL.as_millis() as u64);
    // Worker 1 releases after a second; worker 2 claims at once.
    pass(&clock, Duration::from_secs(1)).await;
    let new = sign(&signer, 2, clock.now_ms() + MAX_TTL.as_millis() as u64);
    // Worker 1's keyed write arrives a second before its lease's end plus the skew, and
    // its body trickles in.
    pass(&clock, MAX_TTL + SKEW - Duration::from_secs(2)).await;
    let (chunks, body) = common::Channel::new();
    let req = Request::post("/")
        .header("x-fencing-job", job().as_str())
        .header("x-fencing-token", &old)
        .header("idempotency-key", "step-1")
        .body(body)
        .unwrap();
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let inner = {
        let calls = calls.clone();
        service_fn(move |_req: Request<RequestBody<common::Channel>>| {
            calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async { Ok::<_, Infallible>(Response::new(String::new())) }
        })
    };
    let stale = tokio::spawn(sink.layer.layer(inner).oneshot(req));
    chunks.send("half".into()).unwrap();
    // Arrived (its headers checked) before the clocks move on; then worker 2 writes.
    pass(&clock, Duration::from_millis(1)).await;
    assert_eq!(sink.send(job().as_str(), &new).await.0, StatusCode::OK);
    pass(&clock, Duration::from_secs(60)).await;
    assert_eq!(
        store.highest(&job()).await.unwrap(),
        Generation::ZERO,
        "the job was forgotten while the body was read"
    );
    chunks
        .send(" and the rest".into())
        .expect("the body is still being read");
    drop(chunks);
    let answer = stale.await.unwrap().unwrap();
    assert_eq!(
        answer.status(),
        StatusCode::CONFLICT,
        "a token whose lease ended while its body was read was admitted to a forgotten job"
    );
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 0);
}

/// Proof (c): the sink's data directory is replaced by a copy taken before the new
/// holder's writes (a restore from backup); the stale write is still refused.
// Real time: sled commits on a thread of its own, which paused time would outrun. No
// forgetting task runs here, so only the sink's manual clock needs to move.
#[tokio::test]
async fn a_sink_restored_from_an_old_backup_still_refuses_the_stale_write() {
    let clock = ManualClock::new(START);
    let signer = TokenSigner::from_seed([7; 32]);
    let dir = tempfile::tempdir().unwrap();
    let (live, backup) = (dir.path().join("live"), dir.path().join("backup"));
    let old = sign(&signer, 1, START + MAX_TTL.as_millis() as u64);
    {
        let sink = new_sink(
            SledStore::open_with_clock(&live, Arc::new(clock.clone())).unwrap(),
            &signer,
            &clock,
        );
        assert_eq!(sink.send(job().as_str(), &old).await.0, StatusCode::OK);
        sink.layer.store().flush().unwrap();
    }
    copy_dir(&live, &backup);
    clock.advance(MAX_TTL); // worker 1 stalls past its lease
    {
        let sink = new_sink(
            SledStore::open_with_clock(&live, Arc::new(clock.clone())).unwrap(),
            &signer,
            &clock,
        );
        let new = sign(&signer, 2, clock.now_ms() + MAX_TTL.as_millis() as u64);
        assert_eq!(sink.send(job().as_str(), &new).await.0, StatusCode::OK);
    }
    // Disaster: the live directory is lost; the backup (highest 1) comes back.
    let restored = SledStore::open_with_clock(&backup, Arc::new(clock.clone())).unwrap();
    assert_eq!(restored.highest(&job()).await.unwrap(), Generation::new(1));
    let sink = new_sink(restored, &signer, &clock);
    clock.advance(SKEW + Duration::from_millis(1));
    let (status, problem) = sink.send(job().as_str(), &old).await;
    assert_eq!(status, StatusCode::CONFLICT, "{problem}");
    assert_eq!(problem["type"], "urn:fence:token-expired");
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else if entry.file_name() != "fence.lock" {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// What one step of the model does.
#[derive(Debug, Clone)]
enum Step {
    /// The lease server grants the next generation for `ttl_s` (the holder's lease ended or
    /// was released before: `released` says which).
    Claim { ttl_s: u64, released: bool },
    /// The current holder renews: a fresh token ending `ttl_s` from now.
    Renew { ttl_s: u64 },
    /// A write with the `age`-th newest token ever issued arrives.
    Write { age: usize },
    /// Time passes on every clock.
    Wait { s: u64 },
    /// The sink process restarts (same store).
    Restart,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        2 => (1u64..=30, any::<bool>()).prop_map(|(ttl_s, released)| Step::Claim { ttl_s, released }),
        2 => (1u64..=30).prop_map(|ttl_s| Step::Renew { ttl_s }),
        6 => (0usize..6).prop_map(|age| Step::Write { age }),
        3 => prop_oneof![1u64..20, 20u64..120].prop_map(|s| Step::Wait { s }),
        1 => Just(Step::Restart),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]
    /// Proof (e): across forgetting, restarts and a lease server whose clock is off by up to
    /// the allowed skew, the sink never accepts a token below one it accepted before.
    #[test]
    fn never_a_token_below_one_accepted_before(
        steps in proptest::collection::vec(step(), 1..60),
        server_offset_s in -5i64..=5,
    ) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap();
        rt.block_on(async move {
            let sink_clock = ManualClock::new(START);
            let signer = TokenSigner::from_seed([9; 32]);
            let store = MemoryStore::with_clock(Arc::new(sink_clock.clone()));
            let mut sink = new_sink(store.clone(), &signer, &sink_clock);
            let mut upkeep = sink.layer.spawn_maintenance();
            let server_now = |c: &ManualClock| c.now_ms().saturating_add_signed(server_offset_s * 1000);
            // The lease server: generation, when the current lease ends (server clock).
            let (mut generation, mut lease_end) = (0u64, 0u64);
            let mut issued: Vec<(u64, String)> = Vec::new();
            let mut accepted_max = 0u64;
            let mut history = BTreeMap::new();
            for (i, s) in steps.into_iter().enumerate() {
                match s {
                    Step::Claim { ttl_s, released } => {
                        let now = server_now(&sink_clock);
                        if !released && lease_end > now {
                            // Not released and not expired: the claim waits for the lease end.
                            pass(&sink_clock, Duration::from_millis(lease_end - now)).await;
                        }
                        let now = server_now(&sink_clock);
                        generation += 1;
                        lease_end = now + ttl_s * 1000;
                        issued.push((generation, sign(&signer, generation, lease_end)));
                    }
                    Step::Renew { ttl_s } => {
                        let now = server_now(&sink_clock);
                        if generation > 0 && lease_end > now {
                            lease_end = now + ttl_s * 1000;
                            issued.push((generation, sign(&signer, generation, lease_end)));
                        }
                    }
                    Step::Write { age } => {
                        let Some((g, token)) = issued.iter().rev().nth(age).cloned() else { continue };
                        let (status, _) = sink.send(job().as_str(), &token).await;
                        history.insert(i, (g, status.as_u16()));
                        if status == StatusCode::OK {
                            assert!(g >= accepted_max, "step {i}: accepted {g} after {accepted_max}: {history:?}");
                            accepted_max = g;
                        }
                    }
                    Step::Wait { s } => pass(&sink_clock, Duration::from_secs(s)).await,
                    Step::Restart => {
                        upkeep.stop().await;
                        sink = new_sink(store.clone(), &signer, &sink_clock);
                        upkeep = sink.layer.spawn_maintenance();
                    }
                }
            }
        });
    }
}

/// A job with a request in flight is never forgotten, however long the request takes.
#[tokio::test(start_paused = true)]
async fn a_job_with_a_request_in_flight_is_not_forgotten() {
    let (clock, signer, store, sink) = in_memory();
    let _upkeep = sink.layer.spawn_maintenance();
    let release = Arc::new(tokio::sync::Notify::new());
    let inner = {
        let release = release.clone();
        service_fn(move |_req: Request<RequestBody<String>>| {
            let release = release.clone();
            async move {
                release.notified().await;
                Ok::<_, Infallible>(Response::new(String::new()))
            }
        })
    };
    let token = sign(&signer, 3, START + MAX_TTL.as_millis() as u64);
    let req = Request::post("/")
        .header("x-fencing-job", job().as_str())
        .header("x-fencing-token", &token)
        .body(String::new())
        .unwrap();
    let slow = tokio::spawn(sink.layer.layer(inner).oneshot(req));
    pass(&clock, Duration::from_millis(1)).await;
    pass(&clock, 3 * FORGET).await;
    assert_eq!(
        store.highest(&job()).await.unwrap(),
        Generation::new(3),
        "kept while in flight"
    );
    release.notify_one();
    assert_eq!(slow.await.unwrap().unwrap().status(), StatusCode::OK);
    pass(&clock, FORGOTTEN).await;
    assert_eq!(
        store.highest(&job()).await.unwrap(),
        Generation::ZERO,
        "forgotten once idle"
    );
}

/// Jobs a previous process accepted, which this one never held in memory (a restart on
/// the same data directory), are forgotten from the store too, in pages: the pass goes on
/// past a full page.
#[tokio::test(start_paused = true)]
async fn jobs_only_the_store_remembers_are_forgotten_too() {
    let (clock, signer, store, before) = in_memory();
    let jobs: Vec<String> = (0..1_100).map(|i| format!("order-{i}")).collect();
    for (i, j) in jobs.iter().enumerate() {
        let job: JobId = j.parse().unwrap();
        let t = signer.sign(&job, Generation::new(i as u64 + 1), START + 10_000);
        assert_eq!(before.send(j, &t).await.0, StatusCode::OK, "{j}");
    }
    drop(before);
    let after = new_sink(store.clone(), &signer, &clock);
    assert_eq!(
        after.layer.cached_jobs(),
        0,
        "the restarted sink holds nothing yet"
    );
    clock.advance(FORGOTTEN);
    // The first forgetting pass starts at once; let it, and only it, run.
    let _upkeep = after.layer.spawn_maintenance();
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
    for j in [&jobs[0], &jobs[999], &jobs[1_099]] {
        let job: JobId = j.parse().unwrap();
        assert_eq!(
            store.highest(&job).await.unwrap(),
            Generation::ZERO,
            "{j} forgotten in one pass"
        );
    }
}
