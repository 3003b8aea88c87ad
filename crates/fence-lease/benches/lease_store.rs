//! Claim and renew on the durable sled lease store: one task, and 64 concurrent tasks
//! sharing group commits. Every measured operation is on disk before it returns.
//!
//! `cargo bench -p fence-lease --bench lease_store`

#![allow(missing_docs)] // criterion_group! generates an undocumented function

use std::{sync::Arc, time::Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use fence_core::{Generation, JobId, Owner};
use fence_lease::{LeaseKey, LeaseStore, Outcome, SledLeaseStore, Ttl, new_lease_key};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

async fn claim_release(store: &SledLeaseStore, job: &JobId, owner: &Owner, key: &LeaseKey) {
    match store.claim(job, owner, key, Ttl::DEFAULT).await.unwrap() {
        Outcome::Granted(g) => {
            store.release(job, owner, g.generation, key).await.unwrap();
        }
        other => panic!("{other:?}"),
    }
}

fn bench(c: &mut Criterion) {
    let rt = runtime();
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(SledLeaseStore::open(dir.path()).unwrap());
    let owner: Owner = "bench".parse().unwrap();
    let key = new_lease_key().unwrap();

    let mut g = c.benchmark_group("sled_lease_store");
    g.sample_size(20);
    g.throughput(Throughput::Elements(1));
    g.bench_function("claim+release/1 task", |b| {
        let job: JobId = "single".parse().unwrap();
        b.to_async(&rt)
            .iter(|| claim_release(&store, &job, &owner, &key));
    });
    g.bench_function("renew/1 task", |b| {
        let job: JobId = "renew-single".parse().unwrap();
        let Outcome::Granted(grant) = rt
            .block_on(store.claim(&job, &owner, &key, Ttl::DEFAULT))
            .unwrap()
        else {
            panic!()
        };
        b.to_async(&rt).iter(|| async {
            store
                .renew(&job, &owner, grant.generation, &key, Ttl::DEFAULT)
                .await
                .unwrap()
        });
    });

    const TASKS: u64 = 64;
    g.throughput(Throughput::Elements(TASKS));
    for op in ["claim+release", "renew"] {
        g.bench_function(format!("{op}/64 tasks"), |b| {
            b.to_async(&rt).iter_custom(|iters| {
                let (store, key) = (store.clone(), key.clone());
                async move {
                    let start = Instant::now();
                    let tasks: Vec<_> = (0..TASKS)
                        .map(|t| {
                            let (store, key) = (store.clone(), key.clone());
                            tokio::spawn(async move {
                                let (job, owner): (JobId, Owner) = (
                                    format!("{op}-{t}").parse().unwrap(),
                                    format!("o{t}").parse().unwrap(),
                                );
                                let mut generation = Generation::ZERO;
                                for _ in 0..iters {
                                    if op == "renew" {
                                        if generation == Generation::ZERO {
                                            let Outcome::Granted(g) = store
                                                .claim(&job, &owner, &key, Ttl::DEFAULT)
                                                .await
                                                .unwrap()
                                            else {
                                                panic!()
                                            };
                                            generation = g.generation;
                                        }
                                        store
                                            .renew(&job, &owner, generation, &key, Ttl::DEFAULT)
                                            .await
                                            .unwrap();
                                    } else {
                                        claim_release(&store, &job, &owner, &key).await;
                                    }
                                }
                            })
                        })
                        .collect();
                    for t in tasks {
                        t.await.unwrap();
                    }
                    start.elapsed()
                }
            });
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
