#!/usr/bin/env bash
# Bounded state (issue 16): JOBS distinct jobs through `fence proxy` (a signed token each, so
# one durable bump per job) and through `fence server` (a claim and a release each), each
# twice: without forgetting, and with --forget-after FORGET so that about rate x FORGET
# jobs are live. Every REPORT jobs: jobs written, rate, resident memory and data directory
# size of the target. Appends a section to BENCHMARKS.md.
#
# MODE=arenas instead compares two runs that both forget, under glibc malloc's default arenas
# and under MALLOC_ARENA_MAX=2: does what is left of a rise in RSS belong to the allocator?
#
# KINDS=server (or proxy) runs one of the two; KEEP_JOBS=N stops the runs without forgetting
# at N jobs (they grow linearly, and a 10-million-job kept run takes as long as the rest).
#
# Usage: bench/forget_scale.sh [JOBS=10000000] [REPORT=1000000] [FORGET=10s]
#        (CONNS=8, MODE=keep, KINDS="proxy server", KEEP_JOBS=JOBS)
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib.sh
jobs=${1:-10000000}; report=${2:-1000000}; forget=${3:-10s}; conns=${CONNS:-8}; mode=${MODE:-keep}
kinds=${KINDS:-proxy server}; keep_jobs=${KEEP_JOBS:-$jobs}
need curl
case "$mode" in keep|arenas) ;; *) echo "MODE is keep or arenas, not $mode" >&2; exit 2 ;; esac
cargo build --release -q -p fence --bin fence
cargo build --release -q --example forget_load --example bench_sink -p fence-suite
bin=target/release
tmp=$(mktemp -d); pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT
$bin/fence keygen --out "$tmp/keys" >/dev/null
bare=127.0.0.1:19401 proxy=127.0.0.1:19402 admin=127.0.0.1:19403 server=127.0.0.1:19404
$bin/examples/bench_sink bare "$bare" >/dev/null & pids+=($!)
wait_http "http://$bare/"

out=$tmp/rows
run() { # name target addr key ttl_ms pid dir
  echo "== $1" >&2
  local n=$jobs
  case "$1" in *-keep) n=$keep_jobs ;; esac
  $bin/examples/forget_load "$2" "$3" "$4" "$n" "$conns" "$5" "$report" "$6" "$7" \
    | while read -r line; do echo "$1 $line" | tee -a "$out" >&2; done
}
proxy_run() { # name environment (one VAR=value, or "-": none) extra-flags...
  local name=$1 envs=$2; shift 2
  env ${envs#-} RUST_LOG=warn $bin/fence proxy --listen "$proxy" --admin-listen "$admin" --upstream "http://$bare" \
    --data-dir "$tmp/$name" --verify-key "$tmp/keys/fence-verify.pem" --no-idempotency "$@" &
  local pid=$!
  wait_http "http://$admin/healthz"
  run "$name" proxy "$proxy" "$tmp/keys/fence-signing.pem" 2000 "$pid" "$tmp/$name"
  kill "$pid"; wait "$pid" 2>/dev/null || true
}
server_run() { # name environment (one VAR=value, or "-": none) extra-flags...
  local name=$1 envs=$2; shift 2
  env ${envs#-} RUST_LOG=warn $bin/fence server --listen "$server" --data-dir "$tmp/$name" "$@" &
  local pid=$!
  wait_http "http://$server/healthz"
  run "$name" server "http://$server" - 1000 "$pid" "$tmp/$name"
  kill "$pid"; wait "$pid" 2>/dev/null || true
}
# On sled a proxy forgets no sooner than its upstream (or body) timeout plus its hold (with
# idempotency, which this run turns off, also the store timeout and the body timeout again): 2
# minutes with the defaults. Short ones (2 s in all) keep the window at --forget-after.
proxy_forget=(--forget-after "$forget" --max-lease-ttl 2s --clock-skew 1s
  --upstream-timeout 1s --body-timeout 1s --unknown-outcome-hold 1s)
if [ "$mode" = arenas ]; then
  title="Bounded state, RSS and malloc arenas: $jobs distinct jobs, forgetting after $forget"
  a=default b=arena2 a_label="default arenas" b_label="MALLOC_ARENA_MAX=2"
  proxy_run proxy-default - "${proxy_forget[@]}"
  proxy_run proxy-arena2 MALLOC_ARENA_MAX=2 "${proxy_forget[@]}"
  server_run server-default - --forget-after "$forget"
  server_run server-arena2 MALLOC_ARENA_MAX=2 --forget-after "$forget"
else
  title="Bounded state: $jobs distinct jobs, ${conns} connections, forget-after $forget"
  a=keep b=forget a_label=kept b_label=forgetting
  case " $kinds " in *" proxy "*)
    proxy_run proxy-keep -
    proxy_run proxy-forget - "${proxy_forget[@]}" ;;
  esac
  case " $kinds " in *" server "*)
    server_run server-keep -
    server_run server-forget - --forget-after "$forget" ;;
  esac
fi

{
  header "$title" "CONNS=$conns MODE=$mode KINDS=\"$kinds\" KEEP_JOBS=$keep_jobs bench/forget_scale.sh $jobs $report $forget"
  echo "Each proxy job is one write with a signed token (a durable bump; idempotency off);"
  echo "each server job a claim and a release. Sizes at each report: resident memory (RSS)"
  echo "and data directory, in MiB; the rate is jobs per second since the previous report."
  echo
  for kind in $kinds; do
    echo "| jobs written | $kind: rate, $a_label | RSS MiB | disk MiB | $kind: rate, $b_label | RSS MiB | disk MiB |"
    echo "|---|---|---|---|---|---|---|"
    join -j 1 -a 2 -e - -o 0,1.2,1.3,1.4,2.2,2.3,2.4 \
      <(awk -v n="$kind-$a" -v r="$report" '$1==n {printf "%d %s %s %s\n", int($2/r+0.5)*r, $4, $5, $6}' "$out" | sort -k1,1) \
      <(awk -v n="$kind-$b" -v r="$report" '$1==n {printf "%d %s %s %s\n", int($2/r+0.5)*r, $4, $5, $6}' "$out" | sort -k1,1) \
      | sort -n -k1,1 | awk '{printf "| %s | %s | %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5, $6, $7}'
    echo
  done
} | tee -a BENCHMARKS.md
