#!/usr/bin/env bash
# A/B of two builds of `actorpipe` on the rows of docs/performance.md: each command runs REPS
# times per build, alternating the old and the new binary (old first on odd repetitions, new
# first on even ones), so that a slow spell of a shared machine weighs on both. At the end it
# prints a Markdown table of the medians: per row, size and figure, the old and the new
# build's median over the repetitions, new/old, and each side's min–max.
# Run it on an idle machine (it prints the load before each command):
#
#   bash scripts/bench-ab.sh OLD_BINARY NEW_BINARY | tee ab.md
#
# Build the old binary from a checkout of the older commit (`git archive COMMIT | tar -x -C DIR`,
# then `cargo build --release -p actorpipe-tools --bin actorpipe` there; before the tools crate
# existed, `cargo build --release --bin actorpipe`), with the same features as the new one
# (`--features efa,cuda` for the efa and CUDA rows).
#
# ROWS picks the commands, a comma-separated list of tags; a command runs if it has any of them:
#   default  the transport, channel and pipe families at 64 B, 4 KiB, 1 MiB, 64 MiB (the default)
#   small    the same at 64 B and 4 KiB only, which take seconds (SMALL=1 is ROWS=small)
#   16c      every CPU row docs/performance.md measured on the 16-core machines
#   2c       every row it measured on the 2-core VM (run those under `taskset -c 0,1` elsewhere)
#   gpu      the CUDA rows of one GPU (feature cuda; H100, H200)
#   gpu2     the CUDA rows across two GPUs (`--device 0,1`; 2×H200)
#   ibv      the ibv-sim and cuda_gdr rows (feature ibv; cuda_gdr also cuda and a GPU)
#   transport, layers, channel, mpt, pipe, idle, copy, efa, cuda: one family, on every machine
#   all      16c,2c,gpu;   cpu: 16c,2c
# Counts (--iters, --rounds) are cut from the doc's so that ROWS=16c,gpu with REPS=2 takes
# about 4–5 minutes on 16c; the rows' commands are listed below (`LIST=1` prints the selection).
#
# Other settings: REPS=6 alternates each command six times instead of twice (rows tagged `once`,
# slow and steady, run once per build); FIRST=new starts with the new build (rotate it from run
# to run); TIMEOUT=SECS bounds each command (default 300); DEADLINE=EPOCH_SECONDS skips what
# would start or run past it; VERBOSE=1 prints each command's whole output instead of its
# tables; ONLY=NAME,NAME runs those rows whatever their tags. An `ACTORPIPE_*` variable in the environment reaches only builds that read them: unset
# them for a fair comparison (the script warns).
#
# Besides the bench's own lines, each run prints one tab-separated line per figure, for
# scripts: `@ BUILD REP NAME ROW SIZE FIGURE VALUE UNIT` (times in µs, unit `us`; ratios `x`).
set -euo pipefail
old=${1:?usage: bench-ab.sh OLD_BINARY NEW_BINARY}
new=${2:?usage: bench-ab.sh OLD_BINARY NEW_BINARY}
reps=${REPS:-2}
rows=${ROWS:-default}
[ "${SMALL:-0}" = 1 ] && rows=small
limit=${TIMEOUT:-300}
deadline=${DEADLINE:-0}
first=${FIRST:-old}

