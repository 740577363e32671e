#!/bin/bash
# CQs without a wait fd (docs/efa-measurements.md, "Without a wait fd"): `bench efa --sizes 64
# --spin 50` as it runs by default (every CQ, the raw ping-pong's included, with a wait fd where
# the provider offers one: `tcp;ofi_rxm`) and with `--no-wait-fd` (every CQ only polled), one
# binary, rotating which goes first; with a handler in place (`--api handler`) and to a recipient
# actor (`--api standing`); then the idle cost of both modes (`bench efa --idle 3`). One line per
# row set: `rRUN | VARIANT API | row;row;...`.
# Run: bash scripts/ab-efa-wait-fd.sh DIR (holding the `actorpipe` binary); RUNS=N (default 8).
# About 12 s a run on a 16-core machine.
. "$(dirname "${BASH_SOURCE[0]}")/ab-lib.sh"
cd "${1:?usage: ab-efa-wait-fd.sh DIR (holding the actorpipe binary)}" || exit 1
set -u
ab_header
variants=(fd nofd)
for r in $(seq 1 "${RUNS:-8}"); do
  for j in 0 1; do
    v=${variants[$(((r + j) % 2))]}
    flag=()
    [ "$v" = nofd ] && flag=(--no-wait-fd)
    for api in handler standing; do
      x=$(./actorpipe bench efa --sizes 64 --iters 3000 --rounds 3 --spin 50 --api $api \
        --rows "raw,transport spin,channel spin" "${flag[@]}" 2>&1 | ab_rows)
      echo "r$r | $v $api | $x"
    done
  done
done
./actorpipe bench efa --idle 3
echo "# end $(date -u +%FT%TZ)"
