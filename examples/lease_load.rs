//! A load driver for lease stores: N concurrent clients, each on a job of its own, doing
//! claim+release pairs or renewals for a fixed time; prints operations per second.
//!
//! ```text
//! cargo run --release --example lease_load -- sled 8 renew 5
//! cargo run --release --example lease_load -- postgres://postgres@127.0.0.1/test 8 claim 5
//! cargo run --release --example lease_load -- fill /tmp/leases 1000000
//! ```
//! `fill DIR N` claims N jobs (`f-0` .. `f-<N-1>`, one-hour leases) into a sled lease store in
//! DIR, 64 at a time, each durable, as a server's store would hold them.
//! Used by `bench/lease_stores.sh` and `bench/lease_scale.sh`.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use fence_core::{JobId, Owner};
use fence_lease::{LeaseStore, Outcome, PgLeaseStore, PgTable, SledLeaseStore, Ttl, new_lease_key};

async fn drive<S: LeaseStore>(store: Arc<S>, clients: usize, op: &str, secs: u64) -> f64 {
    let until = Instant::now() + Duration::from_secs(secs);
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let (store, op) = (store.clone(), op.to_owned());
            tokio::spawn(async move {
                let job: JobId = format!("load-{c}-{}", std::process::id()).parse().unwrap();
                let owner: Owner = format!("client-{c}").parse().unwrap();
                let key = new_lease_key().unwrap();
                let mut ops = 0u64;
                let mut generation = None;
                while Instant::now() < until {
                    match (op.as_str(), generation) {
                        ("renew", Some(g)) => {
                            store
                                .renew(&job, &owner, g, &key, Ttl::DEFAULT)
                                .await
                                .unwrap();
                        }
                        _ => {
                            let Outcome::Granted(g) =
                                store.claim(&job, &owner, &key, Ttl::DEFAULT).await.unwrap()
                            else {
                                panic!("client {c} could not claim its own job")
                            };
                            if op == "renew" {
                                generation = Some(g.generation);
                                continue;
                            }
                            store
                                .release(&job, &owner, g.generation, &key)
                                .await
                                .unwrap();
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
    if let [fill, dir, jobs] = args.as_slice()
        && fill == "fill"
    {
        return fill_store(dir, jobs.parse()?).await;
    }
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

/// Claims `jobs` distinct jobs into a sled lease store in `dir`, 64 concurrent claims at a time.
async fn fill_store(dir: &str, jobs: u64) -> Result<(), Box<dyn std::error::Error>> {
    let store = Arc::new(SledLeaseStore::open(dir)?);
    let started = Instant::now();
    let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let owner: Owner = "filler".parse()?;
    let key = new_lease_key()?;
    let ttl = Ttl::new(Duration::from_secs(3600))?;
    let tasks: Vec<_> = (0..64)
        .map(|_| {
            let (store, next, owner, key) =
                (store.clone(), next.clone(), owner.clone(), key.clone());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= jobs {
                        return Ok::<_, String>(());
                    }
                    let job: JobId = format!("f-{i}").parse().map_err(|e| format!("{e}"))?;
                    store
                        .claim(&job, &owner, &key, ttl)
                        .await
                        .map_err(|e| format!("claim {job}: {e}"))?;
                    if i % 50_000 == 0 {
                        eprint!("\rfilled {i} of {jobs} jobs");
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await??;
    }
    eprintln!(
        "\rfilled {jobs} jobs in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
