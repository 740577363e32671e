"""What callgrind counted, for scripts/count-instructions.sh and scripts/efa-callgrind.sh."""

import collections
import re
import subprocess


def functions(path):
    """(program total, Counter of exclusive instructions per function) of one callgrind output."""
    text = subprocess.run(
        ["callgrind_annotate", "--threshold=100", "--auto=no", "--inclusive=no", path],
        capture_output=True, text=True).stdout
    counts, total = collections.Counter(), 0
    for line in text.splitlines():
        m = re.match(r"\s*([\d,]+) \(\s*[\d.]+%\)\s+(.*)", line)
        if not m:
            continue
        v = int(m.group(1).replace(",", ""))
        if "PROGRAM TOTALS" in line:
            total = v
            continue
        name = re.sub(r" \[.*\]$", "", m.group(2))
        name = re.sub(r"^.*?:(?=[A-Za-z_<?])", "", name, count=1)
        counts[name] += v
    return total, counts


def command(path):
    """The command line callgrind recorded."""
    with open(path, errors="replace") as f:
        return next((line[5:].strip() for line in f if line.startswith("cmd:")), "?")


# The C allocator (every allocation ends there), and Rust's entry points into it (whose callers
# say who allocated).
ALLOCATORS = ("malloc", "calloc", "realloc")
RUST_ALLOCATORS = ("__rustc::__rust_alloc", "__rustc::__rust_alloc_zeroed",
                   "__rustc::__rust_realloc")


def allocator_calls(path):
    """Counter of calls into the allocator's entry points (`ALLOCATORS`, `RUST_ALLOCATORS`) by
    (callee, caller), read from the `calls=` lines of one callgrind output."""
    names, calls = {}, collections.Counter()
    caller = callee = None
    with open(path, errors="replace") as f:
        for line in f:
            m = re.match(r"(c?fn)=\((\d+)\)(?: (.*))?", line.strip())
            if m:
                kind, ident, name = m.groups()
                if name:
                    names[ident] = name
                if kind == "fn":
                    caller = names.get(ident, ident)
                else:
                    callee = names.get(ident, ident)
                continue
            if line.startswith("calls=") and callee is not None:
                if callee in ALLOCATORS or callee in RUST_ALLOCATORS:
                    calls[(callee, caller)] += int(line.split()[0][6:])
                callee = None
    return calls
