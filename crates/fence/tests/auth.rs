//! The lease server on a network where anyone can connect: bearer secrets from an auth
//! file, job patterns per client, reload on SIGHUP, and no open non-loopback listener.

mod common;

use std::{os::unix::fs::PermissionsExt, path::Path, process::Command};

use common::*;

const OPS: &str = "ops-0123456789abcdef-secret";
const BILLING: &str = "billing-0123456789abcdef-secret";
const LATER: &str = "later-0123456789abcdef-secret";

fn write_auth(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

fn token_file(dir: &Path, name: &str, secret: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, format!("{secret}\n")).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    p.display().to_string()
}

/// A raw request with an optional bearer secret: (status, head and body).
fn call(addr: &str, method: &str, path: &str, bearer: Option<&str>, body: &str) -> (u16, String) {
    bearer_call(addr, method, path, bearer, body)
}

#[test]
fn secrets_and_patterns_decide_who_may_do_what_and_sighup_reloads() {
    let dir = tempfile::tempdir().unwrap();
    let auth = dir.path().join("clients");
    write_auth(
        &auth,
        &format!("# name secret patterns\nops {OPS} *\nbilling {BILLING} inv-* receipt\n"),
    );
    let (server, addr, log) = start_logged(
        &server_args(
            dir.path().join("data").to_str().unwrap(),
            &["--auth-file", auth.to_str().unwrap()],
        ),
        "trace",
    );
    let url = format!("http://{addr}");
    let claim_body = r#"{"owner":"w","lease_key":"k0123456789abcdefghijk"}"#;

    // No secret, an empty one, a wrong one, another scheme: 401, saying how to authenticate.
    for bearer in [
        None,
        Some(""),
        Some("not-a-known-secret-at-all"),
        Some("x y"),
    ] {
        let (status, answer) = call(&addr, "POST", "/v1/leases/inv-1/claim", bearer, claim_body);
        assert_eq!(status, 401, "{bearer:?}: {answer}");
        assert!(answer.contains("urn:fence:unauthenticated"), "{answer}");
        assert!(
            answer
                .to_ascii_lowercase()
                .contains("www-authenticate: bearer"),
            "{answer}"
        );
    }
    let (status, answer) = call(&addr, "GET", "/v1/leases", None, "");
    assert_eq!(status, 401, "the list needs a secret too: {answer}");
    let (status, _) = call(&addr, "GET", "/healthz", None, "");
    assert_eq!(status, 200, "health stays open for load balancers");

    // Inside and outside the client's patterns.
    let claim_as = |secret: &str, job: &str| {
        let path = format!("/v1/leases/{job}/claim");
        call(&addr, "POST", &path, Some(secret), claim_body)
    };
    let (status, answer) = claim_as(BILLING, "inv-1");
    assert_eq!(status, 200, "{answer}");
    let (status, answer) = claim_as(BILLING, "receipt");
    assert_eq!(status, 200, "an exact pattern: {answer}");
    for job in ["pay-1", "receipt2", "inv"] {
        let (status, answer) = claim_as(BILLING, job);
        assert_eq!(status, 403, "{job}: {answer}");
        assert!(answer.contains("urn:fence:forbidden"), "{answer}");
        let path = format!("/v1/leases/{job}");
        let (status, _) = call(&addr, "GET", &path, Some(BILLING), "");
        assert_eq!(status, 403, "GET {job}");
    }
    let (status, answer) = claim_as(OPS, "pay-1");
    assert_eq!(status, 200, "{answer}");

    // The list shows each client only its own jobs.
    let list = |secret: &str| {
        let tokens = token_file(dir.path(), "t", secret);
        let out = fence(&["leases", "--server", &url, "--auth-token-file", &tokens]);
        assert_success(&out);
        // One record per line.
        let mut jobs: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| {
                let record: serde_json::Value = serde_json::from_str(l).unwrap();
                record["job"].as_str().unwrap().to_owned()
            })
            .collect();
        jobs.sort();
        jobs
    };
    assert_eq!(list(BILLING), ["inv-1", "receipt"]);
    assert_eq!(list(OPS), ["inv-1", "pay-1", "receipt"]);

    // The CLI: no secret is a usage error (exit 2) that says what to do.
    let out = fence(&["status", "--server", &url, "--job", "inv-1"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("Authorization: Bearer"));
    let out = Command::new(FENCE)
        .args(["status", "--server", &url, "--job", "inv-1"])
        .env("FENCE_AUTH_TOKEN", BILLING)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "FENCE_AUTH_TOKEN works too");

    // SIGHUP: a new client is let in; a broken file keeps the clients as they were.
    let (status, _) = call(&addr, "GET", "/v1/leases/inv-1", Some(LATER), "");
    assert_eq!(status, 401);
    write_auth(
        &auth,
        &format!("ops {OPS} *\nbilling {BILLING} inv-* receipt\nlater {LATER} inv-*\n"),
    );
    signal(&server, "-HUP");
    log.wait_for("auth file reloaded");
    let (status, _) = call(&addr, "GET", "/v1/leases/inv-1", Some(LATER), "");
    assert_eq!(status, 200, "the reloaded file lets the new client in");
    write_auth(&auth, "later short *\n");
    signal(&server, "-HUP");
    log.wait_for("auth file not reloaded");
    let (status, _) = call(&addr, "GET", "/v1/leases/inv-1", Some(LATER), "");
    assert_eq!(status, 200, "a broken file keeps the old clients");
    write_auth(&auth, &format!("ops {OPS} *\n"));
    std::fs::set_permissions(&auth, std::fs::Permissions::from_mode(0o644)).unwrap();
    signal(&server, "-HUP");
    let line = log.wait_for_nth("auth file not reloaded", 2);
    assert!(line.contains("chmod 600"), "{line}");
    let (status, _) = call(&addr, "GET", "/v1/leases/inv-1", Some(LATER), "");
    assert_eq!(status, 200, "a file others can read is not taken either");
    std::fs::set_permissions(&auth, std::fs::Permissions::from_mode(0o600)).unwrap();
    signal(&server, "-HUP");
    log.wait_for_nth("auth file reloaded", 2);
    let (status, _) = call(&addr, "GET", "/v1/leases/inv-1", Some(LATER), "");
    assert_eq!(status, 401, "a removed client is out after the reload");

    // No secret in any log line, even at trace level.
    let text = log.text();
    for secret in [OPS, BILLING, LATER, "k0123456789abcdefghijk"] {
        assert!(!text.contains(secret), "a secret was logged:\n{text}");
    }
}

