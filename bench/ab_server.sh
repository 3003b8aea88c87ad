#!/usr/bin/env bash
# `fence server` on sled of two prebuilt binaries, side by side in alternating rounds: claims
# of new jobs and renewals of 64 held leases (bench/lease.lua), at 8 and 64 connections. An
# A/B that needs no rebuild, for changes below the server's code (the allocator, a profile).
#
# Usage: bench/ab_server.sh DIR_A DIR_B [SECONDS=4] [ROUNDS=3]   (each DIR holding `fence`)
set -euo pipefail
cd "$(dirname "$0")/.."; source bench/lib.sh
A=${1:?usage: bench/ab_server.sh DIR_A DIR_B}; B=${2:?usage: bench/ab_server.sh DIR_A DIR_B}
secs=${3:-4}; rounds=${4:-3}
need wrk; need curl
tmp=$(mktemp -d -p "$PWD/target"); pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT
a=127.0.0.1:19931 b=127.0.0.1:19932
RUST_LOG=warn "$A/fence" server --listen "$a" --data-dir "$tmp/a" & pids+=($!)
RUST_LOG=warn "$B/fence" server --listen "$b" --data-dir "$tmp/b" & pids+=($!)
for s in "$a" "$b"; do wait_http "http://$s/healthz"; claim_renewable "$s"; done
out=$tmp/rows
for i in $(seq 1 "$rounds"); do for c in 8 64; do
  # A first in odd rounds, B first in even ones: neither always follows the other's writes.
  sides=(A B); [ $((i % 2)) = 0 ] && sides=(B A)
  for side in "${sides[@]}"; do
    s=$a; [ "$side" = B ] && s=$b
    wrk_row "$side-claim-$c" -t2 -c"$c" -d"${secs}s" -s bench/lease.lua "http://$s" -- claim "c$i-$c" "$c" | tee -a "$out"
    wrk_row "$side-renew-$c" -t2 -c"$c" -d"${secs}s" -s bench/lease.lua "http://$s" -- renew r "$c" | tee -a "$out"
  done
done; done
{
  header "fence server A/B: $(basename "$A") against $(basename "$B"), ${secs}s × ${rounds} alternating rounds" \
    "bench/ab_server.sh $A $B $secs $rounds"
  echo "Medians, requests per second at \`fence server\` on sled (every answer durable first)."
  echo
  echo "| connections | claims A | claims B | B/A | renewals A | renewals B | B/A | p99 µs claims A / B |"
  echo "|---:|---:|---:|---:|---:|---:|---:|---|"
  for c in 8 64; do
    ca=$(case_median "$out" "A-claim-$c" 2) cb=$(case_median "$out" "B-claim-$c" 2)
    ra=$(case_median "$out" "A-renew-$c" 2) rb=$(case_median "$out" "B-renew-$c" 2)
    echo "| $c | $ca | $cb | $(ratio "$cb" "$ca") | $ra | $rb | $(ratio "$rb" "$ra") |" \
      "$(case_median "$out" "A-claim-$c" 4) / $(case_median "$out" "B-claim-$c" 4) |"
  done
  echo
  echo '```'
  cat "$out"
  echo '```'
}
