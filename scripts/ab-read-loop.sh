#!/bin/bash
# Where the read loop runs while a handler stands: one binary, three placements by environment
# variable, rotating order: `follow` (the default: the read loop moves to the runtime's queue
# while a standing receive calls a handler), `local` (ACTORPIPE_READ_LOOP_FOLLOWS_HANDLER=0:
# it stays on the arbiter's `LocalSet`, as before 2026-11-27's sixth session) and `runtime`
# (ACTORPIPE_LOOPS_ON_RUNTIME=1: both loops on the runtime's queue for good). Rows: issue 14's
# small-message rows with a handler (`bench transport --sizes 64 --rounds 5 --api handler`: shm
# without spin, tcp, shm with `--spin 20`) and shm without spin to a recipient actor (`--api
# standing`, which no placement should move). Output on stdout, one `### VARIANT ROW RUN` line
# before each row.
# Run: bash scripts/ab-read-loop.sh DIR (holding the `actorpipe` binary); RUNS=N (default 6).
# About 30 s a run on a 16-core machine.
. "$(dirname "${BASH_SOURCE[0]}")/ab-lib.sh"
cd "${1:?usage: ab-read-loop.sh DIR (holding the actorpipe binary)}" || exit 1
set -u
ab_header
row() {
  local variant=$1 name=$2 run=$3 api=$4 backend=$5
  echo "### $variant $name $run"
  case $variant in
    follow) env ./actorpipe bench transport --backend $backend --sizes 64 --rounds 5 --api $api ;;
    local) env ACTORPIPE_READ_LOOP_FOLLOWS_HANDLER=0 \
      ./actorpipe bench transport --backend $backend --sizes 64 --rounds 5 --api $api ;;
    runtime) env ACTORPIPE_LOOPS_ON_RUNTIME=1 \
      ./actorpipe bench transport --backend $backend --sizes 64 --rounds 5 --api $api ;;
  esac | grep -E '^\| 64 B'
}
variants=(follow local runtime)
for k in $(seq 1 "${RUNS:-6}"); do
  # Rotate which variant goes first.
  for j in 0 1 2; do
    v=${variants[$(((k + j) % 3))]}
    row "$v" shm "$k" handler shm
    row "$v" tcp "$k" handler tcp
    row "$v" shm-spin "$k" handler "shm --spin 20"
    row "$v" shm-standing "$k" standing shm
  done
done
echo "# end $(date -u +%FT%TZ)"