#[test]
fn an_auth_file_others_can_read_or_that_is_broken_stops_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let auth = dir.path().join("clients");
    let data = dir.path().join("data");
    let start = |auth: &Path| {
        let out = Command::new(FENCE)
            .args(["server", "--listen", "127.0.0.1:0", "--data-dir"])
            .arg(&data)
            .arg("--auth-file")
            .arg(auth)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    std::fs::write(&auth, format!("ops {OPS} *\n")).unwrap();
    std::fs::set_permissions(&auth, std::fs::Permissions::from_mode(0o640)).unwrap();
    let (code, stderr) = start(&auth);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("chmod 600"), "{stderr}");
    for (text, want) in [
        ("", "no client"),
        ("ops\n", "line 1"),
        ("ops tooshort *\n", "characters"),
        (&format!("ops {OPS}\n") as &str, "no job pattern"),
        (&format!("ops {OPS} a*b\n") as &str, "'*' may only end"),
        // A trailing comment would make `#` and its words job patterns: refused, by line.
        (
            &format!("# operators\nops {OPS} * # everyone\n") as &str,
            "line 2: \"#\": a comment takes a line of its own",
        ),
    ] {
        write_auth(&auth, text);
        let (code, stderr) = start(&auth);
        assert_eq!(code, Some(2), "{text:?}: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
        assert!(
            stderr.contains(want) && stderr.contains(&auth.display().to_string()),
            "{text:?}: {stderr} lacks {want:?}"
        );
        assert!(!stderr.contains(OPS), "the secret was echoed: {stderr}");
    }
    let (code, stderr) = start(&dir.path().join("missing"));
    assert_eq!(code, Some(2), "{stderr}");
}

