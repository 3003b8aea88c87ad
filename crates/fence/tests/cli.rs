//! End-to-end tests of the `fence` binary, run as child processes on loopback ports.

use std::{
    io::{BufRead, BufReader},
    process::{Command, Output, Stdio},
    time::{Duration, Instant},
};

mod common;

use common::*;

/// On/off settings in the environment take what a systemd EnvironmentFile or a container's
/// `-e` holds: `1`, `yes`, `on` as well as `true` (clap's bool took only `true`/`false`).
#[test]
fn on_off_variables_take_1_yes_and_on() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    // With an auth file /metrics needs a secret, unless FENCE_PUBLIC_METRICS says otherwise.
    let clients = dir.path().join("clients");
    std::fs::write(&clients, "ops ops-0123456789abcdefghij *\n").unwrap();
    std::fs::set_permissions(&clients, std::fs::Permissions::from_mode(0o600)).unwrap();
    let data = dir.path().join("data");
    let args = server_args(
        data.to_str().unwrap(),
        &["--auth-file", clients.to_str().unwrap()],
    );
    let metrics = |public: &str| {
        let mut server = std::process::Command::new(FENCE);
        server
            .args(&args)
            .env("FENCE_PUBLIC_METRICS", public)
            // Off beside an auth file: no contradiction (clap's conflicts_with saw one).
            .env("FENCE_INSECURE_NO_AUTH", "0")
            .env("RUST_LOG", "info");
        let (_server, addr, _log) = start_command(server);
        bearer_call(&addr, "GET", "/metrics", None, "").0
    };
    assert_eq!(metrics("yes"), 200);
    assert_eq!(metrics("1"), 200);
    assert_eq!(metrics("off"), 401);
    let refused = std::process::Command::new(FENCE)
        .args(&args)
        .env("FENCE_PUBLIC_METRICS", "maybe")
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(2), "{refused:?}");
    let contradicted = std::process::Command::new(FENCE)
        .args(&args)
        .env("FENCE_INSECURE_NO_AUTH", "yes")
        .output()
        .unwrap();
    assert_eq!(contradicted.status.code(), Some(2), "{contradicted:?}");
    assert!(String::from_utf8_lossy(&contradicted.stderr).contains("opposite"));
}

/// The proxy's opposite pair is checked on its values too: `FENCE_ALLOW_MISSING_TOKEN=0`
/// beside `--require-token` starts (a request without a token is still refused), while an
/// on value beside it is refused as a contradiction.
#[test]
fn the_proxys_token_pair_is_checked_on_its_values() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = format!("http://{}", start_upstream());
    let data = dir.path().join("proxy");
    let args = proxy_args(
        &upstream,
        &["--data-dir", data.to_str().unwrap(), "--require-token"],
    );
    let mut proxy = Command::new(FENCE);
    proxy
        .args(&args)
        .env("FENCE_ALLOW_MISSING_TOKEN", "0")
        .env("RUST_LOG", "info");
    let (_proxy, addr, _log) = start_command(proxy);
    assert_eq!(http_status(&addr, "POST", "/w", &[]), 428);
    let contradicted = Command::new(FENCE)
        .args(&args)
        .env("FENCE_ALLOW_MISSING_TOKEN", "yes")
        .output()
        .unwrap();
    assert_eq!(contradicted.status.code(), Some(2), "{contradicted:?}");
    assert!(String::from_utf8_lossy(&contradicted.stderr).contains("opposite"));
}

/// `fence healthcheck` against nothing: 1, saying what failed without calling a proxy's
/// admin listener a lease store; 2 for a URL it cannot use.
#[test]
fn healthcheck_says_what_failed_and_tells_a_bad_url_apart() {
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let out = fence(&["healthcheck", "--url", &format!("http://{closed}")]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains("/healthz: "), "{said}");
    assert!(!said.contains("lease store"), "{said}");
    let out = fence(&["healthcheck", "--url", "not a url"]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A client's secret file that group or others may read is used, with a warning naming
/// `chmod 600` (a platform may mount it 0644); at 0600 nothing is said.
#[test]
fn a_client_secret_others_may_read_is_warned_of() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let (_server, server) = start_server(&dir.path().join("leases"));
    let token = dir.path().join("token");
    std::fs::write(&token, "client-0123456789abcdefghij\n").unwrap();
    let status = |mode: u32| {
        std::fs::set_permissions(&token, std::fs::Permissions::from_mode(mode)).unwrap();
        let out = fence(&[
            "claim",
            "--server",
            &server,
            "--job",
            &format!("j-{mode:o}"),
            "--auth-token-file",
            token.to_str().unwrap(),
        ]);
        assert_success(&out);
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let said = status(0o644);
    assert!(
        said.contains("chmod 600") && said.contains("mode 644"),
        "{said}"
    );
    let said = status(0o600);
    assert!(!said.contains("chmod 600"), "{said}");
}

/// A `--lease` file holds the lease key: one group or others may read is used with a
/// warning naming `chmod 600`, and one longer than 64 KiB (`/dev/zero`) is refused at once
/// rather than read until memory runs out.
#[test]
fn a_lease_file_others_may_read_is_warned_of_and_a_huge_one_refused() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let (_server, server) = start_server(&dir.path().join("leases"));
    let claimed = fence(&["claim", "--server", &server, "--job", "filed"]);
    assert_success(&claimed);
    let lease = dir.path().join("lease.json");
    std::fs::write(&lease, &claimed.stdout).unwrap();
    let renew = |mode: u32| {
        std::fs::set_permissions(&lease, std::fs::Permissions::from_mode(mode)).unwrap();
        let out = fence(&[
            "renew",
            "--server",
            &server,
            "--lease",
            lease.to_str().unwrap(),
        ]);
        assert_success(&out);
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let said = renew(0o644);
    assert!(
        said.contains("chmod 600") && said.contains("--lease"),
        "{said}"
    );
    let said = renew(0o600);
    assert!(!said.contains("chmod 600"), "{said}");
    let huge = fence(&["release", "--server", &server, "--lease", "/dev/zero"]);
    assert_eq!(huge.status.code(), Some(2), "{huge:?}");
    assert!(
        String::from_utf8_lossy(&huge.stderr).contains("longer than 65536 bytes"),
        "{huge:?}"
    );
}

/// `fence leases | head -1`: a reader that closed the pipe after the first line ends the
/// listing, exit 0, and nothing panics (`println!` panicked: exit 101).
#[test]
fn leases_into_a_pipe_closed_early_end_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, server) = start_server(&dir.path().join("leases"));
    for job in ["p-1", "p-2", "p-3"] {
        assert_success(&fence(&["claim", "--server", &server, "--job", job]));
    }
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader); // closed before anything is written
    let out = Command::new(FENCE)
        .args(["leases", "--server", &server])
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{said}");
    assert!(!said.contains("panicked"), "{said}");
}

