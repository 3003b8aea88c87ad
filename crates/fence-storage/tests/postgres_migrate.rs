//! A restart's migration does not wait behind writers (found by the 30-minute SQL soak of
//! issue 30: a proxy restarted while SQL writers held their transactions open failed to
//! start, "canceling statement due to lock timeout"): DDL already applied is not run again,
//! and an upgrade's DDL that meets a lock timeout is retried.
#![cfg(feature = "postgres")]

use std::time::{Duration, Instant};

use fence_storage::postgres::{Ident, connect_pool, migrate, test_database_url};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_already_applied_takes_no_table_lock_and_an_upgrade_waits_its_turn() {
    let url = test_database_url();
    let pool = connect_pool(&url).unwrap();
    let name = format!("migrate_{}", std::process::id());
    let schema = Ident::new("schema", &name).unwrap();
    let ddl = format!(
        "CREATE TABLE IF NOT EXISTS {schema}.t (k int PRIMARY KEY);
         ALTER TABLE {schema}.t ADD COLUMN IF NOT EXISTS x int;"
    );
    migrate(&pool, &schema, &ddl).await.unwrap();
    // A writer's open transaction holds the table (ROW EXCLUSIVE): ALTER TABLE would wait
    // for it until the fence's lock timeout (2 s).
    let (mut writer, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let tx = writer.transaction().await.unwrap();
    tx.execute(&format!("INSERT INTO {schema}.t (k) VALUES (1)"), &[])
        .await
        .unwrap();
    let started = Instant::now();
    migrate(&pool, &schema, &ddl)
        .await
        .expect("the same DDL again is a no-op, whatever writers hold");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "the restart's migration waited {:?} behind the writer",
        started.elapsed()
    );
    // An upgrade needs the lock: it waits its turn (retried past lock timeouts) and is
    // applied once the writer commits.
    let upgrade = format!("{ddl}\nALTER TABLE {schema}.t ADD COLUMN IF NOT EXISTS y int;");
    let upgrading = tokio::spawn({
        let (pool, schema) = (pool.clone(), schema.clone());
        async move { migrate(&pool, &schema, &upgrade).await }
    });
    tokio::time::sleep(Duration::from_millis(2_500)).await; // past one lock timeout
    tx.commit().await.unwrap();
    upgrading
        .await
        .unwrap()
        .expect("the upgrade ran once the writer let go");
    let client = pool.get().await.unwrap();
    client
        .execute(&format!("SELECT y FROM {schema}.t"), &[])
        .await
        .expect("the upgrade's column exists");
    client
        .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .await
        .unwrap();
}
