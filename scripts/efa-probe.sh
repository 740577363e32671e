#!/bin/bash
# Where a 64 B round trip of the efa `transport spin` row goes on each side: builds a probe
# binary (this tree with scripts/efa-probe.patch applied, in a scratch worktree; the probe is
# not part of the library) that, with AP_PROBE=1, prints every 3000 messages per thread the
# median and p90 of: the CQ completion of a control receive to the handler's call ("cq->handler":
# the spinner's pass handing the end over, the reader task's turn, poll_read, the descriptor's
# decoding), the handler's call to the reply's `fi_tinject` returning ("handler->inject done"),
# the `fi_tinject` call alone ("inject"; the raw inject row's calls print as "inject alone"),
# and the interval between the spinner's CQ passes.
# Build: bash scripts/efa-probe.sh build OUT (writes OUT/probe; needs libfabric-dev).
# Run:   AP_PROBE=1 OUT/probe bench efa --providers 'tcp;ofi_rxm' --sizes 64 --iters 3000 \
#          --rounds 2 --spin 50 --api handler --rows "raw,raw inject,transport spin"
set -eu
[ "${1:-}" = build ] || { sed -n 2,12p "$0"; exit 2; }
out=$(realpath -m "${2:?usage: efa-probe.sh build OUT}")
root=$(cd "$(dirname "$0")/.." && pwd)
tree=$(mktemp -d /tmp/efa-probe.XXXXXX)
git -C "$root" worktree add --detach "$tree" HEAD >/dev/null
trap 'git -C "$root" worktree remove --force "$tree"' EXIT
git -C "$tree" apply "$root/scripts/efa-probe.patch"
CARGO_TARGET_DIR="$root/target/efa-probe" cargo build --release --features efa --bin actorpipe \
  --manifest-path "$tree/Cargo.toml"
mkdir -p "$out"
cp "$root/target/efa-probe/release/actorpipe" "$out/probe"
echo "$out/probe"
