#!/bin/bash
# Issue 12's tcp rows with rxm's direct send (FI_OFI_RXM_ENABLE_DIRECT_SEND=1: a posted send
# that fits rxm's eager size goes out from the caller's buffer, without rxm's copy into its own
# buffer) or without, and the stream's 96-byte messages injected (rxm emulates injects over 64
# bytes: today's code) or posted with fi_tsend (AP_EXP_INJECT_MAX=64), rotated, one build of
# scripts/experiments.patch; the raw ping-pong runs under the same environment in each
# (docs/efa-measurements.md, "rxm's direct send"). Build: bash scripts/build-patched.sh
# scripts/experiments.patch DIR exp; run: RUNS=N bash scripts/ab-efa-direct-send.sh DIR
# (default 20; about 6 s a run on 16 cores).
. "$(dirname "$0")/ab-lib.sh"
ab_start "${1:-}" ab-efa-direct-send.sh
vs=(base posted direct-send posted+direct-send)
for r in $(seq 1 "${RUNS:-20}"); do
  for j in 0 1 2 3; do
    v=${vs[$(((r + j) % 4))]}
    case $v in
      base) e=() ;;
      posted) e=(AP_EXP_INJECT_MAX=64) ;;
      direct-send) e=(FI_OFI_RXM_ENABLE_DIRECT_SEND=1) ;;
      posted+direct-send) e=(AP_EXP_INJECT_MAX=64 FI_OFI_RXM_ENABLE_DIRECT_SEND=1) ;;
    esac
    x=$(env "${e[@]}" ./exp bench efa --providers 'tcp;ofi_rxm' --sizes 64 --iters 3000 \
      --rounds 3 --spin 50 --api handler --rows "raw,transport spin,channel spin" 2>&1 | ab_rows)
    echo "r$r | $v | $x"
  done
done
echo "# end $(date -u +%FT%TZ)"
