#!/bin/bash
# Large tensors between two processes of one host: the default pipe (shm + cma; tensors up to
# 64 MiB through the ring, larger ones read by cma) with each count of cma threads, next to
# shm + basic (every size through the ring, its copies shared among the copy threads),
# alternating. Output on stdout, one `### CONFIG RUN` line before each table's rows.
# Run: bash scripts/ab-cma-threads.sh BINARY [COUNTS...] (default: 2 4 8); RUNS=N (2).
B=${1:?usage: ab-cma-threads.sh BINARY [COUNTS...]}
shift
counts=("$@")
[ ${#counts[@]} -eq 0 ] && counts=(2 4 8)
set -u
echo "# host $(hostname) cores $(nproc) $(date -u +%FT%TZ) load $(cut -d' ' -f1 /proc/loadavg)"
for k in $(seq 1 "${RUNS:-2}"); do
  for n in "${counts[@]}"; do
    echo "### cma-threads $n run $k"
    "$B" bench pipe --sizes 64M,128M,256M --cma-threads "$n" 2>/dev/null | grep -E '^\| [0-9]'
  done
  echo "### shm+basic run $k"
  "$B" bench pipe --backend shm+basic --sizes 64M,128M,256M 2>/dev/null | grep -E '^\| [0-9]'
done
echo "# end $(date -u +%FT%TZ)"
