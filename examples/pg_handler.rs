//! A handler that owns a PostgreSQL database and closes the last crash window: its effect
//! and the fence advance commit (or roll back) in one transaction.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1/test cargo run --example pg_handler
//! ```
//!
//! Without it, a sink that applies an effect and then records the token can crash in
//! between; with `check_in_transaction`, the database sees both or neither.

use fence_core::{Generation, JobId};
use fence_sink::{
    Verdict,
    postgres::{PgStore, PgTables, check_in_transaction},
};
use tokio_postgres::NoTls;

/// Charges `amount` for `job` under `token`, exactly when the token is not stale.
async fn charge(
    client: &mut tokio_postgres::Client,
    tables: &PgTables,
    job: &JobId,
    token: u64,
    amount: i64,
) -> Result<String, Box<dyn std::error::Error>> {
    let tx = client.transaction().await?;
    match check_in_transaction(&tx, tables, job, Generation::new(token)).await? {
        Verdict::Accepted => {
            tx.execute(
                "INSERT INTO fence_example.charges (job, token, amount) VALUES ($1, $2, $3)",
                &[&job.as_str(), &i64::try_from(token)?, &amount],
            )
            .await?;
            tx.commit().await?; // the charge and the fence commit together
            Ok(format!("token {token}: charged {amount}"))
        }
        Verdict::Stale { highest } => {
            tx.rollback().await?;
            Ok(format!(
                "token {token}: refused, generation {highest} has already written"
            ))
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL")
        .map_err(|_| "set DATABASE_URL, e.g. postgres://postgres@127.0.0.1/test")?;
    let tables = PgTables::new("fence_example", "sink")?;
    PgStore::connect(&url, tables.clone())
        .await?
        .migrate()
        .await?; // creates the fence tables
    let (mut client, connection) = tokio_postgres::connect(&url, NoTls).await?;
    tokio::spawn(connection);
    client
        .batch_execute("CREATE TABLE IF NOT EXISTS fence_example.charges (job text, token bigint, amount bigint)")
        .await?;

    let job: JobId = format!("invoice-{}", std::process::id()).parse()?;
    println!("{}", charge(&mut client, &tables, &job, 7, 10).await?); // worker A
    println!("{}", charge(&mut client, &tables, &job, 8, 10).await?); // worker B, after A's lease expired
    println!("{}", charge(&mut client, &tables, &job, 7, 10).await?); // A again, late: refused
    let rows = client
        .query(
            "SELECT token, amount FROM fence_example.charges WHERE job = $1 ORDER BY token",
            &[&job.as_str()],
        )
        .await?;
    let tokens: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
    println!("charges of {job}: tokens {tokens:?}");
    assert_eq!(tokens, [7, 8], "the late charge under token 7 never landed");
    Ok(())
}
