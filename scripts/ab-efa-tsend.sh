#!/bin/bash
# Issue 12's tcp rows with the stream's 96-byte messages injected (rxm emulates injects over 64
# bytes: base), posted with fi_tsend (posted: AP_EXP_INJECT_MAX=64) or sent with fi_tsend from a
# ring (direct: AP_EXP_DIRECT_TSEND=64), one binary of scripts/experiments.patch, rotated; and
# the raw ping-pong at 96 B, tsend against inject, in each run (docs/efa-measurements.md, "Above
# 64 B on `tcp;ofi_rxm`"). Build: bash scripts/build-patched.sh scripts/experiments.patch DIR exp;
# run: RUNS=N bash scripts/ab-efa-tsend.sh DIR (default 30; about 6 s a run on 16 cores).
set -u
cd "${1:?usage: ab-efa-tsend.sh DIR (holding the exp binary)}" || exit 1
echo "# host $(hostname) cores $(nproc) $(date -u +%FT%TZ) load $(cut -d' ' -f1 /proc/loadavg)"
vs=(base posted direct)
for r in $(seq 1 "${RUNS:-30}"); do
  for j in 0 1 2; do
    v=${vs[$(((r + j) % 3))]}
    case $v in
      base) e=() ;;
      posted) e=(AP_EXP_INJECT_MAX=64) ;;
      direct) e=(AP_EXP_DIRECT_TSEND=64) ;;
    esac
    x=$(env "${e[@]}" ./exp bench efa --providers 'tcp;ofi_rxm' --sizes 64 --iters 3000 \
      --rounds 3 --spin 50 --api handler --rows "raw,transport spin,channel spin" 2>&1 |
      grep ' 64 B ' | sed 's/^tcp;ofi_rxm *64 B *//' | tr -s ' ' | tr '\n' ';')
    echo "r$r | $v | $x"
  done
  x=$(./exp bench efa --providers 'tcp;ofi_rxm' --sizes 96 --iters 3000 --rounds 3 \
    --rows "raw,raw inject" 2>&1 | grep ' 96 B ' | sed 's/^tcp;ofi_rxm *96 B *//' | tr -s ' ' | tr '\n' ';')
  echo "r$r | raw96 | $x"
done
echo "# end $(date -u +%FT%TZ)"
