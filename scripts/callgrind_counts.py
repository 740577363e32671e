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
