"""Reads the one-line-per-run output of the A/B scripts (`rRUN | VARIANT WHAT | rows;...`)."""

import re


def runs(path):
    """The variants in the order met, and each line's (variant, what, rows) in file order."""
    variants, out = [], []
    for line in open(path):
        if not re.match(r"r\d+ \|", line):
            continue
        _, vp, rows = (s.strip() for s in line.split("|", 2))
        v, _, what = vp.partition(" ")
        if v not in variants:
            variants.append(v)
        out.append((v, what, rows))
    return variants, out
