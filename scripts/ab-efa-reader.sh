#!/bin/bash
# A stream's reader that reads the CQ itself while its endpoint spins (`Poster::spin_pass`,
# docs/efa-measurements.md, "A reader that reads the CQ itself"), builds in rotating order (old, new; then
# new, old; ... or, with BUILDS="a b c", each run starting one build later). With BIG=K, first K
# rotations of the 64 MiB efa rows (`bench efa --sizes 64M --rounds 2 --rows
# "raw,transport,channel"`); then issue 12's efa rows at 64 B with a handler, RUNS times; then
# each build's idle CPU (`bench efa --idle 3`). Output on stdout, one `### BUILD ROW RUN` line
# before each row or table; the binaries need feature efa.
# Run: bash scripts/ab-efa-reader.sh DIR (holding the builds, `old` and `new` by default);
# RUNS=N (default 8), BUILDS="..." (default "old new"), BIG=K (default 0).
# One binary with switches instead of builds: scripts/ab-efa-reader-switches.sh.
. "$(dirname "${BASH_SOURCE[0]}")/ab-lib.sh"
ab_start "${1:-}" ab-efa-reader.sh
read -r -a builds <<< "${BUILDS:-old new}"
n=${#builds[@]}
for k in $(seq 1 "${BIG:-0}"); do
  for i in $(seq 0 $((n - 1))); do
    b=${builds[$(((i + k - 1) % n))]}
    echo "### $b 64M $k"
    timeout 120 ./$b bench efa --sizes 64M --rounds 2 --rows "raw,transport,channel" 2>&1 |
      grep -E '64 MiB'
  done
done
for k in $(seq 1 "${RUNS:-8}"); do
  for i in $(seq 0 $((n - 1))); do
    b=${builds[$(((i + k - 1) % n))]}
    echo "### $b efa $k"
    ./$b bench efa --sizes 64 --iters 2000 --rounds 3 --spin 50 --api handler \
      --rows "raw,raw inject,transport,transport spin,channel spin" 2>&1 | grep -E '64 B'
  done
done
for b in "${builds[@]}"; do
  echo "### $b idle"
  ./$b bench efa --idle 3 2>&1 | grep -vE '^\s*$'
done
echo "# end $(date -u +%FT%TZ)"
