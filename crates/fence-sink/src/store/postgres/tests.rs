//! The PostgreSQL sink store against the local database: conformance and its own cases.
use super::*;

pub(super) async fn fresh() -> Option<PgStore> {
    let url = fence_storage::postgres::test_database_url();
    leftovers_dropped(&url).await;
    let tables = PgTables::new("fence_test", &format!("sink_{:016x}", rand_u64())).unwrap();
    let store = PgStore::connect(&url, tables).await.unwrap();
    store.migrate().await.unwrap();
    Some(store)
}

/// What earlier runs of these tests left in `fence_test`, dropped once per run before any
/// test starts.
async fn leftovers_dropped(url: &str) {
    static ONCE: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    ONCE.get_or_init(|| {
        fence_storage::postgres::drop_test_tables(url, &["sink\\_%", "effects\\_%"])
    })
    .await;
}

pub(super) fn rand_u64() -> u64 {
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
        ("sql-job", "0"),
        ("never-seen", "0"),
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
    // The forms with a lease end check the input first too: token 0 with a lease that ended
    // long ago is malformed, not "stale".
    let e = client
        .query_one(&format!("SELECT {observe}('sql-job', 0, 0)"), &[])
        .await
        .unwrap_err();
    assert_eq!(
        e.as_db_error().map(|d| d.code().code()),
        Some("22023"),
        "{e}"
    );
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

/// A session on the test database as a superuser (to make and drop roles).
pub(super) async fn admin() -> tokio_postgres::Client {
    let url = fence_storage::postgres::test_database_url();
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client
}

pub(super) fn code(e: &tokio_postgres::Error) -> Option<&str> {
    e.as_db_error().map(|d| d.code().code())
}

/// The SQL functions are the boundary: a writer role granted what docs/protocol.md section
/// 11 lists (USAGE on the schema, EXECUTE on observe and require) calls the fence, and can
/// neither write the table (to lower a job) nor call the shared decision directly. Roles
/// are cluster-wide: this one is named per run and dropped.
#[tokio::test]
async fn a_writer_role_can_call_the_fence_but_not_lower_it() {
    let Some(store) = fresh().await else { return };
    let t = store.tables().clone();
    let job: JobId = "role-job".parse().unwrap();
    assert_eq!(
        store.observe(&job, Generation::new(6)).await.unwrap(),
        Verdict::Accepted
    );
    let role = format!("fence_writer_{:08x}", rand_u64() & 0xffff_ffff);
    let su = admin().await;
    su.batch_execute(&format!(
        "CREATE ROLE {role} NOLOGIN;
         GRANT USAGE ON SCHEMA {schema} TO {role};
         GRANT EXECUTE ON FUNCTION {o}(text, numeric), {o}(text, numeric, bigint),
           {r}(text, numeric), {r}(text, numeric, bigint) TO {role};",
        schema = t.schema,
        o = t.observe_fn,
        r = t.require_fn
    ))
    .await
    .unwrap();
    let outcome = async {
        su.batch_execute(&format!("SET ROLE {role}")).await.unwrap();
        let lowered = su
            .execute(
                &format!(
                    "UPDATE {} SET highest = 1 WHERE job = 'role-job'",
                    t.generations
                ),
                &[],
            )
            .await;
        let direct = su
            .query_one(&format!("SELECT {}('role-job', 99)", t.accept_fn), &[])
            .await;
        let stale = su
            .query_one(&format!("SELECT {}('role-job', 5)", t.require_fn), &[])
            .await;
        let newer = su
            .query_one(&format!("SELECT {}('role-job', 7)", t.observe_fn), &[])
            .await;
        su.batch_execute("RESET ROLE").await.unwrap();
        (lowered, direct, stale, newer)
    }
    .await;
    su.batch_execute(&format!("DROP OWNED BY {role}; DROP ROLE {role}"))
        .await
        .unwrap();
    let (lowered, direct, stale, newer) = outcome;
    assert_eq!(
        code(&lowered.unwrap_err()),
        Some("42501"),
        "the table is writable"
    );
    assert_eq!(
        code(&direct.unwrap_err()),
        Some("42501"),
        "accept is callable"
    );
    assert_eq!(code(&stale.unwrap_err()), Some("ZF409"));
    assert!(newer.unwrap().get::<_, bool>(0));
    assert_eq!(store.highest(&job).await.unwrap(), Generation::new(7));
}

/// An older generation's in-flight record is taken over by a newer one only once its attempt
/// can no longer be running anywhere: `settled_after` from when it began.
#[tokio::test]
async fn a_newer_generation_takes_a_record_over_once_the_older_attempt_has_settled() {
    use crate::store::{Attempt, Begin, Fingerprint, IdempotencyStore};
    let Some(store) = fresh().await else { return };
    let job: JobId = "step-job".parse().unwrap();
    let key = fence_core::headers::IdempotencyKey::from_bytes(b"step").unwrap();
    let fingerprint = Fingerprint::of(&http::Method::POST, "/", b"charge");
    let other = Fingerprint::of(
        &http::Method::POST,
        "/",
        b"charge, as the newer holder says it",
    );
    let attempt = |id: u64, generation: u64, fingerprint, settled_s| Attempt {
        job: &job,
        key: &key,
        fingerprint,
        id,
        generation: Generation::new(generation),
        settled_after: Duration::from_secs(settled_s),
    };
    let in_flight = Duration::from_secs(300);
    // Begun by a process whose requests may run for 60 s.
    assert_eq!(
        store
            .begin(attempt(11, 1, &fingerprint, 60), in_flight)
            .await
            .unwrap(),
        Begin::Started
    );
    store.shift_clock_ms(59_000);
    // A process that settles at once, asking with another body: it still waits, on the
    // beginner's settings, and is not told the key was used for another request.
    for fp in [&fingerprint, &other] {
        assert_eq!(
            store.begin(attempt(12, 2, fp, 0), in_flight).await.unwrap(),
            Begin::InFlight,
            "taken over while the older attempt may still run"
        );
    }
    store.shift_clock_ms(1_000);
    assert_eq!(
        store
            .begin(attempt(13, 2, &other, 0), in_flight)
            .await
            .unwrap(),
        Begin::Started,
        "not taken over once the older attempt has settled"
    );
}

/// Expired idempotency records are purged in batches through an index on their expiry, so a
/// table grown to millions of them is purged a batch per statement, each well within the
/// statement timeout, rather than by one statement that times out and purges nothing.
#[tokio::test]
async fn expired_records_are_purged_in_batches_through_an_index() {
    let Some(store) = fresh().await else { return };
    let url = fence_storage::postgres::test_database_url();
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let table = &store.tables().idempotency;
    client
        .batch_execute(&format!(
            "INSERT INTO {table} (job, key, fingerprint, in_flight, record, live_until_ms) \
             SELECT 'job', 'k' || n, '\\x00', false, '\\x00', 1 FROM generate_series(1, 2500) n; \
             INSERT INTO {table} (job, key, fingerprint, in_flight, record, live_until_ms) \
             VALUES ('job', 'live', '\\x00', false, '\\x00', 9223372036854775807)"
        ))
        .await
        .unwrap();
    // More than two batches: the purge goes on until a batch comes back short.
    assert_eq!(store.purge_expired().await.unwrap(), 2500);
    let left: i64 = client
        .query_one(&format!("SELECT count(*) FROM {table}"), &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 1, "the live record stays");
    // The index is built in the background, by the first purge.
    let (schema, name) = table.split_once('.').unwrap();
    let started = std::time::Instant::now();
    loop {
        let indexed: i64 = client
            .query_one(
                "SELECT count(*) FROM pg_indexes x JOIN pg_class c ON c.relname = x.indexname \
                 JOIN pg_index i ON i.indexrelid = c.oid WHERE x.schemaname = $1 \
                 AND x.tablename = $2 AND x.indexdef LIKE '%(live_until_ms)%' AND i.indisvalid",
                &[&schema, &name],
            )
            .await
            .unwrap()
            .get(0);
        if indexed == 1 {
            break;
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "no valid index on live_until_ms 10 s after the first purge"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // Known to be there: the next purge neither builds nor waits.
    assert_eq!(store.purge_expired().await.unwrap(), 0);
}
