#!/bin/sh
# Builds and runs scripts/shm-stall.c against the installed libfabric: the shm provider's send
# completions behind a silent or dead peer, per size and mode, and its fi_av_remove reuse
# (docs/efa.md, "A dead peer's sends on `shm`"). Needs a C compiler and libfabric-dev.
set -eu
here=$(dirname "$0")
bin=${TMPDIR:-/tmp}/shm-stall.$$
trap 'rm -f "$bin"' EXIT
# shellcheck disable=SC2046
cc -O1 -o "$bin" "$here/shm-stall.c" $(pkg-config --cflags --libs libfabric)
echo "libfabric $(pkg-config --modversion libfabric)"
for size in 64 4096 4097 8192 65536 1048576; do
	for mode in kill alive split; do
		timeout 60 "$bin" stall "$size" "$mode" || echo "$size $mode: exit $?"
	done
done
for mode in kill split; do
	FI_SHM_DISABLE_CMA=1 timeout 60 "$bin" stall 65536 "$mode" || echo "65536 $mode, cma off: exit $?"
done
timeout 30 "$bin" reuse || echo "reuse: exit $?"
timeout 30 "$bin" reuse split || echo "reuse split: exit $? (the new peer crashed reading the misaddressed send)"