#[test]
fn a_listener_beyond_loopback_needs_an_auth_file() {
    let dir = tempfile::tempdir().unwrap();
    // Refused before anything is bound, so this test binds nothing beyond loopback.
    for listen in ["0.0.0.0:0", "[::]:0", "192.0.2.1:7700"] {
        let out = Command::new(FENCE)
            .args(["server", "--listen", listen, "--data-dir"])
            .arg(dir.path())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{listen}: {stderr}");
        assert!(
            stderr.contains("without --auth-file") && stderr.contains("--insecure-no-auth"),
            "{stderr}"
        );
        assert!(stderr.contains("revoke any job"), "{stderr}");
    }
}

/// An operator weighing --insecure-no-auth reads in its help what it gives away, the worst
/// first: anyone who can reach the server may revoke any job without a lease key, and with
/// --signing-key gets a signed token that fences the holder at every sink. Before, the help
/// named renew, release, complete and claim, and left revoke out.
#[test]
fn the_help_of_insecure_no_auth_says_anyone_may_revoke() {
    let out = fence(&["server", "--help"]);
    assert_success(&out);
    let help = String::from_utf8_lossy(&out.stdout);
    let flag = help
        .split("\n      --")
        .find(|p| p.starts_with("insecure-no-auth"))
        .unwrap_or_else(|| panic!("no --insecure-no-auth in:\n{help}"));
    let flag = flag.split_whitespace().collect::<Vec<_>>().join(" ");
    for said in [
        "revoke any job",
        "no lease key needed",
        "--signing-key",
        "signed token",
    ] {
        assert!(flag.contains(said), "{said:?} not in: {flag}");
    }
    let about = help.split("\nUsage:").next().unwrap();
    let about = about.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(about.contains("can revoke any job"), "{about}");
}

