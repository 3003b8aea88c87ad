//! PostgreSQL restarted under a renew loop: clients get errors, the local deadline still
//! governs, nothing is double-granted, service resumes by itself.
//!
//! In a test binary of its own because it restarts the shared database; `cargo test` runs
//! test binaries one after another, so no other PostgreSQL test runs meanwhile.

mod common;

use std::{
    process::Command,
    sync::Arc,
    time::{Duration, Instant},
};

use common::*;
use fence_lease::{ClaimError, HttpLeaseStore, LeaseClient, Ttl};

fn cluster() -> Option<String> {
    let versions = std::fs::read_dir("/etc/postgresql").ok()?;
    let mut v: Vec<String> = versions
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    v.sort();
    v.pop()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_restart_during_renewals() {
    let Some(url) = database_url() else { return };
    // The throwaway cluster (no DATABASE_URL, no local server) restarts itself; otherwise the
    // newest local cluster, which the test database is expected to live in.
    let throwaway = fence_storage::postgres::restart_throwaway_test_database;
    let version = cluster();
    let schema = unique_schema("rst");
    let (_server, addr, log) = start_logged(
        &[
            "server",
            "--listen",
            "127.0.0.1:0",
            "--store",
            &url,
            "--pg-schema",
            &schema,
        ],
        "info",
    );
    let store = HttpLeaseStore::new(&format!("http://{addr}"))
        .unwrap()
        .timeout(Duration::from_secs(2));
    let ttl = Ttl::from_millis(1_500).unwrap();
    let a = LeaseClient::new(store.clone())
        .owner("worker-a".parse().unwrap())
        .ttl(ttl);
    let lease = a.claim("restart-job".parse().unwrap()).await.unwrap();
    let view = Arc::new(lease.view());

    let restart = tokio::task::spawn_blocking(move || {
        if let Some(restarted) = throwaway() {
            return restarted;
        }
        let version = version.expect(
            "no local PostgreSQL cluster under /etc/postgresql to restart, and no throwaway \
             one in use: this test needs one of them (apt install postgresql)",
        );
        Command::new("pg_ctlcluster")
            .args(["--skip-systemctl-redirect", &version, "main", "restart"])
            .status()
            .is_ok_and(|s| s.success())
    });

    // Meanwhile B keeps trying to claim. Whenever it is granted, A must already have stopped
    // believing it holds the job. Go on until the restart is over and the service answers.
    // B's lease is longer than A's: right after the restart, one renewal answered late while
    // the pool reconnects must not lose it (this test is about renewals working again).
    let ttl_b = Ttl::from_millis(4_000).unwrap();
    let b = LeaseClient::new(store.clone())
        .owner("worker-b".parse().unwrap())
        .ttl(ttl_b);
    let started = Instant::now();
    let (mut errors, mut lease_b) = (0, None);
    loop {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "service did not resume within 60 s"
        );
        match b.claim("restart-job".parse().unwrap()).await {
            Ok(l) => {
                assert!(
                    view.is_lost(),
                    "B was granted generation {} while A still held {}",
                    l.generation(),
                    view.generation()
                );
                lease_b = Some(l);
            }
            Err(ClaimError::Held { .. }) => {}
            Err(_) => errors += 1,
        }
        if restart.is_finished() && (lease_b.is_some() || errors > 0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(restart.await.unwrap(), "the database's restart failed");
    assert!(errors > 0, "the restart should have been visible as errors");
    // Service resumes by itself: within a few seconds, calls succeed again.
    let resumed = Instant::now();
    let lease_b = match lease_b {
        Some(l) => l,
        None => loop {
            assert!(
                resumed.elapsed() < Duration::from_secs(20),
                "no answer from the server after the restart; its log:\n{}",
                log.text()
            );
            match b.claim("restart-job".parse().unwrap()).await {
                Ok(l) => {
                    assert!(view.is_lost(), "B granted while A held");
                    break l;
                }
                Err(ClaimError::Held { .. }) if !view.is_lost() => {
                    // A's renewals came back: the service works. Let A go, then B claims.
                    lease.release().await.unwrap();
                    break b.claim("restart-job".parse().unwrap()).await.unwrap();
                }
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        },
    };
    println!(
        "claims that failed during the restart: {errors}; A held {}, B got {}",
        view.generation(),
        lease_b.generation()
    );
    assert_eq!(
        lease_b.generation().get(),
        view.generation().get() + 1,
        "generations +1, nothing reused"
    );
    // Two TTLs: B's lease outlives them only if its renewals go through.
    tokio::time::sleep(ttl_b.as_duration() * 2).await;
    assert!(
        lease_b.token().is_some(),
        "B's renewals work after the restart"
    );
    lease_b.complete().await.unwrap();
}
