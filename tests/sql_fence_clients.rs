//! The SQL fence from other languages (contract section 11): `examples/python/sql_writer.py`
//! (psycopg 3) and `examples/go/sql_writer.go` (pgx v4) against the real database, on the
//! table the sink's PostgreSQL store uses. A stale writer's transaction is refused after a
//! newer generation committed, and a newer writer waits for an older one's open transaction.
//!
//! Needs `DATABASE_URL`, `python3` with psycopg (`pip install "psycopg[binary]"`), and Go with
//! pgx from Debian (`apt-get install golang-go golang-github-jackc-pgx-v4-dev`); `.ci/run`
//! installs them. Without them these tests fail, saying what is missing.

use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
    time::{Duration, Instant},
};

use fence_sink::{
    GenerationStore,
    postgres::{PgStore, PgTables},
};

/// The test database, as every PostgreSQL test finds it.
fn database_url() -> String {
    fence_storage::postgres::test_database_url()
}

/// A fresh schema with the fence (migrated by the sink's store) and a `charges` table.
async fn setup(name: &str) -> (PgStore, String, tokio_postgres::Client) {
    let url = database_url();
    use std::hash::{BuildHasher, RandomState};
    let schema = format!(
        "sqlclients_{name}_{:08x}",
        RandomState::new().hash_one(std::time::SystemTime::now()) & 0xffff_ffff
    );
    let store = PgStore::connect(&url, PgTables::new(&schema, "sink").unwrap())
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    client
        .batch_execute(&format!(
            "CREATE TABLE {schema}.charges (id bigserial PRIMARY KEY, job text NOT NULL,
               token bigint NOT NULL, amount bigint NOT NULL)"
        ))
        .await
        .unwrap();
    (store, schema, client)
}

