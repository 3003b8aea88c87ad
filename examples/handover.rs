//! Hand-over latency: from the moment a holder lets a job go to the moment the next worker
//! holds it, with the server's waiting claims against polling, in one run.
//!
//! ```text
//! cargo run --release --example handover -- 60
//! DATABASE_URL=postgres://postgres@127.0.0.1/test cargo run --release --example handover -- 60
//! ```
//! Starts lease servers (the real router) on loopback ports. Each round, a holder claims a
//! job, a second worker starts trying to get it, and after a varied delay (100 to 700 ms, so
//! pollers are caught at every phase) the holder releases, or its lease runs out. Modes, taken
//! in turn round by round so they share the machine's noise:
//! - `wait`: one waiting claim (`claim?wait=20s`, what the lease client and `fence run --wait`
//!   send), memory store;
//! - `poll-backoff`: claim, and on `lease-held` sleep 100 ms doubling to 2 s (what `fence run`
//!   did before waiting claims);
//! - `poll-100ms`: claim every 100 ms;
//! - `sled-release`: a waiting claim on a sled store (every grant on disk first);
//! - `sled-expiry`: the same, but the holder never lets go: its lease (claimed with the
//!   delay as its ttl) expires; measured from the claim's *sending* plus the ttl, so the
//!   figure is an upper bound (the store started the lease a little later);
//! - `pg-two-servers` (with `DATABASE_URL`): the holder releases through server A, the
//!   waiting claim waits on server B, both on one PostgreSQL table (`pg_notify`/`LISTEN`).
//!
//! Prints the median, p99 and max per mode, in milliseconds.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use fence_core::{JobId, Owner};
use fence_lease::{
    HttpLeaseStore, LeaseStore, MemoryLeaseStore, Outcome, PgLeaseStore, PgTable, SledLeaseStore,
    Ttl, new_lease_key,
};

/// Where a mode's holder and taker go, and whether the holder lets go or its lease expires.
struct Mode {
    name: &'static str,
    holder: Arc<HttpLeaseStore>,
    taker: Arc<HttpLeaseStore>,
    expires: bool,
}

/// A lease server with the real router over `store`, on a loopback port.
async fn serve<S: LeaseStore>(store: S) -> Arc<HttpLeaseStore> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let router = fence::server::router(Arc::new(store), fence::server::ServerOptions::default());
    tokio::spawn(async move { axum::serve(listener, router).await });
    Arc::new(HttpLeaseStore::new(&url).unwrap())
}

/// Gets `job` for `owner` the way `mode` does; returns when it is granted.
async fn take(store: &HttpLeaseStore, job: &JobId, mode: &str) -> Instant {
    let owner: Owner = "next".parse().unwrap();
    let key = new_lease_key().unwrap();
    let mut pause = Duration::from_millis(100);
    loop {
        let outcome = if !mode.starts_with("poll") {
            store
                .claim_waiting(
                    job,
                    &owner,
                    &key,
                    Ttl::DEFAULT.into(),
                    Duration::from_secs(20),
                )
                .await
        } else {
            store.claim(job, &owner, &key, Ttl::DEFAULT).await
        };
        match outcome.unwrap() {
            Outcome::Granted(_) => return Instant::now(),
            Outcome::Held { expires_in, .. } => {
                let sleep = if mode == "poll-backoff" {
                    let now = pause.min(expires_in);
                    pause = (pause * 2).min(Duration::from_secs(2));
                    now
                } else {
                    Duration::from_millis(100)
                };
                tokio::time::sleep(sleep).await;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

#[tokio::main]
async fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .map_or(60, |n| n.parse().expect("rounds: a number"));
    let memory = serve(MemoryLeaseStore::new()).await;
    let dir = tempfile::tempdir().unwrap();
    let sled = serve(SledLeaseStore::open(dir.path()).unwrap()).await;
    let mode = |name, holder: &Arc<HttpLeaseStore>, taker: &Arc<HttpLeaseStore>, expires| Mode {
        name,
        holder: holder.clone(),
        taker: taker.clone(),
        expires,
    };
    let mut modes = vec![
        mode("wait", &memory, &memory, false),
        mode("poll-backoff", &memory, &memory, false),
        mode("poll-100ms", &memory, &memory, false),
        mode("sled-release", &sled, &sled, false),
        mode("sled-expiry", &sled, &sled, true),
    ];
    if let Ok(url) = std::env::var("DATABASE_URL") {
        // One table per run, dropped (with what earlier runs left) first.
        fence_storage::postgres::drop_test_tables(&url, &["handover_%"]).await;
        let table =
            PgTable::new("fence_test", &format!("handover_{}", std::process::id())).unwrap();
        let pg = || async {
            let store = PgLeaseStore::connect(&url, table.clone()).await.unwrap();
            store.migrate().await.unwrap();
            serve(store).await
        };
        let (a, b) = (pg().await, pg().await);
        modes.push(mode("pg-two-servers", &a, &b, false));
    } else {
        eprintln!("DATABASE_URL is not set: the pg-two-servers mode is left out");
    }
    let holder: Owner = "holder".parse().unwrap();
    let mut seen: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    for round in 0..rounds {
        for (m, mode) in modes.iter().enumerate() {
            let job: JobId = format!("handover-{}-{round}-{}", std::process::id(), mode.name)
                .parse()
                .unwrap();
            let key = new_lease_key().unwrap();
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let delay = Duration::from_millis(100 + seed % 600);
            let ttl = if mode.expires {
                Ttl::from_millis(delay.as_millis() as u64).unwrap()
            } else {
                Ttl::DEFAULT
            };
            let sent = Instant::now();
            let Outcome::Granted(g) = mode.holder.claim(&job, &holder, &key, ttl).await.unwrap()
            else {
                panic!("the holder could not claim {job}")
            };
            let taker = {
                let (store, job, name) = (mode.taker.clone(), job.clone(), mode.name);
                tokio::spawn(async move { take(&store, &job, name).await })
            };
            let let_go = if mode.expires {
                sent + delay
            } else {
                tokio::time::sleep(delay).await;
                let released = Instant::now();
                mode.holder
                    .release(&job, &holder, g.generation, &key)
                    .await
                    .unwrap();
                released
            };
            let granted = taker.await.unwrap();
            seen[m].push(granted.duration_since(let_go).as_secs_f64() * 1e3);
        }
    }
    println!("hand-over latency, let go to next holder granted, {rounds} rounds per mode:");
    println!(
        "{:<15} {:>10} {:>10} {:>10}",
        "mode", "median ms", "p99 ms", "max ms"
    );
    for (m, mode) in modes.iter().enumerate() {
        let mut s = seen[m].clone();
        s.sort_by(f64::total_cmp);
        println!(
            "{:<15} {:>10.1} {:>10.1} {:>10.1}",
            mode.name,
            percentile(&s, 0.5),
            percentile(&s, 0.99),
            s[s.len() - 1]
        );
    }
}
