#!/usr/bin/env bash
# A against B with criterion: the sink layer's and the lease store's criterion benches of
# two commits, B compared against A's saved baseline in one session. Uses the worktrees and
# target dirs of bench/ab.sh (target/ab). Prints criterion's comparison; appends a table of
# the changes it reports to BENCHMARKS.md.
#
# Usage: bench/ab_criterion.sh REV_A   (B=REV_B, default HEAD)
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?usage: bench/ab_criterion.sh REV_A}
a_rev=$(git rev-parse --short "$rev"); b_rev=$(git rev-parse --short "${B:-HEAD}")
root=$PWD
checkout() { # side rev
  local tree=$root/target/ab/tree-$1
  if [ ! -d "$tree" ]; then git worktree add -q --detach "$tree" "$2"; fi
  git -C "$tree" checkout -q --detach "$2"
}
checkout a "$a_rev"; checkout b "$b_rev"
benches=("-p fence-sink --bench fence_layer" "-p fence-lease --bench lease_store")
for bench in "${benches[@]}"; do
  # shellcheck disable=SC2086
  (cd target/ab/tree-a && CARGO_TARGET_DIR=$root/target/ab/target-a cargo bench -q $bench -- --save-baseline a >/dev/null)
done
rm -rf target/ab/target-b/criterion; mkdir -p target/ab/target-b
cp -r target/ab/target-a/criterion target/ab/target-b/criterion
out=$(mktemp)
for bench in "${benches[@]}"; do
  # shellcheck disable=SC2086
  (cd target/ab/tree-b && CARGO_TARGET_DIR=$root/target/ab/target-b cargo bench -q $bench -- --baseline a) | tee -a "$out"
done
{
  echo
  echo "### Criterion A/B: $a_rev (A) against $b_rev (B)"
  echo
  echo "Measured $(date -u '+%F %H:%M') UTC on $(nproc) cores, $(rustc --version | cut -d' ' -f1-2)."
  echo
  echo '```'
  echo "bench/ab_criterion.sh $rev"
  echo '```'
  echo
  echo "| benchmark | B time | change against A (criterion's 95% interval) |"
  echo "|---|---|---|"
  awk '/^[a-z_]+\// {name=$0} /time:/ && name {t=$0; sub(/.*time: +\[/, "", t); sub(/\].*/, "", t); split(t, a, " "); time=a[3] " " a[4]}
       /change:/ && name {c=$0; sub(/.*change: +\[/, "", c); sub(/\].*/, "", c); print "| " name " | " time " | " c " |"; name=""}' "$out"
} | tee -a BENCHMARKS.md
rm -f "$out"
