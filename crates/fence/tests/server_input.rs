//! Bad input on every endpoint of the lease server: a 400 problem naming the field, never a
//! panic, a 5xx or a hang.

use std::sync::Arc;

use axum::body::Body;
use fence_lease::MemoryLeaseStore;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;

async fn call(method: &str, path: &str, body: impl Into<Body>) -> (StatusCode, serde_json::Value) {
    let router = fence::server::router(
        Arc::new(MemoryLeaseStore::new()),
        fence::server::ServerOptions::default(),
    );
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .body(body.into())
        .unwrap();
    let resp = tokio::time::timeout(std::time::Duration::from_secs(5), router.oneshot(req))
        .await
        .expect("no hang")
        .unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
    )
}

#[tokio::test]
async fn every_bad_request_is_a_400_naming_the_field() {
    let claim = "/v1/leases/j/claim";
    let renew = "/v1/leases/j/renew";
    let big = format!(r#"{{"owner": "{}"}}"#, "a".repeat(20_000));
    let long_job = format!("/v1/leases/{}", "j".repeat(257));
    #[rustfmt::skip]
    let cases: Vec<(&str, &str, String, &str)> = vec![
        ("POST", claim, "".into(), "body: not valid JSON"),
        ("POST", claim, "{".into(), "body: not valid JSON"),
        ("POST", claim, "[]".into(), "body: must be a JSON object"),
        ("POST", claim, "null".into(), "body: must be a JSON object"),
        ("POST", claim, r#"{"ttl_ms": 1000}"#.into(), "owner: missing"),
        ("POST", claim, r#"{"owner": 7}"#.into(), "owner: must be a string"),
        ("POST", claim, r#"{"owner": ""}"#.into(), "owner: owner is empty"),
        ("POST", claim, r#"{"owner": "a b"}"#.into(), "owner: owner has byte 0x20"),
        ("POST", claim, r#"{"owner": "é"}"#.into(), "owner: owner has byte 0xC3"),
        ("POST", claim, r#"{"owner": "w"}"#.into(), "lease_key: missing"),
        ("POST", claim, r#"{"owner": "w", "lease_key": "short"}"#.into(), "lease_key: "),
        ("POST", claim, r#"{"owner": "w", "lease_key": ""}"#.into(), "lease_key: "),
        ("POST", claim, r#"{"owner": "w", "lease_key": 12345678901234567890123}"#.into(), "lease_key: must be a string"),
        ("POST", claim, format!(r#"{{"owner": "w", "lease_key": "{}"}}"#, "k".repeat(129)), "lease_key: "),
        ("POST", renew, r#"{"owner": "w", "generation": 1}"#.into(), "lease_key: missing"),
        ("POST", "/v1/leases/j/complete", r#"{"owner": "w", "generation": 1, "lease_key": null}"#.into(), "lease_key: "),
        ("POST", claim, r#"{"owner": "w", "lease_key": "k0123456789abcdefghij+"}"#.into(), "lease_key: "),
        ("POST", claim, r#"{"owner": "w", "lease_key": "k0123456789abcdefghijk", "ttl_ms": 99}"#.into(), "ttl_ms: ttl of 99 ms is below"),
        ("POST", claim, r#"{"owner": "w", "lease_key": "k0123456789abcdefghijk", "ttl_ms": 86400001}"#.into(), "ttl_ms: ttl of 86400001 ms is above"),
        ("POST", claim, r#"{"owner": "w", "lease_key": "k0123456789abcdefghijk", "ttl_ms": -1}"#.into(), "ttl_ms: must be an integer from 100 to 86400000"),
        ("POST", claim, r#"{"owner": "w", "lease_key": "k0123456789abcdefghijk", "ttl_ms": 1.5}"#.into(), "ttl_ms: must be an integer from 100 to 86400000"),
        ("POST", claim, r#"{"owner": "w", "lease_key": "k0123456789abcdefghijk", "ttl_ms": "1000"}"#.into(), "ttl_ms: must be an integer"),
        ("POST", claim, r#"{"owner": "w", "lease_key": "k0123456789abcdefghijk", "extra": 1}"#.into(), "extra: unknown field"),
        ("POST", claim, big, "body: larger than"),
        ("POST", claim, r#"{"owner": "w", "owner": "x", "lease_key": "k0123456789abcdefghijk"}"#.into(), "owner: given twice"),
        ("POST", renew, r#"{"owner": "w", "lease_key": "k0123456789abcdefghijk"}"#.into(), "generation: missing"),
        ("POST", renew, r#"{"owner": "w", "lease_key": "k0123456789abcdefghijk", "generation": 18446744073709551616}"#.into(), "generation: must be an integer"),
        ("POST", renew, r#"{"owner": "w", "lease_key": "k0123456789abcdefghijk", "generation": "1"}"#.into(), "generation: must be an integer"),
        ("POST", "/v1/leases/j/release", r#"{"owner": "w", "lease_key": "k0123456789abcdefghijk", "generation": 1, "ttl_ms": 5}"#.into(), "ttl_ms: unknown field"),
        ("POST", "/v1/leases/j/complete", r#"{"generation": 1}"#.into(), "owner: missing"),
        ("POST", "/v1/leases/a%20b/claim", r#"{"owner": "w", "lease_key": "k0123456789abcdefghijk"}"#.into(), "job (in the path): job id has byte 0x20"),
        ("POST", "/v1/leases/%FF/claim", r#"{"owner": "w", "lease_key": "k0123456789abcdefghijk"}"#.into(), "job"),
        ("GET", "/v1/leases/%00", String::new(), "job (in the path)"),
        ("GET", &long_job, String::new(), "job (in the path): job id is 257 bytes"),
    ];
    for (method, path, body, want) in cases {
        let (status, problem) = call(method, path, body.clone()).await;
        assert_eq!(status, 400, "{method} {path} {body:.60}: {problem}");
        assert_eq!(problem["type"], "urn:fence:bad-request");
        let detail = problem["detail"].as_str().unwrap_or_default();
        assert!(
            detail.starts_with(want) || detail.contains(want),
            "{method} {path}: {detail:?} lacks {want:?}"
        );
    }
}

#[tokio::test]
async fn unknown_paths_and_jobs_are_problems_too() {
    let (status, p) = call("GET", "/v2/whatever", "").await;
    assert_eq!(
        (status, p["type"].as_str()),
        (StatusCode::NOT_FOUND, Some("urn:fence:not-found"))
    );
    let (status, p) = call("GET", "/v1/leases/j/claim", "").await;
    assert_eq!(
        (status, p["type"].as_str()),
        (
            StatusCode::METHOD_NOT_ALLOWED,
            Some("urn:fence:method-not-allowed")
        )
    );
    let (status, p) = call("GET", "/v1/leases/never", "").await;
    assert_eq!(
        (status, p["type"].as_str()),
        (StatusCode::NOT_FOUND, Some("urn:fence:unknown-job"))
    );
    let (status, _) = call("GET", "/healthz", "").await;
    assert_eq!(status, 200);
    let (status, p) = call(
        "POST",
        "/v1/leases/j%2Fk/claim",
        r#"{"owner": "w", "lease_key": "k0123456789abcdefghijk"}"#,
    )
    .await;
    assert_eq!(
        (status, p["job"].as_str(), p["generation"].as_u64()),
        (StatusCode::OK, Some("j/k"), Some(1))
    );
}

#[tokio::test]
async fn arbitrary_bodies_never_crash_the_server() {
    let mut seed = 0x9E37_79B9_7F4A_7C15_u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let fragments = [
        "{",
        "}",
        "\"owner\"",
        ":",
        "\"w\"",
        ",",
        "\"generation\"",
        "1",
        "-1",
        "\"ttl_ms\"",
        "1e3",
        "null",
        "[",
        "]",
        "\u{0}",
        "\"\\ud800\"",
        "18446744073709551615",
        "true",
    ];
    for _ in 0..500 {
        let body: String = (0..next() % 12)
            .map(|_| fragments[(next() % fragments.len() as u64) as usize])
            .collect();
        for op in ["claim", "renew", "release", "complete"] {
            let (status, _) = call("POST", &format!("/v1/leases/j/{op}"), body.clone()).await;
            assert!(
                status.is_client_error() || status.is_success(),
                "{op} {body:?}: {status}"
            );
        }
    }
}

#[tokio::test]
async fn bad_authorization_headers_are_401_never_5xx() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("clients");
    std::fs::write(&file, "ops ops-0123456789abcdef-secret *\n").unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let options = || fence::server::ServerOptions {
        auth: Some(fence::auth::Auth::load(&file).unwrap()),
        ..Default::default()
    };
    let huge = format!("Bearer {}", "x".repeat(16_000));
    let values: Vec<Vec<u8>> = vec![
        b"".to_vec(),
        b"Bearer".to_vec(),
        b"Bearer ".to_vec(),
        b"bearer ops-0123456789abcdef-secre".to_vec(),
        b"Basic b3BzOnNlY3JldA==".to_vec(),
        b"Bearer ops-0123456789abcdef-secret trailing".to_vec(),
        huge.into_bytes(),
        b"Bearer \xff\xfe".to_vec(),
    ];
    // `GET /v1/leases/j` with these Authorization headers, to a fresh server: the status.
    let get = |values: &[&[u8]]| {
        let router = fence::server::router(Arc::new(MemoryLeaseStore::new()), options());
        let mut req = Request::builder().uri("/v1/leases/j");
        for v in values {
            req = req.header("authorization", http::HeaderValue::from_bytes(v).unwrap());
        }
        let req = req.body(Body::empty()).unwrap();
        async move { router.oneshot(req).await.unwrap().status() }
    };
    for value in values {
        assert_eq!(get(&[&value]).await, StatusCode::UNAUTHORIZED, "{value:?}");
    }
    // Two Authorization headers are ambiguous: refused, even when one is right.
    let right: &[u8] = b"Bearer ops-0123456789abcdef-secret";
    let other: &[u8] = b"Bearer other-0123456789abcdef";
    assert_eq!(get(&[right, other]).await, StatusCode::UNAUTHORIZED);
    // The right one, case-insensitive scheme: the job is unknown, not the caller.
    let lower: &[u8] = b"bearer ops-0123456789abcdef-secret";
    assert_eq!(get(&[lower]).await, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn a_restricted_client_pages_through_its_own_jobs_only() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("clients");
    std::fs::write(
        &file,
        "ops ops-0123456789abcdef-secret *\nbilling bill-0123456789abcdef-secret inv-* receipt x-\n",
    )
    .unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let router = fence::server::router(
        Arc::new(MemoryLeaseStore::new()),
        fence::server::ServerOptions {
            auth: Some(fence::auth::Auth::load(&file).unwrap()),
            ..Default::default()
        },
    );
    let send = |method: &str, uri: String, secret: &str, body: String| {
        let router = router.clone();
        let req = Request::builder()
            .method(method)
            .uri(uri)
            .header("authorization", format!("Bearer {secret}"))
            .header("content-type", "application/json")
            .body(Body::from(body))
            .unwrap();
        async move {
            let resp = router.oneshot(req).await.unwrap();
            let status = resp.status();
            let bytes = resp.into_body().collect().await.unwrap().to_bytes();
            (
                status,
                serde_json::from_slice::<serde_json::Value>(&bytes).unwrap(),
            )
        }
    };
    let ops = "ops-0123456789abcdef-secret";
    let billing = "bill-0123456789abcdef-secret";
    let mut jobs: Vec<String> = (0..120).map(|i| format!("inv-{i:03}")).collect();
    jobs.extend(
        [
            "a-1", "in", "invoice", "receipt", "receipt2", "x-", "x-1", "zzz",
        ]
        .map(String::from),
    );
    for job in &jobs {
        let body = r#"{"owner":"w","lease_key":"k0123456789abcdefghijk"}"#.to_owned();
        let (status, _) = send("POST", format!("/v1/leases/{job}/claim"), ops, body).await;
        assert_eq!(status, StatusCode::OK, "{job}");
    }
    let mut visible: Vec<String> = jobs
        .iter()
        .filter(|j| j.starts_with("inv-") || *j == "receipt" || *j == "x-")
        .cloned()
        .collect();
    visible.sort();
    for (query, want) in [
        ("limit=7", visible.clone()),
        (
            "limit=50&prefix=inv-1",
            visible
                .iter()
                .filter(|j| j.starts_with("inv-1"))
                .cloned()
                .collect(),
        ),
        ("limit=3&prefix=r", vec!["receipt".to_owned()]),
        ("limit=3&prefix=x", vec!["x-".to_owned()]),
        ("limit=3&prefix=z", vec![]),
        ("limit=1000&state=held", visible.clone()),
        ("limit=5&state=free", vec![]),
    ] {
        let mut seen = Vec::new();
        let mut after: Option<String> = None;
        for _ in 0..200 {
            let cursor = after
                .as_ref()
                .map_or(String::new(), |a| format!("&after={a}"));
            let (status, page) = send(
                "GET",
                format!("/v1/leases?{query}{cursor}"),
                billing,
                String::new(),
            )
            .await;
            assert_eq!(status, StatusCode::OK, "{query}: {page}");
            for lease in page["leases"].as_array().unwrap() {
                seen.push(lease["job"].as_str().unwrap().to_owned());
            }
            match page["next"].as_str() {
                Some(next) => {
                    assert!(
                        visible.iter().any(|v| v == next) || next.starts_with("inv-"),
                        "{query}: the cursor names a job the client may not see: {next}"
                    );
                    after = Some(next.to_owned());
                }
                None => break,
            }
        }
        assert_eq!(seen, want, "{query}");
    }
}
