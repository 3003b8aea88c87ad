//! What an operator relies on (contract section 10): metrics a Prometheus parser reads, with
//! HELP and histograms; one JSON log event per decision with `job` and `generation`; the
//! proxy's view of a job; completions and a manual page.

mod common;

use std::{
    collections::BTreeSet,
    process::Command,
    time::{Duration, Instant},
};

use common::*;

/// The families of a scrape, each checked to have HELP and TYPE; returns the parsed scrape.
fn scrape(addr: &str, bearer: Option<&str>) -> prometheus_parse::Scrape {
    let (status, answer) = bearer_call(addr, "GET", "/metrics", bearer, "");
    assert_eq!(status, 200, "{answer}");
    let body = answer
        .split("\r\n\r\n")
        .nth(1)
        .unwrap_or_default()
        .to_owned();
    let lines: Vec<String> = body.lines().map(str::to_owned).collect();
    let typed: BTreeSet<&str> = lines
        .iter()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    let helped: BTreeSet<&str> = lines
        .iter()
        .filter_map(|l| l.strip_prefix("# HELP "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert!(!typed.is_empty(), "no metric families: {body}");
    assert_eq!(typed, helped, "every family has HELP and TYPE:\n{body}");
    prometheus_parse::Scrape::parse(lines.into_iter().map(Ok)).expect("Prometheus text format")
}

/// The histogram `name`'s buckets (upper bounds) in `scrape`.
fn buckets(scrape: &prometheus_parse::Scrape, name: &str) -> Vec<f64> {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == name)
        .find_map(|s| match &s.value {
            prometheus_parse::Value::Histogram(h) => Some(h.iter().map(|b| b.less_than).collect()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("{name} is not a histogram: {:?}", scrape.samples))
}

fn gauge(scrape: &prometheus_parse::Scrape, name: &str) -> f64 {
    scrape
        .samples
        .iter()
        .find(|s| s.metric == name)
        .and_then(|s| match s.value {
            prometheus_parse::Value::Gauge(v) => Some(v),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no gauge {name}"))
}

#[test]
fn metrics_of_server_and_proxy_parse_with_help_types_and_histograms() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, server) = start_server(&dir.path().join("leases"));
    let addr = server.trim_start_matches("http://").to_owned();
    let lease = json(&fence_line(&format!("claim --server {server} --job m1")));
    assert_eq!(lease["generation"], 1);
    let s = scrape(&addr, None);
    let b = buckets(&s, "fence_lease_request_seconds");
    assert!(
        b.len() >= 10 && b.contains(&0.001) && b.contains(&1.0),
        "{b:?}"
    );
    // HELP names every label value, the revoke included.
    let help = &s.docs["fence_lease_requests_total"];
    for word in [
        "revoke",
        "status",
        "list",
        "too_many_waiters",
        "key_mismatch",
    ] {
        assert!(help.contains(word), "{help}");
    }
    // The histogram's too (it said "by operation", naming none).
    let help = &s.docs["fence_lease_request_seconds"];
    for word in ["claim", "checkpoint", "claim_slot", "status", "list"] {
        assert!(help.contains(word), "{help}");
    }
    let build = s
        .samples
        .iter()
        .find(|x| x.metric == "fence_build_info")
        .expect("fence_build_info");
    assert_eq!(build.labels.get("version"), Some(env!("CARGO_PKG_VERSION")));
    // The held-lease and known-job gauges: counted at start (and every 15 s), so a server
    // started again on the same data shows the lease claimed before.
    assert_eq!(
        json(&fence_line(&format!("claim --server {server} --job m2")))["generation"],
        1
    );
    drop(_server);
    let (_server, server) = start_server(&dir.path().join("leases"));
    let addr = server.trim_start_matches("http://").to_owned();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let s = scrape(&addr, None);
        let counted = s.samples.iter().any(|x| x.metric == "fence_lease_jobs");
        if counted {
            assert_eq!(gauge(&s, "fence_lease_jobs"), 2.0, "m1 and m2");
            assert_eq!(gauge(&s, "fence_lease_held"), 2.0, "m1 and m2 are held");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the leases were never counted"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    let upstream = format!("http://{}", start_upstream());
    let data = dir.path().join("proxy");
    let (_proxy, proxy, admin) =
        start_proxy_admin(&upstream, &["--data-dir", data.to_str().unwrap()]);
    let write = |token: &str| fenced_post(&proxy, "/w", "m1", token);
    assert_eq!(write("2"), 200);
    assert_eq!(write("1"), 409);
    let p = scrape(&admin, None);
    let b = buckets(&p, "fence_proxy_upstream_seconds");
    assert!(b.len() >= 10, "{b:?}");
    assert_eq!(gauge(&p, "fence_proxy_cached_jobs"), 1.0);
    let help = &p.docs["fence_sink_requests_total"];
    for word in ["too_large", "body_failed", "too_long_lived", "stale"] {
        assert!(help.contains(word), "{help}");
    }
    for family in [
        "fence_proxy_upstream_seconds",
        "fence_proxy_upstream_requests_total",
    ] {
        let help = &p.docs[family];
        for word in ["ok", "unavailable", "timeout", "bad_target", "overloaded"] {
            assert!(help.contains(word), "{family}: {help}");
        }
    }
    assert_eq!(gauge(&p, "fence_proxy_in_flight"), 0.0);
    // The proxy's view of one job.
    let (status, answer) = bearer_call(&admin, "GET", "/v1/fence/m1", None, "");
    assert_eq!(status, 200, "{answer}");
    let body: serde_json::Value =
        serde_json::from_str(answer.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    assert_eq!(
        body,
        serde_json::json!({"job": "m1", "highest": 2, "in_flight": 0})
    );
    let (status, _) = bearer_call(&admin, "GET", "/v1/fence/never", None, "");
    assert_eq!(status, 200, "an unknown job has highest 0");
    let (status, _) = bearer_call(&admin, "GET", "/v1/fence/a%20b", None, "");
    assert_eq!(status, 400);
}

/// The JSON log events in `log` whose message contains `message` and whose `job` is `job`.
fn events(log: &Log, message: &str, job: &str) -> Vec<serde_json::Value> {
    log.text()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| {
            e["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.contains(message))
                && e["fields"]["job"] == job
        })
        .collect()
}

/// Exactly one event `message` for `job`, carrying `generation` as a number.
fn one_event(log: &Log, message: &str, job: &str, generation: u64) {
    // Decisions are logged as they are made: give the process a moment to write the line.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while events(log, message, job).is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(100));
    let found = events(log, message, job);
    assert_eq!(found.len(), 1, "one {message:?} for {job}:\n{}", log.text());
    assert_eq!(found[0]["fields"]["generation"], generation, "{}", found[0]);
}

fn claim_as(server: &str, job: &str, owner: &str, ttl: &str) -> Result<serde_json::Value, String> {
    let out = fence_line(&format!(
        "claim --server {server} --job {job} --owner {owner} --ttl {ttl}"
    ));
    if out.status.success() {
        Ok(json(&out))
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// A refused claim, a lost lease (server and worker side), a stale and an expired token:
/// one JSON event each, with the job and the generation as fields a log pipeline can index.
#[test]
fn every_decision_is_one_json_event_with_job_and_generation() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys");
    assert_success(&fence(&["keygen", "--out", keys.to_str().unwrap()]));
    let (server_proc, server, server_log) = start_logged(
        &[
            "--log-format",
            "json",
            "server",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            dir.path().join("leases").to_str().unwrap(),
            "--signing-key",
            keys.join("fence-signing.pem").to_str().unwrap(),
        ],
        "info",
    );
    let server = format!("http://{server}");
    let upstream = format!("http://{}", start_upstream());
    let (proxy_data, verify) = (dir.path().join("proxy"), keys.join("fence-verify.pem"));
    let (_proxy, proxy, proxy_log) = start_logged(
        &proxy_args(
            &upstream,
            &[
                "--log-format",
                "json",
                "--data-dir",
                proxy_data.to_str().unwrap(),
                "--verify-key",
                verify.to_str().unwrap(),
                "--clock-skew",
                "0s",
            ],
        ),
        "info",
    );
    let write = |job: &str, token: &str| fenced_post(&proxy, "/w", job, token);

    // A's lease is short: its first write goes at once, before anything else can eat into it.
    let a = claim_as(&server, "j", "worker-a", "3s").unwrap();
    let token_a = a["token"].as_str().unwrap().to_owned();
    assert_eq!(write("j", &token_a), 200);
    one_event(&server_log, "claim granted", "j", 1);
    // A refused claim.
    claim_as(&server, "j", "worker-b", "30s").expect_err("held");
    one_event(&server_log, "claim refused", "j", 1);

    // An expired token: A's lease ran out (by the end its token carries, on this machine's
    // clock, which the server and the proxy share; no skew allowed) and nobody claimed since.
    let expires_at_ms = a["expires_at_ms"].as_u64().unwrap();
    eventually("A's lease ends", Duration::from_secs(10), || {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
        now.unwrap().as_millis() > u128::from(expires_at_ms) + 50
    });
    assert_eq!(write("j", &token_a), 409);
    one_event(&proxy_log, "refused (token expired)", "j", 1);

    // A stale token: B holds generation 2 and wrote; A (still within its own expiry on
    // another job) writes with generation 1.
    let k = claim_as(&server, "k", "worker-a", "30s").unwrap();
    assert_success(&release(&server, "k", &k));
    let k2 = claim_as(&server, "k", "worker-b", "30s").unwrap();
    assert_eq!(write("k", k2["token"].as_str().unwrap()), 200);
    assert_eq!(write("k", k["token"].as_str().unwrap()), 409);
    one_event(&proxy_log, "refused (stale token)", "k", 1);

    // A lost lease, seen by the server: A renews after B claimed.
    let b = claim_as(&server, "j", "worker-b", "30s").unwrap();
    assert_eq!(b["generation"], 2);
    let renew = fence(&[
        "renew",
        "--server",
        &server,
        "--job",
        "j",
        "--owner",
        "worker-a",
        "--generation",
        "1",
        "--lease-key",
        a["lease_key"].as_str().unwrap(),
    ]);
    assert_eq!(renew.status.code(), Some(3), "{renew:?}");
    one_event(&server_log, "renewal refused: lease lost", "j", 1);

    // A lost lease, seen by the worker: the server stops answering (SIGSTOP) past the TTL.
    let worker = Command::new(FENCE)
        .args(["--log-format", "json", "run", "--server", &server])
        .args(["--job", "w", "--ttl", "1s", "--", "sleep", "30"])
        .env("RUST_LOG", "info")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let worker_log = Log::default();
    let mut worker = Proc(worker);
    worker_log.follow(worker.0.stderr.take().unwrap());
    one_event(&server_log, "claim granted", "w", 1);
    signal(&server_proc, "-STOP");
    let status = worker.0.wait().unwrap();
    signal(&server_proc, "-CONT");
    assert_eq!(status.code(), Some(75), "{}", worker_log.text());
    one_event(&worker_log, "lease lost", "w", 1);
}

/// A client looping claims on a held job writes no more log lines than the refusal log's
/// limit allows one peer per kind (10 in 10 s), however many it sends: until this version the
/// server wrote one "claim refused: held" line per request, and a loop filled the disk. A
/// lock-delay refusal is one event, not two (the handler's and the refusal log's).
#[test]
fn refused_lease_decisions_from_one_peer_are_rate_limited() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("leases");
    let (_server, addr, log) = start_logged(
        &[
            "--log-format",
            "json",
            "server",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            data.to_str().unwrap(),
            "--lock-delay",
            "30s",
        ],
        "info",
    );
    let claim = |job: &str, owner: &str, ttl_ms: u32| {
        let body = format!(
            r#"{{"owner":"{owner}","lease_key":"{owner}-0123456789abcdefghijk","ttl_ms":{ttl_ms}}}"#
        );
        bearer_call(
            &addr,
            "POST",
            &format!("/v1/leases/{job}/claim"),
            None,
            &body,
        )
    };
    // The lock-delay first: its lease of 200 ms ends while the loop below runs.
    let delayed_from = Instant::now();
    assert_eq!(claim("d", "holder", 200).0, 200);
    let (status, answer) = claim("busy", "holder", 60_000);
    assert_eq!(status, 200, "{answer}");
    let window = Instant::now();
    const LOOPED: usize = 30;
    for n in 0..LOOPED {
        let (status, answer) = claim("busy", &format!("looper{n}"), 60_000);
        assert_eq!(status, 409, "{answer}");
    }
    std::thread::sleep(Duration::from_millis(400).saturating_sub(delayed_from.elapsed()));
    let (status, answer) = claim("d", "late", 1_000);
    assert_eq!(status, 409, "{answer}");
    assert!(answer.contains("urn:fence:lock-delay"), "{answer}");
    eventually(
        "the lock-delay refusal is logged",
        Duration::from_secs(5),
        || log.text().contains("lock-delay lets nobody claim"),
    );
    std::thread::sleep(Duration::from_millis(200));
    let held = events(&log, "claim refused: held", "busy").len();
    if window.elapsed() < Duration::from_secs(9) {
        assert_eq!(held, 10, "{LOOPED} refused claims from one peer, 10 logged");
    } else {
        // A slow run reached the next window, which logs some again: still not all.
        assert!((10..LOOPED).contains(&held), "{held} of {LOOPED} logged");
    }
    let delayed: Vec<_> = log
        .text()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| e["fields"]["job"] == "d" && e.to_string().contains("lock-delay"))
        .collect();
    assert_eq!(delayed.len(), 1, "one lock-delay event: {delayed:?}");
    assert_eq!(delayed[0]["fields"]["type"], "urn:fence:lock-delay");
}

/// A schema of `docs/openapi.json`, `$ref`s followed.
fn resolve<'a>(doc: &'a serde_json::Value, schema: &'a serde_json::Value) -> &'a serde_json::Value {
    match schema["$ref"].as_str() {
        Some(r) => {
            let name = r.trim_start_matches("#/components/schemas/");
            &doc["components"]["schemas"][name]
        }
        None => schema,
    }
}

/// `body` has every member `schema` requires, recursively through arrays of objects.
fn conforms(
    doc: &serde_json::Value,
    schema: &serde_json::Value,
    body: &serde_json::Value,
) -> Result<(), String> {
    let schema = resolve(doc, schema);
    for member in schema["required"].as_array().into_iter().flatten() {
        let member = member.as_str().unwrap();
        if body.get(member).is_none() {
            return Err(format!("no {member:?} in {body}"));
        }
    }
    if let (Some(items), Some(list)) = (
        schema["properties"]["leases"]["items"].as_object(),
        body["leases"].as_array(),
    ) {
        let items = serde_json::Value::Object(items.clone());
        for item in list {
            conforms(doc, &items, item)?;
        }
    }
    Ok(())
}

/// (documented path, method, status, server, concrete path, bearer, body).
type Row<'a> = (
    &'a str,
    &'a str,
    u16,
    &'a str,
    String,
    Option<&'a str>,
    String,
);

/// Every status `docs/openapi.json` documents, for every operation, produced by a real
/// server, with the documented content type and the members its schema requires; and no
/// answer the document does not list.
#[test]
fn every_documented_status_comes_from_the_real_server_as_documented() {
    const OPS: &str = "ops-0123456789abcdef-secret";
    const BILLING: &str = "billing-0123456789abcdef-secret";
    let doc: serde_json::Value =
        serde_json::from_str(include_str!("../../../docs/openapi.json")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let auth = dir.path().join("clients");
    std::fs::write(
        &auth,
        format!("ops {OPS} * +revoke\nbilling {BILLING} inv-*\n"),
    )
    .unwrap();
    std::fs::set_permissions(
        &auth,
        <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o600),
    )
    .unwrap();
    let (_s, sled) = start_ready(&server_args(
        dir.path().join("leases").to_str().unwrap(),
        &["--auth-file", auth.to_str().unwrap()],
    ));
    // A server whose PostgreSQL goes away (a relay in front of it is cut): its store is
    // unusable.
    let url = database_url().unwrap();
    let relay = Relay::to(&url);
    let schema = unique_schema("openapi");
    let (_p, broken) = start_pg_server(&relay.url, &schema, &[]);
    relay.cut();

    let key = "k0123456789abcdefghijk";
    let other_key = "x0123456789abcdefghijk";
    let claim = |owner: &str| format!(r#"{{"owner":"{owner}","lease_key":"{key}"}}"#);
    // A server with room for one waiting claim, taken: the next waiting claim is 429.
    let (_t, tiny) = start_ready(&server_args(
        dir.path().join("tiny").to_str().unwrap(),
        &["--max-waiting-claims", "1"],
    ));
    assert_eq!(
        bearer_call(&tiny, "POST", "/v1/leases/w/claim", None, &claim("w")).0,
        200
    );
    let _waiter = send_request(
        &tiny,
        "POST",
        "/v1/leases/w/claim?wait=30s",
        &[],
        &claim("u"),
    );
    waiting_claims(&tiny, 1);
    let held = |g: u64, k: &str| {
        format!(r#"{{"owner":"w","generation":{g},"lease_key":"{k}","ttl_ms":30000}}"#)
    };
    let finish = |g: u64, k: &str| format!(r#"{{"owner":"w","generation":{g},"lease_key":"{k}"}}"#);
    let ops = Some(OPS);
    let billing = Some(BILLING);
    let lease = "/v1/leases/{job}";
    let claim_path = "/v1/leases/{job}/claim";
    let renew_path = "/v1/leases/{job}/renew";
    let release_path = "/v1/leases/{job}/release";
    let complete_path = "/v1/leases/{job}/complete";
    let revoke_path = "/v1/leases/{job}/revoke";
    let checkpoint_path = "/v1/leases/{job}/checkpoint";
    let slot_path = "/v1/semaphores/{resource}/claim";
    let slot = |owner: &str, slots: u32| {
        format!(r#"{{"owner":"{owner}","lease_key":"{key}","slots":{slots}}}"#)
    };
    let save = |g: u64, k: &str, data: &str| {
        format!(r#"{{"owner":"w","generation":{g},"lease_key":"{k}","checkpoint":"{data}"}}"#)
    };
    // (documented path, method, status, server, concrete path, bearer, body), in order:
    // earlier rows set up later ones.
    #[rustfmt::skip]
    let rows: Vec<Row> = vec![
        (claim_path, "POST", 200, &sled, "/v1/leases/a/claim".into(), ops, claim("w")),
        (claim_path, "POST", 200, &sled, "/v1/leases/r/claim".into(), ops, claim("w")),
        (claim_path, "POST", 200, &sled, "/v1/leases/c/claim".into(), ops, claim("w")),
        (claim_path, "POST", 400, &sled, "/v1/leases/a%20b/claim".into(), ops, claim("w")),
        (claim_path, "POST", 401, &sled, "/v1/leases/a/claim".into(), None, claim("w")),
        (claim_path, "POST", 403, &sled, "/v1/leases/a/claim".into(), billing, claim("w")),
        (claim_path, "POST", 409, &sled, "/v1/leases/a/claim".into(), ops, claim("v")),
        (claim_path, "POST", 503, &broken, "/v1/leases/a/claim".into(), None, claim("w")),
        (claim_path, "POST", 429, &tiny, "/v1/leases/w/claim?wait=5s".into(), None, claim("v")),
        (slot_path, "POST", 200, &sled, "/v1/semaphores/s/claim".into(), ops, slot("w", 1)),
        (slot_path, "POST", 400, &sled, "/v1/semaphores/s%23/claim".into(), ops, slot("w", 1)),
        (slot_path, "POST", 401, &sled, "/v1/semaphores/s/claim".into(), None, slot("w", 1)),
        (slot_path, "POST", 403, &sled, "/v1/semaphores/s/claim".into(), billing, slot("w", 1)),
        (slot_path, "POST", 409, &sled, "/v1/semaphores/s/claim".into(), ops, slot("v", 1)),
        (slot_path, "POST", 503, &broken, "/v1/semaphores/s/claim".into(), None, slot("w", 1)),
        (renew_path, "POST", 200, &sled, "/v1/leases/a/renew".into(), ops, held(1, key)),
        (renew_path, "POST", 400, &sled, "/v1/leases/a/renew".into(), ops, "{}".into()),
        (renew_path, "POST", 401, &sled, "/v1/leases/a/renew".into(), None, held(1, key)),
        (renew_path, "POST", 403, &sled, "/v1/leases/a/renew".into(), ops, held(1, other_key)),
        (renew_path, "POST", 409, &sled, "/v1/leases/a/renew".into(), ops, held(7, key)),
        (renew_path, "POST", 503, &broken, "/v1/leases/a/renew".into(), None, held(1, key)),
        (checkpoint_path, "POST", 200, &sled, "/v1/leases/a/checkpoint".into(), ops, save(1, key, "step 2")),
        (checkpoint_path, "POST", 400, &sled, "/v1/leases/a/checkpoint".into(), ops, finish(1, key)),
        (checkpoint_path, "POST", 401, &sled, "/v1/leases/a/checkpoint".into(), None, save(1, key, "x")),
        (checkpoint_path, "POST", 403, &sled, "/v1/leases/a/checkpoint".into(), ops, save(1, other_key, "x")),
        (checkpoint_path, "POST", 409, &sled, "/v1/leases/a/checkpoint".into(), ops, save(7, key, "x")),
        (checkpoint_path, "POST", 413, &sled, "/v1/leases/a/checkpoint".into(), ops, save(1, key, &"x".repeat(8193))),
        (checkpoint_path, "POST", 503, &broken, "/v1/leases/a/checkpoint".into(), None, save(1, key, "x")),
        (release_path, "POST", 200, &sled, "/v1/leases/r/release".into(), ops, finish(1, key)),
        (release_path, "POST", 400, &sled, "/v1/leases/r/release".into(), ops, "[".into()),
        (release_path, "POST", 401, &sled, "/v1/leases/r/release".into(), None, finish(1, key)),
        (release_path, "POST", 403, &sled, "/v1/leases/a/release".into(), ops, finish(1, other_key)),
        (release_path, "POST", 409, &sled, "/v1/leases/r/release".into(), ops, finish(1, key)),
        (release_path, "POST", 503, &broken, "/v1/leases/r/release".into(), None, finish(1, key)),
        (complete_path, "POST", 200, &sled, "/v1/leases/c/complete".into(), ops, finish(1, key)),
        (complete_path, "POST", 400, &sled, "/v1/leases/c/complete".into(), ops, r#"{"owner":"w"}"#.into()),
        (complete_path, "POST", 401, &sled, "/v1/leases/c/complete".into(), None, finish(1, key)),
        (complete_path, "POST", 403, &sled, "/v1/leases/a/complete".into(), ops, finish(1, other_key)),
        (complete_path, "POST", 409, &sled, "/v1/leases/a/complete".into(), ops, finish(7, key)),
        (complete_path, "POST", 503, &broken, "/v1/leases/c/complete".into(), None, finish(1, key)),
        (claim_path, "POST", 410, &sled, "/v1/leases/c/claim".into(), ops, claim("w")),
        (revoke_path, "POST", 200, &sled, "/v1/leases/r/revoke".into(), ops, r#"{"reason":"test"}"#.into()),
        (revoke_path, "POST", 400, &sled, "/v1/leases/r/revoke".into(), ops, r#"{"why":1}"#.into()),
        (revoke_path, "POST", 401, &sled, "/v1/leases/r/revoke".into(), None, String::new()),
        (revoke_path, "POST", 403, &sled, "/v1/leases/inv-1/revoke".into(), billing, String::new()),
        (revoke_path, "POST", 404, &sled, "/v1/leases/never/revoke".into(), ops, String::new()),
        (revoke_path, "POST", 410, &sled, "/v1/leases/c/revoke".into(), ops, String::new()),
        (revoke_path, "POST", 503, &broken, "/v1/leases/r/revoke".into(), None, String::new()),
        (lease, "GET", 200, &sled, "/v1/leases/a".into(), ops, String::new()),
        (lease, "GET", 400, &sled, "/v1/leases/%FF".into(), ops, String::new()),
        (lease, "GET", 401, &sled, "/v1/leases/a".into(), None, String::new()),
        (lease, "GET", 403, &sled, "/v1/leases/a".into(), billing, String::new()),
        (lease, "GET", 404, &sled, "/v1/leases/never".into(), ops, String::new()),
        (lease, "GET", 503, &broken, "/v1/leases/a".into(), None, String::new()),
        ("/v1/leases", "GET", 200, &sled, "/v1/leases?limit=2".into(), ops, String::new()),
        ("/v1/leases", "GET", 400, &sled, "/v1/leases?state=bogus".into(), ops, String::new()),
        ("/v1/leases", "GET", 401, &sled, "/v1/leases".into(), None, String::new()),
        ("/v1/leases", "GET", 503, &broken, "/v1/leases".into(), None, String::new()),
        ("/healthz", "GET", 200, &sled, "/healthz".into(), None, String::new()),
        ("/healthz", "GET", 503, &broken, "/healthz".into(), None, String::new()),
        ("/readyz", "GET", 200, &sled, "/readyz".into(), None, String::new()),
        ("/readyz", "GET", 503, &broken, "/readyz".into(), None, String::new()),
        ("/openapi.json", "GET", 200, &sled, "/openapi.json".into(), None, String::new()),
        ("/metrics", "GET", 200, &sled, "/metrics".into(), ops, String::new()),
        ("/metrics", "GET", 401, &sled, "/metrics".into(), None, String::new()),
    ];
    let mut seen = BTreeSet::new();
    for (documented, method, want, server, path, bearer, body) in rows {
        let (status, answer) = bearer_call(server, method, &path, bearer, &body);
        assert_eq!(status, want, "{method} {path}: {answer}");
        let op = &doc["paths"][documented][method.to_lowercase()];
        let response = &op["responses"][want.to_string()];
        assert!(
            response.is_object(),
            "{method} {documented} {want} is not documented"
        );
        let (head, text) = answer.split_once("\r\n\r\n").unwrap();
        let content_type = head
            .lines()
            .find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("content-type: ")
                    .map(str::to_owned)
            })
            .unwrap_or_default();
        let (media, content) = response["content"]
            .as_object()
            .and_then(|c| c.iter().next())
            .unwrap_or_else(|| panic!("{method} {documented} {want} has no content"));
        assert!(
            content_type.starts_with(media.as_str()),
            "{method} {path}: {content_type} is not {media}"
        );
        if media.ends_with("json") {
            let body: serde_json::Value = serde_json::from_str(text)
                .unwrap_or_else(|e| panic!("{method} {path}: {e}: {text}"));
            if let Err(e) = conforms(&doc, &content["schema"], &body) {
                panic!("{method} {path} {want}: {e}");
            }
            if media.starts_with("application/problem") {
                assert_eq!(body["status"], want, "{body}");
            }
        }
        seen.insert((
            documented.to_owned(),
            method.to_lowercase(),
            want.to_string(),
        ));
    }
    let mut documented = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            for status in op["responses"].as_object().unwrap().keys() {
                documented.insert((path.clone(), method.clone(), status.clone()));
            }
        }
    }
    let missing: Vec<_> = documented.difference(&seen).collect();
    assert!(
        missing.is_empty(),
        "documented but never produced here: {missing:?}"
    );
}

/// Completions for the shells operators use, and a manual page, from the same definition as
/// `--help`: every subcommand and a deep flag are in them.
#[test]
fn completions_and_the_manual_page_cover_every_command() {
    for (shell, marker) in [
        ("bash", "complete -F"),
        ("zsh", "#compdef fence"),
        ("fish", "complete -c fence"),
    ] {
        let out = fence(&["completions", shell]);
        assert_success(&out);
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(text.contains(marker), "{shell}: {text}");
        for word in ["server", "proxy", "run", "leases", "max-buffered-bytes"] {
            assert!(text.contains(word), "{shell} completion lacks {word}");
        }
        // `watchdog` is fence run's own, hidden from --help: not offered on Tab either.
        assert!(
            !text.contains("watchdog"),
            "{shell} completion offers watchdog"
        );
    }
    // A reader that stops early (`| head -1`) closes the pipe: no panic, exit 0.
    for what in [&["completions", "bash"][..], &["man"][..]] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader); // closed before fence writes a byte
        let out = Command::new(FENCE)
            .args(what)
            .stdout(writer)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{what:?} into a closed pipe: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{what:?}: {stderr}");
    }
    let bad = fence(&["completions", "cmd.exe"]);
    assert_eq!(bad.status.code(), Some(2));
    let man = fence(&["man"]);
    assert_success(&man);
    let page = String::from_utf8(man.stdout).unwrap();
    assert!(
        page.starts_with(".ie") || page.starts_with(".TH"),
        "{}",
        &page[..80]
    );
    assert!(page.contains(".TH fence 1"), "{}", &page[..200]);
    for word in ["server", "proxy", "run", "keygen", "completions"] {
        assert!(page.contains(word), "the manual page lacks {word}");
    }
    assert!(!page.contains("watchdog"), "the manual page shows watchdog");
}

/// `/readyz` on both (issue 34): the server's is 200 while its store answers; the proxy's is
/// 200 once the upstream accepts a connection and 503 while it does not, the problem body
/// saying 503 too (it said 502, its type's own status, under an HTTP 503).
#[test]
fn readiness_probes_answer_what_their_status_says() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, server) = start_server(&dir.path().join("leases"));
    let addr = server.trim_start_matches("http://");
    let (status, answer) = bearer_call(addr, "GET", "/readyz", None, "");
    assert_eq!(status, 200, "{answer}");

    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let data = dir.path().join("proxy");
    let (_proxy, _, admin) = start_proxy_admin(&dead, &["--data-dir", data.to_str().unwrap()]);
    let (status, answer) = bearer_call(&admin, "GET", "/readyz", None, "");
    assert_eq!(status, 503, "{answer}");
    let body: serde_json::Value =
        serde_json::from_str(answer.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    assert_eq!(body["status"], 503, "{body}");
    assert_eq!(body["type"], "urn:fence:upstream-unavailable", "{body}");

    let upstream = format!("http://{}", start_upstream());
    let data = dir.path().join("proxy2");
    let (_proxy, _, admin) = start_proxy_admin(&upstream, &["--data-dir", data.to_str().unwrap()]);
    let (status, answer) = bearer_call(&admin, "GET", "/readyz", None, "");
    assert_eq!(status, 200, "{answer}");
}

/// An upstream that is down fails every request: the proxy logs that rate-limited, like
/// refusals (at most 10 lines per 10 s), naming the upstream in the log and not in the
/// answer, which goes to clients that need not learn the proxy's inner addresses.
#[test]
fn a_down_upstream_is_logged_rate_limited_and_not_named_to_clients() {
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("proxy");
    let upstream = format!("http://{dead}");
    let args = proxy_args(&upstream, &["--data-dir", data.to_str().unwrap()]);
    let (_proxy, addr, log) = start_logged(&args, "info");
    for _ in 0..25 {
        let (status, answer) = exchange(&addr, "GET", "/r", &[], "");
        assert_eq!(status, 502, "{answer}");
        assert!(answer.contains("upstream-unavailable"), "{answer}");
        assert!(
            !answer.contains(&dead),
            "the answer names the upstream: {answer}"
        );
    }
    let first = log.wait_for("upstream failed");
    assert!(first.contains(&dead), "the log names the upstream: {first}");
    std::thread::sleep(Duration::from_millis(200));
    let logged = log
        .text()
        .lines()
        .filter(|l| l.contains("upstream failed"))
        .count();
    assert_eq!(logged, 10, "25 failures in one window:\n{}", log.text());
}

/// One JSON log event per refusal (issue 34), at the server and the proxy: the problem type
/// and status, job, method, path, peer and auth client where they apply; a failed TLS
/// handshake with its peer; and a flood of one kind from one peer rate-limited.
#[test]
fn every_refusal_is_one_json_event_with_the_request() {
    use std::os::unix::fs::PermissionsExt;
    const OPS: &str = "ops-0123456789abcdefghij";
    const BILLING: &str = "billing-0123456789abcdefg";
    let dir = tempfile::tempdir().unwrap();
    let auth = dir.path().join("clients");
    std::fs::write(
        &auth,
        format!("ops {OPS} * +revoke\nbilling {BILLING} inv-*\n"),
    )
    .unwrap();
    std::fs::set_permissions(&auth, std::fs::Permissions::from_mode(0o600)).unwrap();
    let ca = TestCa::new();
    let data = dir.path().join("leases");
    let mut args = vec![
        "--log-format".to_owned(),
        "json".into(),
        "server".into(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--data-dir".into(),
        data.to_str().unwrap().into(),
        "--auth-file".into(),
        auth.to_str().unwrap().into(),
    ];
    args.extend(ca.server_args());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (_server, addr, log) = start_logged(&args, "info");
    let url = format!("https://localhost:{}", addr.rsplit(':').next().unwrap());
    let refusals = |log: &Log, kind: &str| -> Vec<serde_json::Value> {
        log.text()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|e| e["fields"]["type"] == kind)
            .map(|e| e["fields"].clone())
            .collect()
    };
    let one = |log: &Log, kind: &str| -> serde_json::Value {
        eventually(kind, Duration::from_secs(5), || {
            !refusals(log, kind).is_empty()
        });
        let found = refusals(log, kind);
        assert_eq!(found.len(), 1, "{kind}: {found:?}");
        found[0].clone()
    };
    let ca_file = ca.ca.to_str().unwrap().to_owned();
    let with = |secret: Option<&str>, args: &[&str]| {
        let mut c = Command::new(FENCE);
        c.args(args).args(["--server", &url, "--ca-cert", &ca_file]);
        match secret {
            Some(s) => c.env("FENCE_AUTH_TOKEN", s),
            None => c.env_remove("FENCE_AUTH_TOKEN"),
        };
        c.output().unwrap()
    };
    // 401: no secret. The rate limit's window for this kind and peer starts here.
    let window = Instant::now();
    let out = with(None, &["status", "--job", "inv-1"]);
    assert_eq!(out.status.code(), Some(2));
    let e = one(&log, "urn:fence:unauthenticated");
    assert_eq!(e["status"], 401);
    assert_eq!(e["method"], "GET");
    assert_eq!(e["path"], "/v1/leases/inv-1");
    assert_eq!(e["peer"], "127.0.0.1");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .starts_with("refused (unauthenticated)"),
        "{e}"
    );
    // 403: a revoke by a client without +revoke, named.
    let out = with(
        Some(BILLING),
        &["revoke", "--job", "inv-1", "--reason", "test"],
    );
    assert_eq!(out.status.code(), Some(2));
    let e = one(&log, "urn:fence:forbidden");
    assert_eq!(
        (e["client"].as_str(), e["job"].as_str()),
        (Some("billing"), Some("inv-1"))
    );
    assert_eq!(e["path"], "/v1/leases/inv-1/revoke");
    // Who revoked, and why.
    assert_success(&with(Some(BILLING), &["claim", "--job", "inv-3"]));
    assert_success(&with(
        Some(OPS),
        &["revoke", "--job", "inv-3", "--reason", "stuck"],
    ));
    eventually("the revoke event", Duration::from_secs(5), || {
        log.text().contains("lease revoked")
    });
    let revoked: serde_json::Value = log
        .text()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|e| e["fields"]["message"] == "lease revoked")
        .unwrap();
    assert_eq!(
        (
            revoked["fields"]["by"].as_str(),
            revoked["fields"]["reason"].as_str()
        ),
        (Some("ops"), Some("stuck"))
    );
    // A failed TLS handshake, with its peer.
    let plain = format!("http://localhost:{}", addr.rsplit(':').next().unwrap());
    let _ = fence(&["status", "--server", &plain, "--job", "j"]);
    eventually("the handshake event", Duration::from_secs(5), || {
        log.text().contains("TLS handshake failed")
    });
    // A flood of one kind from one peer: at most 10 events in 10 s.
    for _ in 0..15 {
        let _ = with(None, &["status", "--job", "inv-1"]);
    }
    std::thread::sleep(Duration::from_millis(300));
    let n = refusals(&log, "urn:fence:unauthenticated").len();
    if window.elapsed() < Duration::from_secs(9) {
        assert_eq!(n, 10, "16 refusals of one kind from one peer, 10 logged");
    } else {
        // A slow run reached the next window, which logs some again: still not all 16.
        assert!((10..16).contains(&n), "{n} of 16 refusals logged");
    }

    // The proxy: a missing token (428), a malformed one (400), a stale one (409).
    let upstream = format!("http://{}", start_upstream());
    let data = dir.path().join("proxy");
    let (_proxy, proxy, plog) = start_logged(
        &proxy_args(
            &upstream,
            &["--log-format", "json", "--data-dir", data.to_str().unwrap()],
        ),
        "info",
    );
    let (status, _) = exchange(&proxy, "POST", "/charges", &[], "");
    assert_eq!(status, 428);
    let e = one(&plog, "urn:fence:missing-token");
    assert_eq!(
        (e["method"].as_str(), e["path"].as_str()),
        (Some("POST"), Some("/charges"))
    );
    assert_eq!(e["peer"], "127.0.0.1");
    assert_eq!(fenced_post(&proxy, "/charges", "inv-2", "x7"), 400);
    let e = one(&plog, "urn:fence:malformed-token");
    assert_eq!(e["status"], 400);
    assert_eq!(fenced_post(&proxy, "/charges", "inv-2", "8"), 200);
    assert_eq!(fenced_post(&proxy, "/charges", "inv-2", "7"), 409);
    let e = one(&plog, "urn:fence:stale-token");
    assert_eq!(
        (e["generation"].as_u64(), e["highest"].as_u64()),
        (Some(7), Some(8))
    );
    assert_eq!(e["path"], "/charges");
}

/// A data directory others may enter is named in a warning at start (it holds stored
/// responses and checkpoints); one fence made itself is private and draws none.
#[test]
fn a_data_directory_others_may_enter_is_warned_about() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let open = dir.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).unwrap();
    let fresh = dir.path().join("fresh");
    for (data, warned) in [(&open, true), (&fresh, false)] {
        let (server, _, log) = start_logged(&server_args(data.to_str().unwrap(), &[]), "info");
        drop(server);
        let text = log.text();
        assert_eq!(
            text.contains("other users may enter the data directory"),
            warned,
            "{}: {text}",
            data.display()
        );
    }
    assert_eq!(
        std::fs::metadata(&fresh).unwrap().permissions().mode() & 0o777,
        0o700
    );
}

