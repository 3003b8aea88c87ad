//! A claim acknowledged by the sled lease store survives SIGKILL of the process that made it.

use std::{
    io::{BufRead, BufReader, Write},
    process::{Command, Stdio},
    time::Duration,
};

use fence_core::Generation;
use fence_lease::{LeaseStore, Outcome, SledLeaseStore, Ttl};
use fence_suite::ChildGuard;

const CHILD_DIR: &str = "FENCE_TEST_CHILD_DIR";
const CHILD_OWNER: &str = "FENCE_TEST_CHILD_OWNER";

/// Entry point of the child process: claims, reports the acknowledged generation, then
/// waits to be killed. Run by `claims_survive_sigkill` only.
#[tokio::test]
#[ignore = "child process of claims_survive_sigkill, not a test on its own"]
async fn child_claims_then_waits() {
    let dir = std::env::var(CHILD_DIR).expect("run by claims_survive_sigkill");
    let owner = std::env::var(CHILD_OWNER).unwrap().parse().unwrap();
    let store = SledLeaseStore::open(dir).unwrap();
    match store
        .claim(
            &"durable-job".parse().unwrap(),
            &owner,
            &fence_lease::new_lease_key().unwrap(),
            Ttl::MIN,
        )
        .await
        .unwrap()
    {
        Outcome::Granted(g) => {
            let mut out = std::io::stdout().lock();
            writeln!(out, "ACK {}", g.generation).unwrap();
            out.flush().unwrap();
        }
        other => panic!("{other:?}"),
    }
    std::future::pending::<()>().await;
}

#[tokio::test]
async fn claims_survive_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    let mut last = Generation::ZERO;
    for round in 1..=5u64 {
        let mut child = ChildGuard(
            Command::new(std::env::current_exe().unwrap())
                .args([
                    "child_claims_then_waits",
                    "--exact",
                    "--ignored",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(CHILD_DIR, dir.path())
                .env(CHILD_OWNER, format!("child-{round}"))
                .stdout(Stdio::piped())
                .spawn()
                .unwrap(),
        );
        let stdout = child.0.stdout.take().unwrap();
        let reader = tokio::task::spawn_blocking(move || {
            // libtest prints "test child_claims_then_waits ... " on the same line first.
            BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
                .find_map(|l| {
                    l.split_once("ACK ")
                        .map(|(_, g)| g.trim().parse::<u64>().unwrap())
                })
        });
        let acked = tokio::time::timeout(Duration::from_secs(30), reader)
            .await
            .expect("the child answered within 30 s")
            .unwrap()
            .expect("the child acknowledged a claim");
        child.0.kill().unwrap(); // SIGKILL right after the acknowledgement
        child.0.wait().unwrap();

        let store = SledLeaseStore::open(dir.path()).unwrap();
        let rec = store
            .get(&"durable-job".parse().unwrap())
            .await
            .unwrap()
            .expect("the claim is on disk");
        assert_eq!(rec.generation, Generation::new(acked), "round {round}");
        assert!(
            rec.generation > last,
            "generation went back from {last} to {}",
            rec.generation
        );
        assert_eq!(rec.owner.unwrap().as_str(), format!("child-{round}"));
        last = rec.generation;
        drop(store);
        tokio::time::sleep(Duration::from_millis(120)).await; // let the 100 ms lease expire
    }
    assert_eq!(last, Generation::new(5));
}
