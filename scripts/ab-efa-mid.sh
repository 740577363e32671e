#!/bin/bash
# Tensors between issue 12's two sizes (docs/efa-measurements.md, "Between 64 B and 64 MiB"):
# per run, binary and provider, `bench efa --sizes 16K,64K,256K,1M,4M,16M --api receive --spin 50
# --rows "raw,transport,channel,channel spin"` (the default iterations: 256 MiB a row, from 20 to
# 10,000 round trips). One line per run, binary and provider:
# `rRUN | VARIANT PROVIDER | provider size row p50 ratio GB/s;...`.
# Run: bash scripts/ab-efa-mid.sh DIR (holding the `old` and `new` binaries); RUNS=N (default
# 3); VARIANTS="a b" other binaries of DIR. About 6 s a run, binary and provider on a 16-core
# machine. Then: bash scripts/ab-efa-mid.sh --summary FILE (median p50 and ratio to the same
# run's raw row, per variant).
if [ "${1:-}" = "--summary" ]; then
  PYTHONPATH="$(dirname "$0")" python3 - "${2:?usage: ab-efa-mid.sh --summary FILE}" <<'PY'
import collections, re, statistics as st, sys
from ab_runs import runs
rows = collections.defaultdict(list)
variants, lines = runs(sys.argv[1])
unit = {"µs": 1.0, "ms": 1000.0, "s": 1e6}
for v, p, x in lines:
    for m in re.finditer(r"(?:shm|tcp;ofi_rxm) (\S+ \S+) (raw|transport|channel|channel spin) ([\d.]+) (µs|ms|s) ([\d.]+)", x):
        rows[(p, m[1], m[2])].append((v, float(m[3]) * unit[m[4]], float(m[5])))
print("provider     size     row            " + "  ".join(f"{v + ' p50 µs':>14} {'ratio':>6}" for v in variants))
for (p, size, row), vals in rows.items():
    cells = []
    for v in variants:
        mine = [(t, r) for w, t, r in vals if w == v]
        if not mine:
            cells.append(f"{'-':>14} {'-':>6}")
            continue
        cells.append(f"{st.median(t for t, _ in mine):14.1f} {st.median(r for _, r in mine):6.2f}")
    print(f"{p:12} {size:8} {row:14} " + "  ".join(cells))
PY
  exit
fi
. "$(dirname "${BASH_SOURCE[0]}")/ab-lib.sh"
ab_start "${1:-}" ab-efa-mid.sh
one() {
  local v=$1 p=$2 r=$3 x
  x=$("./$v" bench efa --providers "$p" --sizes 16K,64K,256K,1M,4M,16M --rounds 1 --spin 50 \
    --api receive --rows "raw,transport,channel,channel spin" 2>&1 |
    grep -E ' (16|64|256) KiB | (1|4|16) MiB ' |
    awk '{s = $1 " " $2 " " $3; for (i = 4; i <= NF; i++) s = s " " $i; print s}' | tr '\n' ';')
  echo "r$r | $v $p | $x"
}
ab_each "old new" one shm 'tcp;ofi_rxm'
