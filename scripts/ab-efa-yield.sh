#!/bin/bash
# Issue 12's rows (both providers, 64 B, spin 50 µs, a handler) with the efa spin task's
# `sched_yield` every 20 µs of a spin (base), only after 20 µs of turns that found nothing
# (idle: AP_EXP_IDLE_YIELD=1), never (noyield: AP_EXP_NOYIELD=1), and without the stream's
# credit messages (nocredit: AP_EXP_NOCREDIT=1), rotated, all from one build of
# scripts/experiments.patch (docs/efa-measurements.md, "Credits on the reverse stream's tags").
# Build: bash scripts/build-patched.sh scripts/experiments.patch DIR exp;
# run: RUNS=N bash scripts/ab-efa-yield.sh DIR (default 20; about 8 s a run on 16 cores);
# VARIANTS="base noyield" runs only those, rotated the same way.
. "$(dirname "$0")/ab-lib.sh"
ab_start "${1:-}" ab-efa-yield.sh
read -ra vs <<<"${VARIANTS:-base idle noyield nocredit}"
n=${#vs[@]}
for r in $(seq 1 "${RUNS:-20}"); do
  for j in $(seq 0 $((n - 1))); do
    v=${vs[$(((r + j) % n))]}
    case $v in
      base) e=() ;;
      idle) e=(AP_EXP_IDLE_YIELD=1) ;;
      noyield) e=(AP_EXP_NOYIELD=1) ;;
      nocredit) e=(AP_EXP_NOCREDIT=1) ;;
    esac
    x=$(env "${e[@]}" ./exp bench efa --sizes 64 --iters 3000 --rounds 3 --spin 50 \
      --api handler --rows "raw,transport spin,channel spin" 2>&1 | ab_rows)
    echo "r$r | $v | $x"
  done
done
echo "# end $(date -u +%FT%TZ)"
