#!/usr/bin/env bash
# Instructions per iteration, per process and per function, counted by valgrind's callgrind:
# a deterministic count that needs no hardware counter (neither our VM nor the GPU machine has
# one). It runs the command twice, with --iters N and --iters 2N, and divides the difference by
# N, so start-up and tear-down cancel out.
#
#   scripts/count-instructions.sh [-n N] [-t TOP] -- BIN bench ARGS...   (ARGS without --iters)
#
# e.g. scripts/count-instructions.sh -n 10000 -- target/release/actorpipe bench transport \
#        --backend tcp --sizes 64 --warmup 0 --rounds 1 --no-baseline --api standing
#      scripts/count-instructions.sh -n 10000 -- target/release/actorpipe bench layers \
#        --transport tcp --layers actor --warmup 0 --rounds 1
# `bench transport` prints two processes (the client, and the server it started); a round trip
# is one iteration. Read the echo (server) process: the client's total also holds the timed
# calibrations of the report (the memcpy column, the core-to-core line), which do not scale with
# the iterations. Needs valgrind and python3 (callgrind_annotate comes with valgrind).
set -euo pipefail
n=10000 top=25
while [ $# -gt 0 ]; do
  case "$1" in
    -n) n=$2; shift 2 ;;
    -t) top=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "usage: $0 [-n N] [-t TOP] -- BIN bench ARGS..." >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "usage: $0 [-n N] [-t TOP] -- BIN bench ARGS..." >&2; exit 2; }
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
for k in 1 2; do
  mkdir -p "$dir/$k"
  # Fair scheduling: with valgrind's default, thread interleaving (how often a read finds
  # nothing) varies from run to run, and so do the counts.
  valgrind --tool=callgrind --fair-sched=yes --trace-children=yes \
    --callgrind-out-file="$dir/$k/cg.%p" \
    "$@" --iters $((k * n)) > "$dir/$k/log" 2>&1 || { tail -20 "$dir/$k/log" >&2; exit 1; }
done
PYTHONPATH="$(dirname "$0")" python3 - "$dir" "$n" "$top" <<'PY'
import collections, glob, re, sys
from callgrind_counts import command, functions
d, n, top = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

def load(path):
    """(command, total, {function: exclusive instructions}) of one callgrind file."""
    return (command(path), *functions(path))

def key(cmd):
    # The same process of both runs: its command without the iteration count.
    return re.sub(r"--iters \d+|--shm-fds [\d,]+", "", cmd)

# Areas, first match wins: a rough map of where a message's instructions go.
AREAS = [
    ("malloc and free", r"^(malloc|free|_int_free|_int_malloc|__rustc::__r|alloc::raw_vec|cfree)"),
    ("actorpipe: read loop (stream/read.rs, select!, liveness, sequencer)",
     r"actorpipe::transport::stream::(read|Sequencer|Halt|next_op)|stream::Halt|poll_fn::PollFn"
     r"|actorpipe::transport::liveness"),
    ("actorpipe: PipeWriter and parking", r"actorpipe::actors::pipe::writer|stream::parking"),
    ("actorpipe: wire encode/decode (MessagePack)", r"actorpipe::wire|^rmp::"),
    ("actorpipe: catch (standing receive, parked Receive)", r"actorpipe::actors::pipe::catch"),
    ("actorpipe: metrics", r"actorpipe::metrics|^metrics::"),
    ("actorpipe: other", r"actorpipe::"),
    ("tokio: timer wheel", r"tokio::runtime::time|tokio::time::"),
    ("tokio: I/O readiness and reads/writes", r"tokio::runtime::io|tokio::io::|^mio::|tokio::net"),
    ("tokio: scheduling", r"tokio::runtime::(task|scheduler|context|metrics|driver)|tokio::task::"
     r"|LocalKey|atomic_waker|Coop"),
    ("actix", r"^<?actix"),
    ("clock reads", r"Timespec|Instant|clock_gettime"),
    ("memcpy", r"memcpy|memmove|memset"),
]

runs = [{key(c): (c, t, f) for c, t, f in map(load, glob.glob(f"{d}/{k}/cg.*"))} for k in (1, 2)]
for k in sorted(runs[0]):
    if k not in runs[1]:
        continue
    (c, t1, f1), (_, t2, f2) = runs[0][k], runs[1][k]
    print(f"## {c}\n\ninstructions per iteration: {(t2 - t1) / n:.0f}\n")
    diff = sorted(((f2[x] - f1[x]) / n, x) for x in set(f1) | set(f2))
    for v, x in sorted(diff, reverse=True)[:top]:
        print(f"{v:9.1f}  {x[:150]}")
    areas = collections.Counter()
    for v, x in diff:
        area = next((a for a, p in AREAS if re.search(p, x)), "everything else")
        areas[area] += v
    print("\nby area:")
    for a, v in areas.most_common():
        print(f"{v:9.0f}  {a}")
    print()
PY