# NAME TAGS | COMMAND: the command's words as bash reads them (quote a word with spaces); a
# leading NAME=VALUE word sets an environment variable for it.
table=$(cat <<'EOF'
tcp         default | transport --backend tcp --sizes 64,4K,1M,64M
shm         default | transport --backend shm --sizes 64,4K,1M,64M
shm-spin    default small | transport --backend shm --spin 20 --sizes 64,4K
basic       default | channel --backend basic --sizes 64,4K,1M,64M
mpt         default | channel --backend mpt --sizes 64,4K,1M,64M
pipe        default | pipe --sizes 64,4K,1M,64M
tcp-s       small | transport --backend tcp --sizes 64,4K
shm-s       small | transport --backend shm --sizes 64,4K
basic-s     small | channel --backend basic --sizes 64,4K
pipe-s      small | pipe --sizes 64,4K

tr-shm-spin-handler  16c 2c transport | transport --backend shm --spin 20 --sizes 64 --rounds 3 --iters 5000 --api handler
tr-shm-handler       16c 2c transport | transport --backend shm --sizes 64 --rounds 5 --iters 5000 --api handler
tr-tcp-handler       16c 2c transport | transport --backend tcp --sizes 64 --rounds 5 --iters 5000 --api handler
tr-shm-standing      16c transport | transport --backend shm --sizes 64 --rounds 5 --iters 5000 --api standing
tr-shm-spin-standing 16c transport | transport --backend shm --spin 20 --sizes 64 --rounds 5 --iters 5000 --api standing
tr-tcp-standing      16c transport | transport --backend tcp --sizes 64 --rounds 5 --iters 5000 --api standing
tr-shm-large         16c 2c transport | transport --backend shm --sizes 1M,64M --rounds 5
tr-tcp-large         2c transport | transport --backend tcp --sizes 1M,64M --rounds 4

ly-shm-spin          16c 2c layers | layers --spin 20 --iters 5000 --rounds 3
ly-tcp               16c layers | layers --transport tcp --iters 2000 --warmup 200 --rounds 3
ly-efa-shm           16c layers efa | layers --transport efa --provider shm --spin 50 --iters 5000 --rounds 3 --layers halves
ly-efa-tcp           16c layers efa | layers --transport efa --provider 'tcp;ofi_rxm' --spin 50 --iters 2000 --warmup 200 --rounds 3 --layers halves

ch-basic-tcp-handler 16c channel | channel --backend basic --transport tcp --sizes 64 --rounds 5 --iters 5000 --api handler
ch-basic-shm-spin    16c channel | channel --backend basic --transport shm --sizes 64 --spin 20 --api handler --rounds 3 --iters 20000
ch-basic-large       2c channel | channel --backend basic --sizes 1M,64M --rounds 4
ch-xth-large         16c channel | channel --backend xth --sizes 1M,64M --rounds 5
ch-xth-64            2c channel | channel --backend xth --sizes 64 --api receive --rounds 5 --iters 5000
ch-cma-tcp           16c channel | channel --backend cma --transport tcp --sizes 1M,2M,4M,8M,16M,64M --rounds 3
ch-cma-shm-large     16c channel | channel --backend cma --sizes 64M,256M --rounds 2 --iters 8
ch-cma-64            2c channel | channel --backend cma --sizes 64 --api receive --rounds 5 --iters 5000

mpt-lanes-64M        16c mpt | channel --backend mpt --lanes 2,4,8 --sizes 64M --rounds 3 --iters 12
mpt-2-small          16c mpt | channel --backend mpt --lanes 2 --sizes 64,4K,64K,128K,256K,512K,1M --rounds 3 --iters 1000
mpt-2c-small         2c mpt | channel --backend mpt --sizes 64,4K,256K,1M --rounds 3 --iters 1000
mpt-2c-64M           2c mpt | channel --backend mpt --sizes 64M --rounds 3 --iters 12

pp-handler           16c pipe | pipe --sizes 64 --rounds 5 --api handler --iters 5000
pp-spin-handler      16c pipe | pipe --sizes 64 --rounds 5 --api handler --spin 20 --iters 5000
pp-large             16c 2c pipe | pipe --sizes 1M,64M --rounds 5
pp-cma               16c pipe | pipe --sizes 128M,256M --rounds 2 --iters 8

idle                 2c idle once | idle --pipes 300 --hold 1
copy                 16c copy | copy --sizes 1M,16M,64M --threads 1,2,4,8 --iters 10

cu-xth-4K            gpu cuda | channel --backend cuda_xth --sizes 4K --iters 300 --rounds 3
cu-xth-1G            gpu cuda | channel --backend cuda_xth --sizes 1G --iters 20 --rounds 3 --transport shm --spin 20
cu-ipc-4K            gpu cuda | channel --backend cuda_ipc --sizes 4K --iters 300 --rounds 3
cu-ipc-64M-spin      gpu cuda | channel --backend cuda_ipc --sizes 4K,64M --iters 100 --rounds 3 --transport shm --spin 20
cu-ipc-1G-spin       gpu cuda | channel --backend cuda_ipc --sizes 256M,1G --iters 20 --rounds 3 --transport shm --spin 20
cu-ipc-1G            gpu cuda | channel --backend cuda_ipc --sizes 1G --iters 20 --rounds 2 --transport shm
cu-basic-tcp         gpu cuda | channel --backend cuda_basic --sizes 256M --iters 2 --warmup 1 --rounds 2
cu-basic-shm         gpu cuda | channel --backend cuda_basic --transport shm --sizes 64M,256M --iters 4 --warmup 1 --rounds 2

efa-64-handler       16c efa | efa --sizes 64 --iters 2000 --rounds 3 --spin 50 --api handler --rows 'raw,transport,transport spin,channel spin'
efa-64-standing      16c efa | efa --sizes 64 --iters 2000 --rounds 3 --spin 50 --api standing --rows 'raw,transport spin,channel spin'
efa-64-no-wait-fd    16c efa | efa --providers 'tcp;ofi_rxm' --sizes 64 --iters 2000 --rounds 3 --spin 50 --api handler --no-wait-fd --rows 'raw,transport spin'
efa-64-passthru      16c efa | FI_OFI_RXM_ENABLE_PASSTHRU=1 efa --providers 'tcp;ofi_rxm' --sizes 64 --iters 2000 --rounds 3 --spin 50 --api handler --rows 'raw,transport spin,channel spin'
efa-shm-in-place     16c efa | efa --providers shm --sizes 4K,16K,64K,256K --iters 1000 --rounds 3 --spin 50 --api handler --rows 'raw,in-place spin,in-place'
efa-in-place-small   16c efa | efa --sizes 64,4K,16K,64K --iters 1000 --rounds 2 --spin 50 --api handler --rows 'raw,channel spin,in-place spin'
efa-receive-mid      16c efa | efa --sizes 16K,64K,256K --iters 1000 --rounds 1 --spin 50 --api receive --rows 'raw,transport,channel,channel spin'
efa-receive-large    16c efa | efa --sizes 1M,4M,16M --iters 20 --rounds 1 --spin 50 --api receive --rows 'raw,transport,channel,channel spin'
efa-64M              16c efa | efa --sizes 64M --iters 4 --rounds 2 --rows 'raw,transport,channel,striped'
efa-idle             16c efa once | efa --idle 1
efa-2c               2c efa | efa --sizes 64 --iters 2000 --rounds 3 --spin 50 --api handler --rows 'raw,transport spin'

cu2-xth              gpu2 | channel --backend cuda_xth --device 0,1 --sizes 4K,64M,1G --iters 50 --rounds 2
cu2-xth-one          gpu2 | channel --backend cuda_xth --device 0 --sizes 1G --iters 20 --rounds 2
cu2-ipc              gpu2 | channel --backend cuda_ipc --device 0,1 --sizes 4K,64M,1G --iters 50 --rounds 2
cu2-ipc-one          gpu2 | channel --backend cuda_ipc --device 0 --sizes 4K,1G --iters 50 --rounds 2
cu2-basic            gpu2 | channel --backend cuda_basic --device 0,1 --sizes 64M,256M --iters 4 --warmup 1 --rounds 2

ibv-channel          ibv | channel --backend ibv-sim --sizes 64,4K,1M,64M --iters 30 --rounds 3
ibv-transport        ibv | transport --backend ibv-sim --sizes 64,4K,1M,64M --iters 30 --rounds 3
cu-gdr               ibv | channel --backend cuda_gdr --sizes 4K,64M,1G --iters 20 --rounds 2
EOF
)

