#!/bin/bash
# Issue 14's small-message rows with a standing receive's handler (`--api handler`), builds
# alternating: 64 B over shm in spin mode (`--spin 20`), over tcp, and over shm without spin,
# each `bench transport --rounds 5`; ten alternations by default. Output on stdout, one
# `### BUILD ROW RUN` line before each row.
# Run: bash scripts/ab-small-handler.sh DIR [BUILD...] (default builds: old new), DIR holding
# the actorpipe binaries; RUNS=N for another count. About 3 minutes for two builds on a
# 16-core machine.
cd "${1:?usage: ab-small-handler.sh DIR [BUILD...] (DIR holding the actorpipe binaries)}"
shift
builds=("$@")
[ ${#builds[@]} -eq 0 ] && builds=(old new)
set -u
echo "# host $(hostname) cores $(nproc) $(date -u +%FT%TZ) load $(cut -d' ' -f1 /proc/loadavg)"
row() {
  echo "### $1 $2 $3"
  ./$1 bench transport --backend $4 --sizes 64 --rounds 5 --api handler | grep -E '^\| 64 B'
}
for k in $(seq 1 "${RUNS:-10}"); do
  for b in "${builds[@]}"; do
    row "$b" shm-spin "$k" "shm --spin 20"
    row "$b" tcp "$k" tcp
    row "$b" shm "$k" shm
  done
done
echo "# end $(date -u +%FT%TZ)"
