#!/bin/bash
# Runs the test suites over and over, many copies at once, to shake out what one run on a quiet
# machine does not show: a hang (a run that outlives its time limit), an order or timing
# assumption that a loaded machine breaks, a leak that only a later test trips on.
#
# Build and pack here (the device machines have no Rust toolchain): stripped, gzipped copies of
# the named suites (`lib` is the library's unit tests) and of the binaries their trials start,
# built with .ci/run's profile:
#   bash scripts/stress-suites.sh pack .dev/stress SUITE...
# Run there (device call, carry [".dev/stress"]):
#   bash scripts/stress-suites.sh run .dev/stress [SECONDS]
# Env for `run`: WORKERS (copies at once; default the core count / 4), LIMIT (seconds a run may
# take before it counts as hung; 240), SUITES (which to run, in rotation; default every packed
# suite), OUT (where stress.log goes; $OUT on the device). A hung run's processes, threads and,
# where gdb or cuda-gdb is installed, stacks go to the log before it is killed.
# Each worker takes the suites in turn, so every suite runs about as often; a run that fails or
# hangs has its failing tests and panics written to stress.log as soon as it ends. Ends with a
# table: runs, passed, failed, hung, per suite. A run started just before SECONDS are up may
# still take LIMIT, and a hung one the debugger's time on top (up to 2 minutes a process): give
# the device call SECONDS + LIMIT + 3 minutes.
set -u
cmd=${1:?usage: stress-suites.sh pack DIR SUITE... | run DIR [SECONDS]}
dir=${2:?a folder}
shift 2
case "$cmd" in
pack)
  mkdir -p "$dir"
  # cargo names each test binary: "Executable tests/efa.rs (target/debug/deps/efa-...)",
  # "Executable tests/integration/main.rs (...)", "Executable unittests src/lib.rs (...)" (the
  # suite `lib`).
  # The profile of .ci/run, so that a tree built by it (or by the line above) is not rebuilt.
  built=$(CARGO_INCREMENTAL=0 CARGO_PROFILE_DEV_DEBUG=line-tables-only \
    cargo test --all-features --no-run 2>&1 | grep -E "^ +Executable")
  for s in "$@"; do
    if [ "$s" = lib ]; then
      pat="unittests src/lib.rs"
    elif [ -f "tests/$s/main.rs" ]; then
      pat="tests/$s/main.rs"
    else
      pat="tests/$s.rs"
    fi
    bin=$(echo "$built" | grep -F " $pat (" | sed 's/.*(\(.*\))$/\1/')
    [ -n "$bin" ] || { echo "no test binary for $s" >&2; exit 1; }
    # Symbol tables kept (debug info dropped): a hung run's stacks then name their functions.
    strip --strip-debug -o "$dir/$s" "$bin" && gzip -f "$dir/$s"
  done
  # Trials that start other processes run these.
  strip -o "$dir/actorpipe-debug" target/debug/actorpipe && gzip -f "$dir/actorpipe-debug"
  strip -o "$dir/echo_peer" target/debug/examples/echo_peer && gzip -f "$dir/echo_peer"
  du -sh "$dir"
  ;;
