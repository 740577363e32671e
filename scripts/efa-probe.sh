#!/bin/bash
# Where a 64 B round trip of the efa rows goes on each side: builds a probe binary (this tree
# with scripts/efa-probe.patch applied, by scripts/build-patched.sh; the probe is not part of
# the library) that, with AP_PROBE=1, prints every 3000 injects per thread the median and p90
# of: "arrival->cq read returned", from the peer thread's `fi_tinject` returning (both sides
# are threads of one process: one clock) to the CQ read that returned the message (how soon it
# was noticed, and the read itself); "->handler", from there to the pipe's handler (none in the
# raw rows); "->inject start", from there to the reply's `fi_tinject` call; "inject", that call.
# In the raw rows the same hooks sit in the same binding (`Endpoint::poll`, `Endpoint::tinject`),
# so `raw inject` and `transport spin` split alike. Then, from the same CQ read, the marks on a
# pipe's way: "read" (the stream reader hands the bytes over), "catch" (the read loop hands the
# decoded frame to the catcher), "take" (the catcher builds the message; the handler follows),
# "send" (the stream writer's `send` starts, inside the handler's write). Since 2026-11-27's
# ninth session; before, it printed spans from the engine's progress pass.
# Build: bash scripts/efa-probe.sh build OUT (writes OUT/probe; needs libfabric-dev).
# Run:   AP_PROBE=1 OUT/probe bench efa --providers 'tcp;ofi_rxm' --sizes 64 --iters 3000 \
#          --rounds 2 --spin 50 --api handler --rows "raw,raw inject,transport spin"
set -eu
[ "${1:-}" = build ] || { sed -n 2,17p "$0"; exit 2; }
exec bash "$(dirname "$0")/build-patched.sh" "$(dirname "$0")/efa-probe.patch" \
  "${2:?usage: efa-probe.sh build OUT}" probe
