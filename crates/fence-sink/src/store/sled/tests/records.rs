//! Tests of the records a sled store keeps for the processes after: run bounds, forgetting.

use super::*;

/// The bounds a process ran with outlive it: the next one reads them ([`Prior::ran`],
/// `ran_within`) whatever it is told itself, and records the longer of both while what the
/// process before admitted may still run; once that has settled (the earlier hold after the
/// open, on the monotonic clock), the record is lowered to this process's own at its next
/// load, so a shorter setting counts from the restart after.
#[tokio::test]
async fn the_bounds_a_process_ran_with_are_read_by_the_next_and_lowered_once_settled() {
    use fence_storage::clock::ManualClock;
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_700_000_000_000);
    let open = || SledStore::open_with_clock(dir.path(), Arc::new(clock.clone())).unwrap();
    let job: JobId = "ran".parse().unwrap();
    let long = RunBounds::new(Duration::from_secs(600), Duration::from_secs(600));
    let short = RunBounds::new(Duration::from_secs(30), Duration::from_secs(30));
    {
        let a = open();
        assert_eq!(a.ran_within(), RunBounds::default(), "none recorded yet");
        a.running_within(long).await.unwrap();
        a.accept(&job, Generation::new(4), false).await.unwrap();
    }
    clock.advance(Duration::from_secs(120));
    {
        let b = open();
        assert_eq!(b.ran_within(), long);
        let prior = b.load(&job).await.unwrap().prior.expect("stamps");
        assert_eq!(prior.ran, long, "the job's stamps come with the bounds");
        b.running_within(short).await.unwrap();
    }
    {
        // B died before what A admitted had settled: its record still says A's bounds.
        let c = open();
        assert_eq!(
            c.ran_within(),
            long,
            "lowered while A's requests could still run"
        );
        c.running_within(short).await.unwrap();
        // A's requests may run until A's hold (600 s) after C's open: not lowered a
        // second before, lowered at it.
        clock.advance(Duration::from_secs(599));
        c.load(&job).await.unwrap();
        assert_eq!(
            recorded_running(&c),
            long,
            "lowered before A's hold ran out"
        );
        clock.advance(Duration::from_secs(1));
        c.load(&job).await.unwrap();
        assert_eq!(recorded_running(&c), short, "not lowered once it ran out");
    }
    assert_eq!(open().ran_within(), short, "never lowered");
}

/// Forgetting is recorded on disk before the first deletion, for the processes after this
/// one: with the smallest skew and the shortest longest lease any process forgot under, and
/// with the defaults when a job is deleted without being told the window first.
#[tokio::test]
async fn forgetting_is_recorded_for_the_processes_after_with_the_strictest_bounds() {
    let dir = tempfile::tempdir().unwrap();
    let open = || SledStore::open(dir.path()).unwrap();
    {
        let store = open();
        assert_eq!(store.recorded_settings().unwrap(), None);
        store
            .forgetting_within(Duration::from_secs(2), Duration::from_secs(3600))
            .await
            .unwrap();
    }
    {
        let store = open();
        let recorded = |skew: u64, ttl: u64| {
            Some(crate::SinkSettings {
                forgetting: true,
                clock_skew: Duration::from_secs(skew),
                max_lease_ttl: Some(Duration::from_secs(ttl)),
            })
        };
        assert_eq!(store.recorded_settings().unwrap(), recorded(2, 3600));
        // A later process with a larger skew and a shorter lease: the smaller of each.
        store
            .forgetting_within(Duration::from_secs(9), Duration::from_secs(60))
            .await
            .unwrap();
        assert_eq!(store.recorded_settings().unwrap(), recorded(2, 60));
    }
    let other = tempfile::tempdir().unwrap();
    let store = SledStore::open(other.path()).unwrap();
    let job: JobId = "gone".parse().unwrap();
    store.observe(&job, Generation::new(1)).await.unwrap();
    let idle = IdleJob {
        touched_ms: u64::MAX,
        job,
    };
    // Not deleted (the stamp differs), but recorded first all the same.
    assert!(!store.forget(&idle).await.unwrap());
    drop(store);
    let recorded = SledStore::open(other.path())
        .unwrap()
        .recorded_settings()
        .unwrap()
        .expect("forgetting recorded before the first deletion");
    assert_eq!(recorded.clock_skew, crate::DEFAULT_CLOCK_SKEW);
}

/// Writes `value` under `key` in the `format` tree of the (closed) store in `dir`.
fn write_format(dir: &Path, key: &[u8], value: &[u8]) {
    let db = DurableDb::open(dir).unwrap();
    db.tree("format").unwrap().insert(key, value).unwrap();
    db.flush_now().unwrap();
}