/// A claim granted while its stdout is a closed pipe: the lease key, shown nowhere else, is
/// lost, and the command says so and exits 1 (it exited 0 as if the caller had its lease).
#[test]
fn a_granted_claim_into_a_closed_pipe_says_its_key_is_lost() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, server) = start_server(&dir.path().join("leases"));
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = Command::new(FENCE)
        .args(["claim", "--server", &server, "--job", "unread"])
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains("lease key is lost"), "{said}");
}

#[test]
fn demo_runs_the_worked_example() {
    let out = Command::new(FENCE)
        .arg("demo")
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("409 Conflict urn:fence:stale-token, highest 8"),
        "{stdout}"
    );
    assert!(stdout.contains("PASS"), "{stdout}");
    assert!(!stdout.contains("FAILED"), "{stdout}");
}

#[test]
fn claims_racing_from_24_processes_have_one_winner_per_round() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, url) = start_server(dir.path());
    for round in 1..=5u64 {
        let outs = claim_race(std::slice::from_ref(&url), "race", 24);
        let winners: Vec<&Output> = outs.iter().filter(|o| o.status.code() == Some(0)).collect();
        assert_eq!(winners.len(), 1, "round {round}");
        assert!(
            outs.iter().all(|o| matches!(o.status.code(), Some(0 | 3))),
            "every loser is told the lease is held"
        );
        let lease = json(winners[0]);
        assert_eq!(lease["generation"], round, "round {round}: {lease}");
        let released = release(&url, "race", &lease);
        assert_eq!(released.status.code(), Some(0), "{released:?}");
    }
}

#[test]
fn server_killed_with_sigkill_keeps_every_acknowledged_claim() {
    let dir = tempfile::tempdir().unwrap();
    let (server, url) = start_server(dir.path());
    let mut acked = Vec::new();
    for i in 0..10 {
        let job = format!("job-{i}");
        let out = fence_line(&format!(
            "claim --server {} --job {} --owner w --ttl 1h",
            url, job
        ));
        assert_eq!(out.status.code(), Some(0));
        acked.push((job, json(&out)["generation"].as_u64().unwrap()));
    }
    signal(&server, "-KILL");
    drop(server);
    let (_server, url) = start_server(dir.path());
    for (job, generation) in acked {
        let rec = json(&fence(&["status", "--server", &url, "--job", &job]));
        assert_eq!(
            (
                rec["generation"].as_u64(),
                rec["state"].as_str(),
                rec["owner"].as_str()
            ),
            (Some(generation), Some("held"), Some("w"))
        );
    }
}

#[test]
fn fence_run_stops_its_command_before_the_store_side_expiry() {
    let dir = tempfile::tempdir().unwrap();
    let (server, url) = start_server(dir.path());
    let term_file = dir.path().join("term-at");
    // The shell's own redirection makes the file when SIGTERM comes (no fork that could be
    // slow under load); its modification time is the moment.
    let script = format!(
        "trap ': > {}; exit 0' TERM; while :; do sleep 0.02; done",
        term_file.display()
    );
    let mut run = Command::new(FENCE)
        .args([
            "run", "--server", &url, "--job", "nightly", "--ttl", "5s", "--grace", "3s", "--",
            "sh", "-c", &script,
        ])
        .env("RUST_LOG", "fence_lease=debug")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = run.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(v) = line.split("expires_at_ms=").nth(1) {
                let _ = tx.send(v.split_whitespace().next().unwrap().parse::<u64>().unwrap());
            }
        }
    });
    let run = Proc(run);
    let mut expiry = rx.recv_timeout(Duration::from_secs(10)).expect("a renewal");
    signal(&server, "-STOP"); // the lease server stops answering
    let started = Instant::now();
    let term_at: u64 = loop {
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "the command never got SIGTERM"
        );
        if let Ok(made) = std::fs::metadata(&term_file).and_then(|m| m.modified()) {
            let since_epoch = made.duration_since(std::time::UNIX_EPOCH).unwrap();
            break u64::try_from(since_epoch.as_millis()).unwrap();
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    while let Ok(e) = rx.try_recv() {
        expiry = e; // renewals that were answered before the stop
    }
    assert!(
        term_at < expiry,
        "SIGTERM at {term_at} ms, store-side expiry at {expiry} ms"
    );
    let mut run = run;
    let status = run.0.wait().unwrap();
    assert_eq!(status.code(), Some(75));
    signal(&server, "-CONT");
    // Nor too early: the lease holds until its local deadline (expiry - 10% of the 5 s TTL,
    // less the renewal's latency), not until the first renewal that goes unanswered, about
    // a TTL/3 after the last answered one (3.3 s before the expiry).
    assert!(
        term_at + 1_500 >= expiry,
        "SIGTERM at {term_at} ms, {} ms before the expiry at {expiry} ms",
        expiry - term_at
    );
}

#[test]
fn fence_run_completes_on_success_and_releases_on_failure() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, url) = start_server(dir.path());
    let env_check =
        "test \"$FENCE_JOB\" = j1 && test \"$FENCE_TOKEN\" = 1 && test -n \"$FENCE_SERVER\"";
    let ok = fence(&[
        "run", "--server", &url, "--job", "j1", "--", "sh", "-c", env_check,
    ]);
    assert_success(&ok);
    assert_eq!(
        json(&fence(&["status", "--server", &url, "--job", "j1"]))["state"],
        "completed"
    );
    let again = fence(&["run", "--server", &url, "--job", "j1", "--", "true"]);
    assert_eq!(
        again.status.code(),
        Some(3),
        "a completed job is not run again"
    );

    let failed = fence(&[
        "run", "--server", &url, "--job", "j2", "--", "sh", "-c", "exit 7",
    ]);
    assert_eq!(failed.status.code(), Some(7));
    assert_eq!(
        json(&fence(&["status", "--server", &url, "--job", "j2"]))["state"],
        "free"
    );
    // A signal death is worded as one, and a code fence run also uses is flagged.
    let killed = fence(&[
        "run",
        "--server",
        &url,
        "--job",
        "j4",
        "--",
        "sh",
        "-c",
        "kill -KILL $$",
    ]);
    let said = String::from_utf8_lossy(&killed.stderr);
    assert_eq!(killed.status.code(), Some(137), "{said}");
    assert!(
        said.contains("was killed by SIGKILL (signal 9; exit code 137)"),
        "{said}"
    );
    let own = fence(&[
        "run", "--server", &url, "--job", "j5", "--", "sh", "-c", "exit 3",
    ]);
    let said = String::from_utf8_lossy(&own.stderr);
    assert_eq!(own.status.code(), Some(3), "{said}");
    assert!(
        said.contains("exited 3 (the command's own code, not fence run's)"),
        "{said}"
    );

    let held = fence_line(&format!(
        "claim --server {} --job j3 --owner other --ttl 1h",
        url
    ));
    assert_eq!(held.status.code(), Some(0));
    let start = Instant::now();
    let blocked = fence_line(&format!(
        "run --server {} --job j3 --wait 500ms -- true",
        url
    ));
    assert_eq!(blocked.status.code(), Some(3));
    assert!(
        start.elapsed() >= Duration::from_millis(500),
        "it kept trying for --wait"
    );
}

