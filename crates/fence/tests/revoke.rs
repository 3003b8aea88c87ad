//! Operator revoke (contract section 11), against the real binaries: `fence revoke` ends a
//! lease at once, one generation up, only for a client allowed `+revoke`; with `--sink` the
//! signed new generation is pushed to proxies, which refuse the old holder's writes from then
//! on, before any new holder has written. Bad input changes nothing.

mod common;

use std::{os::unix::fs::PermissionsExt, path::Path, process::Command};

use common::*;

const OPS: &str = "ops-0123456789abcdef-secret";
const WORKER: &str = "worker-0123456789abcdef-secret";

/// `fence ARGS` with the bearer secret `secret` in FENCE_AUTH_TOKEN.
fn fence_as(secret: &str, args: &[&str]) -> std::process::Output {
    Command::new(FENCE)
        .args(args)
        .env("FENCE_AUTH_TOKEN", secret)
        .env("RUST_LOG", "warn")
        .output()
        .expect("fence runs")
}

fn stdout_json(out: &std::process::Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|_| {
        panic!(
            "not JSON: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

fn setup(dir: &Path) -> (String, String) {
    assert_success(&fence(&["keygen", "--out", dir.to_str().unwrap()]));
    let auth = dir.join("clients");
    std::fs::write(&auth, format!("ops {OPS} * +revoke\nworker {WORKER} *\n")).unwrap();
    std::fs::set_permissions(&auth, std::fs::Permissions::from_mode(0o600)).unwrap();
    (
        auth.display().to_string(),
        dir.join("fence-signing.pem").display().to_string(),
    )
}

/// A fenced POST through `proxy` with a signed token: (status, answer).
fn write(proxy: &str, job: &str, token: &str) -> (u16, String) {
    let headers = [
        ("X-Fencing-Job", job.to_owned()),
        ("X-Fencing-Token", token.to_owned()),
    ];
    exchange(proxy, "POST", "/charge", &headers, "")
}

#[test]
fn revoke_ends_the_lease_and_the_pushed_generation_fences_the_old_holder_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let (auth, signing) = setup(dir.path());
    let data = dir.path().join("data");
    let (_server, addr) = start_ready(&server_args(
        data.to_str().unwrap(),
        &["--auth-file", &auth, "--signing-key", &signing],
    ));
    let server = format!("http://{addr}");
    let upstream = format!("http://{}", start_upstream());
    let verify = dir.path().join("fence-verify.pem").display().to_string();
    let sled = dir.path().join("proxy").display().to_string();
    let (_proxy, proxy, admin) =
        start_proxy_admin(&upstream, &["--verify-key", &verify, "--data-dir", &sled]);
    let sink = format!("http://{admin}");

    let claimed = fence_as(WORKER, &["claim", "--server", &server, "--job", "pay-1"]);
    assert_success(&claimed);
    let lease = stdout_json(&claimed);
    let old_token = lease["token"].as_str().expect("a signed token").to_owned();
    assert_eq!(write(&proxy, "pay-1", &old_token).0, 200);

    // A client without +revoke, an unknown job, a reason with a control character: refused,
    // nothing changed.
    let revoke = |secret: &str, job: &str, extra: &[&str]| {
        let mut args = vec!["revoke", "--server", &server, "--job", job];
        args.extend_from_slice(extra);
        fence_as(secret, &args)
    };
    let out = revoke(WORKER, "pay-1", &[]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert_eq!(stdout_json(&out)["type"], "urn:fence:forbidden");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("+revoke"),
        "{out:?}"
    );
    let out = revoke(OPS, "never-claimed", &[]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert_eq!(stdout_json(&out)["type"], "urn:fence:unknown-job");
    let out = revoke(OPS, "pay-1", &["--reason", "bell\u{7}"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let out = revoke(OPS, "pay-1", &["--sink", "not a url"]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "a bad --sink is refused before revoking"
    );
    let status = fence_as(WORKER, &["status", "--server", &server, "--job", "pay-1"]);
    let record = stdout_json(&status);
    assert_eq!(
        (record["state"].as_str(), record["generation"].as_u64()),
        (Some("held"), Some(1))
    );

    // The operator revokes and pushes to the proxy.
    let out = revoke(
        OPS,
        "pay-1",
        &["--reason", "stuck for an hour", "--sink", &sink],
    );
    assert_success(&out);
    let record = stdout_json(&out);
    assert_eq!(
        (
            record["state"].as_str(),
            record["generation"].as_u64(),
            record["owner"].is_null()
        ),
        (Some("free"), Some(2), true),
        "{record}"
    );
    let pushed = record["token"]
        .as_str()
        .expect("the signed token of generation 2");
    assert!(pushed.starts_with("2."), "{pushed}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("fenced at generation 2"),
        "{out:?}"
    );

    // Nobody has written at generation 2, yet the old holder's write is refused.
    let (status, answer) = write(&proxy, "pay-1", &old_token);
    assert_eq!(status, 409, "{answer}");
    assert!(answer.contains("urn:fence:stale-token"), "{answer}");
    let (status, view) = exchange(&admin, "GET", "/v1/fence/pay-1", &[], "");
    assert_eq!(status, 200);
    assert!(view.contains(r#""highest":2"#), "{view}");
    // Its renewal is lease-lost (exit 3).
    let renew = fence_as(
        WORKER,
        &[
            "renew",
            "--server",
            &server,
            "--job",
            "pay-1",
            "--owner",
            lease["owner"].as_str().unwrap(),
            "--generation",
            "1",
            "--lease-key",
            lease["lease_key"].as_str().unwrap(),
        ],
    );
    assert_eq!(renew.status.code(), Some(3), "{renew:?}");
    assert_eq!(stdout_json(&renew)["type"], "urn:fence:lease-lost");

    // Pushes the proxy must not take: forged, for another job, stale, malformed.
    let push =
        |job: &str, body: &str| exchange(&admin, "POST", &format!("/v1/fence/{job}"), &[], body);
    let forged = format!(r#"{{"token":"9.{}.{}"}}"#, u64::MAX / 2, "A".repeat(86));
    let (status, answer) = push("pay-1", &forged);
    assert_eq!(status, 403, "{answer}");
    assert!(answer.contains("urn:fence:invalid-signature"), "{answer}");
    let (status, answer) = push("other-job", &format!(r#"{{"token":"{pushed}"}}"#));
    assert_eq!(
        status, 403,
        "a token signed for pay-1 does not raise other-job: {answer}"
    );
    for bad in ["", "{}", r#"{"token":7}"#, r#"{"token":"2","x":1}"#] {
        let (status, answer) = push("pay-1", bad);
        assert_eq!(status, 400, "{bad}: {answer}");
    }
    let (status, view) = push("pay-1", &format!(r#"{{"token":"{old_token}"}}"#));
    assert_eq!(
        status, 200,
        "a push at or below the highest changes nothing: {view}"
    );
    assert!(view.contains(r#""highest":2"#), "{view}");

    // The next claim gets the generation after the revoked one, and writes.
    let claimed = fence_as(WORKER, &["claim", "--server", &server, "--job", "pay-1"]);
    let lease = stdout_json(&claimed);
    assert_eq!(lease["generation"], 3, "{lease}");
    assert_eq!(
        write(&proxy, "pay-1", lease["token"].as_str().unwrap()).0,
        200
    );
}

#[test]
fn a_proxy_without_verify_keys_takes_no_pushed_generation() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = format!("http://{}", start_upstream());
    let (_proxy, proxy, admin) =
        start_proxy_admin(&upstream, &["--data-dir", dir.path().to_str().unwrap()]);
    let (status, answer) = exchange(
        &admin,
        "POST",
        "/v1/fence/j",
        &[],
        &format!(r#"{{"token":"{}"}}"#, u64::MAX),
    );
    assert_eq!(status, 403, "{answer}");
    assert!(answer.contains("no verify key"), "{answer}");
    let headers = [
        ("X-Fencing-Job", "j".to_owned()),
        ("X-Fencing-Token", "5".to_owned()),
    ];
    assert_eq!(
        exchange(&proxy, "POST", "/", &headers, "").0,
        200,
        "j was not raised"
    );
}

/// A sink whose admin listener wants secrets of its own (`--admin-auth-file`, required off
/// loopback) takes the push with the sinks' secret (`--sink-auth-token-file` or
/// FENCE_SINK_AUTH_TOKEN); the lease server's secret is not sent to it. Before, no secret
/// was sent and every such sink answered 401: a revoked holder kept passing it.
#[test]
fn a_push_carries_the_sinks_secret_and_not_the_lease_servers() {
    const ADMIN: &str = "admin-0123456789abcdef-secret";
    let dir = tempfile::tempdir().unwrap();
    let (auth, signing) = setup(dir.path());
    let data = dir.path().join("data");
    let (_server, addr) = start_ready(&server_args(
        data.to_str().unwrap(),
        &["--auth-file", &auth, "--signing-key", &signing],
    ));
    let server = format!("http://{addr}");
    let admins = dir.path().join("admins");
    std::fs::write(&admins, format!("ops {ADMIN} *\n")).unwrap();
    std::fs::set_permissions(&admins, std::fs::Permissions::from_mode(0o600)).unwrap();
    let verify = dir.path().join("fence-verify.pem").display().to_string();
    let sled = dir.path().join("proxy").display().to_string();
    let upstream = format!("http://{}", start_upstream());
    let (_proxy, proxy, admin) = start_proxy_admin(
        &upstream,
        &[
            "--verify-key",
            &verify,
            "--data-dir",
            &sled,
            "--admin-auth-file",
            admins.to_str().unwrap(),
        ],
    );
    let sink = format!("http://{admin}");
    let highest = || {
        let bearer = [("Authorization", format!("Bearer {ADMIN}"))];
        let (status, view) = exchange(&admin, "GET", "/v1/fence/pay-2", &bearer, "");
        assert_eq!(status, 200, "{view}");
        let body = view.split("\r\n\r\n").nth(1).unwrap_or_default();
        serde_json::from_str::<serde_json::Value>(body).unwrap()["highest"].as_u64()
    };

    let claimed = fence_as(WORKER, &["claim", "--server", &server, "--job", "pay-2"]);
    assert_success(&claimed);
    let old_token = stdout_json(&claimed)["token"].as_str().unwrap().to_owned();
    assert_eq!(write(&proxy, "pay-2", &old_token).0, 200);
    assert_eq!(highest(), Some(1));

    // Without the sinks' secret: revoked at the server, refused by the sink, exit 1.
    let revoke = |job: &str, extra: &[(&str, &str)]| {
        let mut command = Command::new(FENCE);
        command
            .args(["revoke", "--server", &server, "--job", job, "--sink", &sink])
            .env("FENCE_AUTH_TOKEN", OPS)
            .env("RUST_LOG", "warn");
        for (k, v) in extra {
            command.env(k, v);
        }
        command.output().unwrap()
    };
    let out = revoke("pay-2", &[]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("401"), "{stderr}");
    assert!(!stderr.contains(OPS), "a secret in the output: {stderr}");
    assert_eq!(highest(), Some(1));

    // With it (a file here): the sink is fenced at the revoked generation.
    let secret_file = dir.path().join("sink-secret");
    std::fs::write(&secret_file, format!("{ADMIN}\n")).unwrap();
    let secret_path = secret_file.to_str().unwrap();
    let out = revoke("pay-2", &[("FENCE_SINK_AUTH_TOKEN_FILE", secret_path)]);
    assert_success(&out);
    let revoked = stdout_json(&out)["generation"].as_u64();
    assert_eq!(highest(), revoked);
    let (status, answer) = write(&proxy, "pay-2", &old_token);
    assert_eq!(status, 409, "{answer}");
    // And from the environment.
    let out = revoke("pay-2", &[("FENCE_SINK_AUTH_TOKEN", ADMIN)]);
    assert_success(&out);
    assert_eq!(highest(), stdout_json(&out)["generation"].as_u64());
}

/// Revoking a released job pushes a token that ends at the revoke: the pushes go out at
/// once, so a sink that never answers (its 10 s timeout) does not hold back the others past
/// their clock skew. Before, they went one after another, and the sink after the dead one
/// refused the push as expired.
#[test]
fn pushes_go_to_every_sink_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let (auth, signing) = setup(dir.path());
    let data = dir.path().join("data");
    let (_server, addr) = start_ready(&server_args(
        data.to_str().unwrap(),
        &["--auth-file", &auth, "--signing-key", &signing],
    ));
    let server = format!("http://{addr}");
    let upstream = format!("http://{}", start_upstream());
    let verify = dir.path().join("fence-verify.pem").display().to_string();
    let sled = dir.path().join("proxy").display().to_string();
    let (_proxy, proxy, admin) = start_proxy_admin(
        &upstream,
        &[
            "--verify-key",
            &verify,
            "--data-dir",
            &sled,
            "--clock-skew",
            "1s",
        ],
    );
    // A sink that takes the connection and never answers; one that answers 503 (its fence
    // store failing); one where nothing listens.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_url = format!("http://{}", dead.local_addr().unwrap());
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy_url = format!("http://{}", busy.local_addr().unwrap());
    std::thread::spawn(move || {
        use std::io::{Read as _, Write as _};
        if let Ok((mut stream, _)) = busy.accept() {
            let _ = stream.read(&mut [0; 8192]);
            let body = r#"{"type":"urn:fence:store-unavailable","title":"Store unavailable","status":503,"detail":"the fence store failed"}"#;
            let _ = write!(
                stream,
                "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/problem+json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    let gone_url = {
        let gone = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", gone.local_addr().unwrap())
    };

    let claimed = fence_as(WORKER, &["claim", "--server", &server, "--job", "pay-3"]);
    assert_success(&claimed);
    let lease = stdout_json(&claimed);
    let old_token = lease["token"].as_str().unwrap().to_owned();
    assert_eq!(write(&proxy, "pay-3", &old_token).0, 200);
    assert_success(&fence_as(
        WORKER,
        &[
            "release",
            "--server",
            &server,
            "--job",
            "pay-3",
            "--owner",
            lease["owner"].as_str().unwrap(),
            "--generation",
            "1",
            "--lease-key",
            lease["lease_key"].as_str().unwrap(),
        ],
    ));
    let sink = format!("http://{admin}");
    let out = fence_as(
        OPS,
        &[
            "revoke", "--server", &server, "--job", "pay-3", "--sink", &dead_url, "--sink", &sink,
            "--sink", &busy_url, "--sink", &gone_url,
        ],
    );
    assert_eq!(
        out.status.code(),
        Some(1),
        "the dead sink's push failed: {out:?}"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("fenced at generation 2"), "{stderr}");
    // In a sink's words, not the lease client's.
    assert!(
        stderr.contains(&format!(
            "{dead_url}: the push failed: the sink did not answer within"
        )),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!(
            "{busy_url}: the push failed: the sink answered 503: the fence store failed"
        )),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!(
            "{gone_url}: the push failed: the sink could not be reached"
        )),
        "{stderr}"
    );
    assert!(
        !stderr.contains("lease store") && !stderr.contains("lease server"),
        "{stderr}"
    );
    let (status, answer) = write(&proxy, "pay-3", &old_token);
    assert_eq!(status, 409, "{answer}");
    drop(dead);
}

/// A push logs a line only when it raised the job's fence: a local process looping pushes
/// of one token (no secret: sinks may log tokens) writes no line after the first, and the
/// log does not report revokes that never happened. Before, every push wrote a warn line
/// "fence raised by a push (revoke)", unthrottled, even when nothing changed.
#[test]
fn a_push_that_raises_nothing_logs_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (auth, signing) = setup(dir.path());
    let data = dir.path().join("data");
    let (_server, addr) = start_ready(&server_args(
        data.to_str().unwrap(),
        &["--auth-file", &auth, "--signing-key", &signing],
    ));
    let server = format!("http://{addr}");
    let upstream = format!("http://{}", start_upstream());
    let verify = dir.path().join("fence-verify.pem").display().to_string();
    let sled = dir.path().join("proxy").display().to_string();
    let (_proxy, _, log) = start_logged(
        &proxy_args(&upstream, &["--verify-key", &verify, "--data-dir", &sled]),
        "info",
    );
    let admin = log
        .wait_for("proxy ready")
        .split("admin=")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .expect("the ready line names the admin address")
        .to_owned();
    let claimed = fence_as(WORKER, &["claim", "--server", &server, "--job", "pay-9"]);
    assert_success(&claimed);
    let token = stdout_json(&claimed)["token"].as_str().unwrap().to_owned();
    let body = format!(r#"{{"token":"{token}"}}"#);
    let before = log.text().lines().count();
    for _ in 0..101 {
        let (status, view) = exchange(&admin, "POST", "/v1/fence/pay-9", &[], &body);
        assert_eq!(status, 200, "{view}");
        assert!(view.contains(r#""highest":1"#), "{view}");
    }
    log.wait_for("fence raised by a push");
    std::thread::sleep(std::time::Duration::from_millis(300));
    let text = log.text();
    let raised = text
        .lines()
        .filter(|l| l.contains("fence raised by a push"))
        .count();
    assert_eq!(raised, 1, "one push raised pay-9:\n{text}");
    let lines = text.lines().count() - before;
    assert!(lines <= 11, "{lines} lines for 101 pushes:\n{text}");
}