/// A client with no secret sending paths of 60,000 bytes (a head may hold 64 KiB) cannot
/// fill a disk through the refusal log: each event repeats a few hundred bytes of the path
/// and says how long it was, at the server (404, 405, 400) and at the proxy (428). Before,
/// each event repeated the path twice, about 120 KiB, and 10 events per kind and peer every
/// 10 s let one address write half a megabyte a second.
#[test]
fn a_refusal_of_a_huge_path_logs_a_short_line() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let auth = dir.path().join("clients");
    std::fs::write(&auth, "ops ops-0123456789abcdefghij *\n").unwrap();
    std::fs::set_permissions(&auth, std::fs::Permissions::from_mode(0o600)).unwrap();
    let data = dir.path().join("leases");
    let args = server_args(
        data.to_str().unwrap(),
        &["--auth-file", auth.to_str().unwrap()],
    );
    let (_server, server, log) = start_logged(&args, "info");
    let upstream = format!("http://{}", start_upstream());
    let pdata = dir.path().join("proxy");
    let (_proxy, proxy, plog) = start_logged(
        &proxy_args(&upstream, &["--data-dir", pdata.to_str().unwrap()]),
        "info",
    );
    let long = "a".repeat(60_000);
    let (before, pbefore) = (log.text().len(), plog.text().len());
    for _ in 0..15 {
        let (status, answer) = exchange(&server, "GET", &format!("/{long}"), &[], "");
        assert_eq!(status, 404, "{}", &answer[..answer.len().min(300)]);
        assert!(
            answer.contains("(60001 bytes in all)"),
            "the 404 says the cut"
        );
        let (status, _) = exchange(&server, "PUT", &format!("/v1/leases/{long}"), &[], "");
        assert_eq!(status, 405);
        let (status, _) = exchange(&server, "GET", &format!("/v1/leases/{long}"), &[], "");
        assert_eq!(status, 400, "a job id too long, checked before the secret");
        let (status, _) = exchange(&proxy, "POST", &format!("/{long}"), &[], "");
        assert_eq!(status, 428);
    }
    for (log, kinds) in [
        (
            &log,
            &["not found", "method not allowed", "bad request"][..],
        ),
        (&plog, &["missing token"][..]),
    ] {
        for kind in kinds {
            log.wait_for(&format!("refused ({kind})"));
        }
    }
    std::thread::sleep(Duration::from_millis(300));
    for (log, before, events) in [(&log, before, 30), (&plog, pbefore, 10)] {
        let text = log.text();
        let grown = &text[before..];
        let longest = grown.lines().map(str::len).max().unwrap_or(0);
        assert!(longest < 2048, "a line of {longest} bytes");
        assert!(
            grown.len() < events * 2048,
            "{} bytes logged for {events} events",
            grown.len()
        );
        assert!(grown.contains("(60001 bytes in all)"), "the cut is said");
    }
}
