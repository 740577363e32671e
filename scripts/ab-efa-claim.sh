#!/bin/bash
# A reader's own ends (docs/efa-measurements.md, "A reader's own ends, straight"): in spin mode
# the ends that an efa stream reader's own CQ pass reads for its pipe go straight to it
# (`Claim`, `new`) against through its pipe's queue, which woke its own task each time (`old`,
# the build before), rotating which goes first. Per run and binary: the stream's halves alone
# (`bench layers --transport efa`, both providers) and `bench efa --sizes 64 --spin 50` with a
# handler in place (`--api handler`) and to a recipient actor (`--api standing`). One line per
# row set: `rRUN | VARIANT WHAT | row;row;...`.
# Run: bash scripts/ab-efa-claim.sh DIR (holding the `old` and `new` binaries); RUNS=N
# (default 6). About 25 s a run on a 16-core machine.
. "$(dirname "${BASH_SOURCE[0]}")/ab-lib.sh"
ab_start "${1:-}" ab-efa-claim.sh
variants=(old new)
for r in $(seq 1 "${RUNS:-6}"); do
  for j in 0 1; do
    v=${variants[$(((r + j) % 2))]}
    ab_efa_halves_and_apis "$v" "$r"
  done
done
echo "# end $(date -u +%FT%TZ)"
