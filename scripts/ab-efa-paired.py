#!/usr/bin/env python3
"""Summarizes the rotated efa A/B scripts' output (lines `rRUN | VARIANT [API] | row;row;...`,
as scripts/ab-efa-inline.sh, ab-efa-yield.sh and ab-efa-tsend.sh print them): per provider,
row and variant, the median p50, the median ratio to the same run's raw ping-pong with its
quartiles, and the ratio's difference to BASE's in the same run (mean, twice its standard
error, and in how many runs it was lower).
Run: python3 scripts/ab-efa-paired.py OUTPUT BASE (BASE as the lines name it, e.g. "base" or
"base handler")."""
import collections
import re
import statistics as st
import sys

path, base = sys.argv[1], sys.argv[2]
rows = collections.defaultdict(lambda: collections.defaultdict(dict))
for line in open(path):
    if not line.startswith("r"):
        continue
    run, variant, rest = (s.strip() for s in line.split("|", 2))
    for m in re.finditer(r"(tcp;ofi_rxm|shm) ([a-z ]+?) ([\d.]+) (µs|ms) ([\d.]+)", rest):
        provider, row, p50, _, ratio = m.groups()
        rows[(provider, row)][variant][run] = (float(p50), float(ratio))
for (provider, row), variants in rows.items():
    if row == "raw":
        medians = {v: st.median(p for p, _ in d.values()) for v, d in variants.items()}
        print(f"{provider} raw: median p50 " + ", ".join(f"{v} {m:.2f}" for v, m in medians.items()))
        continue
    print(f"{provider} {row}:")
    for v, d in variants.items():
        ratios = [r for _, r in d.values()]
        q = st.quantiles(ratios, n=4)
        line = (f"  {v:18s} n={len(ratios)} p50 {st.median(p for p, _ in d.values()):7.2f}"
                f" ratio {st.median(ratios):.3f} [{q[0]:.3f}-{q[2]:.3f}]")
        if v != base and base in variants:
            diffs = [d[r][1] - variants[base][r][1] for r in d if r in variants[base]]
            se = st.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else 0.0
            lower = sum(x < 0 for x in diffs)
            line += f"  vs {base}: {st.mean(diffs):+.3f} ±{2 * se:.3f}, lower in {lower}/{len(diffs)}"
        print(line)