/// Runs `fence` with each case's arguments (`|`-separated, so `a||b` has an empty middle
/// one) and checks that it exits 2 saying `want`; with `one_line`, in one line.
fn expect_usage(cases: &[(String, &str)], one_line: bool) {
    for (args, want) in cases {
        let args: Vec<&str> = args.split('|').collect();
        let out = fence(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(want), "{args:?}: {stderr} lacks {want:?}");
        if one_line {
            assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr}");
        }
    }
}

#[test]
fn bad_flags_exit_2_with_a_message() {
    let renew = |key: &str| format!("renew|--job|j|--owner|o|--generation|1|--lease-key|{key}");
    let long_key = "a".repeat(198);
    let cases: Vec<(String, &str)> = vec![
        ("claim|--job|".into(), "job id is empty"),
        ("claim|--job|a b".into(), "byte 0x20"),
        (
            "claim|--job|j|--ttl|50ms".into(),
            "below the minimum of 100 ms",
        ),
        ("claim|--job|j|--ttl|25h".into(), "above the maximum"),
        ("claim|--job|j|--ttl|ten".into(), "not a duration"),
        // A duration always has a unit, and a negative one is named as such, not taken
        // for an unknown flag.
        ("claim|--job|j|--ttl|30".into(), "has no unit; write 30s"),
        ("claim|--job|j|--ttl|0.5".into(), "has no unit; write 0.5s"),
        ("claim|--job|j|--ttl|-5s".into(), "cannot be negative"),
        (
            "run|--job|j|--grace|-1s|--|true".into(),
            "cannot be negative",
        ),
        (
            "server|--data-dir|x|--idle-timeout|60".into(),
            "has no unit; write 60s",
        ),
        (
            "renew|--job|j|--owner|o|--generation|-1".into(),
            "generation",
        ),
        ("run|--job|j".into(), "COMMAND"),
        ("server".into(), "--data-dir"),
        ("proxy|--data-dir|x".into(), "--upstream"),
        (
            "proxy|--data-dir|x|--upstream|http://a|--workers|0".into(),
            "--workers",
        ),
        ("frobnicate".into(), "unrecognized subcommand"),
        // The flags of contract v2 sections 4 and 7: empty, short, oversized, wrong kind.
        (renew(""), "22 to 128 base64url characters, got 0"),
        (renew("short"), "22 to 128 base64url characters, got 5"),
        (renew("k0123456789abcdefghij+"), "character 21 is not"),
        (renew(&long_key), "got 198"),
        ("claim|--job|j|--server|".into(), "invalid server URL"),
        (
            "claim|--job|j|--server|ftp://x".into(),
            "expected http://host:port or https://host:port",
        ),
        ("claim|--job|j|--owner|".into(), "owner is empty"),
        (
            "server|--data-dir|x|--header-timeout|0s".into(),
            "a timeout must be from 1ms to 24h",
        ),
        (
            "server|--data-dir|x|--idle-timeout|25h".into(),
            "a timeout must be from 1ms to 24h",
        ),
        (
            "proxy|--data-dir|x|--upstream|http://a|--upstream-idle-timeout|0s".into(),
            "a timeout must be from 1ms to 24h",
        ),
        (
            "server|--data-dir|x|--max-connections|0".into(),
            "--max-connections",
        ),
        (
            "server|--data-dir|x|--max-connections|many".into(),
            "--max-connections",
        ),
        (
            "server|--data-dir|x|--auth-file".into(),
            "a value is required",
        ),
        ("server|--data-dir|x|--tls-key|k.pem".into(), "--tls-cert"),
        (
            "proxy|--data-dir|x|--upstream|ftp://127.0.0.1:1".into(),
            "only http:// and https:// upstreams",
        ),
    ];
    expect_usage(&cases, false);
    // Files named by flags: missing, empty, unusable; the answer is one line.
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty");
    std::fs::write(&empty, "").unwrap();
    let missing = dir.path().join("missing");
    let (empty, missing) = (empty.to_str().unwrap(), missing.to_str().unwrap());
    let https = "claim|--job|j|--server|https://127.0.0.1:1|--ca-cert";
    let cases: Vec<(String, &str)> = vec![
        (
            format!("claim|--job|j|--auth-token-file|{missing}"),
            "cannot read --auth-token-file",
        ),
        (
            format!("claim|--job|j|--auth-token-file|{empty}"),
            "must be 16 to 256 characters",
        ),
        (format!("{https}|{empty}"), "no CERTIFICATE in it"),
        (format!("{https}|{missing}"), "CA file"),
        (
            format!(
                "proxy|--data-dir|x|--upstream|https://127.0.0.1:1|--upstream-ca-cert|{missing}"
            ),
            "CA file",
        ),
    ];
    expect_usage(&cases, true);
    let out = fence(&["status", "--server", "http://127.0.0.1:1", "--job", "j"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot reach"));
}

/// A keyed request the upstream has (and may have acted on) when the proxy is SIGKILLed:
/// after the restart its record is still in flight, so the client's retry gets 409 and is
/// not run a second time. (The in-flight record was once written without waiting for the
/// disk; the fault harness then found writes applied twice.)
#[test]
fn a_keyed_request_in_flight_when_the_proxy_is_killed_is_not_run_twice() {
    let dir = tempfile::tempdir().unwrap();
    // An upstream that takes the request and never answers: its effect may have happened.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let upstream = listener.local_addr().unwrap().to_string();
    let (got, arrived) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let got = got.clone();
            std::thread::spawn(move || {
                let mut lines = BufReader::new(&stream).lines();
                while lines.next().is_some_and(|l| l.is_ok_and(|l| !l.is_empty())) {}
                let _ = got.send(());
                std::thread::sleep(Duration::from_secs(30));
                drop(stream);
            });
        }
    });
    let (proxy, addr) = start_proxy(dir.path(), &upstream);
    let headers = vec![
        ("X-Fencing-Job", "job-pay".to_owned()),
        ("X-Fencing-Token", "3".to_owned()),
        ("Idempotency-Key", "\"pay-1\"".to_owned()),
    ];
    let first = {
        let (addr, headers) = (addr.clone(), headers.clone());
        std::thread::spawn(move || exchange(&addr, "POST", "/pay", &headers, "10 EUR"))
    };
    arrived
        .recv_timeout(Duration::from_secs(10))
        .expect("the upstream got the request");
    signal(&proxy, "-KILL");
    drop(proxy);
    let _ = first.join();

    let (_proxy, addr) = start_proxy(dir.path(), &upstream);
    let (status, answer) = exchange(&addr, "POST", "/pay", &headers, "10 EUR");
    assert_eq!(status, 409, "{answer}");
    assert!(
        answer.contains("urn:fence:idempotency-in-flight"),
        "{answer}"
    );
    assert!(
        arrived.try_recv().is_err(),
        "the retry reached the upstream: the effect could run twice"
    );
}

