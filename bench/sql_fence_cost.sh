#!/usr/bin/env bash
# What ordering effects across proxies costs the destination (issue 18): the effect's own
# transaction calls the SQL fence (`require`, contract section 11) before it writes, which
# locks the job's fence row until commit, so effects commit in token order whichever proxy
# carried them. pgbench runs three transactions on 1,000 jobs each, alternating, ROUNDS times at
# 1 and 8 clients in one session:
#   plain   BEGIN; INSERT the effect; COMMIT                       (no fence in the database)
#   same    BEGIN; require(job, token it already has); INSERT; COMMIT   (the common case)
#   bump    BEGIN; require(job, a newer token every time); INSERT; COMMIT  (a new holder;
#           each client its own jobs, as each holder its own generation)
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
SQL
effect="INSERT INTO $schema.effects (job, token) VALUES ('job-' || :j, 1);"
printf '%s\n' '\set j random(1, 1000)' 'BEGIN;' "$effect" COMMIT';' > "$tmp/plain.sql"
printf '%s\n' '\set j random(1, 1000)' 'BEGIN;' "SELECT $schema.require('same-' || :j, 1);" \
  "$effect" COMMIT';' > "$tmp/same.sql"
printf '%s\n' '\set j random(1, 1000)' 'BEGIN;' \
  "SELECT $schema.require('bump-' || :client_id || '-' || :j, (extract(epoch FROM clock_timestamp()) * 1000000)::bigint);" \
  "$effect" COMMIT';' > "$tmp/bump.sql"
rows=""
for c in 1 8; do
  for _ in $(seq "$rounds"); do
    for v in plain same bump; do
      tps=$(pgbench -n -c "$c" -j "$(( c < 2 ? c : 2 ))" -T "$secs" -f "$tmp/$v.sql" "$DATABASE_URL" | awk '/^tps/ {print int($3)}')
      echo "$v $c ${tps:-0}" >> "$tmp/runs"; echo "$v c=$c ${tps:-0}" >&2
    done
  done
  m() { awk -v v="$1" -v c="$c" '$1==v && $2==c {print $3}' "$tmp/runs" | median; }
  plain=$(m plain); same=$(m same); bump=$(m bump)
  rows+="| $c | $plain | $same | $(ratio "$same" "$plain") | $bump | $(ratio "$bump" "$plain") |"$'\n'
done
{
  header "The SQL fence in the effect's transaction: what cross-proxy ordering costs" \
    "DATABASE_URL=... bench/sql_fence_cost.sh $secs $rounds"
  echo "Effect transactions per second on 1,000 jobs, as pgbench runs them; medians of $rounds"
  echo "alternating rounds of ${secs} s. *same*: \`require\` with the token the job already has"
  echo "(every write of a holder but its first); *bump*: a newer token every time (the worst"
  echo "case: every write is a new holder's first, so each takes the row's write lock)."
  echo
  echo "| clients | effect alone | with require, same token | ratio | with require, bump | ratio |"
  echo "|---|---|---|---|---|---|"
  printf "%s" "$rows"
  echo
} >> BENCHMARKS.md
