//! The PostgreSQL sink store against the local database: conformance and its own cases.
use super::*;

async fn fresh() -> Option<PgStore> {
    let url = fence_storage::postgres::test_database_url();
    let tables = PgTables::new("fence_test", &format!("sink_{:016x}", rand_u64())).unwrap();
    let store = PgStore::connect(&url, tables).await.unwrap();
    store.migrate().await.unwrap();
    Some(store)
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now())
}

crate::sink_store_conformance!(|| async {
    let store = fresh().await?;
    let shifter = store.clone();
    let advance: crate::conformance::Advance = Box::new(move |ms| shifter.shift_clock_ms(ms));
    Some((store, advance))
});

/// The effect and the fence commit or roll back together.
#[tokio::test]
async fn in_transaction_check_rolls_back_with_the_effect() {
    let Some(store) = fresh().await else { return };
    let url = fence_storage::postgres::test_database_url();
    let effects = format!("fence_test.effects_{:016x}", rand_u64());
    let (mut client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client
        .batch_execute(&format!("CREATE TABLE {effects} (job text, token bigint)"))
        .await
        .unwrap();
    let job: JobId = "tx-job".parse().unwrap();
    assert_eq!(
        store.observe(&job, Generation::new(8)).await.unwrap(),
        Verdict::Accepted
    );

    // A stale token: the handler rolls back its effect.
    let tx = client.transaction().await.unwrap();
    assert_eq!(
        check_in_transaction(&tx, store.tables(), &job, Generation::new(7))
            .await
            .unwrap(),
        Verdict::Stale {
            highest: Generation::new(8)
        }
    );
    tx.rollback().await.unwrap();

    // A crash mid-transaction (the connection is dropped): neither the effect nor the fence advance stays.
    {
        let (mut doomed, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        let conn = tokio::spawn(conn);
        let tx = doomed.transaction().await.unwrap();
        assert_eq!(
            check_in_transaction(&tx, store.tables(), &job, Generation::new(9))
                .await
                .unwrap(),
            Verdict::Accepted
        );
        tx.execute(&format!("INSERT INTO {effects} VALUES ('tx-job', 9)"), &[])
            .await
            .unwrap();
        std::mem::forget(tx); // no commit, no rollback: the process "dies"
        drop(doomed);
        conn.abort();
    }
    // The server notices the closed connection and rolls back; wait for it.
    let mut highest = Generation::ZERO;
    for _ in 0..100 {
        highest = store.highest(&job).await.unwrap();
        let count: i64 = client
            .query_one(&format!("SELECT count(*) FROM {effects}"), &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(
            count, 0,
            "the effect of a crashed transaction is never visible"
        );
        if highest == Generation::new(8) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(highest, Generation::new(8));
    assert_eq!(
        store.observe(&job, Generation::new(9)).await.unwrap(),
        Verdict::Accepted,
        "9 was never taken"
    );

    // A committed transaction moves both.
    let tx = client.transaction().await.unwrap();
    assert_eq!(
        check_in_transaction(&tx, store.tables(), &job, Generation::new(10))
            .await
            .unwrap(),
        Verdict::Accepted
    );
    tx.execute(&format!("INSERT INTO {effects} VALUES ('tx-job', 10)"), &[])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        store.observe(&job, Generation::new(9)).await.unwrap(),
        Verdict::Stale {
            highest: Generation::new(10)
        }
    );
}

/// Two layers on one database enforce one fence.
#[tokio::test]
async fn two_sinks_share_one_fence() {
    let Some(a) = fresh().await else { return };
    let b = PgStore::connect(
        &fence_storage::postgres::test_database_url(),
        a.tables().clone(),
    )
    .await
    .unwrap();
    let job: JobId = "shared".parse().unwrap();
    assert_eq!(
        a.observe(&job, Generation::new(3)).await.unwrap(),
        Verdict::Accepted
    );
    assert_eq!(
        b.observe(&job, Generation::new(3)).await.unwrap(),
        Verdict::Accepted
    );
    assert_eq!(
        b.observe(&job, Generation::new(4)).await.unwrap(),
        Verdict::Accepted
    );
    assert_eq!(
        a.observe(&job, Generation::new(3)).await.unwrap(),
        Verdict::Stale {
            highest: Generation::new(4)
        }
    );
}

/// The SQL fence (contract section 11): `observe` and `require` decide on the same table as
/// the store, so a token the layer accepted makes a lower one stale for a writer in SQL, and
/// the other way round; bad input is SQLSTATE 22023, a stale token ZF409 with the highest.
#[tokio::test]
async fn the_sql_fence_is_the_same_fence() {
    let Some(store) = fresh().await else { return };
    let (observe, require) = (&store.tables.observe_fn, &store.tables.require_fn);
    let url = fence_storage::postgres::test_database_url();
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let sql_observe = |job: &'static str, token: &'static str| {
        let (client, sql) = (&client, format!("SELECT {observe}($1, $2::text::numeric)"));
        async move {
            client
                .query_one(&sql, &[&job, &token])
                .await
                .map(|row| row.get::<_, bool>(0))
        }
    };
    let job: JobId = "sql-job".parse().unwrap();
    assert_eq!(
        store.observe(&job, Generation::new(7)).await.unwrap(),
        Verdict::Accepted
    );
    assert!(!sql_observe("sql-job", "6").await.unwrap(), "stale in SQL");
    assert!(sql_observe("sql-job", "7").await.unwrap(), "current in SQL");
    assert!(sql_observe("sql-job", "9").await.unwrap(), "raised in SQL");
    assert_eq!(
        store.observe(&job, Generation::new(8)).await.unwrap(),
        Verdict::Stale {
            highest: Generation::new(9)
        },
        "the layer sees what SQL raised"
    );
    let stale = client
        .execute(&format!("SELECT {require}('sql-job', 8)"), &[])
        .await
        .unwrap_err();
    let db = stale.as_db_error().expect("a database error");
    assert_eq!(db.code().code(), "ZF409");
    assert_eq!(
        db.message(),
        "stale fencing token: job sql-job, token 8, highest 9"
    );
    client
        .execute(&format!("SELECT {require}('sql-job', 9)"), &[])
        .await
        .unwrap();
    for (bad_job, bad_token) in [
        ("", "1"),
        ("a b", "1"),
        ("sql-job", "-1"),
        ("sql-job", "1.5"),
        ("sql-job", "18446744073709551616"),
    ] {
        let e = sql_observe(bad_job, bad_token).await.unwrap_err();
        assert_eq!(
            e.as_db_error().map(|d| d.code().code()),
            Some("22023"),
            "{bad_job:?} {bad_token}: {e}"
        );
    }
    assert_eq!(
        store.highest(&job).await.unwrap(),
        Generation::new(9),
        "bad input changed nothing"
    );
}

#[test]
fn the_default_tables_have_the_contract_function_names() {
    let t = PgTables::default();
    assert_eq!(
        (t.observe_fn.as_str(), t.require_fn.as_str()),
        ("fence.observe", "fence.require")
    );
    let other = PgTables::new("fence", "billing").unwrap();
    assert_eq!(other.observe_fn, "fence.billing_observe");
}
