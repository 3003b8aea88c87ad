//! What an operator relies on (contract section 10): metrics a Prometheus parser reads, with
//! HELP and histograms; one JSON log event per decision with `job` and `generation`; the
//! proxy's view of a job; completions and a manual page.

mod common;

use std::{collections::BTreeSet, process::Command, time::Duration};

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
    assert!(s.docs.contains_key("fence_lease_requests_total"));

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
    one_event(&proxy_log, "expired token", "j", 1);

    // A stale token: B holds generation 2 and wrote; A (still within its own expiry on
    // another job) writes with generation 1.
    let k = claim_as(&server, "k", "worker-a", "30s").unwrap();
    assert_success(&release(&server, "k", &k));
    let k2 = claim_as(&server, "k", "worker-b", "30s").unwrap();
    assert_eq!(write("k", k2["token"].as_str().unwrap()), 200);
    assert_eq!(write("k", k["token"].as_str().unwrap()), 409);
    one_event(&proxy_log, "stale token", "k", 1);

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
    let (_p, broken) = start_pg_server(&relay.url, &unique_schema("openapi"), &[]);
    relay.cut();

    let key = "k0123456789abcdefghijk";
    let other_key = "x0123456789abcdefghijk";
    let claim = |owner: &str| format!(r#"{{"owner":"{owner}","lease_key":"{key}"}}"#);
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
        (renew_path, "POST", 200, &sled, "/v1/leases/a/renew".into(), ops, held(1, key)),
        (renew_path, "POST", 400, &sled, "/v1/leases/a/renew".into(), ops, "{}".into()),
        (renew_path, "POST", 401, &sled, "/v1/leases/a/renew".into(), None, held(1, key)),
        (renew_path, "POST", 403, &sled, "/v1/leases/a/renew".into(), ops, held(1, other_key)),
        (renew_path, "POST", 409, &sled, "/v1/leases/a/renew".into(), ops, held(7, key)),
        (renew_path, "POST", 503, &broken, "/v1/leases/a/renew".into(), None, held(1, key)),
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
}
