//! Hand-over latency: from the moment a holder sends its release to the moment the next
//! worker holds the job, with the server's waiting claims against polling, in one run.
//!
//! ```text
//! cargo run --release --example handover -- 60
//! ```
//! Starts a lease server (the real router, memory store) on a loopback port. Each round, a
//! holder claims a job, a second worker starts trying to get it, and after a varied delay
//! (100 to 700 ms, so pollers are caught at every phase) the holder releases. Modes, taken in
//! turn round by round so they share the machine's noise:
//! - `wait`: one waiting claim (`claim?wait=20s`, what the lease client and `fence run --wait`
//!   send);
//! - `poll-backoff`: claim, and on `lease-held` sleep 100 ms doubling to 2 s (what `fence run`
//!   did before waiting claims);
//! - `poll-100ms`: claim every 100 ms.
//!
//! Prints the median, p99 and max per mode, in milliseconds.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use fence_core::{JobId, Owner};
use fence_lease::{HttpLeaseStore, LeaseStore, MemoryLeaseStore, Outcome, Ttl, new_lease_key};

const MODES: [&str; 3] = ["wait", "poll-backoff", "poll-100ms"];

/// Gets `job` for `owner` the way `mode` does; returns when it is granted.
async fn take(store: &HttpLeaseStore, job: &JobId, mode: &str) -> Instant {
    let owner: Owner = "next".parse().unwrap();
    let key = new_lease_key().unwrap();
    let mut pause = Duration::from_millis(100);
    loop {
        let outcome = if mode == "wait" {
            store
                .claim_waiting(job, &owner, &key, Ttl::DEFAULT, Duration::from_secs(20))
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
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let router = fence::server::router(
        Arc::new(MemoryLeaseStore::new()),
        fence::server::ServerOptions::default(),
    );
    tokio::spawn(async move { axum::serve(listener, router).await });
    let store = Arc::new(HttpLeaseStore::new(&url).unwrap());
    let holder: Owner = "holder".parse().unwrap();
    let mut seen: Vec<Vec<f64>> = vec![Vec::new(); MODES.len()];
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    for round in 0..rounds {
        for (m, mode) in MODES.iter().enumerate() {
            let job: JobId = format!("handover-{round}-{mode}").parse().unwrap();
            let key = new_lease_key().unwrap();
            let Outcome::Granted(g) = store
                .claim(&job, &holder, &key, Ttl::DEFAULT)
                .await
                .unwrap()
            else {
                panic!("the holder could not claim {job}")
            };
            let taker = {
                let (store, job, mode) = (store.clone(), job.clone(), *mode);
                tokio::spawn(async move { take(&store, &job, mode).await })
            };
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            tokio::time::sleep(Duration::from_millis(100 + seed % 600)).await;
            let released = Instant::now();
            store
                .release(&job, &holder, g.generation, &key)
                .await
                .unwrap();
            let granted = taker.await.unwrap();
            seen[m].push(granted.duration_since(released).as_secs_f64() * 1e3);
        }
    }
    println!("hand-over latency, release sent to next holder granted, {rounds} rounds per mode:");
    println!(
        "{:<14} {:>10} {:>10} {:>10}",
        "mode", "median ms", "p99 ms", "max ms"
    );
    for (m, mode) in MODES.iter().enumerate() {
        let mut s = seen[m].clone();
        s.sort_by(f64::total_cmp);
        println!(
            "{mode:<14} {:>10.1} {:>10.1} {:>10.1}",
            percentile(&s, 0.5),
            percentile(&s, 0.99),
            s[s.len() - 1]
        );
    }
}
