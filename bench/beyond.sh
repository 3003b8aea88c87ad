#!/usr/bin/env bash
# Beyond one holder (issue 35), at `fence server` on sled, in one run, alternating rounds:
# a checkpoint write (64 bytes and 8 KiB) against a renewal of the same leases (both one
# durable write under the holder's guard), a claim with a lock-delay against a plain one, and
# a semaphore claim (a slot of a new 4-slot resource per request) against a plain claim (a new
# job per request): one durable write each, the semaphore's under its resource's lock.
# wrk -t2, 8 and 64 connections (CONNS), ROUNDS rounds of SECONDS each; medians.
# Appends a section to BENCHMARKS.md.
#
# Usage: bench/beyond.sh [SECONDS=5] [ROUNDS=3]   (PROFILE=release, CONNS="8 64")
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib.sh
secs=${1:-5}; rounds=${2:-3}; profile=${PROFILE:-release}; conns=${CONNS:-8 64}
command -v wrk >/dev/null || apt-get install -y -qq wrk >/dev/null
cargo build --profile "$profile" -q -p fence --bin fence
bin=target/$profile
tmp=$(mktemp -d -p "$PWD/target"); pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT
server=127.0.0.1:19311
RUST_LOG=warn $bin/fence server --listen "$server" --data-dir "$tmp/server" \
  --max-checkpoint-bytes 8192 & pids+=($!)
wait_http "http://$server/healthz"
claim_renewable "$server"

cat > "$tmp/delayed.lua" <<'LUA'
-- As lease.lua's claim mode, each claim with a 30 s lock-delay.
local threads = {}
function setup(thread) thread:set("id", #threads); table.insert(threads, thread) end
function init(args) prefix = args[1]; n = 0; wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json" end
function request()
  n = n + 1
  return wrk.format(nil, "/v1/leases/" .. prefix .. "-" .. id .. "-" .. n .. "/claim", nil,
    '{"owner":"o' .. id .. '","lease_key":"benchkey-0123456789abcdef","ttl_ms":30000,"lock_delay_ms":30000}')
end
LUA

cat > "$tmp/slot.lua" <<'LUA'
-- As lease.lua's claim mode, each request a semaphore claim of a new resource of 4 slots.
local threads = {}
function setup(thread) thread:set("id", #threads); table.insert(threads, thread) end
function init(args) prefix = args[1]; n = 0; wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json" end
function request()
  n = n + 1
  return wrk.format(nil, "/v1/semaphores/" .. prefix .. "-" .. id .. "-" .. n .. "/claim", nil,
    '{"owner":"o' .. id .. '","lease_key":"benchkey-0123456789abcdef","ttl_ms":30000,"slots":4}')
end
LUA

out=$tmp/rows
row() { local name=$1 c=$2; shift 2; wrk_row "$name-$c" -t2 -c"$c" -d"${secs}s" "$@" | tee -a "$out"; }
for i in $(seq 1 "$rounds"); do
  for c in $conns; do
    echo "round $i of $rounds, $c connections" >&2
    # Each case follows the others' writes in turn (odd rounds forward, even rounds backward):
    # a case right after a burst of new records pays for sled's work on them.
    cases=(renew ckpt64 ckpt8k claim delayed slot)
    if [ $((i % 2)) = 0 ]; then cases=(slot delayed claim ckpt8k ckpt64 renew); fi
    for k in "${cases[@]}"; do
      case $k in
        renew) row renew "$c" -s bench/lease.lua "http://$server" -- renew r "$c" ;;
        ckpt64) row ckpt64 "$c" -s bench/lease.lua "http://$server" -- checkpoint r "$c" 64 ;;
        ckpt8k) row ckpt8k "$c" -s bench/lease.lua "http://$server" -- checkpoint r "$c" 8192 ;;
        claim) row claim "$c" -s bench/lease.lua "http://$server" -- claim "c$i-$c" "$c" ;;
        delayed) row delayed "$c" -s "$tmp/delayed.lua" "http://$server" -- "d$i-$c" ;;
        slot) row slot "$c" -s "$tmp/slot.lua" "http://$server" -- "s$i-$c" ;;
      esac
    done
  done
done

m() { case_median "$out" "$1" 2; }
{
  header "Beyond one holder: checkpoints against renewals, lock-delay and semaphore claims against plain ones, ${secs}s × ${rounds} alternating rounds" \
    "PROFILE=$profile bench/beyond.sh $secs $rounds"
  echo "Medians, requests per second at \`fence server\` on sled (every answer durable first); errors and non-2xx answers summed."
  echo
  echo "| connections | renewals | checkpoints, 64 B | ratio | checkpoints, 8 KiB | ratio | claims | claims with lock-delay | ratio | semaphore claims | ratio | non-2xx / errors |"
  echo "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
  for c in $conns; do
    bad=0
    for k in renew ckpt64 ckpt8k claim delayed slot; do
      bad=$((bad + $(case_sum "$out" "$k-$c" 5) + $(case_sum "$out" "$k-$c" 6)))
    done
    r=$(m renew-$c) cl=$(m claim-$c)
    echo "| $c | $r | $(m ckpt64-$c) | $(ratio "$(m ckpt64-$c)" "$r") | $(m ckpt8k-$c) | $(ratio "$(m ckpt8k-$c)" "$r") | $cl | $(m delayed-$c) | $(ratio "$(m delayed-$c)" "$cl") | $(m slot-$c) | $(ratio "$(m slot-$c)" "$cl") | $bad |"
  done
  echo
  wrk_rounds "$out"
} | tee -a BENCHMARKS.md
