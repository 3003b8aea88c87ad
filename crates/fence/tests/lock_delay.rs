//! Lock-delay through `fence server` (contract section 12): after a lease *expires*, claims
//! are 409 `lock-delay` with the time left and `Retry-After` until the delay is over, a
//! waiting claim waits it out, a claim's own `lock_delay_ms` beats the server's default,
//! and a release skips it.

mod common;

use std::time::{Duration, Instant};

use common::*;

/// A claim of `job` by `owner` with a 1 s lease (and `extra` fields): (status, headers and
/// body as sent, the body as JSON).
fn claim(
    addr: &str,
    job: &str,
    owner: &str,
    extra: &str,
    wait: &str,
) -> (u16, String, serde_json::Value) {
    let body = format!(
        r#"{{"owner":"{owner}","lease_key":"{owner}-0123456789abcdefghijk","ttl_ms":1000{extra}}}"#
    );
    let path = if wait.is_empty() {
        format!("/v1/leases/{job}/claim")
    } else {
        format!("/v1/leases/{job}/claim?wait={wait}")
    };
    let (status, answer) = bearer_call(addr, "POST", &path, None, &body);
    let json = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
    (
        status,
        answer.clone(),
        serde_json::from_str(json).unwrap_or_default(),
    )
}

fn server(lock_delay: &str) -> (tempfile::TempDir, Proc, String) {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap().to_owned();
    let (proc, addr) = start_ready(&server_args(&data, &["--lock-delay", lock_delay]));
    (dir, proc, addr)
}

#[test]
fn an_expired_lease_keeps_its_job_for_the_servers_lock_delay() {
    let (_dir, _server, addr) = server("3s");
    // Taken before the claim is sent: a's lease starts when the server decides, after this.
    let claimed = Instant::now();
    let (status, _, a) = claim(&addr, "nightly", "a", "", "");
    assert_eq!(status, 200, "{a}");
    std::thread::sleep(Duration::from_millis(1200)); // a's 1 s lease expires

    let (status, answer, refused) = claim(&addr, "nightly", "b", "", "");
    assert_eq!(status, 409, "{answer}");
    assert_eq!(refused["type"], "urn:fence:lock-delay", "{refused}");
    assert_eq!(refused["owner"], "a", "{refused}");
    assert_eq!(refused["generation"], 1, "{refused}");
    let left = refused["claimable_in_ms"]
        .as_u64()
        .expect("claimable_in_ms");
    assert!(
        (1_000..=2_800).contains(&left),
        "{left} ms left of the delay"
    );
    assert!(
        answer.to_ascii_lowercase().contains("retry-after: 2")
            || answer.to_ascii_lowercase().contains("retry-after: 3"),
        "{answer}"
    );
    assert!(
        refused["detail"].as_str().unwrap().contains("lock-delay"),
        "{refused}"
    );

    // A waiting claim waits the delay out: granted once 1 s + 3 s have passed since a's claim.
    let (status, _, b) = claim(&addr, "nightly", "b", "", "10s");
    assert_eq!(status, 200, "{b}");
    assert_eq!(b["generation"], 2, "{b}");
    // The server counts whole milliseconds, so the end it computes may fall up to 1 ms before
    // the real one.
    assert!(
        claimed.elapsed() >= Duration::from_secs(4) - Duration::from_millis(2),
        "granted {:?} after the first claim, inside the delay",
        claimed.elapsed()
    );
}

#[test]
fn a_claims_own_lock_delay_beats_the_default_and_a_release_skips_it() {
    let (_dir, _server, addr) = server("1h");
    // Its own 0: claimable as soon as the lease expires, whatever the server's default.
    let (status, _, a) = claim(&addr, "own", "a", r#","lock_delay_ms":0"#, "");
    assert_eq!(status, 200, "{a}");
    std::thread::sleep(Duration::from_millis(1200));
    let (status, _, b) = claim(&addr, "own", "b", "", "");
    assert_eq!(status, 200, "{b}");

    // b's lease has the server's hour; released, it is free at once.
    let release = r#"{"owner":"b","generation":2,"lease_key":"b-0123456789abcdefghijk"}"#;
    let (status, answer) = bearer_call(&addr, "POST", "/v1/leases/own/release", None, release);
    assert_eq!(status, 200, "{answer}");
    let (status, _, c) = claim(&addr, "own", "c", "", "");
    assert_eq!(status, 200, "{c}");
    assert_eq!(c["generation"], 3, "{c}");

    // A lock-delay past 24 h is a 400 that says so.
    let (status, _, bad) = claim(&addr, "own2", "d", r#","lock_delay_ms":86400001"#, "");
    assert_eq!(status, 400, "{bad}");
    assert!(
        bad["detail"].as_str().unwrap().contains("lock_delay_ms"),
        "{bad}"
    );
}

#[test]
fn fence_claim_and_fence_run_take_a_lock_delay() {
    let (_dir, _server, addr) = server("0s");
    let url = format!("http://{addr}");
    let out = fence(&[
        "claim",
        "--server",
        &url,
        "--job",
        "cli",
        "--ttl",
        "1s",
        "--lock-delay",
        "1h",
    ]);
    assert_success(&out);
    std::thread::sleep(Duration::from_millis(1200));
    let out = fence(&["run", "--server", &url, "--job", "cli", "--", "true"]);
    assert_eq!(out.status.code(), Some(3), "not obtained: {out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("lock-delay"), "{stderr}");
    let out = fence(&[
        "claim",
        "--server",
        &url,
        "--job",
        "cli",
        "--lock-delay",
        "25h",
    ]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}

/// `fence run --on-failure expire`: a command that fails (its write may still land) leaves
/// the job to expire, never released, so the lock-delay keeps the next holder out after the
/// lease's end; without it the job is released and the next run starts at once.
#[test]
fn fence_run_on_failure_expire_leaves_the_job_to_its_lock_delay() {
    let (_dir, _server, addr) = server("1h");
    let url = format!("http://{addr}");
    let run = |job: &str, extra: &[&str], command: &str| {
        let mut args = vec!["run", "--server", &url, "--job", job, "--ttl", "2s"];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--", "sh", "-c", command]);
        fence(&args)
    };
    let failed = run("expire", &["--on-failure", "expire"], "exit 4");
    let said = String::from_utf8_lossy(&failed.stderr);
    assert_eq!(failed.status.code(), Some(4), "{said}");
    assert!(said.contains("left to expire"), "{said}");
    let released = run("release", &[], "exit 4");
    assert_eq!(released.status.code(), Some(4), "{released:?}");
    // Past the lease's end: the expired one is in its lock-delay, the released one free.
    std::thread::sleep(Duration::from_millis(2300));
    let next = run("expire", &[], "true");
    assert_eq!(next.status.code(), Some(3), "not obtained: {next:?}");
    let said = String::from_utf8_lossy(&next.stderr);
    assert!(said.contains("lock-delay"), "{said}");
    assert_success(&run("release", &[], "true"));
}
