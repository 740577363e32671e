#!/bin/bash
# cma reads of 1 MiB and more between two processes of one host, two builds alternating: the cma
# channel over tcp (every tensor above 256 KiB read by cma) and the default pipe above 64 MiB
# (shm, large tensors read by cma). Output on stdout, one `### BUILD ROW run K` line before each
# table's rows.
# Run: bash scripts/ab-cma-readers.sh OLD_BINARY NEW_BINARY; RUNS=N (3).
. "$(dirname "${BASH_SOURCE[0]}")/ab-lib.sh"
OLD=${1:?usage: ab-cma-readers.sh OLD NEW}
NEW=${2:?usage: ab-cma-readers.sh OLD NEW}
set -u
ab_header
for k in $(seq 1 "${RUNS:-3}"); do
  for b in old new; do
    B=$OLD
    [ "$b" = new ] && B=$NEW
    echo "### $b cma-over-tcp run $k"
    "$B" bench channel --backend cma --transport tcp --sizes 1M,2M,4M,8M,16M,64M --rounds 3 \
      2>/dev/null | grep -E '^\| [0-9]'
    echo "### $b default-pipe run $k"
    "$B" bench pipe --sizes 128M,256M --rounds 3 2>/dev/null | grep -E '^\| [0-9]'
  done
done
echo "# end $(date -u +%FT%TZ)"
