#!/bin/bash
# Large same-host messages with the copies shared among copy threads (the default on more than
# 2 cores, `actorpipe::copy`) against the caller alone (ACTORPIPE_COPY_THREADS=1), one build,
# alternating: the shm ring (`bench transport --backend shm`), the xth channel (`bench channel
# --backend xth`) and the default pipe (`bench pipe`: shm, with tensors up to 64 MiB through the
# ring), 1 MiB and 64 MiB each; first the copy floor (`bench copy`). Output on stdout, one
# `### THREADS ROW RUN` line before each row.
# Run: bash scripts/ab-shared-copies.sh BINARY [THREADS...] (default: 1 and the machine's
# default, written `default`); RUNS=N alternations (3). About 3 minutes on a 16-core machine.
B=${1:?usage: ab-shared-copies.sh BINARY [THREADS...]}
shift
counts=("$@")
[ ${#counts[@]} -eq 0 ] && counts=(1 default)
set -u
echo "# host $(hostname) cores $(nproc) $(date -u +%FT%TZ) load $(cut -d' ' -f1 /proc/loadavg)"
"$B" bench copy --sizes 1M,16M,64M --threads 1,2,4,8
row() {
  echo "### $1 $2 $3"
  if [ "$1" = default ]; then
    "$B" bench "${@:4}" --sizes 1M,64M | grep -E '^\| (1 MiB|64 MiB)'
  else
    ACTORPIPE_COPY_THREADS=$1 "$B" bench "${@:4}" --sizes 1M,64M | grep -E '^\| (1 MiB|64 MiB)'
  fi
}
for k in $(seq 1 "${RUNS:-3}"); do
  for t in "${counts[@]}"; do
    row "$t" shm "$k" transport --backend shm
    row "$t" xth "$k" channel --backend xth
    row "$t" pipe "$k" pipe
  done
done
echo "# end $(date -u +%FT%TZ)"
