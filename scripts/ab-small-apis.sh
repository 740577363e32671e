#!/usr/bin/env bash
# Small-message A/B for the PipeWriter change (branch small-write): old = main at 3f00bea
# (bench default --api receive), new = small-write (bench default --api writer), and new with
# --api receive (the old path in the new build). Each command alternates the arms, 3 times.
# Run: bash scripts/ab-small-apis.sh DIR, DIR holding the two binaries `old` and `new`.
cd "${1:?usage: ab-small-apis.sh DIR (holding old and new actorpipe binaries)}"
nproc; date -u +%FT%TZ
for cmd in "transport --backend shm --spin 20 --sizes 64,4K" "transport --backend shm --sizes 64,4K" \
           "transport --backend tcp --sizes 64,4K" "channel --backend basic --sizes 64,4K" "pipe --sizes 64,4K"; do
  for rep in 1 2 3; do
    for arm in "old" "new" "new --api receive"; do
      echo "== $arm | bench $cmd | load $(cut -d' ' -f1 /proc/loadavg)"
      # shellcheck disable=SC2086
      bin=${arm%% *}; extra=""; [ "$arm" != "$bin" ] && extra=${arm#* }
      ./$bin bench $cmd $extra 2>&1 | grep -E '^\| [0-9]|cores at'
    done
  done
done
date -u +%FT%TZ
