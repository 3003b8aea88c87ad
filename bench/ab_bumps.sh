#!/usr/bin/env bash
# Bumps (a new generation per request, jobs spread as in bench/limits.sh) through the layer
# and `fence proxy` of two prebuilt sets of binaries, alternating rounds at 8 and 64
# connections: an A/B that needs no rebuild (bench/ab.sh builds both sides from commits).
#
# Usage: bench/ab_bumps.sh DIR_A DIR_B   (each holding `fence` and `bench_sink`, e.g. copies of
#        target/release/fence and target/release/examples/bench_sink of two builds)
set -euo pipefail
cd "$(dirname "$0")/.."; source bench/lib.sh
A=${1:?usage: bench/ab_bumps.sh DIR_A DIR_B}; B=${2:?usage: bench/ab_bumps.sh DIR_A DIR_B}
tmp=$(mktemp -d -p "$PWD/target"); pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT
"$A/bench_sink" bare 127.0.0.1:19602 >/dev/null & pids+=($!)
for s in A B; do
  p=$([ $s = A ] && echo 19610 || echo 19620)
  d=$([ $s = A ] && echo "$A" || echo "$B")
  "$d/bench_sink" fenced 127.0.0.1:$((p+1)) $tmp/layer$s >/dev/null & pids+=($!)
  RUST_LOG=warn "$d/fence" proxy --listen 127.0.0.1:$((p+2)) --admin-listen 127.0.0.1:$((p+3)) --upstream http://127.0.0.1:19602 --data-dir $tmp/proxy$s & pids+=($!)
done
sleep 1.5
out=$tmp/rows
for i in 1 2 3; do for c in 8 64; do for s in A B; do
  p=$([ $s = A ] && echo 19610 || echo 19620)
  wrk_row "layer$s-$c" -t2 -c$c -d4s -s bench/fenced.lua http://127.0.0.1:$((p+1))/ -- spread l$s$i$c $((4*c)) | tee -a $out
  wrk_row "proxy$s-$c" -t2 -c$c -d4s -s bench/fenced.lua http://127.0.0.1:$((p+2))/ -- spread p$s$i$c $((4*c)) | tee -a $out
done; done; done
echo "| case | connections | A req/s | B req/s | B/A |"
echo "|---|---:|---:|---:|---:|"
for k in layer proxy; do for c in 8 64; do
  a=$(case_median $out $k"A-$c" 2); b=$(case_median $out $k"B-$c" 2)
  echo "| $k bumps | $c | $a | $b | $(ratio $b $a) |"
done; done
