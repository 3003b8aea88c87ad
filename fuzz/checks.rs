//! What the fuzz targets check, one function per target, shared by the libFuzzer targets
//! (`fuzz/fuzz_targets/`, `cargo +nightly fuzz run NAME`) and by `tests/fuzz_replay.rs`,
//! which feeds every checked-in corpus file to the same function on stable.

use std::{
    collections::HashMap,
    convert::Infallible,
    sync::{Arc, Mutex},
};

use bytes::Bytes;
use fence_core::{
    Generation, JobId, Problem,
    headers::{FencingHeaders, IdempotencyKey, parse_token},
    signing::{TokenSigner, TokenVerifier},
};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::{Layer, ServiceExt, service_fn};

/// The names a fuzzed header line may take: its first byte picks one.
const NAMES: [&str; 7] = [
    "x-fencing-job",
    "x-fencing-token",
    "idempotency-key",
    "X-Fencing-Token",
    "x-fencing-token-bin",
    "x-fencing-job-bin",
    "content-type",
];

/// Header lines from `data`: per line, the first byte picks the name, the rest is the value.
fn header_map(data: &[u8]) -> HeaderMap {
    let mut map = HeaderMap::new();
    for line in data.split(|&b| b == b'\n') {
        let Some((&pick, value)) = line.split_first() else {
            continue;
        };
        let name = HeaderName::from_static(match NAMES[usize::from(pick) % NAMES.len()] {
            "X-Fencing-Token" => "x-fencing-token",
            n => n,
        });
        if let Ok(value) = HeaderValue::from_bytes(value) {
            map.append(name, value);
        }
    }
    map
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime")
    })
}

/// The fencing headers and `Idempotency-Key`: never a panic; what parses writes back and
/// parses the same.
pub fn headers(data: &[u8]) {
    let map = header_map(data);
    if let Ok(Some(f)) = FencingHeaders::from_headers(&map) {
        let mut again = HeaderMap::new();
        fence_core::headers::insert_fencing(&mut again, &f.job, f.token);
        let reread = FencingHeaders::from_headers(&again).unwrap().unwrap();
        assert_eq!((reread.job, reread.token), (f.job, f.token));
    }
    if let Ok(Some(key)) = IdempotencyKey::from_headers(&map) {
        assert!(key.as_str().len() <= fence_core::headers::MAX_IDEMPOTENCY_KEY_LEN);
        // Written back as an sf-string (the form that can hold any key), it reads the same.
        let quoted = format!(
            "\"{}\"",
            key.as_str().replace('\\', "\\\\").replace('"', "\\\"")
        );
        assert_eq!(IdempotencyKey::from_bytes(quoted.as_bytes()).unwrap(), key);
    }
}

/// Token parsing and signature verification: a plain token reads back the same; only the
/// key's holder makes a signature that verifies (so a fuzzed one that verifies is the one
/// the key makes); a real signed token verifies, and any change to it does not.
pub fn tokens(data: &[u8]) {
    let signer = TokenSigner::from_seed([42; 32]);
    let verifier = TokenVerifier::new([signer.verify_key()]);
    let job: JobId = "fuzz-job".parse().expect("a job id");
    match parse_token(data) {
        Ok((token, None)) => {
            let (again, _) = parse_token(token.to_string().as_bytes()).unwrap();
            assert_eq!(again, token);
        }
        Ok((token, Some(s))) => {
            let g = token.generation();
            if verifier.verify(&job, g, s.expires_at_ms, &s.signature) {
                assert_eq!(signer.sign(&job, g, s.expires_at_ms).as_bytes(), data);
            }
        }
        Err(_) => {}
    }
    // A token made from the input: it verifies; one character changed, it does not.
    let number = |b: &[u8]| {
        b.iter()
            .fold(0u64, |n, &x| n.wrapping_mul(257).wrapping_add(u64::from(x)))
    };
    let (g, rest) = data.split_at(data.len().min(8));
    let generation = Generation::new(number(g).max(1));
    let expires_at_ms = number(rest);
    let token = signer.sign(&job, generation, expires_at_ms);
    let (parsed, signed) = parse_token(token.as_bytes()).unwrap();
    let signed = signed.unwrap();
    assert_eq!(parsed.generation(), generation);
    assert!(verifier.verify(&job, generation, expires_at_ms, &signed.signature));
    let mut forged = signed.signature.to_string().into_bytes();
    let at = usize::from(data.first().copied().unwrap_or(0)) % forged.len();
    let by = data.get(1).copied().unwrap_or(1);
    forged[at] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
        [(usize::from(forged[at]) + usize::from(by.max(1))) % 64];
    if forged != signed.signature.as_bytes() {
        let forged = String::from_utf8(forged).unwrap();
        assert!(
            !verifier.verify(&job, generation, expires_at_ms, &forged),
            "{token} / {forged}"
        );
    }
}

