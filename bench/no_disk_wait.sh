#!/usr/bin/env bash
# What the durable rows of bench/limits.sh reach when the disk costs nothing (issue 32): the
# lease server's claims and FenceLayer's bumps, as built, against the same with
# `DurableDb::commit` answering at once (no wait for the write-ahead log's fdatasync), at
# CONNS connections, alternating rounds. The second build is made from a copy of HEAD in
# target/no-disk-wait with that one line changed, only for this measurement: it is not
# durable, and nothing of it is committed or installed. What is left between the
# no-wait figures and their bounds (the status answer; the disk's limit or the bare service)
# is CPU spent on the request path and the store's index, not on the disk. The bounds are
# bench/limits.sh's: the status answer for claims, the disk's limit or the bare service
# (the smaller) for bumps.
#
# Usage: bench/no_disk_wait.sh [SECONDS=4] [ROUNDS=3]   (CONNS=64)
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib.sh
secs=${1:-4}; rounds=${2:-3}; c=${CONNS:-64}
need wrk; need curl
# Both builds from HEAD: the working tree must be HEAD, or A would differ by more than the line.
git diff --quiet HEAD -- crates Cargo.toml Cargo.lock ||
  { echo "bench/no_disk_wait.sh: commit or stash the changes to crates/ first" >&2; exit 1; }
cargo build --release -q -p fence --bin fence
cargo build --release -q --example bench_sink --example disk_probe
src=target/no-disk-wait
rm -rf "$src"; mkdir -p "$src"
git archive HEAD | tar -x -C "$src"
disk=$src/crates/fence-storage/src/disk.rs
grep -q '        self.log().commit().await$' "$disk"
sed -i 's|^        self.log().commit().await$|        Ok(()) // no-disk-wait: not durable|' "$disk"
# (RUSTFLAGS: the log's commit is unused there.)
(cd "$src" && export CARGO_TARGET_DIR="$PWD/../no-disk-wait-build" RUSTFLAGS="-A dead_code" &&
  cargo build --release -q -p fence --bin fence && cargo build --release -q --example bench_sink)
A=target/release B=target/no-disk-wait-build/release
tmp=$(mktemp -d -p "$PWD/target"); pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT
RUST_LOG=warn $A/fence server --listen 127.0.0.1:19941 --data-dir "$tmp/a" & pids+=($!)
RUST_LOG=warn $B/fence server --listen 127.0.0.1:19942 --data-dir "$tmp/b" & pids+=($!)
$A/examples/bench_sink bare 127.0.0.1:19943 >/dev/null & pids+=($!)
$A/examples/bench_sink fenced 127.0.0.1:19944 "$tmp/c" >/dev/null & pids+=($!)
$B/examples/bench_sink fenced 127.0.0.1:19945 "$tmp/d" >/dev/null & pids+=($!)
for s in 127.0.0.1:19941 127.0.0.1:19942; do wait_http "http://$s/healthz"; claim_renewable "$s"; done
for s in 127.0.0.1:19943 127.0.0.1:19944 127.0.0.1:19945; do wait_http "http://$s/healthz"; done
out=$tmp/rows
row() { wrk_row "$1-$c" -t2 -c"$c" -d"${secs}s" "${@:2}" | tee -a "$out"; }
for i in $(seq 1 "$rounds"); do
  $A/examples/disk_probe "$tmp" "$secs" "$c" | awk -v c="$c" '{print "disk-" c, $3, 0, 0, 0, 0}' | tee -a "$out"
  row status http://127.0.0.1:19941/v1/leases/r-0
  row claim -s bench/lease.lua http://127.0.0.1:19941 -- claim "a$i" "$c"
  row claim-nowait -s bench/lease.lua http://127.0.0.1:19942 -- claim "b$i" "$c"
  row bare -s bench/fenced.lua http://127.0.0.1:19943/ -- same
  row lbump -s bench/fenced.lua http://127.0.0.1:19944/ -- spread "c$i" $((4 * c))
  row lbump-nowait -s bench/fenced.lua http://127.0.0.1:19945/ -- spread "d$i" $((4 * c))
done
m() { case_median "$out" "$1-$c" 2; }
bad() { echo $(( $(case_sum "$out" "$1-$c" 5) + $(case_sum "$out" "$1-$c" 6) )); }
d=$(m disk) b=$(m bare); lb=$(( d < b ? d : b ))   # the layer's bound, as in bench/limits.sh
{
  header "The durable rows when the disk costs nothing: $c connections, ${secs}s × ${rounds} alternating rounds" \
    "bench/no_disk_wait.sh $secs $rounds   # CONNS=$c"
  echo "Medians, requests per second. \"no wait\": the same build with \`DurableDb::commit\` answering at once."
  echo
  echo "| what | as built | no wait | bound | as built / bound | no wait / bound | non-2xx / errors, as built / no wait |"
  echo "|---|---:|---:|---:|---:|---:|---|"
  echo "| claims at fence server (bound: status answer) | $(m claim) | $(m claim-nowait) | $(m status) | $(ratio "$(m claim)" "$(m status)") | $(ratio "$(m claim-nowait)" "$(m status)") | $(bad claim) / $(bad claim-nowait) |"
  echo "| bumps through FenceLayer (bound: disk or bare service, the smaller) | $(m lbump) | $(m lbump-nowait) | $lb | $(ratio "$(m lbump)" "$lb") | $(ratio "$(m lbump-nowait)" "$lb") | $(bad lbump) / $(bad lbump-nowait) |"
  echo
  wrk_rounds "$out"
} | tee -a BENCHMARKS.md
