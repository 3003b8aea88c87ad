//! What operators see: one Prometheus recorder with real histograms, HELP on every family.
//!
//! Latencies are histograms with fixed buckets (not summaries, which read 0 after a quiet
//! minute and cannot be added up across instances). Gauges are set from the state itself:
//! the server counts its leases every [`COUNT_EVERY`]; the proxy reads its cache when
//! `/metrics` is scraped.
//!
//! The recorder keeps every histogram sample it is given until someone folds them into the
//! buckets: rendering `/metrics` does, and so does [`upkeep`], which [`install`] spawns every
//! [`UPKEEP_EVERY`]. Without it, a process nobody scrapes holds each request's latency sample
//! for ever: the lease server grew by about 35 bytes per request (65 MiB to 399 MiB over ten
//! million claims) until this ran.

use std::time::Duration;

use anyhow::Context as _;
use fence_core::lease_api::{LeaseState, ListQuery, MAX_LIST_LIMIT};
use fence_lease::LeaseStore;
use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Bucket bounds of every `*_seconds` histogram: 0.5 ms to 10 s.
const BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// How often the lease server counts its jobs and held leases for the gauges.
pub const COUNT_EVERY: Duration = Duration::from_secs(15);

/// How often the recorder folds the histogram samples it holds into their buckets, so the
/// memory they take stays bounded by the request rate over this period.
pub const UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// Installs the process's metrics recorder, describes every metric fence exports and spawns
/// its [`upkeep`] on the current Tokio runtime.
///
/// # Errors
/// When a recorder is installed already, or when called outside a Tokio runtime.
pub fn install() -> anyhow::Result<PrometheusHandle> {
    let runtime = tokio::runtime::Handle::try_current()
        .context("the metrics recorder needs a Tokio runtime for its upkeep")?;
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &BUCKETS)
        .context("configuring the latency buckets")?
        .install_recorder()
        .context("installing the metrics recorder")?;
    describe();
    metrics::gauge!(
        "fence_build_info",
        "version" => env!("CARGO_PKG_VERSION"),
        "protocol" => "2"
    )
    .set(1.0);
    runtime.spawn(upkeep(handle.clone()));
    Ok(handle)
}

/// Folds the recorder's pending histogram samples into their buckets every
/// [`UPKEEP_EVERY`], for as long as the runtime runs.
pub async fn upkeep(handle: PrometheusHandle) {
    let mut tick = every(UPKEEP_EVERY);
    loop {
        tick.tick().await;
        handle.run_upkeep();
    }
}

/// A timer for background work every `period`: a late tick delays the next ones rather than
/// firing a burst to catch up.
fn every(period: Duration) -> tokio::time::Interval {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick
}

fn describe() {
    describe_counter!(
        "fence_lease_requests_total",
        Unit::Count,
        format!(
            "Lease API requests answered, by op ({}) and outcome ({}).",
            crate::server::LEASE_OPS.join(", "),
            crate::server::LEASE_OUTCOMES.join(", ")
        )
    );
    describe_histogram!(
        "fence_lease_request_seconds",
        Unit::Seconds,
        format!(
            "Time to answer a lease API request, store write included, by op ({}).",
            crate::server::LEASE_OPS.join(", ")
        )
    );
    describe_gauge!(
        "fence_lease_jobs",
        Unit::Count,
        "Jobs the lease store holds a record of (counted every 15 s)."
    );
    describe_gauge!(
        "fence_lease_held",
        Unit::Count,
        "Jobs whose lease is held now (counted every 15 s)."
    );
    describe_gauge!(
        "fence_lease_waiting_claims",
        Unit::Count,
        "Claims waiting for a held job (claim?wait=), over every job."
    );
    describe_counter!(
        "fence_sink_requests_total",
        Unit::Count,
        format!(
            "Requests the fence decided on, by outcome ({}).",
            fence_sink::metrics::OUTCOMES.join(", ")
        )
    );
    describe_gauge!(
        "fence_sink_idempotency_stored_bytes",
        Unit::Bytes,
        "Bytes the stored idempotency records hold (memory and sled stores), as last read when a new key began; new keys are refused at --idempotency-max-stored."
    );
    describe_gauge!(
        "fence_build_info",
        Unit::Count,
        "Always 1; its labels say which build runs: version (of the fence package) and the protocol version."
    );
    describe_counter!(
        "fence_proxy_upstream_requests_total",
        Unit::Count,
        format!(
            "Requests the proxy handled for the upstream, by outcome ({}; overloaded: never sent, no room for another upstream connection or the connection's gRPC calls at --h2-max-streams).",
            crate::proxy::UPSTREAM_OUTCOMES.join(", ")
        )
    );
    describe_histogram!(
        "fence_proxy_upstream_seconds",
        Unit::Seconds,
        format!(
            "Time from sending a request upstream to its response head, by outcome ({}).",
            crate::proxy::UPSTREAM_OUTCOMES.join(", ")
        )
    );
    describe_gauge!(
        "fence_proxy_cached_jobs",
        Unit::Count,
        "Jobs the proxy's fence holds in memory (read when /metrics is scraped)."
    );
    describe_gauge!(
        "fence_proxy_in_flight",
        Unit::Count,
        "Admitted requests still running, over every job (read when /metrics is scraped)."
    );
    describe_gauge!(
        "fence_proxy_buffered_bytes",
        Unit::Bytes,
        "Bytes of bodies the fence holds in memory: buffered idempotent requests, captured responses, replays."
    );
}

/// Counts `store`'s jobs and held leases into the gauges at once and then every
/// [`COUNT_EVERY`] (or 19 times as long as a count took, when that is longer), until the
/// returned task is aborted. A page at a time, so a large store costs a scan per count, not
/// a pause.
pub fn count_leases<S: LeaseStore + Clone>(store: S) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let started = tokio::time::Instant::now();
            let mut query = ListQuery {
                limit: Some(MAX_LIST_LIMIT),
                ..ListQuery::default()
            };
            let (mut jobs, mut held) = (0u64, 0u64);
            loop {
                let Ok(page) = store.list(&query).await else {
                    break; // the store failed: keep the last counts
                };
                jobs += page.leases.len() as u64;
                held += page
                    .leases
                    .iter()
                    .filter(|r| r.state == LeaseState::Held)
                    .count() as u64;
                match page.next {
                    Some(next) => query.after = Some(next),
                    None => {
                        metrics::gauge!("fence_lease_jobs").set(jobs as f64);
                        metrics::gauge!("fence_lease_held").set(held as f64);
                        break;
                    }
                }
                tokio::task::yield_now().await;
            }
            // A store of millions of jobs takes a while to count: wait at least 19 times as
            // long as the count took, so counting never costs more than 5% of a core.
            tokio::time::sleep(COUNT_EVERY.max(started.elapsed() * 19)).await;
        }
    })
}
