#!/usr/bin/env python3
"""Where a module training step's GPU time goes: the kernels of step-bench.py's variants, per
micro-batch, from torch.profiler (CUDA activity), and the idle time between them.

For each case and variant (anchor, a, b, c as in step-bench.py): warm-up steps, then `--steps`
steps of `--micro-batches` micro-batches profiled back to back. Printed per variant: the span from
the first kernel's start to the last kernel's end, the sum of kernel times, the GPU's idle time
inside the span, the kernels grouped by name (count and microseconds per micro-batch) and the
largest idle gaps by the pair of kernels around them.

    python3 bench/experiments/step_profile.py --cases small-batch/balanced --variants anchor,b
"""
import argparse
import collections
import importlib.util
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
DRIVERS = os.path.join(HERE, "..", "drivers")
sys.path.insert(0, DRIVERS)
spec = importlib.util.spec_from_file_location("step_bench", os.path.join(DRIVERS, "step-bench.py"))
step_bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(step_bench)


def kernels_of(prof):
    """(name, start us, duration us) of every CUDA kernel / memset / memcpy the profiler saw."""
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out.append((e.name, e.time_range.start, e.time_range.end - e.time_range.start))
    return sorted(out, key=lambda k: k[1])


def profile_variant(variant, inputs, steps, micro_batches, warmup):
    # No synchronize between the warm-up and the profiled steps: the profiled kernels then queue
    # behind the warm-up's, as in a training loop, and the idle time counts only the GPU waiting
    # on the host inside the loop, not the host's start on an empty queue.
    for _ in range(warmup):
        variant.step(inputs, micro_batches)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            variant.step(inputs, micro_batches)
        torch.cuda.synchronize()
    ks = kernels_of(prof)
    n = steps * micro_batches
    span = (ks[-1][1] + ks[-1][2] - ks[0][1]) if ks else 0.0
    busy, end = 0.0, None
    for _, s, d in ks:  # union of intervals: overlapping kernels count once
        if end is None or s >= end:
            busy += d
            end = s + d
        elif s + d > end:
            busy += s + d - end
            end = s + d
    gaps = collections.defaultdict(lambda: [0, 0.0])  # (before, after) -> count, idle us
    for (a_name, a_start, a_dur), (b_name, b_start, _) in zip(ks, ks[1:]):
        idle = b_start - (a_start + a_dur)
        if idle > 0:
            key = (a_name[:60], b_name[:60])
            gaps[key][0] += 1
            gaps[key][1] += idle
    per = collections.defaultdict(lambda: [0, 0.0])
    for name, _, d in ks:
        per[name][0] += 1
        per[name][1] += d
    return span / n, busy / n, per, gaps, n


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=os.path.join(HERE, "..", "workloads.json"))
    ap.add_argument("--cases", default="small-batch/balanced", help="cases whose name contains one of these (comma-separated)")
    ap.add_argument("--variants", default="anchor,a,b", help="comma-separated subset of anchor,a,b,c")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--gaps", type=int, default=8, help="the largest idle gaps to list, by the kernels around them")
    a = ap.parse_args()
    import json
    with open(a.workloads) as f:
        cases = json.load(f)["cases"]
    wanted = [c for c in a.cases.split(",") if c]
    device = torch.device("cuda")
    for case in cases:
        if not any(w in case["name"] for w in wanted):
            continue
        layout = step_bench.glu_layout_of(case, "")
        for v in a.variants.split(","):
            if v == "anchor":
                variant = step_bench.build_anchor(case, layout, device, True)
            else:
                variant = step_bench.build_ours(v, case, layout, device)
            inputs = step_bench.make_inputs(case, device)
            span, busy, per, gaps, n = profile_variant(variant, inputs, a.steps, a.micro_batches, a.warmup)
            total = sum(d for _, d in per.values()) / n
            print(f"\n== {case['name']} {v} ({variant.name}): per micro-batch span {span:.1f} us, "
                  f"GPU busy {busy:.1f} us, idle {span - busy:.1f} us, kernel sum {total:.1f} us")
            rows = sorted(per.items(), key=lambda kv: -kv[1][1])[:a.top]
            for name, (count, d) in rows:
                print(f"  {d / n:9.1f} us  x{count / n:5.2f}  {name[:150]}")
            print("  largest idle gaps (us per micro-batch, between):")
            for (before, after), (count, idle) in sorted(gaps.items(), key=lambda kv: -kv[1][1])[:a.gaps]:
                print(f"  {idle / n:9.1f} us  x{count / n:5.2f}  {before} -> {after}")
            del variant, inputs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
