#!/usr/bin/env bash
# `fence proxy` of two prebuilt binaries with the same generation (and nginx proxy_pass beside
# them) in front of one bare hyper service, alternating rounds at 8 and 64 connections: an
# A/B that needs no rebuild (bench/ab.sh builds both sides from commits).
#
# Usage: bench/ab_proxy.sh DIR_A DIR_B [SECONDS=4] [ROUNDS=3]   (each DIR holding `fence`;
#        DIR_A also `bench_sink`)
set -euo pipefail
cd "$(dirname "$0")/.."; source bench/lib.sh
A=${1:?usage: bench/ab_proxy.sh DIR_A DIR_B}; B=${2:?usage: bench/ab_proxy.sh DIR_A DIR_B}
secs=${3:-4}; rounds=${4:-3}
command -v nginx >/dev/null || apt-get install -y -qq nginx-light >/dev/null
tmp=$(mktemp -d -p "$PWD/target"); pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT
bare=127.0.0.1:19902 nginx=127.0.0.1:19905
"$A/bench_sink" bare "$bare" >/dev/null & pids+=($!)
RUST_LOG=warn "$A/fence" proxy --listen 127.0.0.1:19910 --admin-listen 127.0.0.1:19911 \
  --upstream "http://$bare" --data-dir "$tmp/a" & pids+=($!)
RUST_LOG=warn "$B/fence" proxy --listen 127.0.0.1:19920 --admin-listen 127.0.0.1:19921 \
  --upstream "http://$bare" --data-dir "$tmp/b" & pids+=($!)
nginx_pass_bare "$tmp/nginx" "$nginx" "$bare" & pids+=($!)
for a in "$bare" 127.0.0.1:19910 127.0.0.1:19920 "$nginx"; do wait_http "http://$a/"; done
out=$tmp/rows
# A and B take turns going first (A in odd rounds, B in even ones): on this host the side that
# runs first in a round tends to do better, whichever build it is. An even ROUNDS evens it out.
for i in $(seq 1 "$rounds"); do for c in 8 64; do
  sides=("A 19910" "B 19920"); [ $((i % 2)) -eq 1 ] || sides=("B 19920" "A 19910")
  for side in "${sides[@]}"; do
    read -r name port <<<"$side"
    wrk_row "$name-$c" -t2 -c"$c" -d"${secs}s" -s bench/fenced.lua "http://127.0.0.1:$port/" -- same | tee -a "$out"
  done
  wrk_row "nginx-$c" -t2 -c"$c" -d"${secs}s" -s bench/fenced.lua "http://$nginx/" -- same | tee -a "$out"
done; done
echo "| connections | A req/s | B req/s | B/A | nginx req/s | A/nginx | B/nginx | p99 µs A / B / nginx |"
echo "|---:|---:|---:|---:|---:|---:|---:|---|"
for c in 8 64; do
  a=$(case_median "$out" "A-$c" 2); b=$(case_median "$out" "B-$c" 2); n=$(case_median "$out" "nginx-$c" 2)
  echo "| $c | $a | $b | $(ratio "$b" "$a") | $n | $(ratio "$a" "$n") | $(ratio "$b" "$n") |" \
    "$(case_median "$out" "A-$c" 4) / $(case_median "$out" "B-$c" 4) / $(case_median "$out" "nginx-$c" 4) |"
done