run)
  secs=${1:-480}
  root=$(pwd)
  kit=$(cd "$dir" && pwd)
  mkdir -p target/debug/deps target/debug/examples /work
  # The suites look for fixtures and helper binaries under the path they were built at.
  [ "$root" = /work/main ] || ln -sfn "$root" /work/main
  suites=()
  for f in "$kit"/*.gz; do
    name=$(basename "$f" .gz)
    case "$name" in
    actorpipe-debug) zcat "$f" >target/debug/actorpipe && chmod +x target/debug/actorpipe ;;
    echo_peer) zcat "$f" >target/debug/examples/echo_peer && chmod +x target/debug/examples/echo_peer ;;
    *) zcat "$f" >target/debug/deps/"$name" && chmod +x target/debug/deps/"$name" && suites+=("$name") ;;
    esac
  done
  # SUITES="a b b": run only these, in this rotation (a name twice runs twice as often).
  [ -n "${SUITES:-}" ] && read -r -a suites <<<"$SUITES"
  cores=$(nproc)
  workers=${WORKERS:-$((cores / 4 > 0 ? cores / 4 : 1))}
  limit=${LIMIT:-240}
  out=${OUT:-/tmp}
  log="$out/stress.log"
  res=$(mktemp -d)
  end=$(($(date +%s) + secs))
  gdb=$(command -v gdb || command -v cuda-gdb || true)
  echo "stress: ${suites[*]}; $workers copies at once on $cores cores, $secs s, a run hung after $limit s" | tee "$log"
  uptime | tee -a "$log"
  # What a hung run is doing: its processes (the suite and the peers it started), each thread's
  # kernel wait, and, where a debugger is installed, every thread's stack (the packed suites
  # keep their symbol tables for this).
  diagnose() {
    local pid=$1 kid t
    echo "--- hung: processes"
    ps -e -o pid,ppid,stat,etime,wchan:28,args | awk -v p="$pid" 'NR == 1 || $1 == p || $2 == p'
    for kid in $pid $(pgrep -P "$pid"); do
      echo "--- threads of $kid: name, state, kernel wait (count)"
      for t in /proc/"$kid"/task/*; do
        echo "$(cat "$t"/comm 2>/dev/null) $(awk '{print $3}' "$t"/stat 2>/dev/null) $(cat "$t"/wchan 2>/dev/null)"
      done | sort | uniq -c
      if [ -n "$gdb" ]; then
        echo "--- stacks of $kid"
        timeout 120 "$gdb" -batch -nx -p "$kid" -ex 'set pagination off' -ex 'thread apply all bt 40' 2>&1 |
          grep -E '^Thread|^#' | head -1500
      fi
    done
  }
  worker() {
    local w=$1 i=$1 s o rc t0 pid hung
    while [ "$(date +%s)" -lt "$end" ]; do
      s=${suites[$((i % ${#suites[@]}))]}
      i=$((i + 1))
      o="$res/$w-$i.out"
      t0=$(date +%s%N)
      (cd /work/main && exec target/debug/deps/"$s" >"$o" 2>&1) &
      pid=$!
      hung=0
      while kill -0 "$pid" 2>/dev/null; do
        if [ $((($(date +%s%N) - t0) / 1000000000)) -ge "$limit" ] && [ $hung = 0 ]; then
          hung=1
          diagnose "$pid" >"$o.diag" 2>&1
          pkill -KILL -P "$pid"
          kill -KILL "$pid"
        fi
        sleep 1
      done
      wait "$pid"
      rc=$?
      [ $hung = 1 ] && rc=137
      echo "$s $rc $((($(date +%s%N) - t0) / 1000000))" >>"$res/w$w"
      if [ $rc -ne 0 ]; then
        {
          echo "### $s: worker $w run $i exited $rc ($([ $hung = 1 ] && echo hung || echo failed))"
          grep -E "^test .*(FAILED|failed)|panicked|^failures:|^    [a-z_:]+$|Error|error" "$o" | head -40
          echo "--- last lines"
          tail -25 "$o"
          [ -f "$o.diag" ] && cat "$o.diag"
        } >"$res/fail-$w-$i"
        # Into the log at once: a call cut short by its own limit still brings back what failed.
        cat "$res/fail-$w-$i" >>"$log"
      else
        rm -f "$o"
      fi
    done
  }
  for w in $(seq 0 $((workers - 1))); do worker "$w" & done
  wait
  echo "## per suite: runs passed failed hung, seconds a run (median)" | tee -a "$log"
  cat "$res"/w* | python3 -c '
import sys, statistics
runs = {}
for line in sys.stdin:
    s, rc, ms = line.split()
    runs.setdefault(s, []).append((int(rc), int(ms) / 1000))
for s in sorted(runs):
    r = runs[s]
    ok = sum(rc == 0 for rc, _ in r)
    hung = sum(rc == 137 for rc, _ in r)
    print(f"{s:16} {len(r):4} {ok:4} {len(r) - ok - hung:4} {hung:4}  {statistics.median(t for _, t in r):6.1f}")
' | tee -a "$log"
  uptime | tee -a "$log"
  ;;
*)
  echo "usage: stress-suites.sh pack DIR SUITE... | run DIR [SECONDS]" >&2
  exit 2
  ;;
esac
