#!/usr/bin/env bash
# Lease operations per second at 1, 8 and 64 clients: the sled store, PgLeaseStore, and
# pgbench running the equivalent raw renewal UPDATE, in one session. Appends to BENCHMARKS.md.
# Usage: DATABASE_URL=postgres://... bench/lease_stores.sh [SECONDS=5]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-5}
: "${DATABASE_URL:?set DATABASE_URL (../shared/services.sh postgres prints it)}"
cargo build --release --example lease_load -q
bin=target/release/examples/lease_load
psql "$DATABASE_URL" -qc "CREATE TABLE IF NOT EXISTS fence_bench_raw (job text PRIMARY KEY, owner text, generation numeric(20,0), lease_until_ms bigint, completed boolean)" >/dev/null
script=$(mktemp)
cat > "$script" <<'SQL'
UPDATE fence_bench_raw SET lease_until_ms = (floor(extract(epoch from clock_timestamp()) * 1000))::bigint + 30000
 WHERE job = 'raw-' || :client_id AND owner = 'o' AND generation = 1 AND NOT completed;
SQL
rows=""
for c in 1 8 64; do
  psql "$DATABASE_URL" -qc "INSERT INTO fence_bench_raw SELECT 'raw-' || g, 'o', 1, 0, false FROM generate_series(0, $((c - 1))) g ON CONFLICT DO NOTHING" >/dev/null
  sled_claim=$("$bin" sled "$c" claim "$secs")
  sled_renew=$("$bin" sled "$c" renew "$secs")
  pg_claim=$("$bin" "$DATABASE_URL" "$c" claim "$secs")
  pg_renew=$("$bin" "$DATABASE_URL" "$c" renew "$secs")
  raw=$(pgbench -n -c "$c" -j 2 -T "$secs" -f "$script" "$DATABASE_URL" 2>/dev/null | awk '/^tps/ {print int($3)}')
  rows+="| $c | $sled_claim | $sled_renew | $pg_claim | $pg_renew | $raw |"$'\n'
  echo "clients $c: sled claim+release $sled_claim/s renew $sled_renew/s; pg claim+release $pg_claim/s renew $pg_renew/s; pgbench raw renew UPDATE $raw/s"
done
rm -f "$script"
{
  echo
  echo "### Lease stores under load, $(date -u +%F), $(nproc) cores, ${secs}s per cell"
  echo
  echo '```'
  echo "DATABASE_URL=... bench/lease_stores.sh $secs"
  echo '```'
  echo
  echo "| clients | sled claim+release pairs/s | sled renewals/s | PgLeaseStore claim+release pairs/s | PgLeaseStore renewals/s | pgbench raw renew UPDATE/s |"
  echo "|---|---|---|---|---|---|"
  printf "%s" "$rows"
} >> BENCHMARKS.md
