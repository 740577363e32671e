#!/bin/bash
# The raw `tcp;ofi_rxm` ping-pongs (posted and injected sends, 64 and 96 B) with rxm's passthru
# off and on (FI_OFI_RXM_ENABLE_PASSTHRU=1: rxm hands tagged calls to the tcp provider's own
# RDM endpoint, whose inject size is 128 bytes, not 64), alternating: whether the switch would
# be worth having were it usable (libfabric 1.17 reports every received tag as 0 with it, so
# the efa streams refuse it; docs/efa.md, "Providers").
# Run: RUNS=N bash scripts/ab-efa-passthru.sh DIR (DIR holds an `actorpipe` built with
# --features efa as `exp` or `new`; default 12 runs, about 4 s each).
# Then: bash scripts/ab-efa-passthru.sh --summary FILE (median p50 per row and switch, and the
# paired difference on - off: mean, twice its standard error, runs lower).
if [ "${1:-}" = "--summary" ]; then
  python3 - "${2:?usage: ab-efa-passthru.sh --summary FILE}" <<'PY'
import re, statistics as st, sys
rows = {}
for line in open(sys.argv[1]):
    if not line.startswith("r"):
        continue
    _, v, x = [s.strip() for s in line.split("|")]
    for item in x.split(";"):
        m = re.match(r"(\S+) (raw(?: inject)?) ([\d.]+) µs", item.strip())
        if m:
            rows.setdefault((m[1], m[2], v), []).append(float(m[3]))
for size, row in sorted({(k[0], k[1]) for k in rows}):
    on, off = rows[(size, row, "on")], rows[(size, row, "off")]
    d = [a - b for a, b in zip(on, off)]
    print(f"{size} {row:10} off {st.median(off):6.2f} µs on {st.median(on):6.2f} µs  "
          f"on - off {st.mean(d):+.2f} ±{2 * st.stdev(d) / len(d) ** 0.5:.2f}, "
          f"lower in {sum(x < 0 for x in d)}/{len(d)}")
PY
  exit
fi
. "$(dirname "$0")/ab-lib.sh"
ab_start "${1:-}" ab-efa-passthru.sh
bin=exp
[ -x ./exp ] || bin=new
for r in $(seq 1 "${RUNS:-12}"); do
  for v in off on; do
    e=(AP_NONE=1)
    [ "$v" = on ] && e=(FI_OFI_RXM_ENABLE_PASSTHRU=1)
    x=$(env "${e[@]}" ./$bin bench efa --providers 'tcp;ofi_rxm' --sizes 64,96 --iters 3000 \
      --rounds 1 --rows "raw,raw inject" 2>&1 | grep -E ' (64|96) B ' |
      awk '{s = $2 $3; for (i = 4; i <= NF; i++) s = s " " $i; print s}' | tr '\n' ';')
    echo "r$r | $v | $x"
  done
done
echo "# end $(date -u +%FT%TZ)"
