#!/usr/bin/env bash
# fence proxy in front of a bare hyper service, with signed tokens required (--verify-key)
# and without, in alternating wrk rounds on the same-generation path. Appends to BENCHMARKS.md.
# Usage: bench/proxy_signing.sh [DURATION_SECONDS=5] [ROUNDS=3]
set -euo pipefail
cd "$(dirname "$0")/.."
dur=${1:-5}; rounds=${2:-3}; conns=${CONNS:-16}
command -v wrk >/dev/null || { echo "wrk is needed: apt-get install wrk" >&2; exit 1; }
cargo build --release -q -p fence --bin fence
cargo build --release -q --example bench_sink
fence=target/release/fence
tmp=$(mktemp -d)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; rm -rf "$tmp"' EXIT
"$fence" keygen --out "$tmp/keys" >/dev/null
target/release/examples/bench_sink bare 127.0.0.1:19101 >/dev/null & pids+=($!)
RUST_LOG=warn "$fence" server --listen 127.0.0.1:19100 --data-dir "$tmp/leases" --signing-key "$tmp/keys/fence-signing.key" & pids+=($!)
RUST_LOG=warn "$fence" proxy --listen 127.0.0.1:19102 --admin-listen 127.0.0.1:19103 --upstream http://127.0.0.1:19101 --data-dir "$tmp/off" & pids+=($!)
RUST_LOG=warn "$fence" proxy --listen 127.0.0.1:19104 --admin-listen 127.0.0.1:19105 --upstream http://127.0.0.1:19101 --data-dir "$tmp/on" --verify-key "$tmp/keys/fence-verify.pub" & pids+=($!)
sleep 1
token=$("$fence" claim --server http://127.0.0.1:19100 --job bench --ttl 1h | sed 's/.*"token":"\([^"]*\)".*/\1/')
out=$(mktemp)
run() { # name url token
  local r; r=$(wrk -t2 -c"$conns" -d"${dur}s" --latency -s bench/post_token.lua "$2" -- bench "$3")
  echo "$1 $(awk '/Requests\/sec/ {print $2}' <<<"$r") $(awk '$1=="50%" {print $2}' <<<"$r") $(awk '$1=="99%" {print $2}' <<<"$r") $(awk '/non-2xx:/ {print $2}' <<<"$r")" | tee -a "$out"
}
for i in $(seq 1 "$rounds"); do
  run off http://127.0.0.1:19102/ 1
  run on http://127.0.0.1:19104/ "$token"
done
{
  echo
  echo "### fence proxy, signing off vs on (same generation), $(date -u +%F), $(nproc) cores, ${conns} connections, ${dur}s x ${rounds} alternating rounds"
  echo
  echo '```'
  echo "bench/proxy_signing.sh $dur $rounds"
  echo '```'
  echo
  echo "| case | req/s (median) | p50 | p99 | non-2xx |"
  echo "|---|---|---|---|---|"
  for c in off on; do
    awk -v c="$c" '$1==c {rps[++n]=$2; p50[n]=$3; p99[n]=$4; bad+=$5} END { asort(rps); printf "| signing %s | %.0f | %s | %s | %d |\n", c, rps[int((n+1)/2)], p50[1], p99[1], bad }' "$out"
  done
} | tee -a BENCHMARKS.md
