#!/usr/bin/env bash
# Sink memory and latency with many distinct jobs (issue 7): for 1k, 100k, 1M and 10M jobs
# stored at generation 1, a FenceLayer on sled (caching up to CACHE jobs, default 1,000,000)
# takes wrk load on jobs drawn uniformly at random: a warm-up run, then a measured run.
# Reports req/s, p50, p99, the cache's hit rate in the measured run, cached jobs, the
# process's RSS and the store's size on disk; then the cache's own bytes per job
# (examples/sink_memory.rs). Appends a section to BENCHMARKS.md.
#
# Usage: bench/sink_scale.sh [SECONDS=10] [JOB_COUNTS="1000 100000 1000000 10000000"]
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib.sh
secs=${1:-10}; counts=${2:-"1000 100000 1000000 10000000"}; cache=${CACHE:-1000000}
need wrk; need curl
cargo build --release -q -p fence-suite --example bench_sink --example sink_memory
bin=target/release/examples/bench_sink
tmp=$(mktemp -d); pid=
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT
addr=127.0.0.1:19401
rows=""
for n in $counts; do
  dir=$tmp/jobs-$n
  "$bin" seed "$dir" "$n"
  CACHE=$cache "$bin" fenced "$addr" "$dir" >/dev/null & pid=$!
  wait_http "http://$addr/_stats"
  wrk -t2 -c16 -d"${secs}s" -s bench/scale.lua "http://$addr/" -- "$n" >/dev/null
  read -r _ h0 m0 _ < <(curl -s "http://$addr/_stats")
  row=$(wrk_row "$n" -t2 -c16 -d"${secs}s" -s bench/scale.lua "http://$addr/" -- "$n")
  read -r cached h1 m1 rss < <(curl -s "http://$addr/_stats")
  kill "$pid"; wait "$pid" 2>/dev/null || true; pid=
  read -r _ rps p50 p99 bad errs <<<"$row"
  [ "$bad" = 0 ] && [ "$errs" = 0 ] || { echo "$n jobs: $bad non-2xx answers, $errs socket errors" >&2; exit 1; }
  hit=$(awk -v h=$((h1 - h0)) -v m=$((m1 - m0)) 'BEGIN { printf "%.1f%%", 100 * h / (h + m) }')
  disk=$(du -sm "$dir" | cut -f1)
  echo "$n jobs: $rps req/s, p50 ${p50} µs, p99 ${p99} µs, hit rate $hit, cached $cached, RSS $((rss / 1048576)) MiB, disk ${disk} MiB" >&2
  rows+="| $n | $rps | $p50 | $p99 | $hit | $cached | $((rss / 1048576)) | $disk |"$'\n'
  rm -rf "$dir"
done
mem=""
for id_len in 12 36; do
  read -r _ _ _ cached grown per < <(target/release/examples/sink_memory 1000000 1000000 "$id_len")
  mem+="| 1,000,000 | 1,000,000 | $id_len | $cached | $((grown / 1048576)) | $per |"$'\n'
done
for sent in 1000000 10000000; do
  read -r _ _ _ cached grown per < <(target/release/examples/sink_memory "$sent" 100000 12)
  mem+="| $sent | 100,000 | 12 | $cached | $((grown / 1048576)) | $per |"$'\n'
done
{
  header "Sink with many jobs: ${secs}s warm-up + ${secs}s measured per row, cache bound ${cache}" \
    "CACHE=$cache bench/sink_scale.sh $secs \"$counts\""
  echo "wrk, 16 connections, token 1 on a job drawn uniformly at random; every job stored at generation 1 beforehand."
  echo
  echo "| distinct jobs | req/s | p50 µs | p99 µs | cache hit rate (measured run) | cached jobs | RSS MiB | sled on disk MiB |"
  echo "|---|---|---|---|---|---|---|---|"
  printf "%s" "$rows"
  echo
  echo "The job cache alone (\`examples/sink_memory.rs\`: RSS growth while a layer over a store that keeps nothing fills up):"
  echo
  echo "| jobs sent | cache bound | job id length | cached jobs | RSS growth MiB | bytes per cached job |"
  echo "|---|---|---|---|---|---|"
  printf "%s" "$mem"
} | tee -a BENCHMARKS.md
