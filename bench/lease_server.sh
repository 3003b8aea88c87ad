#!/usr/bin/env bash
# Lease claims and renewals per second, side by side in one session (issue 7):
#   - `fence server` on sled (every answer on disk first), driven by wrk over HTTP;
#   - PostgreSQL: pgbench running PgLeaseStore's own claim and renew statements
#     (synchronous_commit as configured, `on` by default);
#   - etcd (Debian's etcd-server, started here on loopback with a temporary data dir): lease
#     grant and keepalive through its HTTP gateway, driven by wrk.
# At 1, 8 and 64 clients (connections), ROUNDS alternating rounds, medians reported.
# Appends a section to BENCHMARKS.md.
#
# Usage: DATABASE_URL=postgres://... bench/lease_server.sh [SECONDS=5] [ROUNDS=3]
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib.sh
secs=${1:-5}; rounds=${2:-3}
: "${DATABASE_URL:?set DATABASE_URL (eval \"\$(../shared/services.sh postgres)\" sets it)}"
need wrk; need pgbench postgresql-client; need etcd etcd-server; need curl
cargo build --release -q -p fence --bin fence
tmp=$(mktemp -d); pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT
fence=127.0.0.1:19200 etcd=127.0.0.1:19210
RUST_LOG=warn target/release/fence server --listen "$fence" --data-dir "$tmp/fence" & pids+=($!)
etcd --name bench --data-dir "$tmp/etcd" --listen-client-urls "http://$etcd" \
  --advertise-client-urls "http://$etcd" --listen-peer-urls http://127.0.0.1:19211 \
  --initial-advertise-peer-urls http://127.0.0.1:19211 \
  --initial-cluster bench=http://127.0.0.1:19211 --log-level error >"$tmp/etcd.log" 2>&1 & pids+=($!)
wait_http "http://$fence/healthz"; wait_http "http://$etcd/health"

# PostgreSQL: the table PgLeaseStore creates, and its statements with the clock offset at 0.
now="(floor(extract(epoch from clock_timestamp()) * 1000))::bigint"
psql "$DATABASE_URL" -qc "DROP TABLE IF EXISTS fence_bench_leases;
  CREATE TABLE fence_bench_leases (job text PRIMARY KEY, owner text, generation numeric(20,0) NOT NULL,
    lease_until_ms bigint NOT NULL, completed boolean NOT NULL)" >/dev/null
cat > "$tmp/claim.sql" <<SQL
\set j random(1, 2000000000)
INSERT INTO fence_bench_leases AS t (job, owner, generation, lease_until_ms, completed)
 VALUES ('c-' || :client_id || '-' || :j, 'o', 1, $now + 30000, false)
 ON CONFLICT (job) DO UPDATE SET
   generation = CASE WHEN t.owner = excluded.owner AND t.lease_until_ms > excluded.lease_until_ms - 30000
                THEN t.generation ELSE t.generation + 1 END,
   owner = excluded.owner, lease_until_ms = excluded.lease_until_ms
 WHERE NOT t.completed
   AND (t.owner IS NULL OR t.owner = excluded.owner OR t.lease_until_ms <= excluded.lease_until_ms - 30000)
 RETURNING t.generation::text, t.lease_until_ms;
SQL
cat > "$tmp/renew.sql" <<SQL
UPDATE fence_bench_leases SET lease_until_ms = $now + 30000
 WHERE job = 'r-' || :client_id AND owner = 'o' AND generation = '1'::text::numeric AND NOT completed
 RETURNING lease_until_ms;
SQL
psql "$DATABASE_URL" -qc "INSERT INTO fence_bench_leases SELECT 'r-' || g, 'o', 1, 0, false FROM generate_series(0, 63) g" >/dev/null

# Leases to renew: jobs r-0..r-63 claimed on the fence server, 64 etcd leases.
claim_renewable "$fence"
etcd_ids=()
for _ in $(seq 0 63); do
  etcd_ids+=("$(curl -sf -XPOST "http://$etcd/v3/lease/grant" -d '{"TTL":3600}' | sed 's/.*"ID":"\([0-9]*\)".*/\1/')")
done

out=$tmp/rows
cell() { # name clients command...
  local name=$1 c=$2; shift 2
  local rate
  rate=$("$@")
  echo "$name $c $rate" | tee -a "$out" >&2
}
wrk_rate() { # clients url script args...
  local c=$1 url=$2 script=$3; shift 3
  local t=$(( c < 2 ? c : 2 ))
  local r; r=$(wrk -t"$t" -c"$c" -d"${secs}s" -s "$script" "$url" -- "$@")
  if grep -q "Non-2xx" <<<"$r"; then echo "non-2xx answers in $url $*:" >&2; echo "$r" >&2; exit 1; fi
  awk '/Requests\/sec/ {printf "%.0f\n", $2}' <<<"$r"
}
pg_rate() { # clients script
  local c=$1 t=$(( $1 < 2 ? $1 : 2 ))
  pgbench -n -c "$c" -j "$t" -T "$secs" -f "$2" "$DATABASE_URL" 2>/dev/null | awk '/^tps/ {printf "%.0f\n", $3}'
}
for i in $(seq 1 "$rounds"); do
  for c in 1 8 64; do
    echo "round $i of $rounds, $c clients" >&2
    cell fence_claim "$c" wrk_rate "$c" "http://$fence" bench/lease.lua claim "r$i-$c" "$c"
    cell pg_claim "$c" pg_rate "$c" "$tmp/claim.sql"
    cell etcd_grant "$c" wrk_rate "$c" "http://$etcd" bench/etcd.lua grant
    cell fence_renew "$c" wrk_rate "$c" "http://$fence" bench/lease.lua renew r "$c"
    cell pg_renew "$c" pg_rate "$c" "$tmp/renew.sql"
    cell etcd_keepalive "$c" wrk_rate "$c" "http://$etcd" bench/etcd.lua keepalive "${etcd_ids[@]:0:$c}"
  done
done
psql "$DATABASE_URL" -qc "DROP TABLE fence_bench_leases" >/dev/null

m() { awk -v n="$1" -v c="$2" '$1==n && $2==c {print $3}' "$out" | median; }
{
  header "Lease service: fence server vs PostgreSQL vs etcd, ${secs}s × ${rounds} alternating rounds" \
    "DATABASE_URL=... bench/lease_server.sh $secs $rounds"
  echo "$(psql --version), $(etcd --version | head -1). Medians of the rounds, operations per second."
  echo
  echo "| clients | fence claims | pgbench claim | etcd grants | fence renewals | pgbench renew | etcd keepalives | fence claims × etcd grants | fence renewals × pgbench renew |"
  echo "|---|---|---|---|---|---|---|---|---|"
  for c in 1 8 64; do
    fc=$(m fence_claim "$c"); eg=$(m etcd_grant "$c"); fr=$(m fence_renew "$c"); pr=$(m pg_renew "$c")
    echo "| $c | $fc | $(m pg_claim "$c") | $eg | $fr | $pr | $(m etcd_keepalive "$c") | $(ratio "$fc" "$eg") | $(ratio "$fr" "$pr") |"
  done
} | tee -a BENCHMARKS.md
