#!/usr/bin/env python3
"""Per-GEMM time ratios of two sides of a same-call A/B of `moe-engine bench gemm --json-out`.

  suite_ab_compare.py DIR PREFIX A B [GEMM_FILTER]

reads DIR/PREFIX-{A,B}-r{1,2,...}.json (the rounds a device call wrote, alternating the sides),
averages each GEMM's time over the rounds and prints B / A per GEMM kind (geomean, min, max) and
over all; with GEMM_FILTER (e.g. wgrad) also every matching GEMM's times and TFLOP/s."""
import collections
import glob
import json
import math
import os
import sys


def rounds(d, prefix, side):
    files = sorted(glob.glob(os.path.join(d, f"{prefix}-{side}-r*.json")))
    if not files:
        sys.exit(f"no {prefix}-{side}-r*.json in {d}")
    return [{(e["case"], e["fc"], e["gemm"]): e for e in json.load(open(f))["entries"]} for f in files]


def geomean(xs):
    return math.exp(sum(map(math.log, xs)) / len(xs))


def main():
    d, prefix, a, b = sys.argv[1:5]
    only = sys.argv[5] if len(sys.argv) > 5 else None
    A, B = rounds(d, prefix, a), rounds(d, prefix, b)
    by_kind, rows = collections.defaultdict(list), []
    for k in A[0]:
        ta = sum(r[k]["ms"] for r in A) / len(A)
        tb = sum(r[k]["ms"] for r in B) / len(B)
        by_kind[k[1] + "/" + k[2]].append(tb / ta)
        rows.append((k, ta, tb, A[0][k].get("tflops", 0.0), B[0][k].get("tflops", 0.0)))
    for kind, v in sorted(by_kind.items()):
        print(f"{kind:16s} {b}/{a} geomean {geomean(v):.3f} min {min(v):.3f} max {max(v):.3f}")
    print(f"all {b}/{a} geomean {geomean([r[2] / r[1] for r in rows]):.3f}")
    for k, ta, tb, fa, fb in rows:
        if only and only in k[2]:
            print(f"{k[0]:36s} {k[1]} {k[2]:10s} {ta:.3f} -> {tb:.3f} ms ({tb / ta:.3f}), {fa:.0f} -> {fb:.0f} TFLOP/s")


main()
