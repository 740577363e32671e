#!/bin/bash
# The efa stream's reader keeping on looking within a poll (`READER_BURST`,
# docs/efa-measurements.md, "A reader that keeps looking") against one pass a poll, the path
# before: one binary built with scripts/experiments.patch (`bash scripts/build-patched.sh
# scripts/experiments.patch DIR exp`), run plain (`keep`) and with AP_EXP_READER_ONE_PASS=1
# (`one`), alternating, the first flipped every run. Rows: `bench efa --sizes 64 --spin 50`,
# both providers, with a handler answering in place (`--api handler`) and to a recipient actor
# (`--api standing`). One line per row: `rRUN | VARIANT API | row;row;...`.
# Run: bash scripts/ab-efa-keep-looking.sh DIR (holding `exp`); RUNS=N (default 10). About 8 s a
# run on a 16-core machine.
. "$(dirname "${BASH_SOURCE[0]}")/ab-lib.sh"
cd "${1:?usage: ab-efa-keep-looking.sh DIR (holding the exp binary)}" || exit 1
set -u
ab_header
for r in $(seq 1 "${RUNS:-10}"); do
  order="keep one"
  [ $((r % 2)) = 0 ] && order="one keep"
  for v in $order; do
    e=()
    [ "$v" = one ] && e=(AP_EXP_READER_ONE_PASS=1)
    for api in handler standing; do
      x=$(env "${e[@]}" ./exp bench efa --sizes 64 --iters 3000 --rounds 3 --spin 50 --api $api \
        --rows "raw,transport spin,channel spin" 2>&1 | grep ' 64 B' |
        awk '{print $1,$4,$5,$6,$7}' | tr '\n' ';')
      echo "r$r | $v $api | $x"
    done
  done
done
echo "# end $(date -u +%FT%TZ)"