# Whether a line's tags meet ROWS.
wanted() {
    local tag want
    for want in ${rows//,/ }; do
        case $want in
        all) want='16c 2c gpu' ;;
        cpu) want='16c 2c' ;;
        esac
        for w in $want; do
            for tag in $1; do [ "$tag" = "$w" ] && return 0; done
        done
    done
    return 1
}

# The bench's lines into `@` lines: one per figure of each table row (see the top).
normalize() {
    awk -v build="$1" -v rep="$2" -v name="$3" '
    function trim(s) { sub(/^[ \t]+/, "", s); sub(/[ \t]+$/, "", s); return s }
    # "25.3 µs", "54.922µs", "1.17×", "1.05x", "93 %", "0.18 % over 1 s", "31.4": VALUE UNIT
    function val(s, unit,   n, u) {
        s = trim(s)
        if (match(s, /^[0-9]+(\.[0-9]+)?/) == 0) return ""
        n = substr(s, 1, RLENGTH) + 0
        u = trim(substr(s, RLENGTH + 1))
        if (u ~ /^ns/) return (n / 1000) "\tus"
        if (u ~ /^(µs|us)/) return n "\tus"
        if (u ~ /^ms/) return (n * 1000) "\tus"
        if (u == "s") return (n * 1000000) "\tus"
        if (u ~ /^(×|x)/) return n "\tx"
        if (u ~ /^%/) return n "\t%"
        return n "\t" unit
    }
    function emit(row, size, figure, v) {
        if (v != "") printf "@\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", build, rep, name, row, size, figure, v
    }
    function words(a, b,   s, i) { s = $a; for (i = a + 1; i <= b; i++) s = s " " $i; return s }
    /^\| *:?-+/ {
        nh = split(prev, H, "|"); for (i = 1; i <= nh; i++) H[i] = trim(H[i])
        p50 = 0; for (i = 1; i <= nh; i++) if (H[i] ~ /p50/) p50 = 1
        intable = 1; efa = 0; idle = 0; prev = $0; next
    }
    /^\| / && intable {
        n = split($0, C, "|"); size = "-"; row = ""
        for (i = 2; i < n && i < nh; i++) {
            c = trim(C[i]); h = H[i]
            if (h == "size") size = c
            else if (h == "lanes") row = (c == "tcp+basic") ? c : c " lanes"
            else if (h == "threads") row = c " threads"
            else if (h == "layer" || h == "configuration") row = c
        }
        if (row == "") row = "-"
        for (i = 2; i < n && i < nh; i++) {
            c = trim(C[i]); h = H[i]; f = ""; u = ""
            if (h ~ /p50/ && h !~ /range/) {
                f = h; sub(/ \(median of rounds\)/, "", f)
                if (f == "mpt p50" || f == "pipe p50") f = "p50"
                if (f == "baseline p50") f = "raw p50"
            } else if (h == "ratio" || h == "mpt / raw") { f = "ratio"; u = "x" }
            else if (h == "x tcp+basic") { f = h; u = "x" }
            else if (h ~ / \/ / && h !~ /of which/) f = h
            else if (h ~ /GB\/s/ && !p50) { f = h; u = "GB/s" }
            else if (h ~ /KiB\/pipe/) { f = h; u = "KiB" }
            else if (h ~ /fds\/pipe|idle CPU/) f = h
            if (f != "") emit(row, size, f, val(c, u))
        }
        prev = $0; next
    }
    /^provider +size +row/ { efa = 1; intable = 0; prev = $0; next }
    /^provider +progress/ { idle = 1; intable = 0; prev = $0; next }
    efa && NF >= 8 && $3 ~ /^(B|KiB|MiB|GiB)$/ {
        row = $1 " " words(4, NF - 4)
        emit(row, $2 " " $3, "p50", val($(NF - 3) " " $(NF - 2), ""))
        if (words(4, NF - 4) != "raw") emit(row, $2 " " $3, "vs raw", val($(NF - 1), "x"))
    }
    idle && NF >= 3 && $NF ~ /%$/ { emit($1 " " words(2, NF - 1), "-", "idle CPU", val($NF, "%")) }
    !/^\|/ { intable = 0 }
    { prev = $0 }
    '
}

