//! A pooled connection whose statement was abandoned mid-way is not handed to the next user
//! (issue 31): it may still wait on a row lock, and the next request would wait behind it.
#![cfg(feature = "postgres")]

use std::time::{Duration, Instant};

use fence_storage::postgres::{
    Checkout, SESSION_IDLE_IN_TRANSACTION_TIMEOUT, connect_pool, test_database_url,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_statement_does_not_hold_up_the_next_user_of_the_pool() {
    let url = test_database_url();
    let pool = connect_pool(&url).unwrap();
    let setup = Checkout::of(&pool).await.unwrap();
    let table = format!("checkout_{}", std::process::id());
    setup
        .batch_execute(&format!(
            "CREATE TABLE IF NOT EXISTS {table} (k int PRIMARY KEY); INSERT INTO {table} VALUES (1) ON CONFLICT DO NOTHING"
        ))
        .await
        .unwrap();
    setup.done();
    // Another session holds the row.
    let (mut holder, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let tx = holder.transaction().await.unwrap();
    tx.execute(
        &format!("SELECT k FROM {table} WHERE k = 1 FOR UPDATE"),
        &[],
    )
    .await
    .unwrap();
    // A request that waits on the row through the pool, and goes away after 200 ms.
    let sent = Instant::now();
    let waiting = async {
        let client = Checkout::of(&pool).await.unwrap();
        let r = client
            .query(
                &format!("SELECT k FROM {table} WHERE k = 1 FOR UPDATE"),
                &[],
            )
            .await;
        client.done();
        r
    };
    assert!(
        tokio::time::timeout(Duration::from_millis(200), waiting)
            .await
            .is_err(),
        "the statement should still be waiting on the lock"
    );
    // The next user of the pool is answered at once, not after the lock timeout (2 s).
    // Timed from when the abandoned statement was sent: one queued behind it on its
    // connection cannot be answered sooner than its lock timeout from then, whatever the
    // load, while a correct pool leaves 1.6 s for a fresh connection on a loaded machine.
    let started = Instant::now();
    let next = Checkout::of(&pool).await.unwrap();
    next.query_one("SELECT 1", &[]).await.unwrap();
    next.done();
    let (took, since_sent) = (started.elapsed(), sent.elapsed());
    tx.rollback().await.unwrap();
    let cleanup = Checkout::of(&pool).await.unwrap();
    let _ = cleanup.batch_execute(&format!("DROP TABLE {table}")).await;
    cleanup.done();
    assert!(
        since_sent < Duration::from_millis(1_800),
        "the next user waited {took:?} behind an abandoned statement \
         (answered {since_sent:?} after it was sent, with a 2 s lock timeout)"
    );
}

/// A fence session that stalls inside a transaction (its process stopped, say, holding a
/// semaphore's slot rows or the floor row) is ended by the database after
/// `SESSION_IDLE_IN_TRANSACTION_TIMEOUT`, and its row locks go with it: another session takes
/// the row a moment later. Before, the transaction stayed open until TCP gave up (hours).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_idle_in_a_transaction_is_ended_and_its_locks_freed() {
    let url = test_database_url();
    let pool = connect_pool(&url).unwrap();
    let table = format!("idle_tx_{}", std::process::id());
    let setup = Checkout::of(&pool).await.unwrap();
    setup
        .batch_execute(&format!(
            "CREATE TABLE IF NOT EXISTS {table} (k int PRIMARY KEY); INSERT INTO {table} VALUES (1) ON CONFLICT DO NOTHING"
        ))
        .await
        .unwrap();
    setup.done();
    let lock = format!("SELECT k FROM {table} WHERE k = 1 FOR UPDATE NOWAIT");
    let mut stalled = Checkout::of(&pool).await.unwrap();
    let tx = stalled.transaction().await.unwrap();
    tx.execute(&lock, &[]).await.unwrap();
    // Held while the transaction is open.
    let other = Checkout::of(&pool).await.unwrap();
    assert!(
        other.execute(&lock, &[]).await.is_err(),
        "the row is locked"
    );
    other.done();
    // The stalled session says nothing for longer than the timeout.
    tokio::time::sleep(SESSION_IDLE_IN_TRANSACTION_TIMEOUT + Duration::from_millis(1_500)).await;
    let other = Checkout::of(&pool).await.unwrap();
    let took = other.execute(&lock, &[]).await;
    other.done();
    let ended = tx.execute("SELECT 1", &[]).await;
    drop(tx);
    drop(stalled);
    let cleanup = Checkout::of(&pool).await.unwrap();
    let _ = cleanup.batch_execute(&format!("DROP TABLE {table}")).await;
    cleanup.done();
    assert!(
        took.is_ok(),
        "the stalled session still holds the row: {took:?}"
    );
    assert!(ended.is_err(), "the stalled session was not ended");
}
