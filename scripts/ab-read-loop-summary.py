#!/usr/bin/env python3
"""Summarizes scripts/ab-read-loop.sh's output: per row and variant, the median p50 and the
median ratio to the same run's raw baseline, with their ranges.
Run: python3 scripts/ab-read-loop-summary.py OUTPUT"""
import re
import statistics
import sys

def micros(text):
    v, unit = text.split()
    return float(v) * {"µs": 1.0, "ms": 1000.0, "ns": 0.001}[unit]

rows = {}
current = None
for line in open(sys.argv[1]):
    m = re.match(r"### (\S+) (\S+) (\d+)", line)
    if m:
        current = (m.group(2), m.group(1))
        continue
    if current and line.startswith("| 64 B"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        p50, ratio = micros(cells[2]), float(cells[7].rstrip("×"))
        rows.setdefault(current, []).append((p50, ratio))
        current = None
for (row, variant), vals in sorted(rows.items()):
    p = [v[0] for v in vals]
    r = [v[1] for v in vals]
    print(f"{row:13} {variant:8} n={len(vals)} p50 {statistics.median(p):7.2f} µs "
          f"[{min(p):.2f}-{max(p):.2f}]  ratio {statistics.median(r):.2f}x [{min(r):.2f}-{max(r):.2f}]")
