#!/usr/bin/env bash
# What TLS and authentication cost (issue 14), side by side in alternating rounds:
#   1. `fence server` (sled) four ways: plain HTTP, HTTP with --auth-file, HTTPS, HTTPS with
#      --auth-file; claims and renewals per second at CONNS connections (kept alive, so the
#      TLS handshake is paid once per connection and the cost measured is per request).
#   2. `fence proxy` against nginx (Debian's nginx-light), both serving HTTPS (and both plain
#      HTTP for reference) in front of the same bare hyper upstream, same-generation writes.
# Certificates are made here with openssl (a throwaway P-256 CA and server certificate).
# Appends a section to BENCHMARKS.md.
#
# Usage: bench/secure.sh [SECONDS=5] [ROUNDS=3]   (CONNS=8; PROFILE=release)
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib.sh
secs=${1:-5}; rounds=${2:-3}; conns=${CONNS:-8}; profile=${PROFILE:-release}
need wrk; need nginx nginx-light; need curl; need openssl
cargo build --profile "$profile" -q -p fence --bin fence
cargo build --profile "$profile" -q --example bench_sink -p fence-suite
bin=target/$profile
tmp=$(mktemp -d); pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT

# A CA and a server certificate for 127.0.0.1.
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj /CN=bench-ca \
  -keyout "$tmp/ca.key" -out "$tmp/ca.pem" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=127.0.0.1 \
  -keyout "$tmp/key.pem" -out "$tmp/req.pem" 2>/dev/null
openssl x509 -req -in "$tmp/req.pem" -CA "$tmp/ca.pem" -CAkey "$tmp/ca.key" -CAcreateserial -days 2 \
  -extfile <(printf 'subjectAltName=IP:127.0.0.1') -out "$tmp/cert.pem" 2>/dev/null
tls=(--tls-cert "$tmp/cert.pem" --tls-key "$tmp/key.pem")
secret=$(head -c 32 /dev/urandom | base64 | tr -d '=+/')
printf 'bench %s *\n' "$secret" > "$tmp/clients"; chmod 600 "$tmp/clients"
auth=(--auth-file "$tmp/clients")
bearer="Authorization: Bearer $secret"

plain=127.0.0.1:19301 authed=127.0.0.1:19302 https=127.0.0.1:19303 both=127.0.0.1:19304
s() { RUST_LOG=warn $bin/fence server --listen "$1" --data-dir "$tmp/$2" "${@:3}" & pids+=($!); }
s "$plain" plain
s "$authed" authed "${auth[@]}"
s "$https" https "${tls[@]}"
s "$both" both "${tls[@]}" "${auth[@]}"

bare=127.0.0.1:19311 proxy=127.0.0.1:19312 proxys=127.0.0.1:19313 nginx=127.0.0.1:19315 nginxs=127.0.0.1:19316
$bin/examples/bench_sink bare "$bare" >/dev/null & pids+=($!)
p() { RUST_LOG=warn $bin/fence proxy --listen "$1" --admin-listen "$2" --upstream "http://$bare" --data-dir "$tmp/$3" "${@:4}" & pids+=($!); }
p "$proxy" 127.0.0.1:19320 proxy
p "$proxys" 127.0.0.1:19321 proxys "${tls[@]}"
nginx_run "$tmp/nginx" "  upstream bare { server $bare; keepalive 128; }
  server {
    listen $nginx;
    listen $nginxs ssl;
    ssl_certificate $tmp/cert.pem;
    ssl_certificate_key $tmp/key.pem;
$NGINX_PASS_BARE
  }" & pids+=($!)
for a in "$plain" "$authed" "$proxy" "$nginx" "$bare"; do wait_http "http://$a/healthz"; done
for a in "$https" "$both" "$proxys" "$nginxs"; do wait_http "https://$a/healthz" || true; done
claim_renewable "http://$plain"
claim_renewable "http://$authed" -H "$bearer"
claim_renewable "https://$https"
claim_renewable "https://$both" -H "$bearer"

out=$tmp/rows
lease() { # case url mode prefix [wrk args]
  local name=$1 url=$2 mode=$3 prefix=$4; shift 4
  wrk_row "$name" -t2 -c"$conns" -d"${secs}s" "$@" -s bench/lease.lua "$url" -- "$mode" "$prefix" "$conns" | tee -a "$out"
}
sink() { wrk_row "$1" -t2 -c"$conns" -d"${secs}s" -s bench/fenced.lua "$2" -- same | tee -a "$out"; }
for i in $(seq 1 "$rounds"); do
  echo "round $i of $rounds ($conns connections)" >&2
  lease claim_plain "http://$plain" claim "c$i"
  lease claim_auth "http://$authed" claim "c$i" -H "$bearer"
  lease claim_tls "https://$https" claim "c$i"
  lease claim_both "https://$both" claim "c$i" -H "$bearer"
  lease renew_plain "http://$plain" renew r
  lease renew_auth "http://$authed" renew r -H "$bearer"
  lease renew_tls "https://$https" renew r
  lease renew_both "https://$both" renew r -H "$bearer"
  sink proxy "http://$proxy/"
  sink nginx "http://$nginx/"
  sink proxys "https://$proxys/"
  sink nginxs "https://$nginxs/"
done

row() { # label case base
  local r; r=$(case_median "$out" "$2" 2)
  echo "| $1 | $r | $(case_median "$out" "$2" 3) | $(case_median "$out" "$2" 4) |" \
    "$(case_sum "$out" "$2" 5)/$(case_sum "$out" "$2" 6) | $(ratio "$r" "$(case_median "$out" "$3" 2)") |"
}
{
  header "What TLS and authentication cost: ${conns} kept-alive connections, ${secs}s × ${rounds} alternating rounds" \
    "CONNS=$conns PROFILE=$profile bench/secure.sh $secs $rounds"
  echo "rustls $(cargo tree -q -p fence -i rustls --depth 0 2>/dev/null | head -1 | awk '{print $2}') (ring) in fence; $(nginx -v 2>&1 | cut -d' ' -f3) with $(openssl version | cut -d' ' -f1-2). P-256 certificates."
  echo
  echo "| fence server (sled) | ops/s (median) | p50 µs | p99 µs | non-2xx/errors | × plain HTTP |"
  echo "|---|---|---|---|---|---|"
  row "claim, plain HTTP" claim_plain claim_plain
  row "claim, HTTP + --auth-file" claim_auth claim_plain
  row "claim, HTTPS" claim_tls claim_plain
  row "claim, HTTPS + --auth-file" claim_both claim_plain
  row "renew, plain HTTP" renew_plain renew_plain
  row "renew, HTTP + --auth-file" renew_auth renew_plain
  row "renew, HTTPS" renew_tls renew_plain
  row "renew, HTTPS + --auth-file" renew_both renew_plain
  echo
  echo "| proxy → bare upstream (same generation) | req/s (median) | p50 µs | p99 µs | non-2xx/errors | × nginx, same scheme |"
  echo "|---|---|---|---|---|---|"
  row "fence proxy, HTTP" proxy nginx
  row "nginx proxy_pass, HTTP" nginx nginx
  row "fence proxy, HTTPS" proxys nginxs
  row "nginx proxy_pass, HTTPS" nginxs nginxs
} | tee -a BENCHMARKS.md
