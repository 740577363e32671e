#!/bin/bash
# Builds `actorpipe` (release, feature efa) from this tree's HEAD with PATCH applied, in a scratch
# worktree, and copies it to OUT/NAME: the measured experiments whose code is not part of the
# library (scripts/efa-probe.patch, scripts/experiments.patch) are rebuilt this way.
# Run: bash scripts/build-patched.sh PATCH OUT NAME (needs libfabric-dev).
set -eu
patch=$(realpath "${1:?usage: build-patched.sh PATCH OUT NAME}")
out=$(realpath -m "${2:?usage: build-patched.sh PATCH OUT NAME}")
name=${3:?usage: build-patched.sh PATCH OUT NAME}
root=$(cd "$(dirname "$0")/.." && pwd)
tree=$(mktemp -d /tmp/actorpipe-patched.XXXXXX)
git -C "$root" worktree add --detach "$tree" HEAD >/dev/null
trap 'git -C "$root" worktree remove --force "$tree"' EXIT
git -C "$tree" apply "$patch"
CARGO_TARGET_DIR="$root/target/patched" cargo build --release --features efa --bin actorpipe \
  --manifest-path "$tree/Cargo.toml"
mkdir -p "$out"
cp "$root/target/patched/release/actorpipe" "$out/$name"
echo "$out/$name"
