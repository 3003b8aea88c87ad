//! The PostgreSQL sink store and the SQL fence around a job's row lock, against the local database.
//!
//! A writer's open transaction holds its job's row: who waits for it, who does not, and how long.
use std::time::Instant;

use super::tests::{admin, code, fresh};
use super::*;

/// The current holder's SQL writer has checked the fence and not committed yet (its
/// transaction holds the job's row): a stale token's check through the store is answered
/// stale at once, not after the session's lock timeout as 503 store-unavailable (which told
/// the stale holder to retry, and took one of the job's connections from the current one).
#[tokio::test]
async fn a_stale_check_does_not_wait_for_the_holders_open_transaction() {
    let Some(store) = fresh().await else { return };
    let job: JobId = "held-job".parse().unwrap();
    assert_eq!(
        store.observe(&job, Generation::new(8)).await.unwrap(),
        Verdict::Accepted
    );
    let mut writer = admin().await;
    let tx = writer.transaction().await.unwrap();
    assert_eq!(
        check_in_transaction(&tx, store.tables(), &job, Generation::new(8))
            .await
            .unwrap(),
        Verdict::Accepted
    );
    let began = Instant::now();
    let stale = store.observe(&job, Generation::new(7)).await;
    let took = began.elapsed();
    assert_eq!(
        stale.unwrap(),
        Verdict::Stale {
            highest: Generation::new(8)
        }
    );
    assert!(
        took < Duration::from_millis(500),
        "waited {took:?} for the holder's lock"
    );
    tx.rollback().await.unwrap();
}

/// A writer whose `observe` answered false, or whose `require` raised ZF409, holds no lock on
/// the job's row while its transaction stays open (an aborted one is open until ROLLBACK): a
/// newer writer's `require` goes through at once.
#[tokio::test]
async fn a_refused_sql_check_leaves_the_row_unlocked() {
    let Some(store) = fresh().await else { return };
    let t = store.tables().clone();
    let job: JobId = "refused-job".parse().unwrap();
    assert_eq!(
        store.observe(&job, Generation::new(8)).await.unwrap(),
        Verdict::Accepted
    );
    // Every statement's wait is cut short, well before any lock timeout, so that a lock
    // left behind fails the test rather than hangs it.
    let (mut observer, mut requirer) = (admin().await, admin().await);
    let observed = observer.transaction().await.unwrap();
    let sql = format!("SELECT {}('refused-job', 7)", t.observe_fn);
    let accepted: bool = within("observe", observed.query_one(&sql, &[]))
        .await
        .unwrap()
        .get(0);
    assert!(!accepted, "a stale token is refused");
    let required = requirer.transaction().await.unwrap();
    let sql = format!("SELECT {}('refused-job', 7)", t.require_fn);
    let refused = within("the stale require", required.execute(&sql, &[]))
        .await
        .unwrap_err();
    assert_eq!(code(&refused), Some("ZF409"), "{refused}");
    // Both transactions are still open (the aborted one until its ROLLBACK).
    let newer = admin().await;
    let sql = format!("SELECT {}('refused-job', 9)", t.require_fn);
    within("the newer require", newer.execute(&sql, &[]))
        .await
        .unwrap();
    drop((observed, required));
    assert_eq!(store.highest(&job).await.unwrap(), Generation::new(9));
}

/// An older writer's transaction holds the job's row (it passed `require` and stalls): a
/// newer writer's `require`, in a session that would wait for ever (lock_timeout 0),
/// gets SQLSTATE 55P03 after the fence's lock timeout (2 s), and its retry passes once the
/// older transaction has ended.
#[tokio::test]
async fn a_newer_writer_waits_for_an_older_ones_transaction_at_most_the_lock_timeout() {
    let Some(store) = fresh().await else { return };
    let t = store.tables().clone();
    let mut older = admin().await;
    let held = older.transaction().await.unwrap();
    held.execute(&format!("SELECT {}('stalled-job', 5)", t.require_fn), &[])
        .await
        .unwrap();
    let newer = admin().await;
    newer
        .batch_execute("SET lock_timeout = 0; SET statement_timeout = 0")
        .await
        .unwrap();
    let sql = format!("SELECT {}('stalled-job', 6)", t.require_fn);
    let began = Instant::now();
    let waited = tokio::time::timeout(Duration::from_secs(10), newer.execute(&sql, &[]))
        .await
        .expect("the newer writer still waits after 10 s");
    let took = began.elapsed();
    let e = waited.unwrap_err();
    assert_eq!(code(&e), Some("55P03"), "{e}");
    assert!(
        took < Duration::from_millis(3_500),
        "the newer writer waited {took:?}"
    );
    held.rollback().await.unwrap();
    newer.execute(&sql, &[]).await.unwrap();
    assert_eq!(
        store
            .highest(&"stalled-job".parse().unwrap())
            .await
            .unwrap(),
        Generation::new(6)
    );
}

