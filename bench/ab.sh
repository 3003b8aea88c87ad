#!/usr/bin/env bash
# A against B: the sink layer and `fence proxy` of two commits (A, and B: HEAD unless named),
# side by side in alternating rounds on one machine, so a change's cost is a ratio measured
# in one run. Cases, each for A and for B: the layer with the same
# generation ("same"), a durable bump per request ("bump"), a new Idempotency-Key per
# request ("idem"), and `fence proxy` with the same generation ("proxy"), all in front of
# one bare hyper service. Each side is built from a clean checkout in a worktree under
# target/ab, with a target dir of its own, so edits in the working tree do not leak in.
# Appends a section to BENCHMARKS.md.
#
# Usage: bench/ab.sh REV_A [DURATION_SECONDS=5] [ROUNDS=3]   (B=REV_B, default HEAD;
#        CONNS=8; PROFILE=release)
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib.sh
rev=${1:?usage: bench/ab.sh REV [DURATION_SECONDS] [ROUNDS]}
dur=${2:-5}; rounds=${3:-3}; conns=${CONNS:-8}; profile=${PROFILE:-release}
need wrk; need curl
a_rev=$(git rev-parse --short "$rev")
b_rev=$(git rev-parse --short "${B:-HEAD}")
root=$PWD
build() { # side rev: builds bench_sink and fence at rev in target/ab/tree-side
  local tree=$root/target/ab/tree-$1
  if [ ! -d "$tree" ]; then git worktree add -q --detach "$tree" "$2"; fi
  git -C "$tree" checkout -q --detach "$2"
  (cd "$tree" && CARGO_TARGET_DIR=$root/target/ab/target-$1 cargo build --profile "$profile" -q \
    --example bench_sink -p fence-suite && CARGO_TARGET_DIR=$root/target/ab/target-$1 \
    cargo build --profile "$profile" -q -p fence --bin fence)
}
build a "$a_rev"
build b "$b_rev"
a_bin=$root/target/ab/target-a/$profile b_bin=$root/target/ab/target-b/$profile
tmp=$(mktemp -d); pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT
bare=127.0.0.1:19101
$b_bin/examples/bench_sink bare "$bare" >/dev/null & pids+=($!)
start() { # side bin layer_port proxy_port admin_port
  "$2/examples/bench_sink" fenced "127.0.0.1:$3" "$tmp/$1-layer" >/dev/null & pids+=($!)
  RUST_LOG=warn "$2/fence" proxy --listen "127.0.0.1:$4" --admin-listen "127.0.0.1:$5" \
    --upstream "http://$bare" --data-dir "$tmp/$1-proxy" & pids+=($!)
}
start A "$a_bin" 19102 19103 19104
start B "$b_bin" 19112 19113 19114
for p in 19101 19102 19103 19112 19113; do wait_http "http://127.0.0.1:$p/"; done

out=$tmp/rows
run() { # case port mode
  wrk_row "$1" -t"$conns" -c"$conns" -d"${dur}s" -s bench/fenced.lua "http://127.0.0.1:$2/" -- "$3" \
    | tee -a "$out"
}
for i in $(seq 1 "$rounds"); do
  echo "round $i of $rounds ($conns connections)" >&2
  for side in A B; do
    off=0; [ "$side" = B ] && off=10
    run "$side-same" $((19102 + off)) same
    run "$side-bump" $((19102 + off)) bump
    run "$side-idem" $((19102 + off)) idem
    run "$side-proxy" $((19103 + off)) same
  done
done

{
  header "A/B: $a_rev (A) against $b_rev (B), $conns connections, ${dur}s x $rounds alternating rounds" \
    "bench/ab.sh $rev $dur $rounds   # CONNS=$conns PROFILE=$profile"
  echo "| case | A req/s | B req/s | B/A | A p99 µs | B p99 µs |"
  echo "|---|---|---|---|---|---|"
  for c in same bump idem proxy; do
    ar=$(case_median "$out" "A-$c" 2); br=$(case_median "$out" "B-$c" 2)
    ap=$(case_median "$out" "A-$c" 4); bp=$(case_median "$out" "B-$c" 4)
    echo "| $c | $ar | $br | $(ratio "$br" "$ar") | $ap | $bp |"
  done
  echo
  echo "Medians over the rounds; non-2xx answers and socket errors: $(case_sum "$out" A-same 5)/$(case_sum "$out" B-same 5) and $(case_sum "$out" A-same 6)/$(case_sum "$out" B-same 6) (same, A/B)."
} | tee -a BENCHMARKS.md
