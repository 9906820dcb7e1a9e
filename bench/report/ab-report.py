#!/usr/bin/env python3
"""Report of scripts/gpu ab: per variant, the geomean speedup vs torch._grouped_mm (per-GEMM
medians over rounds, as gemm-report.py) and per GEMM its time relative to the baseline build.
Usage: bench/report/ab-report.py DIR   (DIR holds NAME-ROUND.json files; NAME 'base' is the baseline)"""
import collections
import glob
import math
import os
import statistics
import sys

import json

runs = collections.defaultdict(list)
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*-*.json"))):
    name = os.path.basename(path).rsplit("-", 1)[0]
    if name != "anchor":
        runs[name].append(json.load(open(path)))
names = ["base"] + sorted(n for n in runs if n != "base")
first = runs["base"][0]["entries"]
keys = [(e["case"], e["fc"], e["gemm"]) for e in first]


def median_ms(name, i, key="ms"):
    return statistics.median(r["entries"][i][key] for r in runs[name] if key in r["entries"][i])


def geomean(values):
    values = list(values)
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


print(f"rounds: " + ", ".join(f"{n} {len(runs[n])}" for n in names))
print("\n| variant | geomean vs torch | min vs torch | geomean time vs base | by model (time vs base) |")
print("|---|---:|---:|---:|---|")
for n in names:
    speed = [median_ms(n, i, "torch_grouped_mm_ms") / median_ms(n, i) for i, e in enumerate(first) if e["in_geomean"]]
    rel = [median_ms(n, i) / median_ms("base", i) for i, e in enumerate(first) if e["in_geomean"]]
    models = collections.defaultdict(list)
    for i, e in enumerate(first):
        if e["in_geomean"]:
            models[e["case"].split("/")[0]].append(median_ms(n, i) / median_ms("base", i))
    by_model = ", ".join(f"{m} {geomean(v):.3f}" for m, v in models.items())
    print(f"| {n} | {geomean(speed):.4f} | {min(speed):.3f} | {geomean(rel):.4f} | {by_model} |")
print("\n| case | fc | GEMM | base ms | " + " | ".join(f"{n} / base" for n in names[1:]) + " | torch ms |")
print("|---|---|---|---:|" + "---:|" * (len(names) - 1) + "---:|")
for i, (case, fc, gemm) in enumerate(keys):
    base = median_ms("base", i)
    cols = " | ".join(f"{median_ms(n, i) / base:.3f}" for n in names[1:])
    torch = median_ms("base", i, "torch_grouped_mm_ms") if "torch_grouped_mm_ms" in first[i] else float("nan")
    print(f"| {case} | {fc} | {gemm} | {base:.4f} | {cols} | {torch:.4f} |")
