//! A load driver for lease stores: N concurrent clients, each on a job of its own, doing
//! claim+release pairs or renewals for a fixed time; prints operations per second.
//!
//! ```text
//! cargo run --release --example lease_load -- sled 8 renew 5
//! cargo run --release --example lease_load -- postgres://postgres@127.0.0.1/test 8 claim 5
//! ```
//! Used by `bench/lease_load.sh`.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use fence_core::{JobId, Owner};
use fence_lease::{ClaimOutcome, LeaseStore, PgLeaseStore, PgTable, SledLeaseStore, Ttl};

async fn drive<S: LeaseStore>(store: Arc<S>, clients: usize, op: &str, secs: u64) -> f64 {
    let until = Instant::now() + Duration::from_secs(secs);
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let (store, op) = (store.clone(), op.to_owned());
            tokio::spawn(async move {
                let job: JobId = format!("load-{c}-{}", std::process::id()).parse().unwrap();
                let owner: Owner = format!("client-{c}").parse().unwrap();
                let mut ops = 0u64;
                let mut generation = None;
                while Instant::now() < until {
                    match (op.as_str(), generation) {
                        ("renew", Some(g)) => {
                            store.renew(&job, &owner, g, Ttl::DEFAULT).await.unwrap();
                        }
                        _ => {
                            let ClaimOutcome::Granted(g) =
                                store.claim(&job, &owner, Ttl::DEFAULT).await.unwrap()
                            else {
                                panic!("client {c} could not claim its own job")
                            };
                            if op == "renew" {
                                generation = Some(g.generation);
                                continue;
                            }
                            store.release(&job, &owner, g.generation).await.unwrap();
                        }
                    }
                    ops += 1;
                }
                ops
            })
        })
        .collect();
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap();
    }
    total as f64 / secs as f64
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [store, clients, op, secs] = args.as_slice() else {
        return Err("usage: lease_load STORE(postgres://... or sled, in a temporary directory) CLIENTS claim|renew SECONDS".into());
    };
    let (clients, secs): (usize, u64) = (clients.parse()?, secs.parse()?);
    let rate = if store.starts_with("postgres") {
        let pg = PgLeaseStore::connect(store, PgTable::new("fence_bench", "leases")?).await?;
        pg.migrate().await?;
        drive(Arc::new(pg), clients, op, secs).await
    } else {
        let dir = std::env::temp_dir().join(format!("fence-lease-load-{}", std::process::id()));
        let sled = SledLeaseStore::open(&dir)?;
        let rate = drive(Arc::new(sled), clients, op, secs).await;
        std::fs::remove_dir_all(&dir)?;
        rate
    };
    // claim counts claim+release pairs, renew counts renewals.
    println!("{rate:.0}");
    Ok(())
}
