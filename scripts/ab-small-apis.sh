#!/usr/bin/env bash
# Small-message A/B between two builds and their bench APIs. Each command alternates the arms,
# 3 times. By default the arms of the PipeWriter change (branch small-write): old = main at
# 3f00bea (bench default --api receive), new = small-write (bench default --api writer), and
# new with --api receive (the old path in the new build). ARMS (|-separated, each a binary and
# its extra flags) and CMDS (|-separated bench commands) override them; the standing receive's
# round (old = f917ed7):
#   ARMS="old|new --api writer|new --api standing" \
#   CMDS="transport --backend shm --spin 20 --pin --sizes 64,4K|transport --backend shm --spin 20 --sizes 64,4K|transport --backend shm --sizes 64,4K|transport --backend tcp --sizes 64,4K|channel --backend basic --sizes 64,4K|pipe --sizes 64,4K" \
#   bash scripts/ab-small-apis.sh DIR
# Run: bash scripts/ab-small-apis.sh DIR, DIR holding the two binaries `old` and `new`.
cd "${1:?usage: ab-small-apis.sh DIR (holding old and new actorpipe binaries)}"
nproc; date -u +%FT%TZ
ARMS=${ARMS:-"old|new|new --api receive"}
CMDS=${CMDS:-"transport --backend shm --spin 20 --sizes 64,4K|transport --backend shm --sizes 64,4K|transport --backend tcp --sizes 64,4K|channel --backend basic --sizes 64,4K|pipe --sizes 64,4K"}
IFS='|' read -ra arms <<< "$ARMS"
IFS='|' read -ra cmds <<< "$CMDS"
for cmd in "${cmds[@]}"; do
  for rep in 1 2 3; do
    for arm in "${arms[@]}"; do
      echo "== $arm | bench $cmd | load $(cut -d' ' -f1 /proc/loadavg)"
      # shellcheck disable=SC2086
      bin=${arm%% *}; extra=""; [ "$arm" != "$bin" ] && extra=${arm#* }
      ./$bin bench $cmd $extra 2>&1 | grep -E '^\| [0-9]|cores at'
    done
  done
done
date -u +%FT%TZ
