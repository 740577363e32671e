#!/bin/bash
# In-place tensors of 64 B to 64 KiB on the efa channel (docs/efa-measurements.md, "A reader's
# burst only in a quick exchange"): per run, binary and provider, `bench efa --sizes
# 64,4K,16K,64K --spin 50 --api handler --rows "raw,channel spin,in-place spin"`, on `shm`,
# `tcp;ofi_rxm`, and `tcp;ofi_rxm` with rxm's passthru (`tcp;ofi_rxm+pass`, where the efa
# channel waits for each receive: a rendezvous). One line per run, binary and provider:
# `rRUN | VARIANT PROVIDER | provider size row p50 ratio GB/s;...`.
# Run: bash scripts/ab-efa-burst.sh DIR (holding the `new` and `hot` binaries); RUNS=N
# (default 3); VARIANTS="a b" other binaries of DIR. About 2.5 s a run, binary and provider
# on a 16-core machine. Then: bash scripts/ab-efa-burst.sh --summary FILE (median p50 of each
# row, per variant).
if [ "${1:-}" = "--summary" ]; then
  PYTHONPATH="$(dirname "$0")" python3 - "${2:?usage: ab-efa-burst.sh --summary FILE}" <<'PY'
import collections, re, statistics as st, sys
from ab_runs import runs
rows = collections.defaultdict(list)
variants, lines = runs(sys.argv[1])
for v, p, x in lines:
    for m in re.finditer(r"(?:shm|tcp;ofi_rxm) (\S+) (raw|channel spin|in-place spin) ([\d.]+) µs", x):
        rows[(p, m[1], m[2])].append((v, float(m[3])))
print("provider          size   row            " + "  ".join(f"{v:>8}" for v in variants))
for (p, size, row), vals in rows.items():
    cells = [st.median([x for w, x in vals if w == v] or [float("nan")]) for v in variants]
    print(f"{p:17} {size:6} {row:14} " + "  ".join(f"{c:8.2f}" for c in cells))
PY
  exit
fi
. "$(dirname "${BASH_SOURCE[0]}")/ab-lib.sh"
ab_start "${1:-}" ab-efa-burst.sh
one() {
  local v=$1 p=$2 r=$3 e=(AP_NONE=1) q=$2 x
  if [ "$p" = 'tcp;ofi_rxm+pass' ]; then
    e=(FI_OFI_RXM_ENABLE_PASSTHRU=1)
    q='tcp;ofi_rxm'
  fi
  x=$(env "${e[@]}" "./$v" bench efa --providers "$q" --sizes 64,4K,16K,64K --iters 1000 \
    --rounds 2 --spin 50 --api handler --rows "raw,channel spin,in-place spin" 2>&1 |
    grep -E ' (64 B|4 KiB|16 KiB|64 KiB) ' |
    awk '{s = $1 " " $2 $3; for (i = 4; i <= NF; i++) s = s " " $i; print s}' | tr '\n' ';')
  echo "r$r | $v $p | $x"
}
ab_each "new hot" one shm 'tcp;ofi_rxm' 'tcp;ofi_rxm+pass'
