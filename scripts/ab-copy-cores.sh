#!/bin/bash
# Shared copies on machines of fewer cores: the same-host large rows of
# scripts/ab-shared-copies.sh (shm transport, xth channel, default pipe; 1 MiB and 64 MiB) with
# both processes confined to the first N CPUs (`taskset`: the default copy threads follow the
# CPUs a process may use), ACTORPIPE_COPY_THREADS=1 against the default, alternating.
# Run: bash scripts/ab-copy-cores.sh BINARY [CPUS...] (default: 4 8); RUNS=N alternations (2).
B=${1:?usage: ab-copy-cores.sh BINARY [CPUS...]}
shift
cpus=("$@")
[ ${#cpus[@]} -eq 0 ] && cpus=(4 8)
set -u
echo "# host $(hostname) cores $(nproc) $(date -u +%FT%TZ) load $(cut -d' ' -f1 /proc/loadavg)"
for n in "${cpus[@]}"; do
  set=0-$((n - 1))
  for k in $(seq 1 "${RUNS:-2}"); do
    for t in 1 default; do
      for row in "transport --backend shm" "channel --backend xth" "pipe"; do
        echo "### cpus $n threads $t run $k: bench $row"
        if [ "$t" = default ]; then
          taskset -c "$set" "$B" bench $row --sizes 1M,64M 2>/dev/null | grep -E '^\| (1 MiB|64 MiB)|machine'
        else
          ACTORPIPE_COPY_THREADS=1 taskset -c "$set" "$B" bench $row --sizes 1M,64M 2>/dev/null | grep -E '^\| (1 MiB|64 MiB)|machine'
        fi
      done
    done
  done
done
echo "# end $(date -u +%FT%TZ)"
