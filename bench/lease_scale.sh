#!/usr/bin/env bash
# The lease server with a million jobs on disk (issue 7): fills a sled lease store with JOBS
# held jobs (examples/lease_load.rs fill), then measures `fence server` on it: time from
# start to a healthy answer, after a clean stop and after SIGKILL; RSS; claims of new jobs and
# renewals at 64 connections (wrk) against the same on an empty store, in alternating rounds.
# Appends a section to BENCHMARKS.md.
#
# Usage: bench/lease_scale.sh [SECONDS=5] [ROUNDS=2] [JOBS=1000000]
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib.sh
secs=${1:-5}; rounds=${2:-2}; jobs=${3:-1000000}
need wrk; need curl
cargo build --release -q -p fence --bin fence
cargo build --release -q -p fence-suite --example lease_load
tmp=$(mktemp -d); pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT
full=127.0.0.1:19501 empty=127.0.0.1:19502

fill_started=$(date +%s.%N)
target/release/examples/lease_load fill "$tmp/full" "$jobs"
fill_secs=$(awk -v a="$fill_started" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
disk=$(du -sm "$tmp/full" | cut -f1)

# start DIR ADDR: starts a server, sets $took to the seconds until /healthz answered 200.
start() {
  local t0; t0=$(date +%s.%N)
  RUST_LOG=warn target/release/fence server --listen "$2" --data-dir "$1" >>"$tmp/server.log" 2>&1 & pids+=($!)
  for _ in $(seq 1 600); do
    curl -sf -o /dev/null "http://$2/healthz" && break
    sleep 0.05
  done
  curl -sf -o /dev/null "http://$2/healthz" || { echo "server on $1 did not become healthy" >&2; exit 1; }
  took=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }')
}
server_pid() { pgrep -f "fence server --listen $1" | head -1; }
rss_mib() { awk '/VmRSS/ {printf "%.0f", $2/1024}' "/proc/$1/status"; }
check_sample() { # the last job filled must still be held by the filler at generation 1
  curl -sf "http://$1/v1/leases/f-$((jobs - 1))" | grep -q '"generation":1' \
    || { echo "job f-$((jobs - 1)) is not as filled on $1" >&2; exit 1; }
}

start "$tmp/full" "$full"; cold=$took; check_sample "$full"
p=$(server_pid "$full"); kill -TERM "$p"; while kill -0 "$p" 2>/dev/null; do sleep 0.05; done
start "$tmp/full" "$full"; clean=$took; check_sample "$full"
p=$(server_pid "$full"); kill -KILL "$p"; while kill -0 "$p" 2>/dev/null; do sleep 0.05; done
start "$tmp/full" "$full"; crash=$took; check_sample "$full"
start "$tmp/empty" "$empty"
claim_renewable "$full"; claim_renewable "$empty"
out=$tmp/rows
for i in $(seq 1 "$rounds"); do
  for a in full empty; do
    addr=$([ $a = full ] && echo "$full" || echo "$empty")
    wrk_row "${a}_claim" -t2 -c64 -d"${secs}s" -s bench/lease.lua "http://$addr" -- claim "n$i" 64 | tee -a "$out" >&2
    wrk_row "${a}_renew" -t2 -c64 -d"${secs}s" -s bench/lease.lua "http://$addr" -- renew r 64 | tee -a "$out" >&2
  done
done
rss_full=$(rss_mib "$(server_pid "$full")"); rss_empty=$(rss_mib "$(server_pid "$empty")")
{
  header "Lease server with $jobs jobs on disk, ${secs}s × ${rounds} alternating rounds" \
    "bench/lease_scale.sh $secs $rounds $jobs"
  echo "Filling: $jobs durable claims (64 at a time, in-process) took ${fill_secs}s; the sled store is ${disk} MiB on disk."
  echo
  echo "| start of \`fence server\` until \`/healthz\` answers 200 | seconds |"
  echo "|---|---|"
  echo "| first start on the filled store | $cold |"
  echo "| restart after SIGTERM | $clean |"
  echo "| restart after SIGKILL | $crash |"
  echo
  echo "| store | claims of new jobs/s | p99 µs | renewals/s | p99 µs | RSS after the runs MiB |"
  echo "|---|---|---|---|---|---|"
  echo "| $jobs jobs | $(case_median "$out" full_claim 2) | $(case_median "$out" full_claim 4) | $(case_median "$out" full_renew 2) | $(case_median "$out" full_renew 4) | $rss_full |"
  echo "| empty | $(case_median "$out" empty_claim 2) | $(case_median "$out" empty_claim 4) | $(case_median "$out" empty_renew 2) | $(case_median "$out" empty_renew 4) | $rss_empty |"
} | tee -a BENCHMARKS.md
