#!/usr/bin/env bash
# gRPC unary Charge through `fence proxy` and through FenceLayer (examples/grpc_load's
# in-process ledger) of two prebuilt builds, alternating rounds, in front of one bare tonic
# ledger: an A/B of the gRPC paths that needs no rebuild (bench/grpc.sh compares against nginx).
#
# Usage: bench/ab_grpc.sh DIR_A DIR_B [SECONDS=5] [ROUNDS=3]   (CALLERS=16; each DIR holding
#        `fence` and `grpc_load`: target/release/fence, target/release/examples/grpc_load)
set -euo pipefail
cd "$(dirname "$0")/.."; source bench/lib.sh
A=${1:?usage: bench/ab_grpc.sh DIR_A DIR_B}; B=${2:?usage: bench/ab_grpc.sh DIR_A DIR_B}
secs=${3:-5}; rounds=${4:-3}; callers=${CALLERS:-16}
tmp=$(mktemp -d -p "$PWD/target"); pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT
bare=127.0.0.1:19201
"$B/grpc_load" serve bare "$bare" & pids+=($!)
"$A/grpc_load" serve layer 127.0.0.1:19202 "$tmp/la" & pids+=($!)
"$B/grpc_load" serve layer 127.0.0.1:19203 "$tmp/lb" & pids+=($!)
RUST_LOG=warn "$A/fence" proxy --listen 127.0.0.1:19204 --admin-listen 127.0.0.1:19205 \
  --upstream "http://$bare" --data-dir "$tmp/pa" & pids+=($!)
RUST_LOG=warn "$B/fence" proxy --listen 127.0.0.1:19206 --admin-listen 127.0.0.1:19207 \
  --upstream "http://$bare" --data-dir "$tmp/pb" & pids+=($!)
for port in 19201 19202 19203 19204 19206; do wait_tcp "127.0.0.1:$port"; done
out=$tmp/rows
for i in $(seq 1 "$rounds"); do
  for c in layer-A:19202 layer-B:19203 proxy-A:19204 proxy-B:19206; do
    echo "${c%%:*} $("$B/grpc_load" load "http://127.0.0.1:${c#*:}" "$callers" "$secs")" | tee -a "$out"
  done
done
echo "| path | A calls/s | B calls/s | B/A | p99 µs A / B | errors A / B |"
echo "|---|---:|---:|---:|---|---|"
for p in layer proxy; do
  a=$(case_median "$out" "$p-A" 2); b=$(case_median "$out" "$p-B" 2)
  echo "| $p | $a | $b | $(ratio "$b" "$a") | $(case_median "$out" "$p-A" 4) / $(case_median "$out" "$p-B" 4) |" \
    "$(case_sum "$out" "$p-A" 5) / $(case_sum "$out" "$p-B" 5) |"
done
