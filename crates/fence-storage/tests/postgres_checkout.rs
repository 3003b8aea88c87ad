//! A pooled connection whose statement was abandoned mid-way is not handed to the next user
//! (issue 31): it may still wait on a row lock, and the next request would wait behind it.
#![cfg(feature = "postgres")]

use std::time::{Duration, Instant};

use fence_storage::postgres::{Checkout, connect_pool, test_database_url};

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
    let started = Instant::now();
    let next = Checkout::of(&pool).await.unwrap();
    next.query_one("SELECT 1", &[]).await.unwrap();
    next.done();
    let took = started.elapsed();
    tx.rollback().await.unwrap();
    let cleanup = Checkout::of(&pool).await.unwrap();
    let _ = cleanup.batch_execute(&format!("DROP TABLE {table}")).await;
    cleanup.done();
    assert!(
        took < Duration::from_millis(1_000),
        "the next user waited {took:?} behind an abandoned statement"
    );
}
