#!/bin/bash
# A/B of branch efa-cuts (new: fewer instructions per message in the efa rows, see docs/efa.md
# "Instruction counts") against main at 111c6c5 (old): `actorpipe bench efa` at 64 B, old and
# new alternating, output on stdout. About 2 minutes on the 2-core VM.
# Run: bash scripts/ab-efa-cuts.sh DIR [RUNS], DIR holding the two binaries `old` and `new`
# (needs libfabric.so.1 with the tcp and shm providers); RUNS alternations, 3 by default.
cd "${1:?usage: ab-efa-cuts.sh DIR [RUNS] (holding old and new actorpipe binaries)}"
set -u
echo "# host $(hostname) cores $(nproc) libfabric $(fi_info --version 2>/dev/null | head -1) $(date -u +%FT%TZ)"
for i in $(seq 1 "${2:-3}"); do
  for v in old new; do
    echo "## 64 B, $v --spin 50, run $i, load $(cut -d' ' -f1 /proc/loadavg)"
    ./$v bench efa --sizes 64 --iters 2000 --rounds 3 --spin 50 --rows "raw,transport,channel,transport spin,channel spin"
  done
done
echo "# end $(date -u +%FT%TZ)"
