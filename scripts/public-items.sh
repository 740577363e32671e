#!/usr/bin/env bash
# Counts the library's public API (every feature on): the names reachable from the crate root
# and their public members, from rustdoc's JSON output. Rustdoc's JSON is unstable, so this
# asks the stable toolchain for it with RUSTC_BOOTSTRAP=1 (the format checked is version 57,
# Rust 1.95). `-v` lists every name with its kind.
#
#   scripts/public-items.sh [-v]
set -euo pipefail
cd "$(dirname "$0")/.."
RUSTC_BOOTSTRAP=1 cargo rustdoc -q -p actorpipe --lib --all-features -- \
  -Z unstable-options --output-format json 2>/dev/null
python3 scripts/public-items.py target/doc/actorpipe.json "$@"
