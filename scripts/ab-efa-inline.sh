#!/bin/bash
# A small message's tensors straight from the read buffer (docs/efa-measurements.md, "A small
# message's tensors from the read buffer"): the read loop copies a message's payloads and
# tensors out of its buffer when all of them came with the frame (`new`), against reading each
# tensor's chunk through the general async reads into a zeroed buffer (`old`, the build before),
# rotating which goes first. Per run and binary: `bench efa --sizes 64 --spin 50 --api handler`,
# both providers, and the same read loop on the shm transport (`bench channel --backend basic
# --transport shm --sizes 64 --spin 20 --api handler`). One line per row set: `rRUN | VARIANT
# WHAT | row;row;...`.
# Run: bash scripts/ab-efa-inline.sh DIR (holding the `old` and `new` binaries); RUNS=N
# (default 10). About 8 s a run on a 16-core machine.
. "$(dirname "${BASH_SOURCE[0]}")/ab-lib.sh"
ab_start "${1:-}" ab-efa-inline.sh
variants=(old new)
for r in $(seq 1 "${RUNS:-10}"); do
  for j in 0 1; do
    v=${variants[$(((r + j) % 2))]}
    ab_efa_api "$v" "$r" handler
    x=$(./$v bench channel --backend basic --transport shm --sizes 64 --spin 20 --api handler \
      --rounds 3 --iters 20000 2>&1 | grep -E '^\| 64 B' | awk -F'|' '{print "shm-transport p50" $4 "baseline" $7 "ratio" $9}')
    echo "r$r | $v shm-transport | $x"
  done
done
echo "# end $(date -u +%FT%TZ)"