#[test]
fn proxy_killed_with_sigkill_keeps_every_accepted_generation() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = start_upstream();
    let (proxy, addr) = start_proxy(dir.path(), &upstream);
    let fenced = |job: &str, token: u64| {
        vec![
            ("X-Fencing-Job", job.to_owned()),
            ("X-Fencing-Token", token.to_string()),
        ]
    };
    for i in 0..20 {
        assert_eq!(
            http_status(
                &addr,
                "POST",
                "/effects",
                &fenced(&format!("job-{i}"), 5 + i)
            ),
            200
        );
    }
    signal(&proxy, "-KILL");
    drop(proxy);
    let (_proxy, addr) = start_proxy(dir.path(), &upstream);
    for i in 0..20 {
        let job = format!("job-{i}");
        assert_eq!(
            http_status(&addr, "POST", "/effects", &fenced(&job, 4 + i)),
            409,
            "{job}: older token after restart"
        );
        assert_eq!(
            http_status(&addr, "POST", "/effects", &fenced(&job, 5 + i)),
            200,
            "{job}: same token after restart"
        );
    }
    assert_eq!(http_status(&addr, "POST", "/effects", &[]), 428);
    assert_eq!(
        http_status(&addr, "GET", "/anything", &[]),
        200,
        "safe methods pass unfenced"
    );
}

#[test]
fn server_and_proxy_exit_0_on_sigterm_and_keep_their_data() {
    let dir = tempfile::tempdir().unwrap();
    let (server, url) = start_server(&dir.path().join("leases"));
    assert_eq!(
        fence(&[
            "claim", "--server", &url, "--job", "graceful", "--owner", "w"
        ])
        .status
        .code(),
        Some(0)
    );
    exits_0_on(server, "-TERM", "fence server");
    let (_server, url) = start_server(&dir.path().join("leases"));
    assert_eq!(
        json(&fence(&["status", "--server", &url, "--job", "graceful"]))["generation"],
        1
    );

    let upstream = start_upstream();
    let (proxy, addr) = start_proxy(&dir.path().join("proxy"), &upstream);
    let fenced = vec![
        ("X-Fencing-Job", "graceful".to_owned()),
        ("X-Fencing-Token", "3".to_owned()),
    ];
    assert_eq!(http_status(&addr, "POST", "/", &fenced), 200);
    exits_0_on(proxy, "-INT", "fence proxy");
    let (_proxy, addr) = start_proxy(&dir.path().join("proxy"), &upstream);
    let stale = vec![
        ("X-Fencing-Job", "graceful".to_owned()),
        ("X-Fencing-Token", "2".to_owned()),
    ];
    assert_eq!(http_status(&addr, "POST", "/", &stale), 409);
}

#[test]
fn fence_run_releases_the_job_when_the_command_cannot_start() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, url) = start_server(dir.path());
    let out = fence_line(&format!(
        "run --server {} --job j --ttl 1h -- /nonexistent/command",
        url
    ));
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("the job was released"));
    assert_eq!(
        json(&fence(&["status", "--server", &url, "--job", "j"]))["state"],
        "free",
        "not held for the 1 h ttl"
    );
}

#[test]
fn forgetting_and_max_ttl_settings_are_checked_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys");
    assert!(
        fence(&["keygen", "--out", keys.to_str().unwrap()])
            .status
            .success()
    );
    let verify = keys.join("fence-verify.pem");
    let data = dir.path().join("d");
    let (verify, data) = (verify.to_str().unwrap(), data.to_str().unwrap());
    let proxy = format!(
        "proxy|--listen|127.0.0.1:0|--admin-listen|127.0.0.1:0|--upstream|http://127.0.0.1:9|--data-dir|{data}"
    );
    let server = format!("server|--data-dir|{data}");
    let cases: Vec<(String, &str)> = vec![
        (format!("{proxy}|--forget-after|1h"), "needs signed tokens"),
        (
            format!("{proxy}|--forget-after|1h|--verify-key|{verify}"),
            "shorter than the longest lease TTL (86400s) plus twice the clock skew (5s)",
        ),
        (
            format!(
                "{proxy}|--forget-after|40s|--verify-key|{verify}|--max-lease-ttl|30s|--clock-skew|6s"
            ),
            "shorter than the longest lease TTL",
        ),
        (
            format!("{proxy}|--forget-after|500ms"),
            "from 1s to 10 years",
        ),
        (format!("{server}|--max-ttl|50ms"), "below the minimum"),
        (format!("{server}|--max-ttl|25h"), "above the maximum"),
        (format!("{server}|--forget-after|0s"), "from 1s to 10 years"),
    ];
    expect_usage(&cases, false);
    // A valid setting starts (and is stopped at once).
    let (_proxy, _) = start_proxy_with(
        "http://127.0.0.1:9",
        &[
            "--data-dir",
            data,
            "--verify-key",
            verify,
            "--max-lease-ttl",
            "30s",
            "--forget-after",
            "40s",
        ],
    );
}