# The medians of the `@` lines in $1, as a Markdown table.
summary() {
    awk -F '\t' '
    function med(s,   a, n, i, j, t) {
        n = split(s, a, " ")
        for (i = 2; i <= n; i++) { t = a[i] + 0; for (j = i - 1; j >= 1 && a[j] + 0 > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
        lo = a[1]; hi = a[n]; cnt = n
        return (n % 2) ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
    }
    function show(v, u) {
        if (u == "us") {
            if (v < 1) return sprintf("%.0f ns", v * 1000)
            if (v < 1000) return sprintf("%.3g µs", v)
            if (v < 1000000) return sprintf("%.3g ms", v / 1000)
            return sprintf("%.3g s", v / 1000000)
        }
        if (u == "x") return sprintf(v >= 100 ? "%.0f×" : v >= 10 ? "%.1f×" : "%.3f×", v)
        if (u == "%") return sprintf("%.2f %%", v)
        if (u == "") return sprintf("%.4g", v)
        return sprintf("%.4g %s", v, u)
    }
    $1 == "@" {
        k = $4 "\t" $5 "\t" $6 "\t" $7
        if (!(k in unit)) { order[++nk] = k; unit[k] = $9 }
        v[k, $2] = v[k, $2] " " $8
    }
    END {
        print "| row | size | figure | old | new | new/old | old min–max | new min–max | runs |"
        print "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
        for (i = 1; i <= nk; i++) {
            k = order[i]; split(k, K, "\t"); u = unit[k]
            o = ""; n = ""; ratio = ""; os = ""; ns = ""; oc = 0; nc = 0
            if ((k, "old") in v) { o = med(v[k, "old"]); os = show(lo, u) "–" show(hi, u); oc = cnt }
            if ((k, "new") in v) { n = med(v[k, "new"]); ns = show(lo, u) "–" show(hi, u); nc = cnt }
            if (o != "" && n != "" && o + 0 != 0) ratio = sprintf("%.3f", n / o)
            row = K[1]; if (K[2] != "-") row = row " " K[2]
            printf "| %s | %s | %s | %s | %s | %s | %s | %s | %d/%d |\n", row, K[3], K[4],
                (o == "" ? "" : show(o, u)), (n == "" ? "" : show(n, u)), ratio, os, ns, oc, nc
        }
        print ""
        print "new/old: of times, lower is better; of GB/s and `x tcp+basic`, higher is better. runs: old/new."
    }' "$1"
}

# The command as one would type it: words with spaces or `;` in quotes.
shown() {
    local w out=()
    for w in "$@"; do
        if [[ $w =~ ^[A-Za-z0-9_.,:/=+-]+$ ]]; then out+=("$w"); else out+=("'$w'"); fi
    done
    echo "${out[*]}"
}

if env | grep -q '^ACTORPIPE_'; then
    echo "note: ACTORPIPE_* variables are set ($(env | grep -o '^ACTORPIPE_[A-Z0-9_]*' | tr '\n' ' ')); newer builds read them in bench, older ones may not"
fi
figures=$(mktemp)
trap 'rm -f "$figures" "$figures.out"' EXIT
while IFS= read -r line; do
    [ -z "${line// /}" ] && continue
    meta=${line%%|*}
    cmd=${line#*|}
    read -r name tags <<<"$meta"
    if [ -n "${ONLY:-}" ]; then
        [[ ",$ONLY," == *",$name,"* ]] || continue
    else
        wanted "$tags" || continue
    fi
    eval "words=($cmd)"
    vars=()
    while [[ ${words[0]} =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; do vars+=("${words[0]}"); words=("${words[@]:1}"); done
    if [ "${LIST:-0}" = 1 ]; then
        echo "$name: $(shown "${vars[@]}" bench "${words[@]}")"
        continue
    fi
    n=$reps
    [[ " $tags " == *" once "* ]] && n=1
    took=0
    for rep in $(seq "$n"); do
        now=$(date +%s)
        if [ "$deadline" -gt 0 ] && [ $((now + took)) -ge "$deadline" ]; then
            echo "== skip $name rep $rep: past the deadline"
            continue
        fi
        pair_start=$now
        order=("$old" "$new")
        names=(old new)
        if { [ "$first" = new ] && [ $((rep % 2)) = 1 ]; } || { [ "$first" != new ] && [ $((rep % 2)) = 0 ]; }; then
            order=("$new" "$old")
            names=(new old)
        fi
        hung=0
        for i in 0 1; do
            b=${order[$i]}
            t=$limit
            if [ "$deadline" -gt 0 ]; then
                left=$((deadline - $(date +%s)))
                [ "$left" -lt "$t" ] && t=$((left > 5 ? left : 5))
            fi
            echo "== ${names[$i]} $rep/$n $name | $(shown "${vars[@]}" bench "${words[@]}") | load $(cut -d' ' -f1 /proc/loadavg) | limit ${t}s"
            s=$(date +%s%N)
            rc=0
            timeout -k 5 "$t" env "${vars[@]}" "$b" bench "${words[@]}" >"$figures.out" 2>&1 || rc=$?
            e=$(date +%s%N)
            if [ "${VERBOSE:-0}" = 1 ]; then
                cat "$figures.out"
            else
                grep -E '^\| |^  (negotiated|machine|cores at)|^(tcp;ofi_rxm|shm|efa|provider) ' "$figures.out" || true
                [ "$rc" = 0 ] || tail -n 5 "$figures.out"
            fi
            normalize "${names[$i]}" "$rep" "$name" <"$figures.out" | tee -a "$figures"
            echo "== rc $rc | $(((e - s) / 1000000)) ms"
            case $rc in 124 | 137) hung=1 ;; esac
        done
        took=$(($(date +%s) - pair_start))
        if [ "$hung" = 1 ]; then
            echo "== skip $name: a run timed out"
            break
        fi
    done
done <<<"$table"
[ "${LIST:-0}" = 1 ] && exit 0
echo "== end | load $(cut -d' ' -f1 /proc/loadavg)"
echo
echo "== summary"
summary "$figures"
