//! Progress-bound renewals through `fence run --progress-file`: a command that keeps touching
//! the file keeps its lease past many TTLs; one that stops (alive but hung) loses the lease,
//! is stopped like on any loss (exit 75), and the lease expires at the server.

mod common;

use std::time::{Duration, Instant};

use common::*;

#[test]
fn a_command_that_touches_its_progress_file_keeps_the_lease() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, url) = start_server(&dir.path().join("leases"));
    let progress = dir.path().join("progress");
    // 7 s of work (past two TTLs), touching the file every 200 ms, under a 3 s lease bound
    // to 1.5 s. Not a 1 s lease: one renewal answered 0.6 s late, on a loaded CI machine,
    // would lose it.
    let out = fence(&[
        "run",
        "--server",
        &url,
        "--job",
        "steady",
        "--ttl",
        "3s",
        "--progress-file",
        progress.to_str().unwrap(),
        "--progress-within",
        "1500ms",
        "--",
        "sh",
        "-c",
        r#"test "$FENCE_PROGRESS_FILE" = "$0" || exit 9; i=0; while [ $i -lt 35 ]; do touch "$0"; sleep 0.2; i=$((i+1)); done"#,
        progress.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let record = json(&fence(&["status", "--server", &url, "--job", "steady"]));
    assert_eq!(record["state"], "completed", "{record}");
}

#[test]
fn a_command_that_stops_making_progress_loses_the_lease_and_is_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, url) = start_server(&dir.path().join("leases"));
    let progress = dir.path().join("progress");
    let started = Instant::now();
    // Touches the file twice, then hangs (alive, still renewable but for the progress rule).
    let out = fence(&[
        "run",
        "--server",
        &url,
        "--job",
        "stuck",
        "--ttl",
        "2s",
        "--grace",
        "1s",
        "--progress-file",
        progress.to_str().unwrap(),
        "--progress-within",
        "1s",
        "--",
        "sh",
        "-c",
        r#"touch "$0"; sleep 0.3; touch "$0"; exec sleep 60"#,
        progress.to_str().unwrap(),
    ]);
    let took = started.elapsed();
    assert_eq!(out.status.code(), Some(75), "{out:?}");
    assert!(took < Duration::from_secs(10), "stopped after {took:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no progress"), "{stderr}");
    // Not released: the lease runs out at the server, then the next run gets generation 2.
    let record = json(&fence(&["status", "--server", &url, "--job", "stuck"]));
    assert_ne!(record["state"], "free", "{record}");
    let out = fence(&[
        "run", "--server", &url, "--job", "stuck", "--wait", "5s", "--", "true",
    ]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let record = json(&fence(&["status", "--server", &url, "--job", "stuck"]));
    assert_eq!(record["generation"], 2, "{record}");

    let out = fence(&[
        "run",
        "--server",
        &url,
        "--job",
        "x",
        "--progress-within",
        "1s",
        "--",
        "true",
    ]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "--progress-within alone: {out:?}"
    );
}
