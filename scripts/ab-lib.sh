# Shared by the A/B scripts (sourced, not run): the header line and issue 12's efa row.

# Enters DIR (holding the `old` and `new` binaries; $1, from the script's own $1) and prints the
# machine line; $2 names the script for the usage line.
ab_start() {
  cd "${1:?usage: $2 DIR (holding the old and new actorpipe binaries)}" || exit 1
  set -u
  ab_header
}

# The machine line every A/B output starts with.
ab_header() {
  echo "# host $(hostname) cores $(nproc) $(date -u +%FT%TZ) load $(cut -d' ' -f1 /proc/loadavg)"
}

# Issue 12's efa rows with binary ./$1, run $2: the raw ping-pong and the pipe rows in spin mode,
# 64 B, a handler (`bench efa --sizes 64 --spin 50 --api handler`, both providers).
ab_efa_row() {
  echo "### $1 efa $2"
  ./$1 bench efa --sizes 64 --iters 2000 --rounds 3 --spin 50 --api handler \
    --rows "raw,transport spin,channel spin" 2>&1 | grep -E '64 B'
}

# A `bench efa` table's 64 B / 64 MiB rows on one line, `;`-separated: provider, row, p50, ratio
# to raw, GB/s.
ab_rows() {
  grep -E ' 64 (B|MiB) ' | awk '{s = $1; for (i = 4; i <= NF; i++) s = s " " $i; print s}' |
    tr '\n' ';'
}

# Per binary ./$1, run $2: the efa stream's halves alone (`bench layers --transport efa`, both
# providers), then `bench efa --sizes 64 --spin 50` with a handler in place (`--api handler`)
# and to a recipient actor (`--api standing`). One line per row set: `rRUN | VARIANT WHAT | ...`.
ab_efa_halves_and_apis() {
  local v=$1 r=$2 p api x
  for p in shm 'tcp;ofi_rxm'; do
    x=$(./$v bench layers --transport efa --provider "$p" --spin 50 --iters 5000 --rounds 3 \
      --layers halves | grep '^| halves' | awk -F'|' '{print $4}')
    echo "r$r | $v halves $p | $x"
  done
  for api in handler standing; do
    ab_efa_api "$v" "$r" $api
  done
}

# Per binary ./$1, run $2: `bench efa --sizes 64 --spin 50 --api $3` (both providers), the raw
# ping-pong and the pipe rows in spin mode, on one line: `rRUN | VARIANT API | row;row;...`.
ab_efa_api() {
  local x
  x=$(./$1 bench efa --sizes 64 --iters 3000 --rounds 3 --spin 50 --api "$3" \
    --rows "raw,transport spin,channel spin" 2>&1 | ab_rows)
  echo "r$2 | $1 $3 | $x"
}

# Runs `ONE VARIANT PROVIDER RUN` (a function of the caller's, printing one line) for each run
# (RUNS, default 3), each binary of VARIANTS (default DEFAULTS) and each PROVIDER, in that
# nesting, then prints the end line: `ab_each "DEFAULTS" ONE PROVIDER...`.
ab_each() {
  local defaults=$1 one=$2 r v p variants
  shift 2
  read -r -a variants <<<"${VARIANTS:-$defaults}"
  for r in $(seq 1 "${RUNS:-3}"); do
    for v in "${variants[@]}"; do
      for p in "$@"; do
        "$one" "$v" "$p" "$r"
      done
    done
  done
  echo "# end $(date -u +%FT%TZ)"
}