/// A `running` record that cannot be decoded refuses the open, naming the directory and
/// the record, and is left as it was: read as none and then overwritten with the restarted
/// process's shorter bounds, a newer token would pass while an older request can still
/// commit. A longer record (a newer build's) is read by its first 16 bytes; one above the
/// 100-year cap is damage; `clear_running_record` removes it.
#[tokio::test]
async fn a_damaged_running_record_refuses_the_open_and_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let long = RunBounds::new(Duration::from_secs(600), Duration::from_secs(60));
    let mut longer = 600_000u64.to_be_bytes().to_vec();
    longer.extend_from_slice(&60_000u64.to_be_bytes());
    longer.extend_from_slice(b"newer");
    write_format(dir.path(), b"running", &longer);
    assert!(
        !SledStore::clear_running_record(dir.path()).unwrap(),
        "kept: it reads"
    );
    assert_eq!(SledStore::open(dir.path()).unwrap().ran_within(), long);
    let mut above = [0u8; 16];
    above[..8].copy_from_slice(&u64::MAX.to_be_bytes());
    for damaged in [&b"short"[..], &above[..]] {
        write_format(dir.path(), b"running", damaged);
        let err = SledStore::open(dir.path()).expect_err("a damaged record refuses");
        assert!(
            matches!(
                err,
                OpenError::Record {
                    record: "running",
                    ..
                }
            ),
            "{err:?}"
        );
        let text = err.to_string();
        assert!(text.contains(&dir.path().display().to_string()), "{text}");
        assert!(text.contains("--clear-running-record"), "{text}");
        let db = DurableDb::open(dir.path()).unwrap();
        let kept = db.tree("format").unwrap().get(b"running").unwrap();
        assert_eq!(kept.as_deref(), Some(damaged), "not overwritten");
    }
    assert!(SledStore::clear_running_record(dir.path()).unwrap());
    assert_eq!(
        SledStore::open(dir.path()).unwrap().ran_within(),
        RunBounds::default()
    );
}

/// A `forgetting` record that cannot be decoded is an error naming it, where it is read
/// and before a deletion, and is never written over: read as the defaults, a later proxy
/// would check expiry by a larger skew or a longer lease than the one that forgot. A longer
/// record (a newer build's) is read by its first 16 bytes.
#[tokio::test]
async fn a_damaged_forgetting_record_is_an_error_and_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let mut longer = 2_000u64.to_be_bytes().to_vec();
    longer.extend_from_slice(&60_000u64.to_be_bytes());
    longer.extend_from_slice(b"newer");
    write_format(dir.path(), b"forgetting", &longer);
    let recorded = SledStore::open(dir.path())
        .unwrap()
        .recorded_settings()
        .unwrap()
        .expect("recorded");
    assert_eq!(recorded.clock_skew, Duration::from_secs(2));
    assert_eq!(recorded.max_lease_ttl, Some(MINUTE));
    let damaged = &b"short"[..];
    write_format(dir.path(), b"forgetting", damaged);
    {
        let store = SledStore::open(dir.path()).unwrap();
        let err = anyhow_chain(&store.recorded_settings().unwrap_err());
        assert!(err.contains("`forgetting` record"), "{err}");
        assert!(err.contains(&dir.path().display().to_string()), "{err}");
        let job: JobId = "gone".parse().unwrap();
        store.observe(&job, Generation::new(1)).await.unwrap();
        let idle = IdleJob {
            touched_ms: u64::MAX,
            job,
        };
        store
            .forget(&idle)
            .await
            .expect_err("not forgotten over it");
        store
            .forgetting_within(Duration::from_secs(9), Duration::from_secs(3600))
            .await
            .expect_err("not recorded over it");
    }
    let db = DurableDb::open(dir.path()).unwrap();
    let kept = db.tree("format").unwrap().get(b"forgetting").unwrap();
    assert_eq!(kept.as_deref(), Some(damaged), "not overwritten");
}

/// An error and its sources, as `fence` prints them.
fn anyhow_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// The bounds the `running` record holds now, read from the tree.
fn recorded_running(store: &SledStore) -> RunBounds {
    let raw = store.format.get(b"running").unwrap().expect("recorded");
    let word = |i: usize| {
        Duration::from_millis(u64::from_be_bytes(
            raw[i * 8..i * 8 + 8].try_into().unwrap(),
        ))
    };
    RunBounds::new(word(0), word(1))
}

