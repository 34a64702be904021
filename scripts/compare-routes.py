#!/usr/bin/env python3
"""Compares two router traces (DRAMATIS_TRACE_ROUTES=PATH writes PATH.<backend>), call by call.

Usage: scripts/compare-routes.py PATH.cpu PATH.cuda

For every routed call and row, the top-k expert sets of the two backends; where they differ, the
gap between the k-th and (k+1)-th router logits on each side (a routing flip on a near-tie has a
tiny gap on both). Also the smallest gap seen anywhere, to say how near the ties run."""
import json
import sys


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    a, b = load(sys.argv[1]), load(sys.argv[2])
    if len(a) != len(b):
        print(f"calls differ in number: {len(a)} vs {len(b)}; comparing the first {min(len(a), len(b))}")
    flips, rows, min_gap = [], 0, None
    for ca, cb in zip(a, b):
        k = ca["k"]
        if len(ca["top"]) != len(cb["top"]):
            print(f"call {ca['call']}: {len(ca['top'])} rows vs {len(cb['top'])}")
            continue
        for r, (ta, tb) in enumerate(zip(ca["top"], cb["top"])):
            rows += 1
            for g in (ca["gap"][r], cb["gap"][r]):
                if g is not None and (min_gap is None or g < min_gap):
                    min_gap = g
            if set(ta[:k]) != set(tb[:k]):
                flips.append((ca["call"], r, ca["gap"][r], cb["gap"][r], ta, tb))
    print(f"{len(a)} calls, {rows} rows compared; {len(flips)} rows route differently; smallest k-th/(k+1)-th gap {min_gap}")
    for call, r, ga, gb, ta, tb in flips[:20]:
        print(f"  call {call} row {r}: gaps {ga} / {gb}; top {ta} vs {tb}")


if __name__ == "__main__":
    main()
