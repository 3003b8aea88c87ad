#!/usr/bin/env bash
# Instructions per same-generation request through `fence proxy`, two prebuilt binaries
# under callgrind: a count that does not move with the host's noise, for the changes that
# wall-clock A/Bs (bench/ab_proxy.sh) cannot settle on 2 noisy cores.
#
# Each side: a bare hyper upstream, the proxy under `valgrind --tool=callgrind
# --separate-threads=yes`, warmed up (one request, then wrk on one connection for 3 s), its
# counters zeroed, then wrk on one connection for SECONDS, then dumped. One connection keeps
# the proxy's work for the client and the upstream on one runtime worker thread, so that
# thread's count over the requests wrk completed is the proxy's instructions per request (the
# other threads, the checkpoint and the clock, stay below 0.5% of it). `--fair-sched=yes`:
# with valgrind's default scheduling a spinning thread can starve the others, and a fresh
# proxy then answered no request with a body for minutes (both sides alike). A side whose run
# completed no request is reported as stalled.
#
# Usage: bench/ab_callgrind.sh DIR_A DIR_B [SECONDS=10] [ROUNDS=2]   (each DIR holding `fence`;
#        DIR_A also `bench_sink`)
set -euo pipefail
cd "$(dirname "$0")/.."; source bench/lib.sh
A=${1:?usage: bench/ab_callgrind.sh DIR_A DIR_B}; B=${2:?usage: bench/ab_callgrind.sh DIR_A DIR_B}
secs=${3:-10}; rounds=${4:-2}
need wrk; need curl; need valgrind; need callgrind_control valgrind
tmp=$(mktemp -d -p "$PWD/target"); pids=()
cleanup() { kill -9 "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT
bare=127.0.0.1:19902 proxy=127.0.0.1:19910
"$A/bench_sink" bare "$bare" >/dev/null & pids+=($!)
wait_http "http://$bare/"

# count NAME DIR: one side's run; prints "NAME requests instructions-per-request".
count() {
  local name=$1 dir=$2 out=$tmp/$1 pid n busiest
  mkdir -p "$out"
  RUST_LOG=warn valgrind --tool=callgrind --separate-threads=yes --fair-sched=yes \
    --callgrind-out-file="$out/cg" "$dir/fence" proxy --listen "$proxy" \
    --admin-listen 127.0.0.1:19911 --upstream "http://$bare" --data-dir "$out/data" \
    2>"$out/valgrind.log" &
  pid=$!
  # Until a fenced request is answered (valgrind starts slowly; a refused connection fails
  # at once), at most about a minute.
  for _ in $(seq 1 60); do
    [ "$(curl -s -m 10 -o /dev/null -w '%{http_code}' -XPOST -H 'x-fencing-job: warm' \
      -H 'x-fencing-token: 1' "http://$proxy/")" = 200 ] && break
    sleep 1
  done
  wrk -t1 -c1 -d3s -s bench/fenced.lua "http://$proxy/" -- same >/dev/null
  callgrind_control -z "$pid" >/dev/null
  wrk -t1 -c1 -d"${secs}s" -s bench/fenced.lua "http://$proxy/" -- same >"$out/wrk"
  callgrind_control -d "$pid" >/dev/null
  kill -9 "$pid"; wait "$pid" 2>/dev/null || true
  n=$(awk '/requests in/ {print $1}' "$out/wrk")
  busiest=$(cat "$out"/cg.1-* | awk '/^totals:/ && $2 > m {m = $2} END {print m + 0}')
  if [ "${n:-0}" -gt 0 ]; then echo "$name $n $((busiest / n))"; else echo "$name 0 stalled"; fi
}

rows=$tmp/rows
for i in $(seq 1 "$rounds"); do
  sides=("A $A" "B $B"); [ $((i % 2)) -eq 1 ] || sides=("B $B" "A $A")
  for side in "${sides[@]}"; do
    read -r name dir <<<"$side"
    count "$name" "$dir" | tee -a "$rows"
  done
done
a=$(awk '$1=="A" && $3 != "stalled" {print $3}' "$rows" | median)
b=$(awk '$1=="B" && $3 != "stalled" {print $3}' "$rows" | median)
header "fence proxy A/B under callgrind: $(basename "$A") against $(basename "$B"), ${secs}s × ${rounds} rounds" \
  "bench/ab_callgrind.sh $A $B $secs $rounds"
echo "Instructions per same-generation request (the busiest thread's count over wrk's completed"
echo "requests, one connection), medians of the rounds that completed requests."
echo
echo "| A | B | B/A |"
echo "|---:|---:|---:|"
echo "| $a | $b | $(ratio "$b" "$a") |"
echo
echo '```'
cat "$rows"
echo '```'
