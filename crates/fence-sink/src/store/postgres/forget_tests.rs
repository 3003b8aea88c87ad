//! The PostgreSQL sink store forgetting idle jobs, against the local database.
//!
//! What the SQL fence then asks of writers, and what forgetting passes over.
use super::tests::{admin, code, fresh};
use super::*;

/// `job` as the store lists it among the jobs idle for a minute or more.
async fn idle_job(store: &PgStore, job: &JobId) -> IdleJob {
    let page = IdlePage {
        idle_for: Duration::from_secs(60),
        after: None,
        limit: 10,
    };
    let idle = store.idle(page).await.unwrap();
    idle.into_iter().find(|i| &i.job == job).expect("idle")
}

/// While the sinks forget idle jobs, a check without the token's lease end is refused
/// (ZF428), and one with an ended lease is stale, also for a job the sink has forgotten.
#[tokio::test]
async fn while_sinks_forget_a_writer_must_give_the_lease_end() {
    let Some(store) = fresh().await else { return };
    let t = store.tables().clone();
    let su = admin().await;
    let now: i64 = su
        .query_one(&format!("SELECT {}", fence_storage::postgres::NOW_MS), &[])
        .await
        .unwrap()
        .get(0);
    let job: JobId = "forgotten-job".parse().unwrap();
    // Forgetting off: the two-argument form works.
    let plain = su
        .query_one(&format!("SELECT {}('forgotten-job', 3)", t.observe_fn), &[])
        .await;
    assert!(plain.unwrap().get::<_, bool>(0));
    store
        .announce_forgetting(true, Duration::from_secs(5), Duration::from_secs(3600))
        .await
        .unwrap();
    let refused = su
        .query_one(&format!("SELECT {}('forgotten-job', 4)", t.require_fn), &[])
        .await
        .unwrap_err();
    assert_eq!(code(&refused), Some("ZF428"), "{refused}");
    // The job is forgotten (its row deleted); the stale holder's lease ended a minute ago.
    su.execute(
        &format!("DELETE FROM {} WHERE job = 'forgotten-job'", t.generations),
        &[],
    )
    .await
    .unwrap();
    let ended = now - 60_000;
    let stale = su
        .query_one(
            &format!("SELECT {}('forgotten-job', 2, $1)", t.require_fn),
            &[&ended],
        )
        .await
        .unwrap_err();
    assert_eq!(code(&stale), Some("ZF409"), "{stale}");
    let message = stale.as_db_error().map(|d| d.message().to_owned());
    assert!(
        message
            .as_deref()
            .is_some_and(|m| m.starts_with("expired fencing token")),
        "{message:?}"
    );
    let mut client = admin().await;
    let tx = client.transaction().await.unwrap();
    assert_eq!(
        check_in_transaction_expiring(&tx, &t, &job, Generation::new(2), ended as u64)
            .await
            .unwrap(),
        Verdict::Stale {
            highest: Generation::ZERO
        }
    );
    tx.rollback().await.unwrap();
    // A live holder's token (its lease ends in 30 s) is accepted.
    let live = su
        .query_one(
            &format!("SELECT {}('forgotten-job', 5, $1)", t.observe_fn),
            &[&(now + 30_000)],
        )
        .await
        .unwrap();
    assert!(live.get::<_, bool>(0));
    // A token claiming a lease longer than any the sinks accept (an hour here) plus the
    // skew: refused, as at the sinks, so it cannot outlive the window they forget by.
    let edge = now + 3_600_000 + 5_000;
    let too_long = su
        .query_one(
            &format!("SELECT {}('forgotten-job', 6, $1)", t.observe_fn),
            &[&(edge + 60_000)],
        )
        .await
        .unwrap_err();
    assert_eq!(code(&too_long), Some("ZF403"), "{too_long}");
    assert_eq!(store.highest(&job).await.unwrap(), Generation::new(5));
    let within = su
        .query_one(
            &format!("SELECT {}('forgotten-job', 6, $1)", t.observe_fn),
            &[&(now + 3_600_000)],
        )
        .await
        .unwrap();
    assert!(within.get::<_, bool>(0));
    // Another sink on these tables starts without forgetting (and a longer lease): the
    // check stays on, for the jobs the first one forgot, and the lease bound stays.
    store
        .announce_forgetting(
            false,
            Duration::from_secs(5),
            Duration::from_secs(24 * 3600),
        )
        .await
        .unwrap();
    let still = su
        .query_one(&format!("SELECT {}('forgotten-job', 7)", t.observe_fn), &[])
        .await
        .unwrap_err();
    assert_eq!(code(&still), Some("ZF428"), "{still}");
    let too_long = su
        .query_one(
            &format!("SELECT {}('forgotten-job', 7, $1)", t.observe_fn),
            &[&(edge + 60_000)],
        )
        .await
        .unwrap_err();
    assert_eq!(code(&too_long), Some("ZF403"), "{too_long}");
}

