#!/bin/bash
# Small messages with tensors, two builds alternating: the rows that a message cut from the
# bytes read with its frame moves (`catch::cut`), all with a handler (`--api handler`): a lone
# 64 B tensor over tcp (`bench channel --backend basic`), a 64 B payload with a 64 B tensor
# between two processes (`bench pipe`: shm with cma's inline tensors), the same spinning, and
# issue 12's efa rows (one 64 B tensor a message, inline on the control stream). Output on
# stdout, one `### BUILD ROW RUN` line before each row or table; the binaries need feature efa.
# Run: bash scripts/ab-frame-cut.sh DIR (holding `old` and `new`); RUNS=N (default 4).
. "$(dirname "${BASH_SOURCE[0]}")/ab-lib.sh"
ab_start "${1:-}" ab-frame-cut.sh
for k in $(seq 1 "${RUNS:-4}"); do
  for b in old new; do
    echo "### $b channel-basic-tcp $k"
    ./$b bench channel --backend basic --transport tcp --sizes 64 --rounds 5 --api handler | grep -E '^\| 64 B'
    echo "### $b pipe $k"
    ./$b bench pipe --sizes 64 --rounds 5 --api handler | grep -E '^\| 64 B'
    echo "### $b pipe-spin $k"
    ./$b bench pipe --sizes 64 --rounds 5 --api handler --spin 20 | grep -E '^\| 64 B'
    ab_efa_row "$b" "$k"
  done
done
echo "# end $(date -u +%FT%TZ)"
