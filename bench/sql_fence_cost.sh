#!/usr/bin/env bash
# What ordering effects across proxies costs the destination (issue 18): the effect's own
# transaction calls the SQL fence (`require`, contract section 11) before it writes, which
# locks the job's fence row until commit, so effects commit in token order whichever proxy
# carried them. pgbench runs four transactions, alternating (the order rotates each round),
# ROUNDS times at 1 and 8 clients in one session, the effects table emptied before each run:
#   plain   BEGIN; SELECT 1; INSERT the effect; COMMIT      (no fence, the same round trips)
#   same    BEGIN; require(job, the token it has); INSERT; COMMIT    1,000 jobs
#   bump    BEGIN; require(job, a newer token); INSERT; COMMIT       1,000 jobs per client
#   hot     as same, on 4 jobs that every client writes: effects of one job queue on its row
# Appends the medians to BENCHMARKS.md.
# Usage: DATABASE_URL=postgres://... bench/sql_fence_cost.sh [SECONDS=5] [ROUNDS=3]
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib.sh
secs=${1:-5}; rounds=${2:-3}
need_database
need curl
schema=fence_bench_sqlfence
cargo build --release -q -p fence --bin fence
tmp=$(mktemp -d); pids=()
cleanup() {
  kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$tmp"
  psql "$DATABASE_URL" -qc "DROP SCHEMA IF EXISTS $schema CASCADE" >/dev/null 2>&1 || true
}
trap cleanup EXIT
psql "$DATABASE_URL" -qc "DROP SCHEMA IF EXISTS $schema CASCADE" >/dev/null
# The proxy's migrations install the fence's table and functions; it is stopped once ready.
admin=127.0.0.1:19461
RUST_LOG=warn target/release/fence proxy --listen 127.0.0.1:19460 --admin-listen "$admin" \
  --upstream http://127.0.0.1:9 --store "$DATABASE_URL" --pg-schema "$schema" & pids+=($!)
wait_http "http://$admin/healthz"
kill "${pids[@]}"; wait 2>/dev/null || true; pids=()
psql "$DATABASE_URL" -q >/dev/null <<SQL
CREATE TABLE $schema.effects (id bigserial PRIMARY KEY, job text NOT NULL, token numeric NOT NULL);
SELECT $schema.observe('same-' || j, 1) FROM generate_series(1, 1000) j;
SELECT $schema.observe('hot-' || j, 1) FROM generate_series(1, 4) j;
SQL
effect="INSERT INTO $schema.effects (job, token) VALUES ('job-' || :j, 1);"
script() { # name fence-statement [jobs]
  printf '%s\n' "\\set j random(1, ${3:-1000})" 'BEGIN;' "$2" "$effect" 'COMMIT;' > "$tmp/$1.sql"
}
script plain "SELECT 1;"
script same "SELECT $schema.require('same-' || :j, 1);"
script bump "SELECT $schema.require('bump-' || :client_id || '-' || :j, (extract(epoch FROM clock_timestamp()) * 1000000)::bigint);"
script hot "SELECT $schema.require('hot-' || :j, 1);" 4
variants=(plain same bump hot)
rows=""
for c in 1 8; do
  for r in $(seq "$rounds"); do
    for i in 0 1 2 3; do
      v=${variants[$(( (i + r) % 4 ))]}
      psql "$DATABASE_URL" -qc "TRUNCATE $schema.effects" >/dev/null
      out=$(pgbench -n -c "$c" -j "$(( c < 2 ? c : 2 ))" -T "$secs" -f "$tmp/$v.sql" "$DATABASE_URL" 2>&1) \
        || { echo "pgbench failed ($v, $c clients):" >&2; echo "$out" >&2; exit 1; }
      tps=$(awk '/^tps/ {print int($3)}' <<<"$out")
      echo "$v $c ${tps:-0}" >> "$tmp/runs"; echo "$v c=$c ${tps:-0}" >&2
    done
  done
  m() { awk -v v="$1" -v c="$c" '$1==v && $2==c {print $3}' "$tmp/runs" | median; }
  plain=$(m plain); same=$(m same); bump=$(m bump); hot=$(m hot)
  rows+="| $c | $plain | $same ($(ratio "$same" "$plain")) | $bump ($(ratio "$bump" "$plain")) | $hot ($(ratio "$hot" "$plain")) |"$'\n'
done
{
  header "The SQL fence in the effect's transaction: what cross-proxy ordering costs" \
    "DATABASE_URL=... bench/sql_fence_cost.sh $secs $rounds"
  echo "Effect transactions per second, as pgbench runs them; medians of $rounds rounds of ${secs} s,"
  echo "the four variants alternating. *plain*: the effect with a \`SELECT 1\` where the others"
  echo "call \`require\` (the same round trips, no fence). *same*: \`require\` with the token the"
  echo "job already has (every write of a holder but its first), 1,000 jobs. *bump*: a newer"
  echo "token every time, each client its own 1,000 jobs. *hot*: as *same* on 4 jobs that every"
  echo "client writes, so one job's effects queue on its fence row. In brackets: × plain."
  echo
  echo "| clients | plain | same token | bump | hot jobs |"
  echo "|---|---|---|---|---|"
  printf "%s" "$rows"
  echo
} >> BENCHMARKS.md