/// What the sinks that forget recorded is told apart from what the others did: a sink on
/// the tables must check expiry as strictly as the forgetting ones, not as the strictest of
/// all (a default proxy's 5 s skew must not become a forgetting proxy's, set at 30 s).
#[tokio::test]
async fn the_bounds_of_the_sinks_that_forget_are_kept_apart() {
    let Some(store) = fresh().await else { return };
    assert_eq!(
        store.recorded_settings().await.unwrap(),
        None,
        "nothing yet"
    );
    let (minute, day) = (Duration::from_secs(60), Duration::from_secs(24 * 3600));
    let forgetting = store
        .announce_forgetting(true, Duration::from_secs(30), day)
        .await
        .unwrap();
    let expected = SinkSettings {
        forgetting: true,
        clock_skew: Duration::from_secs(30),
        max_lease_ttl: Some(day),
    };
    assert_eq!(forgetting, expected);
    // A sink that does not forget, stricter: the SQL bounds tighten, the forgetting ones not.
    let other = store
        .announce_forgetting(false, Duration::from_secs(5), minute)
        .await
        .unwrap();
    assert_eq!(other, expected);
    assert_eq!(store.recorded_settings().await.unwrap(), Some(expected));
    // A second sink that forgets, stricter still: it counts.
    let second = store
        .announce_forgetting(true, Duration::from_secs(10), minute)
        .await
        .unwrap();
    assert_eq!(
        second,
        SinkSettings {
            forgetting: true,
            clock_skew: Duration::from_secs(10),
            max_lease_ttl: Some(minute),
        }
    );
}

/// A layer that forgets on PostgreSQL without announcing it (the library, not the proxy)
/// still switches the SQL fence's lease-end check on before it deletes a job.
#[tokio::test]
async fn forgetting_a_job_switches_the_sql_check_on() {
    let Some(store) = fresh().await else { return };
    let t = store.tables().clone();
    let su = admin().await;
    let job: JobId = "idle-job".parse().unwrap();
    assert_eq!(
        store.observe(&job, Generation::new(3)).await.unwrap(),
        Verdict::Accepted
    );
    let plain = su
        .query_one(&format!("SELECT {}('idle-job', 3)", t.observe_fn), &[])
        .await;
    assert!(plain.unwrap().get::<_, bool>(0), "not forgetting yet");
    store.shift_clock_ms(10 * 60_000);
    let idle = idle_job(&store, &job).await;
    assert!(store.forget(&idle).await.unwrap(), "forgotten");
    // A stale writer of the forgotten job cannot pass as its first.
    let refused = su
        .query_one(&format!("SELECT {}('idle-job', 2)", t.require_fn), &[])
        .await
        .unwrap_err();
    assert_eq!(code(&refused), Some("ZF428"), "{refused}");
}

/// A writer whose transaction holds an idle job's row locked (its `observe` of the current
/// token locks the row until it commits) keeps that job, and only that one: forgetting passes over it
/// and forgets the other idle jobs, instead of failing the pass at its lock timeout, pass
/// after pass, with every job kept.
#[tokio::test]
async fn a_locked_row_is_passed_over_by_forgetting() {
    let Some(store) = fresh().await else { return };
    let t = store.tables().clone();
    let (locked, other): (JobId, JobId) =
        ("locked-job".parse().unwrap(), "other-job".parse().unwrap());
    for job in [&locked, &other] {
        assert_eq!(
            store.observe(job, Generation::new(3)).await.unwrap(),
            Verdict::Accepted
        );
    }
    let mut writer = admin().await;
    let tx = writer.transaction().await.unwrap();
    let accepted: bool = tx
        .query_one(&format!("SELECT {}('locked-job', 3)", t.observe_fn), &[])
        .await
        .unwrap()
        .get(0);
    assert!(accepted, "the current token is accepted");
    store.shift_clock_ms(10 * 60_000);
    let (locked, other) = (
        idle_job(&store, &locked).await,
        idle_job(&store, &other).await,
    );
    let began = std::time::Instant::now();
    assert!(
        !store.forget(&locked).await.unwrap(),
        "forgotten under a writer's lock"
    );
    assert!(
        began.elapsed() < Duration::from_secs(1),
        "waited {:?} for the writer's lock",
        began.elapsed()
    );
    assert!(
        store.forget(&other).await.unwrap(),
        "the other job was kept"
    );
    tx.rollback().await.unwrap();
    assert!(
        store.forget(&locked).await.unwrap(),
        "kept once the lock is gone"
    );
}