/// A proxy that forgets idle jobs on a data directory records it there: restarted on it
/// without `--verify-key`, it would admit a stale token of a forgotten job as the first of
/// a new job (checking no expiry), and that old holder's write would commit after the newer
/// holder's. So it refuses to start, exit 2 naming the flag; with the key it starts.
#[test]
fn a_proxy_without_verify_keys_will_not_start_where_jobs_were_forgotten() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys");
    assert!(
        fence(&["keygen", "--out", keys.to_str().unwrap()])
            .status
            .success()
    );
    let verify = keys.join("fence-verify.pem");
    let data = dir.path().join("d");
    let (verify, data) = (verify.to_str().unwrap(), data.to_str().unwrap());
    let upstream = "http://127.0.0.1:9";
    let forgetting = [
        "--data-dir",
        data,
        "--verify-key",
        verify,
        "--max-lease-ttl",
        "30s",
        "--forget-after",
        "40s",
    ];
    let (proxy, _) = start_proxy_with(upstream, &forgetting);
    exits_0_on(proxy, "-TERM", "the proxy that forgets");

    let mut unkeyed = Command::new(FENCE)
        .args(proxy_args(upstream, &["--data-dir", data]))
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let status = loop {
        if let Some(status) = unkeyed.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > Duration::from_secs(20) {
            let _ = unkeyed.kill();
            let _ = unkeyed.wait();
            panic!("a proxy without --verify-key started on a data dir where jobs were forgotten");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut said = String::new();
    std::io::Read::read_to_string(&mut unkeyed.stderr.take().unwrap(), &mut said).unwrap();
    assert_eq!(status.code(), Some(2), "{said}");
    assert!(said.contains("--verify-key"), "{said}");
    assert!(said.contains("--data-dir"), "{said}");
    assert!(said.contains("a proxy with --forget-after ran"), "{said}");
    assert!(said.contains(data), "the path: {said}");
    assert!(said.contains("clock skew 5s, longest lease 30s"), "{said}");
    assert!(!said.contains("give it a new --data-dir"), "{said}");

    let (_proxy, _) = start_proxy_with(upstream, &["--data-dir", data, "--verify-key", verify]);
}

/// A data directory whose `running` record (how long the proxy before let requests run)
/// is damaged refuses to start a proxy, naming the record and how to clear it: read as none,
/// a restart with a shorter --upstream-timeout would let a newer token pass while an older
/// request can still commit. `--clear-running-record` removes it, and the proxy starts.
#[test]
fn a_damaged_running_record_refuses_the_proxy_until_cleared() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("d");
    {
        let db = fence_storage::disk::DurableDb::open(&data).unwrap();
        let format = db.tree("format").unwrap();
        format.insert(b"running", &b"short"[..]).unwrap();
        db.flush_now().unwrap();
    }
    let data = data.to_str().unwrap();
    let upstream = "http://127.0.0.1:9";
    let out = Command::new(FENCE)
        .args(proxy_args(upstream, &["--data-dir", data]))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{said}");
    assert!(said.contains("`running` record"), "{said}");
    assert!(said.contains(data), "{said}");
    assert!(said.contains("--clear-running-record"), "{said}");
    let (_proxy, _) = start_proxy_with(upstream, &["--data-dir", data, "--clear-running-record"]);
}

#[test]
fn the_server_caps_ttls_at_max_ttl_and_forgets_idle_jobs() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, addr) = start_ready(&server_args(
        dir.path().to_str().unwrap(),
        &["--max-ttl", "10s", "--forget-after", "1s"],
    ));
    let url = format!("http://{addr}");
    let lease = json(&fence_line(&format!(
        "claim --server {} --job j --ttl 1h",
        url
    )));
    assert_eq!(lease["ttl_ms"], 10_000, "capped: {lease}");
    assert_eq!(release(&url, "j", &lease).status.code(), Some(0));
    // Forgotten by a pass of the server's maintenance (every 250 ms) once 1 s idle.
    let status = || fence(&["status", "--server", &url, "--job", "j"]);
    eventually(
        "the released job is forgotten",
        Duration::from_secs(10),
        || status().status.code() == Some(1),
    );
    let out = status();
    assert_eq!(out.status.code(), Some(1), "forgotten: 404");
    assert!(String::from_utf8_lossy(&out.stderr).contains("or was forgotten"));
    let again = json(&fence(&["claim", "--server", &url, "--job", "j"]));
    assert_eq!(again["generation"], 2, "above the floor: {again}");
    let fresh = json(&fence(&["claim", "--server", &url, "--job", "never-seen"]));
    assert_eq!(fresh["generation"], 2, "a new job starts at floor + 1");
}

/// Lease keys are base64url, so one in 64 starts with `-`: `--lease-key -Ab...` is a key,
/// not an unknown flag (found when such a key made a test fail now and then).
#[test]
fn a_lease_key_that_starts_with_a_dash_is_a_key() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, url) = start_server(dir.path());
    let lease = json(&fence_line(&format!("claim --server {url} --job dash")));
    let key = format!("-{}", "A".repeat(30));
    let out = fence(&[
        "release",
        "--server",
        &url,
        "--job",
        "dash",
        "--owner",
        lease["owner"].as_str().unwrap(),
        "--generation",
        "1",
        "--lease-key",
        &key,
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("unexpected argument"), "{stderr}");
    assert!(
        stderr.contains("lease key"),
        "the server judged the key: {stderr}"
    );
}

/// A lease key that does not check is never repeated on stderr, from the flag or from
/// `FENCE_LEASE_KEY`: the usual mistake is the real key in quotes (`jq` without `-r`, an env
/// file's quoted line), and stderr goes to CI and container logs. Nor is a `--store` that
/// is not a postgres:// URL, which may hold a password.
#[test]
fn a_lease_key_or_store_url_that_does_not_check_is_not_repeated() {
    let key = "Zk9yZ2V0TWVOb3RTZWNyZXRLZXk0Mg";
    let quoted = format!("\"{key}\"");
    let renew = ["renew", "--job", "j", "--owner", "o", "--generation", "1"];
    let by_flag = fence(&[&renew[..], &["--lease-key", &quoted]].concat());
    let by_env = Command::new(FENCE)
        .args(renew)
        .env("FENCE_LEASE_KEY", &quoted)
        .output()
        .unwrap();
    for out in [by_flag, by_env] {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains("character 0 is not"), "the cause: {stderr}");
        assert!(!stderr.contains(key), "the key was repeated: {stderr}");
    }
    // A --store that is not a postgres:// URL may still carry a password.
    for store in [
        "host=db user=fence password=S3cretPw",
        "postgresql+psycopg://fence:S3cretPw@db/fence",
        "\"postgres://fence:S3cretPw@db/fence\"",
    ] {
        let out = Command::new(FENCE)
            .arg("server")
            .env("FENCE_STORE", store)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains("expected a postgres://"), "{stderr}");
        assert!(
            !stderr.contains("S3cretPw"),
            "the password was repeated: {stderr}"
        );
    }
    // A postgres:// URL whose TLS options do not go together is usage too (exit 2), and
    // its password is not repeated either.
    let out = Command::new(FENCE)
        .args(["server", "--listen", "127.0.0.1:0"])
        .env(
            "FENCE_STORE",
            "postgres://fence:S3cretPw@127.0.0.1:1/fence?sslrootcert=/etc/ca.pem",
        )
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("sslrootcert"), "{stderr}");
    assert!(!stderr.contains("S3cretPw"), "{stderr}");
}