/// Token parsing alone, at parser speed (the signing in [`tokens`] slows it a thousandfold):
/// never a panic, and whatever parses, written back as `<generation>[.<expires>.<signature>]`,
/// parses to the same token.
pub fn token_parse(data: &[u8]) {
    let Ok((token, signed)) = parse_token(data) else {
        return;
    };
    let again = match &signed {
        None => token.to_string(),
        Some(s) => format!("{token}.{}.{}", s.expires_at_ms, s.signature),
    };
    let (token2, signed2) = parse_token(again.as_bytes()).unwrap();
    assert_eq!((token2, signed2), (token, signed), "{again}");
}

/// Requests to the lease server's real router, in process: never a 500, never a panic, and
/// every refusal a problem document with a detail. Up to four requests per input on one
/// store, separated by 0xff bytes; per request the first byte picks the method and action,
/// the bytes up to the first zero are the job (percent-encoded; for a listing, the query as
/// it came, a few bytes escaped), the rest is the body. The actions cover every route that
/// reads a body, a path or a query: the lease verbs, checkpoints, a semaphore's claim, the
/// listing and waiting claims.
pub fn lease_api(data: &[u8]) {
    let router = fence::server::router(
        Arc::new(fence_lease::MemoryLeaseStore::new()),
        fence::server::ServerOptions::default(),
    );
    runtime().block_on(async {
        for part in data.split(|&b| b == 0xff).take(4) {
            let Some((&pick, rest)) = part.split_first() else {
                continue;
            };
            let method = [Method::POST, Method::GET, Method::PUT, Method::DELETE]
                [usize::from(pick & 3)]
            .clone();
            let (job, body) = rest
                .iter()
                .position(|&b| b == 0)
                .map_or((rest, &[][..]), |i| (&rest[..i], &rest[i + 1..]));
            let escaped: String = job.iter().map(|b| format!("%{b:02X}")).collect();
            // A query as a client may send it: its separators and escapes kept.
            let query: String = job
                .iter()
                .map(|&b| match b {
                    b'a'..=b'z'
                    | b'A'..=b'Z'
                    | b'0'..=b'9'
                    | b'&'
                    | b'='
                    | b'%'
                    | b'-'
                    | b'_'
                    | b'.'
                    | b'~'
                    | b','
                    | b':'
                    | b'+' => char::from(b).to_string(),
                    _ => format!("%{b:02X}"),
                })
                .collect();
            let uri = match (pick >> 2) % 12 {
                0 => format!("/v1/leases/{escaped}/claim"),
                1 => format!("/v1/leases/{escaped}/renew"),
                2 => format!("/v1/leases/{escaped}/release"),
                3 => format!("/v1/leases/{escaped}/complete"),
                4 => format!("/v1/leases/{escaped}/revoke"),
                5 => format!("/v1/leases/{escaped}"),
                6 => format!("/v1/leases/{escaped}/x"),
                7 => format!("/v1/leases/{escaped}/claim?wait=1ms"),
                8 => format!("/v1/leases/{escaped}/checkpoint"),
                9 => format!("/v1/semaphores/{escaped}/claim"),
                10 => format!("/v1/leases?{query}"),
                _ => format!("/v1/leases/q/claim?{query}"),
            };
            // A query the http crate will not take is no request a server could receive.
            let Ok(uri) = uri.parse::<http::Uri>() else {
                continue;
            };
            let request = Request::builder()
                .method(method)
                .uri(uri)
                .header("content-type", "application/json")
                .body(axum::body::Body::from(body.to_vec()))
                .unwrap();
            // A claim with the input's query goes to a store of its own: one that waits (the
            // query may ask it to, for up to a minute) finds its job free and is answered
            // at once.
            let router = if (pick >> 2) % 12 == 11 {
                fence::server::router(
                    Arc::new(fence_lease::MemoryLeaseStore::new()),
                    fence::server::ServerOptions::default(),
                )
            } else {
                router.clone()
            };
            let response = router.oneshot(request).await.unwrap();
            let status = response.status();
            assert_ne!(status, StatusCode::INTERNAL_SERVER_ERROR, "{part:?}");
            if status != StatusCode::OK {
                let bytes = response.into_body().collect().await.unwrap().to_bytes();
                let problem: Problem = serde_json::from_slice(&bytes)
                    .unwrap_or_else(|e| panic!("{status}: not a problem: {e}: {bytes:?}"));
                assert!(!problem.detail.is_empty());
            }
        }
    });
}