/// Lowering the `running` record at a load is optional: when its write fails, the load of
/// an unrelated job still answers (the record keeps the longer bounds, the safe side),
/// instead of failing the request that happened to come first after the earlier hold.
#[cfg(feature = "test-hooks")]
#[tokio::test]
async fn a_failed_lowering_write_does_not_fail_a_load() {
    use fence_storage::clock::ManualClock;
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_700_000_000_000);
    let open = || SledStore::open_with_clock(dir.path(), Arc::new(clock.clone())).unwrap();
    let long = RunBounds::new(Duration::from_secs(600), Duration::from_secs(600));
    open().running_within(long).await.unwrap();
    {
        let store = open();
        clock.advance(Duration::from_secs(601));
        store.db.fail_log();
        let job: JobId = "unrelated".parse().unwrap();
        let loaded = store.load(&job).await.expect("the load answers");
        assert_eq!(loaded.highest, Generation::ZERO);
        assert_eq!(recorded_running(&store), long, "kept the longer bounds");
    }
    assert_eq!(open().ran_within(), long);
}

/// Idempotency records are timed on the wall clock at the open plus the monotonic time
/// since (a step of the wall clock within a process is not time passed), so the records an
/// earlier process wrote still compare with the next one's times: the time between the two
/// processes counts, on the wall clock. A record begun 100 s before the process stopped is in
/// flight at a restart 100 s later, and free once its 300 s have passed in all; an answer
/// kept for 600 s is replayed by the next process until then.
#[tokio::test]
async fn idempotency_records_of_an_earlier_process_keep_their_times() {
    use fence_storage::clock::ManualClock;
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_700_000_000_000);
    let open = || SledStore::open_with_clock(dir.path(), Arc::new(clock.clone())).unwrap();
    let job: JobId = "restarted".parse().unwrap();
    let (crashed, done) = (
        IdempotencyKey::from_bytes(b"crashed").unwrap(),
        IdempotencyKey::from_bytes(b"done").unwrap(),
    );
    let fp = crate::Fingerprint::of(&http::Method::POST, "/pay", b"{}");
    let at = |key, id| Attempt {
        job: &job,
        key,
        fingerprint: &fp,
        id,
        generation: Generation::new(1),
        settled_after: Duration::ZERO,
    };
    let in_flight = Duration::from_secs(300);
    {
        let a = open();
        clock.advance(Duration::from_secs(10));
        assert_eq!(
            a.begin(at(&crashed, 1), in_flight).await.unwrap(),
            Begin::Started
        );
        assert_eq!(
            a.begin(at(&done, 2), in_flight).await.unwrap(),
            Begin::Started
        );
        let response = crate::StoredResponse {
            status: http::StatusCode::CREATED,
            headers: http::HeaderMap::new(),
            body: bytes::Bytes::from_static(b"paid"),
            trailers: None,
        };
        let retention = Duration::from_secs(600);
        a.finish(
            at(&done, 2),
            Finish::Store {
                response,
                retention,
            },
        )
        .await
        .unwrap();
        clock.advance(Duration::from_secs(100));
    }
    // 100 s without a process: the wall clock moves on, this monotonic one does not (the
    // next process's starts anywhere).
    clock.set_ms(clock.now_ms() + 100_000);
    let b = open();
    assert_eq!(
        b.begin(at(&crashed, 3), in_flight).await.unwrap(),
        Begin::InFlight,
        "200 s after its begin, the record of the process before is still in flight"
    );
    assert_eq!(b.purge_expired().await.unwrap(), 0);
    clock.advance(Duration::from_secs(101));
    assert_eq!(
        b.begin(at(&crashed, 3), in_flight).await.unwrap(),
        Begin::Started
    );
    assert!(
        matches!(b.begin(at(&done, 4), in_flight).await.unwrap(), Begin::Replay(r) if r.body == "paid"),
        "the answer is kept for its 600 s"
    );
    clock.advance(Duration::from_secs(300));
    assert_eq!(
        b.begin(at(&done, 4), in_flight).await.unwrap(),
        Begin::Started
    );
}

