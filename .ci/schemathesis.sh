#!/usr/bin/env bash
# schemathesis (PyPI) against a running `fence server` (issue 34): every check and every
# phase, the stateful one following docs/openapi.json's links, configured and explained in
# .ci/schemathesis.toml and .ci/schemathesis_hooks.py. Fails on any failure or error.
# Usage: FENCE_BIN=target/debug/fence bash .ci/schemathesis.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
fence=${FENCE_BIN:?FENCE_BIN names the fence binary to test}
if ! command -v schemathesis >/dev/null 2>&1; then
  python3 -m pip install -q 'schemathesis>=4.3,<5' >/dev/null 2>&1 \
    || { echo "schemathesis could not be installed (pip install schemathesis)" >&2; exit 1; }
fi
work=$(mktemp -d)
server=
cleanup() { [ -n "$server" ] && kill "$server" 2>/dev/null; wait 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
secret=$(head -c 24 /dev/urandom | base64 | tr '+/' '-_')
# One client that may claim any job and revoke.
printf 'schemathesis %s * +revoke\n' "$secret" >"$work/clients"
chmod 600 "$work/clients"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$fence" server --listen "127.0.0.1:$port" --data-dir "$work/data" --auth-file "$work/clients" \
  --max-claim-wait 1s >"$work/server.log" 2>&1 &
server=$!
for _ in $(seq 100); do
  curl -fsS "http://127.0.0.1:$port/healthz" >/dev/null 2>&1 && break
  sleep 0.1
done
curl -fsS "http://127.0.0.1:$port/healthz" >/dev/null || { cat "$work/server.log" >&2; exit 1; }
cd "$work"
FENCE_ST_SECRET=$secret SCHEMATHESIS_HOOKS=schemathesis_hooks PYTHONPATH=$here \
  schemathesis --config-file "$here/schemathesis.toml" run "http://127.0.0.1:$port/openapi.json" \
  || { echo "schemathesis failed; the server's log:" >&2; tail -20 "$work/server.log" >&2; exit 1; }