/// A claim answered 503 by a store that failed may have been granted under a lease key that
/// only the command knew: `fence claim` says so and what to do, since the server's advice
/// (retry with the same key) cannot be followed from the command line.
#[test]
fn a_claim_of_unknown_outcome_says_the_key_is_gone_and_what_to_check() {
    let failing = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", failing.local_addr().unwrap());
    std::thread::spawn(move || {
        use std::io::{Read as _, Write as _};
        for stream in failing.incoming().take(8) {
            let Ok(mut stream) = stream else { continue };
            let _ = stream.read(&mut [0; 8192]);
            let body = r#"{"type":"urn:fence:store-unavailable","title":"Store unavailable","status":503,"detail":"the lease store failed; whether the request took effect is unknown: retry with the same owner and lease key"}"#;
            let _ = write!(
                stream,
                "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/problem+json\r\nretry-after: 1\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    let out = fence(&["claim", "--server", &url, "--job", "pay-9"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        stderr.contains("whether the claim was granted is unknown")
            && stderr.contains("fence status --server")
            && stderr.contains("--job pay-9"),
        "{stderr}"
    );
    assert!(!stdout.contains("lease_key"), "{stdout}");
}

/// `fence idempotency-key` prints the key of a job's step that every holder derives alike,
/// as docs/protocol.md describes it (computed here independently, as another language would).
#[test]
fn the_idempotency_key_of_a_step_is_the_same_for_every_holder() {
    let out = fence(&["idempotency-key", "--job", "invoice-42", "--step", "charge"]);
    assert_success(&out);
    let key = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        key.trim(),
        "fence-94_3LSyI-83UpFvMYZSTMad586VO_w3O3VjtR9m8yGY"
    );
    let other = fence(&["idempotency-key", "--job", "invoice-42", "--step", "refund"]);
    assert_ne!(String::from_utf8(other.stdout).unwrap(), key);
    let bad = fence(&["idempotency-key", "--job", "a b", "--step", "charge"]);
    assert_eq!(bad.status.code(), Some(2));
}

/// A data directory another fence process holds: one line naming it, exit 1, for the server
/// and for the proxy (issue 19 saw `Os { code: 11, kind: WouldBlock }` here).
#[test]
fn a_data_directory_in_use_is_one_line_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, _url) = start_server(dir.path());
    let path = dir.path().to_str().unwrap();
    for args in [
        vec!["server", "--listen", "127.0.0.1:0", "--data-dir", path],
        proxy_args("http://127.0.0.1:9", &["--data-dir", path]),
    ] {
        let out = fence(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
        assert!(
            stderr.contains(&format!(
                "another fence process is using the data directory {path}"
            )),
            "{stderr}"
        );
        assert!(
            !stderr.contains("WouldBlock") && !stderr.contains("ready"),
            "{stderr}"
        );
    }
}

/// Sends `sig` to `p` and asserts that it exits 0.
fn exits_0_on(mut p: Proc, sig: &str, what: &str) {
    signal(&p, sig);
    assert_eq!(
        p.0.wait().unwrap().code(),
        Some(0),
        "{what} exits 0 on {sig}"
    );
}

/// A CLI for scripts (issue 34): renew, release and complete take the claim's JSON from a
/// file or stdin; `fence keepalive` renews it while stdin is open (copying it to stdout),
/// exits 75 the moment it is lost, and 0 (the lease still held) when stdin closes.
#[test]
fn scripts_pass_the_claims_json_and_keepalive_renews_until_stdin_closes() {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let (_server, url) = start_server(dir.path());
    let claim = |job: &str| {
        let out = fence(&["claim", "--server", &url, "--job", job, "--ttl", "3s"]);
        assert_success(&out);
        let file = dir.path().join(format!("{}.json", job.replace('/', "_")));
        std::fs::write(&file, &out.stdout).unwrap();
        file
    };
    let with_stdin = |args: &[&str], input: &[u8]| {
        let mut child = Command::new(FENCE)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(input).unwrap();
        child.wait_with_output().unwrap()
    };
    // The one-shot calls, from a file and from stdin, on a job id that needs encoding.
    let lease = claim("a/b");
    let file = lease.to_str().unwrap();
    assert_success(&fence(&["renew", "--server", &url, "--lease", file]));
    let text = std::fs::read(&lease).unwrap();
    let released = with_stdin(&["release", "--server", &url, "--lease", "-"], &text);
    assert_success(&released);
    assert_eq!(json(&released)["state"], "free");
    let other = fence(&["complete", "--server", &url, "--lease", file, "--job", "c"]);
    assert_eq!(other.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&other.stderr).contains("not of --job c"));
    // Under `fence run`, FENCE_JOB names that run's job: a lease file of another job is
    // finished as the file says, not refused as a mismatch.
    let nested = claim("nested");
    // A FENCE_LEASE_KEY exported for another lease (as the docs advise) is not read with
    // --lease either: it made every --lease call a usage error (exit 2), and `fence
    // keepalive --lease` renewed nothing while the work ran.
    let out = Command::new(FENCE)
        .args(["complete", "--server", &url, "--lease"])
        .arg(&nested)
        .env("FENCE_JOB", "outer")
        .env("FENCE_LEASE_KEY", "T3RoZXJMZWFzZXNLZXlOb3RUaGlzT25lNDI")
        .output()
        .unwrap();
    assert_success(&out);
    assert_eq!(json(&out)["state"], "completed");
    // Without --lease, FENCE_JOB still stands in for --job.
    let claimed = fence(&[
        "claim", "--server", &url, "--job", "from-env", "--ttl", "3s",
    ]);
    let body = json(&claimed);
    let generation = body["generation"].to_string();
    let out = Command::new(FENCE)
        .args(["release", "--server", &url, "--owner"])
        .args([body["owner"].as_str().unwrap(), "--generation", &generation])
        .env("FENCE_JOB", "from-env")
        .env("FENCE_LEASE_KEY", body["lease_key"].as_str().unwrap())
        .output()
        .unwrap();
    assert_success(&out);
    assert_eq!(json(&out)["state"], "free");
    let broken = with_stdin(
        &["release", "--server", &url, "--lease", "-"],
        b"{\"job\":\"x\"}",
    );
    assert_eq!(broken.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&broken.stderr).contains("no \"owner\" field"));

    // keepalive: renewed past its 3 s TTL while stdin is open, then lost at a revoke: 75.
    let lease = claim("kept");
    let mut kept = Command::new(FENCE)
        .args(["keepalive", "--server", &url, "--ttl", "3s", "--lease"])
        .arg(&lease)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = kept.stdin.take().unwrap();
    input.write_all(b"progress 1\n").unwrap();
    let mut echoed = BufReader::new(kept.stdout.take().unwrap());
    let mut line = String::new();
    echoed.read_line(&mut line).unwrap();
    assert_eq!(line, "progress 1\n", "stdin is copied to stdout");
    std::thread::sleep(Duration::from_millis(4_000));
    let status = json(&fence(&["status", "--server", &url, "--job", "kept"]));
    assert_eq!(status["state"], "held", "renewed past its TTL: {status}");
    let revoked = Instant::now();
    assert_success(&fence(&["revoke", "--server", &url, "--job", "kept"]));
    let code = kept.wait().unwrap().code();
    let mut said = String::new();
    kept.stderr
        .take()
        .unwrap()
        .read_to_string(&mut said)
        .unwrap();
    assert_eq!(code, Some(75), "{said}");
    assert!(said.contains("is lost"), "{said}");
    assert!(
        revoked.elapsed() < Duration::from_secs(3),
        "{:?}",
        revoked.elapsed()
    );
    drop(input);

    // Closing stdin ends it with 0, the lease still held for the script to complete.
    let lease = claim("closed");
    let out = with_stdin(
        &[
            "keepalive",
            "--server",
            &url,
            "--lease",
            lease.to_str().unwrap(),
        ],
        b"",
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let done = fence(&[
        "complete",
        "--server",
        &url,
        "--lease",
        lease.to_str().unwrap(),
    ]);
    assert_success(&done);
    assert_eq!(json(&done)["state"], "completed");
    // Its lifeline cannot also be where the lease comes from.
    let out = fence(&["keepalive", "--server", &url, "--lease", "-"]);
    assert_eq!(out.status.code(), Some(2));
}

