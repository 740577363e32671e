#!/bin/bash
# A/B of the efa endpoint's injects and quiet-turn-free spin (new) against main at a13f068
# (old): `actorpipe bench efa --api handler`, both in spin mode, old and new alternating five
# times, then the 64 MiB rows once each; output on stdout. About 2 minutes on a 16-core machine.
# Run: bash scripts/ab-efa-inject.sh DIR [BUILD...], DIR holding the binaries named (default:
# `old` and `new`; needs libfabric.so.1 with the tcp and shm providers; a build without the
# `raw inject` row skips it).
cd "${1:?usage: ab-efa-inject.sh DIR [BUILD...] (DIR holding the actorpipe binaries)}"
shift
builds=("$@")
[ ${#builds[@]} -eq 0 ] && builds=(old new)
set -u
echo "# host $(hostname) cores $(nproc) $(date -u +%FT%TZ)"
for i in 1 2 3 4 5; do
  for v in "${builds[@]}"; do
    echo "## 64 B, $v --spin 50, run $i, load $(cut -d' ' -f1 /proc/loadavg)"
    ./$v bench efa --sizes 64 --iters 2000 --rounds 3 --spin 50 --api handler \
      --rows "raw,raw inject,actor spin,transport,transport spin,channel spin"
  done
done
for v in "${builds[@]}"; do
  echo "## 64 MiB, $v, load $(cut -d' ' -f1 /proc/loadavg)"
  ./$v bench efa --sizes 64M --rounds 2 --rows raw,transport,channel
done
echo "# end $(date -u +%FT%TZ)"
