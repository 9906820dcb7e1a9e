#!/usr/bin/env python3
"""Report of the expert-MLP half of scripts/gpu ab: per case, the median over rounds of the fused
forward, backward and total times of the baseline build ("base") and this build ("new"), their
ratio new/base, and the geomean ratio over the suite (below 1: this build is faster).
Usage: bench/report/ab-mlp-report.py DIR   (DIR holds NAME-ROUND-CASE.json from `bench mlp --json`)"""
import collections
import glob
import math
import os
import statistics
import sys
import json

PHASES = ("forward", "backward", "total")


def main():
    times = collections.defaultdict(lambda: collections.defaultdict(list))  # (name, case) -> phase -> ms
    for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
        name = os.path.basename(path).split("-", 2)[0]
        try:
            r = json.load(open(path))
        except (OSError, ValueError):
            continue  # a run cut off mid-write
        case = r["case"]["name"]
        for ph in PHASES:
            times[(name, case)][ph].append(r["time_ms"][ph]["median"])
    cases = sorted({c for (n, c) in times if n == "base"} & {c for (n, c) in times if n == "new"})
    if not cases:
        print("no case with both a base and a new run")
        return
    print("| case | base total ms | new total ms | new/base forward | new/base backward | new/base total |")
    print("|---|---|---|---|---|---|")
    ratios = collections.defaultdict(list)
    for c in cases:
        row = []
        for ph in PHASES:
            b = statistics.median(times[("base", c)][ph])
            n = statistics.median(times[("new", c)][ph])
            ratios[ph].append(n / b)
            row.append(n / b)
        print(f"| {c} | {statistics.median(times[('base', c)]['total']):.3f} | "
              f"{statistics.median(times[('new', c)]['total']):.3f} | " + " | ".join(f"{x:.4f}" for x in row) + " |")
    geo = {ph: math.exp(sum(map(math.log, v)) / len(v)) for ph, v in ratios.items()}
    rounds = min(len(times[("new", c)]["total"]) for c in cases)
    print(f"\ngeomean new/base over {len(cases)} cases ({rounds} rounds): forward {geo['forward']:.4f}, "
          f"backward {geo['backward']:.4f}, total {geo['total']:.4f}")


if __name__ == "__main__":
    main()
