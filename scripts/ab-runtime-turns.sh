#!/bin/bash
# The loops on the runtime's queue (`ACTORPIPE_LOOPS_ON_RUNTIME=1`) against the default
# `LocalSet`, two builds alternating, 64 B (`bench transport --sizes 64 --rounds 5`): shm in spin
# mode (`--spin 20`) with a recipient actor (`--api standing`) and with a handler (`--api
# handler`) for both builds, then shm and tcp without spin with a recipient for the new build.
# Output on stdout, one `### BUILD QUEUE API ROW RUN` line before each row.
# Run: bash scripts/ab-runtime-turns.sh DIR (holding `old` and `new`); RUNS=N (default 3).
. "$(dirname "${BASH_SOURCE[0]}")/ab-lib.sh"
ab_start "${1:-}" ab-runtime-turns.sh
row() { # BUILD QUEUE API RUN BACKEND...
  local b=$1 q=$2 api=$3 k=$4
  shift 4
  echo "### $b $q $api $* $k"
  local on=0
  [ "$q" = runtime ] && on=1
  ACTORPIPE_LOOPS_ON_RUNTIME=$on ./$b bench transport --backend "$@" --sizes 64 --rounds 5 \
    --api "$api" | grep -E '^\| 64 B'
}
for k in $(seq 1 "${RUNS:-3}"); do
  for b in old new; do
    for q in localset runtime; do
      for api in standing handler; do
        row "$b" "$q" "$api" "$k" shm --spin 20
      done
    done
  done
  for q in localset runtime; do
    row new "$q" standing "$k" shm
    row new "$q" standing "$k" tcp
  done
done
echo "# end $(date -u +%FT%TZ)"
