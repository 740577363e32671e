#!/bin/bash
# A/B of branch efa-direct (new: stream halves and the efa channel post straight into the
# endpoint's engine) against main at f917ed7 (old): `actorpipe bench efa`, both in spin mode,
# old and new alternating, output on stdout. About 1 minute on the 2-core VM.
# Run: bash scripts/ab-efa-direct.sh DIR, DIR holding the two binaries `old` and `new` (needs
# libfabric.so.1 with the tcp and shm providers).
cd "${1:?usage: ab-efa-direct.sh DIR (holding old and new actorpipe binaries)}"
set -u
echo "# host $(hostname) cores $(nproc) libfabric $(fi_info --version 2>/dev/null | head -1) $(date -u +%FT%TZ)"
for i in 1 2 3; do
  for v in old new; do
    echo "## 64 B, $v --spin 50, run $i, load $(cut -d' ' -f1 /proc/loadavg)"
    ./$v bench efa --sizes 64 --iters 2000 --rounds 3 --spin 50 --rows "raw,actor,transport,channel,actor spin,transport spin,channel spin"
  done
done
for v in old new; do
  echo "## 64 MiB, $v, load $(cut -d' ' -f1 /proc/loadavg)"
  ./$v bench efa --sizes 64M --rounds 2 --rows raw,transport,channel
done
echo "# end $(date -u +%FT%TZ)"
