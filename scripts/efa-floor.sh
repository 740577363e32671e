#!/bin/bash
# The floor under a 64 B efa round trip in spin mode, layer by layer, next to the shm
# transport's (docs/efa-measurements.md, "The floor under a spin round trip, layer by layer"):
# per run, the shm transport's `bench layers --spin 20` (its halves under tokio, and one actor
# hop a side) and its whole pipe with a handler (`bench transport --backend shm --spin 20 --api
# handler`, beside its raw ring); then for each libfabric provider the efa stream's halves
# (`bench layers --transport efa --spin 50`) and `bench efa`'s raw ping-pong and pipe rows
# (`--spin 50 --api handler`). Output on stdout.
# Run: bash scripts/efa-floor.sh DIR (holding an `actorpipe` built with --features efa);
# RUNS=N (default 3). About 15 s a run on a 16-core machine.
. "$(dirname "${BASH_SOURCE[0]}")/ab-lib.sh"
cd "${1:?usage: efa-floor.sh DIR (holding the actorpipe binary)}" || exit 1
set -u
ab_header
for r in $(seq 1 "${RUNS:-3}"); do
  echo "## run $r"
  ./actorpipe bench layers --spin 20 --iters 5000 --rounds 3 | grep -E '^\| halves'
  ./actorpipe bench transport --backend shm --spin 20 --sizes 64 --api handler --rounds 3 \
    --iters 5000 | grep -E '^\| 64 B'
  for p in shm 'tcp;ofi_rxm'; do
    ./actorpipe bench layers --transport efa --provider "$p" --spin 50 --iters 5000 --rounds 3 |
      grep -E '^\| halves' | sed "s/^/$p /"
    ./actorpipe bench efa --providers "$p" --sizes 64 --iters 3000 --rounds 3 --spin 50 \
      --api handler --rows "raw,transport spin,channel spin" | grep ' 64 B'
  done
done
echo "# end $(date -u +%FT%TZ)"