/// The sink's layer against the contract's model, one request at a time: per 4 input
/// bytes a job, a token, a method and a way of sending it. A stale token is 409 and never
/// reaches the service; a fenced request that passes raises the job's highest; nothing that
/// is refused reaches the service.
pub fn sink_layer(data: &[u8]) {
    type Reached = Arc<Mutex<Vec<(String, String)>>>;
    let reached: Reached = Arc::default();
    let layer = fence_sink::FenceLayer::new(fence_sink::MemoryStore::new());
    let svc = {
        let reached = reached.clone();
        layer.layer(service_fn(
            move |req: Request<fence_sink::RequestBody<Full<Bytes>>>| {
                let reached = reached.clone();
                async move {
                    let h = |n: &str| {
                        req.headers()
                            .get(n)
                            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                            .unwrap_or_default()
                    };
                    reached
                        .lock()
                        .unwrap()
                        .push((h("x-fencing-job"), h("x-fencing-token")));
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"done"))))
                }
            },
        ))
    };
    let mut highest: HashMap<&str, u64> = HashMap::new();
    runtime().block_on(async {
        for c in data.chunks_exact(4) {
            let job = ["a", "b"][usize::from(c[0] & 1)];
            let token = u64::from(c[1]);
            let method = [Method::POST, Method::GET, Method::PUT, Method::DELETE]
                [usize::from(c[2] & 3)]
            .clone();
            let how = c[3] % 5;
            let mut request = Request::builder().method(method.clone()).uri("/effect");
            match how {
                1 => {}
                2 => {
                    request = request
                        .header("x-fencing-job", job)
                        .header("x-fencing-token", format!("x{token}"))
                }
                4 => {
                    request = request
                        .header("x-fencing-job", job)
                        .header("x-fencing-token", token.to_string())
                        .header("x-fencing-token", token.to_string());
                }
                _ => {
                    request = request
                        .header("x-fencing-job", job)
                        .header("x-fencing-token", token.to_string())
                }
            }
            if how == 3 {
                request = request.header("idempotency-key", format!("key-{}", c[0] % 3));
            }
            let before = reached.lock().unwrap().len();
            let response = svc
                .clone()
                .oneshot(request.body(Full::new(Bytes::new())).unwrap())
                .await
                .unwrap();
            let status = response.status();
            let got_through = reached.lock().unwrap().len() > before;
            if status != StatusCode::OK {
                assert!(
                    !got_through,
                    "a refused request ({status}) reached the service"
                );
            }
            let fenced = method != Method::GET;
            let h = highest.entry(job).or_default();
            match how {
                _ if !fenced => assert!(got_through || status != StatusCode::OK),
                0 => {
                    let valid = token > 0;
                    if valid && token < *h {
                        assert_eq!(status, StatusCode::CONFLICT, "token {token} below {h}");
                    } else if valid {
                        assert_eq!(status, StatusCode::OK, "token {token}, highest {h}");
                        assert!(got_through);
                        *h = token;
                    } else {
                        assert_eq!(status, StatusCode::BAD_REQUEST);
                    }
                }
                1 => assert_eq!(status, StatusCode::PRECONDITION_REQUIRED),
                2 | 4 => assert_eq!(status, StatusCode::BAD_REQUEST),
                // A keyed request's token is admitted (and raises the highest) before its key
                // is looked at, so it raises the highest even when the key then refuses it.
                _ if token == 0 => assert_eq!(status, StatusCode::BAD_REQUEST),
                _ if token < *h => {
                    assert_eq!(
                        status,
                        StatusCode::CONFLICT,
                        "keyed token {token} below {h}"
                    );
                }
                _ => *h = token,
            }
        }
    });
}

/// The PEM key loaders and the auth file parser: never a panic, whatever the file holds.
pub fn pem_and_auth(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let _ = fence::auth::AuthFile::parse(&text);
    thread_local! {
        static DIR: tempfile::TempDir = tempfile::tempdir().expect("a temporary directory");
    }
    DIR.with(|dir| {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.path().join("key.pem");
        std::fs::write(&path, data).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let _ = TokenSigner::from_file(&path);
        let _ = fence_core::signing::VerifyKey::from_file(&path);
    });
}
