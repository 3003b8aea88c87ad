#!/usr/bin/env bash
# CPU per request and context switches per request of `fence proxy` (and of its bare
# upstream), for same-generation requests and for bumps (a new generation per request, jobs
# spread as in bench/limits.sh), at 8 and 64 connections: what a bump adds to the proxy's
# work, measured from /proc (utime + stime of each process, voluntary and involuntary
# context switches of the proxy's threads) around each wrk run, and the proxy's `fdatasync`
# calls per request (`perf stat` on the syscall's tracepoint, when perf can read it).
#
# Usage: bench/proxy_cpu.sh DIR [SECONDS=4] [ROUNDS=2]   (DIR holding `fence` and `bench_sink`)
set -euo pipefail
cd "$(dirname "$0")/.."; source bench/lib.sh
dir=${1:?usage: bench/proxy_cpu.sh DIR [SECONDS] [ROUNDS]}; secs=${2:-4}; rounds=${3:-2}
need wrk; need curl
tmp=$(mktemp -d -p "$PWD/target"); pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT
"$dir/bench_sink" bare 127.0.0.1:19952 >/dev/null & b=$!; pids+=($b)
RUST_LOG=warn "$dir/fence" proxy --listen 127.0.0.1:19953 --admin-listen 127.0.0.1:19954 \
  --upstream http://127.0.0.1:19952 --data-dir "$tmp/p" >/dev/null & p=$!; pids+=($p)
wait_http http://127.0.0.1:19953/healthz
tick_us=$((1000000 / $(getconf CLK_TCK)))
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
# A thread that ends between the glob and the read is skipped.
switches() { { cat /proc/"$1"/task/*/status 2>/dev/null || true; } | awk '/ctxt_switches/ { s += $2 } END { print s + 0 }'; }
echo "| case | connections | req/s | proxy CPU µs/req | upstream CPU µs/req | proxy context switches/req | syncs/req |"
echo "|---|---:|---:|---:|---:|---:|---:|"
for r in $(seq 1 "$rounds"); do for mode in same spread; do for c in 8 64; do
  # Counts for SECONDS from its start, a little after wrk's: syncs/req reads slightly low.
  { perf stat -x, -e syscalls:sys_enter_fdatasync -p "$p" -o "$tmp/syncs" -- sleep "$secs" || true; } 2>/dev/null &
  c0=$(cpu $p) u0=$(cpu $b) x0=$(switches $p)
  out=$(wrk -t2 -c"$c" -d"${secs}s" -s bench/fenced.lua http://127.0.0.1:19953/ -- "$mode" "m$r$c$mode" $((4 * c)))
  c1=$(cpu $p) u1=$(cpu $b) x1=$(switches $p)
  wait $! 2>/dev/null || true
  # No perf, no permission for the tracepoint, or "<not counted>": no figure.
  syncs=$(awk -F, '/fdatasync/ && $1 ~ /^[0-9]+$/ { print $1 }' "$tmp/syncs" 2>/dev/null || true)
  syncs=${syncs:-NaN}; rm -f "$tmp/syncs"
  n=$(echo "$out" | awk '/requests in/ { print $1 }'); n=${n:-0}
  [ "$n" -gt 0 ] || { echo "| $mode | $c | wrk completed no request |"; continue; }
  rps=$(echo "$out" | awk '/Requests\/sec/ { printf "%.0f", $2 }')
  awk -v m="$mode" -v c="$c" -v rps="$rps" -v n="$n" -v t="$tick_us" \
    -v pc=$((c1 - c0)) -v uc=$((u1 - u0)) -v xs=$((x1 - x0)) -v sy="$syncs" \
    'BEGIN { printf "| %s | %d | %d | %.1f | %.1f | %.2f | %s |\n", m, c, rps, pc*t/n, uc*t/n, xs/n,
             (sy == "NaN" ? "-" : sprintf("%.3f", sy/n)) }'
done; done; done
