#!/usr/bin/env bash
# The clients' negative control (issue 33): in a scratch copy of each client, the keeper is
# made to ignore loss (the token is handed out past the local deadline, and nothing is ever
# declared lost: no event, no AbortSignal, no cancelled context), and each loss scenario is
# run against the real binaries, first on an unchanged copy (it must pass) and then on the
# changed one (it must FAIL): a scenario that passes with loss ignored could not catch a
# client that sends stale writes.
#
#   FENCE_BIN=target/debug/fence bash clients/negative-control.sh
#
# Prints one line per scenario and exits non-zero when one fails unchanged or passes changed
# (or a mutation no longer applies: the text it replaces is gone). Needs what
# clients/run-tests.sh installs. Not part of .ci/run (about 3 minutes): run it after changing
# a keeper; BENCHMARKS.md records its last output.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
FENCE_BIN=$(realpath -m "${FENCE_BIN:-$here/../target/debug/fence}")
export FENCE_BIN
[ -x "$FENCE_BIN" ] || { echo "negative control: the fence binary is missing at $FENCE_BIN" >&2; exit 1; }
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for copy in good bad; do
  mkdir -p "$scratch/$copy/examples"
  cp -r "$here/python" "$here/typescript" "$here/go" "$here/sh" "$scratch/$copy/"
  cp "$here/../examples/sh/worker.sh" "$scratch/$copy/examples/worker.sh"
done

# Each mutation: file, then pairs of (text, replacement); every text must be found.
python3 - "$scratch/bad" <<'EOF' || { echo "negative control: a mutation no longer applies" >&2; exit 1; }
import pathlib, sys
root = pathlib.Path(sys.argv[1])
mutations = {
    "python/src/fence_client/_lease.py": [
        ("if self._reason is None and monotonic() < self._deadline:", "if True:"),
        ("            if self._reason is None:\n                self._reason = reason\n        self._signal_lost()",
         "            pass"),
    ],
    "typescript/src/lease.js": [
        ("if (this.#reason === null && now() < this.#deadline) return this.#token;", "return this.#token;"),
        ("  #declareLost(reason) {\n", "  #declareLost(reason) {\n    return;\n"),
    ],
    "go/lease.go": [
        ('if l.reason == "" && l.clock.Now().Before(l.deadline) {', "if true {"),
        ("func (l *Lease) declareLost(reason string) {\n", "func (l *Lease) declareLost(reason string) {\n\treturn\n"),
    ],
    "examples/worker.sh": [
        ('if [ "$(now_ms)" -ge "$deadline" ]; then', "if false; then"),
    ],
}
for name, pairs in mutations.items():
    path = root / name
    text = path.read_text()
    for old, new in pairs:
        if old not in text:
            sys.exit(f"{name}: {old!r} not found")
        text = text.replace(old, new)
    path.write_text(text)
EOF

wrong=0
scenario() {
  local name=$1 log
  shift
  log="$scratch/$(echo "$name" | tr -c 'a-z' _)"
  if ! (cd "$scratch/good" && "$@") >"$log.good" 2>&1; then
    echo "$name: FAILED UNCHANGED (so its failure below would prove nothing): $(tail -3 "$log.good" | tr '\n' ' ' | cut -c1-200)"
    wrong=1
  elif (cd "$scratch/bad" && "$@") >"$log.bad" 2>&1; then
    echo "$name: PASSED with loss ignored: this scenario cannot catch a keeper that ignores loss"
    wrong=1
  else
    echo "$name: passes unchanged, fails with loss ignored"
  fi
}
py() { (cd python && python3 -m pytest -q -x -p no:cacheprovider "$@"); }
ts() { (cd typescript && node --test "$@"); }
gt() { (cd go && go test -count=1 -run "$1" ./...); }
sh_worker() { WORKER_SH="$PWD/examples/worker.sh" bash sh/test.sh; }
scenario "python: worked example" py tests/test_worked_example.py
scenario "python: clock an hour off" py tests/test_faults.py -k wall_clock
scenario "python: server stops answering" py tests/test_faults.py -k stops_answering
scenario "typescript: worked example" ts test/worked-example.test.js
scenario "typescript: clock an hour off" ts --test-name-pattern 'wall clock' test/faults.test.js
scenario "typescript: server stops answering" ts --test-name-pattern 'stops answering' test/faults.test.js
scenario "go: worked example" gt '^TestWorkedExample$'
scenario "go: clock an hour off" gt '^TestClockOffset$'
scenario "go: server stops answering" gt '^TestServerStopsAnswering$'
scenario "sh: worked example, revoked and stopped-server runs" sh_worker
exit "$wrong"
