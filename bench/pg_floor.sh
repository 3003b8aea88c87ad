#!/usr/bin/env bash
# What the forgetting floor costs a PostgreSQL claim (issue 16): pgbench runs the lease
# server's claim statement as it was (a new row starts at 1) and as it is (a new row starts
# at the floor + 1, read under FOR SHARE), alternating, ROUNDS times at 1, 8 and 64 clients,
# in one session. Appends the medians to BENCHMARKS.md.
# Usage: DATABASE_URL=postgres://... bench/pg_floor.sh [SECONDS=5] [ROUNDS=3]
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib.sh
secs=${1:-5}; rounds=${2:-3}
need_database
tmp=$(mktemp -d); trap 'rm -rf "$tmp"; psql "$DATABASE_URL" -qc "DROP TABLE IF EXISTS fence_bench_floor" >/dev/null 2>&1 || true' EXIT
psql "$DATABASE_URL" -q >/dev/null <<'SQL'
DROP TABLE IF EXISTS fence_bench_floor;
CREATE TABLE fence_bench_floor (job text COLLATE "C" PRIMARY KEY, owner text,
  generation numeric(20,0) NOT NULL, lease_until_ms bigint NOT NULL,
  completed boolean NOT NULL DEFAULT false, key_hash bytea NOT NULL DEFAULT ''::bytea,
  changed_ms bigint NOT NULL DEFAULT 0);
INSERT INTO fence_bench_floor VALUES ('', NULL, 0, 0, true, '', 0);
SQL
for variant in plain floor; do
  if [ "$variant" = plain ]; then gen="1"
  else gen="(SELECT f.generation + 1 FROM fence_bench_floor f WHERE f.job = '' FOR SHARE)"; fi
  cat > "$tmp/$variant.sql" <<SQL
\set j random(1, 100000)
INSERT INTO fence_bench_floor AS t (job, owner, generation, lease_until_ms, changed_ms, key_hash, completed)
 VALUES ('j' || :j, 'o' || :client_id, $gen, 0, 0, '\x00', false)
 ON CONFLICT (job) DO UPDATE SET generation = t.generation + 1, owner = excluded.owner,
   lease_until_ms = excluded.lease_until_ms, changed_ms = excluded.changed_ms
 WHERE NOT t.completed AND (t.owner IS NULL OR t.lease_until_ms <= excluded.changed_ms)
 RETURNING t.generation::text;
SQL
done
rows=""
for c in 1 8 64; do
  for r in $(seq "$rounds"); do
    for v in plain floor; do
      tps=$(pgbench -n -c "$c" -j 2 -T "$secs" -f "$tmp/$v.sql" "$DATABASE_URL" 2>/dev/null | awk '/^tps/ {print int($3)}')
      echo "$v $c $tps" >> "$tmp/runs"; echo "$v c=$c $tps" >&2
    done
  done
  plain=$(awk -v c="$c" '$1=="plain" && $2==c {print $3}' "$tmp/runs" | median)
  floor=$(awk -v c="$c" '$1=="floor" && $2==c {print $3}' "$tmp/runs" | median)
  rows+="| $c | $plain | $floor | $(awk -v a="$floor" -v b="$plain" 'BEGIN {printf "%.2f", a/b}') |"$'\n'
done
{
  header "PostgreSQL claim: the cost of the forgetting floor" "DATABASE_URL=... bench/pg_floor.sh $secs $rounds"
  echo "Claims per second of the lease server's claim statement on 100,000 jobs, as pgbench runs it;"
  echo "medians of $rounds alternating rounds of ${secs} s. *floor*: a new row starts at the floor + 1,"
  echo "read under FOR SHARE, so that forgetting on any server can never let a claim start below it."
  echo
  echo "| clients | before (starts at 1) | with the floor | ratio |"
  echo "|---|---|---|---|"
  printf "%s" "$rows"
  echo
} >> BENCHMARKS.md