/// A step of the wall clock during one process does not come back at the next open. A proxy
/// starts with its clock an hour behind, NTP corrects it, and the proxy is killed while a
/// keyed request is in flight: after the restart its record must still be in flight, not an
/// hour (less 5 min) expired with a retry reaching the service a second time. A step back
/// holds the key the step's size longer (liveness), and no longer than that.
#[tokio::test]
async fn a_step_of_the_wall_clock_does_not_expire_records_at_the_next_open() {
    use fence_storage::clock::ManualClock;
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_700_000_000_000);
    let open = || SledStore::open_with_clock(dir.path(), Arc::new(clock.clone())).unwrap();
    let job: JobId = "stepped".parse().unwrap();
    let (ahead, back) = (
        IdempotencyKey::from_bytes(b"ahead").unwrap(),
        IdempotencyKey::from_bytes(b"back").unwrap(),
    );
    let fp = crate::Fingerprint::of(&http::Method::POST, "/pay", b"{}");
    let at = |key, id| Attempt {
        job: &job,
        key,
        fingerprint: &fp,
        id,
        generation: Generation::new(1),
        settled_after: Duration::ZERO,
    };
    let in_flight = Duration::from_secs(300);
    {
        let a = open();
        clock.step_ms(3_600_000);
        assert_eq!(
            a.begin(at(&ahead, 1), in_flight).await.unwrap(),
            Begin::Started
        );
    }
    let b = open();
    assert_eq!(
        b.begin(at(&ahead, 2), in_flight).await.unwrap(),
        Begin::InFlight,
        "the record of the process before expired at the open: a retry would run again"
    );
    assert_eq!(b.purge_expired().await.unwrap(), 0);
    clock.advance(in_flight);
    assert_eq!(
        b.begin(at(&ahead, 3), in_flight).await.unwrap(),
        Begin::Started,
        "held past its in-flight timeout"
    );
    assert_eq!(
        b.begin(at(&back, 4), in_flight).await.unwrap(),
        Begin::Started
    );
    clock.step_ms(-600_000);
    clock.advance(in_flight);
    assert_eq!(
        b.begin(at(&back, 5), in_flight).await.unwrap(),
        Begin::InFlight,
        "a step back holds the key the step longer"
    );
    clock.advance(Duration::from_secs(600));
    assert_eq!(
        b.begin(at(&back, 6), in_flight).await.unwrap(),
        Begin::Started,
        "held past its timeout plus the step"
    );
}

/// A step of the wall clock *after* a record's begin, in the process that began it, is not
/// taken for time passed at the next open either. A proxy begins a keyed request, NTP steps
/// its clock an hour forward, and the proxy is killed while the request still runs at the
/// service: at the restart the record's time says it expired 55 minutes ago, but the request
/// may still commit until the unknown-outcome hold the process recorded has passed (the
/// longest a newer token waits after a restart). Until then the record is in flight, and neither a retry
/// nor the purge takes it; after it, the retry runs.
#[tokio::test]
async fn a_records_request_running_at_a_restart_keeps_it_in_flight_past_a_clock_step() {
    use fence_storage::clock::ManualClock;
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_700_000_000_000);
    let open = || SledStore::open_with_clock(dir.path(), Arc::new(clock.clone())).unwrap();
    let job: JobId = "stepped-after-begin".parse().unwrap();
    let key = IdempotencyKey::from_bytes(b"charge").unwrap();
    let fp = crate::Fingerprint::of(&http::Method::POST, "/pay", b"{}");
    let at = |id| Attempt {
        job: &job,
        key: &key,
        fingerprint: &fp,
        id,
        generation: Generation::new(1),
        settled_after: Duration::ZERO,
    };
    let in_flight = Duration::from_secs(300);
    let hold = Duration::from_secs(60);
    {
        let a = open();
        a.running_within(RunBounds::new(in_flight, hold))
            .await
            .unwrap();
        assert_eq!(a.begin(at(1), in_flight).await.unwrap(), Begin::Started);
        clock.advance(Duration::from_secs(1));
        clock.step_ms(3_600_000);
    }
    let b = open();
    assert_eq!(
        b.begin(at(2), in_flight).await.unwrap(),
        Begin::InFlight,
        "the step expired the record at the open: a retry would run the effect again"
    );
    // Nor does a newer holder's request with the key (a derived key) take it over: after
    // the step its restart wait is shortened by the step, and it may be admitted at once.
    let newer = Attempt {
        generation: Generation::new(2),
        ..at(5)
    };
    assert_eq!(
        b.begin(newer, in_flight).await.unwrap(),
        Begin::InFlight,
        "a newer holder took over the record of a request that may still commit"
    );
    assert_eq!(b.purge_expired().await.unwrap(), 0, "the purge dropped it");
    clock.advance(hold - Duration::from_millis(1));
    assert_eq!(b.begin(at(3), in_flight).await.unwrap(), Begin::InFlight);
    clock.advance(Duration::from_millis(1));
    assert_eq!(
        b.begin(at(4), in_flight).await.unwrap(),
        Begin::Started,
        "held past the recorded hold"
    );
}