/// `--server` with several URLs (servers on one database): a server that cannot be
/// connected to is passed over; one that took the request and failed is not, since the
/// request may have been decided there (issue 34).
#[test]
fn several_servers_fail_over_on_connection_errors_only() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, url) = start_server(dir.path());
    // Nothing listens on a port we bound and closed.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let both = format!("{dead},{url}");
    let claimed = fence(&["claim", "--server", &both, "--job", "over"]);
    assert_success(&claimed);
    assert_eq!(json(&claimed)["generation"], 1);
    let lease = dir.path().join("lease.json");
    std::fs::write(&lease, &claimed.stdout).unwrap();
    let run = fence(&["run", "--server", &both, "--job", "run-over", "--", "true"]);
    assert_success(&run);
    // A "server" that reads the request and closes without an answer: the request may have
    // been decided there, so the live server is not asked.
    let taker = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = format!("http://{}", taker.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in taker.incoming().flatten() {
            let mut reader = BufReader::new(&stream);
            let mut line = String::new();
            while reader.read_line(&mut line).is_ok_and(|n| n > 2) {
                line.clear();
            }
            drop(stream);
        }
    });
    let out = fence(&[
        "claim",
        "--server",
        &format!("{taken},{url}"),
        "--job",
        "not-over",
    ]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let status = fence(&["status", "--server", &url, "--job", "not-over"]);
    assert_eq!(
        status.status.code(),
        Some(1),
        "the live server was not asked"
    );
    assert!(String::from_utf8_lossy(&status.stdout).contains("urn:fence:unknown-job"));
}

/// A server that drops connection attempts without a word (a host gone from the network):
/// the next server is still asked in time, since one attempt gets only its share of the
/// call's timeout (at most 2 s), not all 10 s of it.
#[test]
fn a_silent_server_is_passed_over_before_the_call_times_out() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, url) = start_server(dir.path());
    // A listener whose accept queue holds one connection, filled: the kernel drops every
    // further SYN, so a connect hangs as it would to a vanished host.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .unwrap();
    let (_listener, silent) = rt.block_on(async {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener = socket.listen(0).unwrap();
        let addr = listener.local_addr().unwrap();
        (listener, addr)
    });
    let _queued = std::net::TcpStream::connect(silent).unwrap();
    let started = Instant::now();
    let out = fence(&[
        "claim",
        "--server",
        &format!("http://{silent},{url}"),
        "--job",
        "silent",
    ]);
    let took = started.elapsed();
    assert_success(&out);
    assert!(
        took < Duration::from_secs(5),
        "the live server was asked only after {took:?}"
    );
}

