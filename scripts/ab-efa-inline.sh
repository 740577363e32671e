#!/bin/bash
# A small message's tensors read straight from the read buffer, and written straight from the
# message (docs/efa-measurements.md, "A small message's tensors from the read buffer";
# docs/performance-limits.md, "Thirteenth round"): builds rotated, which goes first changing
# from run to run. Per run and binary: `bench efa --sizes 64 --spin 50 --api handler`, both
# providers, and the same read loop and writer on the shm transport (`bench channel --backend
# basic --transport shm --sizes 64 --spin 20 --api handler`). One line per row set: `rRUN |
# VARIANT WHAT | row;row;...`.
# Run: bash scripts/ab-efa-inline.sh DIR (holding the `old` and `new` binaries); RUNS=N
# (default 10); VARIANTS="a b c" names other binaries of DIR, rotated alike. About 4 s a run
# and binary on a 16-core machine.
. "$(dirname "${BASH_SOURCE[0]}")/ab-lib.sh"
ab_start "${1:-}" ab-efa-inline.sh
read -r -a variants <<<"${VARIANTS:-old new}"
k=${#variants[@]}
for r in $(seq 1 "${RUNS:-10}"); do
  for j in $(seq 0 $((k - 1))); do
    v=${variants[$(((r + j) % k))]}
    ab_efa_api "$v" "$r" handler
    x=$(./$v bench channel --backend basic --transport shm --sizes 64 --spin 20 --api handler \
      --rounds 3 --iters 20000 2>&1 | grep -E '^\| 64 B' | awk -F'|' '{print "shm-transport p50" $4 "baseline" $7 "ratio" $9}')
    echo "r$r | $v shm-transport | $x"
  done
done
echo "# end $(date -u +%FT%TZ)"
