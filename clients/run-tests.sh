#!/usr/bin/env bash
# Installs what each client needs, then runs the Python, TypeScript, Go and shell-worker tests
# against the real fence binary (FENCE_BIN, default ../target/debug/fence from here).
# Exits non-zero when any suite fails or cannot run (missing tools included).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
FENCE_BIN=$(realpath -m "${FENCE_BIN:-$here/../target/debug/fence}")
export FENCE_BIN
die() { echo "clients: FAIL: $*" >&2; exit 1; }
[ -x "$FENCE_BIN" ] || die "the fence binary is missing at $FENCE_BIN: cargo build, or set FENCE_BIN"

# Debian packages: Go 1.19 (golang-go), libfaketime, openssl (test certificates), curl (sh worker).
missing=()
command -v go >/dev/null || missing+=(golang-go)
[ -e /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1 ] || [ -e /usr/lib/faketime/libfaketime.so.1 ] || missing+=(faketime)
command -v openssl >/dev/null || missing+=(openssl)
command -v curl >/dev/null || missing+=(curl)
if [ ${#missing[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "${missing[@]}" >/dev/null; } ||
    die "could not install ${missing[*]} with apt-get"
fi
command -v node >/dev/null || die "node is missing (Node 20 or later is needed)"
[ "$(node -p 'process.versions.node.split(".")[0]')" -ge 20 ] || die "Node $(node -v) is too old: 20 or later is needed"
command -v python3 >/dev/null || die "python3 is missing"
# The Python package as users install it, and what its tests need. (The tests themselves import
# the working tree, clients/python/src.)
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
python3 -m pip install -q pytest requests httpx "$here/python" || die "pip install failed"
rm -rf "$here/python/build" "$here/python/src/"*.egg-info
(cd / && python3 -c 'import fence_client, fence_client.requests, fence_client.httpx, pathlib
assert (pathlib.Path(fence_client.__file__).parent / "py.typed").is_file()') || die "the installed fence_client is incomplete"
# TypeScript: no dependencies at all (plain ESM with hand-written types), so no npm install.

failed=0
summary=()
suite() {
  local name=$1 start rc
  shift
  echo "== $name"
  start=$(date +%s)
  "$@"
  rc=$?
  # pytest exits 5 when it collected no tests: that is a failure too, like any non-zero code.
  [ "$rc" -eq 0 ] || failed=1
  summary+=("$name: $([ "$rc" -eq 0 ] && echo ok || echo "FAILED (exit $rc)") in $(($(date +%s) - start)) s")
}
suite python bash -c "cd '$here/python' && python3 -m pytest -q -p no:cacheprovider"
suite typescript bash -c "cd '$here/typescript' && node --test test/*.test.js"
suite go bash -c "cd '$here/go' && go vet ./... && go test -count=1 ./..."
suite sh bash "$here/sh/test.sh"
echo "== summary"
printf '%s\n' "${summary[@]}"
exit "$failed"
