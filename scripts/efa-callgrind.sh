#!/bin/bash
# Instructions per 64 B round trip of `actorpipe bench efa` rows, counted by valgrind's
# callgrind (the 2-core VM has no hardware counters): each row alone (`--rows`), at
# --iters 2000 and 4000, the two totals subtracted and divided by the 2200 round trips between
# them (the bench adds a tenth of --iters as warm-up), with the functions whose exclusive
# counts moved most. `--fair-sched=yes`: with valgrind's default lock the two bench threads'
# interleaving, and so the number of CQ reads and fd waits per round trip, varied from run to
# run (the same binary's `transport` row measured 79 and 88 thousand; with it, 85.5 and 85.6).
# Rows that spin (`raw`, `... spin`) count their spin loops: read those as upper bounds.
# Run: bash scripts/efa-callgrind.sh BIN OUTDIR [ROW...] (default rows: transport channel raw;
# PROVIDER overrides 'tcp;ofi_rxm', API picks `--api`, SPIN adds `--spin US` for the `... spin`
# rows). About 2 minutes for the default rows on the 2-core VM. Each row also prints the C
# allocator's calls (malloc, calloc, realloc) per round trip, by caller.
# Then: bash scripts/efa-callgrind.sh --compare OLDDIR NEWDIR [ROW...]: the two runs' counts
# per round trip side by side, per function (exclusive), those that moved most first.
set -u
if [ "${1:-}" = "--compare" ]; then
  old=${2:?usage: efa-callgrind.sh --compare OLDDIR NEWDIR [ROW...]}
  new=${3:?usage: efa-callgrind.sh --compare OLDDIR NEWDIR [ROW...]}
  shift 3
  rows=("$@")
  [ ${#rows[@]} -eq 0 ] && rows=(transport channel)
  for row in "${rows[@]}"; do
    PYTHONPATH="$(dirname "$0")" python3 - "$old" "$new" "$row" <<'EOF'
import sys
from callgrind_counts import functions

old, new, row = sys.argv[1:4]
trips = 2200
per = []
for d in (old, new):
    (_, a), (_, b) = functions(f"{d}/{row}-4000.cg"), functions(f"{d}/{row}-2000.cg")
    per.append({k: (a[k] - b[k]) / trips for k in set(a) | set(b)})
keys = set(per[0]) | set(per[1])
total = [sum(p.values()) for p in per]
print(f"## {row}: per round trip: old, new, new - old ({old} -> {new})")
print(f"{total[0]:9.0f} {total[1]:9.0f} {total[1] - total[0]:9.0f}  (all functions)")
for k in sorted(keys, key=lambda k: -abs(per[1].get(k, 0) - per[0].get(k, 0)))[:40]:
    o, n = per[0].get(k, 0), per[1].get(k, 0)
    print(f"{o:9.1f} {n:9.1f} {n - o:9.1f}  {k[:130]}")
EOF
  done
  exit 0
fi
bin=$(realpath "${1:?usage: efa-callgrind.sh BIN OUTDIR [ROW...]}")
out=${2:?usage: efa-callgrind.sh BIN OUTDIR [ROW...]}
shift 2
rows=("$@")
[ ${#rows[@]} -eq 0 ] && rows=(transport channel raw)
provider=${PROVIDER:-tcp;ofi_rxm}
mkdir -p "$out"
echo "# $(basename "$bin") $(date -u +%FT%TZ) load $(cut -d' ' -f1 /proc/loadavg) $(valgrind --version)"
for row in "${rows[@]}"; do
  for n in 2000 4000; do
    valgrind --tool=callgrind --fair-sched=yes --callgrind-out-file="$out/$row-$n.cg" \
      "$bin" bench efa --providers "$provider" --sizes 64 --iters $n --rounds 1 --rows "$row" \
      ${API:+--api "$API"} ${SPIN:+--spin "$SPIN"} >"$out/$row-$n.log" 2>&1
  done
  PYTHONPATH="$(dirname "$0")" python3 - "$out/$row-4000.cg" "$out/$row-2000.cg" "$row" <<'EOF'
import sys
from callgrind_counts import ALLOCATORS, RUST_ALLOCATORS, allocator_calls, functions

big, small, row = sys.argv[1:4]
trips = 2200
(total_big, a), (total_small, b) = functions(big), functions(small)
print(f"## {row}: {(total_big - total_small) / trips:.0f} instructions per round trip")
moved = {k: (a[k] - b[k]) / trips for k in set(a) | set(b)}
for name, per in sorted(moved.items(), key=lambda kv: -abs(kv[1]))[:25]:
    print(f"{per:9.1f}  {name[:150]}")
ca, cb = allocator_calls(big), allocator_calls(small)
per = {k: (ca[k] - cb[k]) / trips for k in set(ca) | set(cb)}
c_calls = sum(n for (callee, _), n in per.items() if callee in ALLOCATORS)
print(f"## {row}: {c_calls:.2f} allocations per round trip (malloc, calloc, realloc); Rust's by caller:")
for (callee, caller), n in sorted(per.items(), key=lambda kv: -kv[1]):
    if callee in RUST_ALLOCATORS and abs(n) >= 0.05:
        print(f"{n:9.2f}  {callee} <- {caller[:130]}")
EOF
done