/// `query`'s answer, or a panic naming `what` once it has waited a second.
async fn within<T>(what: &str, query: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(1), query)
        .await
        .unwrap_or_else(|_| panic!("{what} waited a second for another writer's lock"))
}

/// A newer holder's transaction under REPEATABLE READ (or SERIALIZABLE) takes its snapshot,
/// then waits in `require` behind an older holder's open transaction at the same highest;
/// the older one writes its effect and commits. The newer one must not be accepted on its
/// snapshot, which misses that effect: it read "not done" and did the effect again (an audit
/// saw two charges under tokens 5 and 6). It now fails with 40001, and its retry, on a new
/// snapshot, sees the effect. Under READ COMMITTED it is accepted and sees the effect.
#[tokio::test]
async fn a_newer_writers_snapshot_never_misses_an_older_ones_committed_effect() {
    let Some(store) = fresh().await else { return };
    let t = store.tables().clone();
    let effects = format!("fence_test.effects_{:016x}", super::tests::rand_u64());
    let setup = admin().await;
    setup
        .batch_execute(&format!(
            "CREATE TABLE {effects} (job text, item int, token int)"
        ))
        .await
        .unwrap();
    for (level, raced) in [
        ("REPEATABLE READ", true),
        ("SERIALIZABLE", true),
        ("READ COMMITTED", false),
    ] {
        let job = format!("snapshot-{}", level.replace(' ', "-").to_lowercase());
        let require = |token: u32| format!("SELECT {}('{job}', {token})", t.require_fn);
        // The older holder's token is the job's highest already (its stamp fresh).
        setup.execute(&require(5), &[]).await.unwrap();
        let mut older = admin().await;
        let held = older.transaction().await.unwrap();
        held.execute(&require(5), &[]).await.unwrap();
        // The newer holder: its snapshot first, then the fence, which waits for the row.
        let mut newer = admin().await;
        let (sql, effects2) = (require(6), effects.clone());
        let job2 = job.clone();
        let racing = tokio::spawn(async move {
            let tx = newer.transaction().await.unwrap();
            tx.batch_execute(&format!("SET TRANSACTION ISOLATION LEVEL {level}"))
                .await
                .unwrap();
            tx.query_one("SELECT 1", &[]).await.unwrap(); // the snapshot
            tx.execute(&sql, &[]).await?;
            let done: i64 = tx
                .query_one(
                    &format!("SELECT count(*) FROM {effects2} WHERE job = $1 AND item = 101"),
                    &[&job2],
                )
                .await?
                .get(0);
            if done == 0 {
                tx.execute(
                    &format!("INSERT INTO {effects2} VALUES ($1, 101, 6)"),
                    &[&job2],
                )
                .await?;
            }
            tx.commit().await
        });
        // The newer holder's snapshot is taken and it waits for the row: seen waiting on a
        // lock (a fixed pause would let a slow start take its snapshot after the commit).
        let waiting = format!("%{}%", require(6));
        let began = Instant::now();
        loop {
            let n: i64 = setup
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE $1",
                    &[&waiting],
                )
                .await
                .unwrap()
                .get(0);
            if n > 0 {
                break;
            }
            assert!(
                began.elapsed() < Duration::from_secs(10),
                "{level}: the newer holder never waited for the row"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        held.execute(
            &format!("INSERT INTO {effects} VALUES ($1, 101, 5)"),
            &[&job],
        )
        .await
        .unwrap();
        held.commit().await.unwrap();
        let newer = racing.await.unwrap();
        if raced {
            let e = newer.expect_err(level);
            assert_eq!(code(&e), Some("40001"), "{level}: {e}");
        } else {
            newer.unwrap();
        }
        let charges: i64 = setup
            .query_one(
                &format!("SELECT count(*) FROM {effects} WHERE job = $1"),
                &[&job],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(charges, 1, "{level}: item 101 was charged {charges} times");
    }
    setup
        .batch_execute(&format!("DROP TABLE {effects}"))
        .await
        .unwrap();
}
