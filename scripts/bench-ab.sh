#!/usr/bin/env bash
# A/B of two builds of `actorpipe` on the transport, channel and pipe rows of
# docs/performance.md: each command runs twice, alternating the old and the new binary, so a
# slow spell of a shared machine weighs on both.
# Run it on an idle machine (it prints the load before each command):
#
#   bash scripts/bench-ab.sh OLD_BINARY NEW_BINARY | tee ab.md
#
# Build the old binary from a checkout of the older commit (`git archive COMMIT | tar -x -C DIR`,
# then `cargo build --release --bin actorpipe` there).
#
# REPS=6 alternates each command six times instead of twice; SMALL=1 runs only the small-message
# rows (64 B and 4 KiB), which take seconds, so that many repeats fit a noisy spell.
set -euo pipefail
old=${1:?usage: bench-ab.sh OLD_BINARY NEW_BINARY}
new=${2:?usage: bench-ab.sh OLD_BINARY NEW_BINARY}
reps=${REPS:-2}
all='transport --backend tcp --sizes 64,4K,1M,64M
transport --backend shm --sizes 64,4K,1M,64M
transport --backend shm --spin 20 --sizes 64,4K
channel --backend basic --sizes 64,4K,1M,64M
channel --backend mpt --sizes 64,4K,1M,64M
pipe --sizes 64,4K,1M,64M'
small='transport --backend tcp --sizes 64,4K
transport --backend shm --sizes 64,4K
transport --backend shm --spin 20 --sizes 64,4K
channel --backend basic --sizes 64,4K
pipe --sizes 64,4K'
cmds=$all
[ "${SMALL:-0}" = 1 ] && cmds=$small
while read -r cmd; do
    for rep in $(seq "$reps"); do
        for b in "$old" "$new"; do
            echo "== $b | bench $cmd | load $(cut -d' ' -f1 /proc/loadavg)"
            # shellcheck disable=SC2086 # the command's words split on purpose
            "$b" bench $cmd 2>&1 | grep -E '^\| [0-9]|cores at'
        done
    done
done <<<"$cmds"
echo "== end | load $(cut -d' ' -f1 /proc/loadavg)"
