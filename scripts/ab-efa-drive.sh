#!/bin/bash
# The endpoint actor's driver (`actors/fabric/drive.rs`: nothing spawned to arm progress, one
# spin task for the actor's life), two builds alternating: issue 12's efa rows at 64 B with a
# handler, with and without spin, then each build's idle CPU (`bench efa --idle 3`). Output on
# stdout, one `### BUILD ROW RUN` line before each row or table; the binaries need feature efa.
# Run: bash scripts/ab-efa-drive.sh DIR (holding `old` and `new`); RUNS=N (default 6).
. "$(dirname "${BASH_SOURCE[0]}")/ab-lib.sh"
ab_start "${1:-}" ab-efa-drive.sh
for k in $(seq 1 "${RUNS:-6}"); do
  for b in old new; do
    echo "### $b efa $k"
    ./$b bench efa --sizes 64 --iters 2000 --rounds 3 --spin 50 --api handler \
      --rows "raw,transport,channel,transport spin,channel spin" 2>&1 | grep -E '64 B'
  done
done
for b in old new; do
  echo "### $b idle"
  ./$b bench efa --idle 3 2>&1 | grep -vE '^\s*$'
done
echo "# end $(date -u +%FT%TZ)"
