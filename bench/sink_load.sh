#!/usr/bin/env bash
# Side-by-side load of a bare hyper hello service and the same behind FenceLayer (issue 3):
# (a) same generation, (b) a new generation per request (durable bump), (c) idempotency keys.
# Alternating runs in one session; appends a table to BENCHMARKS.md.
# Usage: bench/sink_load.sh [DURATION_SECONDS=10] [ROUNDS=3]
set -euo pipefail
cd "$(dirname "$0")/.."
dur=${1:-10}; rounds=${2:-3}; conns=${CONNS:-8}
command -v wrk >/dev/null || { echo "wrk is needed: apt-get install wrk" >&2; exit 1; }
cargo build --release --example bench_sink -q
bin=target/release/examples/bench_sink
data=$(mktemp -d)
"$bin" bare 127.0.0.1:19001 >/dev/null & bare=$!
"$bin" fenced 127.0.0.1:19002 "$data" >/dev/null & fenced=$!
trap 'kill $bare $fenced 2>/dev/null; rm -rf "$data"' EXIT
sleep 1
out=$(mktemp)
run() { # name url mode
  local r
  r=$(wrk -t"$conns" -c"$conns" -d"${dur}s" --latency -s bench/fenced.lua "$2" -- "$3")
  local rps p50 p99 bad
  rps=$(awk '/Requests\/sec/ {print $2}' <<<"$r")
  p50=$(awk '$1=="50%" {print $2}' <<<"$r")
  p99=$(awk '$1=="99%" {print $2}' <<<"$r")
  bad=$(awk '/non-2xx:/ {print $2}' <<<"$r")
  echo "$1 $rps $p50 $p99 $bad" | tee -a "$out"
}
for i in $(seq 1 "$rounds"); do
  run bare http://127.0.0.1:19001/ same
  run same http://127.0.0.1:19002/ same
  run bump http://127.0.0.1:19002/ bump
  run idem http://127.0.0.1:19002/ idem
done
{
  echo
  echo "### Sink under wrk load, $(date -u +%F), $(nproc) cores, ${conns} connections, ${dur}s x ${rounds} alternating rounds"
  echo
  echo '```'
  echo "bench/sink_load.sh $dur $rounds"
  echo '```'
  echo
  echo "| case | req/s (median of rounds) | p50 | p99 | non-2xx | ratio to bare |"
  echo "|---|---|---|---|---|---|"
  bare_rps=$(awk '$1=="bare" {print $2}' "$out" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
  for c in bare same bump idem; do
    awk -v c="$c" -v b="$bare_rps" '$1==c {rps[++n]=$2; p50[n]=$3; p99[n]=$4; bad+=$5}
      END { asort(rps); m=rps[int((n+1)/2)]; printf "| %s | %.0f | %s | %s | %d | %.2f |\n", c, m, p50[1], p99[1], bad, m/b }' "$out"
  done
} | tee -a BENCHMARKS.md
