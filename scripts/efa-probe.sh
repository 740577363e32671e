#!/bin/bash
# Where a 64 B round trip of the efa `transport spin` row goes on each side: builds a probe
# binary (this tree with scripts/efa-probe.patch applied, by scripts/build-patched.sh; the probe
# is not part of the library) that, with AP_PROBE=1, prints every 3000 messages per thread the
# median and p90 of: the CQ pass that found a completion to the handler's call ("cq->handler":
# since 2026-11-27's fifth session usually the reader's own pass, then poll_read and the
# descriptor's decoding; before, the spin task's pass handing the end over and the reader task's
# turn too), the handler's call to the reply's `fi_tinject` returning ("handler->inject done"),
# the `fi_tinject` call alone ("inject"; the raw inject row's calls print as "inject alone"),
# and the interval between CQ passes on the thread (the spin task's and the readers').
# Build: bash scripts/efa-probe.sh build OUT (writes OUT/probe; needs libfabric-dev).
# Run:   AP_PROBE=1 OUT/probe bench efa --providers 'tcp;ofi_rxm' --sizes 64 --iters 3000 \
#          --rounds 2 --spin 50 --api handler --rows "raw,raw inject,transport spin"
set -eu
[ "${1:-}" = build ] || { sed -n 2,12p "$0"; exit 2; }
exec bash "$(dirname "$0")/build-patched.sh" "$(dirname "$0")/efa-probe.patch" \
  "${2:?usage: efa-probe.sh build OUT}" probe