/// Secrets never cross a network in clear: a server beyond loopback without TLS is refused
/// unless the operator says --insecure-no-tls, and the proxy's unauthenticated admin
/// listener stays on loopback (issue 31). Refused before anything is bound.
#[test]
fn a_listener_beyond_loopback_needs_tls_and_the_admin_port_stays_on_loopback() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(FENCE)
        .args([
            "server",
            "--listen",
            "192.0.2.1:7700",
            "--insecure-no-auth",
            "--data-dir",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("without TLS") && stderr.contains("--insecure-no-tls"),
        "{stderr}"
    );
    let out = Command::new(FENCE)
        .args([
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "0.0.0.0:0",
        ])
        .args(["--upstream", "http://127.0.0.1:9", "--data-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("loopback only"), "{stderr}");
    // Secrets of its own are not enough: they would cross the network in clear.
    let admins = dir.path().join("admins");
    write_auth(&admins, &format!("ops {OPS} *\n"));
    let out = Command::new(FENCE)
        .args([
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "0.0.0.0:0",
        ])
        .args(["--upstream", "http://127.0.0.1:9", "--admin-auth-file"])
        .arg(&admins)
        .arg("--data-dir")
        .arg(dir.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("and TLS"), "{stderr}");
}

/// With --admin-auth-file, every admin request needs one of its secrets (issue 31).
#[test]
fn the_admin_listener_takes_secrets_of_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let admins = dir.path().join("admins");
    write_auth(&admins, &format!("ops {OPS} *\n"));
    let data = dir.path().join("data");
    let extra = ["--data-dir", data.to_str().unwrap(), "--admin-auth-file"];
    let upstream = start_upstream();
    let (_proxy, _addr, admin) = start_proxy_admin(
        &format!("http://{upstream}"),
        &[&extra[..], &[admins.to_str().unwrap()]].concat(),
    );
    for path in ["/metrics", "/healthz", "/v1/fence/job-1"] {
        for bearer in [None, Some(BILLING)] {
            let (status, answer) = call(&admin, "GET", path, bearer, "");
            assert_eq!(status, 401, "{path} {bearer:?}: {answer}");
            assert!(answer.contains("--admin-auth-file"), "{answer}");
        }
        let (status, answer) = call(&admin, "GET", path, Some(OPS), "");
        assert_eq!(status, 200, "{path}: {answer}");
    }
}

/// `fence run --wait` waits for a held job, not for an answer that cannot change: a secret
/// the server does not accept and a job id no plain claim may take each end the run at once,
/// with the reason, and the command does not run.
#[test]
fn a_run_the_server_will_never_grant_stops_at_once_whatever_its_wait() {
    let dir = tempfile::tempdir().unwrap();
    let auth = dir.path().join("clients");
    write_auth(&auth, &format!("ops {OPS} *\n"));
    let data = dir.path().join("data");
    let (_server, addr) = start_ready(&server_args(
        data.to_str().unwrap(),
        &["--auth-file", auth.to_str().unwrap()],
    ));
    let url = format!("http://{addr}");
    let marker = dir.path().join("ran");
    let touch = format!("touch {}", marker.display());
    let none: &[&str] = &[];
    let cases = [
        (
            "a secret the server does not know",
            LATER,
            "job-a",
            none,
            "refused this client",
        ),
        (
            "a semaphore's slot claimed plainly",
            OPS,
            "pool#1",
            none,
            "cannot be claimed this way",
        ),
        (
            "a semaphore named with a #",
            OPS,
            "pool#1",
            &["--slots", "2"],
            "resource",
        ),
    ];
    for (what, secret, job, more, says) in cases {
        let tokens = token_file(dir.path(), "t", secret);
        let started = std::time::Instant::now();
        let mut args = vec![
            "run",
            "--server",
            &url,
            "--auth-token-file",
            &tokens,
            "--job",
            job,
            "--wait",
            "60s",
        ];
        args.extend_from_slice(more);
        args.extend_from_slice(&["--", "sh", "-c", &touch]);
        let out = fence(&args);
        let took = started.elapsed();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{what}: {out:?}");
        assert!(
            took < std::time::Duration::from_secs(20),
            "{what}: fence run kept asking for {took:?} (--wait 60s): {stderr}"
        );
        assert!(stderr.contains(says), "{what}: {stderr}");
        assert!(
            !stderr.contains(secret),
            "{what}: the secret is on stderr: {stderr}"
        );
        assert!(!marker.exists(), "{what}: the command ran");
    }
}

/// SIGHUP to a server or proxy that took no auth file is logged and ignored: without a
/// handler its default action would end the process at once, with no drain and no last flush.
#[test]
fn a_hangup_without_an_auth_file_does_not_end_the_process() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("leases");
    let (server, addr, log) = start_logged(&server_args(data.to_str().unwrap(), &[]), "info");
    let upstream = format!("http://{}", start_upstream());
    let proxy_data = dir.path().join("proxy");
    let (proxy, proxy_addr, proxy_log) = start_logged(
        &proxy_args(&upstream, &["--data-dir", proxy_data.to_str().unwrap()]),
        "info",
    );
    for (p, log) in [(&server, &log), (&proxy, &proxy_log)] {
        signal(p, "-HUP");
        log.wait_for("SIGHUP: nothing to reload");
    }
    assert_eq!(http_status(&addr, "GET", "/healthz", &[]), 200);
    assert_eq!(fenced_post(&proxy_addr, "/w", "j", "1"), 200);
}
