#!/usr/bin/env bash
# gRPC overhead, side by side in one session (issue 17): a unary Charge to the bare tonic
# ledger; to the same behind FenceLayer (sled); through `fence proxy` (sled, HTTP/2 to the
# upstream); through nginx `grpc_pass` (Debian's nginx, a worker per core, upstream
# keepalive). examples/grpc_load.rs is the load client (closed loop, a job per caller at
# token 1). Alternating rounds; appends a section to BENCHMARKS.md.
#
# Usage: bench/grpc.sh [DURATION_SECONDS=5] [ROUNDS=3]   (CALLERS=16)
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib.sh
dur=${1:-5}; rounds=${2:-3}; callers=${CALLERS:-16}
need nginx nginx
cargo build --release -q --example grpc_load -p fence-suite
cargo build --release -q -p fence --bin fence
bin=target/release
tmp=$(mktemp -d); pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT
bare=127.0.0.1:19101 layer=127.0.0.1:19102 proxy=127.0.0.1:19103 nginx=127.0.0.1:19105
$bin/examples/grpc_load serve bare "$bare" & pids+=($!)
$bin/examples/grpc_load serve layer "$layer" "$tmp/layer" & pids+=($!)
RUST_LOG=warn $bin/fence proxy --listen "$proxy" --admin-listen 127.0.0.1:19104 \
  --upstream "http://$bare" --data-dir "$tmp/proxy" & pids+=($!)
nginx_grpc_pass "$tmp/nginx" "$nginx" "$bare" & pids+=($!)
sleep 2
out=$tmp/rows
for i in $(seq 1 "$rounds"); do
  for c in bare:$bare layer:$layer proxy:$proxy nginx:$nginx; do
    row=$($bin/examples/grpc_load load "http://${c#*:}" "$callers" "$dur")
    echo "${c%%:*} $row" | tee -a "$out"
  done
done
{
  header "gRPC unary Charge: bare tonic, FenceLayer, fence proxy, nginx grpc_pass; $callers callers, ${dur}s x $rounds alternating rounds" "bench/grpc.sh $dur $rounds   # CALLERS=$callers"
  echo "| path | calls/s (median) | vs bare | p50 µs | p99 µs | errors |"
  echo "|---|---:|---:|---:|---:|---:|"
  b=$(case_median "$out" bare 2)
  for c in bare layer proxy nginx; do
    r=$(case_median "$out" $c 2)
    echo "| $c | $r | $(ratio "$r" "$b") | $(case_median "$out" $c 3) | $(case_median "$out" $c 4) | $(case_sum "$out" $c 5) |"
  done
  echo
  echo "Rounds (path, calls/s, p50 µs, p99 µs, errors):"
  echo
  echo '```'
  cat "$out"
  echo '```'
} >> BENCHMARKS.md