/// A lease end at the very end of `bigint` (what `check_in_transaction_expiring` sends for
/// one beyond it) is refused as too long-lived (ZF403), as at the sinks, not an overflow
/// (SQLSTATE 22003, an I/O-style error to the caller); and a longest lease recorded near
/// `bigint`'s end does not overflow the bound either.
#[tokio::test]
async fn a_lease_end_at_the_end_of_bigint_is_too_long_lived_not_an_overflow() {
    let Some(store) = fresh().await else { return };
    let t = store.tables().clone();
    let su = admin().await;
    let far = su
        .query_one(
            &format!("SELECT {}('far-job', 5, $1)", t.observe_fn),
            &[&i64::MAX],
        )
        .await
        .unwrap_err();
    assert_eq!(code(&far), Some("ZF403"), "{far}");
    let mut client = admin().await;
    let tx = client.transaction().await.unwrap();
    let job: JobId = "far-job".parse().unwrap();
    let e = check_in_transaction_expiring(&tx, &t, &job, Generation::new(5), u64::MAX)
        .await
        .unwrap_err();
    let db = std::error::Error::source(&e).and_then(|s| s.downcast_ref::<tokio_postgres::Error>());
    assert_eq!(db.and_then(code), Some("ZF403"), "{e:?}");
    tx.rollback().await.unwrap();
    let longest = Duration::from_millis(u64::try_from(i64::MAX).unwrap());
    store
        .announce_forgetting(false, Duration::from_secs(5), longest)
        .await
        .unwrap();
    let now: i64 = su
        .query_one(&format!("SELECT {}", fence_storage::postgres::NOW_MS), &[])
        .await
        .unwrap()
        .get(0);
    let live = su
        .query_one(
            &format!("SELECT {}('far-job', 5, $1)", t.observe_fn),
            &[&(now + 30_000)],
        )
        .await
        .unwrap();
    assert!(live.get::<_, bool>(0));
}

/// The first time forgetting is switched on, a stale writer's two-argument check may have
/// read the setting (off) just before, and the job be forgotten before it writes: its token
/// must not pass as the forgotten job's first. The writer is held between the two by a lock
/// on the table, taken by the transaction that switches forgetting on and deletes the job.
#[tokio::test]
async fn forgetting_switched_on_during_a_plain_check_refuses_it() {
    let Some(store) = fresh().await else { return };
    let t = store.tables().clone();
    let job: JobId = "racing-job".parse().unwrap();
    assert_eq!(
        store.observe(&job, Generation::new(5)).await.unwrap(),
        Verdict::Accepted
    );
    let mut switcher = admin().await;
    let tx = switcher.transaction().await.unwrap();
    let generations = &t.generations;
    tx.batch_execute(&format!(
        "LOCK TABLE {generations} IN ACCESS EXCLUSIVE MODE"
    ))
    .await
    .unwrap();
    let writer = admin().await;
    let pid: i32 = writer
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let sql = format!("SELECT {}('racing-job', 2)", t.observe_fn);
    let check = tokio::spawn(async move {
        let row = writer.query_one(&sql, &[]).await;
        row.map(|r| r.get::<_, bool>(0))
    });
    // Until the writer has read the setting and waits for the table.
    let su = admin().await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while su
        .query_opt(
            "SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock'",
            &[&pid],
        )
        .await
        .unwrap()
        .is_none()
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the writer never waited"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tx.batch_execute(&format!(
        "INSERT INTO {} (one, forgetting, clock_skew_ms) VALUES (true, true, 5000)
           ON CONFLICT (one) DO UPDATE SET forgetting = true;
         DELETE FROM {generations} WHERE job = 'racing-job'",
        t.settings
    ))
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(10), check)
        .await
        .expect("the writer answers")
        .unwrap();
    assert_eq!(
        answer.as_ref().err().and_then(code),
        Some("ZF428"),
        "{answer:?}"
    );
    assert_eq!(
        store.highest(&job).await.unwrap(),
        Generation::ZERO,
        "the stale token was written as the forgotten job's first"
    );
}
