#!/usr/bin/env bash
# Where a bump's extra CPU goes in `fence proxy`: `perf record -e cpu-clock` of the proxy
# under same-generation requests, then under bumps (a new generation per request, jobs spread
# as in bench/limits.sh), at CONNS connections. Prints, for both modes side by side: the CPU
# per request of each thread; how busy the machine's cores were during each run (from
# /proc/stat: what wrk, the upstream and the proxy left idle); and the proxy's workers' CPU per
# request by category (scheduler and wake-ups, malloc, sled, tokio, hyper, ...), from the
# same samples by symbol. The log's thread (fence-log) is not among the categories. KEEP=1
# keeps the recordings (the directory is printed).
#
# Usage: bench/proxy_profile.sh DIR [CONNS=8] [SECONDS=4]   (DIR holding `fence` and `bench_sink`)
set -euo pipefail
cd "$(dirname "$0")/.."; source bench/lib.sh
dir=${1:?usage: bench/proxy_profile.sh DIR [CONNS] [SECONDS]}; c=${2:-8}; secs=${3:-4}
need wrk; need curl; need perf linux-perf; need python3
tmp=$(mktemp -d -p "$PWD/target"); pids=()
cleanup() {
  kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true
  if [ -n "${KEEP:-}" ]; then echo "recordings kept in $tmp"; else rm -rf "$tmp"; fi
}
trap cleanup EXIT
"$dir/bench_sink" bare 127.0.0.1:19962 >/dev/null & pids+=($!)
RUST_LOG=error "$dir/fence" proxy --listen 127.0.0.1:19963 --admin-listen 127.0.0.1:19964 \
  --upstream http://127.0.0.1:19962 --data-dir "$tmp/p" >/dev/null & p=$!; pids+=($p)
wait_http http://127.0.0.1:19963/healthz
# Busy: user, nice, system, irq, softirq, steal (loopback traffic spends real time in
# softirq); idle: idle and iowait.
busy() { awk '/^cpu / { print $2 + $3 + $4 + $7 + $8 + $9, $5 + $6 }' /proc/stat; }
hz=1999
for mode in same spread; do
  wrk -t2 -c"$c" -d1s -s bench/fenced.lua http://127.0.0.1:19963/ -- "$mode" "w$mode" $((4 * c)) >/dev/null
  perf record -q -e cpu-clock -F "$hz" -p "$p" -o "$tmp/$mode.data" -- sleep "$secs" 2>/dev/null & rec=$!
  read -r b0 i0 < <(busy)
  out=$(wrk -t2 -c"$c" -d"${secs}s" -s bench/fenced.lua http://127.0.0.1:19963/ -- "$mode" "p$mode" $((4 * c)))
  read -r b1 i1 < <(busy)
  wait "$rec" || true
  n=$(awk '/requests in/ { print $1 }' <<<"$out")
  echo "$mode $n $(awk '/Requests\/sec/ { printf "%.0f", $2 }' <<<"$out") $(( 100 * (b1 - b0) / (b1 - b0 + i1 - i0) ))" >> "$tmp/runs"
  perf report -i "$tmp/$mode.data" --no-children --sort comm -n -q --stdio -g none 2>/dev/null \
    | awk 'NF >= 3 { n = $2; $1 = ""; $2 = ""; sub(/^ +/, ""); print n "\t" $0 }' > "$tmp/$mode.comm"
  # By thread and symbol, the workers' kept: `--comm` drops about a tenth of the samples
  # `--sort comm` counts (perf 6.x, seen here), so the threads are filtered here instead.
  perf report -i "$tmp/$mode.data" --no-children --sort comm,sym -n -q --stdio -g none 2>/dev/null \
    | awk 'NF >= 4 && $3 ~ /^fence-proxy-/ { n = $2; $1 = ""; $2 = ""; $3 = ""; sub(/^ +/, ""); print n "\t" $0 }' > "$tmp/$mode.sym"
done
python3 - "$tmp" "$hz" <<'PY'
import sys, collections
tmp, hz = sys.argv[1], int(sys.argv[2])
runs = {l.split()[0]: l.split()[1:] for l in open(f"{tmp}/runs")}
def load(path):
    d = collections.Counter()
    for line in open(path):
        n, _, name = line.rstrip("\n").partition("\t")
        if n.isdigit():
            d[name.strip()] += int(n)
    return d
def category(sym):
    if sym.startswith("[k]"):
        if any(w in sym for w in ("task_switch", "schedule", "futex", "spin_unlock", "try_to_wake",
                                  "select_task", "enqueue", "dequeue", "update_curr", "ttwu", "pick_next")):
            return "kernel: scheduler, wake-ups"
        return "kernel: sockets and the rest"
    if any(w in sym for w in ("sled", "crossbeam", "crc32")):
        return "sled"
    if any(w in sym for w in ("malloc", "free", "_int_", "unlink_chunk", "rust_alloc", "rust_dealloc", "realloc")):
        return "malloc and free"
    if any(w in sym for w in ("memmove", "memcmp", "memcpy", "memset")):
        return "memmove, memcmp"
    if "fence_storage" in sym:
        return "fence-storage (log, commit)"
    if "tokio" in sym or "mio" in sym:
        return "tokio"
    if any(w in sym for w in ("hyper", "httparse", "http::")):
        return "hyper, http"
    if "fence" in sym:
        return "fence, fence-sink"
    return "other"
us = lambda samples, mode: samples / hz / int(runs[mode][0]) * 1e6
print(f"| {'mode':6} | requests | req/s | machine busy |")
print("|---|---:|---:|---:|")
for m, (n, rps, b) in runs.items():
    print(f"| {m} | {n} | {rps} | {b}% |")
print("\nCPU µs per request, by thread:\n")
print("| thread | same | bump |\n|---|---:|---:|")
comms = {m: load(f"{tmp}/{m}.comm") for m in runs}
for t in sorted(set(comms["same"]) | set(comms["spread"]), key=lambda t: -comms["spread"][t]):
    a, b = us(comms["same"][t], "same"), us(comms["spread"][t], "spread")
    if a + b >= 0.1:
        print(f"| {t} | {a:.1f} | {b:.1f} |")
print("\nThe proxy's workers (fence-proxy-N, together), CPU µs per request by category:\n")
print("| category | same | bump | bump − same |\n|---|---:|---:|---:|")
cats = {m: collections.Counter() for m in runs}
for m in runs:
    for s, n in load(f"{tmp}/{m}.sym").items():
        cats[m][category(s)] += n
rows = sorted(set(cats["same"]) | set(cats["spread"]),
              key=lambda k: us(cats["same"][k], "same") - us(cats["spread"][k], "spread"))
for k in rows:
    a, b = us(cats["same"][k], "same"), us(cats["spread"][k], "spread")
    print(f"| {k} | {a:.1f} | {b:.1f} | {b - a:+.1f} |")
a, b = us(sum(cats["same"].values()), "same"), us(sum(cats["spread"].values()), "spread")
print(f"| **all** | {a:.1f} | {b:.1f} | {b - a:+.1f} |")
workers = {m: sum(n for t, n in comms[m].items() if t.startswith("fence-proxy-")) for m in runs}
print(f"\nCross-check, the workers' samples: by thread {workers['same']} and {workers['spread']}, "
      f"by symbol {sum(cats['same'].values())} and {sum(cats['spread'].values())} (same, bump).")
PY
