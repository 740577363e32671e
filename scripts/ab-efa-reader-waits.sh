#!/bin/bash
# How the efa stream's reader waits in spin mode (docs/efa-measurements.md, "A reader that keeps
# looking" and "A recipient actor's turn without a pass before it"): one binary built with
# scripts/experiments.patch (`bash scripts/build-patched.sh scripts/experiments.patch DIR exp`),
# three ways, rotating which goes first: `now` (plain: a wait's first poll gives way without a
# CQ pass, later polls pass for up to READER_BURST, the spin task skips its read after a reader's
# pass), `first` (AP_EXP_READER_FIRST_PASS=1 AP_EXP_SPIN_READS_ALWAYS=1: the first poll makes
# one pass and the spin task reads on every turn, as at 69c4790) and `one` (also
# AP_EXP_READER_ONE_PASS=1: one pass a poll, as at ce5274d). Rows: `bench efa --sizes 64 --spin
# 50`, both providers, with a handler answering in place (`--api handler`) and to a recipient
# actor (`--api standing`); with BIG=1 also 64 MiB in spin mode. One line per row: `rRUN |
# VARIANT API | row;row;...`.
# Run: bash scripts/ab-efa-reader-waits.sh DIR (holding `exp`); RUNS=N (default 8). About 15 s
# a run on a 16-core machine, 25 s with BIG=1.
. "$(dirname "${BASH_SOURCE[0]}")/ab-lib.sh"
cd "${1:?usage: ab-efa-reader-waits.sh DIR (holding the exp binary)}" || exit 1
set -u
ab_header
variants=(now first one)
envs() {
  case $1 in
    now) ;;
    first) echo AP_EXP_READER_FIRST_PASS=1 AP_EXP_SPIN_READS_ALWAYS=1 ;;
    one) echo AP_EXP_READER_ONE_PASS=1 AP_EXP_SPIN_READS_ALWAYS=1 ;;
  esac
}
rows() {
  grep -E ' 64 (B|MiB) ' | awk '{print $1,$4,$5,$6,$7}' | tr '\n' ';'
}
for r in $(seq 1 "${RUNS:-8}"); do
  for j in 0 1 2; do
    v=${variants[$(((r + j) % 3))]}
    for api in handler standing; do
      x=$(env $(envs $v) ./exp bench efa --sizes 64 --iters 3000 --rounds 3 --spin 50 --api $api \
        --rows "raw,transport spin,channel spin" 2>&1 | rows)
      echo "r$r | $v $api | $x"
    done
    if [ "${BIG:-0}" = 1 ]; then
      x=$(env $(envs $v) ./exp bench efa --sizes 64M --iters 4 --rounds 2 --spin 50 \
        --rows "raw,transport spin,channel spin" 2>&1 | rows)
      echo "r$r | $v 64M | $x"
    fi
  done
done
echo "# end $(date -u +%FT%TZ)"
