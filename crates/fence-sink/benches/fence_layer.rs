//! Per-request cost of `FenceLayer` over a trivial service: unfenced, same generation (the
//! fast path, answered from memory), a new generation on every request (durable bump through
//! sled's group commit), and an idempotency key per request.
//!
//! `cargo bench -p fence-sink --bench fence_layer`

#![allow(missing_docs)] // criterion_group! generates an undocumented function

use std::{
    convert::Infallible,
    sync::atomic::{AtomicU64, Ordering},
};

use criterion::{Criterion, criterion_group, criterion_main};
use fence_sink::{FenceLayer, RequestBody, SledStore};
use http::{Request, Response};
use tower::{Service, ServiceExt, service_fn};

type Body = http_body_util::Empty<bytes::Bytes>;

/// A lease end far in the future (2096).
/// A lease end an hour from when the bench starts: a token that ends later than any lease
/// the server may grant (24 h by default) is refused, and would bench the refusal.
static LATER_MS: std::sync::LazyLock<u64> =
    std::sync::LazyLock::new(|| fence_storage::clock::system_now_ms() + 3_600_000);

fn request(job: &str, token: u64, key: Option<u64>) -> Request<Body> {
    let mut r = Request::post("/effects")
        .header("x-fencing-job", job)
        .header("x-fencing-token", token);
    if let Some(k) = key {
        r = r.header("idempotency-key", k);
    }
    r.body(Body::new()).unwrap()
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let layer = rt.block_on(async { FenceLayer::new(SledStore::open(dir.path()).unwrap()) });
    let inner = service_fn(|_req: Request<RequestBody<Body>>| async {
        Ok::<_, Infallible>(Response::new(Body::new()))
    });
    let svc = tower::Layer::layer(&layer, inner);
    let bare =
        service_fn(|_req: Request<Body>| async { Ok::<_, Infallible>(Response::new(Body::new())) });

    let mut g = c.benchmark_group("fence_layer");
    g.bench_function("bare service", |b| {
        b.to_async(&rt).iter(|| bare.oneshot(request("j", 1, None)))
    });
    g.bench_function("same generation", |b| {
        b.to_async(&rt)
            .iter(|| svc.clone().oneshot(request("same", 1, None)));
    });
    let next = AtomicU64::new(1);
    g.bench_function("new generation, durable", |b| {
        b.to_async(&rt).iter(|| {
            svc.clone()
                .oneshot(request("bump", next.fetch_add(1, Ordering::Relaxed), None))
        });
    });
    let key = AtomicU64::new(1);
    g.bench_function("idempotency key, durable", |b| {
        b.to_async(&rt).iter(|| {
            svc.clone().oneshot(request(
                "idem",
                1,
                Some(key.fetch_add(1, Ordering::Relaxed)),
            ))
        });
    });
    // Signed tokens (contract section 6).
    let signer = fence_core::signing::TokenSigner::from_seed([7; 32]);
    let verifier = fence_core::signing::TokenVerifier::new([signer.verify_key()]);
    let job: fence_core::JobId = "signed".parse().unwrap();
    let signed = signer.sign(&job, fence_core::Generation::new(1), *LATER_MS);
    let signature = signed.rsplit('.').next().unwrap().to_owned();
    g.bench_function("sign a token", |b| {
        b.iter(|| signer.sign(&job, fence_core::Generation::new(1), *LATER_MS))
    });
    g.bench_function("verify a token", |b| {
        b.iter(|| {
            assert!(verifier.verify(&job, fence_core::Generation::new(1), *LATER_MS, &signature))
        })
    });
    let signing_layer =
        FenceLayer::new(fence_sink::MemoryStore::new()).require_signatures(verifier);
    let plain_layer = FenceLayer::new(fence_sink::MemoryStore::new());
    let inner = service_fn(|_req: Request<RequestBody<Body>>| async {
        Ok::<_, Infallible>(Response::new(Body::new()))
    });
    let signed_svc = tower::Layer::layer(&signing_layer, inner);
    let plain_svc = tower::Layer::layer(&plain_layer, inner);
    let with_token = |job: &str, token: &str| {
        Request::post("/effects")
            .header("x-fencing-job", job)
            .header("x-fencing-token", token)
            .body(Body::new())
            .unwrap()
    };
    g.bench_function("same generation, signing off (memory store)", |b| {
        b.to_async(&rt)
            .iter(|| plain_svc.clone().oneshot(with_token("signed", "1")));
    });
    g.bench_function(
        "same generation, signing on, cache hit (memory store)",
        |b| {
            b.to_async(&rt)
                .iter(|| signed_svc.clone().oneshot(with_token("signed", &signed)));
        },
    );
    let tokens: Vec<(String, String)> = (0..10_000)
        .map(|i| {
            let job = format!("miss-{i}");
            let token = signer.sign(
                &job.parse().unwrap(),
                fence_core::Generation::new(1),
                *LATER_MS,
            );
            (job, token)
        })
        .collect();
    // Layers bounded to one cached job: every request below misses both the gate cache (and
    // reloads highest from the memory store) and, when signing, the signature cache.
    let plain_miss = tower::Layer::layer(
        &FenceLayer::new(fence_sink::MemoryStore::new()).max_cached_jobs(1),
        inner,
    );
    let signed_miss = tower::Layer::layer(
        &FenceLayer::new(fence_sink::MemoryStore::new())
            .max_cached_jobs(1)
            .require_signatures(fence_core::signing::TokenVerifier::new([
                signer.verify_key()
            ])),
        inner,
    );
    let next = AtomicU64::new(0);
    g.bench_function("job cache miss, signing off (memory store)", |b| {
        b.to_async(&rt).iter(|| {
            let (job, _) = &tokens[next.fetch_add(1, Ordering::Relaxed) as usize % tokens.len()];
            plain_miss.clone().oneshot(with_token(job, "1"))
        });
    });
    let next = AtomicU64::new(0);
    g.bench_function(
        "job cache miss, signing on, signature cache miss (memory store)",
        |b| {
            b.to_async(&rt).iter(|| {
                let (job, token) =
                    &tokens[next.fetch_add(1, Ordering::Relaxed) as usize % tokens.len()];
                signed_miss.clone().oneshot(with_token(job, token))
            });
        },
    );
    g.finish();
    let mut check = svc.clone();
    let status = rt.block_on(async {
        check
            .ready()
            .await
            .unwrap()
            .call(request("bump", 1, None))
            .await
            .unwrap()
            .status()
    });
    assert_eq!(status, 409, "the bump path really bumped");
}

criterion_group!(benches, bench);
criterion_main!(benches);
