#!/usr/bin/env bash
# Runs the transport, channel, pipe, idle and copy benchmarks of docs/performance.md, one after
# the other, and prints the tables (Markdown) as they come. Run it on an idle machine:
#
#   bash scripts/bench-all.sh | tee bench.md
#
# Each table's header repeats its exact command line, machine and time, so a row in the doc can
# be traced back to the command that printed it.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --bin actorpipe >&2
B=target/release/actorpipe

run() {
    echo
    echo "\$ actorpipe $*"
    "$B" "$@" 2>/dev/null
}

run bench transport --backend tcp
run bench transport --backend shm
run bench transport --backend shm --spin 20
run bench transport --backend shm --spin 20 --pin
run bench channel --backend basic
run bench channel --backend basic --transport shm
run bench channel --backend mpt
run bench channel --backend cma
run bench channel --backend xth
run bench pipe
run bench pipe --backend tcp+basic
run bench transport --backend tcp --sizes 64 --iters 20000
run bench transport --backend tcp --sizes 64 --iters 20000 --api fired
run bench transport --backend shm --sizes 64 --iters 20000
run bench transport --backend shm --spin 20 --pin --sizes 64 --iters 20000 --api fired
# The small-message rows with a standing receive's handler (`--api handler`) and with its
# recipient actor (`--api standing`).
for api in handler standing; do
    run bench transport --backend shm --spin 20 --sizes 64 --rounds 5 --api "$api"
    run bench transport --backend tcp --sizes 64 --rounds 5 --api "$api"
    run bench transport --backend shm --sizes 64 --rounds 5 --api "$api"
done
run bench pipe --sizes 1M,64M --iters 1000
run bench channel --backend basic --sizes 64M --iters 40
run bench idle --pipes 1000
run bench copy --threads 1,2,4,8
