#!/bin/bash
# Issue 12's 64 B rows with the efa stream's credits as remote CQ data, and with rxm's passthru
# on (docs/efa-measurements.md, "rxm's passthru, usable"): builds and switches rotated, which
# goes first changing from run to run. A variant is a binary of DIR (`old`: credits on the
# tags; `new`: credits as CQ data), or a binary with `+pass` after its name: the same with
# FI_OFI_RXM_ENABLE_PASSTHRU=1, so that the raw ping-pong it is compared with runs on the same
# path. Per run and variant: `bench efa --sizes 64 --spin 50 --api handler` (tcp;ofi_rxm only
# for `+pass`: the switch does not touch shm). Then, per run, the `new+pass` and `new` efa
# channel at 64 KiB (an in-place tensor: under passthru each waits for the peer's receive) and
# 64 MiB, against the raw ping-pong.
# Run: bash scripts/ab-efa-passthru-pipes.sh DIR; RUNS=N (default 12); VARIANTS="a b+pass ..."
# (default "old new new+pass"); BIG=0 leaves out the 64 KiB / 64 MiB rows. Summaries:
# python3 scripts/ab-efa-paired.py FILE old (the 64 B rows), and grep 'big' FILE.
. "$(dirname "${BASH_SOURCE[0]}")/ab-lib.sh"
ab_start "${1:-}" ab-efa-passthru-pipes.sh
read -r -a variants <<<"${VARIANTS:-old new new+pass}"
k=${#variants[@]}
# The variant's binary and environment.
run_as() {
  local v=$1
  shift
  if [ "${v%+pass}" != "$v" ]; then
    env FI_OFI_RXM_ENABLE_PASSTHRU=1 "./${v%+pass}" "$@"
  else
    "./$v" "$@"
  fi
}
for r in $(seq 1 "${RUNS:-12}"); do
  for j in $(seq 0 $((k - 1))); do
    v=${variants[$(((r + j) % k))]}
    p=(--providers 'tcp;ofi_rxm,shm')
    [ "${v%+pass}" != "$v" ] && p=(--providers 'tcp;ofi_rxm')
    x=$(run_as "$v" bench efa "${p[@]}" --sizes 64 --iters 3000 --rounds 3 --spin 50 \
      --api handler --rows "raw,transport spin,channel spin" 2>&1 | ab_rows)
    echo "r$r | $v handler | $x"
  done
  if [ "${BIG:-1}" = 1 ]; then
    for v in new new+pass; do
      x=$(run_as "$v" bench efa --providers 'tcp;ofi_rxm' --sizes 64K,64M --rounds 2 \
        --rows "raw,channel" 2>&1 | grep -E ' 64 (KiB|MiB) ' |
        awk '{s = $1 " " $2 $3; for (i = 4; i <= NF; i++) s = s " " $i; print s}' | tr '\n' ';')
      echo "r$r | $v big | $x"
    done
  fi
done
echo "# end $(date -u +%FT%TZ)"
