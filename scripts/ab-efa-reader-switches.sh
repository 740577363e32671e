#!/bin/bash
# The efa stream reader's variants in one binary, by the switches of scripts/experiments.patch
# (build: bash scripts/build-patched.sh scripts/experiments.patch DIR exp), in rotating order:
# AP_EXP_NOREADER (no reader passes: the path before them), AP_NONE (no switch: what was kept),
# AP_EXP_READER_SKIP, AP_EXP_READER_BURST; 64 B efa rows with a handler RUNS times, then BIG
# rotations of the 64 MiB rows without and with the readers' passes (docs/efa-measurements.md, "A reader that
# reads the CQ itself"). Run: bash scripts/ab-efa-reader-switches.sh DIR (holding `exp`); RUNS=N
# (default 6), BIG=K (default 4).
. "$(dirname "${BASH_SOURCE[0]}")/ab-lib.sh"
ab_start "${1:-}" ab-efa-reader-switches.sh
vs=(AP_EXP_NOREADER AP_NONE AP_EXP_READER_SKIP AP_EXP_READER_BURST)
for k in $(seq 1 "${RUNS:-6}"); do
  for i in 0 1 2 3; do
    v=${vs[$(((i + k - 1) % 4))]}
    echo "### $v efa $k"
    env "$v=1" ./exp bench efa --sizes 64 --iters 2000 --rounds 3 --spin 50 --api handler \
      --rows "raw,transport,transport spin,channel spin" 2>&1 | grep -E '64 B'
  done
done
for k in $(seq 1 "${BIG:-4}"); do
  order="AP_EXP_NOREADER AP_NONE"
  [ $((k % 2)) -eq 0 ] && order="AP_NONE AP_EXP_NOREADER"
  for v in $order; do
    echo "### $v 64M $k"
    env "$v=1" timeout 120 ./exp bench efa --sizes 64M --rounds 2 --rows "raw,transport,channel" \
      2>&1 | grep -E '64 MiB'
  done
done
echo "# end $(date -u +%FT%TZ)"
