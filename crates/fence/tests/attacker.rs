//! What an attacker who can reach the lease server, and read what it answers, can do to a
//! lease it does not hold: nothing. Owner and generation are public; the lease key is not,
//! and it never leaves the holder (no response, log line or metric carries it).

mod common;

use std::{
    os::unix::fs::PermissionsExt,
    process::{Command, Stdio},
    time::Duration,
};

use common::*;

const HOLDER: &str = "holder-0123456789abcdef-secret";
const STRANGER: &str = "stranger-0123456789abcdef-secret";

fn call(addr: &str, method: &str, path: &str, bearer: &str, body: &str) -> (u16, String) {
    bearer_call(addr, method, path, Some(bearer), body)
}

#[test]
fn a_stranger_who_knows_owner_and_generation_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let auth = dir.path().join("clients");
    // Both clients may act on every job: the attacker is a tenant, not an outsider.
    std::fs::write(&auth, format!("holder {HOLDER} *\nstranger {STRANGER} *\n")).unwrap();
    std::fs::set_permissions(&auth, std::fs::Permissions::from_mode(0o600)).unwrap();
    let keys = dir.path().join("keys");
    assert!(
        fence(&["keygen", "--out", keys.to_str().unwrap()])
            .status
            .success()
    );
    let (_server, addr, log) = start_logged(
        &server_args(
            dir.path().join("data").to_str().unwrap(),
            &[
                "--auth-file",
                auth.to_str().unwrap(),
                "--signing-key",
                keys.join("fence-signing.pem").to_str().unwrap(),
            ],
        ),
        "trace",
    );
    let url = format!("http://{addr}");

    // The holder: `fence run` with a 4 s lease around a 9 s command; it must renew throughout
    // (4 s, not less: a renewal that a loaded test machine delays, here to a server logging
    // at trace level, must not lose the lease; a 2 s lease is lost by one renewal 1.1 s late).
    let mut worker = Command::new(FENCE)
        .args([
            "run", "--server", &url, "--job", "nightly", "--ttl", "4s", "--", "sleep", "9",
        ])
        .env("FENCE_AUTH_TOKEN", HOLDER)
        .env("RUST_LOG", "warn")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let record = loop {
        let (status, answer) = call(&addr, "GET", "/v1/leases/nightly", STRANGER, "");
        if status == 200 {
            break answer;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let body = record.split("\r\n\r\n").nth(1).unwrap();
    let record: serde_json::Value = serde_json::from_str(body).unwrap();
    let owner = record["owner"].as_str().unwrap().to_owned();
    let generation = record["generation"].as_u64().unwrap();
    assert!(
        !body.contains("lease_key") && !body.contains("key_hash"),
        "{body}"
    );

    // Every finishing or renewing verb, with what GET showed and a key of the stranger's.
    for action in ["renew", "release", "complete"] {
        let attempt = format!(
            r#"{{"owner":"{owner}","generation":{generation},"lease_key":"guessed0123456789abcdefgh"}}"#
        );
        let (status, answer) = call(
            &addr,
            "POST",
            &format!("/v1/leases/nightly/{action}"),
            STRANGER,
            &attempt,
        );
        assert_eq!(status, 403, "{action}: {answer}");
        assert!(answer.contains("urn:fence:lease-key-mismatch"), "{answer}");
        assert!(
            !answer.contains("\"token\""),
            "no signed token for a stranger: {answer}"
        );
    }
    // Claiming as the holder's owner with another key is not a "retry": 409.
    let (status, answer) = call(
        &addr,
        "POST",
        "/v1/leases/nightly/claim",
        STRANGER,
        &format!(r#"{{"owner":"{owner}","lease_key":"guessed0123456789abcdefgh"}}"#),
    );
    assert_eq!(status, 409, "{answer}");
    assert!(answer.contains("urn:fence:lease-held"), "{answer}");

    // The holder never noticed: it renewed past two TTLs and completed the job.
    let out = worker_output(&mut worker);
    assert_eq!(out.0, Some(0), "{}", out.1);
    let (_, answer) = call(&addr, "GET", "/v1/leases/nightly", STRANGER, "");
    assert!(answer.contains(r#""state":"completed""#), "{answer}");
    assert!(
        answer.contains(&format!(r#""generation":{generation}"#)),
        "{answer}"
    );

    // A key that is known to the test: claimed, renewed, released through the CLI; the key
    // appears in no answer, no log line at trace level, and no metric.
    let tokens = dir.path().join("holder-token");
    std::fs::write(&tokens, HOLDER).unwrap();
    let tokens = tokens.to_str().unwrap();
    let claimed = fence_line(&format!(
        "claim --server {} --auth-token-file {} --job other",
        url, tokens
    ));
    let lease = json(&claimed);
    let key = lease["lease_key"].as_str().unwrap().to_owned();
    let renewed = Command::new(FENCE)
        .args([
            "renew",
            "--server",
            &url,
            "--auth-token-file",
            tokens,
            "--job",
            "other",
            "--owner",
            lease["owner"].as_str().unwrap(),
            "--generation",
            "1",
        ])
        .env("FENCE_LEASE_KEY", &key)
        .output()
        .unwrap();
    assert!(renewed.status.success());
    assert!(!String::from_utf8_lossy(&renewed.stdout).contains(&key));
    let (_, metrics) = call(&addr, "GET", "/metrics", HOLDER, "");
    assert!(
        metrics.contains("fence_"),
        "metrics are served: {metrics:.200}"
    );
    assert!(!metrics.contains(&key), "the key is in a metric");
    let text = log.text();
    assert!(
        text.contains("claim granted"),
        "the trace log was captured: {text:.300}"
    );
    for secret in [&key as &str, HOLDER, STRANGER] {
        assert!(!text.contains(secret), "a secret was logged:\n{text}");
    }
}

fn worker_output(worker: &mut std::process::Child) -> (Option<i32>, String) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = worker.try_wait().unwrap() {
            let mut stderr = String::new();
            use std::io::Read;
            let _ = worker.stderr.take().unwrap().read_to_string(&mut stderr);
            return (status.code(), stderr);
        }
        assert!(std::time::Instant::now() < deadline, "fence run hangs");
        std::thread::sleep(Duration::from_millis(50));
    }
}