/// A server that is down: fence run says so once, then how often again (issue 34: it said
/// the same line nine times a second).
#[test]
fn a_repeated_warning_is_said_once_with_a_count() {
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let out = fence(&[
        "run", "--server", &dead, "--job", "j", "--wait", "2s", "--", "true",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(said.matches("claim failed, retrying").count(), 1, "{said}");
    assert!(said.contains("(the warning above came"), "{said}");
}

/// `fence keygen` never overwrites a key, and never leaves half a pair: with the public key's
/// name taken, it writes nothing (a private key without its public half would refuse every
/// later run).
#[test]
fn keygen_writes_both_keys_or_neither() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("fence-verify.pem"), "an older key").unwrap();
    let out = fence(&["keygen", "--out", dir.path().to_str().unwrap()]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(
        said.contains("fence-verify.pem: it is already there"),
        "{said}"
    );
    assert!(said.contains("never overwritten"), "{said}");
    assert!(
        !dir.path().join("fence-signing.pem").exists(),
        "a private key was left without its public half"
    );
}

/// An upstream given with a password is refused without repeating the password: the error
/// lands in the journal.
#[test]
fn an_upstream_with_a_password_is_refused_without_showing_it() {
    let dir = tempfile::tempdir().unwrap();
    let out = fence(&[
        "proxy",
        "--upstream",
        "http://u:hunter2@127.0.0.1:9/",
        "--data-dir",
        dir.path().to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("hunter2"), "{stderr}");
    assert!(stderr.contains("user info"), "{stderr}");
    // A password with '/' (no longer user info to a URL parser) or a space (no URL at all),
    // from the flag or the environment: refused, not repeated.
    for (upstream, secret) in [
        ("http://u:hunt/er2@127.0.0.1:9/", "er2"),
        ("http://u:hunt er2@127.0.0.1:9/", "er2"),
    ] {
        // Bounded: read as a URL, the first would start a proxy (host "u").
        let out = Command::new("timeout")
            .args(["10", FENCE, "proxy", "--listen", "127.0.0.1:0"])
            .args(["--data-dir", dir.path().to_str().unwrap()])
            .env("FENCE_UPSTREAM", upstream)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{upstream}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains(secret), "{upstream}: {stderr}");
        assert!(stderr.contains("--upstream"), "{upstream}: {stderr}");
    }
}

/// `fence keepalive` on a fresh lease of `job`, its stdout a pipe nobody reads and far more
/// than a pipe holds fed to its stdin by the returned thread: its copy to stdout stalls.
fn keepalive_with_a_stalled_reader(
    url: &str,
    dir: &std::path::Path,
    job: &str,
) -> (std::process::Child, std::thread::JoinHandle<()>) {
    use std::io::Write;
    let out = fence(&["claim", "--server", url, "--job", job, "--ttl", "3s"]);
    assert_success(&out);
    let lease = dir.join(format!("{job}.json"));
    std::fs::write(&lease, &out.stdout).unwrap();
    let mut kept = Command::new(FENCE)
        .args(["keepalive", "--server", url, "--ttl", "3s", "--lease"])
        .arg(&lease)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped()) // never read: the pipe fills
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = kept.stdin.take().unwrap();
    // The writes block once keepalive stops reading.
    let feeder = std::thread::spawn(move || {
        let chunk = vec![b'x'; 64 * 1024];
        for _ in 0..32 {
            if input.write_all(&chunk).is_err() {
                return;
            }
        }
    });
    std::thread::sleep(Duration::from_millis(500));
    assert!(kept.try_wait().unwrap().is_none(), "keepalive ended early");
    (kept, feeder)
}

/// The exit code of `child` within 10 s of now (killed and `None` if it has not ended), and
/// what it wrote to stderr.
fn ended_within_10s(mut child: std::process::Child) -> (Option<i32>, String) {
    use std::io::Read;
    let since = Instant::now();
    let mut code = None;
    while code.is_none() && since.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
        code = child.try_wait().unwrap().map(|s| s.code());
    }
    if code.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    drop(child.stdout.take());
    let mut said = String::new();
    if let Some(mut stderr) = child.stderr.take() {
        let _ = stderr.read_to_string(&mut said);
    }
    (code.flatten(), said)
}

/// `fence keepalive --token-file` leaves no token behind, lost or stopped: the file was
/// emptied by a task that the exit could abort before it ran, so a script reading it before
/// each write could still find the token of a revoked lease, or, after a stop, that of a
/// lease no longer renewed and soon ended. Each round is a race; five make it show.
#[test]
fn keepalive_leaves_its_token_file_empty_however_it_ends() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, url) = start_server(dir.path());
    for round in 0..6 {
        let job = format!("kept-{round}");
        let out = fence(&["claim", "--server", &url, "--job", &job, "--ttl", "5s"]);
        assert_success(&out);
        let lease = dir.path().join(format!("{job}.json"));
        std::fs::write(&lease, &out.stdout).unwrap();
        let token_file = dir.path().join(format!("{job}.token"));
        let mut kept = Command::new(FENCE)
            .args(["keepalive", "--server", &url, "--ttl", "5s", "--lease"])
            .arg(&lease)
            .arg("--token-file")
            .arg(&token_file)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let input = kept.stdin.take().unwrap();
        eventually("the token in the file", Duration::from_secs(10), || {
            std::fs::read_to_string(&token_file).is_ok_and(|t| t == "1\n")
        });
        // Odd rounds stop (stdin closes: exit 0), even ones lose the lease (exit 75).
        let expected = if round % 2 == 1 {
            drop(input);
            0
        } else {
            assert_success(&fence(&["revoke", "--server", &url, "--job", &job]));
            75
        };
        let (code, said) = ended_within_10s(kept);
        assert_eq!(code, Some(expected), "round {round}: {said}");
        assert_eq!(
            std::fs::read_to_string(&token_file).unwrap(),
            "",
            "round {round}: a token was left in the file after exit {expected}"
        );
    }
}

/// `fence keepalive` whose reader stalls (a full pipe) still exits 75 the moment the lease is
/// lost: the copy to stdout does not hold back the loss.
#[test]
fn keepalive_exits_at_the_loss_while_its_reader_stalls() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, url) = start_server(dir.path());
    let (kept, feeder) = keepalive_with_a_stalled_reader(&url, dir.path(), "stalled");
    assert_success(&fence(&["revoke", "--server", &url, "--job", "stalled"]));
    let (code, said) = ended_within_10s(kept);
    assert_eq!(
        code,
        Some(75),
        "not ended by the loss within 10 s while its stdout was full: {said}"
    );
    feeder.join().unwrap();
}

/// ...and a SIGTERM stops it then too, the usual way: exit 0, the lease still held.
#[test]
fn keepalive_stops_at_a_signal_while_its_reader_stalls() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, url) = start_server(dir.path());
    let (kept, feeder) = keepalive_with_a_stalled_reader(&url, dir.path(), "signalled");
    // Not before it catches SIGTERM: until then (a loaded machine) the default action would
    // end it, which is not what this test is about.
    let catches_term = || {
        std::fs::read_to_string(format!("/proc/{}/status", kept.id()))
            .ok()
            .and_then(|status| {
                let mask = status.lines().find_map(|l| l.strip_prefix("SigCgt:"))?;
                u64::from_str_radix(mask.trim(), 16).ok()
            })
            .is_some_and(|mask| mask & (1 << (nix::sys::signal::Signal::SIGTERM as u32 - 1)) != 0)
    };
    eventually(
        "keepalive catches SIGTERM",
        Duration::from_secs(10),
        catches_term,
    );
    let killed = Command::new("kill")
        .args(["-TERM", &kept.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let (code, said) = ended_within_10s(kept);
    assert_eq!(code, Some(0), "not stopped by SIGTERM within 10 s: {said}");
    assert!(said.contains("stopped renewing"), "{said}");
    feeder.join().unwrap();
}