async fn charged(client: &tokio_postgres::Client, schema: &str, job: &str) -> Vec<i64> {
    client
        .query(
            &format!("SELECT token FROM {schema}.charges WHERE job = $1 ORDER BY id"),
            &[&job],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

async fn drop_schema(client: &tokio_postgres::Client, schema: &str) {
    client
        .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .await
        .unwrap();
}

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Runs `writer` (a command line) with DSN SCHEMA JOB TOKEN AMOUNT and extra arguments.
fn write(
    writer: &[String],
    schema: &str,
    job: &str,
    token: impl std::fmt::Display,
    extra: &[&str],
) -> Output {
    let mut cmd = Command::new(&writer[0]);
    cmd.args(&writer[1..])
        .args([&database_url(), schema, job, &token.to_string(), "10"])
        .args(extra);
    cmd.output()
        .unwrap_or_else(|e| panic!("{writer:?} cannot start: {e}"))
}

fn python_writer() -> Vec<String> {
    let check = Command::new("python3")
        .args(["-c", "import psycopg"])
        .output();
    assert!(
        check.is_ok_and(|o| o.status.success()),
        "python3 with psycopg 3 is needed: pip install \"psycopg[binary]\""
    );
    let script = root().join("examples/python/sql_writer.py");
    vec!["python3".into(), script.display().to_string()]
}

/// Builds the Go example with Debian's Go and pgx (GOPATH mode: no module download).
fn go_writer(dir: &Path) -> Vec<String> {
    let binary: PathBuf = dir.join("sql_writer");
    let out = Command::new("go")
        .args(["build", "-o"])
        .arg(&binary)
        .arg(root().join("examples/go/sql_writer.go"))
        .env("GO111MODULE", "off")
        .env("GOPATH", "/usr/share/gocode")
        .env("GOCACHE", dir.join("gocache"))
        .output()
        .expect("Go is needed: apt-get install golang-go golang-github-jackc-pgx-v4-dev");
    assert!(
        out.status.success(),
        "go build failed (is golang-github-jackc-pgx-v4-dev installed?): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    vec![binary.display().to_string()]
}

/// Writes at 7 and 8, then a stale 7: refused (exit 3), nothing written; the sink's store
/// sees what the SQL writers did (one fence).
async fn stale_writer_is_refused(writer: &[String], name: &str) {
    let (store, schema, client) = setup(name).await;
    let job = format!("invoice-{name}");
    for token in [7, 8] {
        let out = write(writer, &schema, &job, token, &[]);
        assert_eq!(out.status.code(), Some(0), "token {token}: {out:?}");
    }
    let highest = store.highest(&job.parse().unwrap()).await.unwrap();
    assert_eq!(
        highest.get(),
        8,
        "the proxy's store reads the SQL writers' fence"
    );
    let out = write(writer, &schema, &job, 7, &[]);
    assert_eq!(
        out.status.code(),
        Some(3),
        "a stale writer is refused: {out:?}"
    );
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains(&format!(
            "stale fencing token: job {job}, token 7, highest 8"
        )),
        "{said}"
    );
    assert_eq!(
        charged(&client, &schema, &job).await,
        [7, 8],
        "nothing stale written"
    );

    // The sinks on the fence forget idle jobs: a plain token is refused (the writer cannot
    // be told from a stale one of a forgotten job), a signed one counts with its lease end.
    store
        .announce_forgetting(true, Duration::from_secs(5), Duration::from_secs(3600))
        .await
        .unwrap();
    let out = write(writer, &schema, &job, 9, &[]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(1),
        "a plain token while forgetting: {said}"
    );
    assert!(said.contains("forget idle jobs"), "{said}");
    let signature = "A".repeat(86); // the database does not verify it; the sinks do
    let ms = |d: std::time::Duration| d.as_millis() as u64;
    let now = ms(std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap());
    let ended = format!("9.{}.{signature}", now - 60_000);
    let out = write(writer, &schema, &job, &ended, &[]);
    assert_eq!(
        out.status.code(),
        Some(3),
        "an ended lease is stale: {out:?}"
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("expired fencing token"));
    let live = format!("9.{}.{signature}", now + 30_000);
    let out = write(writer, &schema, &job, &live, &[]);
    assert_eq!(out.status.code(), Some(0), "a live signed token: {out:?}");
    assert_eq!(charged(&client, &schema, &job).await, [7, 8, 9]);
    drop_schema(&client, &schema).await;
}

#[tokio::test]
async fn python_writers_share_the_fence_and_a_stale_one_is_refused() {
    let writer = python_writer();
    stale_writer_is_refused(&writer, "py").await;

    newer_waits_for_older(&writer, &writer, "pyhold").await;
}

/// A writer whose transaction holds the fence row open (`older` checked 9, then pauses 3 s
/// before its insert): the newer writer (10) waits for its commit, so the effects land in
/// order. Longer than the fence's 2 s lock timeout: the newer writer's first attempt gets
/// 55P03 and the writer asks again (without that retry it exits 1).
async fn newer_waits_for_older(older_writer: &[String], newer_writer: &[String], tag: &str) {
    let (_store, schema, client) = setup(tag).await;
    let (older, newer) = {
        let (w, s) = (older_writer.to_vec(), schema.clone());
        let older = std::thread::spawn(move || write(&w, &s, "held", 9, &["3"]));
        // Until the older writer holds the row: its transaction idles after `require`.
        let holding = format!(
            "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction' \
             AND query LIKE '%{schema}.require%'"
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while client
            .query_one(&holding, &[])
            .await
            .unwrap()
            .get::<_, i64>(0)
            == 0
        {
            assert!(
                Instant::now() < deadline,
                "the older writer never held the row"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let started = Instant::now();
        let newer = write(newer_writer, &schema, "held", 10, &[]);
        assert!(
            started.elapsed() >= Duration::from_millis(2_000),
            "the newer writer did not wait for the older one's transaction: {:?}",
            started.elapsed()
        );
        (older.join().unwrap(), newer)
    };
    assert_eq!(
        (older.status.code(), newer.status.code()),
        (Some(0), Some(0))
    );
    assert_eq!(charged(&client, &schema, "held").await, [9, 10]);
    let stale = write(newer_writer, &schema, "held", 9, &[]);
    assert_eq!(stale.status.code(), Some(3));
    drop_schema(&client, &schema).await;
}

#[tokio::test]
async fn go_writers_share_the_fence_and_a_stale_one_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let writer = go_writer(dir.path());
    stale_writer_is_refused(&writer, "go").await;
    // The older writer that holds the row is Python's (the Go writer takes no pause): the
    // Go writer waits past the lock timeout, and asks again on 55P03.
    newer_waits_for_older(&python_writer(), &writer, "gohold").await;
}