/// A forward step of the wall clock between two processes on one boot is told from time
/// passed: every job is taken as stamped at the later open, so a job busy at a crash waits
/// the restart hold (an audit saw a newer token pass at once after a step of an hour across
/// a `kill -9`, its effect committing before the old request's), its raise too, and no job
/// is forgotten before it has been idle since the open. Without a step nothing is
/// restamped; across a reboot the clocks are not compared.
#[tokio::test]
async fn a_step_of_the_wall_clock_between_processes_takes_every_job_as_stamped_at_the_open() {
    use fence_storage::clock::ManualClock;
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_700_000_000_000).with_boot();
    let open = || SledStore::open_with_clock(dir.path(), Arc::new(clock.clone())).unwrap();
    let job: JobId = "busy-at-the-crash".parse().unwrap();
    let prior = |store: &SledStore| {
        let job = job.clone();
        let store = store.clone();
        async move { store.load(&job).await.unwrap().prior.expect("stamps") }
    };
    {
        let a = open();
        clock.advance(Duration::from_secs(60));
        a.accept(&job, Generation::new(1), false).await.unwrap();
        a.accept(&job, Generation::new(2), true).await.unwrap();
        clock.advance(Duration::from_secs(1));
        clock.step_ms(3_600_000);
    }
    let b = open();
    let p = prior(&b).await;
    assert!(
        p.admitted_until_ms > p.opened_ms && p.raised_ms >= p.opened_ms,
        "the step made the job look idle for an hour: {p:?}"
    );
    let idle = || async {
        let page = IdlePage {
            idle_for: Duration::from_secs(600),
            after: None,
            limit: 10,
        };
        b.idle(page).await.unwrap().len()
    };
    clock.advance(Duration::from_secs(300));
    assert_eq!(idle().await, 0, "forgotten by the step");
    clock.advance(Duration::from_secs(320));
    assert_eq!(idle().await, 1, "idle 620 s after the open");
    drop(b);
    // No step since: the stamps stay as they are.
    clock.advance(Duration::from_secs(5));
    let c = open();
    assert_eq!(prior(&c).await.admitted_until_ms, p.admitted_until_ms);
    drop(c);
    // After a reboot the clocks are not compared (the step is not seen).
    clock.reboot();
    clock.step_ms(3_600_000);
    let d = open();
    assert_eq!(prior(&d).await.admitted_until_ms, p.admitted_until_ms);
}

/// The next open tells a step of the wall clock whatever the time between the opens (a
/// review: a tolerance growing with it let 590 s after 7 days pass unseen), after a step
/// back and then forward while the process ran (which net out between the opens: the
/// process records how far back it went), and takes a damaged record of the last open for a
/// step (the safe side).
#[tokio::test]
async fn the_record_of_the_last_open_sees_long_gaps_steps_back_and_damage() {
    use fence_storage::clock::ManualClock;
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_700_000_000_000).with_boot();
    let open = || SledStore::open_with_clock(dir.path(), Arc::new(clock.clone())).unwrap();
    let job: JobId = "watched".parse().unwrap();
    let restamped = |store: &SledStore| {
        let (store, job) = (store.clone(), job.clone());
        async move {
            let p = store.load(&job).await.unwrap().prior.expect("stamps");
            p.admitted_until_ms > p.opened_ms
        }
    };
    // Seven days, then a step of 590 s.
    {
        let a = open();
        a.accept(&job, Generation::new(1), false).await.unwrap();
        clock.advance(Duration::from_secs(7 * 24 * 3600));
        a.accept(&job, Generation::new(2), false).await.unwrap();
        clock.advance(Duration::from_secs(1));
        clock.step_ms(590_000);
    }
    let b = open();
    assert!(
        restamped(&b).await,
        "a step of 590 s after 7 days went unseen"
    );
    // A step back an hour while it runs, a stamp, then forward an hour, then the restart.
    clock.advance(Duration::from_secs(30));
    clock.step_ms(-3_600_000);
    b.accept(&job, Generation::new(3), false).await.unwrap();
    clock.advance(Duration::from_secs(1));
    clock.step_ms(3_600_000);
    drop(b);
    let c = open();
    assert!(
        restamped(&c).await,
        "back and forward again netted out: the stamp written an hour behind looked an hour old"
    );
    drop(c);
    // No step since: taken as it is.
    clock.advance(Duration::from_secs(20));
    let d = open();
    assert!(!restamped(&d).await, "restamped without a step");
    drop(d);
    // A damaged record of the last open: taken as a step.
    clock.advance(Duration::from_secs(20));
    write_format(dir.path(), b"opened", b"short");
    let e = open();
    assert!(restamped(&e).await, "a damaged record was taken as no step");
}
