#!/usr/bin/env bash
# Sink overhead, side by side in one session (issues 3 and 7): a bare hyper hello service;
# the same service behind FenceLayer on sled with (a) the same generation, (b) a new
# generation per request (a durable bump each), (c) a new Idempotency-Key per request;
# the bare service behind `fence proxy`; behind the least hyper proxy (hyper-util's pooled
# client, no fence: the floor fence proxy builds on); and behind nginx `proxy_pass` (Debian's
# nginx-light, a worker per core, upstream keepalive). wrk runs every case
# in alternating rounds, then once more at one connection (no queueing) for the latency each
# layer adds. Appends a section to BENCHMARKS.md.
#
# Usage: bench/sink_load.sh [DURATION_SECONDS=5] [ROUNDS=3]
#        (CONNS=8 connections; PROFILE=release or dist, the cargo profile of every binary)
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib.sh
dur=${1:-5}; rounds=${2:-3}; conns=${CONNS:-8}; profile=${PROFILE:-release}
need wrk; need nginx nginx-light; need curl
cargo build --profile "$profile" -q --example bench_sink -p fence-suite
cargo build --profile "$profile" -q -p fence --bin fence
bin=target/$profile
tmp=$(mktemp -d); pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT
bare=127.0.0.1:19001 layer=127.0.0.1:19002 proxy=127.0.0.1:19003 nginx=127.0.0.1:19005
hyperp=127.0.0.1:19006
$bin/examples/bench_sink bare "$bare" >/dev/null & pids+=($!)
$bin/examples/bench_sink fenced "$layer" "$tmp/layer" >/dev/null & pids+=($!)
RUST_LOG=warn $bin/fence proxy --listen "$proxy" --admin-listen 127.0.0.1:19004 \
  --upstream "http://$bare" --data-dir "$tmp/proxy" & pids+=($!)
$bin/examples/bench_sink proxy "$hyperp" "$bare" >/dev/null & pids+=($!)
nginx_pass_bare "$tmp/nginx" "$nginx" "$bare" & pids+=($!)
for a in "$bare" "$layer" "$proxy" "$hyperp" "$nginx"; do wait_http "http://$a/"; done

out=$tmp/rows
run() { # case address mode connections
  wrk_row "$1" -t"$4" -c"$4" -d"${dur}s" -s bench/fenced.lua "http://$2/" -- "$3" | tee -a "$out"
}
for i in $(seq 1 "$rounds"); do
  echo "round $i of $rounds ($conns connections)" >&2
  run bare "$bare" same "$conns"
  run same "$layer" same "$conns"
  run bump "$layer" bump "$conns"
  run idem "$layer" idem "$conns"
  run proxy "$proxy" same "$conns"
  run hyper "$hyperp" same "$conns"
  run nginx "$nginx" same "$conns"
done
for i in $(seq 1 "$rounds"); do
  echo "latency round $i of $rounds (1 connection)" >&2
  run bare1 "$bare" same 1
  run same1 "$layer" same 1
  run proxy1 "$proxy" same 1
  run hyper1 "$hyperp" same 1
  run nginx1 "$nginx" same 1
done

label() {
  case $1 in
    bare) echo "bare hyper" ;; same) echo "FenceLayer, (a) same generation" ;;
    bump) echo "FenceLayer, (b) new generation per request, durable" ;;
    idem) echo "FenceLayer, (c) new Idempotency-Key per request, durable" ;;
    proxy) echo "fence proxy → bare, same generation" ;; nginx) echo "nginx proxy_pass → bare" ;;
    hyper) echo "least hyper proxy (no fence) → bare" ;;
  esac
}
{
  header "Sink overhead side by side: ${conns} connections, ${dur}s × ${rounds} alternating rounds" \
    "CONNS=$conns PROFILE=$profile bench/sink_load.sh $dur $rounds"
  b=$(case_median "$out" bare 2); n=$(case_median "$out" nginx 2)
  echo "| case | req/s (median) | p50 µs | p99 µs | non-2xx | socket errors | × bare | × nginx |"
  echo "|---|---|---|---|---|---|---|---|"
  for c in bare same bump idem proxy hyper nginx; do
    r=$(case_median "$out" "$c" 2)
    echo "| $(label "$c") | $r | $(case_median "$out" "$c" 3) | $(case_median "$out" "$c" 4) |" \
      "$(case_sum "$out" "$c" 5) | $(case_sum "$out" "$c" 6) | $(ratio "$r" "$b") | $(ratio "$r" "$n") |"
  done
  echo
  echo "One connection, no queueing (latency each hop adds; medians of ${rounds} rounds):"
  echo
  echo "| case | req/s | p50 µs | p99 µs | p99 added over bare µs |"
  echo "|---|---|---|---|---|"
  b99=$(case_median "$out" bare1 4)
  for c in bare same proxy hyper nginx; do
    p99=$(case_median "$out" "${c}1" 4)
    echo "| $(label "$c") | $(case_median "$out" "${c}1" 2) | $(case_median "$out" "${c}1" 3) | $p99 | $((p99 - b99)) |"
  done
} | tee -a BENCHMARKS.md
