#!/usr/bin/env bash
# Scale-out on one PostgreSQL (issue 18): lease claims and renewals through 1 and 2
# `fence server`s, and generation bumps through 1 and 2 `fence proxy`s, all sharing one
# database, in alternating rounds; for each case the operations per second and the CPU the
# fence processes and PostgreSQL spent per thousand operations (utime+stime from /proc, all
# of the postgres user's processes for the database). Appends a section to BENCHMARKS.md
# with the capacity model these figures give.
#
# Usage: DATABASE_URL=postgres://... bench/scale_out.sh [SECONDS=5] [ROUNDS=2]   (CONNS=16)
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib.sh
secs=${1:-5}; rounds=${2:-2}; conns=${CONNS:-16}
: "${DATABASE_URL:?set DATABASE_URL (eval \"\$(../shared/services.sh postgres)\" sets it)}"
need wrk; need psql postgresql-client
cargo build --release -q -p fence --bin fence
cargo build --release -q --example bench_sink -p fence-suite
bin=target/release
tmp=$(mktemp -d); pids=()
schema=scale_$$
cleanup() {
  kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$tmp"
  psql "$DATABASE_URL" -qc "DROP SCHEMA IF EXISTS $schema CASCADE" >/dev/null 2>&1 || true
}
trap cleanup EXIT
s1=127.0.0.1:19401 s2=127.0.0.1:19402 p1=127.0.0.1:19411 p2=127.0.0.1:19412 up=127.0.0.1:19420
$bin/examples/bench_sink bare "$up" >/dev/null & pids+=($!)
store=(--store "$DATABASE_URL" --pg-schema "$schema")
RUST_LOG=warn $bin/fence server --listen "$s1" "${store[@]}" & pid_s1=$!; pids+=($pid_s1)
wait_http "http://$s1/healthz"
RUST_LOG=warn $bin/fence server --listen "$s2" "${store[@]}" & pid_s2=$!; pids+=($pid_s2)
RUST_LOG=warn $bin/fence proxy --listen "$p1" --admin-listen 127.0.0.1:19413 --upstream "http://$up" --workers 1 "${store[@]}" & pid_p1=$!; pids+=($pid_p1)
RUST_LOG=warn $bin/fence proxy --listen "$p2" --admin-listen 127.0.0.1:19414 --upstream "http://$up" --workers 1 "${store[@]}" & pid_p2=$!; pids+=($pid_p2)
for a in "$s2/healthz" "$p1/" "$p2/" "$up/"; do wait_http "http://$a"; done
claim_renewable "http://$s1"

hz=$(getconf CLK_TCK)
ticks() { local t=0 p; for p in "$@"; do t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0))); done; echo "$t"; }
pg_pids() { pgrep -u postgres postgres | tr '\n' ' '; }
rps() { awk '/Requests\/sec/ {printf "%.0f", $2}' "$1"; }

out=$tmp/rows
# case NAME FENCE_PIDS -- TARGET... : every target gets its own wrk (CONNS / targets
# connections), all at once; prints NAME ops/s fence-ms/kop pg-ms/kop.
case_run() {
  local name=$1 fpids=$2; shift 2
  local n=$# c i=0 f0 g0 f1 g1 total=0 pg w=()
  c=$((conns / n)); pg=$(pg_pids)
  f0=$(ticks $fpids); g0=$(ticks $pg)
  for target in "$@"; do
    i=$((i + 1))
    # shellcheck disable=SC2086
    wrk -t"$c" -c"$c" -d"${secs}s" $target >"$tmp/wrk.$i" 2>&1 & w+=($!)
  done
  wait "${w[@]}"
  # Backends the pools opened during the run count from zero: read the list again.
  f1=$(ticks $fpids); g1=$(ticks $(pg_pids))
  for i in $(seq 1 "$n"); do total=$((total + $(rps "$tmp/wrk.$i"))); done
  awk -v name="$name" -v ops="$total" -v s="$secs" -v hz="$hz" -v f="$((f1 - f0))" -v g="$((g1 - g0))" \
    'BEGIN { k = ops * s / 1000; if (k == 0) k = 1; printf "%s %d %.1f %.1f\n", name, ops, f * 1000 / hz / k, g * 1000 / hz / k }' | tee -a "$out"
}
renew() { echo "-s bench/lease.lua http://$1/ -- renew r 64"; }
claim() { echo "-s bench/lease.lua http://$1/ -- claim $2"; }
bump() { echo "-s bench/fenced.lua http://$1/ -- bump $2"; }
for r in $(seq 1 "$rounds"); do
  case_run renew-1-server "$pid_s1" "$(renew $s1)"
  case_run renew-2-servers "$pid_s1 $pid_s2" "$(renew $s1)" "$(renew $s2)"
  case_run claim-1-server "$pid_s1" "$(claim $s1 c$r-a)"
  case_run claim-2-servers "$pid_s1 $pid_s2" "$(claim $s1 c$r-b)" "$(claim $s2 c$r-c)"
  case_run bump-1-proxy "$pid_p1" "$(bump $p1 b$r-a)"
  case_run bump-2-proxies "$pid_p1 $pid_p2" "$(bump $p1 b$r-b)" "$(bump $p2 b$r-c)"
done
{
  header "Scale-out on one PostgreSQL: 1 and 2 servers, 1 and 2 proxies, $conns connections, ${secs}s x $rounds alternating rounds" "bench/scale_out.sh $secs $rounds   # CONNS=$conns"
  echo "| case | ops/s (median) | fence CPU ms per 1000 ops | PostgreSQL CPU ms per 1000 ops |"
  echo "|---|---:|---:|---:|"
  for c in renew-1-server renew-2-servers claim-1-server claim-2-servers bump-1-proxy bump-2-proxies; do
    echo "| $c | $(case_median "$out" $c 2) | $(case_median "$out" $c 3) | $(case_median "$out" $c 4) |"
  done
  echo
  echo "Rounds (case, ops/s, fence ms/kop, PostgreSQL ms/kop):"
  echo
  echo '```'
  cat "$out"
  echo '```'
} >> BENCHMARKS.md
