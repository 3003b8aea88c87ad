# Shared helpers of the bench/ scripts: source it, do not run it.
#
# wrk_row NAME WRK_ARGS...   runs wrk --latency and prints "NAME req/s p50_us p99_us non2xx errors"
# case_median FILE CASE COL  the median of a column over a case's rounds (case_sum: the sum)
# header TITLE COMMAND       the heading every appended section starts with: date, machine, versions
# claim_renewable ADDR       jobs r-0..r-63 held by owner "o" on a fence server, for renewals
set -euo pipefail

need() { command -v "$1" >/dev/null || { echo "$1 is needed: apt-get install ${2:-$1}" >&2; exit 1; }; }

# need_database: DATABASE_URL set and pgbench installed, for the scripts that measure SQL.
need_database() {
  : "${DATABASE_URL:?set DATABASE_URL (../shared/services.sh postgres prints it)}"
  need pgbench postgresql-contrib
}

# wrk latency figures ("114.00us", "1.24ms", "2.00s") in microseconds.
to_us() { awk '{v=$1; u=v; sub(/[0-9.]+/, "", u); sub(/[a-z]+$/, "", v);
  f = (u=="us") ? 1 : (u=="ms") ? 1000 : (u=="s") ? 1000000 : 1; printf "%.0f\n", v*f}' <<<"$1"; }

wrk_row() {
  local name=$1; shift
  local r rps p50 p99 bad errs
  r=$(wrk --latency "$@")
  rps=$(awk '/Requests\/sec/ {printf "%.0f", $2}' <<<"$r")
  p50=$(to_us "$(awk '$1=="50%" {print $2}' <<<"$r")")
  p99=$(to_us "$(awk '$1=="99%" {print $2}' <<<"$r")")
  bad=$(awk '/Non-2xx or 3xx responses:/ {print $NF}' <<<"$r"); bad=${bad:-0}
  errs=$(awk '/Socket errors:/ {gsub(/,/, ""); print $4+$6+$8+$10}' <<<"$r"); errs=${errs:-0}
  echo "$name ${rps:-0} ${p50:-0} ${p99:-0} $bad $errs"
}

# Median of the numbers on stdin.
median() { sort -n | awk '{a[NR]=$1} END {if (NR) print a[int((NR+1)/2)]; else print 0}'; }

# case_median FILE CASE COLUMN: the median of COLUMN (2 req/s, 3 p50, 4 p99) over CASE's rounds.
case_median() { awk -v c="$2" -v k="$3" '$1==c {print $k}' "$1" | median; }

# case_sum FILE CASE COLUMN: the sum of COLUMN over CASE's rounds.
case_sum() { awk -v c="$2" -v k="$3" '$1==c {s+=$k} END {print s+0}' "$1"; }

# wrk_rounds FILE: the rounds wrk_row wrote to FILE, as the fenced block a BENCHMARKS.md
# section ends with.
wrk_rounds() {
  echo "Rounds (case-connections, req/s, p50 µs, p99 µs, non-2xx, socket errors):"
  echo
  echo '```'
  cat "$1"
  echo '```'
}

ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a/b; else print "n/a" }'; }

header() {
  local title=$1 cmd=$2
  echo
  echo "### $title"
  echo
  echo "Measured $(date -u '+%F %H:%M') UTC on $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo)," \
    "$(rustc --version | cut -d' ' -f1-2)$(command -v wrk >/dev/null && echo ", $(wrk -v 2>&1 | head -1 | cut -d' ' -f1-2)")."
  echo
  echo '```'
  echo "$cmd"
  echo '```'
  echo
}

# nginx_run DIR HTTP_BLOCK: writes DIR/nginx.conf (a worker per core, in the foreground,
# logs and temporary files in DIR, no access log) with HTTP_BLOCK inside its `http { }`,
# and becomes that nginx: run it in the background and keep its pid.
nginx_run() {
  local dir=$1 block=$2
  mkdir -p "$dir"
  cat > "$dir/nginx.conf" <<CONF
worker_processes auto;
daemon off;
pid $dir/nginx.pid;
error_log $dir/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $dir/body;
  proxy_temp_path $dir/proxy;
$block
}
CONF
  exec nginx -p "$dir" -c "$dir/nginx.conf"
}

# NGINX_PASS_BARE: the location block that proxies everything to upstream `bare` over
# kept-alive HTTP/1.1 connections, for nginx_run's HTTP_BLOCK.
NGINX_PASS_BARE='    location / {
      proxy_pass http://bare;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }'

# nginx_pass_bare DIR LISTEN BARE: nginx_run with one server on LISTEN passing everything to
# the bare service at BARE over kept-alive connections (128 idle kept): run it in the background.
nginx_pass_bare() {
  nginx_run "$1" "  upstream bare { server $3; keepalive 128; }
  server {
    listen $2;
$NGINX_PASS_BARE
  }"
}

# nginx_grpc_pass DIR LISTEN BARE: nginx_run with one HTTP/2 server on LISTEN passing every
# gRPC call to the bare tonic service at BARE (grpc_pass, kept-alive upstream connections):
# run it in the background. Without the keepalive_requests lines nginx closes a connection
# after 1000 requests, failing the calls in flight on it.
nginx_grpc_pass() {
  nginx_run "$1" "  keepalive_requests 1000000;
  upstream bare { server $3; keepalive 128; keepalive_requests 1000000; }
  server {
    listen $2 http2;
    location / { grpc_pass grpc://bare; }
  }"
}

# wait_http URL: until URL answers (any status), at most 10 s.
wait_http() {
  for _ in $(seq 1 100); do
    curl -sk -o /dev/null "$1" && return 0
    sleep 0.1
  done
  echo "nothing answers at $1" >&2; return 1
}

# wait_tcp HOST:PORT: until something accepts connections there, at most 10 s (for servers
# that speak only HTTP/2, which curl's plain request cannot ask).
wait_tcp() {
  for _ in $(seq 1 100); do
    (exec 3<>"/dev/tcp/${1%:*}/${1##*:}") 2>/dev/null && return 0
    sleep 0.1
  done
  echo "nothing listens at $1" >&2; return 1
}

# claim_renewable URL [CURL_ARGS...]: jobs r-0 .. r-63 claimed by owner "o" with lease key
# benchkey-0123456789abcdef (generation 1 on a fresh store) for one hour on the fence server
# at URL (http://host:port or https://...; a bare host:port means http), as
# bench/lease.lua's renew mode expects.
claim_renewable() {
  local url=$1; shift
  case $url in http://*|https://*) ;; *) url=http://$url ;; esac
  for j in $(seq 0 63); do
    curl -sfk -XPOST "$url/v1/leases/r-$j/claim" -H 'content-type: application/json' "$@" \
      -d '{"owner":"o","lease_key":"benchkey-0123456789abcdef","ttl_ms":3600000}' >/dev/null
  done
}
