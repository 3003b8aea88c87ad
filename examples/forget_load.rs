//! A load driver for bounded state (issue 16): distinct jobs, one after another, through
//! `fence proxy` (each a new job with a signed token: one durable bump) or `fence server`
//! (each a new job: a claim and a release); every REPORT jobs it prints one line with the
//! jobs written, their rate since the last line, and the target process's resident memory
//! and data directory size.
//!
//! ```text
//! cargo run --release --example forget_load -- proxy 127.0.0.1:7800 keys/fence-signing.pem 10000000 8 2000 1000000 PID DIR
//! cargo run --release --example forget_load -- server http://127.0.0.1:7700 - 10000000 8 1000 1000000 PID DIR
//! ```
//! Arguments: target, address, signing key (`-` for the server), jobs, connections, lease
//! TTL in ms (the tokens' lease end is now + TTL), report interval in jobs, the target's pid
//! and its data directory. Output lines: `jobs seconds rate_per_s rss_mib disk_mib`.
//! Used by `bench/forget_scale.sh`.

use std::{
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use bytes::Bytes;
use fence_core::{Generation, JobId, signing::TokenSigner};
use fence_lease::{HttpLeaseStore, LeaseStore, Outcome, Ttl, new_lease_key};
use http_body_util::Full;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};

fn dir_bytes(path: &Path) -> u64 {
    std::fs::read_dir(path).map_or(0, |entries| {
        entries
            .flatten()
            .map(|e| match e.file_type() {
                Ok(t) if t.is_dir() => dir_bytes(&e.path()),
                Ok(_) => e.metadata().map_or(0, |m| m.len()),
                Err(_) => 0,
            })
            .sum()
    })
}

fn rss_kib(pid: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

fn now_ms() -> u64 {
    u64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_millis(),
    )
    .unwrap_or(u64::MAX)
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [target, addr, key, jobs, conns, ttl_ms, report, pid, dir] = args.as_slice() else {
        eprintln!(
            "usage: forget_load proxy|server ADDR KEY.pem|- JOBS CONNS TTL_MS REPORT PID DIR"
        );
        std::process::exit(2);
    };
    let (jobs, conns, ttl_ms, report): (u64, u64, u64, u64) = (
        jobs.parse().unwrap(),
        conns.parse().unwrap(),
        ttl_ms.parse().unwrap(),
        report.parse().unwrap(),
    );
    let next = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let signer = (key != "-").then(|| Arc::new(TokenSigner::from_file(Path::new(key)).unwrap()));
    let http = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let store = (target == "server").then(|| HttpLeaseStore::new(addr).unwrap());
    let run = std::process::id();
    let workers: Vec<_> = (0..conns)
        .map(|_| {
            let (next, done, signer, http, store) = (
                next.clone(),
                done.clone(),
                signer.clone(),
                http.clone(),
                store.clone(),
            );
            let (target, addr) = (target.clone(), addr.clone());
            tokio::spawn(async move {
                loop {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    if n >= jobs {
                        return;
                    }
                    let job: JobId = format!("j{run}-{n}").parse().unwrap();
                    if target == "proxy" {
                        let signer = signer.as_ref().expect("a signing key for the proxy");
                        let token = signer.sign(&job, Generation::new(1), now_ms() + ttl_ms);
                        let req = http::Request::post(format!("http://{addr}/effects"))
                            .header("x-fencing-job", job.as_str())
                            .header("x-fencing-token", token)
                            .body(Full::new(Bytes::from_static(b"x")))
                            .unwrap();
                        let resp = http.request(req).await.expect("the proxy answers");
                        assert!(resp.status().is_success(), "{}", resp.status());
                    } else {
                        let store = store.as_ref().unwrap();
                        let (owner, key) = ("load".parse().unwrap(), new_lease_key().unwrap());
                        let ttl = Ttl::from_millis(ttl_ms).unwrap();
                        let Outcome::Granted(g) =
                            store.claim(&job, &owner, &key, ttl).await.unwrap()
                        else {
                            panic!("a new job is always free")
                        };
                        store
                            .release(&job, &owner, g.generation, &key)
                            .await
                            .unwrap();
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    let started = Instant::now();
    let dir = PathBuf::from(dir);
    let (mut last_n, mut last_t) = (0u64, Instant::now());
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let n = done.load(Ordering::Relaxed);
        if n >= last_n + report || n >= jobs {
            let dt = last_t.elapsed().as_secs_f64();
            println!(
                "{n} {:.1} {:.0} {} {}",
                started.elapsed().as_secs_f64(),
                (n - last_n) as f64 / dt,
                rss_kib(pid) / 1024,
                dir_bytes(&dir) / (1024 * 1024),
            );
            (last_n, last_t) = (n, Instant::now());
        }
        if n >= jobs {
            break;
        }
    }
    for w in workers {
        w.await.unwrap();
    }
}
