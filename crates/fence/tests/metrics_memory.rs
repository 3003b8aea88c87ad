//! The metrics recorder's memory stays bounded in a process nobody scrapes.
//!
//! The Prometheus recorder keeps every histogram sample until they are folded into buckets.
//! A lease server records one latency sample per request; without the upkeep task
//! `telemetry::install` spawns, ten million claims left ten million samples in memory.
//! This test is its own binary because it installs the process's one recorder and counts the
//! process's heap.

use std::alloc::System;

use fence::telemetry::{UPKEEP_EVERY, install};
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};

#[global_allocator]
static HEAP: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const ROUNDS: u64 = 20;
const PER_ROUND: u64 = 50_000;
const WARM_UP: u64 = 10_000;

fn record(samples: u64) {
    for i in 0..samples {
        metrics::histogram!("fence_lease_request_seconds", "op" => "claim")
            .record((i % 1000) as f64 / 1e6);
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn histogram_samples_do_not_pile_up_between_scrapes() {
    let handle = install().expect("the recorder installs");
    // The first samples create the histogram and its first blocks: not growth.
    record(WARM_UP);
    tokio::time::sleep(UPKEEP_EVERY + std::time::Duration::from_millis(1)).await;

    let region = Region::new(HEAP);
    for _ in 0..ROUNDS {
        record(PER_ROUND);
        // Lets the upkeep task run, as five seconds of a real server would.
        tokio::time::sleep(UPKEEP_EVERY + std::time::Duration::from_millis(1)).await;
    }
    let change = region.change();
    let growth = change.bytes_allocated as i64 - change.bytes_deallocated as i64;
    // A held sample takes at least 8 bytes (16 MB for the million here without upkeep). With
    // upkeep, at most a few rounds' samples are allocated at once: the round being recorded,
    // the blocks the last fold handed to deferred reclamation, and slack.
    let bound = 3 * PER_ROUND as i64 * 8;
    assert!(
        growth < bound,
        "the heap grew by {growth} bytes (bound {bound}) over {} samples: the recorder is holding them",
        ROUNDS * PER_ROUND
    );

    // Nothing was dropped: every sample is counted in the rendered histogram.
    let text = handle.render();
    let count = text
        .lines()
        .find(|l| l.starts_with("fence_lease_request_seconds_count"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no count line in:\n{text}"));
    assert_eq!(count, WARM_UP + ROUNDS * PER_ROUND);
}
