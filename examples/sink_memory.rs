//! Memory per cached job in `FenceLayer`'s job cache, and the cache's bound: fills a layer
//! with JOBS distinct jobs (token 1 each, over a store that keeps nothing, so only the layer's
//! memory grows) and prints the growth of the process's resident set per cached job.
//!
//! ```text
//! cargo run --release --example sink_memory -- JOBS [CAPACITY=JOBS] [ID_LEN=12]
//! ```
//! prints `JOBS CAPACITY ID_LEN CACHED RSS_GROWTH_BYTES BYTES_PER_CACHED_JOB`.
//! Used by `bench/sink_scale.sh`.

use std::convert::Infallible;

use fence_core::{Generation, JobId};
use fence_sink::{FenceLayer, GenerationStore, StoreError, Verdict};
use http::{Method, Request, Response};
use tower::{Layer, Service, ServiceExt, service_fn};

/// Every job is at generation 1 and nothing is stored: only the layer's own memory counts.
struct AtOne;

impl GenerationStore for AtOne {
    async fn observe(&self, _: &JobId, token: Generation) -> Result<Verdict, StoreError> {
        Ok(if token >= Generation::new(1) {
            Verdict::Accepted
        } else {
            Verdict::Stale {
                highest: Generation::new(1),
            }
        })
    }
    async fn highest(&self, _: &JobId) -> Result<Generation, StoreError> {
        Ok(Generation::new(1))
    }
}

impl fence_sink::IdempotencyStore for AtOne {
    async fn begin(
        &self,
        _: fence_sink::Attempt<'_>,
        _: std::time::Duration,
    ) -> Result<fence_sink::Begin, StoreError> {
        Ok(fence_sink::Begin::Started)
    }
    async fn finish(
        &self,
        _: fence_sink::Attempt<'_>,
        _: fence_sink::Finish,
    ) -> Result<(), StoreError> {
        Ok(())
    }
    async fn purge_expired(&self) -> Result<usize, StoreError> {
        Ok(0)
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: sink_memory JOBS [CAPACITY=JOBS] [ID_LEN=12]";
    let jobs: usize = args.first().ok_or(usage)?.parse()?;
    let capacity: usize = args.get(1).map_or(Ok(jobs), |s| s.parse())?;
    let id_len: usize = args.get(2).map_or(Ok(12), |s| s.parse())?;
    let layer = FenceLayer::new(AtOne)
        .without_idempotency()
        .max_cached_jobs(capacity.max(1));
    let mut svc = layer.layer(service_fn(|_req: Request<_>| async {
        Ok::<_, Infallible>(Response::new(String::new()))
    }));
    let before = fence_suite::resident_bytes().ok_or("no VmRSS in /proc/self/status")?;
    for i in 0..jobs {
        let req = Request::builder()
            .method(Method::POST)
            .header("x-fencing-job", format!("{i:0>id_len$}"))
            .header("x-fencing-token", "1")
            .body(String::new())?;
        let response = svc.ready().await?.call(req).await?;
        if !response.status().is_success() {
            return Err(format!("job {i}: {}", response.status()).into());
        }
    }
    let grown = fence_suite::resident_bytes()
        .ok_or("no VmRSS in /proc/self/status")?
        .saturating_sub(before);
    let stats = layer.cache_stats();
    if stats.cached_jobs > capacity.max(1) {
        return Err(format!(
            "the cache holds {} jobs, over its bound {capacity}",
            stats.cached_jobs
        )
        .into());
    }
    // jobs capacity id_len cached rss_growth bytes_per_cached_job
    println!(
        "{jobs} {capacity} {id_len} {} {grown} {:.1}",
        stats.cached_jobs,
        grown as f64 / stats.cached_jobs.max(1) as f64
    );
    Ok(())
}
