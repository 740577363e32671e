#!/bin/bash
# A/B of branch efa-lat at fd41b56 (new, spin mode opt-in) against main at 3f00bea (old): `actorpipe bench
# efa`, old and new alternating, output on stdout. About 2.5 minutes on the 2-core VM.
# Run: bash scripts/ab-efa.sh DIR, DIR holding the two binaries `old` and `new` (needs
# libfabric.so.1 with the tcp and shm providers).
cd "${1:?usage: ab-efa.sh DIR (holding old and new actorpipe binaries)}"
set -u
echo "# host $(hostname) cores $(nproc) libfabric $(fi_info --version 2>/dev/null | head -1) $(date -u +%FT%TZ)"
for i in 1 2 3; do
  echo "## 64 B, old, run $i, load $(cut -d' ' -f1 /proc/loadavg)"
  ./old bench efa --sizes 64 --iters 2000 --rounds 3
  echo "## 64 B, new --spin 50, run $i, load $(cut -d' ' -f1 /proc/loadavg)"
  ./new bench efa --sizes 64 --iters 2000 --rounds 3 --spin 50
done
for i in 1 2; do
  echo "## 64 MiB, old, run $i, load $(cut -d' ' -f1 /proc/loadavg)"
  ./old bench efa --sizes 64M --rounds 2
  echo "## 64 MiB, new, run $i, load $(cut -d' ' -f1 /proc/loadavg)"
  ./new bench efa --sizes 64M --rounds 2 --rows raw,actor,transport,channel,striped
done
echo "## 64 MiB shm, new, spin window longer than the transfer, load $(cut -d' ' -f1 /proc/loadavg)"
./new bench efa --sizes 64M --rounds 2 --providers shm --spin 30000 --rows "raw,channel,channel spin"
echo "## idle, new, load $(cut -d' ' -f1 /proc/loadavg)"
./new bench efa --idle 3
