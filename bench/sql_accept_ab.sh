#!/usr/bin/env bash
# A/B of the SQL fence's accept function: today's (writes the row on every accepted check) against
# the one before fa5e82b (a check at the job's highest with a fresh stamp only locked the row),
# swapped in place between runs; pgbench's "same" workload of bench/sql_fence_cost.sh (the
# check that changed: a token at the job's highest). Prints one line per run.
# Usage: DATABASE_URL=postgres://... bench/sql_accept_ab.sh [SECONDS=5] [ROUNDS=3]
set -euo pipefail
DB=${DATABASE_URL:?}; schema=fence_ab_accept; secs=${1:-5}; rounds=${2:-3}
cd "$(dirname "$0")/.."
FENCE=$(realpath -m "${FENCE_BIN:-target/debug/fence}")
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT; cd "$tmp"
psql "$DB" -qc "DROP SCHEMA IF EXISTS $schema CASCADE" >/dev/null
RUST_LOG=warn $FENCE proxy --listen 127.0.0.1:19560 --admin-listen 127.0.0.1:19561 \
  --upstream http://127.0.0.1:9 --store "$DB" --pg-schema "$schema" --data-dir "$tmp/d" & pid=$!
for i in $(seq 100); do curl -fs http://127.0.0.1:19561/healthz >/dev/null && break; sleep 0.2; done
kill $pid; wait 2>/dev/null || true
psql "$DB" -qAt -c "SELECT pg_get_functiondef('$schema.sink_accept(text,numeric)'::regprocedure)" > new.sql
python3 - <<'PY'
s=open('new.sql').read()
i=s.index('ON CONFLICT (job) DO UPDATE'); j=s.index('IF FOUND THEN')
old_tail="""ON CONFLICT (job) DO UPDATE SET highest = excluded.highest, touched_ms = excluded.touched_ms,
               raised_ms = CASE WHEN g.highest < excluded.highest THEN excluded.raised_ms ELSE g.raised_ms END
             WHERE g.highest < excluded.highest
                OR (g.highest = excluded.highest AND g.touched_ms < excluded.touched_ms - 5000);
           """
open('old.sql','w').write(s[:i]+old_tail+s[j:])
PY
grep -n "touched_ms - " new.sql | head -3
psql "$DB" -q >/dev/null <<SQL
CREATE TABLE $schema.effects (id bigserial PRIMARY KEY, job text NOT NULL, token numeric NOT NULL);
SELECT $schema.observe('same-' || j, 1) FROM generate_series(1, 1000) j;
SQL
printf '%s\n' '\set j random(1, 1000)' 'BEGIN;' "SELECT $schema.require('same-' || :j, 1);" \
  "INSERT INTO $schema.effects (job, token) VALUES ('job-' || :j, 1);" 'COMMIT;' > same.sql
for c in 1 8; do for r in $(seq $rounds); do for v in old new; do
  [ $(( r % 2 )) = 0 ] && v=$([ $v = old ] && echo new || echo old)
  psql "$DB" -q -f $v.sql >/dev/null; psql "$DB" -qc "TRUNCATE $schema.effects" >/dev/null
  tps=$(pgbench -n -c $c -j $(( c < 2 ? c : 2 )) -T $secs -f same.sql "$DB" 2>&1 | awk '/^tps/ {print int($3)}')
  echo "$v c=$c $tps"
done; done; done
psql "$DB" -qc "DROP SCHEMA $schema CASCADE" >/dev/null
