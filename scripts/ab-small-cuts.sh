#!/bin/bash
# Small messages, two builds alternating: issue 14's rows with a standing receive's handler
# (`bench transport --sizes 64 --rounds 5 --api handler`: shm with `--spin 20`, tcp, shm without
# spin) and issue 12's efa rows (`bench efa --sizes 64 --spin 50 --api handler`, both providers,
# the raw ping-pong and the pipe rows in spin mode). Output on stdout, one `### BUILD ROW RUN`
# line before each row or table. The binaries need feature efa (build with --all-features).
# Run: bash scripts/ab-small-cuts.sh DIR (holding `old` and `new`); RUNS=N (default 6). About
# 40 s a run on a 16-core machine.
. "$(dirname "${BASH_SOURCE[0]}")/ab-lib.sh"
ab_start "${1:-}" ab-small-cuts.sh
row() {
  echo "### $1 $2 $3"
  ./$1 bench transport --backend $4 --sizes 64 --rounds 5 --api handler | grep -E '^\| 64 B'
}
for k in $(seq 1 "${RUNS:-6}"); do
  for b in old new; do
    row "$b" shm-spin "$k" "shm --spin 20"
    row "$b" tcp "$k" tcp
    row "$b" shm "$k" shm
    ab_efa_row "$b" "$k"
  done
done
echo "# end $(date -u +%FT%TZ)"
