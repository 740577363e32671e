#!/bin/bash
# Direct injects (docs/efa-measurements.md, "Direct injects"): the efa stream's small writes
# sent with one `fi_tinject` from the writer's bytes (`Poster::inject`, `new`) against the
# posted op of a pooled bounce buffer (`old`, the build before), rotating which goes first.
# Per run and binary: the stream's halves alone (`bench layers --transport efa`, both providers)
# and `bench efa --sizes 64 --spin 50` with a handler in place (`--api handler`) and to a
# recipient actor (`--api standing`); with BIG=1 also 64 MiB in spin mode. One line per row
# set: `rRUN | VARIANT WHAT | row;row;...`.
# Run: bash scripts/ab-efa-direct-inject.sh DIR (holding the `old` and `new` binaries); RUNS=N
# (default 6). About 25 s a run on a 16-core machine, 35 s with BIG=1.
. "$(dirname "${BASH_SOURCE[0]}")/ab-lib.sh"
ab_start "${1:-}" ab-efa-direct-inject.sh
variants=(old new)
for r in $(seq 1 "${RUNS:-6}"); do
  for j in 0 1; do
    v=${variants[$(((r + j) % 2))]}
    ab_efa_halves_and_apis "$v" "$r"
    if [ "${BIG:-0}" = 1 ]; then
      x=$(./$v bench efa --sizes 64M --iters 4 --rounds 2 --spin 50 \
        --rows "raw,transport spin,channel spin" 2>&1 | ab_rows)
      echo "r$r | $v 64M | $x"
    fi
  done
done
echo "# end $(date -u +%FT%TZ)"
